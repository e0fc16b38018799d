//! Reductions along one dim. The reduced dim is **removed** (PyTorch's `keepdim=False`):
//! `[a, e, b]` reduced over dim 1 gives `[a, b]`; a 1-D tensor gives a scalar (`[]`). To keep
//! it, `reshape` the result (a free shape change).
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`sum_dim`] | `Σ_e x[.., e, ..]`, in index order, in the compute type, rounded once | [`sum_dim_backward`]: `dy` broadcast along the restored dim |
//! | [`max_dim`] | values and `i64` argmax (the first maximum; a NaN wins, as in PyTorch) | [`max_dim_backward`]: `dy` placed at the argmax, zeros elsewhere |

use crate::spec::reduction::*;
use crate::{Result, Tensor};

/// The sum over `dim`, which is removed from the shape.
pub fn sum_dim(x: &Tensor, dim: usize) -> Result<Tensor> {
    const OP: &str = "ops::sum_dim";
    let (outer, extent, inner, shape) = split(OP, x, dim)?;
    dispatch!(OP, [x] => crate::cuda::ops::sum_dim(&x, dim));
    crate::cpu::reduction::sum_dim(x, dim, outer, extent, inner, shape)
}

/// The input gradient of [`sum_dim`]: `dy` repeated `extent` times along a new dim `dim`.
pub fn sum_dim_backward(dy: &Tensor, dim: usize, extent: usize) -> Result<Tensor> {
    const OP: &str = "ops::sum_dim_backward";
    let shape = restored(OP, dy, dim, extent)?;
    dispatch!(OP, [dy] => crate::cuda::ops::sum_dim_backward(&dy, dim, extent));
    crate::cpu::reduction::sum_dim_backward(dy, dim, extent, shape)
}

/// The maximum over `dim` (removed from the shape) and its index. Ties give the first index;
/// a NaN is the maximum of any slice that holds one (the first NaN's index).
pub fn max_dim(x: &Tensor, dim: usize) -> Result<MaxDim> {
    const OP: &str = "ops::max_dim";
    let (outer, extent, inner) = max_split(OP, x.shape(), dim)?;
    dispatch!(OP, [x] => crate::cuda::ops::max_dim(&x, dim));
    crate::cpu::reduction::max_dim(x, dim, outer, extent, inner)
}

/// The input gradient of [`max_dim`]: `dy` at each argmax along a new dim `dim` of
/// `extent`, zeros elsewhere. `indices` is [`MaxDim::indices`] (`i64`, `dy`'s shape).
pub fn max_dim_backward(
    dy: &Tensor,
    indices: &Tensor,
    dim: usize,
    extent: usize,
) -> Result<Tensor> {
    const OP: &str = "ops::max_dim_backward";
    let shape = restored(OP, dy, dim, extent)?;
    check_indices(OP, dy, indices)?;
    dispatch!(OP, [dy, indices] => crate::cuda::ops::max_dim_backward(&dy, &indices, dim, extent));
    crate::cpu::reduction::max_dim_backward(dy, indices, dim, extent, shape)
}
