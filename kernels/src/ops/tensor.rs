//! The front door of [`Tensor`]'s own methods (narrow, cat, pack, unpack, write_at,
//! elementwise arithmetic, dtype conversion): each checks its arguments, runs the device
//! kernel when the tensors are on a GPU, else the host kernel of `crate::cpu::tensor`.

use crate::error::{Error, Result};
use crate::shape::{checked_numel, checked_sum};
use crate::spec::tensor::{check_cat, check_dim, check_same, check_tensor_pieces};
use crate::{DType, Tensor};
use smallvec::SmallVec;

/// [`Tensor::try_to_dtype`]: its checks, then the device kernel or the host one.
pub(crate) fn try_to_dtype(x: &Tensor, dtype: DType) -> Result<Tensor> {
    dispatch!("Tensor::to_dtype", [x] => device::to_dtype(&x, dtype));
    crate::cpu::tensor::try_to_dtype(x, dtype)
}

/// [`Tensor::narrow`]: its checks, then the device kernel or the host one.
pub(crate) fn narrow(x: &Tensor, dim: usize, start: usize, len: usize) -> Result<Tensor> {
    check_dim(x, "Tensor::narrow", dim)?;
    // Checked: a wrapping `start + len` would pass and make a view outside this one.
    if start.checked_add(len).is_none_or(|end| end > x.shape[dim]) {
        return Err(Error::Invalid {
            op: "Tensor::narrow",
            detail: format!(
                "range {start}..{start}+{len} exceeds extent {} of dim {dim} in shape {:?}",
                x.shape[dim], x.shape
            ),
        });
    }
    // A device tensor starts at its buffer's start, so every narrow of it copies.
    dispatch!("Tensor::narrow", [x] => device::narrow(&x, dim, start, len));
    crate::cpu::tensor::narrow(x, dim, start, len)
}

/// [`Tensor::cat`]: its checks, then the device kernel or the host one.
pub(crate) fn cat(tensors: &[Tensor], dim: usize) -> Result<Tensor> {
    const OP: &str = "Tensor::cat";
    let shape = check_cat(tensors, dim)?;
    let refs: SmallVec<[&Tensor; 8]> = tensors.iter().collect();
    if crate::dispatch::on_cuda(OP, &refs)? {
        return cat_cuda(tensors, dim, &shape);
    }
    crate::cpu::tensor::cat(tensors, dim, shape)
}

/// [`Tensor::pack`]: its checks, then the device kernel or the host one.
pub(crate) fn pack(x: &Tensor, dim: usize, sizes: &[usize]) -> Result<Tensor> {
    check_tensor_pieces(x, "Tensor::pack", dim, sizes)?;
    dispatch!("Tensor::pack", [x] => device::pack(&x, dim, sizes));
    crate::cpu::tensor::pack(x, dim, sizes)
}

/// [`Tensor::unpack`]: its checks, then the device kernel or the host one.
pub(crate) fn unpack(
    flat: &Tensor,
    shape: &[usize],
    dim: usize,
    sizes: &[usize],
) -> Result<Tensor> {
    if dim >= shape.len()
        || checked_numel(shape) != Some(flat.numel())
        || checked_sum(sizes) != Some(shape[dim])
    {
        return Err(Error::Invalid {
            op: "Tensor::unpack",
            detail: format!(
                "{} packed elements with piece sizes {sizes:?} do not fill shape {shape:?} on dim {dim}",
                flat.numel()
            ),
        });
    }
    dispatch!("Tensor::unpack", [flat] => device::unpack(&flat, shape, dim, sizes));
    crate::cpu::tensor::unpack(flat, shape, dim, sizes)
}

/// [`Tensor::add`]: its checks, then the device kernel or the host one.
pub(crate) fn add(a: &Tensor, other: &Tensor) -> Result<Tensor> {
    check_same(a, "Tensor::add", other)?;
    dispatch!("Tensor::add", [a, other] => device::binary("Tensor::add", "add", &a, &other));
    crate::cpu::tensor::add(a, other)
}

/// [`Tensor::add_assign`]: its checks, then the device kernel or the host one.
pub(crate) fn add_assign(dst: &mut Tensor, other: &Tensor) -> Result<()> {
    check_same(dst, "Tensor::add", other)?;
    dispatch!("Tensor::add", mut dst, [other] => {
        let sum = device::binary("Tensor::add", "add", dst, &other)?;
        *dst = sum;
        Ok(())
    });
    crate::cpu::tensor::add_assign(dst, other)
}

/// [`Tensor::try_scale`]: its checks, then the device kernel or the host one.
pub(crate) fn try_scale(x: &Tensor, factor: f64) -> Result<Tensor> {
    dispatch!("Tensor::scale", [x] => device::scale(&x, factor));
    crate::cpu::tensor::try_scale(x, factor)
}

/// [`Tensor::try_map`]: its checks, then the device kernel or the host one.
pub(crate) fn try_map(x: &Tensor, f: impl Fn(f64) -> f64) -> Result<Tensor> {
    crate::dispatch::host_only("Tensor::map", &[x])?;
    crate::cpu::tensor::try_map(x, f)
}

/// [`Tensor::mul`]: its checks, then the device kernel or the host one.
pub(crate) fn mul(a: &Tensor, other: &Tensor) -> Result<Tensor> {
    check_same(a, "Tensor::mul", other)?;
    dispatch!("Tensor::mul", [a, other] => device::binary("Tensor::mul", "mul", &a, &other));
    crate::cpu::tensor::mul(a, other)
}

/// [`Tensor::write_at`]: its checks, then the device kernel or the host one.
pub(crate) fn write_at(dst: &mut Tensor, dim: usize, start: usize, src: &Tensor) -> Result<()> {
    check_dim(dst, "Tensor::write_at", dim)?;
    let fits = src.rank() == dst.rank()
        && src.dtype() == dst.dtype()
        && start
            .checked_add(src.shape[dim])
            .is_some_and(|end| end <= dst.shape[dim])
        && (0..dst.rank()).all(|d| d == dim || src.shape[d] == dst.shape[d]);
    if !fits {
        return Err(Error::ShapeMismatch {
            op: "Tensor::write_at",
            lhs: dst.shape.clone(),
            rhs: src.shape.clone(),
        });
    }
    dispatch!("Tensor::write_at", mut dst, [src] => device::write_at(dst, dim, start, &src));
    crate::cpu::tensor::write_at(dst, dim, start, src)
}

#[cfg(feature = "cuda")]
fn cat_cuda(tensors: &[Tensor], dim: usize, shape: &[usize]) -> Result<Tensor> {
    let cs = tensors
        .iter()
        .map(Tensor::cuda_tensor)
        .collect::<Result<Vec<_>>>()?;
    device::cat(&cs, dim, shape).map(Tensor::from)
}

#[cfg(not(feature = "cuda"))]
fn cat_cuda(tensors: &[Tensor], _dim: usize, _shape: &[usize]) -> Result<Tensor> {
    unreachable!("{} host tensors reported as device tensors", tensors.len())
}

/// The device launches (`cuda/kernels/elementwise.cu`, and `copy.cu`'s strided copy for the
/// data movement), on operands the front door has checked.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{copy_blocks, func, grid_for, launch_kernel, Acc};
    use crate::cuda::{source, CudaTensor};
    use crate::{DType, Result, Shape};

    /// `(outer, extent, inner)` of `shape` around `dim`, a dim of it (the front door checked).
    fn split(shape: &[usize], dim: usize) -> (usize, usize, usize) {
        let outer = shape[..dim].iter().product();
        (outer, shape[dim], shape[dim + 1..].iter().product())
    }

    /// `Tensor::add` and `mul`: any dtype.
    pub(super) use crate::cuda::launch::binary;

    /// Every element times `factor` rounded into the dtype (the host's `T::from_f64`).
    pub(super) fn scale(a: &CudaTensor, factor: f64) -> Result<CudaTensor> {
        const OP: &str = "Tensor::scale";
        let dev = a.device();
        let mut out = CudaTensor::uninit(dev, a.shape(), a.dtype())?;
        let n = a.numel();
        if n > 0 {
            let f = func(dev, &source::ELEMENTWISE, "scale", a.dtype())?;
            launch_kernel!(OP, dev, f, grid_for(n);
                src a, dst &mut out, acc Acc::rounded(a.dtype(), factor), u64 n)?;
        }
        Ok(out)
    }

    /// A copy converted to `dtype` (through f64, rounded once, as on the host).
    pub(super) fn to_dtype(a: &CudaTensor, dtype: DType) -> Result<CudaTensor> {
        const OP: &str = "Tensor::to_dtype";
        let dev = a.device();
        let mut out = CudaTensor::uninit(dev, a.shape(), dtype)?;
        let n = a.numel();
        if n > 0 {
            let root = format!("cast_{}", a.dtype());
            let f = func(dev, &source::ELEMENTWISE, &root, dtype)?;
            launch_kernel!(OP, dev, f, grid_for(n); src a, dst &mut out, u64 n)?;
        }
        Ok(out)
    }

    /// Which way [`move_pieces`] copies.
    #[derive(Clone, Copy)]
    enum Pieces {
        /// From their places along the dim into the flat buffer, one after another.
        Pack,
        /// From the flat buffer back to their places.
        Unpack,
    }

    /// Copies the pieces (extents `sizes`) of the middle dim of a `[outer, extent, inner]`
    /// tensor to or from a flat buffer that holds them one after another, each piece's
    /// `outer` runs together.
    fn move_pieces(
        op: &'static str,
        src: &CudaTensor,
        dst: &mut CudaTensor,
        (outer, extent, inner): (usize, usize, usize),
        sizes: &[usize],
        way: Pieces,
    ) -> Result<()> {
        let (mut base, mut start) = (0, 0);
        for &len in sizes {
            let run = len * inner;
            let (placed, flat) = ((extent * inner, start * inner), (run, base));
            let ((ss, so), (ds, d0)) = match way {
                Pieces::Pack => (placed, flat),
                Pieces::Unpack => (flat, placed),
            };
            copy_blocks(op, src, dst, outer, run, ss, so, ds, d0)?;
            base += outer * run;
            start += len;
        }
        Ok(())
    }

    /// The pieces of `dim` (extents `sizes`) one after another, flat.
    pub(super) fn pack(t: &CudaTensor, dim: usize, sizes: &[usize]) -> Result<CudaTensor> {
        const OP: &str = "Tensor::pack";
        let dims = split(t.shape(), dim);
        let mut out = CudaTensor::uninit(t.device(), &[t.numel()], t.dtype())?;
        move_pieces(OP, t, &mut out, dims, sizes, Pieces::Pack)?;
        Ok(out)
    }

    /// The inverse of [`pack`].
    pub(super) fn unpack(
        flat: &CudaTensor,
        shape: &[usize],
        dim: usize,
        sizes: &[usize],
    ) -> Result<CudaTensor> {
        const OP: &str = "Tensor::unpack";
        let dims = split(shape, dim);
        let mut out = CudaTensor::uninit(flat.device(), shape, flat.dtype())?;
        move_pieces(OP, flat, &mut out, dims, sizes, Pieces::Unpack)?;
        Ok(out)
    }

    /// A copy of `start..start + len` along `dim`.
    pub(super) fn narrow(
        t: &CudaTensor,
        dim: usize,
        start: usize,
        len: usize,
    ) -> Result<CudaTensor> {
        const OP: &str = "Tensor::narrow";
        let (outer, extent, inner) = split(t.shape(), dim);
        let mut shape: Shape = t.shape().into();
        shape[dim] = len;
        let mut out = CudaTensor::uninit(t.device(), &shape, t.dtype())?;
        let run = len * inner;
        copy_blocks(
            OP,
            t,
            &mut out,
            outer,
            run,
            extent * inner,
            start * inner,
            run,
            0,
        )?;
        Ok(out)
    }

    /// `src` copied into `dst` from `start` along `dim`. A `dst` buffer shared with another
    /// tensor is copied first (copy on write).
    pub(super) fn write_at(
        dst: &mut CudaTensor,
        dim: usize,
        start: usize,
        src: &CudaTensor,
    ) -> Result<()> {
        const OP: &str = "Tensor::write_at";
        let (outer, extent, inner) = split(dst.shape(), dim);
        let run = src.shape()[dim] * inner;
        copy_blocks(
            OP,
            src,
            dst,
            outer,
            run,
            run,
            0,
            extent * inner,
            start * inner,
        )
    }

    /// The tensors one after another along `dim` (`shape` their concatenation).
    pub(super) fn cat(ts: &[CudaTensor], dim: usize, shape: &[usize]) -> Result<CudaTensor> {
        const OP: &str = "Tensor::cat";
        let first = &ts[0];
        let (outer, total, inner) = split(shape, dim);
        let mut out = CudaTensor::uninit(first.device(), shape, first.dtype())?;
        let mut at = 0;
        for t in ts {
            let run = t.shape()[dim] * inner;
            copy_blocks(
                OP,
                t,
                &mut out,
                outer,
                run,
                run,
                0,
                total * inner,
                at * inner,
            )?;
            at += t.shape()[dim];
        }
        Ok(out)
    }
}
