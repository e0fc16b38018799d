//! Pointwise activations and their backward.
//!
//! | op | forward | backward (what it takes) |
//! |---|---|---|
//! | [`gelu`] | `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))` (the tanh approximation) | `dx = dy·gelu'(x)` (`dy`, `x`) |
//! | [`silu`] | `x·σ(x)` | `dx = dy·σ(x)·(1 + x·(1 − σ(x)))` (`dy`, `x`) |
//! | [`swiglu`] | `silu(gate)·up` | `d_gate = dy·up·silu'(gate)`, `d_up = dy·silu(gate)` (`dy`, `gate`, `up`) |
//!
//! Each is evaluated in the compute type (`f32` for `f32`/`bf16`/`f16`, `f64` for `f64`) and
//! rounded once. The sigmoid is `1/(1 + e^-x)` with a vectorizable exp clamped so it never
//! overflows to NaN; GELU is evaluated as `x·σ(2u)`, which equals the tanh form exactly.

use super::{check_dst, same_layout, store, AccFloat, Accum, Float};
use crate::{Result, Tensor};

/// `√(2/π)`.
const GELU_C: f64 = 0.797_884_560_802_865_4;
const GELU_A: f64 = 0.044715;

/// `σ(z) = 1/(1 + e^-z)` with the vectorizable exp, exactly 0 below `z = -80` (where it is
/// under `2e-35`): the clamped f32 exp would leave a tiny non-zero `σ` there, which a huge
/// `|x|` multiplying it would blow up. Never NaN.
#[inline(always)]
fn sigmoid<A: AccFloat>(z: A) -> A {
    if z < A::lit(-80.0) {
        return A::ZERO;
    }
    A::ONE / (A::ONE + (-z).exp_fast())
}

// GELU's tanh form, rewritten without tanh: `0.5·(1 + tanh(u)) = σ(2u)`, so
// `gelu(x) = x·σ(2u)` with `u = c·(x + a·x³)`. One exp, no cancellation (the `1 +` is
// inside σ), and it vectorizes; libm's `tanhf` (through `expm1f`) was half of an MLP's time.
#[inline(always)]
fn gelu_f<A: AccFloat>(x: A) -> A {
    let u = A::lit(GELU_C) * (x + A::lit(GELU_A) * x * x * x);
    x * sigmoid(u + u)
}

/// `gelu'(x) = σ(2u) + x·σ(2u)·(1 − σ(2u))·2u'`, `u' = c·(1 + 3a·x²)`.
#[inline(always)]
fn gelu_grad<A: AccFloat>(x: A) -> A {
    let x2 = x * x;
    let u = A::lit(GELU_C) * x * (A::ONE + A::lit(GELU_A) * x2);
    let s = sigmoid(u + u);
    let ds = s * (A::ONE - s);
    if ds == A::ZERO {
        // Saturated: the second term is 0, but `x2` may have overflowed to inf (0·inf = NaN).
        return s;
    }
    s + x * ds * A::lit(2.0 * GELU_C) * (A::ONE + A::lit(3.0 * GELU_A) * x2)
}

fn silu_f<A: AccFloat>(x: A) -> A {
    x * sigmoid(x)
}

fn silu_grad<A: AccFloat>(x: A) -> A {
    let s = sigmoid(x);
    if s == A::ZERO {
        // x far below 0: σ underflowed, and x·(1−σ) would be −inf (0·inf = NaN).
        return A::ZERO;
    }
    s * (A::ONE + x * (A::ONE - s))
}

fn map_into<T: Float>(dst: &mut [T], x: &[T], f: impl Fn(T::Acc) -> T::Acc) {
    for (d, &v) in dst.iter_mut().zip(x) {
        *d = T::from_acc(f(v.to_acc()));
    }
}

fn grad_into<T: Float>(
    dst: &mut [T],
    dy: &[T],
    x: &[T],
    accum: Accum,
    f: impl Fn(T::Acc) -> T::Acc,
) {
    for ((d, &g), &v) in dst.iter_mut().zip(dy).zip(x) {
        store(d, g.to_acc() * f(v.to_acc()), accum);
    }
}

macro_rules! unary_activation {
    (
        $name:ident, $name_into:ident, $back:ident, $back_into:ident,
        $f:ident, $grad:ident, $op:literal, $op_back:literal, $doc:literal
    ) => {
        #[doc = concat!("`", $doc, "`, elementwise.")]
        pub fn $name(x: &Tensor) -> Result<Tensor> {
            dispatch!($op, [x] => crate::cuda::ops::$name(&x));
            let mut dst = Tensor::zeros(x.shape(), x.dtype());
            $name_into(&mut dst, x)?;
            Ok(dst)
        }

        #[doc = concat!("`dst = ", $doc, "`; `dst` has `x`'s shape and dtype.")]
        pub fn $name_into(dst: &mut Tensor, x: &Tensor) -> Result<()> {
            check_dst($op, dst, x.shape(), x.dtype())?;
            dispatch!($op, mut dst, [x] => {
                let y = crate::cuda::ops::$name(&x)?;
                crate::dispatch::replace($op, dst, y)
            });
            dispatch_float!($op, x.dtype(), |T| {
                map_into::<T>(dst.as_mut_slice()?, x.as_slice()?, $f);
                Ok(())
            })
        }

        #[doc = concat!("The input gradient of [`", stringify!($name), "`] at `x`, given the output gradient `dy`.")]
        pub fn $back(dy: &Tensor, x: &Tensor) -> Result<Tensor> {
            dispatch!($op_back, [dy, x] => crate::cuda::ops::$back(&dy, &x));
            let mut dst = Tensor::zeros(x.shape(), x.dtype());
            $back_into(&mut dst, dy, x, Accum::Replace)?;
            Ok(dst)
        }

        #[doc = concat!("[`", stringify!($back), "`] into `dx`, replacing or adding to it.")]
        pub fn $back_into(dx: &mut Tensor, dy: &Tensor, x: &Tensor, accum: Accum) -> Result<()> {
            same_layout($op_back, dy, x)?;
            check_dst($op_back, dx, x.shape(), x.dtype())?;
            dispatch!($op_back, mut dx, [dy, x] => crate::cuda::ops::$back_into(dx, &dy, &x, accum));
            dispatch_float!($op_back, x.dtype(), |T| {
                grad_into::<T>(dx.as_mut_slice()?, dy.as_slice()?, x.as_slice()?, accum, $grad);
                Ok(())
            })
        }
    };
}

unary_activation!(
    gelu,
    gelu_into,
    gelu_backward,
    gelu_backward_into,
    gelu_f,
    gelu_grad,
    "ops::gelu",
    "ops::gelu_backward",
    "0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))"
);

unary_activation!(
    silu,
    silu_into,
    silu_backward,
    silu_backward_into,
    silu_f,
    silu_grad,
    "ops::silu",
    "ops::silu_backward",
    "x·σ(x)"
);

/// `silu(gate)·up`, elementwise (the gated MLP of LLaMA-style models; `gate` and `up` are the
/// two halves of the first projection).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    dispatch!("ops::swiglu", [gate, up] => crate::cuda::ops::swiglu(&gate, &up));
    let mut dst = Tensor::zeros(gate.shape(), gate.dtype());
    swiglu_into(&mut dst, gate, up)?;
    Ok(dst)
}

/// `dst = silu(gate)·up`.
pub fn swiglu_into(dst: &mut Tensor, gate: &Tensor, up: &Tensor) -> Result<()> {
    const OP: &str = "ops::swiglu";
    same_layout(OP, gate, up)?;
    check_dst(OP, dst, gate.shape(), gate.dtype())?;
    dispatch!(OP, mut dst, [gate, up] => {
        let y = crate::cuda::ops::swiglu(&gate, &up)?;
        crate::dispatch::replace(OP, dst, y)
    });
    dispatch_float!(OP, gate.dtype(), |T| {
        let (g, u) = (gate.as_slice::<T>()?, up.as_slice::<T>()?);
        for ((d, &g), &u) in dst.as_mut_slice::<T>()?.iter_mut().zip(g).zip(u) {
            *d = T::from_acc(silu_f(g.to_acc()) * u.to_acc());
        }
        Ok(())
    })
}

/// The gradients of [`swiglu`] with respect to `gate` and `up`.
#[derive(Clone, Debug, PartialEq)]
pub struct SwiGluGrads {
    /// `dy·up·silu'(gate)`: the gradient of the gate input, `gate`'s shape and dtype.
    pub d_gate: Tensor,
    /// `dy·silu(gate)`: the gradient of the up input, `up`'s shape and dtype.
    pub d_up: Tensor,
}

/// `d_gate = dy·up·silu'(gate)`, `d_up = dy·silu(gate)`.
pub fn swiglu_backward(dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<SwiGluGrads> {
    // Zeros where `gate` is (the device kernel writes them; `Replace` ignores their values).
    crate::dispatch::on_cuda("ops::swiglu_backward", &[dy, gate, up])?;
    let mut d_gate = gate.zeros_like()?;
    let mut d_up = gate.zeros_like()?;
    swiglu_backward_into(&mut d_gate, &mut d_up, dy, gate, up, Accum::Replace)?;
    Ok(SwiGluGrads { d_gate, d_up })
}

/// [`swiglu_backward`] into caller buffers (e.g. the two halves' gradients), replacing or
/// adding to them.
pub fn swiglu_backward_into(
    d_gate: &mut Tensor,
    d_up: &mut Tensor,
    dy: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    accum: Accum,
) -> Result<()> {
    const OP: &str = "ops::swiglu_backward";
    same_layout(OP, gate, up)?;
    same_layout(OP, gate, dy)?;
    check_dst(OP, d_gate, gate.shape(), gate.dtype())?;
    check_dst(OP, d_up, gate.shape(), gate.dtype())?;
    if crate::dispatch::on_cuda(OP, &[&*d_gate, &*d_up, dy, gate, up])? {
        return swiglu_backward_cuda(d_gate, d_up, dy, gate, up, accum);
    }
    dispatch_float!(OP, gate.dtype(), |T| {
        let (g, u, dy) = (
            gate.as_slice::<T>()?,
            up.as_slice::<T>()?,
            dy.as_slice::<T>()?,
        );
        let dg = d_gate.as_mut_slice::<T>()?;
        let du = d_up.as_mut_slice::<T>()?;
        for i in 0..g.len() {
            let (gi, ui, dyi) = (g[i].to_acc(), u[i].to_acc(), dy[i].to_acc());
            store(&mut dg[i], dyi * ui * silu_grad(gi), accum);
            store(&mut du[i], dyi * silu_f(gi), accum);
        }
        Ok(())
    })
}

/// [`swiglu_backward_into`] on the device (every operand there, as the caller checked): both
/// out-parameters are moved out of their tensors for the kernel.
#[cfg(feature = "cuda")]
fn swiglu_backward_cuda(
    d_gate: &mut Tensor,
    d_up: &mut Tensor,
    dy: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    accum: Accum,
) -> Result<()> {
    let (dy, gate, up) = (dy.cuda_tensor()?, gate.cuda_tensor()?, up.cuda_tensor()?);
    crate::dispatch::with_cuda_mut(d_gate, |dg| {
        crate::dispatch::with_cuda_mut(d_up, |du| {
            crate::cuda::ops::swiglu_backward_into(dg, du, &dy, &gate, &up, accum)
        })
    })
}

#[cfg(not(feature = "cuda"))]
fn swiglu_backward_cuda(
    _: &mut Tensor,
    _: &mut Tensor,
    _: &Tensor,
    _: &Tensor,
    _: &Tensor,
    _: Accum,
) -> Result<()> {
    unreachable!("no device tensor exists without the `cuda` feature")
}
