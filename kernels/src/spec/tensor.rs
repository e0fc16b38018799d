//! The checks of [`Tensor`]'s own methods (narrow, split, cat, pack, elementwise), shared
//! by the front door and the host kernels.

use crate::shape::checked_sum;
use crate::{Error, Result, Shape, Tensor};
use smallvec::SmallVec;

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

/// The shape of `tensors` concatenated along `dim`, or the error: no tensors, `dim` not a dim
/// of the first, a dtype or another dim that differs from the first's, or extents whose sum
/// overflows.
pub(crate) fn check_cat(tensors: &[Tensor], dim: usize) -> Result<Shape> {
    const OP: &str = "Tensor::cat";
    let first = tensors.first().ok_or(Error::Invalid {
        op: OP,
        detail: "no tensors to concatenate".into(),
    })?;
    check_dim(first, OP, dim)?;
    for t in tensors {
        if t.dtype() != first.dtype() {
            return Err(Error::DTypeMismatch {
                op: OP,
                lhs: first.dtype(),
                rhs: t.dtype(),
            });
        }
        let same_rest = t.rank() == first.rank()
            && (0..t.rank()).all(|d| d == dim || t.shape[d] == first.shape[d]);
        if !same_rest {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: first.shape.clone(),
                rhs: t.shape.clone(),
            });
        }
    }
    let mut shape = first.shape.clone();
    let extents: SmallVec<[usize; 8]> = tensors.iter().map(|t| t.shape[dim]).collect();
    shape[dim] = checked_sum(&extents).ok_or_else(|| Error::Invalid {
        op: OP,
        detail: format!("extents {extents:?} of dim {dim} overflow usize when added"),
    })?;
    Ok(shape)
}
