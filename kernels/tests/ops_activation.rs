//! GELU (tanh approximation), SiLU and SwiGLU, forward and backward, against f64 formulas
//! written out here; backward also against finite differences. Tolerances: `common::tol`
//! (each output is one rounding of an f32 computation for bf16/f16: half an ulp).

mod common;

use common::*;
use dtensor_kernels::ops::{self, Accum};
use dtensor_kernels::{DType, Error, Tensor};

fn gelu_ref(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())
}

fn gelu_grad_ref(x: f64) -> f64 {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let t = (c * (x + 0.044715 * x.powi(3))).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)
}

fn sigmoid_ref(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn silu_ref(x: f64) -> f64 {
    x * sigmoid_ref(x)
}

fn silu_grad_ref(x: f64) -> f64 {
    let s = sigmoid_ref(x);
    s + x * s * (1.0 - s)
}

const SHAPE: [usize; 3] = [2, 3, 7];

type Forward = fn(&Tensor) -> dtensor_kernels::Result<Tensor>;
type Backward = fn(&Tensor, &Tensor) -> dtensor_kernels::Result<Tensor>;

/// `(name, forward, backward, f, f')`.
type Case = (
    &'static str,
    Forward,
    Backward,
    fn(f64) -> f64,
    fn(f64) -> f64,
);

fn unary_cases() -> [Case; 2] {
    [
        (
            "gelu",
            ops::gelu,
            ops::gelu_backward,
            gelu_ref,
            gelu_grad_ref,
        ),
        (
            "silu",
            ops::silu,
            ops::silu_backward,
            silu_ref,
            silu_grad_ref,
        ),
    ]
}

#[test]
fn gelu_and_silu_forward_match_reference() {
    for (name, fwd, _, f, _) in unary_cases() {
        for dtype in ALL {
            let (x, xv) = input(&SHAPE, 1, 5.0, dtype);
            let want: Vec<f64> = xv.iter().map(|&v| f(v)).collect();
            assert_close(name, &fwd(&x).unwrap(), &want, tol(dtype));
        }
    }
}

#[test]
fn gelu_and_silu_backward_match_reference() {
    for (name, _, back, _, g) in unary_cases() {
        for dtype in ALL {
            let (x, xv) = input(&SHAPE, 2, 5.0, dtype);
            let (dy, gv) = input(&SHAPE, 3, 1.0, dtype);
            let want: Vec<f64> = xv.iter().zip(&gv).map(|(&v, &d)| d * g(v)).collect();
            assert_close(name, &back(&dy, &x).unwrap(), &want, tol(dtype));
        }
    }
}

#[test]
fn gelu_and_silu_backward_match_finite_differences() {
    for (name, fwd, back, _, _) in unary_cases() {
        let xv: Vec<f64> = values(12, 4).iter().map(|v| v * 4.0).collect();
        let gv = values(12, 5);
        let loss = |x: &[f64]| dot(&fwd(&t64(x, &[3, 4])).unwrap().to_f64_vec(), &gv);
        let dx = back(&t64(&gv, &[3, 4]), &t64(&xv, &[3, 4])).unwrap();
        assert_fd(name, &dx, &fd_grad(&xv, loss));
    }
}

#[test]
fn activation_into_variants_match_and_accumulate() {
    for dtype in ALL {
        let (x, xv) = input(&SHAPE, 6, 3.0, dtype);
        let (dy, gv) = input(&SHAPE, 7, 1.0, dtype);
        let mut dst = Tensor::zeros(&SHAPE, dtype);
        ops::gelu_into(&mut dst, &x).unwrap();
        assert_eq!(dst, ops::gelu(&x).unwrap());
        ops::silu_into(&mut dst, &x).unwrap();
        assert_eq!(dst, ops::silu(&x).unwrap());

        let (mut dx, cv) = input(&SHAPE, 8, 1.0, dtype);
        ops::gelu_backward_into(&mut dx, &dy, &x, Accum::Add).unwrap();
        let want: Vec<f64> = (0..cv.len())
            .map(|i| cv[i] + gv[i] * gelu_grad_ref(xv[i]))
            .collect();
        assert_close("gelu_backward Add", &dx, &want, tol(dtype));
        let (mut dx, cv) = input(&SHAPE, 9, 1.0, dtype);
        ops::silu_backward_into(&mut dx, &dy, &x, Accum::Add).unwrap();
        let want: Vec<f64> = (0..cv.len())
            .map(|i| cv[i] + gv[i] * silu_grad_ref(xv[i]))
            .collect();
        assert_close("silu_backward Add", &dx, &want, tol(dtype));
    }
}

#[test]
fn activations_saturate_without_nan() {
    // Far tails: x³ overflows f32 at |x| > ~7e12 and σ(x) underflows below ~-104.
    let xs = [-1e20, -1e4, -200.0, -30.0, 0.0, 30.0, 200.0, 1e4, 1e20];
    let want_gelu = [0.0, 0.0, 0.0, 0.0, 0.0, 30.0, 200.0, 1e4, 1e20];
    let want_grad = [0.0, 0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0];
    for dtype in [DType::F64, DType::F32] {
        let (x, _) = make(&xs, &[9], dtype);
        let (ones, _) = make(&[1.0; 9], &[9], dtype);
        let tight = Tol {
            rtol: 1e-6,
            atol: 1e-6,
        };
        assert_close("gelu tails", &ops::gelu(&x).unwrap(), &want_gelu, tight);
        let g = ops::gelu_backward(&ones, &x).unwrap();
        assert_close("gelu' tails", &g, &want_grad, tight);
        assert_close("silu tails", &ops::silu(&x).unwrap(), &want_gelu, tight);
        let g = ops::silu_backward(&ones, &x).unwrap();
        assert_close("silu' tails", &g, &want_grad, tight);
    }
}

#[test]
fn swiglu_forward_and_backward_match_reference() {
    for dtype in ALL {
        let (gate, gv) = input(&SHAPE, 10, 4.0, dtype);
        let (up, uv) = input(&SHAPE, 11, 2.0, dtype);
        let (dy, dv) = input(&SHAPE, 12, 1.0, dtype);
        let want: Vec<f64> = gv.iter().zip(&uv).map(|(&g, &u)| silu_ref(g) * u).collect();
        assert_close(
            "swiglu",
            &ops::swiglu(&gate, &up).unwrap(),
            &want,
            tol(dtype),
        );
        let grads = ops::swiglu_backward(&dy, &gate, &up).unwrap();
        let want_dg: Vec<f64> = (0..gv.len())
            .map(|i| dv[i] * uv[i] * silu_grad_ref(gv[i]))
            .collect();
        let want_du: Vec<f64> = (0..gv.len()).map(|i| dv[i] * silu_ref(gv[i])).collect();
        assert_close("swiglu d_gate", &grads.d_gate, &want_dg, tol(dtype));
        assert_close("swiglu d_up", &grads.d_up, &want_du, tol(dtype));
    }
}

#[test]
fn swiglu_into_variants_match_and_accumulate() {
    for dtype in ALL {
        let (gate, gv) = input(&SHAPE, 13, 4.0, dtype);
        let (up, uv) = input(&SHAPE, 14, 2.0, dtype);
        let (dy, dv) = input(&SHAPE, 15, 1.0, dtype);
        let mut out = Tensor::zeros(&SHAPE, dtype);
        ops::swiglu_into(&mut out, &gate, &up).unwrap();
        assert_eq!(out, ops::swiglu(&gate, &up).unwrap());
        let (mut dg, cg) = input(&SHAPE, 16, 1.0, dtype);
        let (mut du, cu) = input(&SHAPE, 17, 1.0, dtype);
        ops::swiglu_backward_into(&mut dg, &mut du, &dy, &gate, &up, Accum::Add).unwrap();
        let want_dg: Vec<f64> = (0..gv.len())
            .map(|i| cg[i] + dv[i] * uv[i] * silu_grad_ref(gv[i]))
            .collect();
        let want_du: Vec<f64> = (0..gv.len())
            .map(|i| cu[i] + dv[i] * silu_ref(gv[i]))
            .collect();
        assert_close("swiglu d_gate Add", &dg, &want_dg, tol(dtype));
        assert_close("swiglu d_up Add", &du, &want_du, tol(dtype));
    }
}

#[test]
fn swiglu_backward_matches_finite_differences() {
    let gv: Vec<f64> = values(10, 20).iter().map(|v| v * 4.0).collect();
    let uv = values(10, 21);
    let dv = values(10, 22);
    let loss = |g: &[f64], u: &[f64]| {
        let y = ops::swiglu(&t64(g, &[2, 5]), &t64(u, &[2, 5])).unwrap();
        dot(&y.to_f64_vec(), &dv)
    };
    let grads =
        ops::swiglu_backward(&t64(&dv, &[2, 5]), &t64(&gv, &[2, 5]), &t64(&uv, &[2, 5])).unwrap();
    assert_fd(
        "swiglu d_gate",
        &grads.d_gate,
        &fd_grad(&gv, |g| loss(g, &uv)),
    );
    assert_fd("swiglu d_up", &grads.d_up, &fd_grad(&uv, |u| loss(&gv, u)));
}

#[test]
fn unary_activation_bad_input_errs_naming_op() {
    let x = Tensor::zeros(&[2, 3], DType::F32);
    let i = Tensor::zeros(&[2, 3], DType::I64);
    assert_names_op(ops::gelu(&i), "ops::gelu");
    assert_names_op(ops::silu(&i), "ops::silu");
    let mut wrong = Tensor::zeros(&[3, 2], DType::F32);
    let e = assert_names_op(ops::gelu_into(&mut wrong, &x), "ops::gelu");
    assert!(matches!(e, Error::ShapeMismatch { .. }));
    let mut wrong = Tensor::zeros(&[2, 3], DType::BF16);
    let e = assert_names_op(ops::silu_into(&mut wrong, &x), "ops::silu");
    assert!(matches!(e, Error::DTypeMismatch { .. }));
    let dy = Tensor::zeros(&[6], DType::F32);
    assert_names_op(ops::gelu_backward(&dy, &x), "ops::gelu_backward");
    assert_names_op(ops::silu_backward(&dy, &x), "ops::silu_backward");
    let mut dx = Tensor::zeros(&[2, 3], DType::F64);
    assert_names_op(
        ops::gelu_backward_into(&mut dx, &x, &x, Accum::Add),
        "ops::gelu_backward",
    );
    assert_names_op(
        ops::silu_backward_into(&mut dx, &x, &x, Accum::Replace),
        "ops::silu_backward",
    );
    assert_names_op(ops::gelu_backward(&i, &i), "ops::gelu_backward");
}

#[test]
fn swiglu_bad_input_errs_naming_op() {
    let g = Tensor::zeros(&[2, 3], DType::F32);
    let u = Tensor::zeros(&[3, 2], DType::F32);
    assert_names_op(ops::swiglu(&g, &u), "ops::swiglu");
    assert_names_op(
        ops::swiglu(&g, &Tensor::zeros(&[2, 3], DType::F16)),
        "ops::swiglu",
    );
    let mut wrong = Tensor::zeros(&[2], DType::F32);
    assert_names_op(ops::swiglu_into(&mut wrong, &g, &g), "ops::swiglu");
    assert_names_op(ops::swiglu_backward(&u, &g, &g), "ops::swiglu_backward");
    assert_names_op(ops::swiglu_backward(&g, &g, &u), "ops::swiglu_backward");
    let mut ok = Tensor::zeros(&[2, 3], DType::F32);
    assert_names_op(
        ops::swiglu_backward_into(&mut ok, &mut wrong, &g, &g, &g, Accum::Add),
        "ops::swiglu_backward",
    );
    let i = Tensor::zeros(&[2], DType::I32);
    assert_names_op(ops::swiglu(&i, &i), "ops::swiglu");
}
