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

use super::{check_dst, same_layout, want_float, Accum};
pub use crate::spec::activation::SwiGluGrads;
use crate::{Result, Tensor};

/// The four front doors of a unary activation (forward, backward, each allocating or
/// `_into`); the host halves are `crate::cpu::activation`'s.
macro_rules! unary_activation {
    (
        $name:ident, $name_into:ident, $back:ident, $back_into:ident,
        $op:literal, $op_back:literal, $doc:literal
    ) => {
        #[doc = concat!("`", $doc, "`, elementwise.")]
        pub fn $name(x: &Tensor) -> Result<Tensor> {
            want_float($op, x)?;
            dispatch!($op, [x] => device::unary($op, stringify!($name), &x));
            let mut dst = Tensor::zeros(x.shape(), x.dtype());
            crate::cpu::activation::$name_into($op, &mut dst, x)?;
            Ok(dst)
        }

        #[doc = concat!("`dst = ", $doc, "`; `dst` has `x`'s shape and dtype.")]
        pub fn $name_into(dst: &mut Tensor, x: &Tensor) -> Result<()> {
            want_float($op, x)?;
            check_dst($op, dst, x.shape(), x.dtype())?;
            dispatch!($op, mut dst, [x] => {
                let y = device::unary($op, stringify!($name), &x)?;
                crate::dispatch::replace($op, dst, y)
            });
            crate::cpu::activation::$name_into($op, dst, x)
        }

        #[doc = concat!("The input gradient of [`", stringify!($name), "`] at `x`, given the output gradient `dy`.")]
        pub fn $back(dy: &Tensor, x: &Tensor) -> Result<Tensor> {
            same_layout($op_back, dy, x)?;
            want_float($op_back, x)?;
            dispatch!($op_back, [dy, x] => {
                let mut dx = crate::cuda::CudaTensor::uninit(x.device(), x.shape(), x.dtype())?;
                device::unary_back($op_back, stringify!($back), &mut dx, &dy, &x, Accum::Replace)
                    .map(|()| dx)
            });
            let mut dst = Tensor::zeros(x.shape(), x.dtype());
            crate::cpu::activation::$back_into($op_back, &mut dst, dy, x, Accum::Replace)?;
            Ok(dst)
        }

        #[doc = concat!("[`", stringify!($back), "`] into `dx`, replacing or adding to it.")]
        pub fn $back_into(dx: &mut Tensor, dy: &Tensor, x: &Tensor, accum: Accum) -> Result<()> {
            same_layout($op_back, dy, x)?;
            want_float($op_back, x)?;
            check_dst($op_back, dx, x.shape(), x.dtype())?;
            dispatch!($op_back, mut dx, [dy, x] =>
                device::unary_back($op_back, stringify!($back), dx, &dy, &x, accum));
            crate::cpu::activation::$back_into($op_back, dx, dy, x, accum)
        }
    };
}

unary_activation!(
    gelu,
    gelu_into,
    gelu_backward,
    gelu_backward_into,
    "ops::gelu",
    "ops::gelu_backward",
    "0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))"
);

unary_activation!(
    silu,
    silu_into,
    silu_backward,
    silu_backward_into,
    "ops::silu",
    "ops::silu_backward",
    "x·σ(x)"
);

/// `silu(gate)·up`, elementwise (the gated MLP of LLaMA-style models; `gate` and `up` are the
/// two halves of the first projection).
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    const OP: &str = "ops::swiglu";
    same_layout(OP, gate, up)?;
    want_float(OP, gate)?;
    dispatch!(OP, [gate, up] => device::swiglu(&gate, &up));
    let mut dst = Tensor::zeros(gate.shape(), gate.dtype());
    crate::cpu::activation::swiglu_into(&mut dst, gate, up)?;
    Ok(dst)
}

/// `dst = silu(gate)·up`.
pub fn swiglu_into(dst: &mut Tensor, gate: &Tensor, up: &Tensor) -> Result<()> {
    const OP: &str = "ops::swiglu";
    same_layout(OP, gate, up)?;
    want_float(OP, gate)?;
    check_dst(OP, dst, gate.shape(), gate.dtype())?;
    dispatch!(OP, mut dst, [gate, up] => {
        let y = device::swiglu(&gate, &up)?;
        crate::dispatch::replace(OP, dst, y)
    });
    crate::cpu::activation::swiglu_into(dst, gate, up)
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
    want_float(OP, gate)?;
    check_dst(OP, d_gate, gate.shape(), gate.dtype())?;
    check_dst(OP, d_up, gate.shape(), gate.dtype())?;
    if crate::dispatch::on_cuda(OP, &[&*d_gate, &*d_up, dy, gate, up])? {
        return swiglu_backward_cuda(d_gate, d_up, dy, gate, up, accum);
    }
    crate::cpu::activation::swiglu_backward_into(d_gate, d_up, dy, gate, up, accum)
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
            device::swiglu_backward_into(dg, du, &dy, &gate, &up, accum)
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

/// The device launches (`cuda/kernels/activation.cu`), one thread per element, on operands
/// the front door has checked; float dtypes only, as the host kernels.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{func, grid_for, launch_kernel};
    use crate::cuda::{source, CudaTensor};
    use crate::ops::accum_flag;
    use crate::spec::Accum;
    use crate::Result;

    /// `root(x)` into a new tensor.
    pub(super) fn unary(op: &'static str, root: &str, x: &CudaTensor) -> Result<CudaTensor> {
        let dev = x.device();
        let mut out = CudaTensor::uninit(dev, x.shape(), x.dtype())?;
        let n = x.numel();
        if n > 0 {
            let f = func(dev, &source::ACTIVATION, root, x.dtype())?;
            launch_kernel!(op, dev, f, grid_for(n); src x, dst &mut out, u64 n)?;
        }
        Ok(out)
    }

    /// `dx (=|+=) root(dy, x)`.
    pub(super) fn unary_back(
        op: &'static str,
        root: &str,
        dx: &mut CudaTensor,
        dy: &CudaTensor,
        x: &CudaTensor,
        accum: Accum,
    ) -> Result<()> {
        let n = x.numel();
        if n == 0 {
            return Ok(());
        }
        let dev = x.device().clone();
        let f = func(&dev, &source::ACTIVATION, root, x.dtype())?;
        launch_kernel!(op, dev, f, grid_for(n); dst dx, src dy, src x, u64 n, int accum_flag(accum))
    }

    pub(super) fn swiglu(gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
        const OP: &str = "ops::swiglu";
        let dev = gate.device();
        let mut out = CudaTensor::uninit(dev, gate.shape(), gate.dtype())?;
        let n = gate.numel();
        if n > 0 {
            let f = func(dev, &source::ACTIVATION, "swiglu", gate.dtype())?;
            launch_kernel!(OP, dev, f, grid_for(n); src gate, src up, dst &mut out, u64 n)?;
        }
        Ok(out)
    }

    pub(super) fn swiglu_backward_into(
        d_gate: &mut CudaTensor,
        d_up: &mut CudaTensor,
        dy: &CudaTensor,
        gate: &CudaTensor,
        up: &CudaTensor,
        accum: Accum,
    ) -> Result<()> {
        const OP: &str = "ops::swiglu_backward";
        let n = gate.numel();
        if n == 0 {
            return Ok(());
        }
        let dev = gate.device().clone();
        let f = func(&dev, &source::ACTIVATION, "swiglu_backward", gate.dtype())?;
        launch_kernel!(OP, dev, f, grid_for(n);
            dst d_gate, dst d_up, src dy, src gate, src up, u64 n, int accum_flag(accum))
    }
}
