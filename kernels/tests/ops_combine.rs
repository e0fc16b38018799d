//! `ops::combine` and `ops::reduce_into` on host tensors against plain loops: every
//! `ReduceOp`, left to right, `Avg` divided once at the end; NaN handling as
//! `Element::max_of`; mismatched tensors refused with the op's name.

mod common;

use common::*;
use dtensor_kernels::{ops, DType, ReduceOp, Tensor};

fn fold(op: ReduceOp, a: f64, b: f64) -> f64 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => a + b,
        ReduceOp::Max => a.max(b),
        ReduceOp::Min => a.min(b),
    }
}

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

#[test]
fn combine_and_reduce_into_match_plain_loops() {
    let srcs: Vec<Tensor> = (0..3).map(|s| t64(&values(7, s), &[7])).collect();
    let v: Vec<Vec<f64>> = srcs.iter().map(Tensor::to_f64_vec).collect();
    for op in OPS {
        let mut acc = srcs[0].clone();
        ops::combine(&mut acc, &srcs[1], op).unwrap();
        let want: Vec<f64> = (0..7).map(|i| fold(op, v[0][i], v[1][i])).collect();
        assert_eq!(acc.to_f64_vec(), want, "combine {op:?}");

        let mut dst = Tensor::zeros(&[7], DType::F64);
        let refs: Vec<&Tensor> = srcs.iter().collect();
        ops::reduce_into(&mut dst, &refs, op).unwrap();
        let want: Vec<f64> = (0..7)
            .map(|i| {
                let r = fold(op, fold(op, v[0][i], v[1][i]), v[2][i]);
                if op == ReduceOp::Avg {
                    r / 3.0
                } else {
                    r
                }
            })
            .collect();
        assert_eq!(dst.to_f64_vec(), want, "reduce_into {op:?}");
    }
}

#[test]
fn combine_integers_and_nan_sources() {
    let a = Tensor::from_vec(vec![1i64, -5, 7], &[3]).unwrap();
    let b = Tensor::from_vec(vec![4i64, -9, 7], &[3]).unwrap();
    let mut acc = a.clone();
    ops::combine(&mut acc, &b, ReduceOp::Min).unwrap();
    assert_eq!(acc.as_slice::<i64>().unwrap(), &[1, -9, 7]);
    // Max keeps a NaN accumulator and ignores a NaN source.
    let mut acc = t64(&[f64::NAN, 1.0], &[2]);
    ops::combine(&mut acc, &t64(&[2.0, f64::NAN], &[2]), ReduceOp::Max).unwrap();
    let r = acc.to_f64_vec();
    assert!(r[0].is_nan() && r[1] == 1.0, "{r:?}");
    // No source: dst untouched.
    let mut dst = t64(&[3.0], &[1]);
    ops::reduce_into(&mut dst, &[], ReduceOp::Sum).unwrap();
    assert_eq!(dst.to_f64_vec(), vec![3.0]);
}

#[test]
fn combine_mismatches_name_the_op() {
    let mut acc = t64(&[1.0, 2.0], &[2]);
    assert_names_op(
        ops::combine(&mut acc, &t64(&[1.0], &[1]), ReduceOp::Sum),
        "ops::combine",
    );
    let f32s = Tensor::from_vec(vec![1.0f32, 2.0], &[2]).unwrap();
    assert_names_op(
        ops::reduce_into(&mut acc, &[&f32s], ReduceOp::Sum),
        "ops::reduce_into",
    );
}
