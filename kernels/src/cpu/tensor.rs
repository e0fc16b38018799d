//! The host kernels of [`Tensor`]'s own methods: copies along a dim, elementwise
//! arithmetic and dtype conversion, on host tensors. Each says what it relies on and which
//! check of the front door (`crate::ops::tensor`) ensures it.

use crate::dtype::{DType, Element, Slice, SliceMut};
use crate::error::Result;
use crate::shape::numel;
use crate::storage::tensor::typed_as;
use crate::{with_slice, Shape, Tensor};

/// The host half of [`Tensor::try_to_dtype`]: any dtype to any, nothing to rely on.
pub(crate) fn try_to_dtype(x: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(host_to_dtype(x, dtype))
}

pub(crate) fn host_to_dtype(x: &Tensor, dtype: DType) -> Tensor {
    let vals = x.to_f64_vec();
    let mut out = Tensor::for_overwrite(&x.shape, dtype);
    with_slice!(SliceMut, out.as_dyn_slice_mut(), |s: T| {
        for (d, v) in s.iter_mut().zip(&vals) {
            *d = <T as Element>::from_f64(*v);
        }
    });
    out
}

/// `(outer, extent, inner)`: the tensor seen as `[outer, shape[dim], inner]`.
pub(crate) fn split_at_dim(x: &Tensor, dim: usize) -> (usize, usize, usize) {
    let outer = numel(&x.shape[..dim]);
    let inner = numel(&x.shape[dim + 1..]);
    (outer, x.shape[dim], inner)
}

/// The host half of [`Tensor::narrow`]: relies on `dim` being a dim of `x`
/// (`spec::tensor::check_dim`) and `start + len` (no overflow) within its extent, as the
/// front door checks.
pub(crate) fn narrow(x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
    let (outer, extent, inner) = split_at_dim(x, dim);
    let mut shape = x.shape.clone();
    shape[dim] = len;
    if outer == 1 {
        // The range is contiguous: a view, no copy.
        return Ok(Tensor {
            shape,
            storage: x.storage.clone(),
            offset: x.offset + start * inner,
        });
    }
    let mut out = Tensor::for_overwrite(&shape, x.dtype());
    copy_blocks(
        x.as_dyn_slice(),
        out.as_dyn_slice_mut(),
        outer,
        len * inner,
        extent * inner,
        start * inner,
        len * inner,
        0,
    );
    Ok(out)
}

/// The host half of [`Tensor::cat`]: relies on `tensors` being nonempty, of one dtype and
/// rank, alike but along `dim` (a dim of theirs), and `shape` being their concatenation, as
/// `spec::tensor::check_cat` in the front door ensures.
pub(crate) fn cat(tensors: &[Tensor], dim: usize, shape: Shape) -> Result<Tensor> {
    let first = &tensors[0];
    let mut out = Tensor::for_overwrite_checked("Tensor::cat", &shape, first.dtype())?;
    let (outer, total, inner) = split_at_dim(&out, dim);
    let mut offset = 0;
    for t in tensors {
        let len = t.shape[dim];
        copy_blocks(
            t.as_dyn_slice(),
            out.as_dyn_slice_mut(),
            outer,
            len * inner,
            len * inner,
            0,
            total * inner,
            offset * inner,
        );
        offset += len;
    }
    Ok(out)
}

/// The host half of [`Tensor::pack`]: relies on `dim` being a dim of `x` and `sizes` adding
/// up to its extent, as `spec::tensor::check_tensor_pieces` in the front door ensures.
pub(crate) fn pack(x: &Tensor, dim: usize, sizes: &[usize]) -> Result<Tensor> {
    let (outer, extent, inner) = split_at_dim(x, dim);
    let mut out = Tensor::for_overwrite(&[x.numel()], x.dtype());
    let src = x.as_dyn_slice();
    with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| {
        let s: &[T] = typed_as(src);
        piece_runs(outer, extent, inner, sizes, |t, p, run| {
            d[p..p + run].copy_from_slice(&s[t..t + run])
        });
    });
    Ok(out)
}

/// The host half of [`Tensor::unpack`]: relies on `dim` being a dim of `shape`, `shape`
/// holding exactly `flat`'s elements and `sizes` adding up to `shape[dim]`, as the front door
/// checks.
pub(crate) fn unpack(
    flat: &Tensor,
    shape: &[usize],
    dim: usize,
    sizes: &[usize],
) -> Result<Tensor> {
    let inner: usize = numel(&shape[dim + 1..]);
    let outer: usize = numel(&shape[..dim]);
    let extent = shape[dim];
    let mut out = Tensor::for_overwrite(shape, flat.dtype());
    let src = flat.as_dyn_slice();
    with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| {
        let s: &[T] = typed_as(src);
        piece_runs(outer, extent, inner, sizes, |t, p, run| {
            d[t..t + run].copy_from_slice(&s[p..p + run])
        });
    });
    Ok(out)
}

/// The host half of [`Tensor::add`]: relies on `other` having `a`'s dtype and shape
/// (`spec::tensor::check_same` in the front door).
pub(crate) fn add(a: &Tensor, other: &Tensor) -> Result<Tensor> {
    let mut out = a.clone();
    add_assign(&mut out, other)?;
    Ok(out)
}

/// The host half of [`Tensor::add_assign`]: relies on `other` having `dst`'s dtype and shape
/// (`spec::tensor::check_same` in the front door).
pub(crate) fn add_assign(dst: &mut Tensor, other: &Tensor) -> Result<()> {
    let src = other.as_dyn_slice();
    with_slice!(SliceMut, dst.as_dyn_slice_mut(), |d: T| {
        let s: &[T] = typed_as(src);
        for (a, &b) in d.iter_mut().zip(s) {
            *a = a.add(b);
        }
    });
    Ok(())
}

/// The host half of [`Tensor::try_scale`]: any tensor, nothing to rely on.
pub(crate) fn try_scale(x: &Tensor, factor: f64) -> Result<Tensor> {
    let mut out = x.clone();
    with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| {
        let f = <T as Element>::from_f64(factor);
        for a in d.iter_mut() {
            *a = a.mul(f);
        }
    });
    Ok(out)
}

/// The host half of [`Tensor::try_map`]: any tensor, nothing to rely on.
pub(crate) fn try_map(x: &Tensor, f: impl Fn(f64) -> f64) -> Result<Tensor> {
    let mut out = x.clone();
    with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| {
        for a in d.iter_mut() {
            *a = <T as Element>::from_f64(f(a.to_f64()));
        }
    });
    Ok(out)
}

/// The host half of [`Tensor::mul`]: relies on `other` having `a`'s dtype and shape
/// (`spec::tensor::check_same` in the front door).
pub(crate) fn mul(a: &Tensor, other: &Tensor) -> Result<Tensor> {
    let mut out = a.clone();
    let src = other.as_dyn_slice();
    with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| {
        let s: &[T] = typed_as(src);
        for (a, &b) in d.iter_mut().zip(s) {
            *a = a.mul(b);
        }
    });
    Ok(out)
}

/// The host half of [`Tensor::write_at`]: relies on `dim` being a dim of `dst`, `src` having
/// `dst`'s rank, dtype and other dims, and `start + src.shape[dim]` (no overflow) within
/// `dst`'s extent, as the front door checks.
pub(crate) fn write_at(dst: &mut Tensor, dim: usize, start: usize, src: &Tensor) -> Result<()> {
    let (outer, extent, inner) = split_at_dim(dst, dim);
    let len = src.shape[dim];
    copy_blocks(
        src.as_dyn_slice(),
        dst.as_dyn_slice_mut(),
        outer,
        len * inner,
        len * inner,
        0,
        extent * inner,
        start * inner,
    );
    Ok(())
}

/// The contiguous runs of the pieces of a dim (extents `sizes`) in a tensor seen as
/// `[outer, extent, inner]`, piece by piece: `f(offset in the tensor, offset in the packed
/// buffer, length)`. Pack copies tensor → buffer along these runs, unpack the reverse.
fn piece_runs(
    outer: usize,
    extent: usize,
    inner: usize,
    sizes: &[usize],
    mut f: impl FnMut(usize, usize, usize),
) {
    let (mut piece_base, mut start) = (0, 0);
    for &len in sizes {
        let run = len * inner;
        for o in 0..outer {
            f((o * extent + start) * inner, piece_base + o * run, run);
        }
        piece_base += outer * run;
        start += len;
    }
}

/// Copies `blocks` runs of `run` elements from `src` (stride `src_stride`, start
/// `src_off`) to `dst` (stride `dst_stride`, start `dst_off`). Both must share a dtype.
#[allow(clippy::too_many_arguments)]
fn copy_blocks(
    src: Slice<'_>,
    dst: SliceMut<'_>,
    blocks: usize,
    run: usize,
    src_stride: usize,
    src_off: usize,
    dst_stride: usize,
    dst_off: usize,
) {
    if run == 0 {
        return;
    }
    with_slice!(SliceMut, dst, |d: T| {
        let s: &[T] = typed_as(src);
        for b in 0..blocks {
            let so = src_off + b * src_stride;
            let d_o = dst_off + b * dst_stride;
            d[d_o..d_o + run].copy_from_slice(&s[so..so + run]);
        }
    });
}
