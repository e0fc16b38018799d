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

#[test]
fn grouped_matmul_of_integers_errs_naming_the_grouped_op() {
    // The front door refuses a dtype the product cannot take; the host kernel used to find
    // out inside its per-group matmul and name `ops::matmul`.
    let x = Tensor::zeros(&[2, 2], DType::I64);
    let w = Tensor::zeros(&[1, 3, 2], DType::I64);
    let r = ops::grouped_matmul_t(&x, &w, &[2]);
    assert!(
        matches!(
            &r,
            Err(dtensor_kernels::Error::Invalid {
                op: "ops::grouped_matmul_t",
                ..
            })
        ),
        "{r:?}"
    );
    let dy = Tensor::zeros(&[2, 3], DType::I64);
    let r = ops::grouped_matmul_t_backward(&dy, &x, &w, &[2]).map(|g| g.dx);
    assert!(
        matches!(
            &r,
            Err(dtensor_kernels::Error::Invalid {
                op: "ops::grouped_matmul_t_backward",
                ..
            })
        ),
        "{r:?}"
    );
    // With no rows nothing is multiplied: zeros of the dtype, as before.
    let none = Tensor::zeros(&[0, 2], DType::I64);
    let y = ops::grouped_matmul_t(&none, &w, &[0]).unwrap();
    assert_eq!((y.shape(), y.dtype()), (&[0, 3][..], DType::I64));
}
