//! The checks of [`Tensor`]'s own methods (narrow, split, cat, pack, elementwise), shared
//! by the front door and the host kernels.

use crate::{Error, Result, Tensor};

/// `Err` unless `dim` is a dim of `x`.
pub(crate) fn check_dim(x: &Tensor, op: &'static str, dim: usize) -> Result<()> {
    if dim >= x.rank() {
        return Err(Error::DimOutOfRange {
            op,
            dim,
            shape: x.shape.clone(),
        });
    }
    Ok(())
}

/// `Err` unless the piece extents `sizes` of `dim` add up to its extent in `x`.
pub(crate) fn check_tensor_pieces(
    x: &Tensor,
    op: &'static str,
    dim: usize,
    sizes: &[usize],
) -> Result<()> {
    crate::shape::check_pieces(op, &x.shape, dim, sizes)
}

/// `Err` unless `other` has `x`'s dtype and shape (the elementwise methods).
pub(crate) fn check_same(x: &Tensor, op: &'static str, other: &Tensor) -> Result<()> {
    if x.dtype() != other.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: x.dtype(),
            rhs: other.dtype(),
        });
    }
    if x.shape != other.shape {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x.shape.clone(),
            rhs: other.shape.clone(),
        });
    }
    Ok(())
}
