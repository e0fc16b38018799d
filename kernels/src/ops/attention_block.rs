//! Blockwise causal attention: the pieces context parallelism (ring attention) is built
//! from. One call attends a block of queries to a block of keys and values that may come
//! from another rank, with each side's true positions in the sample; partial results
//! merge by their log-sum-exp (the online softmax one level up); the backward gives one
//! (query block, key block) pair's share of the gradient from the *final* output and lse.
//!
//! Layouts (`H` heads of dim `d`; a block's rows are samples one after another, each of
//! `q_pos.len()` (queries) or `k_pos.len()` (keys) rows, the same positions for every
//! sample):
//!
//! | tensor | shape | dtype |
//! |---|---|---|
//! | `qkv` (queries are read from it) | `[samples·nq, H·3·d]`, fused as [`causal_attention`](super::causal_attention)'s | `T` |
//! | `kv` ([`pack_kv`]) | `[samples·nk, H·2·d]`, head `h`: k at `h·2d ..`, v at `h·2d + d ..` | `T` |
//! | partial `out`, `lse` ([`attention_block`]) | `[samples·nq, H·d]`, `[samples·nq, H]` | compute ([`acc_dtype`]) |
//! | `dq`, `dkv` accumulators ([`attention_block_backward`]) | as `out`, as `kv` | compute |
//!
//! RoPE rotates q by its row's position and k by its own; the mask keeps key `j` for query
//! `i` when `k_pos[j] ≤ q_pos[i]`. A query that sees no key of a block gets `out = 0` and
//! `lse = −∞` there, which [`merge_attention`] treats as "no contribution". Positions must
//! be strictly increasing within a sample (checked): then the keys a query sees in a key
//! tile are a prefix of it, as in the full kernel, and tiles wholly in a query tile's
//! future are skipped. The per-sample work is the full kernel's own code
//! ([`causal_attention`](super::causal_attention) is this with `q_pos = k_pos = 0..s`).
//!
//! Single-threaded; `f32`/`bf16`/`f16` compute in `f32`, `f64` in `f64`.

use super::attention::{forward_sample, ExpShifted, FwdScratch, Operands, SampleGrads};
use super::{acc_dtype, check_dst, same_dtype, AccFloat, Float, Layout};
use crate::spec::attention::Rope;
use crate::spec::attention_block::*;
use crate::{DType, Error, Result, Tensor};
use num_traits::Float as _;

const OP: &str = "ops::attention_block";
const OP_BACK: &str = "ops::attention_block_backward";
const OP_MERGE: &str = "ops::merge_attention";
const OP_PACK: &str = "ops::pack_kv";
const OP_FUSE: &str = "ops::fuse_qkv_grad";
const OP_ROWS: &str = "ops::gather_rows";

/// The k and v columns of a fused `[tokens, H·3·d]` QKV, packed as `[tokens, H·2·d]` (what
/// travels around a ring: two thirds of the fused tensor).
pub fn pack_kv(qkv: &Tensor, head_dim: usize) -> Result<Tensor> {
    dispatch!(OP_PACK, [qkv] => crate::cuda::ops::pack_kv(&qkv, head_dim));
    let d = head_dim;
    if qkv.rank() != 2 || d == 0 || qkv.shape()[1] % (3 * d) != 0 {
        return Err(Error::Invalid {
            op: OP_PACK,
            detail: format!(
                "qkv of shape {:?} is not [tokens, heads·3·{d}]",
                qkv.shape()
            ),
        });
    }
    let (rows, cols) = (qkv.shape()[0], qkv.shape()[1]);
    let heads = cols / (3 * d);
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

/// Attention of `qkv`'s queries (at `cfg.q_pos`) to `kv`'s keys and values (at
/// `cfg.k_pos`), sample by sample: the normalized partial output and its lse, in the
/// compute dtype (merge several with [`merge_attention`], round once at the end).
pub fn attention_block(
    qkv: &Tensor,
    kv: &Tensor,
    cfg: &BlockAttention,
) -> Result<super::CausalAttentionOutput> {
    dispatch!(OP, [qkv, kv] => crate::cuda::ops::attention_block(&qkv, &kv, cfg));
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
    Ok(super::CausalAttentionOutput { out, lse })
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

/// Merges a partial attention result into a running one, row and head at a time:
/// `lse = log(e^lse_a + e^lse_b)`, `out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b`
/// (a side with `lse = −∞` contributes nothing). Both in the compute dtype, shaped alike.
pub fn merge_attention(
    acc: &mut super::CausalAttentionOutput,
    part: &super::CausalAttentionOutput,
) -> Result<()> {
    if crate::dispatch::on_cuda(OP_MERGE, &[&acc.out, &acc.lse, &part.out, &part.lse])? {
        return merge_attention_cuda(acc, part);
    }
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

/// One (query block, key block) pair's share of the gradient: from the output gradient
/// `dout` and the *final* `out` and `lse` of the queries (every key block merged; `dout`,
/// `out` in `qkv`'s dtype, `lse` in the compute dtype), adds `∂/∂q` into `dq` (`[rows_q,
/// H·d]`) and `∂/∂k`, `∂/∂v` into `dkv` (`[rows_k, H·2·d]`, packed as `kv`), both in the
/// compute dtype and with respect to the inputs before RoPE. Summed over the key blocks,
/// `dq` and every block's `dkv` are the full attention's gradient.
#[allow(clippy::too_many_arguments)]
pub fn attention_block_backward(
    dout: &Tensor,
    qkv: &Tensor,
    kv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    cfg: &BlockAttention,
    dq: &mut Tensor,
    dkv: &mut Tensor,
) -> Result<()> {
    if crate::dispatch::on_cuda(OP_BACK, &[dout, qkv, kv, out, lse, &*dq, &*dkv])? {
        return attention_block_backward_cuda([dout, qkv, kv, out, lse], cfg, dq, dkv);
    }
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

/// The fused `[tokens, H·3·d]` gradient of a QKV from its parts: `dq` (`[tokens, H·d]`)
/// and `dkv` (`[tokens, H·2·d]`, packed as [`pack_kv`]), both in the compute dtype,
/// rounded once into `dtype`.
pub fn fuse_qkv_grad(dq: &Tensor, dkv: &Tensor, head_dim: usize, dtype: DType) -> Result<Tensor> {
    dispatch!(OP_FUSE, [dq, dkv] => crate::cuda::ops::fuse_qkv_grad(&dq, &dkv, head_dim, dtype));
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

/// Rows of a 2-D tensor picked by index: row `i` of the result is row `src[i]` of `t`
/// (any dtype, bit for bit). Context parallelism's token reorderings go through it.
pub fn gather_rows(t: &Tensor, src: &[usize]) -> Result<Tensor> {
    dispatch!(OP_ROWS, [t] => crate::cuda::ops::gather_rows(&t, src));
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

/// [`merge_attention`] on the device (every tensor there, as the caller checked): `acc`'s
/// tensors are moved out for the kernel and back, whatever it returns.
#[cfg(feature = "cuda")]
fn merge_attention_cuda(
    acc: &mut super::CausalAttentionOutput,
    part: &super::CausalAttentionOutput,
) -> Result<()> {
    use crate::cuda::ops::CudaAttentionOutput;
    let p = CudaAttentionOutput {
        out: part.out.cuda_tensor()?,
        lse: part.lse.cuda_tensor()?,
    };
    let mut a = CudaAttentionOutput {
        out: crate::dispatch::take_cuda(&mut acc.out),
        lse: crate::dispatch::take_cuda(&mut acc.lse),
    };
    let r = crate::cuda::ops::merge_attention(&mut a, &p);
    acc.out = a.out.into();
    acc.lse = a.lse.into();
    r
}

#[cfg(not(feature = "cuda"))]
fn merge_attention_cuda(
    _: &mut super::CausalAttentionOutput,
    _: &super::CausalAttentionOutput,
) -> Result<()> {
    unreachable!("no device tensor exists without the `cuda` feature")
}

/// [`attention_block_backward`] on the device (every tensor there, as the caller checked):
/// `[dout, qkv, kv, out, lse]`, both out-parameters moved out for the kernel.
#[cfg(feature = "cuda")]
fn attention_block_backward_cuda(
    ins: [&Tensor; 5],
    cfg: &BlockAttention,
    dq: &mut Tensor,
    dkv: &mut Tensor,
) -> Result<()> {
    let [dout, qkv, kv, out, lse] = ins.map(Tensor::cuda_tensor);
    let (dout, qkv, kv, out, lse) = (dout?, qkv?, kv?, out?, lse?);
    crate::dispatch::with_cuda_mut(dq, |dq| {
        crate::dispatch::with_cuda_mut(dkv, |dkv| {
            crate::cuda::ops::attention_block_backward(&dout, &qkv, &kv, &out, &lse, cfg, dq, dkv)
        })
    })
}

#[cfg(not(feature = "cuda"))]
fn attention_block_backward_cuda(
    _: [&Tensor; 5],
    _: &BlockAttention,
    _: &mut Tensor,
    _: &mut Tensor,
) -> Result<()> {
    unreachable!("no device tensor exists without the `cuda` feature")
}
