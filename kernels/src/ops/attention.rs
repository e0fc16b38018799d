//! Fused causal self-attention with rotary position embeddings (RoPE), forward and backward,
//! computed flash-attention style: blocked over queries and keys with an online softmax, so
//! no `seq_len × seq_len` probability matrix is ever stored.
//!
//! Layout (`d` the head dim, `s` the sequence length, `H` the heads):
//!
//! | tensor | shape | contents |
//! |---|---|---|
//! | `qkv` | `[tokens, H·3·d]` | head `h`: columns `h·3d .. h·3d+d` are q, the next `d` k, the next `d` v |
//! | `out` | `[tokens, H·d]` | head `h` at columns `h·d ..` |
//! | `lse` | `[tokens, H]` | per (token, head) `log Σ_j exp(score_j)`, compute dtype ([`acc_dtype`]) |
//!
//! `tokens` are whole samples of `s` tokens one after another; attention never crosses a
//! sample. Token `i` of a sample has position `pos_offset + i`. Per head and sample:
//!
//! - RoPE: each pair `(x[2p], x[2p+1])` of q and k is rotated by `θ = pos / base^(2p/d)`.
//! - `score_ij = q_i·k_j / √d` for `j ≤ i` (causal), `P = softmax_j(score)`, `out_i = Σ_j P_ij v_j`.
//! - Backward from `dout`: `D_i = dout_i·out_i`, `dP_ij = dout_i·v_j`,
//!   `dS_ij = P_ij (dP_ij − D_i)`, `dq_i = Σ_j dS_ij k_j / √d`, `dk_j = Σ_i dS_ij q_i / √d`,
//!   `dv_j = Σ_i P_ij dout_i`, with `P` recomputed from the saved `lse`; dq and dk are then
//!   rotated back (RoPE's transpose is its inverse).
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

/// Causal multi-head self-attention with RoPE on a fused QKV (see the [module docs](self)).
///
/// ```
/// use dtensor_kernels::ops::{causal_attention, CausalAttention};
/// use dtensor_kernels::Tensor;
/// let cfg = CausalAttention { seq_len: 4, head_dim: 2, rope_base: 10000.0, pos_offset: 0 };
/// let qkv = Tensor::from_fn(&[8, 2 * 3 * 2], |i| (i % 7) as f32 * 0.1); // 2 samples, 2 heads
/// let r = causal_attention(&qkv, &cfg).unwrap();
/// assert_eq!(r.out.shape(), &[8, 4]);
/// assert_eq!(r.lse.shape(), &[8, 2]);
/// ```
pub fn causal_attention(qkv: &Tensor, cfg: &CausalAttention) -> Result<CausalAttentionOutput> {
    let g = check_qkv(OP, qkv, cfg)?;
    dispatch!(OP, [qkv] => crate::cuda::ops::causal_attention(&qkv, cfg));
    crate::cpu::attention::causal_attention(qkv, cfg, g)
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
        crate::cuda::ops::causal_attention_backward(&dout, &qkv, &out, &lse, cfg));
    crate::cpu::attention::causal_attention_backward(dout, qkv, out, lse, cfg, g)
}
