//! LayerNorm and RMSNorm over the last dim, with the statistics backward needs.
//!
//! Per row of `n` features (`x̂` the normalized input, `g = dy·w`, means over the row):
//!
//! | op | forward | saved | backward |
//! |---|---|---|---|
//! | [`layer_norm`] | `μ = mean x`, `σ² = mean (x − μ)²` (biased), `rstd = 1/√(σ² + eps)`, `x̂ = (x − μ)·rstd`, `y = x̂·w + b` | `mean`, `rstd` | `dx = rstd·(g − mean g − x̂·mean(g·x̂))`, `dw = Σ_rows dy·x̂`, `db = Σ_rows dy` |
//! | [`rms_norm`] | `rstd = 1/√(mean x² + eps)`, `x̂ = x·rstd`, `y = x̂·w` | `rstd` | `dx = rstd·(g − x̂·mean(g·x̂))`, `dw = Σ_rows dy·x̂` |
//!
//! `x` is `[.., n]`; `w` and `b` are `[n]` of `x`'s dtype. The saved statistics have `x`'s
//! leading shape (`[]` for a 1-D `x`) and the compute dtype ([`acc_dtype`](super::acc_dtype):
//! `f32` for `f32`/`bf16`/`f16`, `f64` for `f64`), so a half-precision backward sees
//! unrounded statistics. The variance is two-pass (no `E[x²] − E[x]²` cancellation). The
//! weight and bias gradients are summed over rows in row order in the compute type and
//! rounded once. Under sequence parallelism they are partial sums: reduce them across ranks.

use super::same_layout;
use crate::spec::norm::*;
use crate::{Result, Tensor};

/// LayerNorm over the last dim: `y = (x − mean)·rstd·weight + bias`.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<LayerNormOutput> {
    const OP: &str = "ops::layer_norm";
    let (rows, n) = check_input(OP, x, &[weight, bias])?;
    dispatch!(OP, [x, weight, bias] => device::layer_norm(&x, &weight, &bias, eps, rows, n));
    crate::cpu::norm::layer_norm(x, weight, bias, eps, n)
}

/// The gradients of [`layer_norm`] from the output gradient `dy`, the input `x`, the weight
/// and the saved `mean` / `rstd`.
pub fn layer_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
) -> Result<LayerNormGrads> {
    const OP: &str = "ops::layer_norm_backward";
    let (rows, n) = check_input(OP, x, &[weight])?;
    same_layout(OP, x, dy)?;
    check_stat(OP, x, mean)?;
    check_stat(OP, x, rstd)?;
    dispatch!(OP, [dy, x, weight, mean, rstd] =>
        device::layer_norm_backward(&dy, &x, &weight, &mean, &rstd, rows, n));
    crate::cpu::norm::layer_norm_backward(dy, x, weight, mean, rstd, n)
}

/// RMSNorm over the last dim: `y = x·rstd·weight`, `rstd = 1/√(mean x² + eps)`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<RmsNormOutput> {
    const OP: &str = "ops::rms_norm";
    let (rows, n) = check_input(OP, x, &[weight])?;
    dispatch!(OP, [x, weight] => device::rms_norm(&x, &weight, eps, rows, n));
    crate::cpu::norm::rms_norm(x, weight, eps, n)
}

/// The gradients of [`rms_norm`] from the output gradient `dy`, the input `x`, the weight
/// and the saved `rstd`.
pub fn rms_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
) -> Result<RmsNormGrads> {
    const OP: &str = "ops::rms_norm_backward";
    let (rows, n) = check_input(OP, x, &[weight])?;
    same_layout(OP, x, dy)?;
    check_stat(OP, x, rstd)?;
    dispatch!(OP, [dy, x, weight, rstd] => device::rms_norm_backward(&dy, &x, &weight, &rstd, rows, n));
    crate::cpu::norm::rms_norm_backward(dy, x, weight, rstd, n)
}

/// The device launches (`cuda/kernels/norm.cu`), on operands the front door has checked:
/// one block per row, the statistics in the compute dtype.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{func, grid_for, launch_kernel, per_row, Acc};
    use crate::cuda::{source, CudaTensor};
    use crate::spec::acc_dtype;
    use crate::spec::norm::*;
    use crate::Result;

    pub(super) fn layer_norm(
        x: &CudaTensor,
        w: &CudaTensor,
        b: &CudaTensor,
        eps: f64,
        rows: usize,
        n: usize,
    ) -> Result<LayerNormOutput> {
        const OP: &str = "ops::layer_norm";
        let dev = x.device();
        let (lead, ad) = (&x.shape()[..x.rank() - 1], acc_dtype(x.dtype()));
        let mut y = CudaTensor::uninit(dev, x.shape(), x.dtype())?;
        let mut mean = CudaTensor::uninit(dev, lead, ad)?;
        let mut rstd = CudaTensor::uninit(dev, lead, ad)?;
        if rows > 0 {
            let f = func(dev, &source::NORM, "layer_norm", x.dtype())?;
            launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?;
                dst &mut y, dst &mut mean, dst &mut rstd, src x, src w, src b, u64 n,
                acc Acc::lit(x.dtype(), eps))?;
        }
        Ok(LayerNormOutput {
            y: y.into(),
            mean: mean.into(),
            rstd: rstd.into(),
        })
    }

    pub(super) fn rms_norm(
        x: &CudaTensor,
        w: &CudaTensor,
        eps: f64,
        rows: usize,
        n: usize,
    ) -> Result<RmsNormOutput> {
        const OP: &str = "ops::rms_norm";
        let dev = x.device();
        let (lead, ad) = (&x.shape()[..x.rank() - 1], acc_dtype(x.dtype()));
        let mut y = CudaTensor::uninit(dev, x.shape(), x.dtype())?;
        let mut rstd = CudaTensor::uninit(dev, lead, ad)?;
        if rows > 0 {
            let f = func(dev, &source::NORM, "rms_norm", x.dtype())?;
            launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?;
                dst &mut y, dst &mut rstd, src x, src w, u64 n, acc Acc::lit(x.dtype(), eps))?;
        }
        Ok(RmsNormOutput {
            y: y.into(),
            rstd: rstd.into(),
        })
    }

    /// `dx` one block per row, `dweight` (and `dbias`) one thread per feature, summed over
    /// the rows in row order; with no rows the parameter gradients are zero sums.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn layer_norm_backward(
        dy: &CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
        mean: &CudaTensor,
        rstd: &CudaTensor,
        rows: usize,
        n: usize,
    ) -> Result<LayerNormGrads> {
        const OP: &str = "ops::layer_norm_backward";
        let (dev, dt) = (x.device(), x.dtype());
        let mut dx = CudaTensor::uninit(dev, x.shape(), dt)?;
        if rows == 0 {
            return Ok(LayerNormGrads {
                dx: dx.into(),
                dweight: CudaTensor::zeros(dev, &[n], dt)?.into(),
                dbias: CudaTensor::zeros(dev, &[n], dt)?.into(),
            });
        }
        let mut dw = CudaTensor::uninit(dev, &[n], dt)?;
        let mut db = CudaTensor::uninit(dev, &[n], dt)?;
        let f = func(dev, &source::NORM, "layer_norm_backward_dx", dt)?;
        launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?;
            dst &mut dx, src dy, src x, src w, src mean, src rstd, u64 n)?;
        let f = func(dev, &source::NORM, "layer_norm_backward_dw", dt)?;
        launch_kernel!(OP, dev, f, grid_for(n);
            dst &mut dw, dst &mut db, src dy, src x, src mean, src rstd, u64 rows, u64 n)?;
        Ok(LayerNormGrads {
            dx: dx.into(),
            dweight: dw.into(),
            dbias: db.into(),
        })
    }

    /// As [`layer_norm_backward`], without the mean and the bias.
    pub(super) fn rms_norm_backward(
        dy: &CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
        rstd: &CudaTensor,
        rows: usize,
        n: usize,
    ) -> Result<RmsNormGrads> {
        const OP: &str = "ops::rms_norm_backward";
        let (dev, dt) = (x.device(), x.dtype());
        let mut dx = CudaTensor::uninit(dev, x.shape(), dt)?;
        if rows == 0 {
            return Ok(RmsNormGrads {
                dx: dx.into(),
                dweight: CudaTensor::zeros(dev, &[n], dt)?.into(),
            });
        }
        let mut dw = CudaTensor::uninit(dev, &[n], dt)?;
        let f = func(dev, &source::NORM, "rms_norm_backward_dx", dt)?;
        launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?;
            dst &mut dx, src dy, src x, src w, src rstd, u64 n)?;
        let f = func(dev, &source::NORM, "rms_norm_backward_dw", dt)?;
        launch_kernel!(OP, dev, f, grid_for(n);
            dst &mut dw, src dy, src x, src rstd, u64 rows, u64 n)?;
        Ok(RmsNormGrads {
            dx: dx.into(),
            dweight: dw.into(),
        })
    }
}
