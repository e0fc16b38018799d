//! LayerNorm and RMSNorm over the last dim, forward (output and saved statistics) and
//! backward (dx, dweight, dbias), against plain f64 loops and finite differences.
//!
//! Tolerances: `common::tol` for elementwise outputs; the weight/bias gradients sum over
//! rows, so they also get `rows·ε·Σ|terms|` (ε of the compute type). The reference is the
//! textbook formula in f64 on the rounded inputs.

mod common;

use common::*;
use dtensor_kernels::ops::{self, acc_dtype};
use dtensor_kernels::{DType, Error, Tensor};

const EPS: f64 = 1e-5;
const SHAPE: [usize; 3] = [2, 3, 8];
const N: usize = 8;

struct RefOut {
    y: Vec<f64>,
    mean: Vec<f64>,
    rstd: Vec<f64>,
}

/// `center = true` for LayerNorm, `false` for RMSNorm (no mean, no bias).
fn norm_ref(x: &[f64], w: &[f64], b: Option<&[f64]>, n: usize) -> RefOut {
    let (mut y, mut mean, mut rstd) = (vec![], vec![], vec![]);
    for row in x.chunks(n) {
        let mu = if b.is_some() {
            row.iter().sum::<f64>() / n as f64
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n as f64;
        let rs = 1.0 / (var + EPS).sqrt();
        for j in 0..n {
            y.push((row[j] - mu) * rs * w[j] + b.map_or(0.0, |b| b[j]));
        }
        mean.push(mu);
        rstd.push(rs);
    }
    RefOut { y, mean, rstd }
}

struct RefGrads {
    dx: Vec<f64>,
    dw: Vec<f64>,
    db: Vec<f64>,
    /// `Σ_rows |dy·x̂|` and `Σ_rows |dy|`, for the summation error bound.
    dw_abs: Vec<f64>,
    db_abs: Vec<f64>,
}

/// Backward by the textbook formulas, recomputing the statistics in f64.
fn norm_back_ref(dy: &[f64], x: &[f64], w: &[f64], layer: bool, n: usize) -> RefGrads {
    let mut r = RefGrads {
        dx: vec![],
        dw: vec![0.0; n],
        db: vec![0.0; n],
        dw_abs: vec![0.0; n],
        db_abs: vec![0.0; n],
    };
    for (g, row) in dy.chunks(n).zip(x.chunks(n)) {
        let mu = if layer {
            row.iter().sum::<f64>() / n as f64
        } else {
            0.0
        };
        let var = row.iter().map(|v| (v - mu) * (v - mu)).sum::<f64>() / n as f64;
        let rs = 1.0 / (var + EPS).sqrt();
        let xhat: Vec<f64> = row.iter().map(|v| (v - mu) * rs).collect();
        let gw: Vec<f64> = (0..n).map(|j| g[j] * w[j]).collect();
        let mean_g = if layer {
            gw.iter().sum::<f64>() / n as f64
        } else {
            0.0
        };
        let mean_gx = dot(&gw, &xhat) / n as f64;
        for j in 0..n {
            r.dx.push(rs * (gw[j] - mean_g - xhat[j] * mean_gx));
            r.dw[j] += g[j] * xhat[j];
            r.dw_abs[j] += (g[j] * xhat[j]).abs();
            r.db[j] += g[j];
            r.db_abs[j] += g[j].abs();
        }
    }
    r
}

fn sum_bound(dtype: DType, rows: usize, abs: &[f64]) -> impl Fn(usize, f64) -> f64 + '_ {
    move |i, w| {
        tol(dtype).rtol * w.abs() + tol(dtype).atol + (rows + 2) as f64 * acc_eps(dtype) * abs[i]
    }
}

#[test]
fn layer_norm_forward_matches_reference() {
    for dtype in ALL {
        let (x, xv) = input(&SHAPE, 1, 3.0, dtype);
        let (w, wv) = input(&[N], 2, 1.5, dtype);
        let (b, bv) = input(&[N], 3, 1.0, dtype);
        let out = ops::layer_norm(&x, &w, &b, EPS).unwrap();
        let r = norm_ref(&xv, &wv, Some(&bv), N);
        assert_close("layer_norm y", &out.y, &r.y, tol(dtype));
        assert_eq!(out.mean.shape(), &[2, 3]);
        assert_eq!(out.mean.dtype(), acc_dtype(dtype));
        assert_eq!(out.rstd.dtype(), acc_dtype(dtype));
        // Statistics are kept in the compute type (f32 for half inputs): f32/f64 tolerance.
        let stat_tol = tol(acc_dtype(dtype));
        assert_close("layer_norm mean", &out.mean, &r.mean, stat_tol);
        assert_close("layer_norm rstd", &out.rstd, &r.rstd, stat_tol);
    }
}

#[test]
fn rms_norm_forward_matches_reference() {
    for dtype in ALL {
        let (x, xv) = input(&SHAPE, 4, 3.0, dtype);
        let (w, wv) = input(&[N], 5, 1.5, dtype);
        let out = ops::rms_norm(&x, &w, EPS).unwrap();
        let r = norm_ref(&xv, &wv, None, N);
        assert_close("rms_norm y", &out.y, &r.y, tol(dtype));
        assert_eq!(out.rstd.shape(), &[2, 3]);
        assert_close("rms_norm rstd", &out.rstd, &r.rstd, tol(acc_dtype(dtype)));
    }
}

#[test]
fn layer_norm_backward_matches_reference() {
    let rows = 6;
    for dtype in ALL {
        let (x, xv) = input(&SHAPE, 6, 3.0, dtype);
        let (w, wv) = input(&[N], 7, 1.5, dtype);
        let (b, _) = input(&[N], 8, 1.0, dtype);
        let (dy, gv) = input(&SHAPE, 9, 1.0, dtype);
        let out = ops::layer_norm(&x, &w, &b, EPS).unwrap();
        let g = ops::layer_norm_backward(&dy, &x, &w, &out.mean, &out.rstd).unwrap();
        let r = norm_back_ref(&gv, &xv, &wv, true, N);
        assert_close("layer_norm dx", &g.dx, &r.dx, tol(dtype));
        assert_close_with(
            "layer_norm dw",
            &g.dweight,
            &r.dw,
            sum_bound(dtype, rows, &r.dw_abs),
        );
        assert_close_with(
            "layer_norm db",
            &g.dbias,
            &r.db,
            sum_bound(dtype, rows, &r.db_abs),
        );
    }
}

#[test]
fn rms_norm_backward_matches_reference() {
    let rows = 6;
    for dtype in ALL {
        let (x, xv) = input(&SHAPE, 10, 3.0, dtype);
        let (w, wv) = input(&[N], 11, 1.5, dtype);
        let (dy, gv) = input(&SHAPE, 12, 1.0, dtype);
        let out = ops::rms_norm(&x, &w, EPS).unwrap();
        let g = ops::rms_norm_backward(&dy, &x, &w, &out.rstd).unwrap();
        let r = norm_back_ref(&gv, &xv, &wv, false, N);
        assert_close("rms_norm dx", &g.dx, &r.dx, tol(dtype));
        assert_close_with(
            "rms_norm dw",
            &g.dweight,
            &r.dw,
            sum_bound(dtype, rows, &r.dw_abs),
        );
    }
}

#[test]
fn layer_norm_backward_matches_finite_differences() {
    let (r, n) = (3, 5);
    let xv: Vec<f64> = values(r * n, 13).iter().map(|v| v * 2.0).collect();
    let wv = values(n, 14);
    let bv = values(n, 15);
    let gv = values(r * n, 16);
    let loss = |x: &[f64], w: &[f64], b: &[f64]| {
        let out = ops::layer_norm(&t64(x, &[r, n]), &t64(w, &[n]), &t64(b, &[n]), EPS).unwrap();
        dot(&out.y.to_f64_vec(), &gv)
    };
    let (x, w) = (t64(&xv, &[r, n]), t64(&wv, &[n]));
    let out = ops::layer_norm(&x, &w, &t64(&bv, &[n]), EPS).unwrap();
    let g = ops::layer_norm_backward(&t64(&gv, &[r, n]), &x, &w, &out.mean, &out.rstd).unwrap();
    assert_fd("layer_norm dx", &g.dx, &fd_grad(&xv, |x| loss(x, &wv, &bv)));
    assert_fd(
        "layer_norm dw",
        &g.dweight,
        &fd_grad(&wv, |w| loss(&xv, w, &bv)),
    );
    assert_fd(
        "layer_norm db",
        &g.dbias,
        &fd_grad(&bv, |b| loss(&xv, &wv, b)),
    );
}

#[test]
fn rms_norm_backward_matches_finite_differences() {
    let (r, n) = (3, 5);
    let xv: Vec<f64> = values(r * n, 17).iter().map(|v| v * 2.0).collect();
    let wv = values(n, 18);
    let gv = values(r * n, 19);
    let loss = |x: &[f64], w: &[f64]| {
        let out = ops::rms_norm(&t64(x, &[r, n]), &t64(w, &[n]), EPS).unwrap();
        dot(&out.y.to_f64_vec(), &gv)
    };
    let (x, w) = (t64(&xv, &[r, n]), t64(&wv, &[n]));
    let out = ops::rms_norm(&x, &w, EPS).unwrap();
    let g = ops::rms_norm_backward(&t64(&gv, &[r, n]), &x, &w, &out.rstd).unwrap();
    assert_fd("rms_norm dx", &g.dx, &fd_grad(&xv, |x| loss(x, &wv)));
    assert_fd("rms_norm dw", &g.dweight, &fd_grad(&wv, |w| loss(&xv, w)));
}

#[test]
fn norms_of_1d_input_give_scalar_stats_and_constant_rows_stay_finite() {
    let (x, _) = make(&[2.0; 4], &[4], DType::F32);
    let w = make(&[1.0; 4], &[4], DType::F32).0;
    let b = make(&[0.5; 4], &[4], DType::F32).0;
    let out = ops::layer_norm(&x, &w, &b, EPS).unwrap();
    assert_eq!(out.mean.shape(), &[] as &[usize]);
    // A constant row has zero variance: eps keeps rstd finite and y = bias.
    assert_eq!(out.y.to_f64_vec(), vec![0.5; 4]);
    let g = ops::layer_norm_backward(&w, &x, &w, &out.mean, &out.rstd).unwrap();
    assert!(g.dx.to_f64_vec().iter().all(|v| v.is_finite()));
    let out = ops::rms_norm(&x, &w, EPS).unwrap();
    assert_eq!(out.rstd.shape(), &[] as &[usize]);
}

#[test]
fn layer_norm_bad_input_errs_naming_op() {
    let x = Tensor::zeros(&[2, 4], DType::F32);
    let w = Tensor::zeros(&[4], DType::F32);
    let op = "ops::layer_norm";
    let e = assert_names_op(
        ops::layer_norm(&x, &Tensor::zeros(&[3], DType::F32), &w, EPS),
        op,
    );
    assert!(matches!(e, Error::ShapeMismatch { .. }));
    let e = assert_names_op(
        ops::layer_norm(&x, &w, &Tensor::zeros(&[4], DType::F64), EPS),
        op,
    );
    assert!(matches!(e, Error::DTypeMismatch { .. }));
    assert_names_op(
        ops::layer_norm(&Tensor::zeros(&[], DType::F32), &w, &w, EPS),
        op,
    );
    let empty = Tensor::zeros(&[2, 0], DType::F32);
    let w0 = Tensor::zeros(&[0], DType::F32);
    assert_names_op(ops::layer_norm(&empty, &w0, &w0, EPS), op);
    let i = Tensor::zeros(&[2, 4], DType::I32);
    let wi = Tensor::zeros(&[4], DType::I32);
    assert_names_op(ops::layer_norm(&i, &wi, &wi, EPS), op);

    let op = "ops::layer_norm_backward";
    let out = ops::layer_norm(&x, &w, &w, EPS).unwrap();
    let bad_dy = Tensor::zeros(&[4, 2], DType::F32);
    assert_names_op(
        ops::layer_norm_backward(&bad_dy, &x, &w, &out.mean, &out.rstd),
        op,
    );
    // Statistics of the wrong shape or dtype (e.g. rounded to the input dtype).
    let bad_shape = Tensor::zeros(&[4], DType::F32);
    assert_names_op(
        ops::layer_norm_backward(&x, &x, &w, &bad_shape, &out.rstd),
        op,
    );
    let (xh, wh) = (x.to_dtype(DType::BF16), w.to_dtype(DType::BF16));
    let out_h = ops::layer_norm(&xh, &wh, &wh, EPS).unwrap();
    let rounded = out_h.rstd.to_dtype(DType::BF16);
    let e = assert_names_op(
        ops::layer_norm_backward(&xh, &xh, &wh, &out_h.mean, &rounded),
        op,
    );
    assert!(matches!(e, Error::DTypeMismatch { .. }));
}

#[test]
fn rms_norm_bad_input_errs_naming_op() {
    let x = Tensor::zeros(&[2, 4], DType::F64);
    let w = Tensor::zeros(&[4], DType::F64);
    let op = "ops::rms_norm";
    assert_names_op(
        ops::rms_norm(&x, &Tensor::zeros(&[2, 4], DType::F64), EPS),
        op,
    );
    assert_names_op(ops::rms_norm(&x, &Tensor::zeros(&[4], DType::F32), EPS), op);
    let w0 = Tensor::zeros(&[0], DType::F64);
    assert_names_op(
        ops::rms_norm(&Tensor::zeros(&[3, 0], DType::F64), &w0, EPS),
        op,
    );
    let op = "ops::rms_norm_backward";
    let out = ops::rms_norm(&x, &w, EPS).unwrap();
    let f32_stats = out.rstd.to_dtype(DType::F32);
    assert_names_op(ops::rms_norm_backward(&x, &x, &w, &f32_stats), op);
    assert_names_op(
        ops::rms_norm_backward(&x, &x, &w, &Tensor::zeros(&[3], DType::F64)),
        op,
    );
    assert_names_op(ops::rms_norm_backward(&w, &x, &w, &out.rstd), op);
}
