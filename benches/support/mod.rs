//! Shared by the criterion benches and `examples/bench_report.rs`: the redistribution
//! cases, one rank's timed part of a case ([`RankCase`], also run by `bench_report
//! --backend mpi` with one MPI process per rank), pools of rank threads that run commands
//! ([`ThreadRanks`], [`RankPool`]), medians of interleaved rounds, criterion groups with a
//! memcpy for scale, and the machine's single-thread memcpy bandwidth.
#![allow(dead_code)]

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};
use dtensor::prelude::*;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

/// One redistribution on a 1-D mesh of `ranks` thread ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// S(0) -> R
    AllGatherS0,
    /// S(last) -> R
    AllGatherSLast,
    /// P -> S(0)
    ReduceScatterS0,
    /// P -> I
    AllReduce,
    /// S(0) -> S(1)
    AllToAllS0S1,
    /// R -> S(0): a local slice
    ChunkS0,
}

impl Op {
    pub const ALL: [Op; 6] = [
        Op::AllGatherS0,
        Op::AllGatherSLast,
        Op::ReduceScatterS0,
        Op::AllReduce,
        Op::AllToAllS0S1,
        Op::ChunkS0,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::AllGatherS0 => "all_gather",
            Op::AllGatherSLast => "all_gather_last",
            Op::ReduceScatterS0 => "reduce_scatter",
            Op::AllReduce => "all_reduce",
            Op::AllToAllS0S1 => "all_to_all",
            Op::ChunkS0 => "chunk",
        }
    }

    /// Source placement and the step that runs.
    fn setup(self) -> (Placement, StepKind) {
        let sum = Placement::Partial(PartialOp::Sum);
        match self {
            Op::AllGatherS0 => (Placement::Shard(0), StepKind::AllGather { dim: 0 }),
            Op::AllGatherSLast => (Placement::Shard(1), StepKind::AllGather { dim: 1 }),
            Op::ReduceScatterS0 => (sum, StepKind::ReduceScatter { dim: 0 }),
            Op::AllReduce => (sum, StepKind::AllReduce),
            Op::AllToAllS0S1 => (Placement::Shard(0), StepKind::AllToAll { from: 0, to: 1 }),
            Op::ChunkS0 => (Placement::Replicate, StepKind::Chunk { dim: 0 }),
        }
    }

    /// nccl-tests' bus-bandwidth factor: busbw = algbw × factor.
    pub fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::ChunkS0 => 1.0,
            _ => (n - 1.0) / n,
        }
    }
}

/// Global shape for `bytes` of `dtype`: 1024 columns (so S(last) splits a row).
pub fn global_shape(bytes: usize, dtype: DType) -> [usize; 2] {
    let numel = bytes / dtype.size_in_bytes();
    [numel / 1024, 1024]
}

/// One rank's part of one case: its input on a 1-D `[Tp]` mesh of every rank, timed
/// between two barriers on the mesh's world. Shared by the thread pool below and by
/// `bench_report --backend mpi`, where each MPI process is one rank.
pub struct RankCase {
    mesh: Arc<DeviceMesh>,
    op: Op,
    src: Placement,
    shape: [usize; 2],
    local: Tensor,
    kind: StepKind,
}

impl RankCase {
    /// Collective over `mesh`: every rank builds its local input of `op` for `bytes` in
    /// total.
    pub fn new(mesh: &Arc<DeviceMesh>, op: Op, bytes: usize, dtype: DType) -> Result<RankCase> {
        let (src, kind) = op.setup();
        let shape = global_shape(bytes, dtype);
        let local_shape =
            dtensor_placement::local_shape(mesh.mesh(), &[src], mesh.coords(), &shape)?;
        let local = Tensor::from_fn(&local_shape, |i| (i % 251) as f32 * 0.5).to_dtype(dtype);
        Ok(RankCase {
            mesh: mesh.clone(),
            op,
            src,
            shape,
            local,
            kind,
        })
    }

    /// This run's input, made outside the timed span. It owns its buffer, as a tensor fresh
    /// from the previous step would (a shallow clone of a kept input would make in-place
    /// collectives copy first). An S(0) shard lives at its place in a full-size buffer, as
    /// it does after `chunk` or a reduce-scatter, so the all-gather need not move it.
    fn fresh_input(&self) -> Result<AnyDTensor> {
        let own = if self.op == Op::AllGatherS0 {
            let mut full = Tensor::for_overwrite(&self.shape, self.local.dtype());
            let n = self.mesh.mesh().size(0);
            let start =
                dtensor_placement::chunk_range(self.shape[0], n, self.mesh.coords()[0]).start;
            full.write_at(0, start, &self.local)?;
            full.narrow(0, start, self.local.shape()[0])?
        } else {
            self.local.deep_clone()
        };
        AnyDTensor::from_local(own, &self.shape, &[self.src], &self.mesh)
    }

    /// Collective: this rank's total time of `iters` runs, each between two barriers
    /// (inputs made outside the timed span).
    pub fn run(&self, iters: u64) -> Result<Duration> {
        let world = self.mesh.world();
        let mut total = Duration::ZERO;
        for _ in 0..iters {
            let x = self.fresh_input()?;
            world.barrier()?;
            let t0 = Instant::now();
            let y = x.apply(0, self.kind)?;
            world.barrier()?;
            total += t0.elapsed();
            drop(y);
        }
        Ok(total)
    }
}

/// The 1-D mesh the cases run on: every rank of `world` on one `Tp` axis.
pub fn bench_mesh(world: Arc<dyn Communicator>) -> Result<Arc<DeviceMesh>> {
    let ranks = world.size();
    DeviceMesh::new(world, Mesh::new(&[(AxisKind::Tp, ranks)])?)
}

/// `ranks` thread ranks on the threads backend, each running `rank` with its world and the
/// commands sent to it (its loop ends when the pool is dropped, which closes the channels
/// and joins the ranks). A rank's error goes to stderr after `name`.
pub struct ThreadRanks<C> {
    senders: Vec<mpsc::Sender<C>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl<C: Send + 'static> ThreadRanks<C> {
    pub fn new<E, F>(name: &'static str, ranks: usize, rank: F) -> ThreadRanks<C>
    where
        E: Send + std::fmt::Display,
        F: Fn(Arc<dyn Communicator>, &mpsc::Receiver<C>) -> std::result::Result<(), E>
            + Send
            + Sync
            + 'static,
    {
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..ranks).map(|_| mpsc::channel()).unzip();
        let receivers: Vec<_> = receivers.into_iter().map(Mutex::new).collect();
        let handle = std::thread::spawn(move || {
            let results = threads::launch(ranks, |world| {
                let rx = receivers[world.rank()].lock().unwrap();
                rank(world, &rx)
            });
            for (r, res) in results.into_iter().enumerate() {
                if let Err(e) = res {
                    eprintln!("{name} rank {r}: {e}");
                }
            }
        });
        ThreadRanks {
            senders,
            handle: Some(handle),
        }
    }

    /// Sends every rank a `cmd()`.
    pub fn send(&self, cmd: impl Fn() -> C) {
        for s in &self.senders {
            s.send(cmd()).unwrap();
        }
    }
}

impl<C> Drop for ThreadRanks<C> {
    fn drop(&mut self) {
        self.senders.clear();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// `ranks` thread ranks holding one case's input, timing it on command.
pub struct RankPool {
    ranks: ThreadRanks<u64>,
    times: mpsc::Receiver<Duration>,
}

impl RankPool {
    pub fn new(op: Op, ranks: usize, bytes: usize, dtype: DType) -> RankPool {
        let (time_tx, times) = mpsc::channel();
        let ranks = ThreadRanks::new("bench", ranks, move |world, rx| -> Result<(), Error> {
            let rank = world.rank();
            let case = RankCase::new(&bench_mesh(world)?, op, bytes, dtype)?;
            while let Ok(iters) = rx.recv() {
                let total = case.run(iters)?;
                if rank == 0 {
                    time_tx.send(total).unwrap();
                }
            }
            Ok(())
        });
        RankPool { ranks, times }
    }

    /// Total time of `iters` runs (timed between two barriers, inputs cloned outside).
    pub fn run(&self, iters: u64) -> Duration {
        self.ranks.send(|| iters);
        self.times.recv().expect("bench ranks failed")
    }
}

/// The median of `v` (the upper one of an even count).
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// The median time of each of `N` variants over `reps` rounds that run every variant
/// once, `run(i)` timing variant `i`: interleaved, so that load from elsewhere on the
/// machine and drifting clocks weigh on every variant alike.
pub fn interleaved_medians<const N: usize>(
    reps: usize,
    mut run: impl FnMut(usize) -> Duration,
) -> [Duration; N] {
    let mut t: [Vec<Duration>; N] = std::array::from_fn(|_| Vec::with_capacity(reps));
    for _ in 0..reps {
        for (i, ti) in t.iter_mut().enumerate() {
            ti.push(run(i));
        }
    }
    t.map(median)
}

/// A criterion group of 10 samples after a 300 ms warm-up, each measured for `measure`.
pub fn group<'a>(
    c: &'a mut Criterion,
    name: String,
    measure: Duration,
) -> BenchmarkGroup<'a, WallTime> {
    let mut group = c.benchmark_group(name);
    group.sample_size(10);
    group.warm_up_time(Duration::from_millis(300));
    group.measurement_time(measure);
    group
}

/// A [`group`] of `bytes` an iteration (its throughput), beginning with a single-thread
/// memcpy of `bytes` for scale.
pub fn group_with_memcpy<'a>(
    c: &'a mut Criterion,
    name: String,
    bytes: usize,
    measure: Duration,
) -> BenchmarkGroup<'a, WallTime> {
    let mut group = group(c, name, measure);
    group.throughput(Throughput::Bytes(bytes as u64));
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    group.bench_function("memcpy", |b| {
        b.iter(|| {
            dst.copy_from_slice(&src);
            std::hint::black_box(&dst);
        })
    });
    group
}

/// GB/s of `threads` threads together copying `bytes` between two warm buffers, each its
/// own `1/threads` share at the same time (best of `reps`): what the machine's memory
/// gives ranks that copy concurrently, the real ceiling of a shared-memory collective.
pub fn parallel_memcpy_gbps(bytes: usize, threads: usize, reps: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let share = bytes.div_ceil(threads.max(1));
    let mut best = Duration::MAX;
    for _ in 0..reps.max(1) {
        // The copying threads start together at a barrier and time themselves: the span
        // from the first start to the last end (the spawning thread may not even get a
        // core while they run).
        let barrier = std::sync::Barrier::new(threads);
        let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
            let handles: Vec<_> = dst
                .chunks_mut(share)
                .zip(src.chunks(share))
                .map(|(d, s_)| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        let t0 = Instant::now();
                        d.copy_from_slice(s_);
                        (t0, Instant::now())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let start = spans.iter().map(|s| s.0).min().unwrap();
        let end = spans.iter().map(|s| s.1).max().unwrap();
        best = best.min(end - start);
        std::hint::black_box(&dst);
    }
    bytes as f64 / best.as_secs_f64() / 1e9
}

/// GB/s of one thread copying `bytes` between two warm buffers (best of `reps`).
pub fn memcpy_gbps(bytes: usize, reps: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut best = Duration::MAX;
    for _ in 0..reps.max(1) {
        let t0 = Instant::now();
        dst.copy_from_slice(&src);
        best = best.min(t0.elapsed());
        std::hint::black_box(&dst);
    }
    bytes as f64 / best.as_secs_f64() / 1e9
}
