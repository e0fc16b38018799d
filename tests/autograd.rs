//! The tape's gradients against central finite differences of the single-rank reference, in
//! f64. Each case lays the global inputs out as the rule's layouts on one rank, a 1-D (2
//! ranks) or a 2-D (2×2) mesh, runs the op on the tape, seeds the output with a gradient
//! laid out as the output's dual (partial terms spread so no rank holds the whole seed), and
//! compares every differentiable input's gradient (`full_tensor()`, laid out as the input's
//! dual) with `d⟨seed, f(x)⟩/dx` computed from the reference op on the global tensors.
//!
//! The `every_*` tests cover every `Var` op, every combination of its per-axis rule table,
//! and every differentiable input, one combination a line (the `check*!` macros); the
//! tests before them are the compositions a model uses (column → row, SP, vocab-parallel).

#![allow(clippy::type_complexity)]

mod common;

use common::{dist, float_global, int_global, numeric_grad, on_mesh};
use dtensor::prelude::*;
use dtensor_core::{Tape, Var};
use dtensor_kernels::ops::{self, Transpose};
use std::sync::Arc;

const TP2: &[(AxisKind, usize)] = &[(AxisKind::Tp, 2)];
const DP2TP2: &[(AxisKind, usize)] = &[(AxisKind::Dp, 2), (AxisKind::Tp, 2)];

/// What every rank returns: the forward value (`full_tensor()`) and the full gradient of
/// every differentiable input, in order.
type RankOut = (Tensor, Vec<Tensor>);

/// The non-generic half of every check: the reference value, the seed, the finite
/// differences of each input marked differentiable, and the comparison of every rank's
/// forward value and gradients (shapes first, so a short gradient cannot pass).
fn check_core(
    what: &str,
    axes: &[(AxisKind, usize)],
    inputs: &[(&Tensor, bool)],
    f_ref: &dyn Fn(&[Tensor]) -> Tensor,
    per_rank: &(dyn Fn(&Arc<DeviceMesh>, &Tensor) -> Result<RankOut> + Sync),
) {
    let owned: Vec<Tensor> = inputs.iter().map(|(t, _)| (*t).clone()).collect();
    let y_ref = f_ref(&owned);
    let seed = float_global(y_ref.shape()).map(|v| v + 0.5);
    let want: Vec<(usize, Vec<f64>)> = (0..inputs.len())
        .filter(|&i| inputs[i].1)
        .map(|i| {
            let f = |xi: &Tensor| {
                let mut v = owned.clone();
                v[i] = xi.clone();
                f_ref(&v)
            };
            (i, numeric_grad(&owned[i], &seed, &f))
        })
        .collect();
    let results = on_mesh(axes, |m| per_rank(m, &seed));
    for (rank, (y_full, grads)) in results.into_iter().enumerate() {
        assert_eq!(
            y_full.shape(),
            y_ref.shape(),
            "{what}: rank {rank} forward shape"
        );
        let (y, yr) = (y_full.to_f64_vec(), y_ref.to_f64_vec());
        for (a, b) in y.iter().zip(&yr) {
            assert!(
                (a - b).abs() <= 1e-10 * (1.0 + b.abs()),
                "{what}: rank {rank} forward {a} vs {b}"
            );
        }
        assert_eq!(grads.len(), want.len(), "{what}: rank {rank} gradients");
        for (g, (k, w)) in grads.iter().zip(&want) {
            assert_eq!(
                g.shape(),
                owned[*k].shape(),
                "{what}: rank {rank} input {k}"
            );
            for (i, (a, b)) in g.to_f64_vec().iter().zip(w).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                    "{what}: rank {rank} d/d(input {k})[{i}]: tape {a}, finite differences {b}"
                );
            }
        }
    }
}

/// `v`'s gradient, checked to be laid out as the dual of `v`'s layout, as a full tensor.
fn full_grad<L: Layout>(grads: &mut Gradients, v: &Var<'_, L>) -> Result<Tensor> {
    let g: DTensor<L::Grad> = grads.take(v)?;
    assert_eq!(g.placements(), <L::Grad as Layout>::placements().as_slice());
    g.full_tensor()
}

fn grad_check<LX: Layout, Out: Layout>(
    what: &str,
    axes: &[(AxisKind, usize)],
    x: &Tensor,
    f_dist: impl for<'t> Fn(&'t Tape, &Arc<DeviceMesh>, Var<'t, LX>) -> Result<Var<'t, Out>> + Sync,
    f_ref: impl Fn(&Tensor) -> Tensor,
) {
    check_core(what, axes, &[(x, true)], &|v| f_ref(&v[0]), &|m, seed| {
        let tape = Tape::new();
        let xv = tape.leaf(dist::<LX>(x, m));
        let y = f_dist(&tape, m, xv.clone())?;
        let y_full = y.value().full_tensor()?;
        let mut grads = y.backward_with(dist::<Out::Grad>(seed, m))?;
        Ok((y_full, vec![full_grad(&mut grads, &xv)?]))
    });
}

/// Two inputs laid out `LA` and `LB`; checks `b`'s gradient as well when `b_diff`.
fn grad_check_two<LA: Layout, LB: Layout, Out: Layout>(
    what: &str,
    axes: &[(AxisKind, usize)],
    (a, b, b_diff): (&Tensor, &Tensor, bool),
    f_dist: impl for<'t> Fn(&'t Tape, Var<'t, LA>, Var<'t, LB>) -> Result<Var<'t, Out>> + Sync,
    f_ref: &dyn Fn(&[Tensor]) -> Tensor,
) {
    check_core(what, axes, &[(a, true), (b, b_diff)], f_ref, &|m, seed| {
        let tape = Tape::new();
        let av = tape.leaf(dist::<LA>(a, m));
        let bv = tape.leaf(dist::<LB>(b, m));
        let y = f_dist(&tape, av.clone(), bv.clone())?;
        let y_full = y.value().full_tensor()?;
        let mut grads = y.backward_with(dist::<Out::Grad>(seed, m))?;
        let mut g = vec![full_grad(&mut grads, &av)?];
        if b_diff {
            g.push(full_grad(&mut grads, &bv)?);
        }
        Ok((y_full, g))
    });
}

/// Both operands' gradients.
fn grad_check2<LA: Layout, LB: Layout, Out: Layout>(
    what: &str,
    axes: &[(AxisKind, usize)],
    a: &Tensor,
    b: &Tensor,
    f_dist: impl for<'t> Fn(&'t Tape, Var<'t, LA>, Var<'t, LB>) -> Result<Var<'t, Out>> + Sync,
    f_ref: impl Fn(&Tensor, &Tensor) -> Tensor,
) {
    grad_check_two(what, axes, (a, b, true), f_dist, &|v| f_ref(&v[0], &v[1]));
}

/// The first operand's gradient; the second (ids, targets) is an input without one.
fn grad_check_with<LA: Layout, LB: Layout, Out: Layout>(
    what: &str,
    axes: &[(AxisKind, usize)],
    a: &Tensor,
    b: &Tensor,
    f_dist: impl for<'t> Fn(&'t Tape, Var<'t, LA>, Var<'t, LB>) -> Result<Var<'t, Out>> + Sync,
    f_ref: impl Fn(&Tensor, &Tensor) -> Tensor,
) {
    grad_check_two(what, axes, (a, b, false), f_dist, &|v| f_ref(&v[0], &v[1]));
}

/// Three inputs (layer norm: x, weight and bias, the last two laid out alike).
fn grad_check3<LX: Layout, LW: Layout, Out: Layout>(
    what: &str,
    axes: &[(AxisKind, usize)],
    (x, w, b): (&Tensor, &Tensor, &Tensor),
    f_dist: impl for<'t> Fn(Var<'t, LX>, Var<'t, LW>, Var<'t, LW>) -> Result<Var<'t, Out>> + Sync,
    f_ref: impl Fn(&Tensor, &Tensor, &Tensor) -> Tensor,
) {
    let inputs = [(x, true), (w, true), (b, true)];
    check_core(
        what,
        axes,
        &inputs,
        &|v| f_ref(&v[0], &v[1], &v[2]),
        &|m, seed| {
            let tape = Tape::new();
            let xv = tape.leaf(dist::<LX>(x, m));
            let wv = tape.leaf(dist::<LW>(w, m));
            let bv = tape.leaf(dist::<LW>(b, m));
            let y = f_dist(xv.clone(), wv.clone(), bv.clone())?;
            let y_full = y.value().full_tensor()?;
            let mut grads = y.backward_with(dist::<Out::Grad>(seed, m))?;
            let g = vec![
                full_grad(&mut grads, &xv)?,
                full_grad(&mut grads, &wv)?,
                full_grad(&mut grads, &bv)?,
            ];
            Ok((y_full, g))
        },
    );
}

fn small(shape: &[usize]) -> Tensor {
    int_global(shape).map(|v| v / 50.0)
}

#[test]
fn matmul_t_column_and_row_rules_have_the_dual_gradients() {
    let (x, w) = (small(&[4, 6]), small(&[5, 6]));
    let wr = w.clone();
    // Column-parallel: x Replicate (entered with to_replicate), W Shard<0>.
    grad_check::<layout![Dp: Shard<0>, Tp: Invariant], layout![Dp: Shard<0>, Tp: Shard<1>]>(
        "column x",
        DP2TP2,
        &x,
        |t, m, x| {
            x.to_replicate(Tp)?
                .matmul_t(&t.leaf(dist::<layout![Dp: Replicate, Tp: Shard<0>]>(&w, m)))
        },
        |x| ops::matmul(x, Transpose::No, &wr, Transpose::Yes).unwrap(),
    );
    let xr = x.clone();
    grad_check::<layout![Dp: Replicate, Tp: Shard<0>], layout![Dp: Shard<0>, Tp: Shard<1>]>(
        "column W",
        DP2TP2,
        &w,
        |t, m, w| {
            t.constant(dist::<layout![Dp: Shard<0>, Tp: Replicate]>(&x, m))
                .matmul_t(&w)
        },
        |w| ops::matmul(&xr, Transpose::No, w, Transpose::Yes).unwrap(),
    );
    // Row-parallel: both sharded on the contracted dim, the output Partial, then all_reduce.
    let (x2, w2) = (small(&[4, 6]), small(&[3, 6]));
    let w2r = w2.clone();
    grad_check::<layout![Dp: Shard<0>, Tp: Shard<1>], layout![Dp: Shard<0>, Tp: Invariant]>(
        "row x",
        DP2TP2,
        &x2,
        |t, m, x| {
            x.matmul_t(&t.leaf(dist::<layout![Dp: Replicate, Tp: Shard<1>]>(&w2, m)))?
                .all_reduce(Tp)
        },
        |x| ops::matmul(x, Transpose::No, &w2r, Transpose::Yes).unwrap(),
    );
}

#[test]
fn matmul_contraction_and_partial_rules_have_the_dual_gradients() {
    let (a, b) = (small(&[3, 4]), small(&[4, 5]));
    let br = b.clone();
    grad_check::<layout![Tp: Shard<1>], layout![Tp: Partial]>(
        "S1·S0",
        TP2,
        &a,
        |t, m, a| a.matmul(&t.leaf(dist::<layout![Tp: Shard<0>]>(&b, m))),
        |a| ops::matmul(a, Transpose::No, &br, Transpose::No).unwrap(),
    );
    let (b2, b2r) = (b.clone(), b.clone());
    grad_check::<layout![Tp: Partial], layout![Tp: Partial]>(
        "P·R",
        TP2,
        &a,
        |t, m, a| a.matmul(&t.leaf(dist::<layout![Tp: Replicate]>(&b2, m))),
        |a| ops::matmul(a, Transpose::No, &b2r, Transpose::No).unwrap(),
    );
    let ar = a.clone();
    grad_check::<layout![Tp: Shard<1>], layout![Tp: Shard<1>]>(
        "R·S1 (B)",
        TP2,
        &b,
        |t, m, b| t.leaf(dist::<layout![Tp: Replicate]>(&a, m)).matmul(&b),
        |b| ops::matmul(&ar, Transpose::No, b, Transpose::No).unwrap(),
    );
}

#[test]
fn pointwise_ops_have_the_dual_gradients() {
    let (x, y) = (small(&[4, 3]), small(&[4, 3]).map(|v| v + 0.3));
    let yr = y.clone();
    grad_check::<layout![Tp: Partial], layout![Tp: Partial]>(
        "mul P·R",
        TP2,
        &x,
        |t, m, x| x.mul(&t.leaf(dist::<layout![Tp: Replicate]>(&y, m))),
        |x| x.mul(&yr).unwrap(),
    );
    grad_check::<layout![Dp: Shard<0>, Tp: Shard<1>], layout![Dp: Shard<0>, Tp: Shard<1>]>(
        "gelu",
        DP2TP2,
        &x,
        |_, _, x| x.gelu(),
        |x| ops::gelu(x).unwrap(),
    );
    grad_check::<layout![Dp: Shard<0>, Tp: Replicate], layout![Dp: Shard<0>, Tp: Replicate]>(
        "silu",
        DP2TP2,
        &x,
        |_, _, x| x.silu(),
        |x| ops::silu(x).unwrap(),
    );
    let (up, upr) = (y.clone(), y.clone());
    grad_check::<layout![Tp: Shard<1>], layout![Tp: Shard<1>]>(
        "swiglu gate",
        TP2,
        &x,
        |t, m, g| g.swiglu(&t.leaf(dist::<layout![Tp: Shard<1>]>(&up, m))),
        |g| ops::swiglu(g, &upr).unwrap(),
    );
    grad_check::<layout![Tp: Invariant], layout![Tp: Invariant]>(
        "scale",
        TP2,
        &x,
        |_, _, x| x.scale(-1.5),
        |x| x.scale(-1.5),
    );
    let (z, zr) = (y.clone(), y.clone());
    grad_check::<layout![Tp: Shard<0>], layout![Tp: Shard<0>]>(
        "sub",
        TP2,
        &x,
        |t, m, x| x.sub(&t.leaf(dist::<layout![Tp: Shard<0>]>(&z, m))),
        |x| ops::sub(x, &zr).unwrap(),
    );
}

#[test]
fn bias_reduction_softmax_and_norm_have_the_dual_gradients() {
    let x = small(&[5, 4]);
    let b = small(&[4]);
    let xr = x.clone();
    // The bias of a column-parallel layer: Shard<0> over Tp, Replicate over Dp (its
    // gradient sums this rank's rows: Partial over Dp).
    grad_check::<layout![Dp: Replicate, Tp: Shard<0>], layout![Dp: Shard<0>, Tp: Shard<1>]>(
        "add_row bias",
        DP2TP2,
        &b,
        |t, m, b| {
            t.constant(dist::<layout![Dp: Shard<0>, Tp: Shard<1>]>(&x, m))
                .add_row(&b)
        },
        |b| ops::add_row(&xr, b).unwrap(),
    );
    grad_check::<layout![Dp: Shard<0>, Tp: Shard<1>], layout![Dp: Partial, Tp: Shard<0>]>(
        "sum over a sharded dim",
        DP2TP2,
        &x,
        |_, _, x| x.sum_dim::<0>(),
        |x| ops::sum_dim(x, 0).unwrap(),
    );
    let x4 = small(&[4, 4]);
    grad_check::<layout![Tp: Shard<0>], layout![Tp: Partial<Avg>]>(
        "mean over a sharded dim",
        TP2,
        &x4,
        |_, _, x| x.mean_dim::<0>(),
        |x| ops::sum_dim(x, 0).unwrap().scale(0.25),
    );
    grad_check::<layout![Dp: Shard<0>, Tp: Invariant], layout![Dp: Shard<0>, Tp: Invariant]>(
        "softmax",
        DP2TP2,
        &x,
        |_, _, x| x.softmax::<1>(),
        |x| ops::softmax(x).unwrap(),
    );
    grad_check::<layout![Dp: Shard<0>, Tp: Invariant], layout![Dp: Shard<0>, Tp: Invariant]>(
        "log_softmax",
        DP2TP2,
        &x,
        |_, _, x| x.log_softmax::<1>(),
        |x| ops::log_softmax(x).unwrap(),
    );
    // Sequence parallel norm: rows over Dp and Tp, the weight Replicate on both (its gradient
    // Partial on both).
    let w = small(&[4]).map(|v| v + 1.0);
    let (wr, xr2) = (w.clone(), x.clone());
    grad_check::<layout![Dp: Shard<0>, Tp: Shard<0>], layout![Dp: Shard<0>, Tp: Shard<0>]>(
        "rms_norm x",
        DP2TP2,
        &x,
        |t, m, x| {
            x.rms_norm::<1, _>(
                &t.leaf(dist::<layout![Dp: Replicate, Tp: Replicate]>(&w, m)),
                1e-5,
            )
        },
        |x| ops::rms_norm(x, &wr, 1e-5).unwrap().y,
    );
    grad_check::<layout![Dp: Replicate, Tp: Replicate], layout![Dp: Shard<0>, Tp: Shard<0>]>(
        "rms_norm weight",
        DP2TP2,
        &w,
        |t, m, w| {
            t.constant(dist::<layout![Dp: Shard<0>, Tp: Shard<0>]>(&x, m))
                .rms_norm::<1, _>(&w, 1e-5)
        },
        |w| ops::rms_norm(&xr2, w, 1e-5).unwrap().y,
    );
}

fn ids(n: usize, vocab: usize) -> Tensor {
    Tensor::from_fn(&[n], |i| ((i * 5 + 2) % vocab) as i64)
}

#[test]
fn embedding_and_vocab_parallel_loss_have_the_dual_gradients() {
    let table = small(&[7, 3]);
    let id = ids(6, 7);
    let idr = id.clone();
    // Vocab-parallel table: the lookup is Partial over Tp (reduced by all_reduce).
    grad_check::<layout![Dp: Replicate, Tp: Shard<0>], layout![Dp: Shard<0>, Tp: Invariant]>(
        "embedding table",
        DP2TP2,
        &table,
        |t, m, tab| {
            tab.embedding(&t.constant(dist::<layout![Dp: Shard<0>, Tp: Invariant]>(&id, m)))?
                .all_reduce(Tp)
        },
        |tab| ops::embedding(tab, &idr).unwrap(),
    );
    let logits = small(&[6, 7]);
    let (tg, tgr) = (ids(6, 7), ids(6, 7));
    let ce_ref = move |l: &Tensor| {
        let (t, v) = (l.shape()[0], l.shape()[1]);
        let lv = l.to_f64_vec();
        let ids = tgr.to_f64_vec();
        Tensor::from_fn(&[t], |r| {
            let row = &lv[r * v..(r + 1) * v];
            row.iter().map(|x| x.exp()).sum::<f64>().ln() - row[ids[r] as usize]
        })
    };
    grad_check::<layout![Dp: Shard<0>, Tp: Shard<1>], layout![Dp: Shard<0>, Tp: Invariant]>(
        "vocab-parallel cross-entropy",
        DP2TP2,
        &logits,
        |t, m, l| {
            l.cross_entropy(&t.constant(dist::<layout![Dp: Shard<0>, Tp: Invariant]>(&tg, m)))
        },
        ce_ref,
    );
}

#[test]
fn sequence_parallel_entry_and_exit_have_the_dual_gradients() {
    let x = small(&[4, 6]);
    let w = small(&[6, 6]);
    let wr = w.clone();
    // SP: all_gather the tokens in, reduce_scatter them out around a column → row pair
    // (here one square weight used column- then row-wise is enough to exercise both).
    grad_check::<layout![Tp: Shard<0>], layout![Tp: Shard<0>]>(
        "sp entry/exit",
        TP2,
        &x,
        |t, m, x| {
            let wc = t.leaf(dist::<layout![Tp: Shard<0>]>(&w, m));
            let wrow = t.leaf(dist::<layout![Tp: Shard<1>]>(&w, m));
            let h = x.all_gather(Tp)?.matmul_t(&wc)?;
            h.matmul_t(&wrow)?.reduce_scatter::<_, _, 0>(Tp)
        },
        |x| {
            let h = ops::matmul(x, Transpose::No, &wr, Transpose::Yes).unwrap();
            ops::matmul(&h, Transpose::No, &wr, Transpose::Yes).unwrap()
        },
    );
}

#[test]
fn backward_runs_every_collective_even_without_a_gradient() {
    // Rank-symmetric: the branch that gets no gradient still all-reduces in backward (its
    // to_replicate's adjoint), so every rank issues the same collectives.
    let x = small(&[2, 4]);
    let counts = on_mesh(TP2, |m| {
        let tape = Tape::new();
        let a = tape.leaf(dist::<layout![Tp: Invariant]>(&x, m));
        let _unused = a.to_replicate(Tp)?;
        let used = a.scale(2.0)?.sum_dim::<1>()?.sum_dim::<0>()?;
        let before = m.counters()[0].1.calls(CollectiveKind::AllReduce);
        let mut g = used.backward()?;
        let after = m.counters()[0].1.calls(CollectiveKind::AllReduce);
        let ga: DTensor<layout![Tp: Invariant]> = g.take(&a)?;
        assert_eq!(ga.full_tensor()?.to_f64_vec(), vec![2.0; 8]);
        Ok(after - before)
    });
    assert_eq!(counts, vec![1, 1]);
}

#[test]
fn a_loss_seeds_ones_and_intermediate_gradients_can_be_read() {
    let x = small(&[4, 3]);
    on_mesh(DP2TP2, |m| {
        let tape = Tape::new();
        let xv = tape.leaf(dist::<layout![Dp: Shard<0>, Tp: Invariant]>(&x, m));
        let h = xv.scale(3.0)?;
        h.retain_grad();
        let h2 = h.scale(1.0)?; // not retained: freed during backward
        let loss = h2.sum_dim::<1>()?.sum_dim::<0>()?; // [Dp: Partial, Tp: Invariant]
        let mut g = loss.backward()?;
        let gh: DTensor<layout![Dp: Shard<0>, Tp: Invariant]> = g.take(&h)?;
        assert_eq!(gh.full_tensor()?.to_f64_vec(), vec![1.0; 12]);
        let gx = g.take(&xv)?;
        assert_eq!(gx.full_tensor()?.to_f64_vec(), vec![3.0; 12]);
        let e = g.take(&h2).map(|_| ()).unwrap_err();
        assert!(e.to_string().contains("retain_grad"), "{e}");
        Ok(())
    });
}

type RegionIn = layout![Dp: Shard<0>, Tp: Invariant];
type RegionW = layout![Dp: Replicate, Tp: Shard<0>];
type RegionOut = layout![Dp: Shard<0>, Tp: Shard<1>];

/// The recomputed region of the test below: `2·gelu(x·Wᵀ)`, `W` bound as parameter 7.
fn region<'s>(
    t: &'s Tape,
    x: &Var<'s, RegionIn>,
    w: &DTensor<RegionW>,
) -> Result<Var<'s, RegionOut>, Error> {
    let w = t.param(7, w.clone());
    x.to_replicate(Tp)?.matmul_t(&w)?.gelu()?.scale(2.0)
}

#[test]
fn a_recomputed_region_has_the_same_gradients_and_keeps_only_its_ends() {
    // y = gelu(x·Wᵀ)·2 on [Dp: Shard<0>, Tp: Replicate] × [Dp: Replicate, Tp: Shard<0>],
    // through a recomputed region (W a parameter bound inside it) and without one.
    let x = small(&[4, 3]);
    let w = small(&[6, 3]);
    let run = |recompute: bool| {
        let (x, w) = (x.clone(), w.clone());
        on_mesh(DP2TP2, move |m| {
            let tape = Tape::new();
            let xv = tape.leaf(dist::<layout![Dp: Shard<0>, Tp: Invariant]>(&x, m));
            let wv = dist::<layout![Dp: Replicate, Tp: Shard<0>]>(&w, m);
            let nodes_before = tape.len();
            let y = if recompute {
                xv.checkpoint(move |t, x| region(t, x, &wv))?
            } else {
                region(&tape, &xv, &wv)?
            };
            let recorded = tape.len() - nodes_before;
            let loss = y.sum_dim::<1>()?.all_reduce(Tp)?.sum_dim::<0>()?;
            let mut g = loss.backward()?;
            let gx = g.take(&xv)?.full_tensor()?;
            let like = dist::<layout![Dp: Replicate, Tp: Shard<0>]>(&w, m);
            let gw = g.of_key(7, &like)?.all_reduce(Dp)?.full_tensor()?;
            Ok((gx, gw, recorded))
        })
    };
    let (plain, recomputed) = (run(false), run(true));
    for (a, b) in plain.iter().zip(&recomputed) {
        assert_eq!(a.0, b.0, "input gradient");
        assert_eq!(a.1, b.1, "parameter gradient");
        assert_eq!(b.2, 1, "one node for the whole region");
        assert!(a.2 > 1);
    }
}

#[test]
fn causal_attention_has_the_dual_gradient() {
    let cfg = dtensor_kernels::ops::CausalAttention {
        seq_len: 3,
        head_dim: 2,
        q_per_kv: 1,
        scale: None,
    };
    // 2 samples of 3 tokens, 2 heads of dim 2: samples over Dp, heads over Tp.
    let qkv = small(&[6, 12]);
    grad_check::<layout![Dp: Shard<0>, Tp: Shard<1>], layout![Dp: Shard<0>, Tp: Shard<1>]>(
        "causal_attention",
        DP2TP2,
        &qkv,
        move |_, _, x| x.causal_attention(&cfg),
        move |x| ops::causal_attention(x, &cfg).unwrap().out,
    );
}

#[test]
fn split_and_merge_have_the_dual_gradients() {
    let x = small(&[4, 6]);
    grad_check::<layout![Dp: Shard<0>, Tp: Shard<1>], layout![Dp: Shard<0>, Tp: Shard<1>]>(
        "split then softmax over the trailing dim, merged back",
        DP2TP2,
        &x,
        |_, _, x| x.split_dim::<1>(3)?.softmax::<2>()?.merge_dims::<1>(),
        |x| {
            let s = ops::softmax(&x.clone().reshape(&[4, 2, 3]).unwrap()).unwrap();
            s.reshape(&[4, 6]).unwrap()
        },
    );
}

// ---------------------------------------------------------------------------------------
// Every `Var` op, every combination of its per-axis rule table (placement/src/rules.rs),
// each input's gradient: on one rank and two (1-D layouts over `Tp`, uneven extents where
// the rule allows them), and representative mixed combinations on the 2×2 mesh.
// ---------------------------------------------------------------------------------------

type Axes = &'static [(AxisKind, usize)];
const ONE: Axes = &[(AxisKind::Tp, 1)];
/// 1-D layouts: one rank and two.
const MESH1: [Axes; 2] = [ONE, TP2];
const MESH2: [Axes; 1] = [DP2TP2];

type R = Replicate;
type I = Invariant;
type P = Partial;
type PAvg = Partial<Avg>;
type S0 = Shard<0>;
type S1 = Shard<1>;
type S2 = Shard<2>;
type S3 = Shard<3>;

/// One combination a line: `[layout of x]`, on every mesh of `$meshes`.
macro_rules! check1 {
    ($meshes:expr, $what:expr, $x:expr, $f:expr, $r:expr; $([$($l:tt)*]),+ $(,)?) => {$(
        for axes in $meshes {
            let what = format!("{} [{}] on {:?}", $what, stringify!($($l)*), axes);
            grad_check::<layout![$($l)*], _>(&what, axes, $x, $f, $r);
        }
    )+};
}

/// One combination a line: `[layout of a] [layout of b]`; both gradients checked
/// (`check2`), or only `a`'s (`check_with`: `b` is ids or targets).
macro_rules! check2 {
    ($check:ident, $meshes:expr, $what:expr, ($a:expr, $b:expr), $f:expr, $r:expr;
     $([$($la:tt)*] [$($lb:tt)*]),+ $(,)?) => {$(
        for axes in $meshes {
            let what = format!(
                "{} [{}] [{}] on {:?}",
                $what,
                stringify!($($la)*),
                stringify!($($lb)*),
                axes
            );
            $check::<layout![$($la)*], layout![$($lb)*], _>(&what, axes, $a, $b, $f, $r);
        }
    )+};
    ($meshes:expr, $($rest:tt)*) => { check2!(grad_check2, $meshes, $($rest)*) };
}

macro_rules! check_with {
    ($($rest:tt)*) => { check2!(grad_check_with, $($rest)*) };
}

/// One combination a line: `[layout of x] [layout of weight and bias]`.
macro_rules! check3 {
    ($meshes:expr, $what:expr, $inputs:expr, $f:expr, $r:expr;
     $([$($lx:tt)*] [$($lw:tt)*]),+ $(,)?) => {$(
        for axes in $meshes {
            let what = format!(
                "{} [{}] [{}] on {:?}",
                $what,
                stringify!($($lx)*),
                stringify!($($lw)*),
                axes
            );
            grad_check3::<layout![$($lx)*], layout![$($lw)*], _>(&what, axes, $inputs, $f, $r);
        }
    )+};
}

fn mm(a: &Tensor, b: &Tensor) -> Tensor {
    ops::matmul(a, Transpose::No, b, Transpose::No).unwrap()
}

fn mm_t(a: &Tensor, w: &Tensor) -> Tensor {
    ops::matmul(a, Transpose::No, w, Transpose::Yes).unwrap()
}

fn transpose(x: &Tensor) -> Tensor {
    let (r, c) = (x.shape()[0], x.shape()[1]);
    let v = x.to_f64_vec();
    Tensor::from_fn(&[c, r], |i| v[(i % r) * c + i / r])
}

fn reshaped(x: &Tensor, shape: &[usize]) -> Tensor {
    x.clone().reshape(shape).unwrap()
}

fn mean_ref(x: &Tensor, d: usize) -> Tensor {
    ops::sum_dim(x, d).unwrap().scale(1.0 / x.shape()[d] as f64)
}

/// Per-token `logsumexp(row) − row[target]`, from the global tensors.
fn ce_ref(l: &Tensor, targets: &Tensor) -> Tensor {
    let (t, v) = (l.shape()[0], l.shape()[1]);
    let lv = l.to_f64_vec();
    let ids = targets.to_f64_vec();
    Tensor::from_fn(&[t], |r| {
        let row = &lv[r * v..(r + 1) * v];
        row.iter().map(|x| x.exp()).sum::<f64>().ln() - row[ids[r] as usize]
    })
}

/// A user op through `Var::custom`: elementwise `x²`, backward `2x·dy`, laid out as `x`.
fn square<'t, L: Layout>(x: Var<'t, L>) -> Result<Var<'t, L>> {
    let shape = x.value().global_shape().to_vec();
    x.custom::<L>(
        "square",
        &shape,
        |x| Ok(x.mul(x)?),
        |dy, x| Ok(dy.mul(&x.scale(2.0))?),
    )
}

/// 4-D, so every `Shard<0..3>` of the elementwise rules has a dim (3 and 3 split unevenly).
fn four_d() -> (Tensor, Tensor) {
    let x = small(&[3, 2, 2, 3]);
    (x.clone(), x.map(|v| 0.3 - v / 2.0))
}

#[test]
fn every_matmul_rule_has_both_gradients() {
    // Uneven everywhere on two ranks: m = 5, k = 3, n = 5.
    let (a, b) = (small(&[5, 3]), small(&[3, 5]).map(|v| v + 0.25));
    check2!(MESH1, "matmul", (&a, &b), |_, a, b| a.matmul(&b), mm;
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
        [Tp: S0] [Tp: R],
        [Tp: R] [Tp: S1],
        [Tp: S1] [Tp: S0],
        [Tp: P] [Tp: R],
        [Tp: R] [Tp: P],
    );
    check2!(MESH2, "matmul", (&a, &b), |_, a, b| a.matmul(&b), mm;
        [Dp: S0, Tp: S1] [Dp: R, Tp: S0],
        [Dp: P, Tp: R] [Dp: R, Tp: S1],
        [Dp: I, Tp: R] [Dp: I, Tp: P],
    );
    let w = small(&[5, 3]).map(|v| v - 0.25);
    check2!(MESH1, "matmul_t", (&a, &w), |_, a, w| a.matmul_t(&w), mm_t;
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
        [Tp: S0] [Tp: R],
        [Tp: R] [Tp: S0],
        [Tp: S1] [Tp: S1],
        [Tp: P] [Tp: R],
        [Tp: R] [Tp: P],
    );
    check2!(MESH2, "matmul_t", (&a, &w), |_, a, w| a.matmul_t(&w), mm_t;
        [Dp: S0, Tp: R] [Dp: R, Tp: S0],
        [Dp: R, Tp: S1] [Dp: P, Tp: S1],
        [Dp: I, Tp: P] [Dp: I, Tp: R],
    );
}

#[test]
fn every_add_sub_and_mul_rule_has_both_gradients() {
    let (x, y) = four_d();
    let add = |a: &Tensor, b: &Tensor| a.add(b).unwrap();
    let sub = |a: &Tensor, b: &Tensor| ops::sub(a, b).unwrap();
    check2!(MESH1, "add", (&x, &y), |_, a, b| a.add(&b), add;
        [Tp: S0] [Tp: S0],
        [Tp: S1] [Tp: S1],
        [Tp: S2] [Tp: S2],
        [Tp: S3] [Tp: S3],
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
        [Tp: P] [Tp: P],
        [Tp: PAvg] [Tp: PAvg],
    );
    check2!(MESH2, "add", (&x, &y), |_, a, b| a.add(&b), add;
        [Dp: S0, Tp: P] [Dp: S0, Tp: P],
        [Dp: PAvg, Tp: S3] [Dp: PAvg, Tp: S3],
        [Dp: I, Tp: S1] [Dp: I, Tp: S1],
    );
    check2!(MESH1, "sub", (&x, &y), |_, a, b| a.sub(&b), sub;
        [Tp: S0] [Tp: S0],
        [Tp: S1] [Tp: S1],
        [Tp: S2] [Tp: S2],
        [Tp: S3] [Tp: S3],
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
        [Tp: P] [Tp: P],
        [Tp: PAvg] [Tp: PAvg],
    );
    check2!(MESH2, "sub", (&x, &y), |_, a, b| a.sub(&b), sub;
        [Dp: P, Tp: S2] [Dp: P, Tp: S2],
        [Dp: R, Tp: PAvg] [Dp: R, Tp: PAvg],
    );
    let mul = |a: &Tensor, b: &Tensor| a.mul(b).unwrap();
    check2!(MESH1, "mul", (&x, &y), |_, a, b| a.mul(&b), mul;
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
        [Tp: S0] [Tp: S0],
        [Tp: S1] [Tp: S1],
        [Tp: S2] [Tp: S2],
        [Tp: S3] [Tp: S3],
        [Tp: P] [Tp: R],
        [Tp: R] [Tp: P],
    );
    check2!(MESH2, "mul", (&x, &y), |_, a, b| a.mul(&b), mul;
        [Dp: P, Tp: S2] [Dp: R, Tp: S2],
        [Dp: S0, Tp: R] [Dp: S0, Tp: P],
        [Dp: I, Tp: S3] [Dp: I, Tp: S3],
    );
}

#[test]
fn every_unary_pointwise_layout_has_its_gradient() {
    let (x, _) = four_d();
    check1!(MESH1, "scale", &x, |_, _, x| x.scale(-1.5), |x| x.scale(-1.5);
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: S3], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH2, "scale", &x, |_, _, x| x.scale(-1.5), |x| x.scale(-1.5);
        [Dp: P, Tp: S1], [Dp: PAvg, Tp: I],
    );
    let gelu = |x: &Tensor| ops::gelu(x).unwrap();
    check1!(MESH1, "gelu", &x, |_, _, x| x.gelu(), gelu;
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: S3], [Tp: R], [Tp: I],
    );
    check1!(MESH2, "gelu", &x, |_, _, x| x.gelu(), gelu;
        [Dp: S0, Tp: S3], [Dp: I, Tp: R],
    );
    let silu = |x: &Tensor| ops::silu(x).unwrap();
    check1!(MESH1, "silu", &x, |_, _, x| x.silu(), silu;
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: S3], [Tp: R], [Tp: I],
    );
    check1!(MESH2, "silu", &x, |_, _, x| x.silu(), silu;
        [Dp: S2, Tp: S1], [Dp: R, Tp: I],
    );
    let sq = |x: &Tensor| x.mul(x).unwrap();
    check1!(MESH1, "custom square", &x, |_, _, x| square(x), sq;
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: S3], [Tp: R], [Tp: I],
    );
    check1!(MESH2, "custom square", &x, |_, _, x| square(x), sq;
        [Dp: S0, Tp: S2], [Dp: R, Tp: I],
    );
}

#[test]
fn every_swiglu_layout_has_both_gradients() {
    let (g, u) = four_d();
    let swiglu = |g: &Tensor, u: &Tensor| ops::swiglu(g, u).unwrap();
    check2!(MESH1, "swiglu", (&g, &u), |_, g, u| g.swiglu(&u), swiglu;
        [Tp: S0] [Tp: S0],
        [Tp: S1] [Tp: S1],
        [Tp: S2] [Tp: S2],
        [Tp: S3] [Tp: S3],
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
    );
    check2!(MESH2, "swiglu", (&g, &u), |_, g, u| g.swiglu(&u), swiglu;
        [Dp: S1, Tp: S3] [Dp: S1, Tp: S3],
        [Dp: I, Tp: R] [Dp: I, Tp: R],
    );
}

#[test]
fn every_add_row_rule_has_both_gradients() {
    let (x, b) = (small(&[5, 3]), small(&[3]).map(|v| v + 0.5));
    let add_row = |x: &Tensor, b: &Tensor| ops::add_row(x, b).unwrap();
    check2!(MESH1, "add_row", (&x, &b), |_, x, b| x.add_row(&b), add_row;
        [Tp: S0] [Tp: R],
        [Tp: S1] [Tp: S0],
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
        [Tp: P] [Tp: P],
    );
    check2!(MESH2, "add_row", (&x, &b), |_, x, b| x.add_row(&b), add_row;
        [Dp: S0, Tp: S1] [Dp: R, Tp: S0],
        [Dp: P, Tp: S0] [Dp: P, Tp: R],
    );
}

#[test]
fn every_sum_and_mean_rule_has_its_gradient() {
    // Sums: uneven (3 and 5 over two ranks); means: even shards only.
    let x = small(&[3, 2, 5]);
    let sum = |d: usize| move |x: &Tensor| ops::sum_dim(x, d).unwrap();
    check1!(MESH1, "sum_dim 0", &x, |_, _, x| x.sum_dim::<0>(), sum(0);
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH1, "sum_dim 1", &x, |_, _, x| x.sum_dim::<1>(), sum(1);
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH1, "sum_dim 2", &x, |_, _, x| x.sum_dim::<2>(), sum(2);
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH2, "sum_dim 0", &x, |_, _, x| x.sum_dim::<0>(), sum(0);
        [Dp: S0, Tp: S1],
    );
    check1!(MESH2, "sum_dim 2", &x, |_, _, x| x.sum_dim::<2>(), sum(2);
        [Dp: P, Tp: S2], [Dp: S2, Tp: PAvg],
    );
    let x = small(&[2, 2, 4]);
    let mean = |d: usize| move |x: &Tensor| mean_ref(x, d);
    check1!(MESH1, "mean_dim 0", &x, |_, _, x| x.mean_dim::<0>(), mean(0);
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH1, "mean_dim 1", &x, |_, _, x| x.mean_dim::<1>(), mean(1);
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH1, "mean_dim 2", &x, |_, _, x| x.mean_dim::<2>(), mean(2);
        [Tp: S0], [Tp: S1], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH2, "mean_dim 0", &x, |_, _, x| x.mean_dim::<0>(), mean(0);
        [Dp: S0, Tp: S2],
    );
    check1!(MESH2, "mean_dim 2", &x, |_, _, x| x.mean_dim::<2>(), mean(2);
        [Dp: S0, Tp: S2], [Dp: S1, Tp: P],
    );
}

#[test]
fn every_softmax_layout_has_its_gradient() {
    let (x3, x2) = (small(&[3, 2, 4]), small(&[5, 4]));
    let softmax = |x: &Tensor| ops::softmax(x).unwrap();
    let log_softmax = |x: &Tensor| ops::log_softmax(x).unwrap();
    check1!(MESH1, "softmax 3-D", &x3, |_, _, x| x.softmax::<2>(), softmax;
        [Tp: R], [Tp: I], [Tp: S0], [Tp: S1],
    );
    check1!(MESH1, "softmax 2-D", &x2, |_, _, x| x.softmax::<1>(), softmax;
        [Tp: R], [Tp: I], [Tp: S0],
    );
    check1!(MESH2, "softmax", &x3, |_, _, x| x.softmax::<2>(), softmax;
        [Dp: S0, Tp: S1], [Dp: R, Tp: I],
    );
    check1!(MESH1, "log_softmax 3-D", &x3, |_, _, x| x.log_softmax::<2>(), log_softmax;
        [Tp: R], [Tp: I], [Tp: S0], [Tp: S1],
    );
    check1!(MESH1, "log_softmax 2-D", &x2, |_, _, x| x.log_softmax::<1>(), log_softmax;
        [Tp: R], [Tp: I], [Tp: S0],
    );
    check1!(MESH2, "log_softmax", &x3, |_, _, x| x.log_softmax::<2>(), log_softmax;
        [Dp: S1, Tp: S0], [Dp: I, Tp: R],
    );
}

#[test]
fn every_norm_rule_has_the_gradients_of_input_weight_and_bias() {
    let (x3, x2) = (small(&[3, 2, 4]), small(&[5, 4]));
    let (w, b) = (small(&[4]).map(|v| v + 1.0), small(&[4]).map(|v| 0.2 - v));
    let rms = |x: &Tensor, w: &Tensor| ops::rms_norm(x, w, 1e-5).unwrap().y;
    check2!(MESH1, "rms_norm 3-D", (&x3, &w), |_, x, w| x.rms_norm::<2, _>(&w, 1e-5), rms;
        [Tp: S0] [Tp: R],
        [Tp: S1] [Tp: R],
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
    );
    check2!(MESH1, "rms_norm 2-D", (&x2, &w), |_, x, w| x.rms_norm::<1, _>(&w, 1e-5), rms;
        [Tp: S0] [Tp: R],
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
    );
    check2!(MESH2, "rms_norm", (&x3, &w), |_, x, w| x.rms_norm::<2, _>(&w, 1e-5), rms;
        [Dp: S0, Tp: S1] [Dp: R, Tp: R],
        [Dp: I, Tp: S0] [Dp: I, Tp: R],
    );
    let ln = |x: &Tensor, w: &Tensor, b: &Tensor| ops::layer_norm(x, w, b, 1e-5).unwrap().y;
    check3!(MESH1, "layer_norm 3-D", (&x3, &w, &b), |x, w, b| x.layer_norm::<2, _>(&w, &b, 1e-5), ln;
        [Tp: S0] [Tp: R],
        [Tp: S1] [Tp: R],
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
    );
    check3!(MESH1, "layer_norm 2-D", (&x2, &w, &b), |x, w, b| x.layer_norm::<1, _>(&w, &b, 1e-5), ln;
        [Tp: S0] [Tp: R],
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
    );
    check3!(MESH2, "layer_norm", (&x3, &w, &b), |x, w, b| x.layer_norm::<2, _>(&w, &b, 1e-5), ln;
        [Dp: S1, Tp: S0] [Dp: R, Tp: R],
        [Dp: R, Tp: I] [Dp: R, Tp: I],
    );
}

#[test]
fn every_embedding_and_cross_entropy_rule_has_its_gradient() {
    // Vocab 7 over two ranks (uneven), 5 tokens.
    let (table, id) = (small(&[7, 3]), ids(5, 7));
    let emb = |t: &Tensor, i: &Tensor| ops::embedding(t, i).unwrap();
    check_with!(MESH1, "embedding table", (&table, &id), |_, t, i| t.embedding(&i), emb;
        [Tp: S0] [Tp: R],
        [Tp: S0] [Tp: I],
        [Tp: S1] [Tp: R],
        [Tp: S1] [Tp: I],
        [Tp: R] [Tp: S0],
        [Tp: R] [Tp: R],
        [Tp: R] [Tp: I],
        [Tp: I] [Tp: I],
    );
    check_with!(MESH2, "embedding table", (&table, &id), |_, t, i| t.embedding(&i), emb;
        [Dp: R, Tp: S0] [Dp: S0, Tp: I],
        [Dp: I, Tp: S1] [Dp: I, Tp: R],
    );
    let logits = small(&[5, 7]);
    check_with!(MESH1, "cross_entropy logits", (&logits, &id), |_, l, t| l.cross_entropy(&t), ce_ref;
        [Tp: S1] [Tp: R],
        [Tp: S1] [Tp: I],
        [Tp: S0] [Tp: S0],
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
    );
    check_with!(MESH2, "cross_entropy logits", (&logits, &id), |_, l, t| l.cross_entropy(&t), ce_ref;
        [Dp: S0, Tp: S1] [Dp: S0, Tp: I],
        [Dp: S1, Tp: S0] [Dp: R, Tp: S0],
    );
}

#[test]
fn every_view_rule_has_its_gradient() {
    let x = small(&[5, 3]);
    check1!(MESH1, "t", &x, |_, _, x| x.t(), transpose;
        [Tp: S0], [Tp: S1], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH2, "t", &x, |_, _, x| x.t(), transpose;
        [Dp: S0, Tp: S1], [Dp: P, Tp: I],
    );
    // Split / merge: a sharded reshaped dim needs even shards (4 = 2·2 over two ranks).
    let x = small(&[4, 6]);
    check1!(MESH1, "split_dim 0", &x, |_, _, x| x.split_dim::<0>(2), |x| reshaped(x, &[2, 2, 6]);
        [Tp: S0], [Tp: S1], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH1, "split_dim 1", &x, |_, _, x| x.split_dim::<1>(3), |x| reshaped(x, &[4, 2, 3]);
        [Tp: S0], [Tp: S1], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH2, "split_dim 0", &x, |_, _, x| x.split_dim::<0>(2), |x| reshaped(x, &[2, 2, 6]);
        [Dp: P, Tp: S0], [Dp: S1, Tp: I],
    );
    let x3 = small(&[4, 2, 3]);
    check1!(MESH1, "split_dim 0 (3-D)", &x3, |_, _, x| x.split_dim::<0>(2), |x| reshaped(x, &[2, 2, 2, 3]);
        [Tp: S2],
    );
    check1!(MESH1, "split_dim 1 (3-D)", &x3, |_, _, x| x.split_dim::<1>(2), |x| reshaped(x, &[4, 1, 2, 3]);
        [Tp: S2],
    );
    check1!(MESH1, "merge_dims 0", &x3, |_, _, x| x.merge_dims::<0>(), |x| reshaped(x, &[8, 3]);
        [Tp: S0], [Tp: S2], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH1, "merge_dims 1", &x3, |_, _, x| x.merge_dims::<1>(), |x| reshaped(x, &[4, 6]);
        [Tp: S0], [Tp: S1], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
    );
    check1!(MESH2, "merge_dims 0", &x3, |_, _, x| x.merge_dims::<0>(), |x| reshaped(x, &[8, 3]);
        [Dp: S0, Tp: S2], [Dp: I, Tp: S0],
    );
    check1!(MESH2, "merge_dims 1", &x3, |_, _, x| x.merge_dims::<1>(), |x| reshaped(x, &[4, 6]);
        [Dp: P, Tp: S1],
    );
    let x4 = small(&[2, 2, 2, 3]);
    check1!(MESH1, "merge_dims 0 (4-D)", &x4, |_, _, x| x.merge_dims::<0>(), |x| reshaped(x, &[4, 2, 3]);
        [Tp: S3],
    );
    check1!(MESH1, "merge_dims 1 (4-D)", &x4, |_, _, x| x.merge_dims::<1>(), |x| reshaped(x, &[2, 4, 3]);
        [Tp: S3],
    );
    check1!(MESH1, "merge_dims 2 (4-D)", &x4, |_, _, x| x.merge_dims::<2>(), |x| reshaped(x, &[2, 2, 6]);
        [Tp: S0], [Tp: S1], [Tp: S2],
    );
}

#[test]
fn every_attention_layout_has_its_gradient() {
    let cfg = dtensor_kernels::ops::CausalAttention {
        seq_len: 3,
        head_dim: 2,
        q_per_kv: 1,
        scale: None,
    };
    // 2 samples of 3 tokens, 2 heads of dim 2: one sample or one head per rank.
    let qkv = small(&[6, 12]);
    let attn = |x: &Tensor| ops::causal_attention(x, &cfg).unwrap().out;
    check1!(MESH1, "causal_attention", &qkv, |_, _, x| x.causal_attention(&cfg), attn;
        [Tp: S0], [Tp: S1], [Tp: R], [Tp: I],
    );
    check1!(MESH2, "causal_attention", &qkv, |_, _, x| x.causal_attention(&cfg), attn;
        [Dp: R, Tp: S0], [Dp: S1, Tp: I],
    );
}

const DP2: Axes = &[(AxisKind::Dp, 2)];

/// RoPE configurations a gradient check covers: interleaved pairs over the whole head;
/// half-split pairs over part of it (the tail passes through) with YaRN frequencies (the
/// attention factor scales cos and sin).
fn rope_configs() -> [ops::Rope; 2] {
    use ops::{Rope, RopeScaling, RopeStyle};
    [
        Rope::new(4, 50.0, RopeStyle::Interleaved),
        Rope {
            rotary_dim: 2,
            scaling: RopeScaling::yarn(4.0, 2),
            ..Rope::new(4, 50.0, RopeStyle::HalfSplit)
        },
    ]
}

#[test]
fn every_rope_rule_has_its_gradient() {
    use dtensor_core::RopePositions;
    // 8 tokens (one sample, positions from 3), 2 heads of dim 4: on a mesh a rank holds
    // some tokens or one head, and the rows' positions come from their global index.
    let x = small(&[8, 8]);
    let positions = RopePositions::Sequential {
        seq_len: 8,
        offset: 3,
    };
    let global: Vec<usize> = (3..11).collect();
    for cfg in rope_configs() {
        let r = |x: &Tensor| ops::rope(x, &global, &cfg).unwrap();
        check1!(MESH1, "rope", &x, |_, _, x| x.rope(&cfg, &positions), r;
            [Tp: S0], [Tp: S1], [Tp: R], [Tp: I], [Tp: P], [Tp: PAvg],
        );
        check1!([DP2], "rope", &x, |_, _, x| x.rope(&cfg, &positions), r; [Dp: S0], [Dp: S1], [Dp: R], [Dp: P]);
        check1!(MESH2, "rope", &x, |_, _, x| x.rope(&cfg, &positions), r;
            [Dp: S0, Tp: S1], [Dp: S0, Tp: S0], [Dp: S1, Tp: S0], [Dp: R, Tp: S1],
            [Dp: P, Tp: S1], [Dp: S0, Tp: P], [Dp: I, Tp: PAvg], [Dp: S0, Tp: R],
        );
    }
    // Packed documents: positions restart, given per global row.
    let docs = RopePositions::documents(&[3, 1, 4]);
    let ids = [0, 1, 2, 0, 0, 1, 2, 3];
    let cfg = rope_configs()[1];
    let r = |x: &Tensor| ops::rope(x, &ids, &cfg).unwrap();
    check1!(MESH2, "rope (documents)", &x, |_, _, x| x.rope(&cfg, &docs), r;
        [Dp: S0, Tp: S1], [Dp: S0, Tp: S0],
    );
}

/// The check above fails on a wrong backward: RoPE recorded with its forward rotation as
/// the "gradient" (the sign of the sines flipped) is caught on one rank and on a mesh.
#[test]
fn rope_gradient_check_catches_a_wrong_backward() {
    let x = small(&[8, 8]);
    let global: Vec<usize> = (0..8).map(|g| 1 + g % 4).collect();
    for cfg in rope_configs() {
        let r = |x: &Tensor| ops::rope(x, &global, &cfg).unwrap();
        // Right: the transposed rotation passes; wrong: the forward rotation again.
        let one: Axes = &[(AxisKind::Dp, 1), (AxisKind::Tp, 1)];
        for (wrong, axes) in [(false, one), (false, DP2TP2), (true, one), (true, DP2TP2)] {
            let check = || {
                grad_check::<layout![Dp: Shard<0>, Tp: Shard<1>], _>(
                    "rope with a perturbed backward",
                    axes,
                    &x,
                    |_, _, x: Var<'_, layout![Dp: Shard<0>, Tp: Shard<1>]>| {
                        let shape = x.value().global_shape().to_vec();
                        let rows = dtensor_placement::local_ranges(
                            x.value().device_mesh().mesh(),
                            x.value().placements(),
                            x.value().device_mesh().coords(),
                            &shape,
                        )?[0]
                            .clone();
                        let pos: Vec<usize> = global[rows].to_vec();
                        let back = pos.clone();
                        x.custom::<layout![Dp: Shard<0>, Tp: Shard<1>]>(
                            "rope (test)",
                            &shape,
                            |x| Ok(ops::rope(x, &pos, &cfg)?),
                            move |dy, _| {
                                Ok(if wrong {
                                    ops::rope(dy, &back, &cfg)?
                                } else {
                                    ops::rope_backward(dy, &back, &cfg)?
                                })
                            },
                        )
                    },
                    r,
                )
            };
            let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(check)).is_err();
            assert_eq!(
                failed, wrong,
                "{cfg:?} on {axes:?}: wrong backward = {wrong}"
            );
        }
    }
}

#[test]
fn every_named_transition_has_its_adjoint() {
    // From `Partial<Sum>` only: reduce_scatter / all_reduce of an avg (max, min) partial
    // compile (`IsPartial`) but have no linear adjoint, by design (`NotDifferentiable`).
    let x = small(&[5, 3]);
    let id = |x: &Tensor| x.clone();
    check1!(MESH1, "all_gather", &x, |_, _, x| x.all_gather(Tp), id; [Tp: S0], [Tp: S1]);
    check1!(MESH2, "all_gather Tp", &x, |_, _, x| x.all_gather(Tp), id; [Dp: S0, Tp: S1]);
    check1!(MESH2, "all_gather Dp", &x, |_, _, x| x.all_gather(Dp), id; [Dp: S1, Tp: P]);
    check1!(MESH1, "all_gather_invariant", &x, |_, _, x| x.all_gather_invariant(Tp), id;
        [Tp: S0], [Tp: S1],
    );
    check1!(MESH2, "all_gather_invariant Tp", &x, |_, _, x| x.all_gather_invariant(Tp), id;
        [Dp: P, Tp: S0],
    );
    check1!(MESH2, "all_gather_invariant Dp", &x, |_, _, x| x.all_gather_invariant(Dp), id;
        [Dp: S0, Tp: I],
    );
    check1!(MESH1, "reduce_scatter 0", &x, |_, _, x| x.reduce_scatter::<_, _, 0>(Tp), id;
        [Tp: P],
    );
    check1!(MESH1, "reduce_scatter 1", &x, |_, _, x| x.reduce_scatter::<_, _, 1>(Tp), id;
        [Tp: P],
    );
    check1!(MESH2, "reduce_scatter 0 Tp", &x, |_, _, x| x.reduce_scatter::<_, _, 0>(Tp), id;
        [Dp: S1, Tp: P],
    );
    check1!(MESH2, "reduce_scatter 1 Dp", &x, |_, _, x| x.reduce_scatter::<_, _, 1>(Dp), id;
        [Dp: P, Tp: S0],
    );
    check1!(MESH1, "all_reduce", &x, |_, _, x| x.all_reduce(Tp), id; [Tp: P]);
    check1!(MESH2, "all_reduce Tp", &x, |_, _, x| x.all_reduce(Tp), id; [Dp: S0, Tp: P]);
    check1!(MESH2, "all_reduce Dp", &x, |_, _, x| x.all_reduce(Dp), id; [Dp: P, Tp: S1]);
    check1!(MESH1, "all_to_all 0→1", &x, |_, _, x| x.all_to_all::<_, _, 1>(Tp), id; [Tp: S0]);
    check1!(MESH1, "all_to_all 1→0", &x, |_, _, x| x.all_to_all::<_, _, 0>(Tp), id; [Tp: S1]);
    check1!(MESH2, "all_to_all 0→1 Tp", &x, |_, _, x| x.all_to_all::<_, _, 1>(Tp), id;
        [Dp: R, Tp: S0],
    );
    check1!(MESH2, "all_to_all 1→0 Dp", &x, |_, _, x| x.all_to_all::<_, _, 0>(Dp), id;
        [Dp: S1, Tp: I],
    );
    check1!(MESH1, "chunk 0", &x, |_, _, x| x.chunk::<_, _, 0>(Tp), id; [Tp: R], [Tp: I]);
    check1!(MESH1, "chunk 1", &x, |_, _, x| x.chunk::<_, _, 1>(Tp), id; [Tp: R], [Tp: I]);
    check1!(MESH2, "chunk 0 Tp", &x, |_, _, x| x.chunk::<_, _, 0>(Tp), id; [Dp: S1, Tp: R]);
    check1!(MESH2, "chunk 1 Dp", &x, |_, _, x| x.chunk::<_, _, 1>(Dp), id; [Dp: I, Tp: S0]);
    check1!(MESH1, "to_replicate", &x, |_, _, x| x.to_replicate(Tp), id; [Tp: I]);
    check1!(MESH2, "to_replicate Tp", &x, |_, _, x| x.to_replicate(Tp), id; [Dp: S0, Tp: I]);
    check1!(MESH2, "to_replicate Dp", &x, |_, _, x| x.to_replicate(Dp), id; [Dp: I, Tp: P]);
    check1!(MESH1, "to_invariant", &x, |_, _, x| x.to_invariant(Tp), id; [Tp: R]);
    check1!(MESH2, "to_invariant Tp", &x, |_, _, x| x.to_invariant(Tp), id; [Dp: P, Tp: R]);
    check1!(MESH2, "to_invariant Dp", &x, |_, _, x| x.to_invariant(Dp), id; [Dp: R, Tp: S1]);
    check1!(MESH1, "replicate_to_partial", &x, |_, _, x| x.replicate_to_partial(Tp), id;
        [Tp: R],
    );
    check1!(MESH2, "replicate_to_partial Tp", &x, |_, _, x| x.replicate_to_partial(Tp), id;
        [Dp: S0, Tp: R],
    );
    check1!(MESH2, "replicate_to_partial Dp", &x, |_, _, x| x.replicate_to_partial(Dp), id;
        [Dp: R, Tp: I],
    );
    check1!(MESH1, "invariant_to_partial", &x, |_, _, x| x.invariant_to_partial(Tp), id;
        [Tp: I],
    );
    check1!(MESH2, "invariant_to_partial Tp", &x, |_, _, x| x.invariant_to_partial(Tp), id;
        [Dp: S1, Tp: I],
    );
    check1!(MESH2, "invariant_to_partial Dp", &x, |_, _, x| x.invariant_to_partial(Dp), id;
        [Dp: I, Tp: S0],
    );
    check1!(MESH1, "pad_to_partial", &x, |_, _, x| x.pad_to_partial(Tp), id;
        [Tp: S0], [Tp: S1],
    );
    check1!(MESH2, "pad_to_partial Tp", &x, |_, _, x| x.pad_to_partial(Tp), id;
        [Dp: R, Tp: S1],
    );
    check1!(MESH2, "pad_to_partial Dp", &x, |_, _, x| x.pad_to_partial(Dp), id;
        [Dp: S0, Tp: P],
    );
}

#[test]
fn bmm_every_rule_has_the_dual_gradients() {
    let (a, b) = (small(&[3, 4, 5]), small(&[3, 5, 2]));
    let bmm = |x: &Tensor, y: &Tensor| ops::matmul(x, Transpose::No, y, Transpose::No).unwrap();
    macro_rules! both {
        ($mesh:expr, [$($la:tt)*], [$($lb:tt)*], [$($lo:tt)*]) => {{
            let (a2, b2, br, ar) = (a.clone(), b.clone(), b.clone(), a.clone());
            grad_check::<layout![$($la)*], layout![$($lo)*]>(
                concat!("bmm dA ", stringify!($($la)*), " · ", stringify!($($lb)*)), $mesh, &a,
                move |t, m, x| x.bmm(&t.leaf(dist::<layout![$($lb)*]>(&b2, m))),
                move |x| bmm(x, &br),
            );
            grad_check::<layout![$($lb)*], layout![$($lo)*]>(
                concat!("bmm dB ", stringify!($($la)*), " · ", stringify!($($lb)*)), $mesh, &b,
                move |t, m, y| t.leaf(dist::<layout![$($la)*]>(&a2, m)).bmm(&y),
                move |y| bmm(&ar, y),
            );
        }};
    }
    for mesh in [&[(AxisKind::Tp, 1)][..], TP2] {
        both!(mesh, [Tp: Shard<0>], [Tp: Shard<0>], [Tp: Shard<0>]);
        both!(mesh, [Tp: Replicate], [Tp: Replicate], [Tp: Replicate]);
        both!(mesh, [Tp: Invariant], [Tp: Invariant], [Tp: Invariant]);
        both!(mesh, [Tp: Shard<1>], [Tp: Replicate], [Tp: Shard<1>]);
        both!(mesh, [Tp: Replicate], [Tp: Shard<2>], [Tp: Shard<2>]);
        both!(mesh, [Tp: Shard<2>], [Tp: Shard<1>], [Tp: Partial]);
        both!(mesh, [Tp: Partial], [Tp: Replicate], [Tp: Partial]);
        both!(mesh, [Tp: Replicate], [Tp: Partial], [Tp: Partial]);
    }
    both!(DP2TP2, [Dp: Shard<0>, Tp: Shard<2>], [Dp: Shard<0>, Tp: Shard<1>], [Dp: Shard<0>, Tp: Partial]);
    both!(DP2TP2, [Dp: Replicate, Tp: Shard<1>], [Dp: Replicate, Tp: Replicate], [Dp: Replicate, Tp: Shard<1>]);
}

#[test]
fn div_and_max_have_the_dual_gradients() {
    let (x, y) = four_d();
    // Divisors kept away from 0.
    let y = y.map(|v| 1.5 + v.abs());
    let div = |a: &Tensor, b: &Tensor| {
        let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
        Tensor::from_vec(
            a.iter().zip(&b).map(|(a, b)| a / b).collect(),
            &[3, 2, 2, 3],
        )
        .unwrap()
    };
    check2!(MESH1, "div", (&x, &y), |_, a, b| a.div(&b), div;
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
        [Tp: S0] [Tp: S0],
        [Tp: S1] [Tp: S1],
        [Tp: S2] [Tp: S2],
        [Tp: S3] [Tp: S3],
        [Tp: P] [Tp: R],
    );
    check2!(MESH2, "div", (&x, &y), |_, a, b| a.div(&b), div;
        [Dp: P, Tp: S2] [Dp: R, Tp: S2],
        [Dp: S0, Tp: I] [Dp: S0, Tp: I],
    );
    // The max over a dim every rank holds whole (distinct values: no ties).
    let m = Tensor::from_fn(&[5, 4, 3], |i| ((i * 37) % 61) as f64 / 7.0);
    check1!(MESH1, "max_dim<1>", &m, |_, _, x| x.max_dim::<1>(), |x| ops::max_dim(x, 1).unwrap().values;
        [Tp: R], [Tp: I], [Tp: S0], [Tp: S2],
    );
    check1!(MESH2, "max_dim<2>", &m, |_, _, x| x.max_dim::<2>(), |x| ops::max_dim(x, 2).unwrap().values;
        [Dp: S0, Tp: S1], [Dp: R, Tp: S0],
    );
}

#[test]
fn mul_row_every_rule_has_both_gradients() {
    let (x, w) = (small(&[5, 4]), small(&[4]).map(|v| v + 0.5));
    let mr = |x: &Tensor, w: &Tensor| ops::mul_row(x, w).unwrap();
    check2!(MESH1, "mul_row", (&x, &w), |_, x, w| x.mul_row(&w), mr;
        [Tp: S0] [Tp: R],
        [Tp: S1] [Tp: S0],
        [Tp: R] [Tp: R],
        [Tp: I] [Tp: I],
        [Tp: P] [Tp: R],
        [Tp: R] [Tp: P],
    );
    check2!(MESH2, "mul_row", (&x, &w), |_, x, w| x.mul_row(&w), mr;
        [Dp: S0, Tp: S1] [Dp: R, Tp: S0],
        [Dp: P, Tp: S0] [Dp: R, Tp: R],
    );
}

#[test]
fn a_split_backward_gives_the_same_gradients_as_a_whole_one() {
    // y = (gelu(x·W1ᵀ)·W2ᵀ) + b on [Dp: Shard<0>, Tp: ·]: the input pass gives dx, the
    // weight pass dW1, dW2, db; together, bitwise the whole backward's.
    let x = small(&[4, 3]);
    let w1 = small(&[6, 3]);
    let w2 = small(&[3, 6]);
    let run = |split: bool| {
        let (x, w1, w2) = (x.clone(), w1.clone(), w2.clone());
        on_mesh(DP2TP2, move |m| {
            let tape = Tape::new();
            let xv = tape.leaf(dist::<layout![Dp: Shard<0>, Tp: Invariant]>(&x, m));
            let p1 = tape.param(1, dist::<layout![Dp: Replicate, Tp: Shard<0>]>(&w1, m));
            let p2 = tape.param(2, dist::<layout![Dp: Replicate, Tp: Shard<1>]>(&w2, m));
            let y = xv
                .to_replicate(Tp)?
                .matmul_t(&p1)?
                .gelu()?
                .matmul_t(&p2)?
                .all_reduce(Tp)?;
            let dy = y.value().clone();
            let (dx, mut g) = if split {
                let (dx, pass) = y.backward_input(dy, &xv)?;
                (dx, pass.run()?)
            } else {
                let mut g = y.backward_with(dy)?;
                (g.take(&xv)?, g)
            };
            let l1 = dist::<layout![Dp: Replicate, Tp: Shard<0>]>(&w1, m);
            let l2 = dist::<layout![Dp: Replicate, Tp: Shard<1>]>(&w2, m);
            Ok((
                dx.full_tensor()?,
                g.of_key(1, &l1)?.all_reduce(Dp)?.full_tensor()?,
                g.of_key(2, &l2)?.all_reduce(Dp)?.full_tensor()?,
            ))
        })
    };
    let (whole, split) = (run(false), run(true));
    assert_eq!(whole, split);
}

#[test]
fn a_backward_hook_gets_each_parameter_gradient_once_when_it_is_final() {
    // y = gelu(x·W1ᵀ)·W2ᵀ, W1 bound twice (two leaves, one key), W3 bound and unused.
    let x = small(&[4, 3]);
    let w1 = small(&[6, 3]);
    let w2 = small(&[3, 6]);
    on_mesh(DP2TP2, move |m| {
        let run = |hooked: bool| -> Result<Vec<(u64, Tensor)>, Error> {
            let tape = Tape::new();
            let xv = tape.constant(dist::<layout![Dp: Shard<0>, Tp: Invariant]>(&x, m));
            let d1 = dist::<layout![Dp: Replicate, Tp: Shard<0>]>(&w1, m);
            let d2 = dist::<layout![Dp: Replicate, Tp: Shard<1>]>(&w2, m);
            let (a, b) = (tape.param(1, d1.clone()), tape.param(1, d1.clone()));
            let p2 = tape.param(2, d2.clone());
            let _unused = tape.param(3, d2.clone());
            let h = xv.to_replicate(Tp)?;
            let y = h
                .matmul_t(&a)?
                .add(&h.matmul_t(&b)?)?
                .gelu()?
                .matmul_t(&p2)?;
            let loss = y.all_reduce(Tp)?.sum_dim::<1>()?.sum_dim::<0>()?;
            if hooked {
                let mut got = Vec::new();
                let mut g = loss.backward_hooked(&mut |key, g| {
                    got.push((key, g.as_local().clone()));
                    // Take all but W2's.
                    Ok(Some(g).filter(|_| key == 2))
                })?;
                // Taken gradients left the store: of_key now finds zeros; W2's stayed.
                let z = g.of_key(1, &d1)?;
                assert!(z.as_local().to_f64_vec().iter().all(|v| *v == 0.0));
                assert_eq!(g.of_key(2, &d2)?.as_local(), &got[1].1);
                Ok(got)
            } else {
                let mut g = loss.backward()?;
                Ok(vec![
                    (2, g.of_key(2, &d2)?.as_local().clone()),
                    (1, g.of_key(1, &d1)?.as_local().clone()),
                    (3, g.of_key(3, &d2)?.as_local().clone()),
                ])
            }
        };
        let hooked = run(true)?;
        let keys: Vec<u64> = hooked.iter().map(|k| k.0).collect();
        // The unused one first (final from the start), then W2 (read last in forward), W1.
        assert_eq!(keys, vec![3, 2, 1]);
        let mut plain = run(false)?;
        plain.sort_by_key(|k| k.0);
        let mut hooked = hooked;
        hooked.sort_by_key(|k| k.0);
        assert_eq!(hooked, plain, "the same gradients, bit for bit");
        Ok(())
    });
}

#[test]
fn a_prefetched_gather_is_the_gather_forward_and_backward() {
    // W [6, 4] sharded over Dp on dim 1 (FSDP's column weight) and over Tp on dim 0.
    let x = small(&[4, 4]);
    let w = small(&[6, 4]);
    let run = |prefetch: bool| {
        let (x, w) = (x.clone(), w.clone());
        on_mesh(DP2TP2, move |m| {
            let tape = Tape::new();
            let wd = dist::<layout![Dp: Shard<1>, Tp: Shard<0>]>(&w, m);
            let pending = wd.clone().start_all_gather(Dp)?;
            let ws = tape.param(9, wd.clone());
            let whole = if prefetch {
                ws.all_gather_prefetched(pending)?
            } else {
                drop(pending);
                ws.all_gather(Dp)?
            };
            let xv = tape.constant(dist::<layout![Dp: Shard<0>, Tp: Invariant]>(&x, m));
            let y = xv.to_replicate(Tp)?.matmul_t(&whole)?.gelu()?;
            let loss = y.sum_dim::<1>()?.all_reduce(Tp)?.sum_dim::<0>()?;
            let mut g = loss.backward()?;
            // The gather's adjoint reduce-scattered the gradient back to Shard<1> over Dp.
            let gw: DTensor<layout![Dp: Shard<1>, Tp: Shard<0>]> = g.of_key(9, &wd)?;
            Ok((y.value().full_tensor()?, gw.full_tensor()?))
        })
    };
    assert_eq!(run(true), run(false));
}
