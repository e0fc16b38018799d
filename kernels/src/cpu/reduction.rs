//! Host kernels of [`crate::ops::reduction`](mod@crate::ops::reduction), on host tensors. Each says
//! what it relies on and which check of the front door ensures it.

use super::Float;
use crate::spec::reduction::*;
use crate::{DType, Result, Shape, Tensor};

/// Host kernel of [`crate::ops::sum_dim`]: relies on `(outer, extent, inner, shape)` being
/// `spec::reduction::split` of `x` at `dim` (in range) and a float dtype
/// (`spec::want_float`), as the front door ensures.
pub(crate) fn sum_dim(
    x: &Tensor,
    _dim: usize,
    outer: usize,
    extent: usize,
    inner: usize,
    shape: Shape,
) -> Result<Tensor> {
    const OP: &str = "ops::sum_dim";
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

/// Host kernel of [`crate::ops::sum_dim_backward`]: relies on `shape` being `dy`'s with
/// `extent` inserted at `dim ≤ rank` (`spec::reduction::restored`) and fitting a `usize`
/// (`storage::tensor::checked_len`), as the front door ensures.
pub(crate) fn sum_dim_backward(
    dy: &Tensor,
    dim: usize,
    extent: usize,
    shape: Shape,
) -> Result<Tensor> {
    const OP: &str = "ops::sum_dim_backward";
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
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

/// Host kernel of [`crate::ops::max_dim`]: relies on `(outer, extent, inner)` being
/// `spec::reduction::max_split` of `x` at `dim` (in range, `extent ≥ 1`), as the front door
/// computes them.
pub(crate) fn max_dim(
    x: &Tensor,
    dim: usize,
    outer: usize,
    extent: usize,
    inner: usize,
) -> Result<MaxDim> {
    const OP: &str = "ops::max_dim";
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

/// Host kernel of [`crate::ops::max_dim_backward`]: relies on `shape` being `dy`'s with
/// `extent` inserted at `dim` (`spec::reduction::restored`) and `indices` being `i64` of
/// `dy`'s shape (`spec::reduction::check_indices`), each index below `extent`
/// (`spec::reduction::check_index_range`) and the restored shape fitting a `usize`
/// (`storage::tensor::checked_len`), as the front door ensures.
pub(crate) fn max_dim_backward(
    dy: &Tensor,
    indices: &Tensor,
    dim: usize,
    extent: usize,
    shape: Shape,
) -> Result<Tensor> {
    const OP: &str = "ops::max_dim_backward";
    let outer: usize = shape[..dim].iter().product();
    let inner: usize = shape[dim + 1..].iter().product();
    let ix = indices.as_slice::<i64>()?;
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
