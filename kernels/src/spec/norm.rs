//! LayerNorm and RMSNorm: outputs, gradients, and the checks of inputs and saved statistics.

use super::*;

/// What [`layer_norm`](crate::ops::layer_norm) returns: the output and the per-row statistics its backward takes.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormOutput {
    /// The normalized output, `x`'s shape and dtype.
    pub y: Tensor,
    /// Per-row mean, shape `x.shape()[..rank-1]`, compute dtype.
    pub mean: Tensor,
    /// Per-row `1/√(var + eps)`, shape `x.shape()[..rank-1]`, compute dtype.
    pub rstd: Tensor,
}

/// The gradients of [`layer_norm`](crate::ops::layer_norm).
#[derive(Clone, Debug, PartialEq)]
pub struct LayerNormGrads {
    /// The input gradient, `x`'s shape and dtype.
    pub dx: Tensor,
    /// The weight gradient `Σ_rows dy·x̂`, `[n]` in `x`'s dtype (summed over this rank's
    /// rows only: under sequence parallelism a partial sum to reduce across ranks).
    pub dweight: Tensor,
    /// The bias gradient `Σ_rows dy`, `[n]` in `x`'s dtype (a partial sum under sequence
    /// parallelism, as `dweight`).
    pub dbias: Tensor,
}

/// What [`rms_norm`](crate::ops::rms_norm) returns: the output and the per-row statistic its backward takes.
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormOutput {
    /// The normalized output, `x`'s shape and dtype.
    pub y: Tensor,
    /// Per-row `1/√(mean x² + eps)`, shape `x.shape()[..rank-1]`, compute dtype.
    pub rstd: Tensor,
}

/// The gradients of [`rms_norm`](crate::ops::rms_norm).
#[derive(Clone, Debug, PartialEq)]
pub struct RmsNormGrads {
    /// The input gradient, `x`'s shape and dtype.
    pub dx: Tensor,
    /// The weight gradient `Σ_rows dy·x̂`, `[n]` in `x`'s dtype (summed over this rank's
    /// rows only: under sequence parallelism a partial sum to reduce across ranks).
    pub dweight: Tensor,
}

/// Checks `x` and the `[n]` parameters; returns `x` as `(rows, n)` over its last dim.
pub(crate) fn check_input(
    op: &'static str,
    x: &Tensor,
    params: &[&Tensor],
) -> Result<(usize, usize)> {
    let (rows, n) = norm_rows(op, x)?;
    for p in params {
        check_row_param(op, x, *p, n)?;
    }
    Ok((rows, n))
}

/// Checks `x` (float, rank ≥ 1, a nonempty last dim); returns it as `(rows, n)` over its
/// last dim.
pub(crate) fn norm_rows<L: Layout + ?Sized>(op: &'static str, x: &L) -> Result<(usize, usize)> {
    let (rows, n) = rows_last(op, x)?;
    want_float(op, x)?;
    if n == 0 {
        return Err(Error::Invalid {
            op,
            detail: format!(
                "cannot normalize over an empty last dim (x shape {:?})",
                x.shape()
            ),
        });
    }
    Ok((rows, n))
}

/// Checks a saved statistic against `x`: leading shape, compute dtype.
pub(crate) fn check_stat<L: Layout + ?Sized>(op: &'static str, x: &L, stat: &L) -> Result<()> {
    let lead = &x.shape()[..x.rank() - 1];
    check_dst(op, stat, lead, acc_dtype(x.dtype()))
}
