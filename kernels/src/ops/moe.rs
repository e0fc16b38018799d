//! Mixture-of-experts kernels: row gathers and scatters (a dispatch's permutation) and the
//! grouped product `y[rows of group e] = x[rows of group e] · W[e]ᵀ`, forward and backward.
//!
//! Rows are grouped contiguously: group `e` holds `groups[e]` rows, after the rows of the
//! groups before it (a group may be empty). Gathers copy elements exactly; scatter-adds
//! and the products follow the module conventions (f64 in f64, others rounded once).

use crate::spec::moe::*;
use crate::{Result, Tensor};

/// The adjoint of [`gather_rows`](super::gather_rows): `out[rows[i]] += src[i]`, `out` is `[n, h]` (rows no
/// source row names stay zero).
pub fn scatter_add_rows(src: &Tensor, rows: &[usize], n: usize) -> Result<Tensor> {
    const OP: &str = "ops::scatter_add_rows";
    dispatch!(OP, [src] => crate::cuda::ops::scatter_add_rows(&src, rows, n));
    crate::cpu::moe::scatter_add_rows(src, rows, n)
}

/// `y[rows of group e] = x[rows of group e] · W[e]ᵀ`: `x` is `[rows, in]`, `w` is
/// `[experts, out, in]` (each expert stored as a linear layer's `[out, in]`), `groups[e]`
/// the rows of expert `e` (Σ = rows). Returns `[rows, out]`.
pub fn grouped_matmul_t(x: &Tensor, w: &Tensor, groups: &[usize]) -> Result<Tensor> {
    const OP: &str = "ops::grouped_matmul_t";
    dispatch!(OP, [x, w] => crate::cuda::ops::grouped_matmul_t(&x, &w, groups));
    crate::cpu::moe::grouped_matmul_t(x, w, groups)
}

/// The backward of [`grouped_matmul_t`] from the output gradient `dy` (`[rows, out]`).
pub fn grouped_matmul_t_backward(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    groups: &[usize],
) -> Result<GroupedMatmulGrads> {
    const OP: &str = "ops::grouped_matmul_t_backward";
    dispatch!(OP, [dy, x, w] => crate::cuda::ops::grouped_matmul_t_backward(&dy, &x, &w, groups)
        .map(|g| GroupedMatmulGrads { dx: g.dx.into(), dw: g.dw.into() }));
    crate::cpu::moe::grouped_matmul_t_backward(dy, x, w, groups)
}
