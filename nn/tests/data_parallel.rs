//! Data parallelism as placements: DDP, ZeRO-1, ZeRO-2 and FSDP, with TP and SP, activation
//! recomputation and mixed precision.
//!
//! - Every mode trains the GPT in f64 for 3 AdamW steps equal to the one-rank run (losses
//!   within 1e-9, every parameter within 1e-12 relative to its scale), at dp = 2 and 4, and
//!   FSDP × TP × SP at dp = 2, tp = 2; replicas agree bitwise.
//! - The `Dp` bytes per step are the analytic ones: 3·(dp−1)/dp·P·8 for FSDP (gather,
//!   re-gather, reduce-scatter), 2·(dp−1)/dp·P·8 for ZeRO and DDP.
//! - Per-rank memory (parameters, optimizer state, gradients), measured by the tensor
//!   accounting of `dtensor_kernels::memory`, is within 10% of the analytic formula at
//!   dp = 1, 2, 4.
//! - Recomputation gives bitwise the same training and lowers the peak.
//! - Mixed precision (bf16 compute, f32 masters and reduction) tracks the f32 run over 50
//!   steps.

mod common;

use common::*;
use dtensor_core::{DTensor, DeviceMesh, Result, Tape};
use dtensor_kernels::{memory, DType, Tensor};
use dtensor_nn::*;
use dtensor_placement::AxisKind;
use std::sync::Arc;

const S: usize = 6;
const B: usize = 4;
const T: usize = S * B;

fn config() -> GptConfig {
    tiny_gpt(2, S, 17)
}

fn tokens() -> (Tensor, Tensor) {
    next_tokens(T, |i| i * i * 7 + i * 3 + 1)
}

/// What one rank reports after training.
struct Run {
    losses: Vec<f64>,
    params: Vec<Tensor>,
}

fn train<M: SeqMode, D: DataMode>(cfg: GptConfig, dp: usize, tp: usize, steps: usize) -> Run {
    let (ids, tg) = tokens();
    let ranks = on_mesh(dp, tp, |mesh| {
        let mut model = Gpt::<M, D>::new(cfg, mesh)?;
        let mut opt = AdamW::new(3e-3);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let losses = (0..steps)
            .map(|_| Ok(model.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<Result<Vec<_>>>()?;
        Ok(Run {
            losses,
            params: model.full_params()?,
        })
    });
    // Every rank reports the same losses and the same whole parameters, bit for bit.
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for r in &ranks {
        assert_eq!(bits(&r.losses), bits(&ranks[0].losses), "losses differ");
        for (a, b) in r.params.iter().zip(&ranks[0].params) {
            assert_eq!(
                bits(&a.to_f64_vec()),
                bits(&b.to_f64_vec()),
                "replicas differ"
            );
        }
    }
    ranks.into_iter().next().expect("rank 0")
}

fn check_against(name: &str, got: &Run, want: &Run, loss_tol: f64, param_tol: f64) {
    for (a, b) in got.losses.iter().zip(&want.losses) {
        assert!(
            (a - b).abs() <= loss_tol * b.abs(),
            "{name}: loss {a} vs {b}"
        );
    }
    let e = got
        .params
        .iter()
        .zip(&want.params)
        .enumerate()
        .map(|(i, (a, b))| assert_close(&format!("{name} param {i}"), a, b, param_tol))
        .fold(0.0, f64::max);
    eprintln!("{name}: params max rel err {e:e}");
}

#[test]
fn every_data_mode_trains_like_one_rank() {
    let cfg = config();
    let want = train::<NoSp, Ddp>(cfg, 1, 1, 3);
    assert!(
        want.losses[2] < want.losses[0],
        "loss goes down: {:?}",
        want.losses
    );
    for dp in [2, 4] {
        let r = train::<NoSp, Fsdp>(cfg, dp, 1, 3);
        check_against(&format!("fsdp dp={dp}"), &r, &want, 1e-9, 1e-12);
        let r = train::<NoSp, Zero1>(cfg, dp, 1, 3);
        check_against(&format!("zero1 dp={dp}"), &r, &want, 1e-9, 1e-12);
        let r = train::<NoSp, Zero2>(cfg, dp, 1, 3);
        check_against(&format!("zero2 dp={dp}"), &r, &want, 1e-9, 1e-12);
    }
    // FSDP × TP × SP, with and without resharding after the forward.
    let r = train::<Sp, Fsdp>(cfg, 2, 2, 3);
    check_against("fsdp dp=2 tp=2 sp", &r, &want, 1e-9, 1e-12);
    let mut resharded = cfg;
    resharded.precision = Precision::default().resharded(true);
    let r = train::<Sp, Fsdp>(resharded, 2, 2, 3);
    check_against("fsdp dp=2 tp=2 sp reshard", &r, &want, 1e-9, 1e-12);
    let r = train::<NoSp, Zero2>(cfg, 2, 2, 3);
    check_against("zero2 dp=2 tp=2", &r, &want, 1e-9, 1e-12);
}

#[test]
fn recomputation_trains_bitwise_the_same() {
    let cfg = config();
    let mut rc = cfg;
    rc.recompute = true;
    for (dp, tp) in [(1, 1), (2, 2)] {
        let a = train::<Sp, Fsdp>(cfg, dp, tp, 3);
        let b = train::<Sp, Fsdp>(rc, dp, tp, 3);
        assert_eq!(a.losses, b.losses, "dp={dp} tp={tp}");
        assert_eq!(a.params, b.params, "dp={dp} tp={tp}");
    }
}

/// The `Dp` communicator's bytes sent by one rank in one training step (forward,
/// backward, optimizer step; the printed loss's all-reduce left out, and so is the
/// forward's one-element all-reduce of the scored-token count, uneven over 4 ranks).
fn dp_bytes_per_step<D: DataMode>(cfg: GptConfig, dp: usize) -> (u64, usize) {
    let (ids, tg) = tokens();
    let per_rank = on_mesh(dp, 1, |mesh| {
        let mut model = Gpt::<NoSp, D>::new(cfg, mesh)?;
        let params: usize = model.full_params()?.iter().map(|p| p.numel()).sum();
        let mut opt = AdamW::new(3e-3);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let comm = mesh.comm(AxisKind::Dp).unwrap().clone();
        let before = comm.counters();
        let tape = Tape::new();
        let loss = model.forward(&tape, &i, &t)?;
        let mut grads = loss.backward()?;
        step(&mut model, &mut grads, &mut opt, 1.0)?;
        let sent = comm.counters().since(&before).bytes_sent;
        let before_count = comm.counters();
        t.scored_tokens(Some(dtensor_kernels::ops::IGNORE_INDEX))?;
        let count = comm.counters().since(&before_count).bytes_sent;
        Ok((sent - count, params))
    });
    for r in &per_rank {
        assert_eq!(
            r.0, per_rank[0].0,
            "every rank sends the same (even shards)"
        );
    }
    per_rank[0]
}

#[test]
fn dp_bytes_per_step_are_the_analytic_ones() {
    // No biases: every parameter has a dim TP leaves whole, so FSDP shards all of them.
    let mut cfg = config();
    cfg.bias = false;
    let mut resharded = cfg;
    resharded.precision = Precision::default().resharded(true);
    for dp in [2u64, 4] {
        let (ddp, p) = dp_bytes_per_step::<Ddp>(cfg, dp as usize);
        let p = p as u64;
        assert_eq!(ddp, 2 * (dp - 1) * p * 8 / dp, "ddp dp={dp}");
        let (z1, _) = dp_bytes_per_step::<Zero1>(cfg, dp as usize);
        assert_eq!(z1, 2 * (dp - 1) * p * 8 / dp, "zero1 dp={dp}");
        let (z2, _) = dp_bytes_per_step::<Zero2>(cfg, dp as usize);
        assert_eq!(z2, 2 * (dp - 1) * p * 8 / dp, "zero2 dp={dp}");
        let (fsdp, _) = dp_bytes_per_step::<Fsdp>(resharded, dp as usize);
        assert_eq!(fsdp, 3 * (dp - 1) * p * 8 / dp, "fsdp dp={dp}");
        // Kept after the forward: no re-gather in the backward.
        let (kept, _) = dp_bytes_per_step::<Fsdp>(cfg, dp as usize);
        assert_eq!(kept, 2 * (dp - 1) * p * 8 / dp, "fsdp (kept) dp={dp}");
    }
}

/// Per-rank bytes: (parameters + optimizer state after a step, gradients after backward,
/// peak during the step), each relative to what the rank held before building the model.
fn memory_per_rank<D: DataMode>(cfg: GptConfig, dp: usize) -> (usize, usize, usize, usize) {
    let (ids, tg) = tokens();
    let per_rank = on_mesh(dp, 1, |mesh: &Arc<DeviceMesh>| {
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let base = memory::live_bytes();
        let mut model = Gpt::<NoSp, D>::new(cfg, mesh)?;
        let params: usize = {
            let full = model.full_params()?;
            full.iter().map(|p| p.numel()).sum()
        };
        let mut opt = AdamW::new(3e-3);
        model.train_step(&i, &t, &mut opt, 1.0)?;
        let resident = memory::live_bytes() - base;
        memory::reset_peak();
        let tape = Tape::new();
        let loss = model.forward(&tape, &i, &t)?;
        let before_backward_peak = memory::peak_bytes();
        let mut grads = loss.backward()?;
        drop(tape);
        let with_grads = memory::live_bytes() - base;
        step(&mut model, &mut grads, &mut opt, 1.0)?;
        drop(grads);
        let peak = memory::peak_bytes().max(before_backward_peak) - base;
        Ok((resident, with_grads - resident, peak, params))
    });
    per_rank[0]
}

#[test]
fn per_rank_memory_matches_the_analytic_formula() {
    let mut cfg = config();
    cfg.bias = false;
    let e = 8; // f64
    for dp in [1usize, 2, 4] {
        // FSDP: parameters and both AdamW moments sharded; gradients arrive sharded.
        let (resident, grads, peak, p) = memory_per_rank::<Fsdp>(cfg, dp);
        let within = |what: &str, got: usize, want: usize| {
            let r = got as f64 / want as f64;
            eprintln!("fsdp dp={dp} {what}: measured {got} B, analytic {want} B ({r:.3})");
            assert!(
                (0.9..=1.1).contains(&r),
                "fsdp dp={dp} {what}: {got} vs {want}"
            );
        };
        within("params+state", resident, 3 * p * e / dp);
        within("gradients", grads, p * e / dp);
        eprintln!("fsdp dp={dp}: peak {peak} B");
        // ZeRO-2: replicated parameters, sharded state.
        let (resident, _, _, p) = memory_per_rank::<Zero2>(cfg, dp);
        let r = resident as f64 / (p * e + 2 * p * e / dp + p * e / dp) as f64;
        eprintln!("zero2 dp={dp} params+state ratio {r:.3}");
        // The replicated compute copy (P), the sharded master (P/dp) and moments (2P/dp).
        assert!((0.9..=1.1).contains(&r), "zero2 dp={dp}: {r}");
        // DDP: everything replicated.
        let (resident, grads, _, p) = memory_per_rank::<Ddp>(cfg, dp);
        let r = resident as f64 / (3 * p * e) as f64;
        assert!((0.9..=1.1).contains(&r), "ddp dp={dp}: {r}");
        let r = grads as f64 / (p * e) as f64;
        assert!((0.9..=1.1).contains(&r), "ddp dp={dp} grads: {r}");
    }
}

/// Losses of `steps` AdamW steps on a batch of 8 samples of 16 tokens (a tiny corpus with
/// structure to learn), at dp = 2 with FSDP.
fn curve(precision: Precision, steps: usize) -> Vec<f64> {
    let mut cfg = config();
    cfg.dtype = DType::F32;
    cfg.seq_len = 16;
    cfg.hidden = 32;
    cfg.ffn = 64;
    cfg.precision = precision;
    let t = 8 * 16;
    let seq: Vec<i64> = (0..t + 1).map(|i| ((i * 5 + i / 7) % 20) as i64).collect();
    let ids = Tensor::from_vec(seq[..t].to_vec(), &[t]).unwrap();
    let tg = Tensor::from_vec(seq[1..].to_vec(), &[t]).unwrap();
    on_mesh(2, 1, |mesh| {
        let mut model = Gpt::<NoSp, Fsdp>::new(cfg, mesh)?;
        let mut opt = AdamW::new(3e-3);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        (0..steps)
            .map(|_| Ok(model.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<Result<Vec<_>>>()
    })
    .swap_remove(0)
}

#[test]
fn mixed_precision_tracks_the_f32_loss_curve_over_50_steps() {
    let f32_run = curve(Precision::default(), 50);
    let bf16 = curve(Precision::mixed(DType::BF16, DType::F32), 50);
    let bf16_reduce = curve(Precision::mixed(DType::BF16, DType::BF16), 50);
    assert!(
        f32_run[49] < 0.5 * f32_run[0],
        "the model learns: {f32_run:?}"
    );
    // Stated tolerance: every step's loss within 5% of the f32 run's (bf16 keeps 8 bits of
    // mantissa: ~0.4% per rounding, compounded through the layers and the steps).
    for (name, run) in [
        ("bf16/f32 reduce", &bf16),
        ("bf16/bf16 reduce", &bf16_reduce),
    ] {
        let worst = run
            .iter()
            .zip(&f32_run)
            .map(|(a, b)| (a - b).abs() / b.abs())
            .fold(0.0, f64::max);
        eprintln!(
            "{name}: worst relative loss gap {worst:.4}; final {:.4} vs f32 {:.4}",
            run[49], f32_run[49]
        );
        assert!(worst <= 0.05, "{name}: {worst}");
    }
}

/// Peak tensor bytes of one forward and backward on rank 0, above what it held before.
fn step_peak(cfg: GptConfig) -> usize {
    let (ids, tg) = tokens();
    on_mesh(1, 1, |mesh| {
        let model = Gpt::<NoSp, Ddp>::new(cfg, mesh)?;
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let base = memory::live_bytes();
        memory::reset_peak();
        let tape = Tape::new();
        let loss = model.forward(&tape, &i, &t)?;
        let grads = loss.backward()?;
        let peak = memory::peak_bytes() - base;
        drop(grads);
        Ok(peak)
    })
    .swap_remove(0)
}

#[test]
fn recomputation_lowers_the_activation_peak() {
    let mut cfg = config();
    cfg.layers = 6;
    let mut rc = cfg;
    rc.recompute = true;
    let (kept, recomputed) = (step_peak(cfg), step_peak(rc));
    eprintln!("peak of forward + backward: {kept} B kept, {recomputed} B recomputed");
    assert!(recomputed < kept, "{recomputed} vs {kept}");
}

/// Losses and whole parameters after 3 DDP steps at dp = 2, tp = 2 with SP, buckets of
/// `cap` bytes (`None`: reduced after the backward), and the `Dp` all-reduces per step.
fn ddp_run(cap: Option<usize>) -> (Vec<f64>, Vec<Tensor>, u64) {
    ddp_run_with(config(), cap)
}

fn ddp_run_with(cfg: GptConfig, cap: Option<usize>) -> (Vec<f64>, Vec<Tensor>, u64) {
    let (ids, tg) = tokens();
    on_mesh(2, 2, |mesh| {
        let mut model = Gpt::<Sp, Ddp>::new(cfg, mesh)?;
        model.ddp_bucket_bytes = cap;
        let mut opt = AdamW::new(3e-3);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let comm = mesh.comm(AxisKind::Dp).unwrap().clone();
        let before = comm.counters();
        let losses = (0..3)
            .map(|_| Ok(model.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<Result<Vec<_>>>()?;
        let calls = comm
            .counters()
            .since(&before)
            .calls(dtensor_collectives::CollectiveKind::AllReduce);
        Ok((losses, model.full_params()?, calls / 3))
    })
    .swap_remove(0)
}

#[test]
fn bucketed_ddp_reduction_is_bitwise_the_unbucketed_one() {
    let (l0, p0, calls0) = ddp_run(None);
    let (l1, p1, calls1) = ddp_run(Some(2048));
    let (l2, p2, calls2) = ddp_run(Some(DEFAULT_BUCKET_BYTES));
    assert_eq!(l0, l1);
    assert_eq!(p0, p1);
    assert_eq!(l0, l2);
    assert_eq!(p0, p2);
    // Per step: the loss's and the scored-token count's all-reduces, and one per parameter
    // unbucketed, one per bucket.
    let params = (p0.len()) as u64;
    assert_eq!(calls0, 2 + params);
    assert_eq!(calls2, 2 + 1, "everything fits one 25 MB bucket");
    assert!(calls1 > 3 && calls1 < calls0, "2 kB buckets: {calls1}");
    eprintln!("dp all-reduces per step: {calls0} per parameter, {calls1} in 2 kB buckets, {calls2} in one");
}

#[test]
fn bucketed_ddp_reduction_with_recomputed_blocks_is_bitwise_the_unbucketed_one() {
    // A recomputed block binds its parameters inside its region: the hook must still see
    // their gradients only once the region's backward has produced them.
    let mut cfg = config();
    cfg.recompute = true;
    let (l0, p0, _) = ddp_run_with(cfg, None);
    let (l1, p1, _) = ddp_run_with(cfg, Some(2048));
    assert_eq!(l0, l1);
    assert_eq!(p0, p1);
    let (l2, p2, _) = ddp_run(None);
    assert_eq!(l0, l2, "recomputation changes nothing");
    assert_eq!(p0, p2);
}

#[test]
fn fsdp_prefetch_trains_bitwise_the_same() {
    let cfg = config();
    for (reshard, recompute) in [(false, false), (true, false), (true, true)] {
        let mut plain = cfg;
        plain.precision = Precision::default().resharded(reshard);
        plain.recompute = recompute;
        let mut pre = plain;
        pre.precision = plain.precision.prefetched(true);
        let a = train::<Sp, Fsdp>(plain, 2, 2, 3);
        let b = train::<Sp, Fsdp>(pre, 2, 2, 3);
        assert_eq!(
            a.losses, b.losses,
            "reshard={reshard} recompute={recompute}"
        );
        assert_eq!(
            a.params, b.params,
            "reshard={reshard} recompute={recompute}"
        );
    }
}
