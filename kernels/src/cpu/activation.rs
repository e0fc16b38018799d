//! Host kernels of [`crate::ops::activation`](mod@crate::ops::activation), on host tensors. Each says
//! what it relies on and which check of the front door ensures it.

use super::{store, AccFloat, Accum, Float};
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

/// The host halves of a unary activation `$f` and its gradient `$grad`, called by the
/// front door's `$name_into` and `$back_into` (`ops::unary_activation!`). `$name_into` relies
/// on `dst` having `x`'s shape and dtype (`spec::check_dst`); `$back_into` on `dy` having
/// `x`'s shape and dtype (`spec::same_layout`) and `dx` too (`spec::check_dst`); both on a
/// float dtype (`spec::want_float`).
macro_rules! host_activation {
    ($name_into:ident, $back_into:ident, $f:ident, $grad:ident) => {
        pub(crate) fn $name_into(op: &'static str, dst: &mut Tensor, x: &Tensor) -> Result<()> {
            dispatch_float!(op, x.dtype(), |T| {
                map_into::<T>(dst.as_mut_slice()?, x.as_slice()?, $f);
                Ok(())
            })
        }

        pub(crate) fn $back_into(
            op: &'static str,
            dx: &mut Tensor,
            dy: &Tensor,
            x: &Tensor,
            accum: Accum,
        ) -> Result<()> {
            dispatch_float!(op, x.dtype(), |T| {
                grad_into::<T>(
                    dx.as_mut_slice()?,
                    dy.as_slice()?,
                    x.as_slice()?,
                    accum,
                    $grad,
                );
                Ok(())
            })
        }
    };
}

host_activation!(gelu_into, gelu_backward_into, gelu_f, gelu_grad);
host_activation!(silu_into, silu_backward_into, silu_f, silu_grad);

/// Host kernel of [`crate::ops::swiglu_into`]: relies on `up` having `gate`'s shape and dtype
/// (`spec::same_layout`) and `dst` too (`spec::check_dst`), as the front door checks.
pub(crate) fn swiglu_into(dst: &mut Tensor, gate: &Tensor, up: &Tensor) -> Result<()> {
    const OP: &str = "ops::swiglu";
    dispatch_float!(OP, gate.dtype(), |T| {
        let (g, u) = (gate.as_slice::<T>()?, up.as_slice::<T>()?);
        for ((d, &g), &u) in dst.as_mut_slice::<T>()?.iter_mut().zip(g).zip(u) {
            *d = T::from_acc(silu_f(g.to_acc()) * u.to_acc());
        }
        Ok(())
    })
}

/// Host kernel of [`crate::ops::swiglu_backward_into`]: relies on `up` and `dy` having
/// `gate`'s shape and dtype (`spec::same_layout`) and `d_gate`, `d_up` too
/// (`spec::check_dst`), as the front door checks.
pub(crate) fn swiglu_backward_into(
    d_gate: &mut Tensor,
    d_up: &mut Tensor,
    dy: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    accum: Accum,
) -> Result<()> {
    const OP: &str = "ops::swiglu_backward";
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
