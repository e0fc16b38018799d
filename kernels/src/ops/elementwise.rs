//! Elementwise ops the [`Tensor`] methods (`add`, `mul`, `scale`) do not cover: `sub`, and
//! the bias add of a linear layer with its backward.
//!
//! | op | shapes | backward |
//! |---|---|---|
//! | [`sub`] | `a − b`, same shape | `da = dy`, `db = −dy` |
//! | [`add_row`] | `[.., n] + [n]` (bias broadcast over every leading index) | `dx = dy`, `dbias = sum_rows(dy)` |
//! | [`sum_rows`] | `[.., n] → [n]`, summed over all leading dims in row order | `dx[r, j] = dy[j]` |

use super::{check_dst, check_row_param, rows_last, same_layout, Accum};
use crate::{Result, Tensor};

/// Elementwise `a − b` (same shape and dtype), rounded once.
pub fn sub(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    const OP: &str = "ops::sub";
    same_layout(OP, a, b)?;
    dispatch!(OP, [a, b] => crate::cuda::ops::sub(&a, &b));
    crate::cpu::elementwise::sub(a, b)
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
    crate::cpu::elementwise::mul_row(x, w, n)
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
    crate::cpu::elementwise::add_row_assign_op(op, x, bias, n)
}

/// `Σ_r x[r, j]` over every leading index: `[.., n] → [n]` (the bias gradient of
/// [`add_row`]). Summed in the compute type in row order, rounded once.
pub fn sum_rows(x: &Tensor) -> Result<Tensor> {
    let (_, n) = rows_last("ops::sum_rows", x)?;
    dispatch!("ops::sum_rows", [x] => crate::cuda::ops::sum_rows(&x));
    crate::cpu::elementwise::sum_rows(x, n)
}

/// [`sum_rows`] into `dst` (`[n]`), replacing or adding to its contents.
pub fn sum_rows_into(dst: &mut Tensor, x: &Tensor, accum: Accum) -> Result<()> {
    const OP: &str = "ops::sum_rows";
    let (_, n) = rows_last(OP, x)?;
    check_dst(OP, dst, &[n], x.dtype())?;
    dispatch!(OP, mut dst, [x] => crate::cuda::ops::sum_rows_into(dst, &x, accum));
    crate::cpu::elementwise::sum_rows_into(dst, x, accum, n)
}
