//! Host kernels of [`crate::ops::attention_block`](mod@crate::ops::attention_block), on host tensors. Each says
//! what it relies on and which check ensures it: the front door's, before the call, or the
//! kernel's own call of the `spec` check it shares with the device launch.

use super::attention::{forward_sample, ExpShifted, FwdScratch, Operands, SampleGrads};
use super::{acc_dtype, check_dst, same_dtype, AccFloat, Float};
use crate::spec::attention::{CausalAttentionOutput, Rope};
use crate::spec::attention_block::*;
use crate::{DType, Error, Result, Tensor};
use num_traits::Float as _;

/// Host kernel of [`crate::ops::pack_kv`] (the checks are the spec's, shared with the device).
pub(crate) fn pack_kv(qkv: &Tensor, head_dim: usize) -> Result<Tensor> {
    let d = head_dim;
    let (rows, heads) = check_pack_kv(OP_PACK, qkv, d)?;
    let cols = heads * 3 * d;
    let mut kv = Tensor::for_overwrite(&[rows, heads * 2 * d], qkv.dtype());
    dispatch_float!(OP_PACK, qkv.dtype(), |T| {
        let src = qkv.as_slice::<T>()?;
        let dst = kv.as_mut_slice::<T>()?;
        for r in 0..rows {
            for h in 0..heads {
                let s = r * cols + h * 3 * d + d;
                let o = (r * heads + h) * 2 * d;
                dst[o..o + 2 * d].copy_from_slice(&src[s..s + 2 * d]);
            }
        }
        Ok(())
    })?;
    Ok(kv)
}

/// Host kernel of [`crate::ops::attention_block`](fn@crate::ops::attention_block): checks `qkv`, `kv` and `cfg` itself
/// (`spec::attention_block::check_block`, shared with the device launch); relies on nothing
/// else.
pub(crate) fn attention_block(
    qkv: &Tensor,
    kv: &Tensor,
    cfg: &BlockAttention,
) -> Result<CausalAttentionOutput> {
    let g = check_block(OP, qkv, kv, cfg)?;
    let acc = acc_dtype(qkv.dtype());
    let rows = g.batch * g.nq;
    let mut out = Tensor::zeros(&[rows, g.heads * g.d], acc);
    let mut lse = Tensor::zeros(&[rows, g.heads], acc).map(|_| f64::NEG_INFINITY);
    if !cfg.fully_masked() {
        dispatch_float!(OP, qkv.dtype(), |T| {
            block_forward::<T>(
                out.as_mut_slice()?,
                lse.as_mut_slice()?,
                qkv.as_slice()?,
                kv.as_slice()?,
                &g,
                cfg,
            );
            Ok(())
        })?;
    }
    Ok(CausalAttentionOutput { out, lse })
}

/// One sample's operands of one head, loaded from a block's tensors.
struct Loaded<A> {
    q: Vec<A>,
    k: Vec<A>,
    v: Vec<A>,
    rq: Rope<A>,
    rk: Rope<A>,
    scale: A,
}

impl<A: AccFloat> Loaded<A> {
    fn new(g: &Dims, cfg: &BlockAttention) -> Self {
        Loaded {
            q: vec![A::ZERO; g.nq * g.d],
            k: vec![A::ZERO; g.nk * g.d],
            v: vec![A::ZERO; g.nk * g.d],
            rq: Rope::for_positions(cfg.q_pos.iter().copied(), g.d, cfg.rope_base),
            rk: Rope::for_positions(cfg.k_pos.iter().copied(), g.d, cfg.rope_base),
            scale: A::lit(1.0 / (g.d as f64).sqrt()),
        }
    }

    /// Head `h` of sample `b`: q rotated and scaled, k rotated, v as is.
    fn load<T: Float<Acc = A>>(&mut self, qkv: &[T], kv: &[T], g: &Dims, h: usize, b: usize) {
        let d = g.d;
        for i in 0..g.nq {
            let row = (b * g.nq + i) * g.qcols() + h * 3 * d;
            self.rq.rotate(
                &mut self.q[i * d..(i + 1) * d],
                &qkv[row..row + d],
                i,
                self.scale,
            );
        }
        for j in 0..g.nk {
            let row = (b * g.nk + j) * g.kvcols() + h * 2 * d;
            let at = j * d..(j + 1) * d;
            self.rk
                .rotate(&mut self.k[at.clone()], &kv[row..row + d], j, A::ONE);
            for (dst, x) in self.v[at].iter_mut().zip(&kv[row + d..row + 2 * d]) {
                *dst = x.to_acc();
            }
        }
    }

    fn operands<'a>(&'a self, cfg: &'a BlockAttention, d: usize) -> Operands<'a, A> {
        Operands {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            q_pos: cfg.q_pos,
            k_pos: cfg.k_pos,
            d,
        }
    }
}

fn block_forward<T: Float<Acc: ExpShifted>>(
    out: &mut [T::Acc],
    lse: &mut [T::Acc],
    qkv: &[T],
    kv: &[T],
    g: &Dims,
    cfg: &BlockAttention,
) {
    let (d, nh) = (g.d, g.heads);
    let mut x = Loaded::<T::Acc>::new(g, cfg);
    let mut w = FwdScratch::new(d, g.nq.max(g.nk));
    for h in 0..nh {
        for b in 0..g.batch {
            x.load(qkv, kv, g, h, b);
            forward_sample(&x.operands(cfg, d), &mut w, |i, acc, l, m| {
                let t = b * g.nq + i;
                let dst = &mut out[t * nh * d + h * d..][..d];
                if l > T::Acc::ZERO {
                    for (o, &a) in dst.iter_mut().zip(acc) {
                        *o = a / l;
                    }
                    lse[t * nh + h] = m + l.ln();
                } else {
                    dst.fill(T::Acc::ZERO);
                    lse[t * nh + h] = T::Acc::neg_infinity();
                }
            });
        }
    }
}

/// Host kernel of [`crate::ops::merge_attention`]: checks both sides itself
/// (`spec::attention_block::check_merge`: `[rows, H]` lse and `[rows, H·d]` out, f32 or f64
/// alike); relies on nothing else.
pub(crate) fn merge_attention(
    acc: &mut CausalAttentionOutput,
    part: &CausalAttentionOutput,
) -> Result<()> {
    let (_, heads, ocols) = check_merge(OP_MERGE, (&acc.out, &acc.lse), (&part.out, &part.lse))?;
    let dt = acc.lse.dtype();
    fn run<A: AccFloat>(oa: &mut [A], la: &mut [A], ob: &[A], lb: &[A], d: usize) {
        for (i, (la, &lb)) in la.iter_mut().zip(lb).enumerate() {
            let (a, b) = (&mut oa[i * d..(i + 1) * d], &ob[i * d..(i + 1) * d]);
            if lb == A::neg_infinity() {
                continue;
            }
            if *la == A::neg_infinity() {
                a.copy_from_slice(b);
                *la = lb;
                continue;
            }
            let m = la.max(lb);
            let l = m + ((*la - m).exp() + (lb - m).exp()).ln();
            let (wa, wb) = ((*la - l).exp(), (lb - l).exp());
            for (x, &y) in a.iter_mut().zip(b) {
                *x = wa * *x + wb * y;
            }
            *la = l;
        }
    }
    let d = ocols / heads;
    match dt {
        DType::F32 => run::<f32>(
            acc.out.as_mut_slice()?,
            acc.lse.as_mut_slice()?,
            part.out.as_slice()?,
            part.lse.as_slice()?,
            d,
        ),
        _ => run::<f64>(
            acc.out.as_mut_slice()?,
            acc.lse.as_mut_slice()?,
            part.out.as_slice()?,
            part.lse.as_slice()?,
            d,
        ),
    }
    Ok(())
}

/// Host kernel of [`crate::ops::attention_block_backward`]: checks every operand itself
/// (`spec::attention_block::check_block`, then `dout`, `out`, `lse`, `dq`, `dkv` against its
/// sizes); relies on nothing else.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_block_backward(
    dout: &Tensor,
    qkv: &Tensor,
    kv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    cfg: &BlockAttention,
    dq: &mut Tensor,
    dkv: &mut Tensor,
) -> Result<()> {
    let g = check_block(OP_BACK, qkv, kv, cfg)?;
    same_dtype(OP_BACK, dout, qkv)?;
    same_dtype(OP_BACK, out, qkv)?;
    let rq = g.batch * g.nq;
    let acc = acc_dtype(qkv.dtype());
    for t in [dout, out] {
        if t.shape() != [rq, g.heads * g.d] {
            return Err(Error::ShapeMismatch {
                op: OP_BACK,
                lhs: t.shape().into(),
                rhs: [rq, g.heads * g.d].as_slice().into(),
            });
        }
    }
    check_dst(OP_BACK, lse, &[rq, g.heads], acc)?;
    check_dst(OP_BACK, dq, &[rq, g.heads * g.d], acc)?;
    check_dst(OP_BACK, dkv, &[g.batch * g.nk, g.kvcols()], acc)?;
    if cfg.fully_masked() {
        return Ok(());
    }
    dispatch_float!(OP_BACK, qkv.dtype(), |T| {
        block_backward::<T>(
            dq.as_mut_slice()?,
            dkv.as_mut_slice()?,
            dout.as_slice()?,
            qkv.as_slice()?,
            kv.as_slice()?,
            out.as_slice()?,
            lse.as_slice()?,
            &g,
            cfg,
        );
        Ok(())
    })
}

#[allow(clippy::too_many_arguments)]
fn block_backward<T: Float<Acc: ExpShifted>>(
    dq_out: &mut [T::Acc],
    dkv_out: &mut [T::Acc],
    dout: &[T],
    qkv: &[T],
    kv: &[T],
    out: &[T],
    lse: &[T::Acc],
    g: &Dims,
    cfg: &BlockAttention,
) {
    let (d, nh, nq, nk) = (g.d, g.heads, g.nq, g.nk);
    let mut x = Loaded::<T::Acc>::new(g, cfg);
    let mut grads = SampleGrads::new(nq, nk, d);
    for h in 0..nh {
        for b in 0..g.batch {
            x.load(qkv, kv, g, h, b);
            grads.compute(&x.operands(cfg, d), dout, out, lse, nh, h, b);
            let SampleGrads { dq, dk, dv, .. } = &grads;
            for i in 0..nq {
                let at = (b * nq + i) * nh * d + h * d;
                // q was scaled by 1/√d after rotating: the chain rule scales dq by it too.
                x.rq.unrotate_add(&mut dq_out[at..at + d], &dq[i * d..(i + 1) * d], i, x.scale);
            }
            for j in 0..nk {
                let at = (b * nk + j) * g.kvcols() + h * 2 * d;
                x.rk.unrotate_add(
                    &mut dkv_out[at..at + d],
                    &dk[j * d..(j + 1) * d],
                    j,
                    T::Acc::ONE,
                );
                for (o, &v) in dkv_out[at + d..at + 2 * d]
                    .iter_mut()
                    .zip(&dv[j * d..(j + 1) * d])
                {
                    *o += v;
                }
            }
        }
    }
}

/// Host kernel of [`crate::ops::fuse_qkv_grad`]: checks `dq` and `dkv` itself
/// (`spec::attention_block::check_fuse_qkv_grad`, which also keeps `H·3·d` within a `usize`);
/// a `dtype` that is not float is an `Err` here.
pub(crate) fn fuse_qkv_grad(
    dq: &Tensor,
    dkv: &Tensor,
    head_dim: usize,
    dtype: DType,
) -> Result<Tensor> {
    let d = head_dim;
    let (rows, heads) = check_fuse_qkv_grad(OP_FUSE, dq, dkv, d, dtype)?;
    let mut dqkv = Tensor::for_overwrite(&[rows, heads * 3 * d], dtype);
    dispatch_float!(OP_FUSE, dtype, |T| {
        let (q, kv) = (
            dq.as_slice::<<T as Float>::Acc>()?,
            dkv.as_slice::<<T as Float>::Acc>()?,
        );
        let dst = dqkv.as_mut_slice::<T>()?;
        for r in 0..rows {
            for h in 0..heads {
                let o = (r * heads + h) * 3 * d;
                let (qs, ks) = ((r * heads + h) * d, (r * heads + h) * 2 * d);
                for (x, &v) in dst[o..o + d].iter_mut().zip(&q[qs..qs + d]) {
                    *x = T::from_acc(v);
                }
                for (x, &v) in dst[o + d..o + 3 * d].iter_mut().zip(&kv[ks..ks + 2 * d]) {
                    *x = T::from_acc(v);
                }
            }
        }
        Ok(())
    })?;
    Ok(dqkv)
}

/// Host kernel of [`crate::ops::gather_rows`]: checks itself that `t` is 2-D and every
/// index of `src` a row of it; relies on nothing else.
pub(crate) fn gather_rows(t: &Tensor, src: &[usize]) -> Result<Tensor> {
    let (rows, cols) = match t.shape() {
        &[r, c] => (r, c),
        s => {
            return Err(Error::Invalid {
                op: OP_ROWS,
                detail: format!("a 2-D tensor, got shape {s:?}"),
            })
        }
    };
    if let Some(&bad) = src.iter().find(|&&i| i >= rows) {
        return Err(Error::Invalid {
            op: OP_ROWS,
            detail: format!("row {bad} of a tensor of {rows} rows"),
        });
    }
    macro_rules! go {
        ($T:ty) => {{
            let s = t.as_slice::<$T>()?;
            let mut v: Vec<$T> = Vec::with_capacity(src.len() * cols);
            for &i in src {
                v.extend_from_slice(&s[i * cols..(i + 1) * cols]);
            }
            Tensor::from_vec(v, &[src.len(), cols])
        }};
    }
    match t.dtype() {
        DType::F32 => go!(f32),
        DType::F64 => go!(f64),
        DType::BF16 => go!(half::bf16),
        DType::F16 => go!(half::f16),
        DType::I32 => go!(i32),
        DType::I64 => go!(i64),
    }
}
