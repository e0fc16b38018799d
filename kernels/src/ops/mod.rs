//! The local compute kernels a transformer layer needs, forward and backward.
//!
//! | topic | forward | backward |
//! |---|---|---|
//! | [`matmul`](mod@matmul) | [`matmul()`], [`matmul_into`] (`[m,k]·[k,n]`, `[b,m,k]·[b,k,n]`, `[b,m,k]·[k,n]`) | matmuls with other [`Transpose`]s |
//! | [`elementwise`] | [`sub`], [`add_row`], [`add_row_assign`], [`mul_row`] | [`sum_rows`], [`sum_rows_into`] (of `add_row`) |
//! | [`activation`] | [`gelu`], [`silu`], [`swiglu`] (and `_into`) | [`gelu_backward`], [`silu_backward`], [`swiglu_backward`] (and `_into`) |
//! | [`softmax`](mod@softmax) | [`softmax()`], [`log_softmax`] along the last dim | [`softmax_backward`], [`log_softmax_backward`] |
//! | [`norm`] | [`layer_norm`], [`rms_norm`] over the last dim | [`layer_norm_backward`], [`rms_norm_backward`] |
//! | [`embedding`](mod@embedding) | [`embedding()`], [`embedding_masked`] (vocab-parallel) | [`embedding_backward`], [`embedding_masked_backward`] (and `_into`) |
//! | [`reduction`] | [`sum_dim`], [`max_dim`] (the dim is removed) | [`sum_dim_backward`], [`max_dim_backward`] |
//! | [`moe`] | [`gather_rows`], [`grouped_matmul_t`] (per-expert `x·W[e]ᵀ` over row groups) | [`scatter_add_rows`], [`grouped_matmul_t_backward`] |
//! | [`attention`](mod@attention) | [`causal_attention`] (fused QKV, RoPE, causal, flash-style) | [`causal_attention_backward`] |
//! | [`attention_block`](mod@attention_block) | [`attention_block()`] (a query block against another block's keys, true positions), [`merge_attention`] | [`attention_block_backward`] |
//!
//! Conventions, every op alike:
//! - Float dtypes only (`f32`, `f64`, `bf16`, `f16`); every tensor argument of one call shares
//!   the dtype. `bf16`/`f16` compute in `f32` and round **once** into the output; `f32`
//!   computes in `f32`, `f64` in `f64` (see [`DType`] and the `Acc` column of each op).
//! - Destination first: `foo_into(dst, inputs…)` writes a caller-owned buffer whose shape and
//!   dtype must already be right; `foo(inputs…)` allocates. Backward `_into` variants take an
//!   [`Accum`]: `Add` accumulates into an existing gradient, rounding once per element.
//! - Backward functions take the output gradient first: `gelu_backward(dy, x)`.
//! - Every shape or dtype mistake is an [`Error`] whose message starts with the op
//!   (`"ops::matmul: …"`); nothing here panics on user input.
//! - Single-threaded, fixed summation order: the same inputs give the same bits on every rank.
//!   Only [`matmul_into`] takes a [`Parallelism`], and the convenience API passes `None`.
//! - Where it runs: every op runs where its tensors are (feature `cuda`): all in host memory
//!   runs the code here, all on one GPU runs the `cuda::ops` kernel (out-parameters included,
//!   which must be on that GPU too; embedding ids may stay on the host), operands in different
//!   places are an [`Error::DeviceMismatch`].
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

use crate::{DType, Error, Result, StorageElement, Tensor};
use half::{bf16, f16};

/// Runs `$body` (which evaluates to a `Result`) with `$T` bound to the element type of a float
/// `DType`; an integer dtype becomes an `Err` naming `$op`.
macro_rules! dispatch_float {
    ($op:expr, $dtype:expr, |$T:ident| $body:expr) => {
        match $dtype {
            $crate::DType::F32 => {
                type $T = f32;
                $body
            }
            $crate::DType::F64 => {
                type $T = f64;
                $body
            }
            $crate::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = half::f16;
                $body
            }
            other => Err($crate::ops::not_float($op, other)),
        }
    };
}

pub mod activation;
pub mod attention;
pub mod attention_block;
pub mod elementwise;
pub mod embedding;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod reduction;
pub mod softmax;

pub use activation::{
    gelu, gelu_backward, gelu_backward_into, gelu_into, silu, silu_backward, silu_backward_into,
    silu_into, swiglu, swiglu_backward, swiglu_backward_into, swiglu_into, SwiGluGrads,
};
pub use attention::{causal_attention, causal_attention_backward};
pub use attention::{CausalAttention, CausalAttentionOutput};
pub use attention_block::{
    attention_block, attention_block_backward, fuse_qkv_grad, gather_rows, merge_attention,
    pack_kv, BlockAttention,
};
pub use elementwise::{add_row, add_row_assign, mul_row, sub, sum_rows, sum_rows_into};
pub use embedding::{
    embedding, embedding_backward, embedding_backward_into, embedding_masked,
    embedding_masked_backward, embedding_masked_backward_into, VocabShard,
};
pub use matmul::{matmul, matmul_into, matmul_into_with, MatmulScratch};
pub use moe::{grouped_matmul_t, grouped_matmul_t_backward, scatter_add_rows, GroupedMatmulGrads};
pub use norm::{
    layer_norm, layer_norm_backward, rms_norm, rms_norm_backward, LayerNormGrads, LayerNormOutput,
    RmsNormGrads, RmsNormOutput,
};
pub use reduction::{max_dim, max_dim_backward, sum_dim, sum_dim_backward, MaxDim};
pub use softmax::{
    log_softmax, log_softmax_backward, log_softmax_backward_into, log_softmax_into, softmax,
    softmax_backward, softmax_backward_into, softmax_into,
};

/// How gemm spreads one product over threads: `None` runs on the calling thread (the
/// default here: ranks are the parallelism); `Rayon(n)` uses `n` threads of the global rayon
/// pool (`0` = all of them), and only above gemm's size threshold.
pub use gemm::Parallelism;

/// What a kernel does with the destination's old contents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Accum {
    /// `dst = result` (the old contents are never read, so they may be garbage or NaN).
    #[default]
    Replace,
    /// `dst = dst + result`, rounded once per element.
    Add,
}

/// Whether an operand enters a product as stored or transposed (read through strides; no
/// copy is made).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Transpose {
    /// The operand as stored (its last two dims used as they are).
    #[default]
    No,
    /// The operand's last two dims swapped (`Aᵀ`), read through strides.
    Yes,
}

/// The arithmetic a kernel does for one element type: `Acc` is the type it computes in
/// (`f32` for `f32`/`bf16`/`f16`, `f64` for `f64`), and a result is rounded into `Self` once.
pub(crate) trait Float: StorageElement {
    type Acc: AccFloat;
    fn to_acc(self) -> Self::Acc;
    fn from_acc(v: Self::Acc) -> Self;
}

/// `f32` or `f64`: the types kernels compute in.
/// `e^x` in `f32` within ~1 ulp (Cephes' `expf`): `e^x = 2^n·e^r` with `n = round(x·log₂e)`,
/// `|r| ≤ ln2/2` by Cody–Waite, `e^r` by a degree-7 polynomial. Written out rather than
/// calling libm's `expf` because it inlines and vectorizes (the exponentials were ~40% of
/// attention's time at head dim 16, libm's `tanhf` and `expm1f` half of a GELU MLP's), and plain mul/add (never fused by rustc) gives the same bits on
/// every machine. Inputs are clamped to `[-87.34, 88]` (the softmax only passes `x ≤ 0`, and
/// `e^-87.34 ≈ 1.2e-38` is as good as 0 next to the row's largest term, 1); NaN stays NaN.
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    const HI: f32 = 88.0;
    const LO: f32 = -87.336_54; // n = -126: 2^n stays normal
                                // 1.5·2^23: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    // Comparisons with NaN are false, so NaN passes through both clamps.
    let x = if x > HI { HI } else { x };
    let x = if x < LO { LO } else { x };
    let t = x * std::f32::consts::LOG2_E + MAGIC;
    let n = t - MAGIC;
    // ln2 = C1 + C2 with C1 = 355/512 exact in 9 bits, so n·C1 is exact.
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_2e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5; // Cephes 5.0000001201e-1, which rounds to 0.5 in f32
    let y = p * (r * r) + r + 1.0;
    // 2^n from its exponent bits: t's bits are MAGIC's plus n.
    let pow2 = f32::from_bits(t.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    y * pow2
}

pub(crate) trait AccFloat:
    num_traits::Float
    + StorageElement
    + std::ops::AddAssign
    + std::ops::SubAssign
    + std::ops::MulAssign
    + Default
    + Send
    + Sync
    + std::fmt::Debug
    + 'static
{
    const ZERO: Self;
    const ONE: Self;
    /// A constant, rounded into this type.
    fn lit(v: f64) -> Self;
    /// `e^x`, vectorizable: [`exp_f32`] for `f32` (clamped to `[-87.34, 88]`, within ~1
    /// ulp), the standard `exp` for `f64`.
    fn exp_fast(self) -> Self;
}

impl AccFloat for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[inline(always)]
    fn lit(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn exp_fast(self) -> Self {
        exp_f32(self)
    }
}

impl AccFloat for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[inline(always)]
    fn lit(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn exp_fast(self) -> Self {
        self.exp()
    }
}

macro_rules! float_identity {
    ($t:ty) => {
        impl Float for $t {
            type Acc = $t;
            #[inline(always)]
            fn to_acc(self) -> $t {
                self
            }
            #[inline(always)]
            fn from_acc(v: $t) -> Self {
                v
            }
        }
    };
}
float_identity!(f32);
float_identity!(f64);

macro_rules! float_half {
    ($t:ty) => {
        impl Float for $t {
            type Acc = f32;
            #[inline(always)]
            fn to_acc(self) -> f32 {
                self.to_f32()
            }
            #[inline(always)]
            fn from_acc(v: f32) -> Self {
                <$t>::from_f32(v)
            }
        }
    };
}
float_half!(bf16);
float_half!(f16);

/// The dtype a kernel computes in for `dtype` (and that saved norm statistics have).
pub fn acc_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

/// Writes `v` into `d` according to `accum`, rounding once.
#[inline(always)]
pub(crate) fn store<T: Float>(d: &mut T, v: T::Acc, accum: Accum) {
    *d = match accum {
        Accum::Replace => T::from_acc(v),
        Accum::Add => T::from_acc(d.to_acc() + v),
    };
}

pub(crate) fn not_float(op: &'static str, dtype: DType) -> Error {
    Error::Invalid {
        op,
        detail: format!("dtype {dtype} is not a float type (expected f32, f64, bf16 or f16)"),
    }
}

/// What the argument checks read of a tensor: its dtype and shape. [`Tensor`] has it and so
/// does the CUDA ops' `CudaTensor`, so the CPU and GPU paths check their arguments with the
/// same code and the same messages.
pub(crate) trait Layout {
    fn dtype(&self) -> DType;
    fn shape(&self) -> &[usize];
    fn rank(&self) -> usize {
        self.shape().len()
    }
}

impl Layout for Tensor {
    fn dtype(&self) -> DType {
        Tensor::dtype(self)
    }
    fn shape(&self) -> &[usize] {
        Tensor::shape(self)
    }
}

/// `Err` unless `t` has a float dtype.
pub(crate) fn want_float<L: Layout + ?Sized>(op: &'static str, t: &L) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(not_float(op, t.dtype()))
    }
}

/// `Err` unless `b` has `a`'s dtype.
pub(crate) fn same_dtype<L: Layout + ?Sized>(op: &'static str, a: &L, b: &L) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    Ok(())
}

/// `Err` unless `b` has `a`'s dtype and shape.
pub(crate) fn same_layout<L: Layout + ?Sized>(op: &'static str, a: &L, b: &L) -> Result<()> {
    same_dtype(op, a, b)?;
    if a.shape() != b.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: a.shape().into(),
            rhs: b.shape().into(),
        });
    }
    Ok(())
}

/// `Err` unless `dst` has exactly `shape` and `dtype` (destination checks of `_into` ops).
pub(crate) fn check_dst<L: Layout + ?Sized>(
    op: &'static str,
    dst: &L,
    shape: &[usize],
    dtype: DType,
) -> Result<()> {
    if dst.dtype() != dtype {
        return Err(Error::DTypeMismatch {
            op,
            lhs: dst.dtype(),
            rhs: dtype,
        });
    }
    if dst.shape() != shape {
        return Err(Error::ShapeMismatch {
            op,
            lhs: dst.shape().into(),
            rhs: shape.into(),
        });
    }
    Ok(())
}

/// The tensor seen as `[rows, n]` over its last dim; `Err` for a scalar.
pub(crate) fn rows_last<L: Layout + ?Sized>(op: &'static str, t: &L) -> Result<(usize, usize)> {
    let Some(&n) = t.shape().last() else {
        return Err(Error::Invalid {
            op,
            detail: "needs a tensor of rank >= 1 (it works along the last dim), got shape []"
                .into(),
        });
    };
    let rows = t.shape()[..t.rank() - 1].iter().product();
    Ok((rows, n))
}

/// `Err` unless `p` is `[n]` of `x`'s dtype: a per-feature parameter (bias, weight) of an op
/// over the last dim `n` of `x`.
pub(crate) fn check_row_param<L: Layout + ?Sized>(
    op: &'static str,
    x: &L,
    p: &L,
    n: usize,
) -> Result<()> {
    same_dtype(op, x, p)?;
    if p.shape() != [n] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x.shape().into(),
            rhs: p.shape().into(),
        });
    }
    Ok(())
}
