//! Reductions along one dim. The reduced dim is **removed** (PyTorch's `keepdim=False`):
//! `[a, e, b]` reduced over dim 1 gives `[a, b]`; a 1-D tensor gives a scalar (`[]`). To keep
//! it, `reshape` the result (a free shape change).
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`sum_dim`] | `Σ_e x[.., e, ..]`, in index order, in the compute type, rounded once | [`sum_dim_backward`]: `dy` broadcast along the restored dim |
//! | [`max_dim`] | values and `i64` argmax (the first maximum; a NaN wins, as in PyTorch) | [`max_dim_backward`]: `dy` placed at the argmax, zeros elsewhere |

use super::{Float, Layout};
use crate::spec::reduction::*;
use crate::{DType, Error, Result, Shape, Tensor};

/// The sum over `dim`, which is removed from the shape.
pub fn sum_dim(x: &Tensor, dim: usize) -> Result<Tensor> {
    const OP: &str = "ops::sum_dim";
    let (outer, extent, inner, shape) = split(OP, x, dim)?;
    dispatch!(OP, [x] => crate::cuda::ops::sum_dim(&x, dim));
    let mut out = Tensor::zeros(&shape, x.dtype());
    dispatch_float!(OP, x.dtype(), |T| {
        let xs = x.as_slice::<T>()?;
        let o = out.as_mut_slice::<T>()?;
        let mut acc = vec![<T as Float>::Acc::default(); inner];
        for b in 0..outer {
            acc.fill(Default::default());
            for e in 0..extent {
                let row = &xs[(b * extent + e) * inner..][..inner];
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a += v.to_acc();
                }
            }
            for (d, &a) in o[b * inner..][..inner].iter_mut().zip(&acc) {
                *d = T::from_acc(a);
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// The input gradient of [`sum_dim`]: `dy` repeated `extent` times along a new dim `dim`.
pub fn sum_dim_backward(dy: &Tensor, dim: usize, extent: usize) -> Result<Tensor> {
    const OP: &str = "ops::sum_dim_backward";
    let shape = restored(OP, dy, dim, extent)?;
    dispatch!(OP, [dy] => crate::cuda::ops::sum_dim_backward(&dy, dim, extent));
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    // `extent` comes from the caller: the restored shape may not fit.
    let mut dx = Tensor::zeros_checked(OP, &shape, dy.dtype())?;
    dispatch_float!(OP, dy.dtype(), |T| {
        let g = dy.as_slice::<T>()?;
        let d = dx.as_mut_slice::<T>()?;
        for b in 0..outer {
            for e in 0..extent {
                d[(b * extent + e) * inner..][..inner].copy_from_slice(&g[b * inner..][..inner]);
            }
        }
        Ok(())
    })?;
    Ok(dx)
}

/// The maximum over `dim` (removed from the shape) and its index. Ties give the first index;
/// a NaN is the maximum of any slice that holds one (the first NaN's index).
pub fn max_dim(x: &Tensor, dim: usize) -> Result<MaxDim> {
    const OP: &str = "ops::max_dim";
    let (outer, extent, inner) = max_split(OP, x.shape(), dim)?;
    dispatch!(OP, [x] => crate::cuda::ops::max_dim(&x, dim));
    let shape = removed(x.shape(), dim);
    let mut values = Tensor::zeros(&shape, x.dtype());
    let mut indices = Tensor::zeros(&shape, DType::I64);
    dispatch_float!(OP, x.dtype(), |T| {
        let xs = x.as_slice::<T>()?;
        let v = values.as_mut_slice::<T>()?;
        let ix = indices.as_mut_slice::<i64>()?;
        for b in 0..outer {
            for i in 0..inner {
                let at = |e: usize| xs[(b * extent + e) * inner + i].to_acc();
                let (mut best, mut arg) = (at(0), 0);
                for e in 1..extent {
                    if best.is_nan() {
                        break;
                    }
                    let c = at(e);
                    if c > best || c.is_nan() {
                        (best, arg) = (c, e);
                    }
                }
                v[b * inner + i] = xs[(b * extent + arg) * inner + i];
                ix[b * inner + i] = arg as i64;
            }
        }
        Ok(())
    })?;
    Ok(MaxDim { values, indices })
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
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let ix = indices.as_slice::<i64>()?;
    check_index_range(OP, ix, extent)?;
    // `extent` comes from the caller: the restored shape may not fit.
    let mut dx = Tensor::zeros_checked(OP, &shape, dy.dtype())?;
    dispatch_float!(OP, dy.dtype(), |T| {
        let g = dy.as_slice::<T>()?;
        let d = dx.as_mut_slice::<T>()?;
        for b in 0..outer {
            for i in 0..inner {
                let e = ix[b * inner + i] as usize;
                d[(b * extent + e) * inner + i] = g[b * inner + i];
            }
        }
        Ok(())
    })?;
    Ok(dx)
}
