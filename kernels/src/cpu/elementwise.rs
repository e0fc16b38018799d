//! Host kernels of [`crate::ops::elementwise`](mod@crate::ops::elementwise), on host tensors. Each says
//! what it relies on and which check of the front door ensures it.

use super::{store, Accum, Float};
use crate::{Result, Tensor};

/// Host kernel of [`crate::ops::sub`]: relies on `b` having `a`'s dtype and shape and that
/// dtype being a float, as `spec::same_layout` and `spec::want_float` in the front door
/// ensure.
pub(crate) fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "ops::sub";
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

/// Host kernel of [`crate::ops::mul_row`]: relies on `n` being `x`'s last dim
/// (`spec::rows_last`) and `w` being `[n]` of `x`'s dtype (`spec::check_row_param`), as the
/// front door ensures.
pub(crate) fn mul_row(x: &Tensor, w: &Tensor, n: usize) -> Result<Tensor> {
    const OP: &str = "ops::mul_row";
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

/// The host half of `ops::add_row_assign_op` (and so of `add_row` and `add_row_assign`):
/// relies on `n` being `x`'s last dim (`spec::rows_last`) and `bias` being `[n]` of `x`'s
/// dtype (`spec::check_row_param`), as that function ensures.
pub(crate) fn add_row_assign_op(
    op: &'static str,
    x: &mut Tensor,
    bias: &Tensor,
    n: usize,
) -> Result<()> {
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

/// Host kernel of [`crate::ops::sum_rows`]: relies on `n` being `x`'s last dim, as
/// `spec::rows_last` in the front door ensures.
pub(crate) fn sum_rows(x: &Tensor, n: usize) -> Result<Tensor> {
    let mut dst = Tensor::zeros(&[n], x.dtype());
    sum_rows_into(&mut dst, x, Accum::Replace, n)?;
    Ok(dst)
}

/// Host kernel of [`crate::ops::sum_rows_into`]: relies on `n` being `x`'s last dim
/// (`spec::rows_last`) and `dst` being `[n]` of `x`'s dtype (`spec::check_dst`), as the front
/// door ensures.
pub(crate) fn sum_rows_into(dst: &mut Tensor, x: &Tensor, accum: Accum, n: usize) -> Result<()> {
    const OP: &str = "ops::sum_rows";
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
