//! Attention, the transformer block and the GPT.
//!
//! - Attention at TP = 1: forward against a naive single-rank f64 implementation written
//!   here (heads, grouped-query KV heads, RoPE in either pairing, causal softmax), backward
//!   against central finite differences; MHA with interleaved RoPE, and GQA with half-split.
//! - Attention and the block at TP = 2, 4, SP on and off, and DP×TP: forward, backward and
//!   every parameter gradient equal the TP = 1 run within 1e-10 (relative to max |ref|).
//! - The GPT: 5 AdamW steps at dp=2, tp=2, SP (and other meshes) equal the one-rank run
//!   in f64 within 1e-9 (losses and every parameter, biases included).
//! - Communication: the bytes the Tp communicators count per token per block.

mod common;

use common::*;
use dtensor_core::{DTensor, DeviceMesh, Result, Tape};
use dtensor_kernels::ops::{self, RopeStyle, Transpose};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::*;
use dtensor_placement::AxisKind;
use std::sync::Arc;

const S: usize = 6;
const B: usize = 4;
const T: usize = S * B;
const H: usize = 16;
const HEADS: usize = 4;

fn acfg() -> AttentionConfig {
    let mut cfg = AttentionConfig::new(H, HEADS, S, RopeStyle::Interleaved);
    cfg.rope.base = 100.0;
    cfg.qkv_bias = true;
    cfg.out_bias = true;
    cfg
}

fn ainit() -> ParamInit {
    ParamInit::new(3, 500, 0.3, DType::F64).with_bias_std(0.1)
}

/// Naive attention on whole tensors, written independently of the layer: grouped-query
/// (query head `h` reads KV head `h / (heads / kv_heads)`; the fused rows are group by
/// group: its q heads, then k, then v), RoPE in the pairs `cfg.rope.style` names.
fn naive_attention(x: &Tensor, cfg: &AttentionConfig) -> Tensor {
    let (heads, kv) = (cfg.heads, cfg.kv_heads);
    let (d, g) = (H / heads, heads / kv);
    let rows = (heads + 2 * kv) * d;
    let wqkv = Init::Normal { std: 0.3 }.full(3, 500, &[rows, H], DType::F64);
    let bqkv = Init::Normal { std: 0.1 }.full(3, 501, &[rows], DType::F64);
    let wo = Init::Normal { std: 0.2 }.full(3, 502, &[H, H], DType::F64);
    let bo = Init::Normal { std: 0.1 }.full(3, 503, &[H], DType::F64);
    let qkv = ops::add_row(
        &ops::matmul(x, Transpose::No, &wqkv, Transpose::Yes).unwrap(),
        &bqkv,
    )
    .unwrap()
    .to_f64_vec();
    let half = cfg.rope.style == RopeStyle::HalfSplit;
    let rot = |v: &[f64], pos: usize| -> Vec<f64> {
        let mut out = v.to_vec();
        for i in 0..d / 2 {
            let th = pos as f64 * 100f64.powf(-(2.0 * i as f64) / d as f64);
            let (a, b) = if half {
                (i, i + d / 2)
            } else {
                (2 * i, 2 * i + 1)
            };
            out[a] = v[a] * th.cos() - v[b] * th.sin();
            out[b] = v[a] * th.sin() + v[b] * th.cos();
        }
        out
    };
    // Column offset of query head h, and of the k / v head of group j, in a fused row.
    let q_col = |h: usize| (h / g) * (g + 2) * d + (h % g) * d;
    let kv_col = |j: usize, which: usize| j * (g + 2) * d + (g + which) * d;
    let mut o = vec![0.0; T * H];
    for b in 0..B {
        for h in 0..heads {
            let row = |t: usize, col: usize| {
                let base = (b * S + t) * rows + col;
                qkv[base..base + d].to_vec()
            };
            for i in 0..S {
                let q = rot(&row(i, q_col(h)), i);
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        let k = rot(&row(j, kv_col(h / g, 0)), j);
                        q.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (j, s) in scores.iter().enumerate() {
                    let p = (s - m).exp() / z;
                    for (e, v) in row(j, kv_col(h / g, 1)).iter().enumerate() {
                        o[(b * S + i) * H + h * d + e] += p * v;
                    }
                }
            }
        }
    }
    let o = Tensor::from_vec(o, &[T, H]).unwrap();
    ops::add_row(
        &ops::matmul(&o, Transpose::No, &wo, Transpose::Yes).unwrap(),
        &bo,
    )
    .unwrap()
}

/// Grouped-query attention (2 KV heads for 4 query heads) with half-split RoPE.
fn gqa_cfg() -> AttentionConfig {
    let mut cfg = acfg();
    cfg.kv_heads = 2;
    cfg.rope.style = RopeStyle::HalfSplit;
    cfg
}

#[test]
fn attention_at_tp1_matches_naive_forward_and_finite_differences() {
    for cfg in [acfg(), gqa_cfg()] {
        attention_matches_naive(&cfg);
    }
}

fn attention_matches_naive(cfg: &AttentionConfig) {
    let x = randn(81, &[T, H]);
    let dy = randn(82, &[T, H]);
    let y_ref = naive_attention(&x, cfg);
    on_mesh(1, 1, |mesh| {
        let attn = ParallelAttention::<NoSp, Ddp>::new(*cfg, ainit(), 0.2, mesh)?;
        // Output and input gradient for the seed dy.
        let run = |x: &Tensor| -> Result<(Tensor, Tensor)> {
            let tape = Tape::new();
            let xs = tape.leaf(piece::<Stream<NoSp>>(x, mesh)?);
            let y = attn.forward(&tape, &xs)?;
            let y_local = y.value().as_local().clone();
            let mut g = y.backward_with(piece(&dy, mesh)?)?;
            Ok((y_local, g.take(&xs)?.as_local().clone()))
        };
        let (y, dx) = run(&x)?;
        assert_close("attention y vs naive", &y, &y_ref, 1e-12);
        let loss =
            |x: &Tensor| -> Result<f64> { Ok(run(x)?.0.mul(&dy)?.to_f64_vec().iter().sum()) };
        let eps = 1e-5;
        let dxv = dx.to_f64_vec();
        for idx in [0, 5, 17, 40, 99, 200, 311, T * H - 1] {
            let mut xp = x.to_f64_vec();
            xp[idx] += eps;
            let lp = loss(&Tensor::from_vec(xp.clone(), &[T, H])?)?;
            xp[idx] -= 2.0 * eps;
            let lm = loss(&Tensor::from_vec(xp, &[T, H])?)?;
            let fd = (lp - lm) / (2.0 * eps);
            assert!(
                (fd - dxv[idx]).abs() <= 1e-7 * (1.0 + fd.abs()),
                "dx[{idx}]: {} vs fd {fd}",
                dxv[idx]
            );
        }
        Ok(())
    });
}

/// Everything a layer run produces, as whole tensors: output, input gradient, reduced
/// parameter gradients (times dp: the full-batch sums).
type Run = Vec<Tensor>;

fn attention_run<M: SeqMode>(dp: usize, tp: usize) -> Run {
    attention_run_with::<M>(&acfg(), dp, tp)
}

fn attention_run_with<M: SeqMode>(cfg: &AttentionConfig, dp: usize, tp: usize) -> Run {
    let x = randn(81, &[T, H]);
    let dy = randn(82, &[T, H]);
    on_mesh(dp, tp, |mesh| {
        let attn = ParallelAttention::<M, Ddp>::new(*cfg, ainit(), 0.2, mesh)?;
        let tape = Tape::new();
        let xs = tape.leaf(piece::<Stream<M>>(&x, mesh)?);
        let y = attn.forward(&tape, &xs)?;
        let y_full = y.value().full_tensor()?;
        let mut g = y.backward_with(piece(&dy, mesh)?)?;
        Ok(vec![
            y_full,
            g.take(&xs)?.full_tensor()?,
            reduced(&attn.qkv.fused().unwrap().weight, &mut g, dp)?,
            reduced(attn.qkv.fused().unwrap().bias.as_ref().unwrap(), &mut g, dp)?,
            reduced(&attn.out.weight, &mut g, dp)?,
            reduced(attn.out.bias.as_ref().unwrap(), &mut g, dp)?,
        ])
    })
    .swap_remove(0)
}

fn compare(what: &str, got: &Run, want: &Run, tol: f64) -> f64 {
    got.iter()
        .zip(want)
        .enumerate()
        .map(|(i, (a, b))| assert_close(&format!("{what} item {i}"), a, b, tol))
        .fold(0.0, f64::max)
}

#[test]
fn grouped_query_attention_over_tp_by_groups_equals_tp1() {
    let cfg = gqa_cfg();
    let want = attention_run_with::<NoSp>(&cfg, 1, 1);
    for (dp, tp) in [(1, 2), (2, 2)] {
        compare(
            &format!("GQA dp={dp} tp={tp}"),
            &attention_run_with::<NoSp>(&cfg, dp, tp),
            &want,
            1e-12,
        );
        compare(
            &format!("GQA dp={dp} tp={tp} sp"),
            &attention_run_with::<Sp>(&cfg, dp, tp),
            &want,
            1e-12,
        );
    }
    // tp above the KV heads must be a multiple of them (tests/attention_settings.rs runs
    // tp = 4 over 2 KV heads): refused by name otherwise.
    let err = cfg.check(3).unwrap_err().to_string();
    assert!(
        err.contains("tp=3 exceeds the 2 KV heads: it must be a multiple of them"),
        "{err}"
    );
}

#[test]
fn parallel_attention_at_every_tp_equals_tp1() {
    let want = attention_run::<NoSp>(1, 1);
    for tp in TPS {
        let a = compare(
            &format!("attention tp={tp}"),
            &attention_run::<NoSp>(1, tp),
            &want,
            1e-10,
        );
        let b = compare(
            &format!("attention tp={tp} sp"),
            &attention_run::<Sp>(1, tp),
            &want,
            1e-10,
        );
        eprintln!("attention tp={tp}: {a:e} (no SP), {b:e} (SP)");
    }
    compare(
        "attention dp=2 tp=2 sp",
        &attention_run::<Sp>(2, 2),
        &want,
        1e-10,
    );
}

fn gpt_config() -> GptConfig {
    tiny_gpt(2, S, 9)
}

fn block_run<M: SeqMode>(dp: usize, tp: usize) -> Run {
    let x = randn(91, &[T, H]);
    let dy = randn(92, &[T, H]);
    let mut cfg = gpt_config();
    cfg.norm = NormKind::Layer;
    on_mesh(dp, tp, |mesh| {
        let init = ParamInit::new(9, 10, 0.3, DType::F64).with_bias_std(0.1);
        let block = TransformerBlock::<M, Ddp>::new(&cfg, init, mesh)?;
        let tape = Tape::new();
        let xs = tape.leaf(piece::<Stream<M>>(&x, mesh)?);
        let y = block.forward(&tape, &xs)?;
        let y_full = y.value().full_tensor()?;
        let mut g = y.backward_with(piece(&dy, mesh)?)?;
        Ok(vec![
            y_full,
            g.take(&xs)?.full_tensor()?,
            reduced(&block.norm1.weight, &mut g, dp)?,
            reduced(block.norm2.bias.as_ref().unwrap(), &mut g, dp)?,
            reduced(&block.attn.qkv.fused().unwrap().weight, &mut g, dp)?,
            reduced(&block.mlp.dense().unwrap().fc1.weight, &mut g, dp)?,
            reduced(
                block
                    .mlp
                    .dense()
                    .unwrap()
                    .up
                    .as_ref()
                    .unwrap()
                    .bias
                    .as_ref()
                    .unwrap(),
                &mut g,
                dp,
            )?,
            reduced(&block.mlp.dense().unwrap().fc2.weight, &mut g, dp)?,
            reduced(
                block.mlp.dense().unwrap().fc2.bias.as_ref().unwrap(),
                &mut g,
                dp,
            )?,
        ])
    })
    .swap_remove(0)
}

#[test]
fn transformer_block_at_every_tp_equals_tp1() {
    let want = block_run::<NoSp>(1, 1);
    for tp in TPS {
        let a = compare(
            &format!("block tp={tp}"),
            &block_run::<NoSp>(1, tp),
            &want,
            1e-10,
        );
        let b = compare(
            &format!("block tp={tp} sp"),
            &block_run::<Sp>(1, tp),
            &want,
            1e-10,
        );
        eprintln!("block tp={tp}: {a:e} (no SP), {b:e} (SP)");
    }
    compare("block dp=2 tp=2 sp", &block_run::<Sp>(2, 2), &want, 1e-10);
}

fn tokens() -> (Tensor, Tensor) {
    let seq: Vec<i64> = (0..T + 1)
        .map(|i| ((i * i * 7 + i * 3 + 1) % 20) as i64)
        .collect();
    // Sample b predicts tokens shifted by one inside its own window.
    let mut ids = Vec::new();
    let mut tg = Vec::new();
    for b in 0..B {
        for i in 0..S {
            ids.push(seq[(b * S + i) % T]);
            tg.push(seq[(b * S + i + 1) % T]);
        }
    }
    (
        Tensor::from_vec(ids, &[T]).unwrap(),
        Tensor::from_vec(tg, &[T]).unwrap(),
    )
}

/// Every parameter's local piece on this rank, in visiting order.
struct Locals(Vec<Tensor>);
impl ParamVisitor for Locals {
    fn visit<D: DataMode, K: ParamKind>(&mut self, _: &str, p: &mut Weight<D, K>) -> Result<()> {
        self.0.push(p.local().clone());
        Ok(())
    }
}

fn gpt_train<M: SeqMode>(dp: usize, tp: usize, steps: usize) -> (Vec<f64>, Vec<Tensor>) {
    let (ids, tg) = tokens();
    let ranks = on_mesh(dp, tp, |mesh| {
        let mut cfg = gpt_config();
        cfg.seed = 17;
        let mut model = Gpt::<M, Ddp>::new(cfg, mesh)?;
        let mut opt = AdamW::new(3e-3);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let losses = (0..steps)
            .map(|_| Ok(model.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<Result<Vec<_>>>()?;
        let mut locals = Locals(Vec::new());
        model.visit_params("", &mut locals)?;
        let tp_coord = dtensor_nn::axis_coord(mesh, dtensor_placement::AxisKind::Tp);
        Ok((losses, model.full_params()?, tp_coord, locals.0))
    });
    // Replicas are bitwise identical: every rank reports the same losses, and ranks at the
    // same Tp coordinate (Dp replicas) hold the same bits of every parameter.
    for (l, _, tp_coord, local) in &ranks {
        assert_eq!(
            l.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            ranks[0].0.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let twin = ranks.iter().find(|r| r.2 == *tp_coord).expect("itself");
        for (a, b) in local.iter().zip(&twin.3) {
            assert_eq!(
                a.to_f64_vec()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                b.to_f64_vec()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>(),
                "Dp replicas differ"
            );
        }
    }
    let (losses, params, _, _) = ranks.into_iter().next().expect("rank 0");
    (losses, params)
}

#[test]
fn gpt_five_adamw_steps_at_dp2_tp2_sp_equal_one_rank() {
    let (want_l, want_p) = gpt_train::<NoSp>(1, 1, 5);
    assert!(want_l[4] < want_l[0], "loss goes down: {want_l:?}");
    for (dp, tp, sp) in [(2, 2, true), (1, 4, true), (2, 2, false), (2, 1, false)] {
        let (l, p) = if sp {
            gpt_train::<Sp>(dp, tp, 5)
        } else {
            gpt_train::<NoSp>(dp, tp, 5)
        };
        for (a, b) in l.iter().zip(&want_l) {
            assert!(
                (a - b).abs() <= 1e-9 * b.abs(),
                "dp={dp} tp={tp} sp={sp}: loss {a} vs {b}"
            );
        }
        let e = compare(&format!("gpt dp={dp} tp={tp} sp={sp}"), &p, &want_p, 1e-9);
        eprintln!("gpt dp={dp} tp={tp} sp={sp}: params max rel err {e:e}");
    }
}

/// Bytes sent over `Tp` by one block's forward and backward (activations only, parameter
/// gradients not reduced), summed over the `Tp` ranks of one `Dp` group.
fn block_tp_bytes<M: SeqMode>(tp: usize) -> (u64, u64) {
    let x = randn(91, &[T, H]);
    let per_rank = on_mesh(1, tp, |mesh: &Arc<DeviceMesh>| {
        let block = TransformerBlock::<M, Ddp>::new(
            &gpt_config(),
            ParamInit::new(9, 10, 0.3, DType::F64),
            mesh,
        )?;
        let tape = Tape::new();
        let xs = tape.leaf(piece::<Stream<M>>(&x, mesh)?);
        let comm = mesh.comm(AxisKind::Tp).unwrap().clone();
        let before = comm.counters();
        let y = block.forward(&tape, &xs)?;
        let seed = y.value().clone();
        let _ = y.backward_with(seed)?;
        let d = comm.counters().since(&before);
        Ok((d.bytes_sent, d.collectives()))
    });
    (per_rank.iter().map(|p| p.0).sum(), per_rank[0].1)
}

#[test]
fn block_communication_matches_the_analytic_bytes_per_token() {
    // Per block, forward + backward, per token of a Dp rank, summed over its tp ranks:
    //   bytes = 8·(tp − 1)·hidden·elem_size, with SP and without.
    // Without SP: 4 all-reduces of [tokens, hidden] (two exits forward, two entry adjoints
    // backward); each moves 2·(tp − 1)·L elements summed over ranks (L = tokens·hidden).
    // With SP: 4 all-gathers and 4 reduce-scatters of the same tensor, (tp − 1)·L each.
    for tp in [2, 4] {
        let want = 8 * (tp as u64 - 1) * H as u64 * 8;
        let (no_sp, calls_no_sp) = block_tp_bytes::<NoSp>(tp);
        let (sp, calls_sp) = block_tp_bytes::<Sp>(tp);
        assert_eq!(calls_no_sp, 4);
        assert_eq!(calls_sp, 8);
        assert_eq!(no_sp / T as u64, want, "no SP, tp={tp}");
        assert_eq!(sp / T as u64, want, "SP, tp={tp}");
        assert_eq!(no_sp % T as u64, 0);
    }
}

#[test]
fn gpt_params_are_enumerable_by_name_layout_and_value() {
    // LayerNorm + SwiGLU + biases: 1 embedding, 14 tensors per block, 2 final-norm, 1 head.
    let mut cfg = gpt_config();
    cfg.norm = NormKind::Layer;
    let named = on_mesh(1, 2, |mesh| {
        let mut model = Gpt::<Sp, Ddp>::new(cfg, mesh)?;
        named_params(&mut model)
    })
    .swap_remove(0);
    assert_eq!(named.len(), 1 + 14 * cfg.layers + 2 + 1);
    let names: std::collections::BTreeSet<&str> = named.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names.len(), named.len(), "names are unique");
    let find = |n: &str| {
        named
            .iter()
            .find(|p| p.name == n)
            .unwrap_or_else(|| panic!("no {n}"))
    };
    use dtensor_placement::Placement::{Invariant as I, Replicate as R, Shard as S};
    // [Dp, Ep, Cp, Tp]: stored parameters are Invariant over Ep and Cp.
    assert_eq!(find("embedding.weight").placements, [R, I, I, S(0)]);
    assert_eq!(find("blocks.0.attn.qkv.bias").placements, [R, I, I, S(0)]);
    assert_eq!(find("blocks.1.attn.out.weight").placements, [R, I, I, S(1)]);
    assert_eq!(find("blocks.1.mlp.up.weight").value.shape(), &[cfg.ffn, H]);
    // Under SP a stream parameter is Replicate over Tp (its gradient needs the Tp reduction).
    assert_eq!(find("blocks.0.norm2.bias").placements, [R, I, I, R]);
    assert_eq!(find("norm.weight").placements, [R, I, I, R]);
    assert_eq!(find("head.weight").value.shape(), &[cfg.vocab, H]);
}
