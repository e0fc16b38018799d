//! The tape's gradients against central finite differences of the single-rank reference, in
//! f64. Each case lays a global input out as the rule's layout on a 1-D (2 ranks) or 2-D
//! (2×2) mesh, runs the op on the tape, seeds the output with a gradient laid out as the
//! output's dual (partial terms spread so no rank holds the whole seed), and compares the
//! input's gradient (`full_tensor()`, laid out as the input's dual) with
//! `d⟨seed, f(x)⟩/dx` computed from the reference op on the global tensors.

#![allow(clippy::type_complexity)]

mod common;

use common::{float_global, int_global, on_mesh, spread_partial_terms};
use dtensor::prelude::*;
use dtensor_core::{Tape, Var};
use dtensor_kernels::ops::{self, Transpose};
use std::sync::Arc;

const TP2: &[(AxisKind, usize)] = &[(AxisKind::Tp, 2)];
const DP2TP2: &[(AxisKind, usize)] = &[(AxisKind::Dp, 2), (AxisKind::Tp, 2)];

fn dist<L: Layout>(full: &Tensor, mesh: &Arc<DeviceMesh>) -> DTensor<L> {
    let x = DTensor::<L>::distribute(Some(full).filter(|_| mesh.rank() == 0), 0, mesh).unwrap();
    if !L::placements().iter().any(|p| p.is_partial()) {
        return x;
    }
    DTensor::try_from_any(spread_partial_terms(x.into_any())).unwrap()
}

fn dot(a: &Tensor, b: &Tensor) -> f64 {
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| x * y)
        .sum()
}

/// `d⟨seed, f(x)⟩/dx` by central differences.
fn numeric_grad(x: &Tensor, seed: &Tensor, f: &dyn Fn(&Tensor) -> Tensor) -> Vec<f64> {
    let h = 1e-6;
    let base = x.to_f64_vec();
    (0..base.len())
        .map(|i| {
            let at = |d: f64| {
                let mut v = base.clone();
                v[i] += d;
                dot(seed, &f(&Tensor::from_vec(v, x.shape()).unwrap()))
            };
            (at(h) - at(-h)) / (2.0 * h)
        })
        .collect()
}

fn grad_check<LX: Layout, Out: Layout>(
    what: &str,
    axes: &[(AxisKind, usize)],
    x: &Tensor,
    f_dist: impl for<'t> Fn(&'t Tape, &Arc<DeviceMesh>, Var<'t, LX>) -> Result<Var<'t, Out>> + Sync,
    f_ref: impl Fn(&Tensor) -> Tensor,
) {
    let y_ref = f_ref(x);
    let seed = float_global(y_ref.shape()).map(|v| v + 0.5);
    let want = numeric_grad(x, &seed, &f_ref);
    let results = on_mesh(axes, |m| {
        let tape = Tape::new();
        let xv = tape.leaf(dist::<LX>(x, m));
        let y = f_dist(&tape, m, xv.clone())?;
        let y_full = y.value().full_tensor()?;
        let mut grads = y.backward_with(dist::<Out::Grad>(&seed, m))?;
        let g: DTensor<LX::Grad> = grads.take(&xv)?;
        assert_eq!(
            g.placements(),
            <LX::Grad as Layout>::placements().as_slice()
        );
        Ok((y_full, g.full_tensor()?))
    });
    for (rank, (y_full, g)) in results.into_iter().enumerate() {
        let (y, yr) = (y_full.to_f64_vec(), y_ref.to_f64_vec());
        for (a, b) in y.iter().zip(&yr) {
            assert!(
                (a - b).abs() <= 1e-10 * (1.0 + b.abs()),
                "{what}: rank {rank} forward {a} vs {b}"
            );
        }
        for (i, (a, b)) in g.to_f64_vec().iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                "{what}: rank {rank} d/dx[{i}]: tape {a}, finite differences {b}"
            );
        }
    }
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
        let loss = h.sum_dim::<1>()?.sum_dim::<0>()?; // [Dp: Partial, Tp: Invariant]
        let mut g = loss.backward()?;
        let gh: DTensor<layout![Dp: Shard<0>, Tp: Invariant]> = g.take(&h)?;
        assert_eq!(gh.full_tensor()?.to_f64_vec(), vec![1.0; 12]);
        let gx = g.take(&xv)?;
        assert_eq!(gx.full_tensor()?.to_f64_vec(), vec![3.0; 12]);
        Ok(())
    });
}

#[test]
fn causal_attention_has_the_dual_gradient() {
    let cfg = dtensor_kernels::ops::CausalAttention {
        seq_len: 3,
        head_dim: 2,
        rope_base: 50.0,
        pos_offset: 0,
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
