//! Elementwise ops the [`Tensor`] methods (`add`, `mul`, `scale`) do not cover: `sub`, and
//! the bias add of a linear layer with its backward.
//!
//! | op | shapes | backward |
//! |---|---|---|
//! | [`sub`] | `a − b`, same shape | `da = dy`, `db = −dy` |
//! | [`add_row`] | `[.., n] + [n]` (bias broadcast over every leading index) | `dx = dy`, `dbias = sum_rows(dy)` |
//! | [`sum_rows`] | `[.., n] → [n]`, summed over all leading dims in row order | `dx[r, j] = dy[j]` |

use super::{check_dst, check_row_param, rows_last, same_layout, want_float, Accum};
use crate::{Result, Tensor};

/// Elementwise `a − b` (same shape and dtype), rounded once.
pub fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "ops::sub";
    same_layout(OP, a, b)?;
    want_float(OP, a)?;
    dispatch!(OP, [a, b] => device::binary(OP, "sub", &a, &b));
    crate::cpu::elementwise::sub(a, b)
}

/// `x[.., j] + bias[j]`: the bias of a linear layer, broadcast over every leading index.
pub fn add_row(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    const OP: &str = "ops::add_row";
    let (rows, n) = rows_last(OP, x)?;
    check_row_param(OP, x, bias, n)?;
    want_float(OP, x)?;
    dispatch!(OP, [x, bias] => device::row_op(OP, "add_row", &x, &bias, rows, n));
    let mut out = x.clone();
    crate::cpu::elementwise::add_row_assign_op(OP, &mut out, bias, n)?;
    Ok(out)
}

/// `x[.., j] · w[j]`: a per-feature scale broadcast along the rows, rounded once.
pub fn mul_row(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    const OP: &str = "ops::mul_row";
    let (rows, n) = rows_last(OP, x)?;
    check_row_param(OP, x, w, n)?;
    want_float(OP, x)?;
    dispatch!(OP, [x, w] => device::row_op(OP, "mul_row", &x, &w, rows, n));
    crate::cpu::elementwise::mul_row(x, w, n)
}

/// In place `x[.., j] += bias[j]`.
pub fn add_row_assign(x: &mut Tensor, bias: &Tensor) -> Result<()> {
    add_row_assign_op("ops::add_row_assign", x, bias)
}

fn add_row_assign_op(op: &'static str, x: &mut Tensor, bias: &Tensor) -> Result<()> {
    let (rows, n) = rows_last(op, x)?;
    check_row_param(op, &*x, bias, n)?;
    want_float(op, &*x)?;
    // On the device the sum is a new buffer that replaces `x`'s (copy on write's result).
    dispatch!(op, mut x, [bias] => device::add_row_assign(op, x, &bias, rows, n));
    crate::cpu::elementwise::add_row_assign_op(op, x, bias, n)
}

/// `Σ_r x[r, j]` over every leading index: `[.., n] → [n]` (the bias gradient of
/// [`add_row`]). Summed in the compute type in row order, rounded once.
pub fn sum_rows(x: &Tensor) -> Result<Tensor> {
    const OP: &str = "ops::sum_rows";
    let (rows, n) = rows_last(OP, x)?;
    want_float(OP, x)?;
    dispatch!(OP, [x] => device::sum_rows(&x, rows, n));
    crate::cpu::elementwise::sum_rows(x, n)
}

/// [`sum_rows`] into `dst` (`[n]`), replacing or adding to its contents.
pub fn sum_rows_into(dst: &mut Tensor, x: &Tensor, accum: Accum) -> Result<()> {
    const OP: &str = "ops::sum_rows";
    let (rows, n) = rows_last(OP, x)?;
    want_float(OP, x)?;
    check_dst(OP, dst, &[n], x.dtype())?;
    dispatch!(OP, mut dst, [x] => device::sum_rows_into(dst, &x, accum, rows, n));
    crate::cpu::elementwise::sum_rows_into(dst, x, accum, n)
}

/// The device launches (`cuda/kernels/elementwise.cu`), one thread per element (per column
/// for `sum_rows`), on operands the front door has checked; float dtypes only, as the host
/// kernels.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{func, grid_for, launch_kernel};
    use crate::cuda::{source, CudaTensor};
    use crate::ops::accum_flag;
    use crate::spec::Accum;
    use crate::Result;

    /// `root(a, b)` elementwise into a new tensor (`a` and `b` laid out alike).
    pub(super) use crate::cuda::launch::binary;

    /// `root(x[r, j], w[j])` for every row `r` of `x` (`[rows, n]`).
    pub(super) fn row_op(
        op: &'static str,
        root: &str,
        x: &CudaTensor,
        w: &CudaTensor,
        rows: usize,
        n: usize,
    ) -> Result<CudaTensor> {
        let dev = x.device();
        let mut out = CudaTensor::uninit(dev, x.shape(), x.dtype())?;
        if rows * n > 0 {
            let f = func(dev, &source::ELEMENTWISE, root, x.dtype())?;
            launch_kernel!(op, dev, f, grid_for(rows * n);
                src x, src w, dst &mut out, u64 rows, u64 n)?;
        }
        Ok(out)
    }

    /// `x[.., j] + bias[j]` into a new buffer that replaces `x`'s (copy on write's result).
    pub(super) fn add_row_assign(
        op: &'static str,
        x: &mut CudaTensor,
        bias: &CudaTensor,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        *x = row_op(op, "add_row", x, bias, rows, n)?;
        Ok(())
    }

    /// `Σ_rows x` into a new `[n]`.
    pub(super) fn sum_rows(x: &CudaTensor, rows: usize, n: usize) -> Result<CudaTensor> {
        let mut dst = CudaTensor::zeros(x.device(), &[n], x.dtype())?;
        sum_rows_into(&mut dst, x, Accum::Replace, rows, n)?;
        Ok(dst)
    }

    /// `dst (=|+=) Σ_rows x`, rows summed in order.
    pub(super) fn sum_rows_into(
        dst: &mut CudaTensor,
        x: &CudaTensor,
        accum: Accum,
        rows: usize,
        n: usize,
    ) -> Result<()> {
        const OP: &str = "ops::sum_rows";
        if n == 0 {
            return Ok(());
        }
        let dev = x.device().clone();
        let f = func(&dev, &source::ELEMENTWISE, "sum_rows", x.dtype())?;
        launch_kernel!(OP, dev, f, grid_for(n);
            dst dst, src x, u64 rows, u64 n, int accum_flag(accum))
    }
}
