//! Typed compute ops against a single-rank reference: every rule of every table, on a 1-D
//! mesh (2 ranks, uneven shapes) and a 2-D mesh (2×2). Each case distributes global f64
//! inputs under the rule's layouts (partial terms spread with noise that sums to zero, so no
//! rank holds the whole value), runs the op, and compares `full_tensor()` with the kernel run
//! on the global inputs. The output layout is the one the type system derived; the test
//! also checks the run-time placements agree.

#![allow(clippy::type_complexity)] // the annotations spell out the derived layouts on purpose

mod common;

use common::{dist, float_global, int_global, on_mesh};
use dtensor::prelude::*;
use dtensor_kernels::ops::{self, Transpose};

const TP2: &[(AxisKind, usize)] = &[(AxisKind::Tp, 2)];
const DP2TP2: &[(AxisKind, usize)] = &[(AxisKind::Dp, 2), (AxisKind::Tp, 2)];

fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tol * (1.0 + b.abs()),
            "{what}: element {i}: got {a}, want {b}"
        );
    }
}

/// Checks a result's run-time placements and its global value.
fn check<L: Layout>(what: &str, y: &DTensor<L>, want: &Tensor) -> Result<()> {
    assert_eq!(
        y.placements(),
        L::placements().as_slice(),
        "{what}: placements"
    );
    assert_close(what, &y.full_tensor()?, want, 1e-12);
    Ok(())
}

macro_rules! binary_case {
    ($mesh:expr, $op:ident, [$($la:tt)*], [$($lb:tt)*], $a:expr, $b:expr, $want:expr) => {{
        let (a, b, want) = ($a, $b, $want);
        let what = format!(
            "{} {} · {}",
            stringify!($op),
            stringify!($($la)*),
            stringify!($($lb)*)
        );
        on_mesh($mesh, |m| {
            let x = dist::<layout![$($la)*]>(&a, m);
            let y = dist::<layout![$($lb)*]>(&b, m);
            check(&what, &x.$op(&y)?, &want)
        });
    }};
}

#[test]
fn matmul_every_rule_matches_the_reference() {
    let (a, b) = (int_global(&[5, 6]), float_global(&[6, 3]));
    let want = ops::matmul(&a, Transpose::No, &b, Transpose::No).unwrap();
    binary_case!(TP2, matmul, [Tp: Replicate], [Tp: Replicate], a.clone(), b.clone(), want.clone());
    binary_case!(TP2, matmul, [Tp: Invariant], [Tp: Invariant], a.clone(), b.clone(), want.clone());
    binary_case!(TP2, matmul, [Tp: Shard<0>], [Tp: Replicate], a.clone(), b.clone(), want.clone());
    binary_case!(TP2, matmul, [Tp: Replicate], [Tp: Shard<1>], a.clone(), b.clone(), want.clone());
    binary_case!(TP2, matmul, [Tp: Shard<1>], [Tp: Shard<0>], a.clone(), b.clone(), want.clone());
    binary_case!(TP2, matmul, [Tp: Partial], [Tp: Replicate], a.clone(), b.clone(), want.clone());
    binary_case!(TP2, matmul, [Tp: Replicate], [Tp: Partial], a.clone(), b.clone(), want.clone());
    binary_case!(DP2TP2, matmul, [Dp: Shard<0>, Tp: Shard<1>], [Dp: Replicate, Tp: Shard<0>],
        a.clone(), b.clone(), want.clone());
    binary_case!(DP2TP2, matmul, [Dp: Shard<1>, Tp: Replicate], [Dp: Shard<0>, Tp: Shard<1>],
        a, b, want);
}

#[test]
fn matmul_t_every_rule_matches_the_reference() {
    let (x, w) = (int_global(&[5, 6]), float_global(&[7, 6]));
    let want = ops::matmul(&x, Transpose::No, &w, Transpose::Yes).unwrap();
    binary_case!(TP2, matmul_t, [Tp: Replicate], [Tp: Replicate], x.clone(), w.clone(), want.clone());
    binary_case!(TP2, matmul_t, [Tp: Invariant], [Tp: Invariant], x.clone(), w.clone(), want.clone());
    binary_case!(TP2, matmul_t, [Tp: Shard<0>], [Tp: Replicate], x.clone(), w.clone(), want.clone());
    binary_case!(TP2, matmul_t, [Tp: Replicate], [Tp: Shard<0>], x.clone(), w.clone(), want.clone());
    binary_case!(TP2, matmul_t, [Tp: Shard<1>], [Tp: Shard<1>], x.clone(), w.clone(), want.clone());
    binary_case!(TP2, matmul_t, [Tp: Partial], [Tp: Replicate], x.clone(), w.clone(), want.clone());
    binary_case!(TP2, matmul_t, [Tp: Replicate], [Tp: Partial], x.clone(), w.clone(), want.clone());
    // Megatron's column-parallel then row-parallel pair on a DP×TP mesh.
    binary_case!(DP2TP2, matmul_t, [Dp: Shard<0>, Tp: Replicate], [Dp: Replicate, Tp: Shard<0>],
        x.clone(), w.clone(), want.clone());
    binary_case!(DP2TP2, matmul_t, [Dp: Shard<0>, Tp: Shard<1>], [Dp: Replicate, Tp: Shard<1>],
        x, w, want);
}

#[test]
fn bmm_batch_and_contraction_rules_match_the_reference() {
    let (a, b) = (int_global(&[3, 4, 5]), float_global(&[3, 5, 2]));
    let want = ops::matmul(&a, Transpose::No, &b, Transpose::No).unwrap();
    binary_case!(TP2, bmm, [Tp: Shard<0>], [Tp: Shard<0>], a.clone(), b.clone(), want.clone());
    binary_case!(TP2, bmm, [Tp: Shard<1>], [Tp: Replicate], a.clone(), b.clone(), want.clone());
    binary_case!(TP2, bmm, [Tp: Replicate], [Tp: Shard<2>], a.clone(), b.clone(), want.clone());
    binary_case!(TP2, bmm, [Tp: Shard<2>], [Tp: Shard<1>], a.clone(), b.clone(), want.clone());
    binary_case!(TP2, bmm, [Tp: Partial], [Tp: Replicate], a, b, want);
}

#[test]
fn mul_and_div_allow_one_partial_factor() {
    let (a, b) = (int_global(&[5, 3]), float_global(&[5, 3]).map(|v| v + 20.0));
    let prod = a.mul(&b).unwrap();
    binary_case!(TP2, mul, [Tp: Shard<0>], [Tp: Shard<0>], a.clone(), b.clone(), prod.clone());
    binary_case!(TP2, mul, [Tp: Shard<1>], [Tp: Shard<1>], a.clone(), b.clone(), prod.clone());
    binary_case!(TP2, mul, [Tp: Invariant], [Tp: Invariant], a.clone(), b.clone(), prod.clone());
    binary_case!(TP2, mul, [Tp: Partial], [Tp: Replicate], a.clone(), b.clone(), prod.clone());
    binary_case!(TP2, mul, [Tp: Replicate], [Tp: Partial], a.clone(), b.clone(), prod.clone());
    let quot = Tensor::from_vec(
        a.to_f64_vec()
            .iter()
            .zip(b.to_f64_vec())
            .map(|(x, y)| x / y)
            .collect(),
        &[5, 3],
    )
    .unwrap();
    binary_case!(TP2, div, [Tp: Partial], [Tp: Replicate], a.clone(), b.clone(), quot.clone());
    binary_case!(DP2TP2, div, [Dp: Shard<0>, Tp: Shard<1>], [Dp: Shard<0>, Tp: Shard<1>], a, b, quot);
}

#[test]
fn add_row_broadcasts_the_bias_along_sharded_rows_and_columns() {
    let (x, bias) = (int_global(&[5, 4]), float_global(&[4]));
    let want = ops::add_row(&x, &bias).unwrap();
    binary_case!(TP2, add_row, [Tp: Shard<0>], [Tp: Replicate], x.clone(), bias.clone(), want.clone());
    binary_case!(TP2, add_row, [Tp: Shard<1>], [Tp: Shard<0>], x.clone(), bias.clone(), want.clone());
    binary_case!(TP2, add_row, [Tp: Partial], [Tp: Partial], x.clone(), bias.clone(), want.clone());
    binary_case!(DP2TP2, add_row, [Dp: Shard<0>, Tp: Shard<1>], [Dp: Replicate, Tp: Shard<0>],
        x, bias, want);
}

#[test]
fn sub_and_swiglu_keep_the_layout() {
    let (a, b) = (int_global(&[5, 4]), float_global(&[5, 4]));
    binary_case!(DP2TP2, sub, [Dp: Shard<0>, Tp: Partial], [Dp: Shard<0>, Tp: Partial],
        a.clone(), b.clone(), ops::sub(&a, &b).unwrap());
    binary_case!(DP2TP2, swiglu, [Dp: Shard<0>, Tp: Shard<1>], [Dp: Shard<0>, Tp: Shard<1>],
        a.clone(), b.clone(), ops::swiglu(&a, &b).unwrap());
}

#[test]
fn reductions_make_partials_of_sharded_dims_and_move_the_others() {
    let x = int_global(&[4, 6, 3]);
    let sum = |d| ops::sum_dim(&x, d).unwrap();
    on_mesh(DP2TP2, |m| {
        let t = dist::<layout![Dp: Shard<0>, Tp: Shard<2>]>(&x, m);
        let s0: DTensor<layout![Dp: Partial, Tp: Shard<1>]> = t.sum_dim::<0>()?;
        check("sum over dim 0", &s0, &sum(0))?;
        let s2: DTensor<layout![Dp: Shard<0>, Tp: Partial]> = t.sum_dim::<2>()?;
        check("sum over dim 2", &s2, &sum(2))?;
        let mean: DTensor<layout![Dp: Partial<Avg>, Tp: Shard<1>]> = t.mean_dim::<0>()?;
        check("mean over dim 0", &mean, &sum(0).scale(0.25))?;
        let max: DTensor<layout![Dp: Shard<0>, Tp: Partial<Max>]> = t.max_dim::<2>()?;
        check("max over dim 2", &max, &ops::max_dim(&x, 2).unwrap().values)?;
        let p = dist::<layout![Dp: Partial, Tp: Shard<0>]>(&x, m);
        let ps: DTensor<layout![Dp: Partial, Tp: Partial]> = p.sum_dim::<0>()?;
        check("sum of a partial", &ps, &sum(0))
    });
}

#[test]
fn mean_over_an_uneven_shard_is_an_error() {
    let x = int_global(&[5, 2]);
    let errs = on_mesh(TP2, |m| {
        let t = dist::<layout![Tp: Shard<0>]>(&x, m);
        Ok(t.mean_dim::<0>().unwrap_err().to_string())
    });
    for e in errs {
        assert!(
            e.contains("DTensor::mean_dim") && e.contains("not split evenly"),
            "{e}"
        );
    }
}

#[test]
fn softmax_and_norms_over_a_whole_dim_match_the_reference() {
    let x = float_global(&[5, 6]);
    let (w, b) = (int_global(&[6]), float_global(&[6]));
    on_mesh(DP2TP2, |m| {
        let t = dist::<layout![Dp: Shard<0>, Tp: Invariant]>(&x, m);
        check("softmax", &t.softmax::<1>()?, &ops::softmax(&x).unwrap())?;
        check(
            "log_softmax",
            &t.log_softmax::<1>()?,
            &ops::log_softmax(&x).unwrap(),
        )?;
        let wi = dist::<layout![Dp: Replicate, Tp: Invariant]>(&w, m);
        let bi = dist::<layout![Dp: Replicate, Tp: Invariant]>(&b, m);
        check(
            "rms_norm",
            &t.rms_norm::<1, _>(&wi, 1e-5)?,
            &ops::rms_norm(&x, &w, 1e-5).unwrap().y,
        )?;
        let ln = ops::layer_norm(&x, &w, &b, 1e-5).unwrap().y;
        check("layer_norm", &t.layer_norm::<1, _>(&wi, &bi, 1e-5)?, &ln)?;
        // Sequence parallel: rows sharded over Tp too, the weight Replicate there.
        let sp = dist::<layout![Dp: Shard<0>, Tp: Shard<0>]>(&x, m);
        let wr = dist::<layout![Dp: Replicate, Tp: Replicate]>(&w, m);
        check(
            "rms_norm sp",
            &sp.rms_norm::<1, _>(&wr, 1e-5)?,
            &ops::rms_norm(&x, &w, 1e-5).unwrap().y,
        )
    });
}

#[test]
fn softmax_over_a_dim_that_is_not_last_is_an_error() {
    let x = float_global(&[3, 4]);
    on_mesh(TP2, |m| {
        let t = dist::<layout![Tp: Shard<1>]>(&x, m);
        let e = t.softmax::<0>().unwrap_err().to_string();
        assert!(
            e.contains("DTensor::softmax") && e.contains("last dim"),
            "{e}"
        );
        Ok(())
    });
}

fn ids(n: usize, vocab: usize) -> Tensor {
    Tensor::from_fn(&[n], |i| ((i * 7 + 3) % vocab) as i64)
}

#[test]
fn embedding_every_rule_matches_the_reference() {
    let (table, id) = (float_global(&[7, 4]), ids(5, 7));
    let want = ops::embedding(&table, &id).unwrap();
    binary_case!(TP2, embedding, [Tp: Shard<0>], [Tp: Invariant], table.clone(), id.clone(), want.clone());
    binary_case!(TP2, embedding, [Tp: Shard<0>], [Tp: Replicate], table.clone(), id.clone(), want.clone());
    binary_case!(TP2, embedding, [Tp: Shard<1>], [Tp: Invariant], table.clone(), id.clone(), want.clone());
    binary_case!(TP2, embedding, [Tp: Replicate], [Tp: Shard<0>], table.clone(), id.clone(), want.clone());
    binary_case!(TP2, embedding, [Tp: Replicate], [Tp: Invariant], table.clone(), id.clone(), want.clone());
    binary_case!(TP2, embedding, [Tp: Invariant], [Tp: Invariant], table.clone(), id.clone(), want.clone());
    binary_case!(DP2TP2, embedding, [Dp: Replicate, Tp: Shard<0>], [Dp: Shard<0>, Tp: Invariant],
        table, id, want);
}

/// Per-token cross-entropy on one rank, plainly: log Σ exp(l) − l[target].
fn cross_entropy_reference(logits: &Tensor, targets: &Tensor) -> Tensor {
    let (t, v) = (logits.shape()[0], logits.shape()[1]);
    let l = logits.to_f64_vec();
    let ids = targets.to_f64_vec();
    Tensor::from_fn(&[t], |r| {
        let row = &l[r * v..(r + 1) * v];
        row.iter().map(|x| x.exp()).sum::<f64>().ln() - row[ids[r] as usize]
    })
}

#[test]
fn cross_entropy_vocab_parallel_gives_an_invariant_loss_without_gathering_logits() {
    let (logits, tg) = (float_global(&[5, 9]), ids(5, 9));
    let want = cross_entropy_reference(&logits, &tg);
    binary_case!(TP2, cross_entropy, [Tp: Shard<1>], [Tp: Invariant], logits.clone(), tg.clone(), want.clone());
    binary_case!(TP2, cross_entropy, [Tp: Shard<0>], [Tp: Shard<0>], logits.clone(), tg.clone(), want.clone());
    binary_case!(TP2, cross_entropy, [Tp: Replicate], [Tp: Replicate], logits.clone(), tg.clone(), want.clone());
    // DP×TP: tokens over Dp, vocab over Tp. The only collectives are on Tp: 3 all-reduces.
    on_mesh(DP2TP2, |m| {
        let l = dist::<layout![Dp: Shard<0>, Tp: Shard<1>]>(&logits, m);
        let t = dist::<layout![Dp: Shard<0>, Tp: Invariant]>(&tg, m);
        let before = m.counters();
        let loss: DTensor<layout![Dp: Shard<0>, Tp: Invariant]> = l.cross_entropy(&t)?;
        let after = m.counters();
        for ((axis, b), (_, a)) in before.iter().zip(&after) {
            let calls = a.calls(CollectiveKind::AllReduce) - b.calls(CollectiveKind::AllReduce);
            let expect = if *axis == AxisKind::Tp { 3 } else { 0 };
            assert_eq!(calls, expect, "all-reduces over {axis}");
        }
        check("cross_entropy dp×tp", &loss, &want)
    });
}

#[test]
fn transpose_swaps_shard_dims() {
    let x = int_global(&[5, 3]);
    let want = Tensor::from_fn(&[3, 5], |i| x.to_f64_vec()[(i % 5) * 3 + i / 5]);
    on_mesh(DP2TP2, |m| {
        let t = dist::<layout![Dp: Shard<0>, Tp: Shard<1>]>(&x, m);
        let tt: DTensor<layout![Dp: Shard<1>, Tp: Shard<0>]> = t.t()?;
        check("t", &tt, &want)
    });
}

#[test]
fn matmul_with_mismatched_contraction_is_an_error_naming_shapes_and_placements() {
    let (a, b) = (int_global(&[4, 6]), int_global(&[5, 3]));
    on_mesh(TP2, |m| {
        let x = dist::<layout![Tp: Shard<1>]>(&a, m);
        let y = dist::<layout![Tp: Shard<0>]>(&b, m);
        let e = x.matmul(&y).unwrap_err().to_string();
        assert!(
            e.contains("DTensor::matmul") && e.contains("[4, 6]") && e.contains("S(1)"),
            "{e}"
        );
        Ok(())
    });
}

fn attention_cfg() -> dtensor_kernels::ops::CausalAttention {
    dtensor_kernels::ops::CausalAttention {
        seq_len: 4,
        head_dim: 4,
        q_per_kv: 1,
        scale: None,
    }
}

#[test]
fn causal_attention_on_whole_samples_and_heads_matches_the_reference() {
    // 2 samples of 4 tokens, 2 heads of dim 4: samples over Dp, heads over Tp.
    let qkv = float_global(&[8, 24]);
    let want = ops::causal_attention(&qkv, &attention_cfg()).unwrap().out;
    on_mesh(DP2TP2, |m| {
        let x = dist::<layout![Dp: Shard<0>, Tp: Shard<1>]>(&qkv, m);
        check("attention", &x.causal_attention(&attention_cfg())?, &want)
    });
}

#[test]
fn grouped_query_attention_sharded_by_kv_groups_matches_the_reference() {
    use dtensor_kernels::ops::CausalAttention;
    // 2 samples of 4 tokens, 2 KV heads each shared by 2 query heads of dim 3: samples over
    // Dp, one whole KV group per Tp rank.
    let gqa = CausalAttention::new(4, 3).grouped(2);
    let qkv = float_global(&[8, 2 * (2 + 2) * 3]);
    let want = ops::causal_attention(&qkv, &gqa).unwrap().out;
    assert_eq!(want.shape(), &[8, 4 * 3]);
    on_mesh(DP2TP2, |m| {
        let x = dist::<layout![Dp: Shard<0>, Tp: Shard<1>]>(&qkv, m);
        check("grouped attention", &x.causal_attention(&gqa)?, &want)
    });
    // Multi-query: one KV head for 4 query heads, whole on every Tp rank.
    let mqa = CausalAttention::new(4, 3).grouped(4);
    let qkv = float_global(&[8, (4 + 2) * 3]);
    let want = ops::causal_attention(&qkv, &mqa).unwrap().out;
    on_mesh(DP2TP2, |m| {
        let x = dist::<layout![Dp: Shard<0>, Tp: Invariant]>(&qkv, m);
        check("multi-query attention", &x.causal_attention(&mqa)?, &want)
    });
    // One KV group split over two Tp ranks: each holds half a group.
    let qkv = float_global(&[8, (2 + 2) * 3]);
    on_mesh(TP2, |m| {
        let x = dist::<layout![Tp: Shard<1>]>(&qkv, m);
        let e = x.causal_attention(&gqa).unwrap_err().to_string();
        assert!(e.contains("whole KV groups"), "{e}");
        Ok(())
    });
}

#[test]
fn causal_attention_on_split_samples_is_an_error() {
    // 6 tokens over 2 ranks is 3 each: not whole samples of 4.
    let qkv = float_global(&[8, 12]);
    on_mesh(TP2, |m| {
        let x = dist::<layout![Tp: Shard<0>]>(&qkv.narrow(0, 0, 6).unwrap(), m);
        let e = x
            .causal_attention(&attention_cfg())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("DTensor::causal_attention") && e.contains("whole samples"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn split_and_merge_move_shard_dims_and_refuse_uneven_shards() {
    let x = int_global(&[4, 6]);
    let split = x.clone().reshape(&[4, 2, 3]).unwrap();
    on_mesh(DP2TP2, |m| {
        // [tokens, heads·d] → [tokens, heads, d]: heads sharded over Tp follow into dim 1.
        let t = dist::<layout![Dp: Shard<0>, Tp: Shard<1>]>(&x, m);
        let s: DTensor<layout![Dp: Shard<0>, Tp: Shard<1>]> = t.split_dim::<1>(3)?;
        check("split dim 1", &s, &split)?;
        // Splitting dim 0 moves a shard of dim 1 to dim 2.
        let r = dist::<layout![Dp: Replicate, Tp: Shard<1>]>(&x, m);
        let s0: DTensor<layout![Dp: Replicate, Tp: Shard<2>]> = r.split_dim::<0>(2)?;
        check("split dim 0", &s0, &x.clone().reshape(&[2, 2, 6]).unwrap())?;
        // And back.
        let back: DTensor<layout![Dp: Shard<0>, Tp: Shard<1>]> = s.merge_dims::<1>()?;
        check("merge dims 1, 2", &back, &x)?;
        let p = dist::<layout![Dp: Shard<0>, Tp: Partial]>(&split, m);
        let pm: DTensor<layout![Dp: Shard<0>, Tp: Partial]> = p.merge_dims::<1>()?;
        check("merge of a partial", &pm, &x)
    });
    // 3 heads over 2 ranks: the shards of the split dim would hold other rows.
    let y = int_global(&[2, 9]);
    on_mesh(TP2, |m| {
        let t = dist::<layout![Tp: Shard<1>]>(&y, m);
        let e = t.split_dim::<1>(3).unwrap_err().to_string();
        assert!(
            e.contains("DTensor::split_dim") && e.contains("evenly"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn mul_row_scales_columns_along_sharded_rows_and_columns() {
    let (x, w) = (int_global(&[5, 4]), float_global(&[4]));
    let want = ops::mul_row(&x, &w).unwrap();
    binary_case!(TP2, mul_row, [Tp: Shard<0>], [Tp: Replicate], x.clone(), w.clone(), want.clone());
    binary_case!(TP2, mul_row, [Tp: Shard<1>], [Tp: Shard<0>], x.clone(), w.clone(), want.clone());
    binary_case!(TP2, mul_row, [Tp: Partial], [Tp: Replicate], x.clone(), w.clone(), want.clone());
    binary_case!(TP2, mul_row, [Tp: Replicate], [Tp: Partial], x.clone(), w.clone(), want.clone());
    binary_case!(DP2TP2, mul_row, [Dp: Shard<0>, Tp: Shard<1>], [Dp: Replicate, Tp: Shard<0>],
        x, w, want);
}
