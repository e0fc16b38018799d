//! Reductions over one dim: the shapes they remove and restore, the argmax output and the
//! checks of its indices.

use super::*;
use crate::Shape;

/// `(outer, extent, inner)` of `x` around `dim`, and the shape with `dim` removed.
pub(crate) fn split(
    op: &'static str,
    x: &Tensor,
    dim: usize,
) -> Result<(usize, usize, usize, Shape)> {
    let (outer, extent, inner) = split_at(op, x.shape(), dim)?;
    Ok((outer, extent, inner, removed(x.shape(), dim)))
}

/// `(outer, extent, inner)`: `shape` seen as `[outer, shape[dim], inner]`.
pub(crate) fn split_at(
    op: &'static str,
    shape: &[usize],
    dim: usize,
) -> Result<(usize, usize, usize)> {
    if dim >= shape.len() {
        return Err(Error::DimOutOfRange {
            op,
            dim,
            shape: shape.into(),
        });
    }
    Ok((
        shape[..dim].iter().product(),
        shape[dim],
        shape[dim + 1..].iter().product(),
    ))
}

/// `shape` without `dim` (which must be in range).
pub(crate) fn removed(shape: &[usize], dim: usize) -> Shape {
    let mut s: Shape = shape.into();
    s.remove(dim);
    s
}

/// `dy.shape` with `extent` inserted at `dim` (the shape a reduction's input had).
pub(crate) fn restored<L: Layout + ?Sized>(
    op: &'static str,
    dy: &L,
    dim: usize,
    extent: usize,
) -> Result<Shape> {
    if dim > dy.rank() {
        return Err(Error::DimOutOfRange {
            op,
            dim,
            shape: dy.shape().into(),
        });
    }
    let mut s: Shape = dy.shape().into();
    s.insert(dim, extent);
    Ok(s)
}

/// [`max_dim`](crate::ops::max_dim)'s split of `shape` around `dim`: `Err` for an empty `dim` (no maximum).
pub(crate) fn max_split(
    op: &'static str,
    shape: &[usize],
    dim: usize,
) -> Result<(usize, usize, usize)> {
    let (outer, extent, inner) = split_at(op, shape, dim)?;
    if extent == 0 {
        return Err(Error::Invalid {
            op,
            detail: format!("no maximum over empty dim {dim} of shape {shape:?}"),
        });
    }
    Ok((outer, extent, inner))
}

/// [`max_dim_backward`]'s `indices`: `i64`, `dy`'s shape.
pub(crate) fn check_indices<L: Layout + ?Sized>(
    op: &'static str,
    dy: &L,
    indices: &L,
) -> Result<()> {
    if indices.dtype() != DType::I64 {
        return Err(Error::DTypeMismatch {
            op,
            lhs: indices.dtype(),
            rhs: DType::I64,
        });
    }
    if indices.shape() != dy.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: dy.shape().into(),
            rhs: indices.shape().into(),
        });
    }
    Ok(())
}

/// `Err` naming the first index of `ix` outside `0..extent`.
pub(crate) fn check_index_range(op: &'static str, ix: &[i64], extent: usize) -> Result<()> {
    if let Some((pos, &bad)) = ix
        .iter()
        .enumerate()
        .find(|(_, &e)| usize::try_from(e).map_or(true, |e| e >= extent))
    {
        return Err(Error::Invalid {
            op,
            detail: format!(
                "index {bad} at flat position {pos} is out of range for extent {extent}"
            ),
        });
    }
    Ok(())
}

/// What [`max_dim`](crate::ops::max_dim) returns.
#[derive(Clone, Debug, PartialEq)]
pub struct MaxDim {
    /// The maxima, `x`'s dtype, shape without `dim`.
    pub values: Tensor,
    /// Where along `dim` each maximum is (`i64`, same shape as `values`).
    pub indices: Tensor,
}
