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

use super::{check_dst, rows_last, same_layout, Accum};
use crate::cpu::softmax::Kind;
use crate::{Result, Tensor};

fn forward_into(op: &'static str, dst: &mut Tensor, x: &Tensor, kind: Kind) -> Result<()> {
    let (_, n) = rows_last(op, x)?;
    check_dst(op, dst, x.shape(), x.dtype())?;
    dispatch!(op, mut dst, [x] => {
        let y = match kind {
            Kind::Softmax => crate::cuda::ops::softmax(&x)?,
            Kind::LogSoftmax => crate::cuda::ops::log_softmax(&x)?,
        };
        crate::dispatch::replace(op, dst, y)
    });
    crate::cpu::softmax::forward_into(op, dst, x, kind, n)
}

fn backward_into(
    op: &'static str,
    dx: &mut Tensor,
    dy: &Tensor,
    y: &Tensor,
    kind: Kind,
    accum: Accum,
) -> Result<()> {
    let (_, n) = rows_last(op, y)?;
    same_layout(op, dy, y)?;
    check_dst(op, dx, y.shape(), y.dtype())?;
    dispatch!(op, mut dx, [dy, y] => match kind {
        Kind::Softmax => crate::cuda::ops::softmax_backward_into(dx, &dy, &y, accum),
        Kind::LogSoftmax => crate::cuda::ops::log_softmax_backward_into(dx, &dy, &y, accum),
    });
    crate::cpu::softmax::backward_into(op, dx, dy, y, kind, accum, n)
}

/// Softmax along the last dim: `exp(x − max) / Σ exp(x − max)` per row.
pub fn softmax(x: &Tensor) -> Result<Tensor> {
    dispatch!("ops::softmax", [x] => crate::cuda::ops::softmax(&x));
    let mut dst = Tensor::zeros(x.shape(), x.dtype());
    softmax_into(&mut dst, x)?;
    Ok(dst)
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
    dispatch!("ops::log_softmax", [x] => crate::cuda::ops::log_softmax(&x));
    let mut dst = Tensor::zeros(x.shape(), x.dtype());
    log_softmax_into(&mut dst, x)?;
    Ok(dst)
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
