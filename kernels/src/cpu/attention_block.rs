//! Host kernels of [`crate::ops::attention_block`](mod@crate::ops::attention_block), on
//! host tensors. Each relies on the front door's `spec::attention_block` checks, called
//! once before it (and shared with the device launch); what it relies on is said above it.

use super::attention::{forward_sample, widen, ExpShifted, FwdScratch, Operands, SampleGrads};
use super::{acc_dtype, AccFloat, Float};
use crate::spec::attention::CausalAttentionOutput;
use crate::spec::attention_block::*;
use crate::{DType, Result, Tensor};
use num_traits::Float as _;

/// Host kernel of [`crate::ops::pack_kv`]: relies on `(rows, kv_heads)` being
/// `check_pack_kv`'s sizes of this float `qkv` with `g` query heads per KV head.
pub(crate) fn pack_kv(
    qkv: &Tensor,
    d: usize,
    g: usize,
    (rows, kv_heads): (usize, usize),
) -> Result<Tensor> {
    let cols = kv_heads * (g + 2) * d;
    let mut kv = Tensor::for_overwrite(&[rows, kv_heads * 2 * d], qkv.dtype());
    dispatch_float!(OP_PACK, qkv.dtype(), |T| {
        let src = qkv.as_slice::<T>()?;
        let dst = kv.as_mut_slice::<T>()?;
        for r in 0..rows {
            for h in 0..kv_heads {
                let s = r * cols + (h * (g + 2) + g) * d;
                let o = (r * kv_heads + h) * 2 * d;
                dst[o..o + 2 * d].copy_from_slice(&src[s..s + 2 * d]);
            }
        }
        Ok(())
    })?;
    Ok(kv)
}

/// Host kernel of [`crate::ops::attention_block`](fn@crate::ops::attention_block): relies on
/// `g` being `check_block`'s sizes of `qkv`, `kv` and `cfg`, and `first` its
/// `BlockAttention::first_keys` (`[batch·nq]`).
pub(crate) fn attention_block(
    qkv: &Tensor,
    kv: &Tensor,
    cfg: &BlockAttention,
    g: Dims,
    first: &[usize],
) -> Result<CausalAttentionOutput> {
    let acc = acc_dtype(qkv.dtype());
    let rows = g.batch * g.nq;
    let mut out = Tensor::zeros(&[rows, g.heads * g.d], acc);
    let mut lse = Tensor::zeros(&[rows, g.heads], acc).map(|_| f64::NEG_INFINITY);
    if !cfg.fully_masked(g.batch) {
        dispatch_float!(OP, qkv.dtype(), |T| {
            block_forward::<T>(
                out.as_mut_slice()?,
                lse.as_mut_slice()?,
                qkv.as_slice()?,
                kv.as_slice()?,
                &g,
                cfg,
                first,
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
    scale: A,
}

impl<A: AccFloat> Loaded<A> {
    fn new(g: &Dims) -> Self {
        Loaded {
            q: vec![A::ZERO; g.nq * g.d],
            k: vec![A::ZERO; g.nk * g.d],
            v: vec![A::ZERO; g.nk * g.d],
            scale: A::lit(g.scale),
        }
    }

    /// Query head `h` of sample `b`, scaled.
    fn load_q<T: Float<Acc = A>>(&mut self, qkv: &[T], g: &Dims, h: usize, b: usize) {
        let d = g.d;
        for i in 0..g.nq {
            let row = (b * g.nq + i) * g.qcols() + g.q_col(h);
            widen(
                &mut self.q[i * d..(i + 1) * d],
                &qkv[row..row + d],
                self.scale,
            );
        }
    }

    /// KV head `kh` of sample `b`, as it is.
    fn load_kv<T: Float<Acc = A>>(&mut self, kv: &[T], g: &Dims, kh: usize, b: usize) {
        let d = g.d;
        for j in 0..g.nk {
            let row = (b * g.nk + j) * g.kvcols() + kh * 2 * d;
            let at = j * d..(j + 1) * d;
            widen(&mut self.k[at.clone()], &kv[row..row + d], A::ONE);
            widen(&mut self.v[at], &kv[row + d..row + 2 * d], A::ONE);
        }
    }

    /// The loaded sample's operands, its queries seeing keys from `first` (`[nq]`) on.
    fn operands<'a>(
        &'a self,
        cfg: &'a BlockAttention,
        first: &'a [usize],
        d: usize,
    ) -> Operands<'a, A> {
        Operands {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            q_pos: cfg.q_pos,
            k_pos: cfg.k_pos,
            q_first: first,
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
    first: &[usize],
) {
    let (d, nh) = (g.d, g.heads);
    let mut x = Loaded::<T::Acc>::new(g);
    let mut w = FwdScratch::new(d, g.nq.max(g.nk));
    for (h, b) in block_order(g) {
        if h % g.g == 0 {
            x.load_kv(kv, g, h / g.g, b);
        }
        x.load_q(qkv, g, h, b);
        let first = &first[b * g.nq..(b + 1) * g.nq];
        forward_sample(&x.operands(cfg, first, d), &mut w, |i, acc, l, m| {
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

/// Host kernel of [`crate::ops::merge_attention`]: relies on `check_merge` (`[rows, H]` lse
/// and `[rows, H·d]` out, f32 or f64 alike), whose head count and out columns it takes.
pub(crate) fn merge_attention(
    acc: &mut CausalAttentionOutput,
    part: &CausalAttentionOutput,
    heads: usize,
    ocols: usize,
) -> Result<()> {
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

/// Host kernel of [`crate::ops::attention_block_backward`]: relies on `g` being
/// `check_block_backward`'s sizes of these operands and `first` as [`attention_block`]'s.
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
    g: Dims,
    first: &[usize],
) -> Result<()> {
    if cfg.fully_masked(g.batch) {
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
            first,
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
    first: &[usize],
) {
    let (d, nh, nq, nk) = (g.d, g.heads, g.nq, g.nk);
    let mut x = Loaded::<T::Acc>::new(g);
    let mut grads = SampleGrads::new(nq, nk, d);
    for (h, b) in block_order(g) {
        if h % g.g == 0 {
            x.load_kv(kv, g, h / g.g, b);
        }
        x.load_q(qkv, g, h, b);
        let first = &first[b * nq..(b + 1) * nq];
        grads.compute(&x.operands(cfg, first, d), dout, out, lse, nh, h, b);
        let SampleGrads { dq, dk, dv, .. } = &grads;
        for i in 0..nq {
            let at = (b * nq + i) * nh * d + h * d;
            // q was scaled on loading: the chain rule scales dq by it too.
            add_scaled(&mut dq_out[at..at + d], &dq[i * d..(i + 1) * d], x.scale);
        }
        // A KV head's dK and dV add up over its query heads, in head order.
        for j in 0..nk {
            let at = (b * nk + j) * g.kvcols() + (h / g.g) * 2 * d;
            let row = j * d..(j + 1) * d;
            add_scaled(&mut dkv_out[at..at + d], &dk[row.clone()], T::Acc::ONE);
            add_scaled(&mut dkv_out[at + d..at + 2 * d], &dv[row], T::Acc::ONE);
        }
    }
}

/// The (query head, sample) pairs in the order the kernels visit them: per KV head and
/// sample, its query heads one after another (their K and V loaded once).
fn block_order(g: &Dims) -> impl Iterator<Item = (usize, usize)> + '_ {
    (0..g.kv_heads)
        .flat_map(move |j| (0..g.batch).flat_map(move |b| (0..g.g).map(move |i| (j * g.g + i, b))))
}

/// `dst += mul · src`, in the compute type (a block's gradient added into a caller's
/// accumulator).
fn add_scaled<A: AccFloat>(dst: &mut [A], src: &[A], mul: A) {
    for (o, &v) in dst.iter_mut().zip(src) {
        *o += v * mul;
    }
}

/// Host kernel of [`crate::ops::fuse_qkv_grad`]: relies on `(rows, kv_heads)` being
/// `check_fuse_qkv_grad`'s sizes of `dq` and `dkv` (which keeps `K·(g+2)·d` within a
/// `usize`); a `dtype` that is not float is an `Err` here.
pub(crate) fn fuse_qkv_grad(
    dq: &Tensor,
    dkv: &Tensor,
    d: usize,
    g: usize,
    dtype: DType,
    (rows, kv_heads): (usize, usize),
) -> Result<Tensor> {
    let mut dqkv = Tensor::for_overwrite(&[rows, kv_heads * (g + 2) * d], dtype);
    dispatch_float!(OP_FUSE, dtype, |T| {
        let (q, kv) = (
            dq.as_slice::<<T as Float>::Acc>()?,
            dkv.as_slice::<<T as Float>::Acc>()?,
        );
        let dst = dqkv.as_mut_slice::<T>()?;
        let (gq, gc) = (g * d, (g + 2) * d);
        for r in 0..rows {
            for j in 0..kv_heads {
                let rj = r * kv_heads + j;
                let o = rj * gc;
                let (qs, ks) = (rj * gq, rj * 2 * d);
                for (x, &v) in dst[o..o + gq].iter_mut().zip(&q[qs..qs + gq]) {
                    *x = T::from_acc(v);
                }
                for (x, &v) in dst[o + gq..o + gc].iter_mut().zip(&kv[ks..ks + 2 * d]) {
                    *x = T::from_acc(v);
                }
            }
        }
        Ok(())
    })?;
    Ok(dqkv)
}

/// Host kernel of [`crate::ops::gather_rows`]: relies on `check_gather_rows` (`t` 2-D of
/// `cols` columns, every index of `src` a row of it).
pub(crate) fn gather_rows(t: &Tensor, src: &[usize], cols: usize) -> Result<Tensor> {
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
