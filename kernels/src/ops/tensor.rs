//! The front door of [`Tensor`]'s own methods (narrow, cat, pack, unpack, write_at,
//! elementwise arithmetic, dtype conversion): each checks its arguments, runs the device
//! kernel when the tensors are on a GPU, else the host kernel of `crate::cpu::tensor`.

#[cfg(feature = "cuda")]
use crate::cuda;
use crate::error::{Error, Result};
use crate::shape::{checked_numel, checked_sum};
use crate::spec::tensor::{check_dim, check_same, check_tensor_pieces};
use crate::{DType, Tensor};
use smallvec::SmallVec;

/// [`Tensor::try_to_dtype`]: its checks, then the device kernel or the host one.
pub(crate) fn try_to_dtype(x: &Tensor, dtype: DType) -> Result<Tensor> {
    dispatch!("Tensor::to_dtype", [x] => cuda::ops::to_dtype(&x, dtype));
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
    dispatch!("Tensor::narrow", [x] => cuda::ops::narrow(&x, dim, start, len));
    crate::cpu::tensor::narrow(x, dim, start, len)
}

/// [`Tensor::cat`]: its checks, then the device kernel or the host one.
pub(crate) fn cat(tensors: &[Tensor], dim: usize) -> Result<Tensor> {
    const OP: &str = "Tensor::cat";
    tensors.first().ok_or(Error::Invalid {
        op: "Tensor::cat",
        detail: "no tensors to concatenate".into(),
    })?;
    let refs: SmallVec<[&Tensor; 8]> = tensors.iter().collect();
    if crate::dispatch::on_cuda(OP, &refs)? {
        return cat_cuda(tensors, dim);
    }
    crate::cpu::tensor::cat(tensors, dim)
}

/// [`Tensor::pack`]: its checks, then the device kernel or the host one.
pub(crate) fn pack(x: &Tensor, dim: usize, sizes: &[usize]) -> Result<Tensor> {
    check_tensor_pieces(x, "Tensor::pack", dim, sizes)?;
    dispatch!("Tensor::pack", [x] => cuda::ops::pack(&x, dim, sizes));
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
    dispatch!("Tensor::unpack", [flat] => cuda::ops::unpack(&flat, shape, dim, sizes));
    crate::cpu::tensor::unpack(flat, shape, dim, sizes)
}

/// [`Tensor::add`]: its checks, then the device kernel or the host one.
pub(crate) fn add(a: &Tensor, other: &Tensor) -> Result<Tensor> {
    check_same(a, "Tensor::add", other)?;
    dispatch!("Tensor::add", [a, other] => cuda::ops::add(&a, &other));
    crate::cpu::tensor::add(a, other)
}

/// [`Tensor::add_assign`]: its checks, then the device kernel or the host one.
pub(crate) fn add_assign(dst: &mut Tensor, other: &Tensor) -> Result<()> {
    check_same(dst, "Tensor::add", other)?;
    dispatch!("Tensor::add", mut dst, [other] => {
        let sum = cuda::ops::add(dst, &other)?;
        *dst = sum;
        Ok(())
    });
    crate::cpu::tensor::add_assign(dst, other)
}

/// [`Tensor::try_scale`]: its checks, then the device kernel or the host one.
pub(crate) fn try_scale(x: &Tensor, factor: f64) -> Result<Tensor> {
    dispatch!("Tensor::scale", [x] => cuda::ops::scale(&x, factor));
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
    dispatch!("Tensor::mul", [a, other] => cuda::ops::mul(&a, &other));
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
    dispatch!("Tensor::write_at", mut dst, [src] => cuda::ops::write_at(dst, dim, start, &src));
    crate::cpu::tensor::write_at(dst, dim, start, src)
}

#[cfg(feature = "cuda")]
fn cat_cuda(tensors: &[Tensor], dim: usize) -> Result<Tensor> {
    let cs = tensors
        .iter()
        .map(Tensor::cuda_tensor)
        .collect::<Result<Vec<_>>>()?;
    let refs: Vec<&cuda::CudaTensor> = cs.iter().collect();
    cuda::ops::cat(&refs, dim).map(Tensor::from)
}

#[cfg(not(feature = "cuda"))]
fn cat_cuda(tensors: &[Tensor], _dim: usize) -> Result<Tensor> {
    unreachable!("{} host tensors reported as device tensors", tensors.len())
}
