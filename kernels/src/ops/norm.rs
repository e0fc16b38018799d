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
    let n = check_input(OP, x, &[weight, bias])?;
    dispatch!(OP, [x, weight, bias] => crate::cuda::ops::layer_norm(&x, &weight, &bias, eps)
        .map(crate::cuda::ops::NormOutput::into_layer));
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
    let n = check_input(OP, x, &[weight])?;
    same_layout(OP, x, dy)?;
    check_stat(OP, x, mean)?;
    check_stat(OP, x, rstd)?;
    dispatch!(OP, [dy, x, weight, mean, rstd] =>
        crate::cuda::ops::layer_norm_backward(&dy, &x, &weight, &mean, &rstd)
            .map(crate::cuda::ops::NormGrads::into_layer));
    crate::cpu::norm::layer_norm_backward(dy, x, weight, mean, rstd, n)
}

/// RMSNorm over the last dim: `y = x·rstd·weight`, `rstd = 1/√(mean x² + eps)`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<RmsNormOutput> {
    const OP: &str = "ops::rms_norm";
    let n = check_input(OP, x, &[weight])?;
    dispatch!(OP, [x, weight] => crate::cuda::ops::rms_norm(&x, &weight, eps)
        .map(crate::cuda::ops::NormOutput::into_rms));
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
    let n = check_input(OP, x, &[weight])?;
    same_layout(OP, x, dy)?;
    check_stat(OP, x, rstd)?;
    dispatch!(OP, [dy, x, weight, rstd] =>
        crate::cuda::ops::rms_norm_backward(&dy, &x, &weight, &rstd)
            .map(crate::cuda::ops::NormGrads::into_rms));
    crate::cpu::norm::rms_norm_backward(dy, x, weight, rstd, n)
}
