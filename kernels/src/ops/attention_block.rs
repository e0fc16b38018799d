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
//! | partial `out`, `lse` ([`attention_block`]) | `[samples·nq, H·d]`, `[samples·nq, H]` | compute ([`acc_dtype`](super::acc_dtype)) |
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

use crate::spec::attention::CausalAttentionOutput;
use crate::spec::attention_block::{
    BlockAttention, OP, OP_BACK, OP_FUSE, OP_MERGE, OP_PACK, OP_ROWS,
};
use crate::{DType, Result, Tensor};

/// The k and v columns of a fused `[tokens, H·3·d]` QKV, packed as `[tokens, H·2·d]` (what
/// travels around a ring: two thirds of the fused tensor).
pub fn pack_kv(qkv: &Tensor, head_dim: usize) -> Result<Tensor> {
    dispatch!(OP_PACK, [qkv] => crate::cuda::ops::pack_kv(&qkv, head_dim));
    crate::cpu::attention_block::pack_kv(qkv, head_dim)
}

/// Attention of `qkv`'s queries (at `cfg.q_pos`) to `kv`'s keys and values (at
/// `cfg.k_pos`), sample by sample: the normalized partial output and its lse, in the
/// compute dtype (merge several with [`merge_attention`], round once at the end).
pub fn attention_block(
    qkv: &Tensor,
    kv: &Tensor,
    cfg: &BlockAttention,
) -> Result<CausalAttentionOutput> {
    dispatch!(OP, [qkv, kv] => crate::cuda::ops::attention_block(&qkv, &kv, cfg));
    crate::cpu::attention_block::attention_block(qkv, kv, cfg)
}

/// Merges a partial attention result into a running one, row and head at a time:
/// `lse = log(e^lse_a + e^lse_b)`, `out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b`
/// (a side with `lse = −∞` contributes nothing). Both in the compute dtype, shaped alike.
pub fn merge_attention(
    acc: &mut CausalAttentionOutput,
    part: &CausalAttentionOutput,
) -> Result<()> {
    if crate::dispatch::on_cuda(OP_MERGE, &[&acc.out, &acc.lse, &part.out, &part.lse])? {
        return merge_attention_cuda(acc, part);
    }
    crate::cpu::attention_block::merge_attention(acc, part)
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
    crate::cpu::attention_block::attention_block_backward(dout, qkv, kv, out, lse, cfg, dq, dkv)
}

/// The fused `[tokens, H·3·d]` gradient of a QKV from its parts: `dq` (`[tokens, H·d]`)
/// and `dkv` (`[tokens, H·2·d]`, packed as [`pack_kv`]), both in the compute dtype,
/// rounded once into `dtype`.
pub fn fuse_qkv_grad(dq: &Tensor, dkv: &Tensor, head_dim: usize, dtype: DType) -> Result<Tensor> {
    dispatch!(OP_FUSE, [dq, dkv] => crate::cuda::ops::fuse_qkv_grad(&dq, &dkv, head_dim, dtype));
    crate::cpu::attention_block::fuse_qkv_grad(dq, dkv, head_dim, dtype)
}

/// Rows of a 2-D tensor picked by index: row `i` of the result is row `src[i]` of `t`
/// (any dtype, bit for bit). Context parallelism's token reorderings go through it.
pub fn gather_rows(t: &Tensor, src: &[usize]) -> Result<Tensor> {
    dispatch!(OP_ROWS, [t] => crate::cuda::ops::gather_rows(&t, src));
    crate::cpu::attention_block::gather_rows(t, src)
}

/// [`merge_attention`] on the device (every tensor there, as the caller checked): `acc`'s
/// tensors are moved out for the kernel and back, whatever it returns.
#[cfg(feature = "cuda")]
fn merge_attention_cuda(
    acc: &mut CausalAttentionOutput,
    part: &CausalAttentionOutput,
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
fn merge_attention_cuda(_: &mut CausalAttentionOutput, _: &CausalAttentionOutput) -> Result<()> {
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
