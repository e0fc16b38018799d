//! Reductions along one dim. The reduced dim is **removed** (PyTorch's `keepdim=False`):
//! `[a, e, b]` reduced over dim 1 gives `[a, b]`; a 1-D tensor gives a scalar (`[]`). To keep
//! it, `reshape` the result (a free shape change).
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`sum_dim`] | `Σ_e x[.., e, ..]`, in index order, in the compute type, rounded once | [`sum_dim_backward`]: `dy` broadcast along the restored dim |
//! | [`max_dim`] | values and `i64` argmax (the first maximum; a NaN wins, as in PyTorch) | [`max_dim_backward`]: `dy` placed at the argmax, zeros elsewhere |

use crate::spec::reduction::*;
use crate::spec::want_float;
use crate::storage::tensor::checked_len;
use crate::{Result, Tensor};

/// The sum over `dim`, which is removed from the shape.
pub fn sum_dim(x: &Tensor, dim: usize) -> Result<Tensor> {
    const OP: &str = "ops::sum_dim";
    let (outer, extent, inner, shape) = split(OP, x, dim)?;
    want_float(OP, x)?;
    dispatch!(OP, [x] => device::sum_dim(&x, outer, extent, inner, &shape));
    crate::cpu::reduction::sum_dim(x, dim, outer, extent, inner, shape)
}

/// The input gradient of [`sum_dim`]: `dy` repeated `extent` times along a new dim `dim`.
pub fn sum_dim_backward(dy: &Tensor, dim: usize, extent: usize) -> Result<Tensor> {
    const OP: &str = "ops::sum_dim_backward";
    let shape = restored(OP, dy, dim, extent)?;
    want_float(OP, dy)?;
    // `extent` comes from the caller: the restored shape may not fit.
    checked_len(OP, &shape, dy.dtype())?;
    dispatch!(OP, [dy] => device::sum_dim_backward(&dy, dim, extent, &shape));
    crate::cpu::reduction::sum_dim_backward(dy, dim, extent, shape)
}

/// The maximum over `dim` (removed from the shape) and its index. Ties give the first index;
/// a NaN is the maximum of any slice that holds one (the first NaN's index).
pub fn max_dim(x: &Tensor, dim: usize) -> Result<MaxDim> {
    const OP: &str = "ops::max_dim";
    let (outer, extent, inner) = max_split(OP, x.shape(), dim)?;
    want_float(OP, x)?;
    dispatch!(OP, [x] => device::max_dim(&x, dim, outer, extent, inner));
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
    // The indices are read on the host (copied back from a device) and checked once here,
    // so neither kernel reads outside `extent`.
    let host_indices = indices.to_host()?;
    check_index_range(OP, host_indices.as_slice::<i64>()?, extent)?;
    checked_len(OP, &shape, dy.dtype())?;
    want_float(OP, dy)?;
    dispatch!(OP, [dy, indices] => device::max_dim_backward(&dy, &indices, dim, extent, &shape));
    crate::cpu::reduction::max_dim_backward(dy, indices, dim, extent, shape)
}

/// The device launches (`cuda/kernels/reduction.cu`), one thread per output element, on
/// operands the front door has checked; float dtypes only, as the host kernels.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{func, grid_for, launch_kernel};
    use crate::cuda::{source, CudaTensor};
    use crate::spec::reduction::*;
    use crate::{DType, Result};

    pub(super) fn sum_dim(
        x: &CudaTensor,
        outer: usize,
        extent: usize,
        inner: usize,
        shape: &[usize],
    ) -> Result<CudaTensor> {
        const OP: &str = "ops::sum_dim";
        let dev = x.device();
        let mut out = CudaTensor::uninit(dev, shape, x.dtype())?;
        if outer * inner > 0 {
            let f = func(dev, &source::REDUCTION, "sum_dim", x.dtype())?;
            launch_kernel!(OP, dev, f, grid_for(outer * inner);
                src x, dst &mut out, u64 outer, u64 extent, u64 inner)?;
        }
        Ok(out)
    }

    pub(super) fn sum_dim_backward(
        dy: &CudaTensor,
        dim: usize,
        extent: usize,
        shape: &[usize],
    ) -> Result<CudaTensor> {
        const OP: &str = "ops::sum_dim_backward";
        let (outer, inner) = (
            shape[..dim].iter().product(),
            shape[dim + 1..].iter().product(),
        );
        let dev = dy.device();
        let mut dx = CudaTensor::uninit(dev, shape, dy.dtype())?;
        let n = outer * extent * inner;
        if n > 0 {
            let f = func(dev, &source::REDUCTION, "sum_dim_backward", dy.dtype())?;
            launch_kernel!(OP, dev, f, grid_for(n);
                src dy, dst &mut dx, u64 outer, u64 extent, u64 inner)?;
        }
        Ok(dx)
    }

    pub(super) fn max_dim(
        x: &CudaTensor,
        dim: usize,
        outer: usize,
        extent: usize,
        inner: usize,
    ) -> Result<MaxDim> {
        const OP: &str = "ops::max_dim";
        let dev = x.device();
        let shape = removed(x.shape(), dim);
        let mut values = CudaTensor::uninit(dev, &shape, x.dtype())?;
        let mut indices = CudaTensor::uninit(dev, &shape, DType::I64)?;
        if outer * inner > 0 {
            let f = func(dev, &source::REDUCTION, "max_dim", x.dtype())?;
            launch_kernel!(OP, dev, f, grid_for(outer * inner);
                src x, dst &mut values, dst &mut indices, u64 outer, u64 extent, u64 inner)?;
        }
        Ok(MaxDim {
            values: values.into(),
            indices: indices.into(),
        })
    }

    /// The front door checked every index against `extent`.
    pub(super) fn max_dim_backward(
        dy: &CudaTensor,
        indices: &CudaTensor,
        dim: usize,
        extent: usize,
        shape: &[usize],
    ) -> Result<CudaTensor> {
        const OP: &str = "ops::max_dim_backward";
        let (outer, inner) = (
            shape[..dim].iter().product(),
            shape[dim + 1..].iter().product(),
        );
        let dev = dy.device();
        let mut dx = CudaTensor::uninit(dev, shape, dy.dtype())?;
        let n = outer * extent * inner;
        if n > 0 {
            let f = func(dev, &source::REDUCTION, "max_dim_backward", dy.dtype())?;
            launch_kernel!(OP, dev, f, grid_for(n);
                src dy, src indices, dst &mut dx, u64 outer, u64 extent, u64 inner)?;
        }
        Ok(dx)
    }
}
