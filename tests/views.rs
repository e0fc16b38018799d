//! The view and data ops (`narrow`, `cat`, `swap_dims`, `repeat_interleave`, `select`,
//! `masked_fill`, `gather_rows`) against central finite differences of a single-rank
//! reference, in f64: every combination their per-axis rules allow (one a line), on one
//! rank, a 1-D mesh of two and a 2×2 mesh; every replica bitwise equal across the ranks
//! that hold it; each check shown to fail when the op's backward is perturbed; and the
//! refusals the types cannot see (sizes) as `Err`s that name the op, the shapes and the
//! placements.

#![allow(clippy::type_complexity)]

mod common;

use common::{dist, float_global, int_global, numeric_grad, on_mesh};
use dtensor::prelude::*;
use dtensor_core::{Tape, Var};
use std::sync::Arc;

type Axes = &'static [(AxisKind, usize)];
const ONE: Axes = &[(AxisKind::Tp, 1)];
const TP2: Axes = &[(AxisKind::Tp, 2)];
const DP2TP2: Axes = &[(AxisKind::Dp, 2), (AxisKind::Tp, 2)];
/// 1-D layouts: one rank and two.
const MESH1: [Axes; 2] = [ONE, TP2];
/// 2-D layouts: a 2×2 mesh (and its one-rank twin).
const MESH2: [Axes; 2] = [&[(AxisKind::Dp, 1), (AxisKind::Tp, 1)], DP2TP2];

type R = Replicate;
type I = Invariant;
type P = Partial;
type PAvg = Partial<Avg>;
type S0 = Shard<0>;
type S1 = Shard<1>;
type S2 = Shard<2>;
type S3 = Shard<3>;

/// A rank's piece of a value: its placements, the rank's mesh coordinates and the bits.
struct Piece {
    placements: Vec<Placement>,
    coords: Vec<usize>,
    bits: Vec<u64>,
}

fn piece<L: Layout>(t: &DTensor<L>) -> Piece {
    Piece {
        placements: t.placements().to_vec(),
        coords: t.device_mesh().coords().to_vec(),
        bits: t
            .as_local()
            .to_f64_vec()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
    }
}

/// Every rank's forward value and input gradients as full tensors, and its pieces of
/// them (the output first) for the replica check.
type RankOut = (Tensor, Vec<Tensor>, Vec<Piece>);

/// Replicas are bitwise equal: two ranks whose coordinates differ only on axes where a
/// value is `Replicate` or `Invariant` hold the same bits of it.
fn check_replicas(what: &str, results: &[RankOut]) {
    for (r1, a) in results.iter().enumerate() {
        for (r2, b) in results.iter().enumerate().skip(r1 + 1) {
            for (k, (pa, pb)) in a.2.iter().zip(&b.2).enumerate() {
                let replicas = pa
                    .coords
                    .iter()
                    .zip(&pb.coords)
                    .enumerate()
                    .all(|(i, (x, y))| {
                        x == y
                            || matches!(
                                pa.placements[i],
                                Placement::Replicate | Placement::Invariant
                            )
                    });
                if replicas {
                    assert!(
                        pa.bits == pb.bits,
                        "{what}: value {k} differs between replicas on ranks {r1} and {r2}"
                    );
                }
            }
        }
    }
}

/// Checks the forward value of every rank against `f_ref`, every input's gradient against
/// central differences of `d⟨seed, f_ref⟩`, and the replicas bitwise.
fn check_core(
    what: &str,
    axes: &[(AxisKind, usize)],
    inputs: &[&Tensor],
    f_ref: &dyn Fn(&[Tensor]) -> Tensor,
    per_rank: &(dyn Fn(&Arc<DeviceMesh>, &Tensor) -> Result<RankOut> + Sync),
) {
    let owned: Vec<Tensor> = inputs.iter().map(|t| (*t).clone()).collect();
    let y_ref = f_ref(&owned);
    let seed = float_global(y_ref.shape()).map(|v| v + 0.5);
    let want: Vec<Vec<f64>> = (0..owned.len())
        .map(|i| {
            let f = |xi: &Tensor| {
                let mut v = owned.clone();
                v[i] = xi.clone();
                f_ref(&v)
            };
            numeric_grad(&owned[i], &seed, &f)
        })
        .collect();
    let results = on_mesh(axes, |m| per_rank(m, &seed));
    for (rank, (y_full, grads, _)) in results.iter().enumerate() {
        assert_eq!(
            y_full.shape(),
            y_ref.shape(),
            "{what}: rank {rank} forward shape"
        );
        for (a, b) in y_full.to_f64_vec().iter().zip(y_ref.to_f64_vec()) {
            assert!(
                a.to_bits() == b.to_bits() || (a - b).abs() <= 1e-12 * (1.0 + b.abs()),
                "{what}: rank {rank} forward {a} vs {b}"
            );
        }
        assert_eq!(grads.len(), want.len(), "{what}: rank {rank} gradients");
        for (k, (g, w)) in grads.iter().zip(&want).enumerate() {
            assert_eq!(g.shape(), owned[k].shape(), "{what}: rank {rank} input {k}");
            for (i, (a, b)) in g.to_f64_vec().iter().zip(w).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                    "{what}: rank {rank} d/d(input {k})[{i}]: tape {a}, finite differences {b}"
                );
            }
        }
    }
    check_replicas(what, &results);
}

/// `v`'s gradient, checked to be laid out as the dual of `v`'s layout.
fn grad<L: Layout>(grads: &mut Gradients, v: &Var<'_, L>) -> Result<DTensor<L::Grad>> {
    let g: DTensor<L::Grad> = grads.take(v)?;
    assert_eq!(g.placements(), <L::Grad as Layout>::placements().as_slice());
    Ok(g)
}

/// Inputs `xs`, all laid out `L` and differentiable; `f_dist` builds the op on the tape
/// (any non-differentiable operand, a mask or ids, inside it).
fn grad_check<L: Layout, Out: Layout>(
    what: &str,
    axes: &[(AxisKind, usize)],
    xs: &[&Tensor],
    f_dist: impl for<'t> Fn(&'t Tape, &Arc<DeviceMesh>, &[Var<'t, L>]) -> Result<Var<'t, Out>> + Sync,
    f_ref: impl Fn(&[Tensor]) -> Tensor,
) {
    check_core(what, axes, xs, &f_ref, &|m, seed| {
        let tape = Tape::new();
        let vs: Vec<Var<'_, L>> = xs.iter().map(|x| tape.leaf(dist::<L>(x, m))).collect();
        let y = f_dist(&tape, m, &vs)?;
        let y_full = y.value().full_tensor()?;
        let mut pieces = vec![piece(y.value())];
        let mut grads = y.backward_with(dist::<Out::Grad>(seed, m))?;
        let mut full = Vec::new();
        for v in &vs {
            let g = grad(&mut grads, v)?;
            pieces.push(piece(&g));
            full.push(g.full_tensor()?);
        }
        Ok((y_full, full, pieces))
    });
}

/// One combination a line: `[layout of the inputs]`, or `[layout of the inputs] [layout
/// of the mask or ids]` (named `M` in the op's closure), on every mesh of `$meshes`.
macro_rules! check {
    ($meshes:expr, $what:expr, $xs:expr, $f:expr, $r:expr; $([$($l:tt)*] $([$($lm:tt)*])?),+ $(,)?) => {$({
        $(#[allow(dead_code)] type M = layout![$($lm)*];)?
        for axes in $meshes {
            let what = format!(
                "{} [{}]{} on {:?}",
                $what,
                stringify!($($l)*),
                concat!($(" [", stringify!($($lm)*), "]")?),
                axes
            );
            grad_check::<layout![$($l)*], _>(&what, axes, $xs, $f, $r);
        }
    })+};
}

fn small(shape: &[usize]) -> Tensor {
    int_global(shape).map(|v| v / 50.0)
}

/// A 0/1 mask of `shape` (integers), set at about a third of the elements.
fn mask_of(shape: &[usize]) -> Tensor {
    Tensor::from_fn(shape, |i| ((i * 7 + 3) % 3 == 0) as i64)
}

// ---- single-rank references, on whole tensors ----

fn narrow_ref(x: &Tensor, d: usize, start: usize, len: usize) -> Tensor {
    x.narrow(d, start, len).unwrap()
}

/// Dims `a` and `b` swapped, element by element.
fn swap_ref(x: &Tensor, a: usize, b: usize) -> Tensor {
    let s = x.shape().to_vec();
    let mut out = s.clone();
    out.swap(a, b);
    let v = x.to_f64_vec();
    let strides: Vec<usize> = (0..s.len()).map(|i| s[i + 1..].iter().product()).collect();
    Tensor::from_fn(&out, |flat| {
        let mut idx = vec![0; out.len()];
        let mut r = flat;
        for d in (0..out.len()).rev() {
            idx[d] = r % out[d];
            r /= out[d];
        }
        idx.swap(a, b);
        v[idx.iter().zip(&strides).map(|(i, s)| i * s).sum::<usize>()]
    })
}

/// Every slice of dim `d` repeated `times` times in place.
fn repeat_ref(x: &Tensor, d: usize, times: usize) -> Tensor {
    let slices: Vec<Tensor> = (0..x.shape()[d])
        .flat_map(|i| std::iter::repeat_n(x.narrow(d, i, 1).unwrap(), times))
        .collect();
    Tensor::cat(&slices, d).unwrap()
}

fn select_ref(mask: &Tensor, a: &Tensor, b: &Tensor) -> Tensor {
    let (m, av, bv) = (mask.to_f64_vec(), a.to_f64_vec(), b.to_f64_vec());
    Tensor::from_fn(a.shape(), |i| if m[i] != 0.0 { av[i] } else { bv[i] })
}

fn fill_ref(mask: &Tensor, x: &Tensor, value: f64) -> Tensor {
    let (m, xv) = (mask.to_f64_vec(), x.to_f64_vec());
    Tensor::from_fn(x.shape(), |i| if m[i] != 0.0 { value } else { xv[i] })
}

fn gather_ref(table: &Tensor, ids: &[usize]) -> Tensor {
    let rows: Vec<Tensor> = ids
        .iter()
        .map(|&i| table.narrow(0, i, 1).unwrap())
        .collect();
    Tensor::cat(&rows, 0).unwrap()
}

// ---------------------------------------------------------------------------------------
// Every combination of every rule
// ---------------------------------------------------------------------------------------

#[test]
fn every_narrow_rule_has_its_gradient() {
    // 5 rows over two ranks: uneven shards of the other dims.
    let x = small(&[5, 4, 3]);
    let r1 = |v: &[Tensor]| narrow_ref(&v[0], 1, 1, 2);
    check!(MESH1, "narrow 1", &[&x], |_, _, v| v[0].narrow::<1>(1, 2), r1;
        [Tp: S0], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check!(MESH2, "narrow 1", &[&x], |_, _, v| v[0].narrow::<1>(1, 2), r1;
        [Dp: S0, Tp: S2], [Dp: P, Tp: S0], [Dp: I, Tp: R], [Dp: S2, Tp: PAvg],
    );
    let r0 = |v: &[Tensor]| narrow_ref(&v[0], 0, 2, 3);
    check!(MESH1, "narrow 0", &[&x], |_, _, v| v[0].narrow::<0>(2, 3), r0;
        [Tp: S1], [Tp: S2], [Tp: R], [Tp: P],
    );
    let x4 = small(&[2, 3, 2, 4]);
    let r3 = |v: &[Tensor]| narrow_ref(&v[0], 3, 3, 1);
    check!(MESH1, "narrow 3", &[&x4], |_, _, v| v[0].narrow::<3>(3, 1), r3;
        [Tp: S0], [Tp: S1], [Tp: S2],
    );
    let r2 = |v: &[Tensor]| narrow_ref(&v[0], 2, 0, 1);
    check!(MESH2, "narrow 2", &[&x4], |_, _, v| v[0].narrow::<2>(0, 1), r2;
        [Dp: S3, Tp: S1],
    );
}

#[test]
fn every_cat_rule_has_the_gradient_of_every_part() {
    // Three parts of different extents along the joined dim.
    let (a, b, c) = (
        small(&[3, 2, 3]),
        small(&[3, 1, 3]).map(|v| v + 0.2),
        small(&[3, 4, 3]),
    );
    let r1 = |v: &[Tensor]| Tensor::cat(v, 1).unwrap();
    check!(MESH1, "cat 1", &[&a, &b, &c], |_, _, v| Var::cat::<1>(&[&v[0], &v[1], &v[2]]), r1;
        [Tp: S0], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check!(MESH2, "cat 1", &[&a, &b, &c], |_, _, v| Var::cat::<1>(&[&v[0], &v[1], &v[2]]), r1;
        [Dp: S0, Tp: S2], [Dp: P, Tp: S0], [Dp: R, Tp: I],
    );
    let (d, e) = (small(&[2, 4]), small(&[3, 4]));
    let r0 = |v: &[Tensor]| Tensor::cat(v, 0).unwrap();
    check!(MESH1, "cat 0", &[&d, &e], |_, _, v| Var::cat::<0>(&[&v[0], &v[1]]), r0;
        [Tp: S1], [Tp: R], [Tp: I], [Tp: P],
    );
    // One value used twice: its gradient is the sum of its two parts'.
    let twice = |v: &[Tensor]| Tensor::cat(&[v[0].clone(), v[0].clone()], 0).unwrap();
    check!(MESH1, "cat of one value twice", &[&d], |_, _, v| Var::cat::<0>(&[&v[0], &v[0]]), twice;
        [Tp: S1],
    );
}

#[test]
fn every_swap_dims_rule_has_its_gradient() {
    let x = small(&[3, 4, 2]);
    let r01 = |v: &[Tensor]| swap_ref(&v[0], 0, 1);
    check!(MESH1, "swap_dims 0 1", &[&x], |_, _, v| v[0].swap_dims::<0, 1>(), r01;
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    let r02 = |v: &[Tensor]| swap_ref(&v[0], 0, 2);
    check!(MESH1, "swap_dims 0 2", &[&x], |_, _, v| v[0].swap_dims::<0, 2>(), r02;
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: P],
    );
    let r12 = |v: &[Tensor]| swap_ref(&v[0], 1, 2);
    check!(MESH1, "swap_dims 1 2", &[&x], |_, _, v| v[0].swap_dims::<1, 2>(), r12;
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: I],
    );
    check!(MESH2, "swap_dims 0 1", &[&x], |_, _, v| v[0].swap_dims::<0, 1>(), r01;
        [Dp: S0, Tp: S1], [Dp: S1, Tp: S2], [Dp: P, Tp: S0], [Dp: S2, Tp: I],
    );
    let x4 = small(&[2, 3, 2, 3]);
    let r13 = |v: &[Tensor]| swap_ref(&v[0], 1, 3);
    check!(MESH1, "swap_dims 1 3", &[&x4], |_, _, v| v[0].swap_dims::<1, 3>(), r13;
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: S3],
    );
    let r03 = |v: &[Tensor]| swap_ref(&v[0], 0, 3);
    check!(MESH2, "swap_dims 0 3", &[&x4], |_, _, v| v[0].swap_dims::<0, 3>(), r03;
        [Dp: S0, Tp: S3],
    );
    let r23 = |v: &[Tensor]| swap_ref(&v[0], 2, 3);
    check!(MESH2, "swap_dims 2 3", &[&x4], |_, _, v| v[0].swap_dims::<2, 3>(), r23;
        [Dp: S2, Tp: S1],
    );
}

#[test]
fn every_repeat_rule_has_its_gradient() {
    // Dim 1 (2 slices) repeated 3 times; shards of it are even over two ranks.
    let x = small(&[3, 2, 3]);
    let r1 = |v: &[Tensor]| repeat_ref(&v[0], 1, 3);
    check!(MESH1, "repeat_interleave 1", &[&x], |_, _, v| v[0].repeat_interleave::<1>(3), r1;
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check!(MESH2, "repeat_interleave 1", &[&x], |_, _, v| v[0].repeat_interleave::<1>(3), r1;
        [Dp: S0, Tp: S1], [Dp: S1, Tp: P], [Dp: I, Tp: S2],
    );
    let x0 = small(&[4, 3]);
    let r0 = |v: &[Tensor]| repeat_ref(&v[0], 0, 2);
    check!(MESH2, "repeat_interleave 0", &[&x0], |_, _, v| v[0].repeat_interleave::<0>(2), r0;
        [Dp: S0, Tp: S0], [Dp: S1, Tp: R],
    );
}

#[test]
fn grouped_query_heads_repeat_per_rank_on_sharded_heads() {
    // [tokens, kv_heads, d] with 2 KV heads over Tp, each repeated for its 2 query heads:
    // every rank repeats its own KV head, and the result is its heads' rows.
    let k = small(&[3, 2, 4]);
    let r = |v: &[Tensor]| repeat_ref(&v[0], 1, 2);
    check!(MESH2, "repeat KV heads", &[&k], |_, _, v| v[0].repeat_interleave::<1>(2), r;
        [Dp: S0, Tp: S1],
    );
}

#[test]
fn every_select_rule_has_the_gradients_of_both_branches() {
    let (a, b) = (small(&[5, 4]), small(&[5, 4]).map(|v| 0.4 - v));
    let mask = mask_of(&[5, 4]);
    let mr = mask.clone();
    let r = move |v: &[Tensor]| select_ref(&mr, &v[0], &v[1]);
    let m = &mask;
    check!(MESH1, "select", &[&a, &b], |_, mesh, v| Var::select(&dist::<M>(m, mesh), &v[0], &v[1]), &r;
        [Tp: S0] [Tp: S0], [Tp: S1] [Tp: S1], [Tp: R] [Tp: R], [Tp: R] [Tp: I],
        [Tp: I] [Tp: I], [Tp: I] [Tp: R], [Tp: P] [Tp: R], [Tp: P] [Tp: I],
        [Tp: PAvg] [Tp: I], [Tp: PAvg] [Tp: R],
    );
    check!(MESH2, "select", &[&a, &b], |_, mesh, v| Var::select(&dist::<M>(m, mesh), &v[0], &v[1]), &r;
        [Dp: S0, Tp: S1] [Dp: S0, Tp: S1], [Dp: P, Tp: S0] [Dp: I, Tp: S0],
        [Dp: S1, Tp: R] [Dp: S1, Tp: I],
    );
}

#[test]
fn every_masked_fill_rule_has_its_gradient() {
    let x = small(&[5, 2, 3]);
    let mask = mask_of(&[5, 2, 3]);
    let mr = mask.clone();
    let r = move |v: &[Tensor]| fill_ref(&mr, &v[0], 7.5);
    let m = &mask;
    check!(MESH1, "masked_fill", &[&x], |_, mesh, v| v[0].masked_fill(&dist::<M>(m, mesh), 7.5), &r;
        [Tp: S0] [Tp: S0], [Tp: S1] [Tp: S1], [Tp: S2] [Tp: S2], [Tp: R] [Tp: R],
        [Tp: R] [Tp: I], [Tp: I] [Tp: I], [Tp: I] [Tp: R],
    );
    check!(MESH2, "masked_fill", &[&x], |_, mesh, v| v[0].masked_fill(&dist::<M>(m, mesh), 7.5), &r;
        [Dp: S0, Tp: S2] [Dp: S0, Tp: S2], [Dp: R, Tp: S1] [Dp: I, Tp: S1],
    );
}

/// Ids with repeats (so the backward adds rows) and one row never read.
fn row_ids() -> (Tensor, Vec<usize>) {
    let v: Vec<usize> = vec![3, 0, 3, 1, 4, 3];
    (
        Tensor::from_vec(v.iter().map(|&i| i as i64).collect(), &[6]).unwrap(),
        v,
    )
}

#[test]
fn every_gather_rule_has_the_table_gradient() {
    let table = small(&[5, 4]);
    let (ids, idv) = row_ids();
    let r = move |v: &[Tensor]| gather_ref(&v[0], &idv);
    let i = &ids;
    check!(MESH1, "gather_rows", &[&table], |_, mesh, v| v[0].gather_rows(&dist::<M>(i, mesh)), &r;
        [Tp: R] [Tp: S0], [Tp: R] [Tp: R], [Tp: R] [Tp: I], [Tp: I] [Tp: I],
        [Tp: P] [Tp: R], [Tp: P] [Tp: I], [Tp: S1] [Tp: R], [Tp: S1] [Tp: I],
    );
    check!(MESH2, "gather_rows", &[&table], |_, mesh, v| v[0].gather_rows(&dist::<M>(i, mesh)), &r;
        [Dp: R, Tp: S1] [Dp: S0, Tp: I], [Dp: P, Tp: R] [Dp: I, Tp: S0],
        [Dp: S1, Tp: I] [Dp: R, Tp: I],
    );
    let table3 = small(&[5, 2, 3]);
    check!(MESH1, "gather_rows (3-D)", &[&table3], |_, mesh, v| v[0].gather_rows(&dist::<M>(i, mesh)), &r;
        [Tp: S2] [Tp: R], [Tp: R] [Tp: S0],
    );
}

// ---------------------------------------------------------------------------------------
// Each check fails on a wrong backward
// ---------------------------------------------------------------------------------------

/// Rows split over both axes, the other dims whole: the layout the emulated ops below run
/// on (each is local there, so one rank and the 2×2 mesh compute the same thing).
type Rows = layout![Dp: Shard<0>, Tp: Shard<0>];
/// Whole on both axes (the gradient arrives as pending terms): for the row gather.
type Whole = layout![Dp: Replicate, Tp: Replicate];

/// Runs the check of an op emulated through `Var::custom` (`forward` on the local
/// piece; `backward(dy, x)`, right or deliberately wrong) on one rank and on the 2×2 mesh,
/// laid out `L`; returns whether each check failed.
fn fails_with<L: Layout>(
    x: &Tensor,
    out_shape: &[usize],
    forward: &(dyn Fn(&Tensor) -> Tensor + Sync),
    backward: Arc<dyn Fn(&Tensor, &Tensor) -> Tensor + Send + Sync>,
    f_ref: &dyn Fn(&Tensor) -> Tensor,
) -> Vec<bool> {
    MESH2
        .iter()
        .map(|axes| {
            let check = || {
                grad_check::<L, L>(
                    "an op with a perturbed backward",
                    axes,
                    &[x],
                    |_, _, v| {
                        let backward = backward.clone();
                        v[0].custom::<L>(
                            "perturbed",
                            out_shape,
                            |x| Ok(forward(x)),
                            move |dy, x| Ok(backward(dy, x)),
                        )
                    },
                    |v: &[Tensor]| f_ref(&v[0]),
                )
            };
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(check)).is_err()
        })
        .collect()
}

/// Host arithmetic on f64 tensors, for the emulated backwards.
fn host(t: &Tensor, shape: &[usize], f: impl Fn(&[f64], usize) -> f64) -> Tensor {
    let v = t.to_f64_vec();
    Tensor::from_fn(shape, |i| f(&v, i))
}

/// The check of each op passes with the op's backward and fails with a plausible wrong
/// one (each op emulated with its forward on the local pieces, on one rank and 2×2).
#[test]
fn each_check_fails_when_the_backward_is_perturbed() {
    fn both(right: Vec<bool>, wrong: Vec<bool>, what: &str) {
        assert_eq!(
            right,
            vec![false, false],
            "{what}: the right backward must pass"
        );
        assert_eq!(
            wrong,
            vec![true, true],
            "{what}: the wrong backward must fail"
        );
    }
    let x = small(&[4, 6]);

    // narrow: the gradient padded at the narrowed offset, or at 0.
    let pad = |at: usize| {
        move |dy: &Tensor, x: &Tensor| {
            let mut g = x.zeros_like().unwrap();
            g.write_at(1, at, dy).unwrap();
            g
        }
    };
    let fwd = |x: &Tensor| x.narrow(1, 2, 3).unwrap();
    let right = fails_with::<Rows>(&x, &[4, 3], &fwd, Arc::new(pad(2)), &fwd);
    let wrong = fails_with::<Rows>(&x, &[4, 3], &fwd, Arc::new(pad(0)), &fwd);
    both(right, wrong, "narrow");

    // cat with a part of ones: x's gradient is its own columns, or the other part's.
    let fwd = |x: &Tensor| Tensor::cat(&[x.clone(), x.map(|_| 1.0)], 1).unwrap();
    let part = |at: usize| move |dy: &Tensor, _: &Tensor| dy.narrow(1, at, 6).unwrap();
    let right = fails_with::<Rows>(&x, &[4, 12], &fwd, Arc::new(part(0)), &fwd);
    let wrong = fails_with::<Rows>(&x, &[4, 12], &fwd, Arc::new(part(6)), &fwd);
    both(right, wrong, "cat");

    // swap_dims 1, 2 of [4, 3, 2]: the gradient swapped back, or only reshaped.
    let x3 = small(&[4, 3, 2]);
    let fwd = |x: &Tensor| swap_ref(x, 1, 2);
    let back = |dy: &Tensor, _: &Tensor| swap_ref(dy, 1, 2);
    let reshaped = |dy: &Tensor, x: &Tensor| dy.clone().reshape(x.shape()).unwrap();
    let right = fails_with::<Rows>(&x3, &[4, 2, 3], &fwd, Arc::new(back), &fwd);
    let wrong = fails_with::<Rows>(&x3, &[4, 2, 3], &fwd, Arc::new(reshaped), &fwd);
    both(right, wrong, "swap_dims");

    // repeat_interleave of the columns: the sum over the copies, or the first copy.
    let fwd = |x: &Tensor| repeat_ref(x, 1, 2);
    let copies = |sum: bool| {
        move |dy: &Tensor, x: &Tensor| {
            let c = x.shape()[1];
            host(dy, x.shape(), |v, i| {
                let (r, j) = (i / c, i % c);
                v[r * 2 * c + 2 * j] + if sum { v[r * 2 * c + 2 * j + 1] } else { 0.0 }
            })
        }
    };
    let right = fails_with::<Rows>(&x, &[4, 12], &fwd, Arc::new(copies(true)), &fwd);
    let wrong = fails_with::<Rows>(&x, &[4, 12], &fwd, Arc::new(copies(false)), &fwd);
    both(right, wrong, "repeat_interleave");

    // masked_fill by a mask the values themselves decide (the same on every layout): the
    // gradient zeroed where filled, or passed everywhere.
    // Inputs are multiples of 1/50: the half-way shift keeps a finite difference
    // from moving an element across the mask.
    let filled = |v: f64| (v * 50.0 + 0.5).rem_euclid(3.0) < 1.0;
    let fwd = move |x: &Tensor| x.map(|v| if filled(v) { 7.5 } else { v });
    let zero_filled = move |dy: &Tensor, x: &Tensor| {
        let xv = x.to_f64_vec();
        host(
            dy,
            dy.shape(),
            |g, i| if filled(xv[i]) { 0.0 } else { g[i] },
        )
    };
    let everywhere = |dy: &Tensor, _: &Tensor| dy.clone();
    let right = fails_with::<Rows>(&x, &[4, 6], &fwd, Arc::new(zero_filled), &fwd);
    let wrong = fails_with::<Rows>(&x, &[4, 6], &fwd, Arc::new(everywhere), &fwd);
    both(right, wrong, "masked_fill");

    // select between x and a constant by the same kind of mask: the gradient to x where
    // x was taken, or where the constant was (the branches swapped).
    let fwd = move |x: &Tensor| x.map(|v| if filled(v) { v } else { -1.0 });
    let taken = |swapped: bool| {
        move |dy: &Tensor, x: &Tensor| {
            let xv = x.to_f64_vec();
            host(dy, dy.shape(), |g, i| {
                if filled(xv[i]) != swapped {
                    g[i]
                } else {
                    0.0
                }
            })
        }
    };
    let right = fails_with::<Rows>(&x, &[4, 6], &fwd, Arc::new(taken(false)), &fwd);
    let wrong = fails_with::<Rows>(&x, &[4, 6], &fwd, Arc::new(taken(true)), &fwd);
    both(right, wrong, "select");

    // gather of rows with repeats: the gradient rows added into their rows, or the last
    // one written kept.
    let pick = [3usize, 0, 3, 1, 3];
    let fwd = move |x: &Tensor| gather_ref(x, &pick);
    let scatter = |add: bool| {
        move |dy: &Tensor, x: &Tensor| {
            let c = x.shape()[1];
            let d = dy.to_f64_vec();
            let mut g = vec![0.0; x.numel()];
            for (k, &row) in pick.iter().enumerate() {
                for j in 0..c {
                    g[row * c + j] = d[k * c + j] + if add { g[row * c + j] } else { 0.0 };
                }
            }
            Tensor::from_vec(g, x.shape()).unwrap()
        }
    };
    let right = fails_with::<Whole>(&x, &[5, 6], &fwd, Arc::new(scatter(true)), &fwd);
    let wrong = fails_with::<Whole>(&x, &[5, 6], &fwd, Arc::new(scatter(false)), &fwd);
    both(right, wrong, "gather_rows");
}

// ---------------------------------------------------------------------------------------
// Values, bits and run-time refusals
// ---------------------------------------------------------------------------------------

#[test]
fn select_and_masked_fill_never_leak_the_branch_not_taken() {
    // A NaN or an infinity in the branch not taken must not reach the result (an
    // arithmetic blend would give NaN), and -inf fills exactly (a softmax mask).
    let a = Tensor::from_vec(vec![1.0, f64::NAN, 3.0, f64::INFINITY], &[2, 2]).unwrap();
    let b = Tensor::from_vec(vec![f64::NAN, 2.0, f64::NEG_INFINITY, 4.0], &[2, 2]).unwrap();
    let mask = Tensor::from_vec(vec![1i64, 0, 1, 0], &[2, 2]).unwrap();
    on_mesh(TP2, |m| {
        type L = layout![Tp: Shard<0>];
        let (a, b, mk) = (dist::<L>(&a, m), dist::<L>(&b, m), dist::<L>(&mask, m));
        let y = DTensor::select(&mk, &a, &b)?.full_tensor()?;
        assert_eq!(y.to_f64_vec(), vec![1.0, 2.0, 3.0, 4.0]);
        let f = a
            .masked_fill(&mk, f64::NEG_INFINITY)?
            .full_tensor()?
            .to_f64_vec();
        assert_eq!(f[0], f64::NEG_INFINITY);
        assert!(f[1].is_nan());
        assert_eq!(f[2], f64::NEG_INFINITY);
        assert_eq!(f[3], f64::INFINITY);
        Ok(())
    });
}

#[test]
fn views_keep_any_dtype_bit_for_bit() {
    // bf16 and integer values move exactly (the gathers copy bits).
    let x = Tensor::from_fn(&[3, 4], |i| {
        dtensor_kernels::half::bf16::from_f64(i as f64 * 0.37 - 1.1)
    });
    let ids = Tensor::from_fn(&[3, 4], |i| (i * 31 % 17) as i64);
    on_mesh(TP2, |m| {
        type L = layout![Tp: Shard<0>];
        for t in [&x, &ids] {
            let d = dist::<L>(t, m);
            let s = d.swap_dims::<0, 1>()?.full_tensor()?;
            assert_eq!(s, swap_ref_bits(t));
            let r = d
                .repeat_interleave::<1>(2)?
                .narrow::<1>(2, 2)?
                .full_tensor()?;
            assert_eq!(
                r,
                Tensor::cat(&[t.narrow(1, 1, 1)?, t.narrow(1, 1, 1)?], 1)?
            );
        }
        Ok(())
    });
}

/// The transpose of a 2-D tensor of any dtype, through the kernels' own copy.
fn swap_ref_bits(t: &Tensor) -> Tensor {
    let c = t.shape()[1];
    t.pack(1, &vec![1; c])
        .unwrap()
        .reshape(&[c, t.shape()[0]])
        .unwrap()
}

#[test]
fn sizes_the_types_cannot_see_are_errors_naming_op_shapes_and_placements() {
    let x = small(&[3, 4]);
    let errs = on_mesh(TP2, |m| {
        let mut e = Vec::new();
        let s1 = dist::<layout![Tp: Shard<1>]>(&x, m);
        let s0 = dist::<layout![Tp: Shard<0>]>(&x, m);
        // 3 rows over 2 ranks: a repeated chunk would not be the result's chunk.
        e.push(s0.repeat_interleave::<0>(2).unwrap_err().to_string());
        e.push(s1.narrow::<0>(2, 2).unwrap_err().to_string());
        let other = dist::<layout![Tp: Shard<1>]>(&small(&[3, 2]), m);
        e.push(DTensor::cat::<0>(&[&s1, &other]).unwrap_err().to_string());
        let (bad_ids, _) = (Tensor::from_vec(vec![0i64, 5], &[2]).unwrap(), ());
        let r = dist::<layout![Tp: Replicate]>(&x, m);
        let ids = dist::<layout![Tp: Replicate]>(&bad_ids, m);
        e.push(r.gather_rows(&ids).unwrap_err().to_string());
        let mask = dist::<layout![Tp: Shard<1>]>(&mask_of(&[3, 2]), m);
        e.push(s1.masked_fill(&mask, 0.0).unwrap_err().to_string());
        Ok(e)
    });
    let e = &errs[0];
    assert!(
        e[0].contains("DTensor::repeat_interleave")
            && e[0].contains("[3, 4]")
            && e[0].contains("S(0)"),
        "{}",
        e[0]
    );
    assert!(e[0].contains("do not split evenly"), "{}", e[0]);
    assert!(
        e[1].contains("DTensor::narrow") && e[1].contains("rows 2..2+2") && e[1].contains("S(1)"),
        "{}",
        e[1]
    );
    assert!(
        e[2].contains("DTensor::cat") && e[2].contains("[3, 2]"),
        "{}",
        e[2]
    );
    assert!(
        e[3].contains("DTensor::gather_rows") && e[3].contains("id 5") && e[3].contains("[3, 4]"),
        "{}",
        e[3]
    );
    assert!(
        e[4].contains("DTensor::masked_fill") && e[4].contains("shapes differ"),
        "{}",
        e[4]
    );
}

#[test]
fn a_cat_of_values_on_two_tapes_is_an_error() {
    let x = small(&[2, 3]);
    on_mesh(ONE, |m| {
        let (t1, t2) = (Tape::new(), Tape::new());
        let a = t1.leaf(dist::<layout![Tp: Replicate]>(&x, m));
        let b = t2.leaf(dist::<layout![Tp: Replicate]>(&x, m));
        let e = Var::cat::<0>(&[&a, &b])
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("Var::cat") && e.contains("different tapes"),
            "{e}"
        );
        Ok(())
    });
}

/// The ops of one program: every view op and its backward, on the mesh's tensors.
fn view_program(m: &Arc<DeviceMesh>) -> Result<Vec<Vec<f64>>> {
    type L = layout![Tp: Replicate];
    let x = small(&[4, 3, 2]);
    let mask = repeat_ref(&mask_of(&[4, 2, 2]), 1, 2);
    let (ids, _) = row_ids();
    let tape = Tape::new();
    let xv = tape.leaf(DTensor::<L>::from_global(&x, m)?);
    let mk = DTensor::<L>::from_global(&mask, m)?;
    let a = xv
        .narrow::<1>(1, 2)?
        .swap_dims::<0, 2>()?
        .repeat_interleave::<1>(2)?;
    let b = Var::cat::<1>(&[&a, &a])?.swap_dims::<0, 2>()?;
    let c = b.masked_fill(&mk, -2.0)?;
    let d = Var::select(&mk, &c, &b.scale(3.0)?)?.merge_dims::<1>()?;
    let g = d.gather_rows(&DTensor::<L>::from_global(&ids, m)?)?;
    let seed =
        DTensor::<<L as Layout>::Grad>::from_global(&float_global(g.value().global_shape()), m)?;
    let y = g.value().as_local().to_host()?.to_f64_vec();
    let dx = g.backward_with(seed)?.take(&xv)?;
    if m.device().is_some() {
        assert!(dx.as_local().is_cuda(), "the gradient left the device");
    }
    Ok(vec![y, dx.as_local().to_host()?.to_f64_vec()])
}

/// Device tensors go through the kernels' front doors: the same values and gradients on
/// a GPU (an NCCL rank, every tensor in its memory) as on the host, bit for bit.
#[test]
#[ignore = "needs a CUDA GPU, libnccl, NVRTC and cuBLAS, and --features cuda,nccl"]
fn views_on_a_gpu_equal_the_host_bit_for_bit() {
    let on_host = on_mesh(ONE, view_program);
    #[cfg(feature = "nccl")]
    {
        use dtensor::collectives::{nccl, Communicator};
        let mesh = Mesh::new(ONE).unwrap();
        let on_gpu: Vec<Vec<Vec<f64>>> = nccl::launch(1, |comm| -> Result<Vec<Vec<f64>>> {
            let dm = DeviceMesh::new(comm as Arc<dyn Communicator>, mesh.clone())?;
            assert!(
                dm.device().is_some(),
                "an NCCL mesh keeps its tensors on a GPU"
            );
            view_program(&dm)
        })
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
        let bits = |v: &Vec<Vec<Vec<f64>>>| -> Vec<Vec<Vec<u64>>> {
            v.iter()
                .map(|r| {
                    r.iter()
                        .map(|t| t.iter().map(|x| x.to_bits()).collect())
                        .collect()
                })
                .collect()
        };
        assert_eq!(bits(&on_host), bits(&on_gpu));
    }
    #[cfg(not(feature = "nccl"))]
    panic!(
        "built without the `nccl` feature (host result: {} values)",
        on_host[0][0].len()
    );
}
