//! How much all-reduce time an asynchronous all-reduce hides behind computation, on the
//! threads backend with 2 and 4 ranks: each iteration (timed between two barriers, rank
//! 0's clock) is one of
//!
//! - `comm`: a blocking all-reduce of N MiB (f32) alone;
//! - `compute`: a computation of T alone, T calibrated to about 1.5 × `comm`'s time (more
//!   than the all-reduce, so that it can hide all of it);
//! - `blocking`: the all-reduce, then the computation;
//! - `async`: `start_all_reduce`, the computation, `wait`.
//!
//! The share of communication hidden is `(blocking − async) / comm`: 100 % when the
//! all-reduce ran entirely behind the computation, 0 % when `async` took as long as the
//! blocking sequence (negative if it took longer). Two kinds of computation:
//!
//! - `cpu`: a dependent floating-point chain on the rank's thread (a CPU kernel). It
//!   competes with the progress worker for cores whenever ranks and workers outnumber
//!   them (2 ranks need 4 busy threads during the overlap), so it shows what the machine's
//!   cores allow;
//! - `idle`: the rank's thread sleeps for T (a kernel running on an accelerator, or any
//!   wait that leaves the core free), which shows what the worker itself can hide.
//!
//! Criterion reports each mode's time; after each group a line
//! `overlap: ranks=… MiB=… compute=… comm_ms=… compute_ms=… blocking_ms=… async_ms=…
//! hidden=…%` gives the share, from the medians of rounds that run the four modes one
//! after another (so that load from elsewhere weighs on them alike). On a machine with fewer cores than ranks plus workers, or shared with
//! other work, the figures are noisy: read several runs.
//!
//! `cargo bench --bench overlap` (about 2 minutes); a criterion filter such as `-- "2 ranks"`
//! narrows the criterion groups, not the summary lines.

mod support;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use dtensor::collectives::{CommunicatorExt, Error, ReduceOp};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use support::{interleaved_medians, median, ThreadRanks};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    Comm,
    Compute,
    Blocking,
    Async,
}

impl Mode {
    const ALL: [Mode; 4] = [Mode::Comm, Mode::Compute, Mode::Blocking, Mode::Async];

    fn name(self) -> &'static str {
        match self {
            Mode::Comm => "comm",
            Mode::Compute => "compute",
            Mode::Blocking => "blocking",
            Mode::Async => "async",
        }
    }
}

/// What a rank computes while the all-reduce may run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Work {
    /// `n` steps of a dependent floating-point chain.
    Cpu(u64),
    /// Sleeping this long.
    Idle(Duration),
}

impl Work {
    fn run(self) {
        match self {
            Work::Cpu(n) => {
                let mut acc = 1.0f64;
                for _ in 0..n {
                    acc = std::hint::black_box(acc * 1.000_000_1 + 1e-9);
                }
                std::hint::black_box(acc);
            }
            Work::Idle(t) => std::thread::sleep(t),
        }
    }
}

/// `ranks` thread ranks, each holding an all-reduce buffer of `bytes`, running `iters`
/// iterations of a mode on command (rank 0 answers with the total time).
struct Pool {
    ranks: ThreadRanks<(Mode, Work, u64)>,
    times: mpsc::Receiver<Duration>,
}

impl Pool {
    fn new(ranks: usize, bytes: usize) -> Pool {
        let (time_tx, times) = mpsc::channel();
        let ranks =
            ThreadRanks::<(Mode, Work, u64)>::new("overlap bench", ranks, move |comm, rx| {
                let rank = comm.rank();
                // Zeros: the sums stay zero, so no run meets infinities or subnormals.
                let mut buf = Some(vec![0.0f32; bytes / 4]);
                while let Ok((mode, work, iters)) = rx.recv() {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        comm.barrier()?;
                        let t0 = Instant::now();
                        match mode {
                            Mode::Comm => {
                                let b = buf.as_mut().expect("buffer");
                                comm.all_reduce_in_place(b, ReduceOp::Sum)?;
                            }
                            Mode::Compute => work.run(),
                            Mode::Blocking => {
                                let b = buf.as_mut().expect("buffer");
                                comm.all_reduce_in_place(b, ReduceOp::Sum)?;
                                work.run();
                            }
                            Mode::Async => {
                                let b = buf.take().expect("buffer");
                                let req = comm.start_all_reduce_vec(b, ReduceOp::Sum);
                                work.run();
                                buf = Some(req.wait()?);
                            }
                        }
                        comm.barrier()?;
                        total += t0.elapsed();
                    }
                    if rank == 0 {
                        time_tx.send(total).unwrap();
                    }
                }
                Ok::<_, Error>(())
            });
        Pool { ranks, times }
    }

    /// Total time of `iters` iterations of `mode`.
    fn run(&self, mode: Mode, work: Work, iters: u64) -> Duration {
        self.ranks.send(|| (mode, work, iters));
        self.times.recv().expect("bench ranks failed")
    }

    /// Median time of one iteration of `mode`, over `reps` runs after a warm-up.
    fn median(&self, mode: Mode, work: Work, reps: usize) -> Duration {
        self.run(mode, work, 1);
        median((0..reps).map(|_| self.run(mode, work, 1)).collect())
    }

    /// Median time of one iteration of each mode (in `Mode::ALL` order), from `reps`
    /// rounds that run every mode once: interleaved, so that load from elsewhere on the
    /// machine and drifting clocks weigh on every mode alike.
    fn interleaved(&self, work: Work, reps: usize) -> [Duration; 4] {
        interleaved_medians(reps, |i| self.run(Mode::ALL[i], work, 1))
    }
}

/// A `Work::Cpu` that takes about `target` on one thread with a core to itself (with more
/// ranks than cores, `compute` measures what it takes when they all compute at once).
fn calibrate_cpu(target: Duration) -> Work {
    const STEPS: u64 = 1 << 20;
    let best = (0..7)
        .map(|_| {
            let t0 = Instant::now();
            Work::Cpu(STEPS).run();
            t0.elapsed()
        })
        .min()
        .expect("runs");
    let steps = STEPS as f64 * target.as_secs_f64() / best.as_secs_f64().max(1e-9);
    Work::Cpu((steps as u64).max(1))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// `(blocking − async) / comm`, in percent.
fn hidden([comm, _, blocking, asynchronous]: [Duration; 4]) -> f64 {
    (blocking.as_secs_f64() - asynchronous.as_secs_f64()) / comm.as_secs_f64() * 100.0
}

fn overlap(c: &mut Criterion) {
    const REPS: usize = 21;
    for ranks in [2usize, 4] {
        for mib in [8usize, 64] {
            let pool = Pool::new(ranks, mib << 20);
            let t = pool.median(Mode::Comm, Work::Idle(Duration::ZERO), REPS) * 3 / 2;
            for (kind, work) in [("cpu", calibrate_cpu(t)), ("idle", Work::Idle(t))] {
                let mut group = support::group(
                    c,
                    format!("overlap/{ranks} ranks/{mib} MiB/{kind}"),
                    Duration::from_secs(1),
                );
                for mode in Mode::ALL {
                    group.bench_with_input(
                        BenchmarkId::from_parameter(mode.name()),
                        &mode,
                        |b, &m| b.iter_custom(|iters| pool.run(m, work, iters)),
                    );
                }
                group.finish();
                let median = pool.interleaved(work, REPS);
                let [comm, compute, blocking, asynchronous] = median;
                println!(
                    "overlap: ranks={ranks} MiB={mib} compute={kind} comm_ms={:.2} \
                     compute_ms={:.2} blocking_ms={:.2} async_ms={:.2} hidden={:.0}%",
                    ms(comm),
                    ms(compute),
                    ms(blocking),
                    ms(asynchronous),
                    hidden(median),
                );
            }
        }
    }
}

criterion_group!(benches, overlap);
criterion_main!(benches);
