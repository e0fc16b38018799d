//! Elementwise ops the [`Tensor`] methods (`add`, `mul`, `scale`) do not cover: `sub`, and
//! the bias add of a linear layer with its backward.
//!
//! | op | shapes | backward |
//! |---|---|---|
//! | [`sub`] | `a − b`, same shape | `da = dy`, `db = −dy` |
//! | [`add_row`] | `[.., n] + [n]` (bias broadcast over every leading index) | `dx = dy`, `dbias = sum_rows(dy)` |
//! | [`sum_rows`] | `[.., n] → [n]`, summed over all leading dims in row order | `dx[r, j] = dy[j]` |

use super::{check_dst, check_row_param, rows_last, same_layout, store, Accum, Float};
use crate::{Result, Tensor};

/// Elementwise `a − b` (same shape and dtype), rounded once.
pub fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "ops::sub";
    same_layout(OP, a, b)?;
    dispatch!(OP, [a, b] => crate::cuda::ops::sub(&a, &b));
    let mut out = a.clone();
    dispatch_float!(OP, a.dtype(), |T| {
        let bs = b.as_slice::<T>()?;
        for (o, &y) in out.as_mut_slice::<T>()?.iter_mut().zip(bs) {
            *o = T::from_acc(o.to_acc() - y.to_acc());
        }
        Ok(())
    })?;
    Ok(out)
}

/// `x[.., j] + bias[j]`: the bias of a linear layer, broadcast over every leading index.
pub fn add_row(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    dispatch!("ops::add_row", [x, bias] => crate::cuda::ops::add_row(&x, &bias));
    let mut out = x.clone();
    add_row_assign_op("ops::add_row", &mut out, bias)?;
    Ok(out)
}

/// `x[.., j] · w[j]`: a per-feature scale broadcast along the rows, rounded once.
pub fn mul_row(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    const OP: &str = "ops::mul_row";
    let (_, n) = rows_last(OP, x)?;
    check_row_param(OP, x, w, n)?;
    dispatch!(OP, [x, w] => crate::cuda::ops::mul_row(&x, &w));
    let mut out = x.clone();
    dispatch_float!(OP, x.dtype(), |T| {
        let ws = w.as_slice::<T>()?;
        if n > 0 {
            for row in out.as_mut_slice::<T>()?.chunks_exact_mut(n) {
                for (o, &s) in row.iter_mut().zip(ws) {
                    *o = T::from_acc(o.to_acc() * s.to_acc());
                }
            }
        }
        Ok(())
    })?;
    Ok(out)
}

/// In place `x[.., j] += bias[j]`.
pub fn add_row_assign(x: &mut Tensor, bias: &Tensor) -> Result<()> {
    add_row_assign_op("ops::add_row_assign", x, bias)
}

fn add_row_assign_op(op: &'static str, x: &mut Tensor, bias: &Tensor) -> Result<()> {
    let (_, n) = rows_last(op, x)?;
    check_row_param(op, &*x, bias, n)?;
    // On the device the sum is a new buffer that replaces `x`'s (copy on write's result).
    dispatch!(op, mut x, [bias] => {
        *x = crate::cuda::ops::add_row(x, &bias)?;
        Ok(())
    });
    dispatch_float!(op, x.dtype(), |T| {
        let bs = bias.as_slice::<T>()?;
        if n > 0 {
            for row in x.as_mut_slice::<T>()?.chunks_exact_mut(n) {
                for (o, &b) in row.iter_mut().zip(bs) {
                    *o = T::from_acc(o.to_acc() + b.to_acc());
                }
            }
        }
        Ok(())
    })
}

/// `Σ_r x[r, j]` over every leading index: `[.., n] → [n]` (the bias gradient of
/// [`add_row`]). Summed in the compute type in row order, rounded once.
pub fn sum_rows(x: &Tensor) -> Result<Tensor> {
    let (_, n) = rows_last("ops::sum_rows", x)?;
    dispatch!("ops::sum_rows", [x] => crate::cuda::ops::sum_rows(&x));
    let mut dst = Tensor::zeros(&[n], x.dtype());
    sum_rows_into(&mut dst, x, Accum::Replace)?;
    Ok(dst)
}

/// [`sum_rows`] into `dst` (`[n]`), replacing or adding to its contents.
pub fn sum_rows_into(dst: &mut Tensor, x: &Tensor, accum: Accum) -> Result<()> {
    const OP: &str = "ops::sum_rows";
    let (_, n) = rows_last(OP, x)?;
    check_dst(OP, dst, &[n], x.dtype())?;
    dispatch!(OP, mut dst, [x] => crate::cuda::ops::sum_rows_into(dst, &x, accum));
    dispatch_float!(OP, x.dtype(), |T| {
        let mut acc = vec![<T as Float>::Acc::default(); n];
        if n > 0 {
            for row in x.as_slice::<T>()?.chunks_exact(n) {
                for (a, &v) in acc.iter_mut().zip(row) {
                    *a += v.to_acc();
                }
            }
        }
        for (d, &a) in dst.as_mut_slice::<T>()?.iter_mut().zip(&acc) {
            store(d, a, accum);
        }
        Ok(())
    })
}
