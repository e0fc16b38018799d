//! The backend conformance suite (`dtensor_collectives::conformance`) on the NCCL backend,
//! through the staging adapter `conformance::staging::Staging` (test harness only: it
//! copies each case's host buffers to the device and back around the backend's
//! `*_device` calls; the GPU path itself never stages through the host).
//!
//! Every case runs on 2 thread ranks, and on 4 when the machine has 4 GPUs or ranks may
//! share one (`NCCL_MULTI_RANK_GPU_ENABLE=1`, NCCL ≥ 2.30). One line per case and group
//! size, `ok`, `FAILED`, `skipped: <why>` or `unsupported: <why>` (the capabilities the
//! NCCL backend declares it lacks, `staging::UNSUPPORTED`), then a summary per size; the
//! test fails on any `FAILED` and on a case that never ran.
//!
//! Ignored by default (it needs a GPU); on a GPU machine `scripts/gpu-check.sh` builds it
//! and its runner runs it with `--include-ignored --nocapture`, `NCCL_SOCKET_IFNAME=lo`,
//! `NCCL_MULTI_RANK_GPU_ENABLE=1` and `DTENSOR_GPU_REQUIRED=1` (a missing GPU or library
//! then fails instead of skipping).
#![cfg(feature = "nccl")]

use dtensor_collectives::conformance::staging::{Staging, UNSUPPORTED};
use dtensor_collectives::conformance::{self, Outcome};
use dtensor_collectives::nccl::{self, Options, MULTI_RANK_GPU_ENV};
use dtensor_collectives::Error;
use dtensor_kernels::cuda;
use std::time::{Duration, Instant};

mod common;
use common::{gpu_missing, gpu_required};

/// The group sizes this machine can run (2 and 4 ranks, where the GPUs allow), and a
/// note for each size it cannot.
fn sizes(gpus: usize) -> (Vec<usize>, Vec<String>) {
    let shared = std::env::var(MULTI_RANK_GPU_ENV).as_deref() == Ok("1");
    let (mut run, mut not) = (Vec::new(), Vec::new());
    for n in [2, 4] {
        if gpus >= n || shared {
            run.push(n);
        } else {
            not.push(format!(
                "{n} ranks: {gpus} GPU(s) and {MULTI_RANK_GPU_ENV} is not 1, so ranks \
                 cannot share a GPU"
            ));
        }
    }
    (run, not)
}

/// Each case's outcome on every rank of one `n`-rank world (or the launch's error).
type RankOutcomes = Vec<Result<Vec<(Outcome, Duration)>, Error>>;

fn run_world(n: usize) -> RankOutcomes {
    // Bounded: a case that waits on NCCL for longer fails (Timeout) instead of hanging the
    // run; the communicator is then aborted and the later cases report that error.
    let options = Options {
        timeout: Duration::from_secs(30),
    };
    nccl::launch_with(n, options, |comm| {
        let staged = Staging::new(comm);
        Ok::<_, Error>(
            conformance::cases()
                .iter()
                .map(|case| {
                    let t0 = Instant::now();
                    let outcome = case.run_on(&staged, UNSUPPORTED);
                    (outcome, t0.elapsed())
                })
                .collect(),
        )
    })
}

#[test]
#[ignore = "needs a CUDA GPU and libnccl (NCCL_MULTI_RANK_GPU_ENABLE=1 where ranks share a GPU); scripts/gpu-check.sh runs it"]
fn conformance_suite_on_nccl() {
    if let Some(why) = gpu_missing() {
        assert!(!gpu_required(), "DTENSOR_GPU_REQUIRED=1 but {why}");
        eprintln!("SKIPPED (needs a CUDA GPU and NCCL): {why}");
        return;
    }
    let gpus = cuda::device_count().unwrap_or(0);
    let (run, not) = sizes(gpus);
    for why in &not {
        println!("nccl conformance: not run on {why}");
    }
    if run.is_empty() {
        assert!(
            !gpu_required(),
            "DTENSOR_GPU_REQUIRED=1 but {}",
            not.join("; ")
        );
        eprintln!("SKIPPED: {}", not.join("; "));
        return;
    }
    let cases = conformance::cases();
    let mut ran = vec![false; cases.len()];
    let mut failed_total = 0;
    for n in run {
        let t0 = Instant::now();
        let results = run_world(n);
        let (mut passed, mut failed, mut skipped, mut unsupported) = (0, 0, 0, 0);
        // A rank whose launch failed fails every case, with its error.
        let launch_errors: Vec<String> = results
            .iter()
            .enumerate()
            .filter_map(|(r, res)| res.as_ref().err().map(|e| format!("rank {r}: {e}")))
            .collect();
        for (i, case) in cases.iter().enumerate() {
            let outcomes: Vec<&(Outcome, Duration)> = results
                .iter()
                .filter_map(|res| res.as_ref().ok().and_then(|o| o.get(i)))
                .collect();
            let mut messages: Vec<String> = launch_errors.clone();
            for (r, res) in results.iter().enumerate() {
                if let Ok(o) = res {
                    if let Some((Outcome::Failed(msgs), _)) = o.get(i) {
                        messages.extend(msgs.iter().map(|m| format!("rank {r}: {m}")));
                    }
                }
            }
            let first = outcomes.first().map(|(o, _)| o);
            if messages.is_empty() && outcomes.iter().any(|(o, _)| Some(o) != first) {
                let all: Vec<String> = outcomes.iter().map(|(o, _)| o.verdict().into()).collect();
                messages.push(format!("the ranks disagree on the outcome: {all:?}"));
            }
            let ms = outcomes
                .iter()
                .map(|(_, t)| t.as_millis())
                .max()
                .unwrap_or(0);
            let verdict = match first {
                _ if !messages.is_empty() => {
                    failed += 1;
                    "FAILED".to_string()
                }
                Some(Outcome::Skipped(why)) => {
                    skipped += 1;
                    format!("skipped: {why}")
                }
                Some(Outcome::Unsupported(why)) => {
                    unsupported += 1;
                    ran[i] = true;
                    format!("unsupported: {why}")
                }
                Some(_) => {
                    passed += 1;
                    ran[i] = true;
                    "ok".to_string()
                }
                None => {
                    failed += 1;
                    "FAILED (no rank reported)".to_string()
                }
            };
            println!(
                "nccl conformance [{n} ranks] {} ... {verdict} ({ms} ms)",
                case.name
            );
            for m in &messages {
                println!("    {m}");
            }
        }
        println!(
            "nccl conformance on {n} ranks ({gpus} GPU(s), {:.1} s): {passed} passed, \
             {failed} failed, {skipped} skipped, {unsupported} unsupported",
            t0.elapsed().as_secs_f64()
        );
        failed_total += failed;
    }
    let never: Vec<&str> = cases
        .iter()
        .zip(&ran)
        .filter(|(_, &r)| !r)
        .map(|(c, _)| c.name)
        .collect();
    assert_eq!(failed_total, 0, "nccl conformance: {failed_total} FAILED");
    assert!(
        never.is_empty(),
        "nccl conformance: never ran on any group size: {never:?}"
    );
}

/// Without a GPU (here and in CI) the suite's launcher gives every rank our error, not a
/// panic or a hang, and no case runs.
#[test]
fn conformance_launch_without_gpu_errs_on_every_rank() {
    if gpu_missing().is_none() {
        eprintln!("SKIPPED: this machine has a GPU and NCCL (the ignored suite covers it)");
        return;
    }
    let results = run_world(2);
    assert_eq!(results.len(), 2);
    for r in results {
        match r {
            Err(Error::Unavailable { backend, .. }) => assert_eq!(backend, "nccl"),
            other => panic!("expected Unavailable on every rank, got {other:?}"),
        }
    }
}

/// No GPU needed: NCCL's declarations on the threads backend. Every case that needs a
/// capability NCCL lacks comes back `unsupported` with the reason, and every other case
/// passes under those declarations (the checks that change without a capability, such as
/// a float `Avg` within rounding, still hold for a backend that has it): so on NCCL each
/// case either runs or says why not.
#[test]
fn nccl_declarations_on_threads_every_case_runs_or_says_why() {
    let mut unsupported = Vec::new();
    for n in [2, 3, 4] {
        for case in conformance::cases() {
            let results = dtensor_collectives::threads::launch(n, |comm| {
                Ok::<_, Error>(case.run_on(&*comm, UNSUPPORTED))
            });
            for (r, res) in results.into_iter().enumerate() {
                let outcome =
                    res.unwrap_or_else(|e| panic!("{} on {n} ranks, rank {r}: {e}", case.name));
                let lacked = case
                    .needs
                    .iter()
                    .any(|need| UNSUPPORTED.iter().any(|(u, _)| u == need));
                match outcome {
                    Outcome::Unsupported(why) => {
                        assert!(
                            lacked,
                            "{}: unsupported without a lacking need: {why}",
                            case.name
                        );
                        assert!(why.contains("nccl") || why.contains("threads"), "{why}");
                        if n == 2 && r == 0 {
                            unsupported.push(format!("{}: {why}", case.name));
                        }
                    }
                    Outcome::Passed | Outcome::Skipped(_) => {
                        assert!(
                            !lacked,
                            "{} ran although NCCL lacks one of {:?}",
                            case.name, case.needs
                        )
                    }
                    Outcome::Failed(msgs) => {
                        panic!(
                            "{} on {n} ranks, rank {r}, under NCCL's declarations: {msgs:?}",
                            case.name
                        )
                    }
                }
            }
        }
    }
    for line in &unsupported {
        println!("unsupported on nccl: {line}");
    }
    assert!(!unsupported.is_empty());
}
