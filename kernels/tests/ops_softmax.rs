//! Softmax and log-softmax along the last dim, forward and backward, against plain f64 loops
//! and finite differences. Tolerances: `common::tol` (bf16/f16 outputs are one rounding of an
//! f32 row computation: half an ulp plus f32 noise).

mod common;

use common::*;
use dtensor_kernels::ops::{self, Accum};
use dtensor_kernels::{DType, Error, Tensor};

fn softmax_ref(x: &[f64], n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(n) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|v| (v - m).exp()).sum();
        out.extend(row.iter().map(|v| (v - m).exp() / s));
    }
    out
}

fn log_softmax_ref(x: &[f64], n: usize) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(n) {
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let lse = m + row.iter().map(|v| (v - m).exp()).sum::<f64>().ln();
        out.extend(row.iter().map(|v| v - lse));
    }
    out
}

/// `dx_i = y_i (dy_i − Σ_j dy_j y_j)`.
fn softmax_back_ref(dy: &[f64], y: &[f64], n: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for (g, p) in dy.chunks(n).zip(y.chunks(n)) {
        let d = dot(g, p);
        out.extend(g.iter().zip(p).map(|(g, p)| p * (g - d)));
    }
    out
}

/// `dx_i = dy_i − exp(y_i) Σ_j dy_j`.
fn log_softmax_back_ref(dy: &[f64], y: &[f64], n: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for (g, l) in dy.chunks(n).zip(y.chunks(n)) {
        let s: f64 = g.iter().sum();
        out.extend(g.iter().zip(l).map(|(g, l)| g - l.exp() * s));
    }
    out
}

const SHAPE: [usize; 3] = [2, 3, 9];

#[test]
fn softmax_forward_matches_reference() {
    for dtype in ALL {
        let (x, xv) = input(&SHAPE, 1, 4.0, dtype);
        let got = ops::softmax(&x).unwrap();
        assert_close("softmax", &got, &softmax_ref(&xv, 9), tol(dtype));
        let mut into = Tensor::zeros(&SHAPE, dtype);
        ops::softmax_into(&mut into, &x).unwrap();
        assert_eq!(into, got);
    }
}

#[test]
fn log_softmax_forward_matches_reference() {
    for dtype in ALL {
        let (x, xv) = input(&SHAPE, 2, 4.0, dtype);
        let got = ops::log_softmax(&x).unwrap();
        assert_close("log_softmax", &got, &log_softmax_ref(&xv, 9), tol(dtype));
        let mut into = Tensor::zeros(&SHAPE, dtype);
        ops::log_softmax_into(&mut into, &x).unwrap();
        assert_eq!(into, got);
    }
}

#[test]
fn softmax_backward_matches_reference() {
    for dtype in ALL {
        let (x, _) = input(&SHAPE, 3, 4.0, dtype);
        let y = ops::softmax(&x).unwrap();
        let yv = y.to_f64_vec();
        let (dy, gv) = input(&SHAPE, 4, 1.0, dtype);
        let want = softmax_back_ref(&gv, &yv, 9);
        assert_close(
            "softmax_backward",
            &ops::softmax_backward(&dy, &y).unwrap(),
            &want,
            tol(dtype),
        );
        let (mut dx, cv) = input(&SHAPE, 5, 1.0, dtype);
        ops::softmax_backward_into(&mut dx, &dy, &y, Accum::Add).unwrap();
        let want: Vec<f64> = want.iter().zip(&cv).map(|(w, c)| w + c).collect();
        assert_close("softmax_backward Add", &dx, &want, tol(dtype));
    }
}

#[test]
fn log_softmax_backward_matches_reference() {
    for dtype in ALL {
        let (x, _) = input(&SHAPE, 6, 4.0, dtype);
        let y = ops::log_softmax(&x).unwrap();
        let yv = y.to_f64_vec();
        let (dy, gv) = input(&SHAPE, 7, 1.0, dtype);
        let want = log_softmax_back_ref(&gv, &yv, 9);
        let got = ops::log_softmax_backward(&dy, &y).unwrap();
        assert_close("log_softmax_backward", &got, &want, tol(dtype));
        let (mut dx, cv) = input(&SHAPE, 8, 1.0, dtype);
        ops::log_softmax_backward_into(&mut dx, &dy, &y, Accum::Add).unwrap();
        let want: Vec<f64> = want.iter().zip(&cv).map(|(w, c)| w + c).collect();
        assert_close("log_softmax_backward Add", &dx, &want, tol(dtype));
    }
}

#[test]
fn softmax_and_log_softmax_backward_match_finite_differences() {
    let (r, n) = (3, 5);
    let xv: Vec<f64> = values(r * n, 9).iter().map(|v| v * 3.0).collect();
    let gv = values(r * n, 10);
    let dy = t64(&gv, &[r, n]);
    let loss = |x: &[f64]| dot(&ops::softmax(&t64(x, &[r, n])).unwrap().to_f64_vec(), &gv);
    let y = ops::softmax(&t64(&xv, &[r, n])).unwrap();
    let dx = ops::softmax_backward(&dy, &y).unwrap();
    assert_fd("softmax", &dx, &fd_grad(&xv, loss));
    let loss = |x: &[f64]| {
        dot(
            &ops::log_softmax(&t64(x, &[r, n])).unwrap().to_f64_vec(),
            &gv,
        )
    };
    let y = ops::log_softmax(&t64(&xv, &[r, n])).unwrap();
    let dx = ops::log_softmax_backward(&dy, &y).unwrap();
    assert_fd("log_softmax", &dx, &fd_grad(&xv, loss));
}

#[test]
fn softmax_large_inputs_stay_finite() {
    // exp(1000) overflows every float type: the max subtraction must keep this exact.
    for dtype in [DType::F64, DType::F32] {
        let (x, xv) = make(&[1000.0, 999.0, -1000.0, 1000.0], &[1, 4], dtype);
        let p = ops::softmax(&x).unwrap();
        assert_close("softmax big", &p, &softmax_ref(&xv, 4), tol(dtype));
        let l = ops::log_softmax(&x).unwrap();
        assert_close("log_softmax big", &l, &log_softmax_ref(&xv, 4), tol(dtype));
    }
}

#[test]
fn softmax_masked_entries_get_zero_and_all_masked_row_is_nan() {
    let inf = f64::INFINITY;
    for dtype in ALL {
        let (x, _) = make(&[0.5, -inf, 1.5, -inf, -inf, -inf], &[2, 3], dtype);
        let p = ops::softmax(&x).unwrap().to_f64_vec();
        let want = softmax_ref(&[0.5, 1.5], 2);
        assert!((p[0] - want[0]).abs() < 1e-2 && p[1] == 0.0 && (p[2] - want[1]).abs() < 1e-2);
        assert!(p[3..].iter().all(|v| v.is_nan()), "{p:?}");
        let l = ops::log_softmax(&x).unwrap().to_f64_vec();
        assert_eq!(l[1], -inf);
        // A NaN input poisons its row only.
        let (x, _) = make(&[0.5, f64::NAN, 1.5, 0.0, 1.0, 2.0], &[2, 3], dtype);
        let p = ops::softmax(&x).unwrap().to_f64_vec();
        assert!(p[..3].iter().all(|v| v.is_nan()) && p[3..].iter().all(|v| v.is_finite()));
    }
}

#[test]
fn softmax_empty_rows_and_1d_work() {
    let x = Tensor::zeros(&[3, 0], DType::F32);
    assert_eq!(ops::softmax(&x).unwrap().shape(), &[3, 0]);
    let x = Tensor::zeros(&[0, 4], DType::F32);
    assert_eq!(ops::log_softmax(&x).unwrap().shape(), &[0, 4]);
    let (x, xv) = input(&[6], 11, 2.0, DType::F64);
    assert_close(
        "softmax 1-D",
        &ops::softmax(&x).unwrap(),
        &softmax_ref(&xv, 6),
        tol(DType::F64),
    );
}

#[test]
fn softmax_bad_input_errs_naming_op() {
    let scalar = Tensor::zeros(&[], DType::F32);
    assert_names_op(ops::softmax(&scalar), "ops::softmax");
    assert_names_op(ops::log_softmax(&scalar), "ops::log_softmax");
    let i = Tensor::zeros(&[2, 3], DType::I32);
    assert_names_op(ops::softmax(&i), "ops::softmax");
    assert_names_op(ops::log_softmax(&i), "ops::log_softmax");
    let x = Tensor::zeros(&[2, 3], DType::F32);
    let mut wrong = Tensor::zeros(&[3, 2], DType::F32);
    let e = assert_names_op(ops::softmax_into(&mut wrong, &x), "ops::softmax");
    assert!(matches!(e, Error::ShapeMismatch { .. }));
    assert_names_op(ops::log_softmax_into(&mut wrong, &x), "ops::log_softmax");
    let dy = Tensor::zeros(&[2, 3], DType::F64);
    let e = assert_names_op(ops::softmax_backward(&dy, &x), "ops::softmax_backward");
    assert!(matches!(e, Error::DTypeMismatch { .. }));
    assert_names_op(
        ops::log_softmax_backward(&wrong, &x),
        "ops::log_softmax_backward",
    );
    assert_names_op(
        ops::softmax_backward_into(&mut wrong, &x, &x, Accum::Add),
        "ops::softmax_backward",
    );
    assert_names_op(
        ops::log_softmax_backward_into(&mut wrong, &x, &x, Accum::Replace),
        "ops::log_softmax_backward",
    );
    assert_names_op(
        ops::softmax_backward(&scalar, &scalar),
        "ops::softmax_backward",
    );
}
