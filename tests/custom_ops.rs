//! Custom ops with several inputs and outputs (`dtensor_core::custom_op`): a
//! position-dependent two-in, two-out op is exact against the single-rank formula on
//! 1-D and 2-D meshes with uneven shards, forward and backward (f64, finite differences);
//! each check is shown to fail when the op ignores its global offsets or its backward is
//! wrong; and the misuses are errors naming the op.

mod common;

use common::{dist, float_global, numeric_grad, on_mesh};
use dtensor::prelude::*;
use dtensor_core::custom::{custom_op, Piece};
use dtensor_core::{Tape, Var};
use std::sync::Arc;

/// What the op under test gets wrong, on purpose.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Flaw {
    None,
    /// Angles from local indices, as a one-input `Var::custom` closure would have to.
    LocalPositions,
    /// The backward rotates the wrong way.
    BackwardSign,
}

/// The angle of global element `(row, col)`.
fn angle(row: usize, col: usize) -> f64 {
    0.3 * row as f64 + 0.1 * col as f64
}

/// `(cos, sin)` of every element of this rank's piece, at its global position (or at its
/// local one, for [`Flaw::LocalPositions`]).
fn tables(p: &Piece<'_>, flaw: Flaw) -> (Vec<f64>, Vec<f64>) {
    let cols = p.local().shape()[1];
    let (r0, c0) = match flaw {
        Flaw::LocalPositions => (0, 0),
        _ => (p.offset(0), p.offset(1)),
    };
    (0..p.local().numel())
        .map(|i| angle(r0 + i / cols, c0 + i % cols).sin_cos())
        .map(|(s, c)| (c, s))
        .unzip()
}

/// Rotates each pair `(a, b)` of elements by `θ` (`a cos θ − b sin θ`, `a sin θ + b cos θ`).
fn rotate(a: &[f64], b: &[f64], cos: &[f64], sin: &[f64], theta_sign: f64) -> [Vec<f64>; 2] {
    let n = a.len();
    let ra = (0..n)
        .map(|i| a[i] * cos[i] - theta_sign * b[i] * sin[i])
        .collect();
    let rb = (0..n)
        .map(|i| theta_sign * a[i] * sin[i] + b[i] * cos[i])
        .collect();
    [ra, rb]
}

/// `(q, k) ↦ (q cos θ − k sin θ, q sin θ + k cos θ)` with `θ` from each element's global
/// row and column: two inputs, two outputs, both laid out as the inputs.
fn rotate_pair<'t, L: Layout>(
    q: &Var<'t, L>,
    k: &Var<'t, L>,
    flaw: Flaw,
) -> Result<(Var<'t, L>, Var<'t, L>)> {
    let shape = q.value().global_shape().to_vec();
    custom_op::<(L, L)>(
        "rotate_pair",
        (q, k),
        &[&shape, &shape],
        move |x| {
            let (cos, sin) = tables(&x[0], flaw);
            let [a, b] = rotate(
                &x[0].local().to_f64_vec(),
                &x[1].local().to_f64_vec(),
                &cos,
                &sin,
                1.0,
            );
            let s = x[0].local().shape();
            Ok(vec![Tensor::from_vec(a, s)?, Tensor::from_vec(b, s)?])
        },
        move |dy, x| {
            // The transpose of a rotation is the rotation by −θ.
            let (cos, sin) = tables(&x[0], flaw);
            let sign = if flaw == Flaw::BackwardSign {
                1.0
            } else {
                -1.0
            };
            let [a, b] = rotate(&dy[0].to_f64_vec(), &dy[1].to_f64_vec(), &cos, &sin, sign);
            let s = dy[0].shape();
            Ok(vec![
                Some(Tensor::from_vec(a, s)?),
                Some(Tensor::from_vec(b, s)?),
            ])
        },
    )
}

/// The single-rank reference: the rotated pair of global tensors.
fn reference(q: &Tensor, k: &Tensor) -> [Tensor; 2] {
    let cols = q.shape()[1];
    let (cos, sin): (Vec<f64>, Vec<f64>) = (0..q.numel())
        .map(|i| angle(i / cols, i % cols).sin_cos())
        .map(|(s, c)| (c, s))
        .unzip();
    let [a, b] = rotate(&q.to_f64_vec(), &k.to_f64_vec(), &cos, &sin, 1.0);
    [
        Tensor::from_vec(a, q.shape()).unwrap(),
        Tensor::from_vec(b, q.shape()).unwrap(),
    ]
}

/// Values of order one, so central differences are accurate to ~1e-10.
fn small(shape: &[usize], f: f64) -> Tensor {
    Tensor::from_fn(shape, |i| (i as f64 * f + 0.2).sin())
}

/// `d⟨s1, q'⟩ + ⟨s2, k'⟩ / d(q, k)` of the reference by central differences: the two
/// outputs side by side, against the two seeds side by side.
fn numeric_grads(q: &Tensor, k: &Tensor, s: &[Tensor; 2]) -> [Vec<f64>; 2] {
    let both = |[a, b]: [Tensor; 2]| Tensor::cat(&[a, b], 0).unwrap();
    let seed = both(s.clone());
    [
        numeric_grad(q, &seed, &|t| both(reference(t, k))),
        numeric_grad(k, &seed, &|t| both(reference(q, t))),
    ]
}

/// Runs the op on `axes` with q, k (5×6: uneven over 2 ranks along rows, even along
/// columns) laid out as `$layout`, seeds `⟨s1, q'⟩ + ⟨s2, k'⟩`, and checks every rank's
/// outputs and gradients against the reference. Panics on a mismatch.
macro_rules! check_rotation {
    ($axes:expr, $flaw:expr, $($layout:tt)*) => {{
        type L = layout![$($layout)*];
        let q = small(&[5, 6], 0.37);
        let k = small(&[5, 6], 0.91);
        let seeds = [small(&[5, 6], 1.3), small(&[5, 6], 0.53)];
        let want = reference(&q, &k);
        let want_grads = numeric_grads(&q, &k, &seeds);
        let results = on_mesh($axes, |m: &Arc<DeviceMesh>| {
            let tape = Tape::new();
            let qv = tape.leaf(dist::<L>(&q, m));
            let kv = tape.leaf(dist::<L>(&k, m));
            let (a, b) = rotate_pair(&qv, &kv, $flaw)?;
            let outs = [a.value().full_tensor()?, b.value().full_tensor()?];
            let s1 = tape.constant(dist::<L>(&seeds[0], m));
            let s2 = tape.constant(dist::<L>(&seeds[1], m));
            let loss = a.mul(&s1)?.add(&b.mul(&s2)?)?.sum_dim::<1>()?.sum_dim::<0>()?;
            let mut g = loss.backward()?;
            let dq: DTensor<<L as Layout>::Grad> = g.take(&qv)?;
            let dk: DTensor<<L as Layout>::Grad> = g.take(&kv)?;
            Ok((outs, [dq.full_tensor()?, dk.full_tensor()?]))
        });
        for (rank, (outs, grads)) in results.iter().enumerate() {
            for (o, w) in outs.iter().zip(&want) {
                for (x, y) in o.to_f64_vec().iter().zip(w.to_f64_vec()) {
                    assert!((x - y).abs() <= 1e-12, "rank {rank}: output {x} vs reference {y}");
                }
            }
            for (g, w) in grads.iter().zip(&want_grads) {
                assert_eq!(g.numel(), w.len());
                for (x, y) in g.to_f64_vec().iter().zip(w) {
                    assert!(
                        (x - y).abs() <= 1e-7 * (1.0 + y.abs()),
                        "rank {rank}: gradient {x} vs finite differences {y}"
                    );
                }
            }
        }
        // Replicas agree bitwise: every rank gathered the same full tensors.
        for r in &results[1..] {
            assert_eq!(r.0, results[0].0);
            assert_eq!(r.1, results[0].1);
        }
    }};
}

const ONE: &[(AxisKind, usize)] = &[(AxisKind::Dp, 1)];
const DP2: &[(AxisKind, usize)] = &[(AxisKind::Dp, 2)];
const TP2: &[(AxisKind, usize)] = &[(AxisKind::Tp, 2)];
const DP2TP2: &[(AxisKind, usize)] = &[(AxisKind::Dp, 2), (AxisKind::Tp, 2)];

#[test]
fn two_in_two_out_op_at_global_positions_equals_one_rank() {
    check_rotation!(ONE, Flaw::None, Dp: Shard<0>);
    check_rotation!(DP2, Flaw::None, Dp: Shard<0>);
    check_rotation!(TP2, Flaw::None, Tp: Shard<1>);
    check_rotation!(TP2, Flaw::None, Tp: Shard<0>);
    check_rotation!(DP2TP2, Flaw::None, Dp: Shard<0>, Tp: Shard<1>);
    check_rotation!(DP2TP2, Flaw::None, Dp: Shard<1>, Tp: Shard<0>);
}

fn fails(check: impl FnOnce()) -> bool {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(check)).is_err()
}

#[test]
fn the_check_fails_when_the_op_ignores_its_offsets_or_its_backward_is_wrong() {
    // On one rank the local positions are the global ones: the flaw is invisible there...
    assert!(!fails(
        || check_rotation!(ONE, Flaw::LocalPositions, Dp: Shard<0>)
    ));
    // ...and wrong as soon as a dim is sharded.
    assert!(fails(
        || check_rotation!(DP2, Flaw::LocalPositions, Dp: Shard<0>)
    ));
    assert!(fails(
        || check_rotation!(TP2, Flaw::LocalPositions, Tp: Shard<1>)
    ));
    assert!(fails(
        || check_rotation!(ONE, Flaw::BackwardSign, Dp: Shard<0>)
    ));
    assert!(fails(
        || check_rotation!(DP2TP2, Flaw::BackwardSign, Dp: Shard<0>, Tp: Shard<1>)
    ));
}

#[test]
fn pieces_report_each_inputs_global_ranges() {
    let x = float_global(&[5, 4]);
    let y = float_global(&[3, 6]);
    let ranges = on_mesh(DP2TP2, |m| {
        let tape = Tape::new();
        let xv = tape.leaf(dist::<layout![Dp: Shard<0>, Tp: Shard<1>]>(&x, m));
        let yv = tape.leaf(dist::<layout![Dp: Replicate, Tp: Shard<0>]>(&y, m));
        let mut seen = Vec::new();
        custom_op::<(layout![Dp: Shard<0>, Tp: Shard<1>],)>(
            "ranges",
            (&xv, &yv),
            &[&[5, 4]],
            |p| {
                seen = p.iter().map(|p| (p.range(0), p.range(1))).collect();
                Ok(vec![p[0].local().clone()])
            },
            |dy, _| Ok(vec![Some(dy[0].clone()), None]),
        )?;
        Ok((m.coords().to_vec(), seen))
    });
    for (coords, seen) in ranges {
        let rows = if coords[0] == 0 { 0..3 } else { 3..5 };
        let cols = if coords[1] == 0 { 0..2 } else { 2..4 };
        let yrows = if coords[1] == 0 { 0..2 } else { 2..3 };
        assert_eq!(seen, vec![(rows, cols), (yrows, 0..6)], "coords {coords:?}");
    }
}

#[test]
fn an_unused_output_gets_zeros_and_an_input_left_out_gets_zeros() {
    let q = float_global(&[4, 3]);
    let k = q.map(|v| v * 2.0 - 1.0);
    let out = on_mesh(DP2, |m| {
        type L = layout![Dp: Shard<0>];
        let tape = Tape::new();
        let (qv, kv) = (tape.leaf(dist::<L>(&q, m)), tape.leaf(dist::<L>(&k, m)));
        let (a, _b) = custom_op::<(L, L)>(
            "first_only",
            (&qv, &kv),
            &[&[4, 3], &[4, 3]],
            |x| Ok(vec![x[0].local().clone(), x[1].local().clone()]),
            move |dy, _| {
                assert!(
                    dy[1].to_f64_vec().iter().all(|&v| v == 0.0),
                    "the unused output's gradient must be zeros"
                );
                Ok(vec![Some(dy[0].clone()), None])
            },
        )?;
        let mut g = a.sum_dim::<1>()?.sum_dim::<0>()?.backward()?;
        let dq: DTensor<layout![Dp: Shard<0>]> = g.take(&qv)?;
        let dk: DTensor<layout![Dp: Shard<0>]> = g.take(&kv)?;
        Ok((dq.full_tensor()?, dk.full_tensor()?))
    });
    for (dq, dk) in out {
        assert!(dq.to_f64_vec().iter().all(|&v| v == 1.0));
        assert!(
            dk.to_f64_vec().iter().all(|&v| v == 0.0),
            "an input the backward left out gets no contribution"
        );
    }
}

#[test]
fn misuses_are_errors_naming_the_op() {
    let x = float_global(&[4, 2]);
    let errs = on_mesh(DP2, |m| {
        type L = layout![Dp: Shard<0>];
        let (tape, other) = (Tape::new(), Tape::new());
        let a = tape.leaf(dist::<L>(&x, m));
        let b = other.leaf(dist::<L>(&x, m));
        let mut errs = Vec::new();
        let id = |x: &[Piece<'_>]| Ok(vec![x[0].local().clone()]);
        let back = |dy: &[Tensor], _: &[Piece<'_>]| Ok(vec![Some(dy[0].clone())]);
        errs.push(
            custom_op::<(L,)>("two_tapes", (&a, &b), &[&[4, 2]], id, |_, _| {
                Ok(vec![None, None])
            })
            .err(),
        );
        errs.push(
            custom_op::<(L, L)>("short_forward", (&a,), &[&[4, 2], &[4, 2]], id, |_, _| {
                Ok(vec![None])
            })
            .err(),
        );
        errs.push(custom_op::<(L,)>("bad_shape", (&a,), &[&[6, 2]], id, back).err());
        errs.push(custom_op::<(L,)>("shape_count", (&a,), &[], id, back).err());
        let (y,) = custom_op::<(L,)>("short_backward", (&a,), &[&[4, 2]], id, |_, _| Ok(vec![]))?;
        errs.push(y.sum_dim::<1>()?.sum_dim::<0>()?.backward().err());
        Ok(errs
            .into_iter()
            .map(|e| e.map(|e| e.to_string()))
            .collect::<Vec<_>>())
    });
    for errs in errs {
        let names = [
            "two_tapes",
            "short_forward",
            "bad_shape",
            "shape_count",
            "short_backward",
        ];
        for (e, name) in errs.iter().zip(names) {
            let e = e.as_deref().unwrap_or_else(|| panic!("{name}: no error"));
            assert!(e.contains(name), "{name}: {e}");
        }
    }
}
