//! `ops::sub`, `ops::add_row` and its backward `ops::sum_rows`, `ops::mul_row`, against plain f64 loops.
//! Tolerances: `common::tol` (half an ulp for bf16/f16: each output is rounded once).

mod common;

use common::*;
use dtensor_kernels::ops::{self, Accum};
use dtensor_kernels::{DType, Error, Tensor};

#[test]
fn sub_matches_reference() {
    for dtype in ALL {
        let (a, av) = input(&[3, 4, 5], 1, 2.0, dtype);
        let (b, bv) = input(&[3, 4, 5], 2, 2.0, dtype);
        let want: Vec<f64> = av.iter().zip(&bv).map(|(x, y)| x - y).collect();
        assert_close("sub", &ops::sub(&a, &b).unwrap(), &want, tol(dtype));
    }
}

#[test]
fn sub_backward_matches_finite_differences() {
    // d(a − b) = (dy, −dy): the gradient of L = Σ dy·(a − b).
    let av = values(6, 3);
    let bv = values(6, 4);
    let gv = values(6, 5);
    let loss = |a: &[f64], b: &[f64]| {
        let y = ops::sub(&t64(a, &[2, 3]), &t64(b, &[2, 3])).unwrap();
        dot(&y.to_f64_vec(), &gv)
    };
    let dy = t64(&gv, &[2, 3]);
    assert_fd("sub da", &dy, &fd_grad(&av, |a| loss(a, &bv)));
    assert_fd("sub db", &dy.scale(-1.0), &fd_grad(&bv, |b| loss(&av, b)));
}

#[test]
fn add_row_matches_reference() {
    for dtype in ALL {
        for shape in [vec![7], vec![4, 7], vec![2, 3, 7]] {
            let (x, xv) = input(&shape, 10, 1.0, dtype);
            let (bias, bv) = input(&[7], 11, 1.0, dtype);
            let want: Vec<f64> = xv.iter().enumerate().map(|(i, x)| x + bv[i % 7]).collect();
            let got = ops::add_row(&x, &bias).unwrap();
            assert_close("add_row", &got, &want, tol(dtype));
            let mut inplace = x.clone();
            ops::add_row_assign(&mut inplace, &bias).unwrap();
            assert_eq!(inplace, got);
        }
    }
}

fn sum_rows_reference(xv: &[f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    let mut s = vec![0.0; n];
    let mut abs = vec![0.0; n];
    for (i, x) in xv.iter().enumerate() {
        s[i % n] += x;
        abs[i % n] += x.abs();
    }
    (s, abs)
}

#[test]
fn sum_rows_matches_reference() {
    // Bound: rtol·|w| + rows·ε·Σ|x| (a sum of `rows` terms in the compute type).
    for dtype in ALL {
        for shape in [vec![5], vec![6, 5], vec![3, 4, 5]] {
            let rows: usize = shape[..shape.len() - 1].iter().product();
            let (x, xv) = input(&shape, 20, 1.0, dtype);
            let (want, abs) = sum_rows_reference(&xv, 5);
            let got = ops::sum_rows(&x).unwrap();
            assert_eq!(got.shape(), &[5]);
            assert_close_with("sum_rows", &got, &want, |i, w| {
                tol(dtype).rtol * w.abs() + rows as f64 * acc_eps(dtype) * abs[i] + 1e-300
            });
        }
    }
}

#[test]
fn sum_rows_into_accum_add_adds_once() {
    for dtype in ALL {
        let (x, xv) = input(&[4, 6], 30, 1.0, dtype);
        let (mut dst, dv) = input(&[6], 31, 1.0, dtype);
        ops::sum_rows_into(&mut dst, &x, Accum::Add).unwrap();
        let (s, abs) = sum_rows_reference(&xv, 6);
        let want: Vec<f64> = s.iter().zip(&dv).map(|(s, d)| s + d).collect();
        assert_close_with("sum_rows Add", &dst, &want, |i, w| {
            tol(dtype).rtol * w.abs() + 5.0 * acc_eps(dtype) * (abs[i] + dv[i].abs()) + 1e-300
        });
    }
}

#[test]
fn add_row_backward_matches_finite_differences() {
    // y = x + bias: dx = dy, dbias = sum_rows(dy).
    let (r, n) = (4, 3);
    let xv = values(r * n, 40);
    let bv = values(n, 41);
    let gv = values(r * n, 42);
    let loss = |x: &[f64], b: &[f64]| {
        let y = ops::add_row(&t64(x, &[r, n]), &t64(b, &[n])).unwrap();
        dot(&y.to_f64_vec(), &gv)
    };
    let dy = t64(&gv, &[r, n]);
    assert_fd("add_row dx", &dy, &fd_grad(&xv, |x| loss(x, &bv)));
    let dbias = ops::sum_rows(&dy).unwrap();
    assert_fd("add_row dbias", &dbias, &fd_grad(&bv, |b| loss(&xv, b)));
}

#[test]
fn add_row_and_sum_rows_handle_empty_rows() {
    let x = Tensor::zeros(&[0, 4], DType::F32);
    let b = Tensor::zeros(&[4], DType::F32);
    assert_eq!(ops::add_row(&x, &b).unwrap().shape(), &[0, 4]);
    assert_eq!(ops::sum_rows(&x).unwrap(), Tensor::zeros(&[4], DType::F32));
    let x = Tensor::zeros(&[3, 0], DType::F32);
    let b = Tensor::zeros(&[0], DType::F32);
    assert_eq!(ops::add_row(&x, &b).unwrap().shape(), &[3, 0]);
    assert_eq!(ops::sum_rows(&x).unwrap().shape(), &[0]);
}

#[test]
fn sub_mismatch_errs_naming_op() {
    let a = Tensor::zeros(&[2, 3], DType::F32);
    let e = assert_names_op(
        ops::sub(&a, &Tensor::zeros(&[3, 2], DType::F32)),
        "ops::sub",
    );
    assert!(matches!(e, Error::ShapeMismatch { .. }));
    let e = assert_names_op(
        ops::sub(&a, &Tensor::zeros(&[2, 3], DType::F64)),
        "ops::sub",
    );
    assert!(matches!(e, Error::DTypeMismatch { .. }));
    let i = Tensor::zeros(&[2], DType::I64);
    assert_names_op(ops::sub(&i, &i), "ops::sub");
}

#[test]
fn add_row_bad_bias_errs_naming_op() {
    let mut x = Tensor::zeros(&[2, 3], DType::F32);
    for bias in [
        Tensor::zeros(&[2], DType::F32),
        Tensor::zeros(&[1, 3], DType::F32),
        Tensor::zeros(&[3], DType::BF16),
    ] {
        assert_names_op(ops::add_row(&x, &bias), "ops::add_row");
        assert_names_op(ops::add_row_assign(&mut x, &bias), "ops::add_row_assign");
    }
    let scalar = Tensor::zeros(&[], DType::F32);
    assert_names_op(ops::add_row(&scalar, &scalar), "ops::add_row");
    let i = Tensor::zeros(&[2, 3], DType::I32);
    assert_names_op(
        ops::add_row(&i, &Tensor::zeros(&[3], DType::I32)),
        "ops::add_row",
    );
}

#[test]
fn sum_rows_bad_input_errs_naming_op() {
    assert_names_op(
        ops::sum_rows(&Tensor::zeros(&[], DType::F32)),
        "ops::sum_rows",
    );
    assert_names_op(
        ops::sum_rows(&Tensor::zeros(&[2, 3], DType::I64)),
        "ops::sum_rows",
    );
    let x = Tensor::zeros(&[2, 3], DType::F32);
    let mut wrong_shape = Tensor::zeros(&[2], DType::F32);
    assert_names_op(
        ops::sum_rows_into(&mut wrong_shape, &x, Accum::Add),
        "ops::sum_rows",
    );
    let mut wrong_dtype = Tensor::zeros(&[3], DType::F64);
    assert_names_op(
        ops::sum_rows_into(&mut wrong_dtype, &x, Accum::Replace),
        "ops::sum_rows",
    );
}

#[test]
fn mul_row_matches_reference() {
    for dtype in ALL {
        let (x, xv) = input(&[3, 4, 5], 7, 2.0, dtype);
        let (w, wv) = input(&[5], 8, 2.0, dtype);
        let want: Vec<f64> = xv.iter().enumerate().map(|(i, v)| v * wv[i % 5]).collect();
        assert_close("mul_row", &ops::mul_row(&x, &w).unwrap(), &want, tol(dtype));
    }
}

#[test]
fn mul_row_of_the_wrong_width_is_an_error() {
    let x = Tensor::zeros(&[2, 3], DType::F32);
    let w = Tensor::zeros(&[4], DType::F32);
    let e = ops::mul_row(&x, &w).unwrap_err().to_string();
    assert!(e.contains("ops::mul_row"), "{e}");
}
