//! The optimizer's step on a parameter and its moments, where they are: AdamW
//! ([`adamw_step`]), in place, with the host's order of operations on both devices.

use crate::spec::optim::check_adamw;
pub use crate::spec::optim::{adamw_state_dtype, AdamWStep};
use crate::{Result, Tensor};

/// AdamW in place: `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
/// `w ← w − lr·((m/c1)/(√(v/c2) + eps) + decay·w)`, element by element (f32 arithmetic for
/// f32; f64 for f64 and for 16-bit parameters, rounded into `w` once). `g` has `w`'s shape
/// and dtype; `m` and `v` its shape and [`adamw_state_dtype`]. On a device, buffers shared
/// with other tensors are copied first (copy on write).
pub fn adamw_step(
    w: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    h: &AdamWStep,
) -> Result<()> {
    const OP: &str = "ops::adamw_step";
    check_adamw(OP, w, g, m, v)?;
    if crate::dispatch::on_cuda(OP, &[&*w, g, &*m, &*v])? {
        return adamw_step_cuda(w, g, m, v, h);
    }
    crate::cpu::optim::adamw_step(w, g, m, v, h)
}

/// [`adamw_step`] on the device (every tensor there, as the caller checked): the three
/// tensors it writes are moved out for the kernel and back.
#[cfg(feature = "cuda")]
fn adamw_step_cuda(
    w: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    h: &AdamWStep,
) -> Result<()> {
    let g = g.cuda_tensor()?;
    crate::dispatch::with_cuda_mut(w, |w| {
        crate::dispatch::with_cuda_mut(m, |m| {
            crate::dispatch::with_cuda_mut(v, |v| device::adamw_step(w, &g, m, v, h))
        })
    })
}

#[cfg(not(feature = "cuda"))]
fn adamw_step_cuda(
    _: &mut Tensor,
    _: &Tensor,
    _: &mut Tensor,
    _: &mut Tensor,
    _: &AdamWStep,
) -> Result<()> {
    unreachable!("no device tensor exists without the `cuda` feature")
}

/// The device launch (`cuda/kernels/optim.cu`), one thread per element.
#[cfg(feature = "cuda")]
mod device {
    use super::AdamWStep;
    use crate::cuda::launch::{func, grid_for, launch_kernel};
    use crate::cuda::{source, CudaTensor};
    use crate::Result;

    pub(super) fn adamw_step(
        w: &mut CudaTensor,
        g: &CudaTensor,
        m: &mut CudaTensor,
        v: &mut CudaTensor,
        h: &AdamWStep,
    ) -> Result<()> {
        const OP: &str = "ops::adamw_step";
        let n = w.numel();
        if n == 0 {
            return Ok(());
        }
        let dev = w.device().clone();
        let f = func(&dev, &source::OPTIM, "adamw", w.dtype())?;
        launch_kernel!(OP, dev, f, grid_for(n);
            dst w, src g, dst m, dst v, f64 h.lr, f64 h.beta1, f64 h.beta2, f64 h.eps,
            f64 h.decay, f64 h.c1, f64 h.c2, u64 n)
    }
}
