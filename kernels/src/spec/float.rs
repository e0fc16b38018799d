//! The arithmetic contract every backend keeps: the type each float dtype computes in
//! (`f32` for `f32`/`bf16`/`f16`, `f64` for `f64`), rounding once into the result, and the
//! one exponential both the host kernels and the host-built tables of the device kernels use.

use crate::StorageElement;
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
                type $T = $crate::half::bf16;
                $body
            }
            $crate::DType::F16 => {
                type $T = $crate::half::f16;
                $body
            }
            other => Err($crate::spec::not_float($op, other)),
        }
    };
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
