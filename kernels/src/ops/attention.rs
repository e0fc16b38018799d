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
//! # Masks: packed documents and sliding windows
//!
//! [`causal_attention_masked`] narrows the causal mask with an [`AttentionMask`]:
//!
//! | mask | query `i` sees key `j` (positions in the sample) | typical use |
//! |---|---|---|
//! | [`AttentionMask::CAUSAL`] | `j ≤ i` | plain causal attention (what [`causal_attention`] runs) |
//! | `.documents(ids)` | `j ≤ i`, `j` in `i`'s document | packed sequences: several documents per sample, none attending to another |
//! | `.window(w)` | `i − w < j ≤ i` | sliding-window attention (Mistral; Hugging Face's `sliding_window`): `w` keys, the query included |
//! | both | all of the above | |
//!
//! Document ids are one `u32` per token in `qkv`'s row order (samples one after another),
//! so every sample packs its own documents; a document is a run of consecutive tokens with
//! the same id, and never crosses a sample (ids need only differ between neighbouring
//! documents). Positions restart per document only where the caller's RoPE restarts them
//! (per-token positions given to [`rope`](fn@super::rope)); the mask does not move q or k. A window of 0 keys, or ids that are not one per token, are errors naming the op.
//!
//! Every query sees the contiguous keys `first(i) ..= i`, `first(i)` the later of its
//! document's start and `i + 1 − w`, and `first` never decreases along a sample. So a tile
//! of queries `q0..=q1` sees nothing of a tile of keys `k0..=k1` when `k0 > q1` or
//! `k1 < first(q0)` ([`key_tile_masked`]): the host kernels skip those tiles (not computed,
//! [`host_tiles_computed`] counts the others), and the device kernels loop over each row's
//! visible keys only. Work then scales with the visible keys: about `s·w` for a window
//! and `Σ len²/2` over the documents. With the empty mask every tile and every
//! operation is the plain kernel's, so [`causal_attention`] is
//! `causal_attention_masked(.., &AttentionMask::CAUSAL)` bit for bit.
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
    forward(OP, qkv, cfg, &AttentionMask::CAUSAL)
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
    backward(OP_BACK, [dout, qkv, out, lse], cfg, &AttentionMask::CAUSAL)
}

/// [`causal_attention`] with packed documents and/or a sliding window ([`AttentionMask`]:
/// query `i` sees key `j` when `j ≤ i`, `j` is in `i`'s document and `i − window < j`).
/// With [`AttentionMask::CAUSAL`] it is `causal_attention`, bit for bit. `Err` (naming the
/// op and the sizes) unless the document ids are one per token and the window is at
/// least 1.
///
/// ```
/// use dtensor_kernels::ops::{causal_attention_masked, AttentionMask, CausalAttention};
/// use dtensor_kernels::Tensor;
/// // One sample of 6 tokens packing two documents (3 + 3), a window of 2 keys.
/// let cfg = CausalAttention::new(6, 4);
/// let ids = [0, 0, 0, 1, 1, 1];
/// let mask = AttentionMask::default().documents(&ids).window(2);
/// let qkv = Tensor::from_fn(&[6, 3 * 4], |i| (i % 5) as f32 * 0.1);
/// let r = causal_attention_masked(&qkv, &cfg, &mask).unwrap();
/// assert_eq!(r.out.shape(), &[6, 4]);
/// ```
pub fn causal_attention_masked(
    qkv: &Tensor,
    cfg: &CausalAttention,
    mask: &AttentionMask<'_>,
) -> Result<CausalAttentionOutput> {
    forward(OP_MASK, qkv, cfg, mask)
}

/// The gradient of [`causal_attention_masked`] (as [`causal_attention_backward`], under the
/// same `mask`).
pub fn causal_attention_masked_backward(
    dout: &Tensor,
    qkv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    cfg: &CausalAttention,
    mask: &AttentionMask<'_>,
) -> Result<Tensor> {
    backward(OP_MASK_BACK, [dout, qkv, out, lse], cfg, mask)
}

/// Score tiles (`64 × 64` queries × keys of one head and sample, or smaller at the edges)
/// the host attention kernels have computed on the calling thread since it started,
/// forward and backward, full and blockwise: a diagnostic that shows which tiles a mask
/// lets the kernels skip ([`key_tile_masked`]). Device kernels do not count.
pub fn host_tiles_computed() -> u64 {
    crate::cpu::attention::tiles_computed()
}

/// Checks once, then the device launch or the host kernel.
fn forward(
    op: &'static str,
    qkv: &Tensor,
    cfg: &CausalAttention,
    mask: &AttentionMask<'_>,
) -> Result<CausalAttentionOutput> {
    let g = check_qkv(op, qkv, cfg)?;
    let positions: Vec<usize> = (0..g.s).collect();
    let first = mask.first_keys(op, g.batch, g.s, &positions)?;
    dispatch!(op, [qkv] => device::causal_attention(op, &qkv, &g, &first));
    crate::cpu::attention::causal_attention(qkv, g, &first)
}

fn backward(
    op: &'static str,
    [dout, qkv, out, lse]: [&Tensor; 4],
    cfg: &CausalAttention,
    mask: &AttentionMask<'_>,
) -> Result<Tensor> {
    let g = check_qkv(op, qkv, cfg)?;
    same_dtype(op, dout, qkv)?;
    same_dtype(op, out, qkv)?;
    let out_shape = [g.tokens, g.heads * g.d];
    for t in [dout, out] {
        if t.shape() != out_shape {
            return Err(Error::ShapeMismatch {
                op,
                lhs: t.shape().into(),
                rhs: out_shape.as_slice().into(),
            });
        }
    }
    check_dst(op, lse, &[g.tokens, g.heads], acc_dtype(qkv.dtype()))?;
    let positions: Vec<usize> = (0..g.s).collect();
    let first = mask.first_keys(op, g.batch, g.s, &positions)?;
    dispatch!(op, [dout, qkv, out, lse] =>
        device::causal_attention_backward(op, &dout, &qkv, &out, &lse, &g, &first));
    crate::cpu::attention::causal_attention_backward(dout, qkv, out, lse, g, &first)
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

    /// Each token's first visible key position (`[B·s]`, the kernels' `i64`), uploaded.
    fn first_keys(
        op: &'static str,
        first: &[usize],
        dev: &crate::cuda::Device,
    ) -> Result<CudaTensor> {
        let v = first
            .iter()
            .map(|&x| {
                i64::try_from(x).map_err(|_| Error::NotOnCuda {
                    op,
                    detail: format!(": key position {x} exceeds the kernels' i64 positions"),
                })
            })
            .collect::<Result<Vec<i64>>>()?;
        Tensor::from_vec(v, &[first.len()])?.upload(dev)
    }

    pub(super) fn causal_attention(
        op: &'static str,
        qkv: &CudaTensor,
        g: &Dims,
        first: &[usize],
    ) -> Result<CausalAttentionOutput> {
        fits(op, qkv, g)?;
        let dev = qkv.device();
        let ad = acc_dtype(qkv.dtype());
        let mut out = CudaTensor::uninit(dev, &[g.tokens, g.heads * g.d], qkv.dtype())?;
        let mut lse = CudaTensor::uninit(dev, &[g.tokens, g.heads], ad)?;
        if g.tokens * g.heads > 0 {
            let [q, k, v] = load(op, qkv, g)?;
            let first = first_keys(op, first, dev)?;
            let smem = (g.s * ad.size_in_bytes()) as u32;
            let f = func(dev, &source::ATTENTION, "attn_forward", qkv.dtype())?;
            launch_kernel!(op, dev, f, per_row(op, g.heads * g.batch * g.s, smem)?;
                src &q, src &k, src &v, src &first, dst &mut out, dst &mut lse, u64 g.batch,
                u64 g.heads, u64 g.g, u64 g.s, u64 g.d)?;
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
        op: &'static str,
        dout: &CudaTensor,
        qkv: &CudaTensor,
        out: &CudaTensor,
        lse: &CudaTensor,
        g: &Dims,
        first: &[usize],
    ) -> Result<Tensor> {
        fits(op, qkv, g)?;
        let ad = acc_dtype(qkv.dtype());
        let dev = qkv.device();
        let mut dqkv = CudaTensor::uninit(dev, qkv.shape(), qkv.dtype())?;
        if g.tokens * g.heads == 0 {
            return Ok(dqkv.into());
        }
        let [q, k, v] = load(op, qkv, g)?;
        let first = first_keys(op, first, dev)?;
        let mut dsum = CudaTensor::uninit(dev, &[g.heads, g.batch, g.s], ad)?;
        let rows = g.heads * g.batch * g.s;
        let scale = Acc::lit(qkv.dtype(), g.scale);
        let smem = (g.s * ad.size_in_bytes()) as u32;
        let f = func(dev, &source::ATTENTION, "attn_backward_dq", qkv.dtype())?;
        launch_kernel!(op, dev, f, per_row(op, rows, smem)?;
            src &q, src &k, src &v, src dout, src out, src lse, src &first, dst &mut dsum,
            dst &mut dqkv, u64 g.batch, u64 g.heads, u64 g.g, u64 g.s, u64 g.d, acc scale)?;
        // Each query head's dk and dv, `[H, B, s, d]`: the heads of a KV group write apart.
        let shape = [g.heads, g.batch, g.s, g.d];
        let mut dk = CudaTensor::uninit(dev, &shape, ad)?;
        let mut dv = CudaTensor::uninit(dev, &shape, ad)?;
        let smem = (2 * g.s * ad.size_in_bytes()) as u32;
        let f = func(dev, &source::ATTENTION, "attn_backward_dkv", qkv.dtype())?;
        launch_kernel!(op, dev, f, per_row(op, rows, smem)?;
            src &q, src &k, src &v, src dout, src lse, src &dsum, src &first, dst &mut dk,
            dst &mut dv, u64 g.batch, u64 g.heads, u64 g.g, u64 g.s, u64 g.d)?;
        let f = func(dev, &source::ATTENTION, "attn_backward_kv_sum", qkv.dtype())?;
        launch_kernel!(op, dev, f, grid_for(g.kv_heads * g.batch * g.s * g.d);
            src &dk, src &dv, dst &mut dqkv, u64 g.batch, u64 g.kv_heads, u64 g.g, u64 g.s,
            u64 g.d)?;
        Ok(dqkv.into())
    }
}
