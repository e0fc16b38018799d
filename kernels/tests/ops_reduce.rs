//! `sum_dim` / `max_dim` along every dim, and their backward, against plain loops and
//! finite differences. The reduced dim is removed from the shape. Tolerances: sums get
//! `common::tol` plus `extent·ε·Σ|x|`; max is exact (it returns an input element).

mod common;

use common::*;
use dtensor_kernels::ops;
use dtensor_kernels::{DType, Error, Tensor};

const SHAPE: [usize; 3] = [3, 4, 5];

/// `(outer, extent, inner)` around `dim`.
fn split(shape: &[usize], dim: usize) -> (usize, usize, usize) {
    let outer = shape[..dim].iter().product();
    let inner = shape[dim + 1..].iter().product();
    (outer, shape[dim], inner)
}

fn removed(shape: &[usize], dim: usize) -> Vec<usize> {
    let mut s = shape.to_vec();
    s.remove(dim);
    s
}

#[test]
fn sum_dim_every_dim_matches_reference() {
    for dtype in ALL {
        let (x, xv) = input(&SHAPE, 1, 1.0, dtype);
        for dim in 0..3 {
            let (o, e, i) = split(&SHAPE, dim);
            let (mut want, mut abs) = (vec![0.0; o * i], vec![0.0; o * i]);
            for a in 0..o {
                for k in 0..e {
                    for b in 0..i {
                        want[a * i + b] += xv[(a * e + k) * i + b];
                        abs[a * i + b] += xv[(a * e + k) * i + b].abs();
                    }
                }
            }
            let got = ops::sum_dim(&x, dim).unwrap();
            assert_eq!(got.shape(), removed(&SHAPE, dim).as_slice());
            assert_close_with(&format!("sum_dim {dim}"), &got, &want, |j, w| {
                tol(dtype).rtol * w.abs() + tol(dtype).atol + e as f64 * acc_eps(dtype) * abs[j]
            });
        }
    }
}

#[test]
fn sum_dim_backward_broadcasts_matches_reference() {
    for dtype in ALL {
        for dim in 0..3 {
            let (o, e, i) = split(&SHAPE, dim);
            let (dy, gv) = input(&removed(&SHAPE, dim), 2, 1.0, dtype);
            let dx = ops::sum_dim_backward(&dy, dim, e).unwrap();
            assert_eq!(dx.shape(), &SHAPE);
            let mut want = vec![0.0; o * e * i];
            for a in 0..o {
                for k in 0..e {
                    for b in 0..i {
                        want[(a * e + k) * i + b] = gv[a * i + b];
                    }
                }
            }
            assert_eq!(dx.to_f64_vec(), want, "{dtype} dim {dim}");
        }
    }
}

#[test]
fn max_dim_every_dim_matches_reference() {
    for dtype in ALL {
        let (x, xv) = input(&SHAPE, 3, 1.0, dtype);
        for dim in 0..3 {
            let (o, e, i) = split(&SHAPE, dim);
            let (mut want, mut arg) = (vec![f64::NEG_INFINITY; o * i], vec![0i64; o * i]);
            for a in 0..o {
                for k in 0..e {
                    for b in 0..i {
                        let v = xv[(a * e + k) * i + b];
                        if v > want[a * i + b] {
                            want[a * i + b] = v;
                            arg[a * i + b] = k as i64;
                        }
                    }
                }
            }
            let got = ops::max_dim(&x, dim).unwrap();
            assert_eq!(got.values.shape(), removed(&SHAPE, dim).as_slice());
            assert_eq!(got.values.to_f64_vec(), want, "{dtype} dim {dim}");
            assert_eq!(got.indices.dtype(), DType::I64);
            assert_eq!(got.indices.as_slice::<i64>().unwrap(), arg.as_slice());
        }
    }
}

#[test]
fn max_dim_ties_pick_first_and_nan_wins() {
    let x = t64(
        &[1.0, 3.0, 3.0, -1.0, f64::NAN, 5.0, f64::NAN, 2.0],
        &[2, 4],
    );
    let m = ops::max_dim(&x, 1).unwrap();
    assert_eq!(m.indices.as_slice::<i64>().unwrap(), &[1, 0]);
    let v = m.values.to_f64_vec();
    assert_eq!(v[0], 3.0);
    assert!(v[1].is_nan());
}

#[test]
fn max_dim_backward_routes_to_argmax_matches_reference() {
    for dtype in ALL {
        let (x, _) = input(&SHAPE, 4, 1.0, dtype);
        for dim in 0..3 {
            let (o, e, i) = split(&SHAPE, dim);
            let m = ops::max_dim(&x, dim).unwrap();
            let (dy, gv) = input(&removed(&SHAPE, dim), 5, 1.0, dtype);
            let dx = ops::max_dim_backward(&dy, &m.indices, dim, e).unwrap();
            let idx = m.indices.as_slice::<i64>().unwrap();
            let mut want = vec![0.0; o * e * i];
            for a in 0..o {
                for b in 0..i {
                    want[(a * e + idx[a * i + b] as usize) * i + b] = gv[a * i + b];
                }
            }
            assert_eq!(dx.to_f64_vec(), want, "{dtype} dim {dim}");
        }
    }
}

#[test]
fn sum_dim_and_max_dim_backward_match_finite_differences() {
    let xv = values(24, 6);
    let shape = [2, 3, 4];
    for dim in 0..3 {
        let out_shape = removed(&shape, dim);
        let gv = values(out_shape.iter().product(), 7);
        let dy = t64(&gv, &out_shape);
        let loss = |x: &[f64]| {
            dot(
                &ops::sum_dim(&t64(x, &shape), dim).unwrap().to_f64_vec(),
                &gv,
            )
        };
        let dx = ops::sum_dim_backward(&dy, dim, shape[dim]).unwrap();
        assert_fd(&format!("sum_dim {dim}"), &dx, &fd_grad(&xv, loss));
        // Distinct inputs: the argmax does not move under ±h.
        let loss = |x: &[f64]| {
            let m = ops::max_dim(&t64(x, &shape), dim).unwrap();
            dot(&m.values.to_f64_vec(), &gv)
        };
        let m = ops::max_dim(&t64(&xv, &shape), dim).unwrap();
        let dx = ops::max_dim_backward(&dy, &m.indices, dim, shape[dim]).unwrap();
        assert_fd(&format!("max_dim {dim}"), &dx, &fd_grad(&xv, loss));
    }
}

#[test]
fn reductions_of_1d_give_scalars_and_empty_extents_sum_to_zero() {
    let x = t64(&[1.0, -2.0, 4.0], &[3]);
    let s = ops::sum_dim(&x, 0).unwrap();
    assert_eq!(s.shape(), &[] as &[usize]);
    assert_eq!(s.to_f64_vec(), vec![3.0]);
    let m = ops::max_dim(&x, 0).unwrap();
    assert_eq!(m.values.to_f64_vec(), vec![4.0]);
    assert_eq!(m.indices.as_slice::<i64>().unwrap(), &[2]);
    let back = ops::sum_dim_backward(&s, 0, 3).unwrap();
    assert_eq!(back.to_f64_vec(), vec![3.0; 3]);
    let e = Tensor::zeros(&[2, 0, 3], DType::F32);
    assert_eq!(
        ops::sum_dim(&e, 1).unwrap(),
        Tensor::zeros(&[2, 3], DType::F32)
    );
}

#[test]
fn reduction_bad_input_errs_naming_op() {
    let x = Tensor::zeros(&[2, 3], DType::F32);
    let e = assert_names_op(ops::sum_dim(&x, 2), "ops::sum_dim");
    assert!(matches!(e, Error::DimOutOfRange { .. }));
    assert_names_op(ops::max_dim(&x, 5), "ops::max_dim");
    assert_names_op(
        ops::sum_dim(&Tensor::zeros(&[2], DType::I32), 0),
        "ops::sum_dim",
    );
    assert_names_op(
        ops::max_dim(&Tensor::zeros(&[2], DType::I64), 0),
        "ops::max_dim",
    );
    let e = assert_names_op(
        ops::max_dim(&Tensor::zeros(&[2, 0], DType::F32), 1),
        "ops::max_dim",
    );
    assert!(e.to_string().contains("empty"), "{e}");

    let op = "ops::sum_dim_backward";
    assert_names_op(ops::sum_dim_backward(&x, 3, 4), op);
    assert_names_op(
        ops::sum_dim_backward(&Tensor::zeros(&[2], DType::I32), 0, 2),
        op,
    );

    let op = "ops::max_dim_backward";
    let idx = Tensor::zeros(&[2, 3], DType::I64);
    assert_names_op(ops::max_dim_backward(&x, &idx, 3, 4), op);
    let e = assert_names_op(ops::max_dim_backward(&x, &x, 0, 4), op);
    assert!(matches!(e, Error::DTypeMismatch { .. }));
    let e = assert_names_op(
        ops::max_dim_backward(&x, &Tensor::zeros(&[3], DType::I64), 0, 4),
        op,
    );
    assert!(matches!(e, Error::ShapeMismatch { .. }));
    let far = Tensor::from_vec(vec![0i64, 1, 4, 0, 0, 0], &[2, 3]).unwrap();
    let e = assert_names_op(ops::max_dim_backward(&x, &far, 0, 4), op);
    assert!(e.to_string().contains("index 4"), "{e}");
    let neg = Tensor::from_vec(vec![0i64, -1, 0, 0, 0, 0], &[2, 3]).unwrap();
    assert_names_op(ops::max_dim_backward(&x, &neg, 1, 4), op);
}
