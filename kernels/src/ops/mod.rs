//! The local compute kernels a transformer layer needs, forward and backward.
//!
//! | topic | forward | backward |
//! |---|---|---|
//! | [`matmul`](mod@matmul) | [`matmul()`], [`matmul_into`] (`[m,k]·[k,n]`, `[b,m,k]·[b,k,n]`, `[b,m,k]·[k,n]`) | matmuls with other [`Transpose`]s |
//! | [`elementwise`] | [`sub`], [`add_row`], [`add_row_assign`], [`mul_row`] | [`sum_rows`], [`sum_rows_into`] (of `add_row`) |
//! | [`activation`] | [`gelu`], [`silu`], [`swiglu`] (and `_into`) | [`gelu_backward`], [`silu_backward`], [`swiglu_backward`] (and `_into`) |
//! | [`softmax`](mod@softmax) | [`softmax()`], [`log_softmax`] along the last dim | [`softmax_backward`], [`log_softmax_backward`] |
//! | [`norm`] | [`layer_norm`], [`rms_norm`] over the last dim | [`layer_norm_backward`], [`rms_norm_backward`] |
//! | [`rope`](mod@rope) | [`rope()`], [`rope_with`] (rotary embedding of q or k rows, or the q and k heads of a fused QKV, at given positions: interleaved or half-split pairs, partial rotary dim, linear / llama3 / YaRN scaling; prebuilt [`RopeTables`]) | [`rope_backward`], [`rope_backward_with`] |
//! | [`embedding`](mod@embedding) | [`embedding()`], [`embedding_masked`] (vocab-parallel) | [`embedding_backward`], [`embedding_masked_backward`] (and `_into`) |
//! | [`reduction`] | [`sum_dim`], [`max_dim`] (the dim is removed) | [`sum_dim_backward`], [`max_dim_backward`] |
//! | [`moe`] | [`gather_rows`], [`grouped_matmul_t`] (per-expert `x·W[e]ᵀ` over row groups) | [`scatter_add_rows`], [`grouped_matmul_t_backward`] |
//! | [`attention`](mod@attention) | [`causal_attention`] (fused QKV with q, k already rotated, causal, flash-style), [`causal_attention_masked`] (packed documents, sliding window: [`AttentionMask`]) | [`causal_attention_backward`], [`causal_attention_masked_backward`] |
//! | [`attention_block`](mod@attention_block) | [`attention_block()`] (a query block against another block's keys, true positions), [`merge_attention`] | [`attention_block_backward`] |
//! | [`cross_entropy`](mod@cross_entropy) | [`ce_targets`] (checked once into [`CheckedTargets`]), [`ce_row_max`], [`ce_sum_target`], [`ce_loss`] (vocab-parallel, in f64; an ignore index, a z-loss) | [`ce_grad`] |
//! | [`reduce`](mod@reduce) | [`combine`], [`reduce_into`] (the collectives' reductions on whole tensors) | |
//! | [`optim`] | [`adamw_step`] (in place on the parameter and its moments) | |
//!
//! Conventions, every op alike:
//! - Float dtypes only (`f32`, `f64`, `bf16`, `f16`); every tensor argument of one call shares
//!   the dtype. `bf16`/`f16` compute in `f32` and round **once** into the output; `f32`
//!   computes in `f32`, `f64` in `f64` (see [`DType`](crate::DType) and the `Acc` column of each op).
//! - Destination first: `foo_into(dst, inputs…)` writes a caller-owned buffer whose shape and
//!   dtype must already be right; `foo(inputs…)` allocates. Backward `_into` variants take an
//!   [`Accum`]: `Add` accumulates into an existing gradient, rounding once per element.
//! - Backward functions take the output gradient first: `gelu_backward(dy, x)`.
//! - Every shape or dtype mistake is an [`Error`](crate::Error) whose message starts with the op
//!   (`"ops::matmul: …"`); nothing here panics on user input.
//! - Single-threaded, fixed summation order: the same inputs give the same bits on every rank.
//!   Only [`matmul_into`] takes a [`Parallelism`], and the convenience API passes `None`.
//! - Where it runs: every op runs where its tensors are (feature `cuda`): all in host memory
//!   runs the host kernel, all on one GPU the device kernel (out-parameters included, which
//!   must be on that GPU too; embedding and cross-entropy ids may stay on the host), operands
//!   in different places are an [`Error::DeviceMismatch`](crate::Error::DeviceMismatch).
//!
//! # One file per family: the checks, the host call, the device launch
//!
//! Each file here is an op family's front door, and the only file that knows both devices.
//! A public function runs the `spec` checks once, for both devices (shapes, dtypes, the
//! sizes the kernels need: rows, row length, …), then `dispatch!`es: on a GPU to the launch
//! in the file's `#[cfg(feature = "cuda")] mod device`, else to the host kernel in
//! `crate::cpu`. A launch takes what the checks computed and does not check again; it
//! allocates the outputs, copies host-side index lists to the device, and launches the
//! `extern "C"` kernels of `cuda/kernels/*.cu` (named in `cuda/source.rs`) through
//! `launch_kernel!` (`cuda/launch.rs`), which compares the pushed arguments with the
//! kernel's parameters before launching. What only a device needs is checked there, and
//! says so: shared memory and cuBLAS's `i32` bounds
//! ([`Error::NotOnCuda`](crate::Error::NotOnCuda)). The dtype a kernel needs (a float, for
//! most) is one of the front door's checks too (`spec::want_float`), so a host kernel's
//! dtype `match` never answers first. (Exception still: the context-parallel pieces of
//! [`attention_block`](mod@attention_block) check in their host kernels and launches alike.)
//!
//! How the device results agree with the host's:
//!
//! | ops | agreement |
//! |---|---|
//! | `Tensor::add`, `mul`, `scale`, `to_dtype`, `pack`, `unpack`, `narrow`, `cat`, `write_at`; [`sub`], [`add_row`], [`mul_row`], [`sum_rows_into`]; [`sum_dim`], [`max_dim`] and backward; [`embedding()`] and backward (a deterministic scatter-add); [`pack_kv`], [`fuse_qkv_grad`], [`gather_rows`], [`scatter_add_rows`]; [`combine`], [`reduce_into`] | bitwise (into f16: ≤ 1 ulp on CPUs without F16C; a Sum/Avg NaN's payload aside) |
//! | [`gelu`], [`silu`], [`swiglu`] and backward | bitwise for f32/bf16/f16; f64 to CUDA's `exp` |
//! | [`softmax()`], [`log_softmax`], [`layer_norm`], [`rms_norm`] and backward; the cross-entropy pieces | to rounding (tree-ordered row sums, CUDA's `exp`/`log`); the norms' weight and bias gradients in the host's order |
//! | [`causal_attention`], [`attention_block()`] and backward, [`merge_attention`] | to rounding; sequence and block lengths bounded by shared memory |
//! | [`matmul()`], [`matmul_into`], [`grouped_matmul_t`] and backward | to rounding (cuBLAS's order) |
//! | [`adamw_step`] | the host's formula in its order of operations (no fused multiply-add) |
//!
//! ```
//! use dtensor_kernels::ops::{self, Transpose};
//! use dtensor_kernels::Tensor;
//! let x = Tensor::from_fn(&[2, 3], |i| i as f32);          // [tokens, in]
//! let w = Tensor::from_fn(&[4, 3], |i| (i % 3) as f32);    // [out, in], as torch stores it
//! let y = ops::matmul(&x, Transpose::No, &w, Transpose::Yes).unwrap(); // x·wᵀ, no copy of w
//! assert_eq!(y.shape(), &[2, 4]);
//! let p = ops::softmax(&y).unwrap();
//! let row: f32 = p.as_slice::<f32>().unwrap()[..4].iter().sum();
//! assert!((row - 1.0).abs() < 1e-6);
//! ```

pub mod activation;
pub mod attention;
pub mod attention_block;
pub mod cross_entropy;
pub mod elementwise;
pub mod embedding;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod optim;
pub mod reduce;
pub mod reduction;
pub mod rope;
pub mod softmax;
pub(crate) mod tensor;

pub use crate::spec::attention::{
    key_tile_masked, AttentionMask, CausalAttention, CausalAttentionOutput,
};
pub use crate::spec::attention_block::BlockAttention;
pub use crate::spec::embedding::VocabShard;
pub use crate::spec::moe::GroupedMatmulGrads;
pub use crate::spec::norm::{LayerNormGrads, LayerNormOutput, RmsNormGrads, RmsNormOutput};
pub use crate::spec::reduction::MaxDim;
pub use activation::{
    gelu, gelu_backward, gelu_backward_into, gelu_into, silu, silu_backward, silu_backward_into,
    silu_into, swiglu, swiglu_backward, swiglu_backward_into, swiglu_into, SwiGluGrads,
};
pub use attention::{
    causal_attention, causal_attention_backward, causal_attention_masked,
    causal_attention_masked_backward, host_tiles_computed,
};
pub use attention_block::{
    attention_block, attention_block_backward, fuse_qkv_grad, gather_rows, merge_attention, pack_kv,
};
pub use cross_entropy::{
    ce_grad, ce_loss, ce_row_max, ce_sum_target, ce_targets, CheckedTargets, CrossEntropyTargets,
    IGNORE_INDEX,
};
pub use elementwise::{add_row, add_row_assign, mul_row, sub, sum_rows, sum_rows_into};
pub use embedding::{
    embedding, embedding_backward, embedding_backward_into, embedding_masked,
    embedding_masked_backward, embedding_masked_backward_into,
};
pub use matmul::{matmul, matmul_into, matmul_into_with, MatmulScratch};
pub use moe::{grouped_matmul_t, grouped_matmul_t_backward, scatter_add_rows};
pub use norm::{layer_norm, layer_norm_backward, rms_norm, rms_norm_backward};
pub use optim::{adamw_state_dtype, adamw_step, AdamWStep};
pub use reduce::{combine, reduce_into};
pub use reduction::{max_dim, max_dim_backward, sum_dim, sum_dim_backward};
pub use rope::{
    rope, rope_backward, rope_backward_with, rope_with, Rope, RopeScaling, RopeStyle, RopeTables,
    RotatedHeads,
};
pub use softmax::{
    log_softmax, log_softmax_backward, log_softmax_backward_into, log_softmax_into, softmax,
    softmax_backward, softmax_backward_into, softmax_into,
};

pub use crate::spec::{acc_dtype, Accum, Transpose};
pub(crate) use crate::spec::{
    check_dst, check_row_param, rows_last, same_dtype, same_layout, want_float,
};

/// The `int accumulate` flag of the device kernels' `_backward`/`_into` entries: 0
/// replaces the destination, 1 adds to it (the host kernels' [`Accum`]).
#[cfg(feature = "cuda")]
pub(crate) fn accum_flag(a: Accum) -> i32 {
    match a {
        Accum::Replace => 0,
        Accum::Add => 1,
    }
}

/// How gemm spreads one product over threads: `None` runs on the calling thread (the
/// default here: ranks are the parallelism); `Rayon(n)` uses `n` threads of the global rayon
/// pool (`0` = all of them), and only above gemm's size threshold.
pub use gemm::Parallelism;
