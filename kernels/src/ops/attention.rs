//! Fused causal self-attention, multi-head, grouped-query or multi-query, forward and
//! backward, computed flash-attention style: blocked over queries and keys with an online
//! softmax, so no `seq_len × seq_len` probability matrix is ever stored.
//!
//! Layout (`d` the head dim, any size; `s` the sequence length; `K` the KV heads, each
//! shared by `g` query heads ([`CausalAttention::q_per_kv`]), `H = K·g` the query heads):
//!
//! | tensor | shape | contents |
//! |---|---|---|
//! | `qkv` | `[tokens, K·(g+2)·d]` | KV group `j` at columns `j·(g+2)·d ..`: its `g` query heads (`d` columns each), then its k, then its v (Megatron's grouped layout; `g = 1` is the per-head `[q, k, v]` of multi-head attention) |
//! | `out` | `[tokens, H·d]` | query head `h = j·g + i` at columns `h·d ..` |
//! | `lse` | `[tokens, H]` | per (token, query head) `log Σ_j exp(score_j)`, compute dtype ([`acc_dtype`]) |
//!
//! `tokens` are whole samples of `s` tokens one after another; attention never crosses a
//! sample. q and k come in already rotated: position embeddings are the caller's, e.g.
//! [`rope`](fn@super::rope) on the q and k heads of the fused rows
//! ([`Rope::on_fused_qkv`](super::Rope::on_fused_qkv)), before this op. Per query head and
//! sample, with `k`, `v` its KV head's and `c` the score scale ([`CausalAttention::scale`],
//! `1/√d` by default):
//!
//! - `score_ij = c·q_i·k_j` for `j ≤ i` (causal), `P = softmax_j(score)`, `out_i = Σ_j P_ij v_j`.
//! - Backward from `dout`: `D_i = dout_i·out_i`, `dP_ij = dout_i·v_j`,
//!   `dS_ij = P_ij (dP_ij − D_i)`, `dq_i = c·Σ_j dS_ij k_j`, `dk_j = c·Σ_i dS_ij q_i`,
//!   `dv_j = Σ_i P_ij dout_i`, with `P` recomputed from the saved `lse`; a KV head's `dk`
//!   and `dv` are the sums over its `g` query heads.
//!
//! `f32`/`bf16`/`f16` compute in `f32` and `f64` in `f64`; every output element is rounded
//! once. Single-threaded (ranks are the parallelism); fixed summation order.
//!
//! The block products go through the `gemm` crate: at the `benches/attention.rs` shapes
//! (head dims 16 and 64, f32) forward+backward took ~2.9× (d 16) and ~3.3× (d 64) as long
//! with plain loops in their place (rows updated axpy-style, 8-lane dot products, libm's
//! exp in both runs; the loops vectorize for baseline x86-64, while gemm dispatches to
//! AVX2/AVX-512 + FMA at run time). The `s×s` work is skipped above the diagonal at block
//! granularity; inside a diagonal block the masked scores are computed and dropped, and
//! their probability 0 multiplies the future values: a non-finite v of a later token in the
//! same block turns earlier outputs NaN (`0·∞`), where a loop over `j ≤ i` would not look
//! at it.

use super::{acc_dtype, check_dst, same_dtype};
use crate::spec::attention::*;
use crate::{Error, Result, Tensor};

/// Causal self-attention on a grouped fused QKV (see the [module docs](self)).
///
/// ```
/// use dtensor_kernels::ops::{causal_attention, CausalAttention};
/// use dtensor_kernels::Tensor;
/// // 2 samples of 4 tokens; 2 KV heads, each shared by 2 query heads of dim 3.
/// let cfg = CausalAttention::new(4, 3).grouped(2);
/// let qkv = Tensor::from_fn(&[8, 2 * (2 + 2) * 3], |i| (i % 7) as f32 * 0.1);
/// let r = causal_attention(&qkv, &cfg).unwrap();
/// assert_eq!(r.out.shape(), &[8, 4 * 3]);
/// assert_eq!(r.lse.shape(), &[8, 4]);
/// ```
pub fn causal_attention(qkv: &Tensor, cfg: &CausalAttention) -> Result<CausalAttentionOutput> {
    let g = check_qkv(OP, qkv, cfg)?;
    dispatch!(OP, [qkv] => device::causal_attention(&qkv, &g));
    crate::cpu::attention::causal_attention(qkv, g)
}

/// The gradient of [`causal_attention`] with respect to `qkv`, in `qkv`'s fused layout, from
/// the output gradient `dout`, the forward's input `qkv`, and its outputs `out` and `lse`.
pub fn causal_attention_backward(
    dout: &Tensor,
    qkv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    cfg: &CausalAttention,
) -> Result<Tensor> {
    let g = check_qkv(OP_BACK, qkv, cfg)?;
    same_dtype(OP_BACK, dout, qkv)?;
    same_dtype(OP_BACK, out, qkv)?;
    let out_shape = [g.tokens, g.heads * g.d];
    for t in [dout, out] {
        if t.shape() != out_shape {
            return Err(Error::ShapeMismatch {
                op: OP_BACK,
                lhs: t.shape().into(),
                rhs: out_shape.as_slice().into(),
            });
        }
    }
    check_dst(OP_BACK, lse, &[g.tokens, g.heads], acc_dtype(qkv.dtype()))?;
    dispatch!(OP_BACK, [dout, qkv, out, lse] =>
        device::causal_attention_backward(&dout, &qkv, &out, &lse, &g));
    crate::cpu::attention::causal_attention_backward(dout, qkv, out, lse, g)
}

/// The device launches (`cuda/kernels/attention.cu`): q, k and v loaded once into the
/// compute type (q scaled), then one block per (head, sample, query row), the
/// keys' scores in shared memory, which bounds `seq_len` (an [`Error::NotOnCuda`] above it).
#[cfg(feature = "cuda")]
pub(crate) mod device {
    use crate::cuda::launch::{func, grid_for, launch_kernel, per_row, Acc, SHARED_BUDGET};
    use crate::cuda::{source, CudaTensor};
    use crate::spec::acc_dtype;
    use crate::spec::attention::*;
    use crate::{Error, Result, Tensor};

    /// `Err` unless the backward's dk/dv kernel, which keeps two values per query of the
    /// sample, fits `seq_len` in shared memory (the forward needs half of that).
    fn fits(op: &'static str, qkv: &CudaTensor, g: &Dims) -> Result<()> {
        let s = g.s;
        let acc = acc_dtype(qkv.dtype()).size_in_bytes();
        if 2 * s * acc > SHARED_BUDGET {
            return Err(Error::NotOnCuda {
                op,
                detail: format!(
                    ": seq_len {s} needs {} bytes of shared memory per block, over the {SHARED_BUDGET} this kernel uses (seq_len ≤ {} for {})",
                    2 * s * acc,
                    SHARED_BUDGET / (2 * acc),
                    qkv.dtype()
                ),
            });
        }
        Ok(())
    }

    /// q (times the score scale) `[H, B, s, d]`, k and v `[K, B, s, d]`, in the compute
    /// type.
    fn load(op: &'static str, qkv: &CudaTensor, g: &Dims) -> Result<[CudaTensor; 3]> {
        let dev = qkv.device();
        let ad = acc_dtype(qkv.dtype());
        let mut q = CudaTensor::uninit(dev, &[g.heads, g.batch, g.s, g.d], ad)?;
        let kv_shape = [g.kv_heads, g.batch, g.s, g.d];
        let mut k = CudaTensor::uninit(dev, &kv_shape, ad)?;
        let mut v = CudaTensor::uninit(dev, &kv_shape, ad)?;
        let scale = Acc::lit(qkv.dtype(), g.scale);
        let f = func(dev, &source::ATTENTION, "attn_load_q", qkv.dtype())?;
        launch_kernel!(op, dev, f, grid_for(g.heads * g.batch * g.s * g.d);
            src qkv, dst &mut q, u64 g.batch, u64 g.kv_heads, u64 g.g, u64 g.s, u64 g.d,
            acc scale)?;
        let f = func(dev, &source::ATTENTION, "attn_load_kv", qkv.dtype())?;
        launch_kernel!(op, dev, f, grid_for(g.kv_heads * g.batch * g.s * g.d);
            src qkv, dst &mut k, dst &mut v, u64 g.batch, u64 g.kv_heads, u64 g.g, u64 g.s,
            u64 g.d)?;
        Ok([q, k, v])
    }

    pub(super) fn causal_attention(qkv: &CudaTensor, g: &Dims) -> Result<CausalAttentionOutput> {
        fits(OP, qkv, g)?;
        let dev = qkv.device();
        let ad = acc_dtype(qkv.dtype());
        let mut out = CudaTensor::uninit(dev, &[g.tokens, g.heads * g.d], qkv.dtype())?;
        let mut lse = CudaTensor::uninit(dev, &[g.tokens, g.heads], ad)?;
        if g.tokens * g.heads > 0 {
            let [q, k, v] = load(OP, qkv, g)?;
            let smem = (g.s * ad.size_in_bytes()) as u32;
            let f = func(dev, &source::ATTENTION, "attn_forward", qkv.dtype())?;
            launch_kernel!(OP, dev, f, per_row(OP, g.heads * g.batch * g.s, smem)?;
                src &q, src &k, src &v, dst &mut out, dst &mut lse, u64 g.batch, u64 g.heads,
                u64 g.g, u64 g.s, u64 g.d)?;
        }
        Ok(CausalAttentionOutput {
            out: out.into(),
            lse: lse.into(),
        })
    }

    /// dq (with the row sums `D_i` it computes) one block per query row, then each query
    /// head's share of dk/dv one block per key row, then the shares summed over each KV
    /// head's query heads, on the same stream.
    pub(super) fn causal_attention_backward(
        dout: &CudaTensor,
        qkv: &CudaTensor,
        out: &CudaTensor,
        lse: &CudaTensor,
        g: &Dims,
    ) -> Result<Tensor> {
        fits(OP_BACK, qkv, g)?;
        let ad = acc_dtype(qkv.dtype());
        let dev = qkv.device();
        let mut dqkv = CudaTensor::uninit(dev, qkv.shape(), qkv.dtype())?;
        if g.tokens * g.heads == 0 {
            return Ok(dqkv.into());
        }
        let [q, k, v] = load(OP_BACK, qkv, g)?;
        let mut dsum = CudaTensor::uninit(dev, &[g.heads, g.batch, g.s], ad)?;
        let rows = g.heads * g.batch * g.s;
        let scale = Acc::lit(qkv.dtype(), g.scale);
        let smem = (g.s * ad.size_in_bytes()) as u32;
        let f = func(dev, &source::ATTENTION, "attn_backward_dq", qkv.dtype())?;
        launch_kernel!(OP_BACK, dev, f, per_row(OP_BACK, rows, smem)?;
            src &q, src &k, src &v, src dout, src out, src lse, dst &mut dsum, dst &mut dqkv,
            u64 g.batch, u64 g.heads, u64 g.g, u64 g.s, u64 g.d, acc scale)?;
        // Each query head's dk and dv, `[H, B, s, d]`: the heads of a KV group write apart.
        let shape = [g.heads, g.batch, g.s, g.d];
        let mut dk = CudaTensor::uninit(dev, &shape, ad)?;
        let mut dv = CudaTensor::uninit(dev, &shape, ad)?;
        let smem = (2 * g.s * ad.size_in_bytes()) as u32;
        let f = func(dev, &source::ATTENTION, "attn_backward_dkv", qkv.dtype())?;
        launch_kernel!(OP_BACK, dev, f, per_row(OP_BACK, rows, smem)?;
            src &q, src &k, src &v, src dout, src lse, src &dsum, dst &mut dk, dst &mut dv,
            u64 g.batch, u64 g.heads, u64 g.g, u64 g.s, u64 g.d)?;
        let f = func(dev, &source::ATTENTION, "attn_backward_kv_sum", qkv.dtype())?;
        launch_kernel!(OP_BACK, dev, f, grid_for(g.kv_heads * g.batch * g.s * g.d);
            src &dk, src &dv, dst &mut dqkv, u64 g.batch, u64 g.kv_heads, u64 g.g, u64 g.s,
            u64 g.d)?;
        Ok(dqkv.into())
    }
}
