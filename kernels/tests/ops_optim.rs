//! `ops::adamw_step` on host tensors against the AdamW formula written out in f64: f64
//! parameters bit for bit (the same operations in the same order), f32 and the 16-bit
//! dtypes within their rounding; the moments' dtype and the argument checks.

mod common;

use common::*;
use dtensor_kernels::ops::{self, AdamWStep};
use dtensor_kernels::{DType, Tensor};

const H: AdamWStep = AdamWStep {
    lr: 1e-2,
    beta1: 0.9,
    beta2: 0.999,
    eps: 1e-8,
    decay: 0.1,
    c1: 1.0 - 0.9 * 0.9,
    c2: 1.0 - 0.999 * 0.999,
};

/// Two steps of AdamW in f64 from `w`, `g` (the same gradient twice) and zero moments.
fn reference(w: &[f64], g: &[f64]) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
    let (mut w, mut m, mut v) = (w.to_vec(), vec![0.0; w.len()], vec![0.0; w.len()]);
    for _ in 0..2 {
        for i in 0..w.len() {
            m[i] = H.beta1 * m[i] + (1.0 - H.beta1) * g[i];
            v[i] = H.beta2 * v[i] + (1.0 - H.beta2) * g[i] * g[i];
            let upd = (m[i] / H.c1) / ((v[i] / H.c2).sqrt() + H.eps);
            w[i] = w[i] - H.lr * (upd + H.decay * w[i]);
        }
    }
    (w, m, v)
}

#[test]
fn adamw_step_matches_the_formula() {
    for dtype in ALL {
        let (mut w, wv) = input(&[3, 5], 1, 1.0, dtype);
        let (g, gv) = input(&[3, 5], 2, 0.5, dtype);
        let state = ops::adamw_state_dtype(dtype);
        let mut m = Tensor::zeros(&[3, 5], state);
        let mut v = Tensor::zeros(&[3, 5], state);
        for _ in 0..2 {
            ops::adamw_step(&mut w, &g, &mut m, &mut v, &H).unwrap();
        }
        let (want_w, want_m, want_v) = reference(&wv, &gv);
        assert_eq!(w.dtype(), dtype);
        if dtype == DType::F64 {
            assert_eq!(w.to_f64_vec(), want_w, "f64 w");
            assert_eq!(m.to_f64_vec(), want_m, "f64 m");
            assert_eq!(v.to_f64_vec(), want_v, "f64 v");
        } else {
            // 16-bit parameters step in f64 and round into w after each step; f32 steps
            // in f32 (constants rounded into it).
            let t = if dtype == DType::F32 {
                Tol {
                    rtol: 1e-5,
                    atol: 1e-6,
                }
            } else {
                let r = tol(dtype).rtol;
                Tol {
                    rtol: 4.0 * r,
                    atol: 1e-5,
                }
            };
            assert_close("w", &w, &want_w, t);
        }
    }
}

#[test]
fn adamw_step_checks_its_tensors() {
    let mut w = t64(&[1.0, 2.0], &[2]);
    let g = t64(&[0.1, 0.2], &[2]);
    let (mut m, mut v) = (
        Tensor::zeros(&[2], DType::F64),
        Tensor::zeros(&[2], DType::F64),
    );
    let short = t64(&[0.1], &[1]);
    assert_names_op(
        ops::adamw_step(&mut w, &short, &mut m, &mut v, &H),
        "ops::adamw_step",
    );
    let mut m32 = Tensor::zeros(&[2], DType::F32);
    assert_names_op(
        ops::adamw_step(&mut w, &g, &mut m32, &mut v, &H),
        "ops::adamw_step",
    );
    let mut ints = Tensor::from_vec(vec![1i64, 2], &[2]).unwrap();
    assert_names_op(
        ops::adamw_step(&mut ints, &g, &mut m, &mut v, &H),
        "ops::adamw_step",
    );
    assert_eq!(ops::adamw_state_dtype(DType::BF16), DType::F64);
}
