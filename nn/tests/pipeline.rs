//! Pipeline parallelism: every schedule, run on thread ranks, trains the GPT like one rank.
//!
//! - GPipe, 1F1B, interleaved 1F1B and ZB-H1 at pp = 2 and 4 with m = 1, pp and 2·pp
//!   microbatches (interleaved needs m a multiple of pp): 3 AdamW steps in f64, losses
//!   within 1e-9 and every parameter within 1e-12 of the one-rank model (compared by name).
//! - pp = 2, dp = 2, tp = 2 with SP and FSDP together.
//! - Bad input is an error before any rank starts: layers that do not divide into stages,
//!   microbatches that do not divide the batch, a schedule that fails validation.

mod common;

use common::*;
use dtensor_core::DTensor;
use dtensor_kernels::Tensor;
use dtensor_nn::pipeline::{self, microbatches, Pipeline};
use dtensor_nn::*;
use std::collections::BTreeMap;

const S: usize = 4;

fn config(layers: usize) -> GptConfig {
    tiny_gpt(layers, S, 23)
}

/// `samples` windows of `S + 1` tokens: ids and their next-token targets.
fn batch(samples: usize) -> (Tensor, Tensor) {
    next_tokens(samples * S, |i| i * i * 7 + i * 3 + 1)
}

type Named = BTreeMap<String, Tensor>;

fn reference(cfg: GptConfig, samples: usize, steps: usize) -> (Vec<f64>, Named) {
    let (ids, tg) = batch(samples);
    on_mesh(1, 1, |mesh| {
        let mut model = Gpt::<NoSp, Ddp>::new(cfg, mesh)?;
        let mut opt = AdamW::new(3e-3);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let losses = (0..steps)
            .map(|_| Ok(model.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<dtensor_core::Result<Vec<_>>>()?;
        let named = named_params(&mut model)?
            .into_iter()
            .map(|p| (p.name, p.value))
            .collect();
        Ok((losses, named))
    })
    .swap_remove(0)
}

fn pipelined<M: SeqMode, D: DataMode>(
    cfg: GptConfig,
    schedule: &Schedule,
    (dp, tp): (usize, usize),
    samples: usize,
    steps: usize,
) -> (Vec<f64>, Named) {
    pipelined_with::<M, D>(cfg, schedule, (dp, tp), samples, steps, None)
}

fn pipelined_with<M: SeqMode, D: DataMode>(
    cfg: GptConfig,
    schedule: &Schedule,
    (dp, tp): (usize, usize),
    samples: usize,
    steps: usize,
    buckets: Option<usize>,
) -> (Vec<f64>, Named) {
    let (ids, tg) = batch(samples);
    let m = schedule.microbatches;
    let (ids, tg) = (
        microbatches(&ids, m, S).unwrap(),
        microbatches(&tg, m, S).unwrap(),
    );
    let ranks = on_pp_mesh(schedule.pp, dp, tp, |mesh| {
        let mut p = Pipeline::<M, D>::new(cfg, schedule.clone(), mesh)?;
        p.ddp_bucket_bytes = buckets;
        let sm = p.stage_mesh().clone();
        let i: Vec<DTensor<Ids>> = ids
            .iter()
            .map(|x| piece(x, &sm))
            .collect::<Result<_, _>>()?;
        let t: Vec<DTensor<Ids>> = tg.iter().map(|x| piece(x, &sm)).collect::<Result<_, _>>()?;
        let mut opt = AdamW::new(3e-3);
        let losses = (0..steps)
            .map(|_| Ok(p.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<dtensor_core::Result<Vec<_>>>()?;
        Ok((losses, named_params(&mut p)?))
    });
    let mut named = Named::new();
    for (l, params) in &ranks {
        assert_eq!(l, &ranks[0].0, "every rank reports the same losses");
        for p in params {
            if let Some(old) = named.insert(p.name.clone(), p.value.clone()) {
                assert_eq!(old, p.value, "{}: replicas differ", p.name);
            }
        }
    }
    (ranks[0].0.clone(), named)
}

fn check(what: &str, got: &(Vec<f64>, Named), want: &(Vec<f64>, Named)) {
    for (a, b) in got.0.iter().zip(&want.0) {
        assert!((a - b).abs() <= 1e-9 * b.abs(), "{what}: loss {a} vs {b}");
    }
    assert_eq!(
        got.1.keys().collect::<Vec<_>>(),
        want.1.keys().collect::<Vec<_>>(),
        "{what}: the stages hold exactly the model's parameters"
    );
    let worst = got
        .1
        .iter()
        .map(|(n, a)| assert_close(&format!("{what} {n}"), a, &want.1[n], 1e-12))
        .fold(0.0, f64::max);
    eprintln!("{what}: params max rel err {worst:e}");
}

#[test]
fn every_schedule_trains_like_one_rank() {
    for pp in [2, 4] {
        let layers = 2 * pp; // interleaved: two chunks per rank
        let samples = 2 * pp;
        let want = reference(config(layers), samples, 3);
        for m in [1, pp, 2 * pp] {
            let cfg = config(layers);
            let schedules = [
                pipeline::gpipe(pp, m).unwrap(),
                pipeline::one_f_one_b(pp, m).unwrap(),
                pipeline::zero_bubble_h1(pp, m).unwrap(),
            ];
            for s in schedules {
                let got = pipelined::<NoSp, Ddp>(cfg, &s, (1, 1), samples, 3);
                check(&format!("{:?} pp={pp} m={m}", s.kind), &got, &want);
            }
            match pipeline::interleaved_1f1b(pp, 2, m) {
                Ok(s) => {
                    let got = pipelined::<NoSp, Ddp>(cfg, &s, (1, 1), samples, 3);
                    check(&format!("interleaved pp={pp} m={m}"), &got, &want);
                }
                Err(e) => assert!(m % pp != 0, "interleaved pp={pp} m={m}: {e}"),
            }
        }
    }
}

#[test]
fn pp2_dp2_tp2_with_sp_and_fsdp_trains_like_one_rank() {
    let cfg = config(4);
    let want = reference(cfg, 8, 3);
    let s = pipeline::one_f_one_b(2, 4).unwrap();
    let got = pipelined::<Sp, Fsdp>(cfg, &s, (2, 2), 8, 3);
    check("1f1b pp=2 dp=2 tp=2 sp fsdp", &got, &want);
    let s = pipeline::interleaved_1f1b(2, 2, 4).unwrap();
    let got = pipelined::<Sp, Zero2>(cfg, &s, (2, 2), 8, 3);
    check("interleaved pp=2 dp=2 tp=2 sp zero2", &got, &want);
    // DDP buckets started in each chunk's last backward, and FSDP's prefetch.
    let s = pipeline::interleaved_1f1b(2, 2, 4).unwrap();
    let got = pipelined_with::<Sp, Ddp>(cfg, &s, (2, 2), 8, 3, Some(2048));
    check("interleaved pp=2 dp=2 tp=2 sp ddp buckets", &got, &want);
    let mut pre = cfg;
    pre.precision = Precision::default().resharded(true).prefetched(true);
    let s = pipeline::one_f_one_b(2, 4).unwrap();
    let got = pipelined::<Sp, Fsdp>(pre, &s, (2, 2), 8, 3);
    check("1f1b pp=2 dp=2 tp=2 sp fsdp prefetch", &got, &want);
    // ZB-H1's weight passes carry the FSDP gathers' reduce-scatters.
    let s = pipeline::zero_bubble_h1(2, 4).unwrap();
    let got = pipelined::<Sp, Fsdp>(cfg, &s, (2, 2), 8, 3);
    check("zb-h1 pp=2 dp=2 tp=2 sp fsdp", &got, &want);
}

#[test]
fn bad_pipelines_are_errors_before_any_rank_starts() {
    // 3 layers do not cut into 2 stages.
    let e = pipeline::check_pipeline(&config(3), &pipeline::one_f_one_b(2, 2).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("3 layers do not divide into 2 stages"), "{e}");
    // 3 microbatches do not divide 4 samples.
    let (ids, _) = batch(4);
    let e = microbatches(&ids, 3, S).unwrap_err().to_string();
    assert!(
        e.contains("3 microbatches do not divide a batch of 4 samples"),
        "{e}"
    );
    // A schedule whose rank 1 runs a backward before its forward.
    let mut s = pipeline::gpipe(2, 2).unwrap();
    let r1 = &mut s.actions[1];
    let f = r1
        .iter()
        .position(|a| matches!(a, Action::Forward { .. }))
        .unwrap();
    let b = r1
        .iter()
        .position(|a| matches!(a, Action::Backward { .. }))
        .unwrap();
    r1.swap(f, b);
    let e = pipeline::check_pipeline(&config(2), &s)
        .unwrap_err()
        .to_string();
    assert!(e.contains("rank 1"), "{e}");
}
