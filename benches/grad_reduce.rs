//! How a parameter gradient that is `Partial` over `Dp` and `Cp` gets reduced, on 4 thread
//! ranks as a `[Dp=2, Cp=2]` mesh, for 256 KiB, 4 MiB and 32 MiB of f32 per rank (zeros,
//! so no sum meets infinities or subnormals). Each iteration (timed between two barriers
//! on the world, rank 0's clock) is one of
//!
//! - `per_axis`: an all-reduce over `Dp`, then one over `Cp` (what `nn` does: the `Cp`
//!   all-reduce is the adjoint of `to_replicate(Cp)`, the `Dp` one the data mode's);
//! - `flat`: one all-reduce over the flattened `Dp × Cp` group (a communicator split from
//!   the world: the ranks sharing every other coordinate, here all 4);
//! - `pair`: for reference, one 2-rank all-reduce (over `Dp` alone, both `Dp` groups at
//!   once).
//!
//! Criterion reports each variant's time with the gradient's size as throughput, beside a
//! single-thread memcpy of the same size. After each size a line per variant
//! `grad_reduce: bytes=… variant=… ranks=… time_us=… algbw_GBps=… busbw_GBps=…
//! memcpy_GBps=… ratio=… sent_B=… recv_B=… calls=…` follows `examples/bench_report.rs`:
//! algbw = bytes / time (median of rounds that run the three variants one after another);
//! busbw = algbw × 2·(n−1)/n with n = 4 for `per_axis` and `flat` (both reduce over the same
//! 4 ranks) and n = 2 for `pair`; `memcpy_GBps` is one thread copying `bytes`, measured in
//! the same run; ratio = algbw / memcpy. `sent_B`, `recv_B` and `calls` are what rank 0's
//! communicators counted for one iteration (`Communicator::counters()`, direct exchange
//! pattern). The machine these run on may be shared and have fewer cores than ranks: read
//! several runs.
//!
//! `cargo bench --bench grad_reduce` (under a minute).

mod support;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use dtensor::prelude::*;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use support::{group_with_memcpy, interleaved_medians, memcpy_gbps, Op, ThreadRanks};

const DP: usize = 2;
const CP: usize = 2;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    PerAxis,
    Flat,
    Pair,
}

impl Variant {
    const ALL: [Variant; 3] = [Variant::PerAxis, Variant::Flat, Variant::Pair];

    fn name(self) -> &'static str {
        match self {
            Variant::PerAxis => "per_axis",
            Variant::Flat => "flat",
            Variant::Pair => "pair",
        }
    }

    /// Ranks of the reduction, for the bus-bandwidth factor.
    fn ranks(self) -> usize {
        match self {
            Variant::PerAxis | Variant::Flat => DP * CP,
            Variant::Pair => DP,
        }
    }
}

/// One rank's communicators: the mesh's two axes and the flattened group.
struct Comms {
    world: Arc<dyn Communicator>,
    dp: Arc<dyn Communicator>,
    cp: Arc<dyn Communicator>,
    flat: Arc<dyn Communicator>,
}

impl Comms {
    /// Collective over `world`.
    fn new(world: Arc<dyn Communicator>) -> Result<Comms> {
        let mesh = DeviceMesh::new(
            world.clone(),
            Mesh::new(&[(AxisKind::Dp, DP), (AxisKind::Cp, CP)])?,
        )?;
        let dp = mesh.comm(AxisKind::Dp).expect("Dp axis").clone();
        let cp = mesh.comm(AxisKind::Cp).expect("Cp axis").clone();
        // Color: the coordinates on every other axis (none here); key: the rank inside the
        // Dp × Cp block, Dp outer.
        let flat = world.split(0, dp.rank() * CP + cp.rank())?;
        flat.set_label("dp×cp");
        Ok(Comms {
            world,
            dp,
            cp,
            flat,
        })
    }

    fn reduce(&self, v: Variant, buf: &mut [f32]) -> Result<()> {
        match v {
            Variant::PerAxis => {
                self.dp.all_reduce_in_place(buf, ReduceOp::Sum)?;
                self.cp.all_reduce_in_place(buf, ReduceOp::Sum)?;
            }
            Variant::Flat => self.flat.all_reduce_in_place(buf, ReduceOp::Sum)?,
            Variant::Pair => self.dp.all_reduce_in_place(buf, ReduceOp::Sum)?,
        }
        Ok(())
    }

    /// Sum of the three communicators' counters (the world's barriers are not counted).
    fn counters(&self) -> [u64; 3] {
        [&self.dp, &self.cp, &self.flat]
            .iter()
            .map(|c| c.counters())
            .fold([0; 3], |acc, s| {
                [
                    acc[0] + s.bytes_sent,
                    acc[1] + s.bytes_received,
                    acc[2] + s.collectives(),
                ]
            })
    }
}

enum Command {
    /// Run `iters` iterations of the variant; rank 0 answers with the total time.
    Run(Variant, u64),
    /// Run one iteration; rank 0 answers with its bytes sent, received and calls.
    Count(Variant),
}

/// 4 thread ranks, each holding a gradient of `bytes`, reducing it on command.
struct Pool {
    ranks: ThreadRanks<Command>,
    times: mpsc::Receiver<Duration>,
    counts: mpsc::Receiver<[u64; 3]>,
}

impl Pool {
    fn new(bytes: usize) -> Pool {
        let (time_tx, times) = mpsc::channel();
        let (count_tx, counts) = mpsc::channel();
        let ranks = ThreadRanks::new("grad_reduce bench", DP * CP, move |world, rx| {
            let rank = world.rank();
            let comms = Comms::new(world)?;
            let mut buf = vec![0.0f32; bytes / 4];
            while let Ok(cmd) = rx.recv() {
                match cmd {
                    Command::Run(v, iters) => {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            comms.world.barrier()?;
                            let t0 = Instant::now();
                            comms.reduce(v, &mut buf)?;
                            comms.world.barrier()?;
                            total += t0.elapsed();
                        }
                        if rank == 0 {
                            time_tx.send(total).unwrap();
                        }
                    }
                    Command::Count(v) => {
                        comms.world.barrier()?;
                        let before = comms.counters();
                        comms.reduce(v, &mut buf)?;
                        let after = comms.counters();
                        if rank == 0 {
                            count_tx
                                .send(std::array::from_fn(|i| after[i] - before[i]))
                                .unwrap();
                        }
                    }
                }
            }
            Ok::<_, Error>(())
        });
        Pool {
            ranks,
            times,
            counts,
        }
    }

    /// Total time of `iters` iterations of `v`.
    fn run(&self, v: Variant, iters: u64) -> Duration {
        self.ranks.send(|| Command::Run(v, iters));
        self.times.recv().expect("bench ranks failed")
    }

    /// Rank 0's bytes sent, received and calls in one iteration of `v`.
    fn count(&self, v: Variant) -> [u64; 3] {
        self.ranks.send(|| Command::Count(v));
        self.counts.recv().expect("bench ranks failed")
    }

    /// Median time of one iteration of each variant (in `Variant::ALL` order), from `reps`
    /// rounds that run every variant once, so that load from elsewhere weighs on all alike.
    fn interleaved(&self, reps: usize) -> [Duration; 3] {
        interleaved_medians(reps, |i| self.run(Variant::ALL[i], 1))
    }
}

fn size_name(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn grad_reduce(c: &mut Criterion) {
    for bytes in [256usize << 10, 4 << 20, 32 << 20] {
        let pool = Pool::new(bytes);
        let mut group = group_with_memcpy(
            c,
            format!("grad_reduce/dp2×cp2/{}", size_name(bytes)),
            bytes,
            Duration::from_secs(if bytes >= 32 << 20 { 4 } else { 1 }),
        );
        for v in Variant::ALL {
            group.bench_with_input(BenchmarkId::from_parameter(v.name()), &v, |b, &v| {
                b.iter_custom(|iters| pool.run(v, iters))
            });
        }
        group.finish();

        let memcpy = memcpy_gbps(bytes, 20);
        let medians = pool.interleaved(if bytes >= 32 << 20 { 9 } else { 25 });
        for (v, t) in Variant::ALL.into_iter().zip(medians) {
            let [sent, received, calls] = pool.count(v);
            let t = t.as_secs_f64();
            let algbw = bytes as f64 / t / 1e9;
            println!(
                "grad_reduce: bytes={bytes} variant={} ranks={} time_us={:.1} algbw_GBps={algbw:.2} \
                 busbw_GBps={:.2} memcpy_GBps={memcpy:.2} ratio={:.3} sent_B={sent} \
                 recv_B={received} calls={calls}",
                v.name(),
                v.ranks(),
                t * 1e6,
                algbw * Op::AllReduce.bus_factor(v.ranks()),
                algbw / memcpy,
            );
        }
    }
}

criterion_group!(benches, grad_reduce);
criterion_main!(benches);
