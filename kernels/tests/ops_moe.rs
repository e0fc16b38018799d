//! The mixture-of-experts ops' argument checks at the front door: sizes that do not fit a
//! `usize` are errors naming the op, never an arithmetic-overflow panic or an index out of
//! bounds.

mod common;

use common::*;
use dtensor_kernels::{ops, DType, Tensor};

#[test]
fn scatter_add_rows_output_too_large_errs() {
    let src = Tensor::zeros(&[1, 2], DType::F32);
    // `[n, 2]` has more elements than a usize counts.
    let n = usize::MAX / 2 + 1;
    assert_names_op(
        ops::scatter_add_rows(&src, &[5], n),
        "ops::scatter_add_rows",
    );
}

#[test]
fn grouped_matmul_group_sizes_overflowing_errs() {
    let x = Tensor::zeros(&[1, 2], DType::F32);
    let w = Tensor::zeros(&[2, 3, 2], DType::F32);
    // Σ groups wraps to 1 = rows in a usize; the sum itself does not fit.
    let groups = [usize::MAX, 2];
    assert_names_op(
        ops::grouped_matmul_t(&x, &w, &groups),
        "ops::grouped_matmul_t",
    );
    let dy = Tensor::zeros(&[1, 3], DType::F32);
    assert_names_op(
        ops::grouped_matmul_t_backward(&dy, &x, &w, &groups).map(|g| g.dx),
        "ops::grouped_matmul_t_backward",
    );
}
