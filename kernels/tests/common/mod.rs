//! Shared helpers for the `ops_*` tests: deterministic inputs, per-dtype tolerances, and
//! central finite differences. Every reference is written in the test files themselves as
//! plain `f64` loops over the *rounded* inputs (so only the kernel's own error is measured).
#![allow(dead_code)]

use dtensor_kernels::{DType, Error, Tensor};

#[cfg(feature = "cuda")]
pub mod cuda;

pub const ALL: [DType; 4] = [DType::F64, DType::F32, DType::BF16, DType::F16];

/// `n` deterministic values in `[-1, 1)` (splitmix64).
pub fn values(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
        })
        .collect()
}

/// `vals` rounded into `dtype`, and the rounded values read back as `f64`.
pub fn make(vals: &[f64], shape: &[usize], dtype: DType) -> (Tensor, Vec<f64>) {
    let t = Tensor::from_vec(vals.to_vec(), shape)
        .unwrap()
        .to_dtype(dtype);
    let back = t.to_f64_vec();
    (t, back)
}

/// A deterministic input of `shape` with values in `[-scale, scale)`.
pub fn input(shape: &[usize], seed: u64, scale: f64, dtype: DType) -> (Tensor, Vec<f64>) {
    let n = shape.iter().product();
    let v: Vec<f64> = values(n, seed).iter().map(|x| x * scale).collect();
    make(&v, shape, dtype)
}

/// `|got − want| ≤ atol + rtol·|want|` per element.
#[derive(Clone, Copy, Debug)]
pub struct Tol {
    pub rtol: f64,
    pub atol: f64,
}

/// Tolerances for one output element of an op computed once from exact (already rounded)
/// inputs, with intermediates of magnitude O(1):
/// - f64: relative 1e-12 (computed in f64; the only error is f64 rounding of O(n) terms).
/// - f32: relative 1e-5, absolute 1e-6 (computed in f32: ~1e-7 per operation).
/// - bf16: relative 2^-8 = half an ulp of bf16 (8 significant bits), so an output rounded
///   more than once, or computed in bf16, fails; absolute 1e-5 for the f32 computation noise.
/// - f16: relative 2^-11 = half an ulp of f16 (11 significant bits); absolute 1e-5 likewise.
pub fn tol(dtype: DType) -> Tol {
    match dtype {
        DType::F64 => Tol {
            rtol: 1e-12,
            atol: 1e-12,
        },
        DType::F32 => Tol {
            rtol: 1e-5,
            atol: 1e-6,
        },
        DType::BF16 => Tol {
            rtol: 2f64.powi(-8),
            atol: 1e-5,
        },
        DType::F16 => Tol {
            rtol: 2f64.powi(-11),
            atol: 1e-5,
        },
        other => panic!("no tolerance for {other}"),
    }
}

/// The unit roundoff of the type an op computes in for `dtype` (f32 for f32/bf16/f16).
pub fn acc_eps(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => f64::EPSILON,
        _ => f32::EPSILON as f64,
    }
}

/// Asserts `got` (any float dtype) matches `want` within `tol` (NaN must match NaN).
pub fn assert_close(what: &str, got: &Tensor, want: &[f64], tol: Tol) {
    assert_close_with(what, got, want, |_, w| tol.atol + tol.rtol * w.abs());
}

/// Like [`assert_close`] with a per-element bound `bound(index, want)`.
pub fn assert_close_with(
    what: &str,
    got: &Tensor,
    want: &[f64],
    bound: impl Fn(usize, f64) -> f64,
) {
    let g = got.to_f64_vec();
    assert_eq!(g.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in g.iter().zip(want).enumerate() {
        if w.is_nan() || g.is_nan() {
            assert!(
                w.is_nan() && g.is_nan(),
                "{what} ({}): element {i}: got {g}, want {w}",
                got.dtype()
            );
            continue;
        }
        let b = bound(i, w);
        assert!(
            (g - w).abs() <= b,
            "{what} ({}): element {i}: got {g}, want {w}, |err| {:e} > {b:e}",
            got.dtype(),
            (g - w).abs()
        );
    }
}

/// Central differences of `f` at `x`, one coordinate at a time.
pub fn fd_grad(x: &[f64], f: impl Fn(&[f64]) -> f64) -> Vec<f64> {
    let h = 1e-5;
    let mut p = x.to_vec();
    (0..x.len())
        .map(|i| {
            p[i] = x[i] + h;
            let up = f(&p);
            p[i] = x[i] - h;
            let down = f(&p);
            p[i] = x[i];
            (up - down) / (2.0 * h)
        })
        .collect()
}

/// Analytic vs finite-difference gradient: central differences with h = 1e-5 on O(1)
/// functions are accurate to ~1e-10; 1e-7 leaves room and still catches any wrong term.
pub fn assert_fd(what: &str, analytic: &Tensor, numeric: &[f64]) {
    assert_close(
        &format!("{what} vs finite differences"),
        analytic,
        numeric,
        Tol {
            rtol: 1e-7,
            atol: 1e-7,
        },
    );
}

/// `Σ a·b`.
pub fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// f64 tensor from values.
pub fn t64(vals: &[f64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(vals.to_vec(), shape).unwrap()
}

/// Asserts an error's message starts with the op's name.
pub fn assert_names_op<T: std::fmt::Debug>(r: Result<T, Error>, op: &str) -> Error {
    let e = r.expect_err("expected an Err");
    let msg = e.to_string();
    assert!(
        msg.starts_with(&format!("{op}:")),
        "message {msg:?} should name {op}"
    );
    e
}
