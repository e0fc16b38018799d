//! Softmax and log-softmax along the last dim, max-subtracted (no overflow for any finite
//! input), with their backward from the forward *output*.
//!
//! | op | forward (per row, `m = max x`, `s = Σ exp(x − m)`) | backward (`dy`, forward output `y`) |
//! |---|---|---|
//! | [`softmax`] | `y = exp(x − m) / s` | `dx = y·(dy − Σ dy·y)` |
//! | [`log_softmax`] | `y = x − m − ln s` | `dx = dy − exp(y)·Σ dy` |
//!
//! `-inf` entries (masks) get probability 0. A row that is all `-inf` has no distribution and
//! gives NaN, as in PyTorch; a NaN anywhere in a row makes the row NaN. Rows are computed in
//! the compute type and rounded once.

use super::{check_dst, rows_last, same_layout, want_float, Accum};
use crate::cpu::softmax::Kind;
use crate::{Result, Tensor};

fn forward_into(op: &'static str, dst: &mut Tensor, x: &Tensor, kind: Kind) -> Result<()> {
    let (rows, n) = rows_last(op, x)?;
    want_float(op, x)?;
    check_dst(op, dst, x.shape(), x.dtype())?;
    dispatch!(op, mut dst, [x] => device::forward_into(op, kind, dst, &x, rows, n));
    crate::cpu::softmax::forward_into(op, dst, x, kind, n)
}

fn forward(op: &'static str, x: &Tensor, kind: Kind) -> Result<Tensor> {
    let (rows, n) = rows_last(op, x)?;
    want_float(op, x)?;
    dispatch!(op, [x] => device::forward(op, kind, &x, rows, n));
    let mut dst = Tensor::zeros(x.shape(), x.dtype());
    crate::cpu::softmax::forward_into(op, &mut dst, x, kind, n)?;
    Ok(dst)
}

fn backward_into(
    op: &'static str,
    dx: &mut Tensor,
    dy: &Tensor,
    y: &Tensor,
    kind: Kind,
    accum: Accum,
) -> Result<()> {
    let (rows, n) = rows_last(op, y)?;
    same_layout(op, dy, y)?;
    want_float(op, y)?;
    check_dst(op, dx, y.shape(), y.dtype())?;
    dispatch!(op, mut dx, [dy, y] => device::backward(op, kind, dx, &dy, &y, accum, rows, n));
    crate::cpu::softmax::backward_into(op, dx, dy, y, kind, accum, n)
}

/// Softmax along the last dim: `exp(x − max) / Σ exp(x − max)` per row.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    forward("ops::softmax", x, Kind::Softmax)
}

/// [`softmax`] into `dst` (same shape and dtype as `x`).
pub fn softmax_into(dst: &mut Tensor, x: &Tensor) -> Result<()> {
    forward_into("ops::softmax", dst, x, Kind::Softmax)
}

/// `dx = y·(dy − Σ_row dy·y)`, where `y = softmax(x)` is the forward output.
pub fn softmax_backward(dy: &Tensor, y: &Tensor) -> Result<Tensor> {
    crate::dispatch::on_cuda("ops::softmax_backward", &[dy, y])?;
    // Where `y` is (on a device the kernel writes every element: `Replace`).
    let mut dx = y.zeros_like()?;
    softmax_backward_into(&mut dx, dy, y, Accum::Replace)?;
    Ok(dx)
}

/// [`softmax_backward`] into `dx`, replacing or adding to it.
pub fn softmax_backward_into(dx: &mut Tensor, dy: &Tensor, y: &Tensor, accum: Accum) -> Result<()> {
    backward_into("ops::softmax_backward", dx, dy, y, Kind::Softmax, accum)
}

/// Log-softmax along the last dim: `x − max − ln Σ exp(x − max)` per row.
pub fn log_softmax(x: &Tensor) -> Result<Tensor> {
    forward("ops::log_softmax", x, Kind::LogSoftmax)
}

/// [`log_softmax`] into `dst` (same shape and dtype as `x`).
pub fn log_softmax_into(dst: &mut Tensor, x: &Tensor) -> Result<()> {
    forward_into("ops::log_softmax", dst, x, Kind::LogSoftmax)
}

/// `dx = dy − exp(y)·Σ_row dy`, where `y = log_softmax(x)` is the forward output.
pub fn log_softmax_backward(dy: &Tensor, y: &Tensor) -> Result<Tensor> {
    crate::dispatch::on_cuda("ops::log_softmax_backward", &[dy, y])?;
    let mut dx = y.zeros_like()?;
    log_softmax_backward_into(&mut dx, dy, y, Accum::Replace)?;
    Ok(dx)
}

/// [`log_softmax_backward`] into `dx`, replacing or adding to it.
pub fn log_softmax_backward_into(
    dx: &mut Tensor,
    dy: &Tensor,
    y: &Tensor,
    accum: Accum,
) -> Result<()> {
    backward_into(
        "ops::log_softmax_backward",
        dx,
        dy,
        y,
        Kind::LogSoftmax,
        accum,
    )
}

/// The device launches (`cuda/kernels/softmax.cu`): one block per row of `n`, on operands
/// the front door has checked; float dtypes only, as the host kernels.
#[cfg(feature = "cuda")]
mod device {
    use crate::cpu::softmax::Kind;
    use crate::cuda::launch::{func, launch_kernel, per_row};
    use crate::cuda::{source, CudaTensor};
    use crate::ops::accum_flag;
    use crate::spec::Accum;
    use crate::Result;

    pub(super) fn forward(
        op: &'static str,
        kind: Kind,
        x: &CudaTensor,
        rows: usize,
        n: usize,
    ) -> Result<CudaTensor> {
        let dev = x.device();
        let mut y = CudaTensor::uninit(dev, x.shape(), x.dtype())?;
        if rows * n > 0 {
            let root = match kind {
                Kind::Softmax => "softmax",
                Kind::LogSoftmax => "log_softmax",
            };
            let f = func(dev, &source::SOFTMAX, root, x.dtype())?;
            launch_kernel!(op, dev, f, per_row(op, rows, 0)?; src x, dst &mut y, u64 n)?;
        }
        Ok(y)
    }

    /// `dx (=|+=)` the backward from the forward output `y`.
    /// [`forward`] computed out of place, its result replacing `dst`'s buffer.
    pub(super) fn forward_into(
        op: &'static str,
        kind: Kind,
        dst: &mut CudaTensor,
        x: &CudaTensor,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        let y = forward(op, kind, x, rows, n)?;
        crate::dispatch::replace(op, dst, y)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn backward(
        op: &'static str,
        kind: Kind,
        dx: &mut CudaTensor,
        dy: &CudaTensor,
        y: &CudaTensor,
        accum: Accum,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        if rows * n == 0 {
            return Ok(());
        }
        let root = match kind {
            Kind::Softmax => "softmax_backward",
            Kind::LogSoftmax => "log_softmax_backward",
        };
        let dev = y.device().clone();
        let f = func(&dev, &source::SOFTMAX, root, y.dtype())?;
        launch_kernel!(op, dev, f, per_row(op, rows, 0)?;
            dst dx, src dy, src y, u64 n, int accum_flag(accum))
    }
}
