//! The GPT's loss is the mean over the scored tokens of the whole global batch: targets
//! equal to −100 (padding, masked prompt tokens) score nothing, and the count is summed
//! over the data axes and the microbatches, so the loss does not change with the mesh.
//!
//! - Ignored targets spread unevenly over the data ranks (most of one rank's tokens): 3
//!   AdamW steps in f64 at dp = 2 × tp = 2 (with and without SP), and at pp = 2 with 4
//!   microbatches (1F1B, and dp = 2 × tp = 2 under it), equal to one rank (losses within
//!   1e-9, every parameter within 1e-12 relative).
//! - Ignored tokens contribute nothing: a batch whose last samples are all −100 trains
//!   exactly like the batch of its first samples alone (samples do not attend to each other).
//! - The z-loss through the GPT (`GptConfig::z_loss`): equal to one rank on the same meshes,
//!   a different loss than without it, and an invalid coefficient refused by `Gpt::new`.

mod common;

use common::*;
use dtensor_core::{DTensor, Result};
use dtensor_kernels::ops::IGNORE_INDEX;
use dtensor_kernels::Tensor;
use dtensor_nn::pipeline::{self, microbatches, Pipeline};
use dtensor_nn::*;

const S: usize = 4;
const SAMPLES: usize = 8;

/// `samples` windows of `S` tokens: ids and their next-token targets.
fn batch(samples: usize) -> (Tensor, Tensor) {
    next_tokens(samples * S, |i| i * i * 7 + i * 3 + 1)
}

/// `tg` with the targets of the tokens `ignored` picks set to −100.
fn masked(tg: &Tensor, ignored: impl Fn(usize) -> bool) -> Tensor {
    let t = tg.as_slice::<i64>().unwrap();
    Tensor::from_fn(&[t.len()], |i| match ignored(i) {
        true => IGNORE_INDEX,
        false => t[i],
    })
}

/// Uneven over two data ranks: 12 of the first half's 16 targets are ignored, 3 of the
/// second half's (the first target of three samples, as a prompt token would be).
fn uneven(i: usize) -> bool {
    let half = SAMPLES * S / 2;
    (i < half && i % 8 != 3 && i % 8 != 6) || (i >= half && i.is_multiple_of(S) && i < half + 3 * S)
}

/// [`Run`] after `steps` AdamW steps of the whole GPT on `dp × tp`; every rank reports the
/// same losses.
fn train<M: SeqMode>(
    cfg: GptConfig,
    (ids, tg): (&Tensor, &Tensor),
    (dp, tp): (usize, usize),
    steps: usize,
) -> Run {
    let ranks = on_mesh(dp, tp, |mesh| {
        let mut model = Gpt::<M, Ddp>::new(cfg, mesh)?;
        let mut opt = AdamW::new(3e-3);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(ids, mesh)?, piece(tg, mesh)?);
        let losses = (0..steps)
            .map(|_| Ok(model.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<Result<Vec<_>>>()?;
        Ok((losses, named_params(&mut model)?))
    });
    gather(ranks)
}

/// [`Run`] after `steps` steps of 1F1B at pp = 2 with `m` microbatches on `dp × tp`.
fn pipelined(
    cfg: GptConfig,
    (ids, tg): (&Tensor, &Tensor),
    (dp, tp): (usize, usize),
    m: usize,
    steps: usize,
) -> Run {
    let schedule = pipeline::one_f_one_b(2, m).unwrap();
    let (ids, tg) = (
        microbatches(ids, m, S).unwrap(),
        microbatches(tg, m, S).unwrap(),
    );
    let ranks = on_pp_mesh(2, dp, tp, |mesh| {
        let mut p = Pipeline::<Sp, Ddp>::new(cfg, schedule.clone(), mesh)?;
        let sm = p.stage_mesh().clone();
        let i: Vec<DTensor<Ids>> = ids.iter().map(|x| piece(x, &sm)).collect::<Result<_>>()?;
        let t: Vec<DTensor<Ids>> = tg.iter().map(|x| piece(x, &sm)).collect::<Result<_>>()?;
        let mut opt = AdamW::new(3e-3);
        let losses = (0..steps)
            .map(|_| Ok(p.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<Result<Vec<_>>>()?;
        Ok((losses, named_params(&mut p)?))
    });
    gather(ranks)
}

fn check(what: &str, got: &Run, want: &Run) {
    for (a, b) in got.0.iter().zip(&want.0) {
        assert!((a - b).abs() <= 1e-9 * b.abs(), "{what}: loss {a} vs {b}");
    }
    assert_eq!(
        got.1.keys().collect::<Vec<_>>(),
        want.1.keys().collect::<Vec<_>>(),
        "{what}: parameter names"
    );
    let worst = got
        .1
        .iter()
        .map(|(n, a)| assert_close(&format!("{what} {n}"), a, &want.1[n], 1e-12))
        .fold(0.0, f64::max);
    eprintln!("{what}: losses {:?}, params max rel err {worst:e}", got.0);
}

#[test]
fn gpt_with_ignored_targets_trains_like_one_rank_on_every_mesh() {
    let cfg = tiny_gpt(2, S, 41);
    let (ids, tg) = batch(SAMPLES);
    let tg = masked(&tg, uneven);
    let want = train::<NoSp>(cfg, (&ids, &tg), (1, 1), 3);
    check(
        "dp=2 tp=2",
        &train::<NoSp>(cfg, (&ids, &tg), (2, 2), 3),
        &want,
    );
    check(
        "dp=2 tp=2 sp",
        &train::<Sp>(cfg, (&ids, &tg), (2, 2), 3),
        &want,
    );
    check(
        "pp=2 m=4",
        &pipelined(cfg, (&ids, &tg), (1, 1), 4, 3),
        &want,
    );
    check(
        "pp=2 m=4 dp=2 tp=2 sp",
        &pipelined(cfg, (&ids, &tg), (2, 2), 4, 3),
        &want,
    );
    // The ignored targets matter: without them the run differs.
    let (_, plain) = batch(SAMPLES);
    let unmasked = train::<NoSp>(cfg, (&ids, &plain), (1, 1), 1);
    assert!((unmasked.0[0] - want.0[0]).abs() > 1e-3 * want.0[0].abs());
}

#[test]
fn ignored_samples_train_like_a_batch_without_them() {
    // The last half of the samples fully ignored: the mean over the first half's tokens,
    // its gradients those of the first half alone (samples attend only within themselves).
    let cfg = tiny_gpt(2, S, 43);
    let (ids, tg) = batch(SAMPLES);
    let half = SAMPLES * S / 2;
    let without = train::<NoSp>(
        cfg,
        (
            &ids.narrow(0, 0, half).unwrap(),
            &tg.narrow(0, 0, half).unwrap(),
        ),
        (1, 1),
        3,
    );
    let tg = masked(&tg, |i| i >= half);
    check(
        "second half ignored, one rank",
        &train::<NoSp>(cfg, (&ids, &tg), (1, 1), 3),
        &without,
    );
    // On dp = 2 the second rank scores nothing at all.
    check(
        "second half ignored, dp=2 tp=2",
        &train::<NoSp>(cfg, (&ids, &tg), (2, 2), 3),
        &without,
    );
}

#[test]
fn gpt_z_loss_trains_like_one_rank() {
    let mut cfg = tiny_gpt(2, S, 47);
    cfg.z_loss = 0.01;
    let (ids, tg) = batch(SAMPLES);
    let tg = masked(&tg, uneven);
    let want = train::<NoSp>(cfg, (&ids, &tg), (1, 1), 3);
    check(
        "z-loss dp=2 tp=2 sp",
        &train::<Sp>(cfg, (&ids, &tg), (2, 2), 3),
        &want,
    );
    check(
        "z-loss pp=2 m=4 dp=2 tp=2 sp",
        &pipelined(cfg, (&ids, &tg), (2, 2), 4, 3),
        &want,
    );
    // The z term is in the loss.
    let off = train::<NoSp>(GptConfig { z_loss: 0.0, ..cfg }, (&ids, &tg), (1, 1), 1);
    assert!(want.0[0] - off.0[0] > 1e-4, "{} vs {}", want.0[0], off.0[0]);
}

#[test]
fn gpt_refuses_an_invalid_z_loss() {
    for z in [-0.1, f64::NAN, f64::INFINITY] {
        let cfg = GptConfig {
            z_loss: z,
            ..tiny_gpt(1, S, 1)
        };
        let errs = on_mesh(1, 1, |mesh| {
            Ok(Gpt::<NoSp, Ddp>::new(cfg, mesh)
                .err()
                .map(|e| e.to_string()))
        });
        let msg = errs[0].clone().expect("an invalid z-loss is an error");
        assert!(msg.contains("z-loss"), "{msg}");
    }
}
