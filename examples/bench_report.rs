//! One line per redistribution case, readable in a minute:
//!
//! `op=all_gather ranks=2 bytes=16777216 dtype=f32 time_us=… algbw_GBps=… busbw_GBps=… memcpy_GBps=… ratio=… backend=threads`
//!
//! `bytes` is the total (gathered / reduced) size; algbw = bytes / time; busbw follows
//! nccl-tests (× (n−1)/n for all-gather, reduce-scatter and all-to-all, × 2(n−1)/n for
//! all-reduce, × 1 for the local chunk); `memcpy_GBps` is one thread copying `bytes`
//! between warm buffers, measured in the same run; ratio = algbw / memcpy_GBps. Times are
//! the median of several runs, each between two barriers.
//!
//! `cargo run --release --example bench_report [-- --quick] [--sizes 1M,16M] [--no-gemm]`
//!
//! `scripts/bench-guard.sh` runs this and compares every line's ratio with a committed
//! baseline (see the README, "Benchmarks").
//!
//! With `--backend mpi` (build with `--features mpi`) each process `mpirun` starts is one
//! rank: `mpirun -np 2 target/release/examples/bench_report --backend mpi [--quick]`. The
//! world is the 1-D mesh, so only the cases with `ranks` = the world size run (run again
//! under `-np 4` for the others); rank 0 times them between barriers (rank 0's time, the
//! median of several runs, as above), measures memcpy in its own process, and prints the
//! same lines with `backend=mpi`. The gemm lines are printed by the threads backend only.
//!
//! With `--backend nccl` (build with `--features nccl`) the ranks are threads of this
//! process, each on a GPU (`nccl::launch`: rank `r` on GPU `r % device_count`; a world
//! with more ranks than GPUs runs only when `NCCL_MULTI_RANK_GPU_ENABLE=1` allows ranks
//! to share one), for 2 and 4 ranks. Each case is the backend's device collective alone,
//! on warm device buffers (the placement layer does not run on device tensors yet, so no
//! pack/unpack kernel is timed): `all_gather` (`all_gather_device`), `reduce_scatter`,
//! `all_reduce` (sum), `all_to_all` (`all_to_all_device` of the rank's `bytes/n`) and
//! `chunk` (a device-to-device copy of the rank's `bytes/n`); `all_gather_last` needs a
//! device column-block all-gather, which does not exist yet, and is reported as not run.
//! Every NCCL call returns only once its data has moved, and each timed run sits between
//! two barriers, so the clock stops after the work is done; a run's time is its slowest
//! rank's, and a line shows the median over runs. `memcpy_GBps` is a
//! device-to-device copy (`cuMemcpyDtoD` through cudarc) of `bytes` on GPU 0, measured in
//! the same run with the stream synchronized before the clock stops; lines say
//! `backend=nccl`.

#[path = "../benches/support/mod.rs"]
mod support;

#[path = "../benches/support/gemm_cases.rs"]
mod gemm_cases;

use dtensor::collectives::mpi as mpi_backend;
use dtensor::prelude::*;
use std::process::ExitCode;
use std::time::{Duration, Instant};
use support::{bench_mesh, memcpy_gbps, parallel_memcpy_gbps, Op, RankCase, RankPool};

const USAGE: &str = "\
usage: bench_report [--quick] [--sizes LIST] [--no-gemm] [--backend threads|mpi|nccl]

  --quick              fewer sizes and repetitions
  --sizes <list>       the total sizes to measure, comma-separated bytes with an
                       optional K, M or G suffix (binary), e.g. 1M,16M,128M (default
                       1M,16M,128M; 1M,16M with --quick)
  --no-gemm            leave out the gemm lines (threads backend)
  --backend <b>        threads (default): ranks are threads of this process, 2 and 4 ranks,
                       plus the gemm lines; mpi: each process started by
                       `mpirun -np N` is one rank and the cases with ranks=N run
                       (needs a build with `--features mpi`); nccl: ranks are
                       threads of this process, each on a GPU, 2 and 4 ranks (needs a
                       build with `--features nccl`, CUDA GPUs and libnccl; ranks share
                       a GPU only with NCCL_MULTI_RANK_GPU_ENABLE=1)
  --help               this text";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Threads,
    Mpi,
    Nccl,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Threads => "threads",
            Backend::Mpi => "mpi",
            Backend::Nccl => "nccl",
        }
    }
}

/// The rank counts every backend's table covers.
const RANKS: [usize; 2] = [2, 4];

/// Median seconds of `reps` runs of `f`, after one warm-up run.
fn median_secs(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[reps / 2]
}

/// The sizes measured when `--sizes` is not given.
fn default_sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![1 << 20, 16 << 20]
    } else {
        vec![1 << 20, 16 << 20, 128 << 20]
    }
}

/// `1M,16M,4096`: bytes, with an optional binary K / M / G suffix.
fn parse_sizes(list: &str) -> Result<Vec<usize>, String> {
    list.split(',')
        .map(|item| {
            let item = item.trim();
            let (digits, shift) = match item.char_indices().last() {
                Some((i, 'K' | 'k')) => (&item[..i], 10),
                Some((i, 'M' | 'm')) => (&item[..i], 20),
                Some((i, 'G' | 'g')) => (&item[..i], 30),
                _ => (item, 0),
            };
            let n: usize = digits
                .parse()
                .map_err(|_| format!("--sizes: `{item}` is not a size like 4096, 64K or 16M"))?;
            n.checked_mul(1 << shift)
                .filter(|&b| b > 0)
                .ok_or_else(|| format!("--sizes: `{item}` is zero or too large"))
        })
        .collect()
}

fn memcpy_reps(bytes: usize) -> usize {
    if bytes >= 128 << 20 {
        5
    } else {
        20
    }
}

/// Timed runs per case (after one warm-up run).
fn case_reps(bytes: usize) -> usize {
    if bytes >= 128 << 20 {
        3
    } else if bytes >= 16 << 20 {
        7
    } else {
        25
    }
}

/// Prints one case's line from its run times.
fn report(
    op: Op,
    ranks: usize,
    bytes: usize,
    dtype: DType,
    mut times: Vec<Duration>,
    memcpy: f64,
    backend: Backend,
) {
    times.sort();
    let t = times[times.len() / 2].as_secs_f64();
    let algbw = bytes as f64 / t / 1e9;
    println!(
        "op={} ranks={ranks} bytes={bytes} dtype={dtype} time_us={:.1} algbw_GBps={algbw:.2} busbw_GBps={:.2} memcpy_GBps={memcpy:.2} ratio={:.2} backend={}",
        op.name(),
        t * 1e6,
        algbw * op.bus_factor(ranks),
        algbw / memcpy,
        backend.name()
    );
}

/// gemm: our wrapper vs the gemm crate directly (threads backend only).
fn gemm_lines(quick: bool) {
    // gemm: our wrapper vs the gemm crate directly, single-threaded f32. One untimed pass
    // over every case first lets the clock and gemm's packing buffers settle.
    for (_, m, n, k, ta, tb) in gemm_cases::CASES {
        let mut case = gemm_cases::GemmCase::new(m, n, k, ta, tb);
        case.run_ours();
        case.run_direct();
    }
    for (name, m, n, k, ta, tb) in gemm_cases::CASES {
        let mut case = gemm_cases::GemmCase::new(m, n, k, ta, tb);
        let reps = if quick { 3 } else { 5 };
        // Interleaved, so drifting clocks and caches hit both alike.
        let (mut ours, mut direct) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            ours.push(median_secs(1, || case.run_ours()));
            direct.push(median_secs(1, || case.run_direct()));
        }
        ours.sort_by(f64::total_cmp);
        direct.sort_by(f64::total_cmp);
        let (ours, direct) = (ours[reps / 2], direct[reps / 2]);
        let gflops = |t: f64| case.flops() as f64 / t / 1e9;
        println!(
            "op=gemm shape={} dtype=f32 ours_GFLOPs={:.1} direct_GFLOPs={:.1} ratio={:.3}",
            name.split(' ').next().unwrap(),
            gflops(ours),
            gflops(direct),
            direct / ours
        );
    }
}

fn threads_cases(sizes: &[usize]) {
    for &bytes in sizes {
        let memcpy = memcpy_gbps(bytes, memcpy_reps(bytes));
        // The ceiling of ranks copying at once: on some machines two cores together copy
        // no faster than one, which bounds every collective's ratio below.
        for threads in RANKS {
            let par = parallel_memcpy_gbps(bytes, threads, memcpy_reps(bytes));
            println!(
                "op=memcpy_parallel threads={threads} bytes={bytes} GBps={par:.2} memcpy_GBps={memcpy:.2} ratio={:.2}",
                par / memcpy
            );
        }
        for dtype in [DType::F32, DType::BF16] {
            for ranks in RANKS {
                for op in Op::ALL {
                    let pool = RankPool::new(op, ranks, bytes, dtype);
                    pool.run(1); // warm up: first touches fill the per-rank buffer pools
                    let times = (0..case_reps(bytes)).map(|_| pool.run(1)).collect();
                    report(op, ranks, bytes, dtype, times, memcpy, Backend::Threads);
                }
            }
        }
    }
}

/// One MPI process's part: the same cases on the world as the 1-D mesh, rank 0 printing.
fn mpi_cases(world: std::sync::Arc<dyn Communicator>, sizes: &[usize]) -> Result<(), Error> {
    let ranks = world.size();
    let rank = world.rank();
    if rank == 0 {
        let skipped: Vec<String> = RANKS
            .iter()
            .filter(|&&r| r != ranks)
            .map(|r| format!("ranks={r} (`mpirun -np {r}`)"))
            .collect();
        let running = if RANKS.contains(&ranks) {
            format!("running the ranks={ranks} cases")
        } else {
            format!("no case has ranks={ranks}")
        };
        println!(
            "bench_report: backend=mpi on a world of {ranks} ranks: {running}, skipping {}",
            skipped.join(", ")
        );
    }
    if !RANKS.contains(&ranks) {
        return Ok(());
    }
    let mesh = bench_mesh(world)?;
    for &bytes in sizes {
        // Every process measures its own memcpy (at the same time, as the ranks would
        // share the memory system); rank 0 reports its own.
        let memcpy = memcpy_gbps(bytes, memcpy_reps(bytes));
        for dtype in [DType::F32, DType::BF16] {
            for op in Op::ALL {
                let case = RankCase::new(&mesh, op, bytes, dtype)?;
                case.run(1)?; // warm up
                let times = (0..case_reps(bytes))
                    .map(|_| case.run(1))
                    .collect::<Result<Vec<_>, _>>()?;
                if rank == 0 {
                    report(op, ranks, bytes, dtype, times, memcpy, Backend::Mpi);
                }
            }
        }
    }
    Ok(())
}

/// What the command line asks for.
struct Args {
    quick: bool,
    sizes: Vec<usize>,
    gemm: bool,
    backend: Backend,
}

fn parse_args() -> Result<Option<Args>, String> {
    let (mut quick, mut backend) = (false, Backend::Threads);
    let (mut sizes, mut gemm) = (None, true);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--quick" => quick = true,
            "--no-gemm" => gemm = false,
            "--sizes" => {
                let list = it.next().ok_or("--sizes needs a list, e.g. 1M,16M")?;
                sizes = Some(parse_sizes(&list)?);
            }
            "--backend" => {
                backend = match it.next().as_deref() {
                    Some("threads") => Backend::Threads,
                    Some("mpi") => Backend::Mpi,
                    Some("nccl") => Backend::Nccl,
                    Some(other) => {
                        return Err(format!("--backend: `{other}` is not threads, mpi or nccl"))
                    }
                    None => return Err("--backend needs a value: threads, mpi or nccl".into()),
                }
            }
            "--help" | "-h" => return Ok(None),
            other => return Err(format!("unknown flag `{other}` (see --help)")),
        }
    }
    Ok(Some(Args {
        sizes: sizes.unwrap_or_else(|| default_sizes(quick)),
        quick,
        gemm,
        backend,
    }))
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    let (quick, sizes) = (args.quick, &args.sizes[..]);
    match args.backend {
        Backend::Threads => {
            if args.gemm {
                gemm_lines(quick);
            }
            threads_cases(sizes);
        }
        Backend::Mpi => {
            if !cfg!(feature = "mpi") {
                eprintln!(
                    "error: --backend mpi: this bench_report was built without the `mpi` feature; rebuild with `cargo build --release --example bench_report --features mpi` (needs OpenMPI and libclang)"
                );
                return ExitCode::from(2);
            }
            if !mpi_backend::launched_by_mpirun() {
                eprintln!(
                    "error: --backend mpi: not started by mpirun, so there is one rank and no case to run. {}",
                    mpi_backend::LAUNCH_HINT
                );
                return ExitCode::from(2);
            }
            mpi_backend::run(|world| mpi_cases(world, sizes));
        }
        Backend::Nccl => {
            if !cfg!(feature = "nccl") {
                eprintln!(
                    "error: --backend nccl: this bench_report was built without the `nccl` feature; rebuild with `cargo build --release --example bench_report --features nccl` (needs CUDA GPUs and libnccl at run time)"
                );
                return ExitCode::from(2);
            }
            #[cfg(feature = "nccl")]
            if let Err(e) = nccl_bench::cases(sizes) {
                eprintln!("error: --backend nccl: {e}");
                return ExitCode::from(1);
            }
        }
    }
    ExitCode::SUCCESS
}

/// `--backend nccl`: the device collectives on thread ranks, one per GPU.
#[cfg(feature = "nccl")]
mod nccl_bench {
    use super::{case_reps, memcpy_reps, report, Backend, Op, RANKS};
    use dtensor::collectives::nccl::{self, NcclComm, MULTI_RANK_GPU_ENV};
    use dtensor::kernels::cuda::{self, CudaTensor, Device, DeviceView, DeviceViewMut};
    use dtensor::prelude::{Communicator, DType, ReduceOp, Tensor};
    use std::time::{Duration, Instant};

    type BoxError = Box<dyn std::error::Error + Send + Sync>;

    /// Copies `src` into `dst` (same dtype and length) on `dev`'s stream; returns once
    /// queued.
    fn dtod(
        dev: &Device,
        src: &DeviceView<'_>,
        dst: &mut DeviceViewMut<'_>,
    ) -> Result<(), BoxError> {
        if src.len() != dst.len() || src.dtype() != dst.dtype() {
            return Err(format!(
                "device copy of {} x {} into {} x {}",
                src.dtype(),
                src.len(),
                dst.dtype(),
                dst.len()
            )
            .into());
        }
        let st = dev.stream();
        match (src, dst) {
            (DeviceView::F32(s), DeviceViewMut::F32(d)) => st.memcpy_dtod(s, d),
            (DeviceView::F64(s), DeviceViewMut::F64(d)) => st.memcpy_dtod(s, d),
            (DeviceView::BF16(s), DeviceViewMut::BF16(d)) => st.memcpy_dtod(s, d),
            (DeviceView::F16(s), DeviceViewMut::F16(d)) => st.memcpy_dtod(s, d),
            (DeviceView::I32(s), DeviceViewMut::I32(d)) => st.memcpy_dtod(s, d),
            (DeviceView::I64(s), DeviceViewMut::I64(d)) => st.memcpy_dtod(s, d),
            _ => unreachable!("dtypes checked above"),
        }
        .map_err(|e| format!("cuMemcpyDtoDAsync: {e}").into())
    }

    /// GB/s of a device-to-device copy of `bytes` on GPU 0 (best of `reps` batches; each
    /// batch of copies is timed from a synchronized stream to a synchronized stream).
    fn dtod_gbps(dev: &Device, bytes: usize, reps: usize) -> Result<f64, BoxError> {
        let n = bytes / 4;
        let src = CudaTensor::zeros(dev, &[n], DType::F32)?;
        let mut dst = CudaTensor::zeros(dev, &[n], DType::F32)?;
        let (s, mut d) = (src.view()?, dst.view_mut()?);
        // Enough copies per batch that the two synchronizations do not dominate.
        let batch = ((256usize << 20) / bytes.max(1)).clamp(1, 64);
        dtod(dev, &s, &mut d)?; // warm up
        dev.synchronize()?;
        let mut best = f64::INFINITY;
        for _ in 0..reps.max(1) {
            dev.synchronize()?;
            let t0 = Instant::now();
            for _ in 0..batch {
                dtod(dev, &s, &mut d)?;
            }
            dev.synchronize()?;
            best = best.min(t0.elapsed().as_secs_f64() / batch as f64);
        }
        Ok(bytes as f64 / best / 1e9)
    }

    /// One case's buffers on one rank, allocated once (warm, as a training step's are).
    struct Case {
        op: Op,
        send: CudaTensor,
        recv: CudaTensor,
    }

    impl Case {
        fn new(comm: &NcclComm, op: Op, bytes: usize, dtype: DType) -> Result<Case, BoxError> {
            let numel = bytes / dtype.size_in_bytes();
            let local = numel / comm.size();
            let dev = comm.device();
            let host =
                |len: usize| Tensor::from_fn(&[len], |i| (i % 251) as f32 * 0.5).to_dtype(dtype);
            let (send, recv) = match op {
                Op::AllGatherS0 => (local, numel),
                Op::ReduceScatterS0 => (numel, local),
                Op::AllReduce => (numel, 0),
                Op::AllToAllS0S1 | Op::ChunkS0 => (local, local),
                Op::AllGatherSLast => return Err("no device column-block all-gather".into()),
            };
            Ok(Case {
                op,
                send: host(send).to_device(dev)?.cuda_tensor()?,
                recv: CudaTensor::zeros(dev, &[recv], dtype)?,
            })
        }

        /// One run of the case (returns once its data has moved).
        fn run(&mut self, comm: &NcclComm) -> Result<(), BoxError> {
            match self.op {
                Op::AllGatherS0 => {
                    comm.all_gather_device(self.send.view()?, self.recv.view_mut()?)?
                }
                Op::ReduceScatterS0 => comm.reduce_scatter_device(
                    self.send.view()?,
                    self.recv.view_mut()?,
                    ReduceOp::Sum,
                )?,
                Op::AllReduce => comm.all_reduce_device(self.send.view_mut()?, ReduceOp::Sum)?,
                Op::AllToAllS0S1 => {
                    comm.all_to_all_device(self.send.view()?, self.recv.view_mut()?)?
                }
                Op::ChunkS0 => {
                    let dev = comm.device();
                    dtod(dev, &self.send.view()?, &mut self.recv.view_mut()?)?;
                    dev.synchronize()?;
                }
                Op::AllGatherSLast => unreachable!("never built"),
            }
            Ok(())
        }
    }

    /// Every rank's `v`, one after another (through the device: NCCL moves nothing else).
    fn gather_f64(comm: &NcclComm, v: &[f64]) -> Result<Vec<f64>, BoxError> {
        let dev = comm.device();
        let send = Tensor::from_vec(v.to_vec(), &[v.len()])?
            .to_device(dev)?
            .cuda_tensor()?;
        let mut recv = CudaTensor::zeros(dev, &[v.len() * comm.size()], DType::F64)?;
        comm.all_gather_device(send.view()?, recv.view_mut()?)?;
        Ok(recv.to_host()?.as_slice::<f64>()?.to_vec())
    }

    /// One rank's part of a world: every case, each run between two barriers; rank 0
    /// prints the lines.
    fn rank_cases(comm: &NcclComm, sizes: &[usize], memcpy: &[f64]) -> Result<(), BoxError> {
        let n = comm.size();
        for (&bytes, &memcpy) in sizes.iter().zip(memcpy) {
            for dtype in [DType::F32, DType::BF16] {
                for op in Op::ALL {
                    if op == Op::AllGatherSLast {
                        continue;
                    }
                    let mut case = Case::new(comm, op, bytes, dtype)?;
                    comm.barrier()?;
                    case.run(comm)?; // warm up
                    let mut times = Vec::new();
                    for _ in 0..case_reps(bytes) {
                        comm.barrier()?;
                        let t0 = Instant::now();
                        case.run(comm)?;
                        comm.barrier()?;
                        times.push(t0.elapsed());
                    }
                    // Every rank's slowest run decides a collective's time: rank 0 reports
                    // the per-run maximum over ranks.
                    let secs: Vec<f64> = times.iter().map(Duration::as_secs_f64).collect();
                    let all = gather_f64(comm, &secs)?;
                    let worst: Vec<Duration> = (0..secs.len())
                        .map(|i| {
                            let t = (0..n).map(|p| all[p * secs.len() + i]).fold(0.0, f64::max);
                            Duration::from_secs_f64(t)
                        })
                        .collect();
                    if comm.rank() == 0 {
                        report(op, n, bytes, dtype, worst, memcpy, Backend::Nccl);
                    }
                }
            }
        }
        Ok(())
    }

    /// Every world size the GPUs allow, after the device copy bandwidth.
    pub fn cases(sizes: &[usize]) -> Result<(), BoxError> {
        nccl::require_library()?;
        let gpus = cuda::device_count()?;
        if gpus == 0 {
            return Err("no CUDA device found".into());
        }
        let dev = Device::new(0)?;
        let memcpy: Vec<f64> = sizes
            .iter()
            .map(|&b| dtod_gbps(&dev, b, memcpy_reps(b)))
            .collect::<Result<_, _>>()?;
        drop(dev);
        let shared = std::env::var(MULTI_RANK_GPU_ENV).as_deref() == Ok("1");
        println!(
            "bench_report: backend=nccl, {gpus} GPU(s); op=all_gather_last not measured (no device column-block all-gather yet); memcpy_GBps is a device-to-device copy on GPU 0"
        );
        let mut ran = 0;
        for n in RANKS {
            if n > gpus && !shared {
                println!(
                    "bench_report: backend=nccl: skipping ranks={n}: {gpus} GPU(s) and {MULTI_RANK_GPU_ENV} is not 1 (ranks may share a GPU only when it is)"
                );
                continue;
            }
            let results = nccl::launch(n, |comm| rank_cases(&comm, sizes, &memcpy));
            for (r, res) in results.into_iter().enumerate() {
                res.map_err(|e| format!("ranks={n}, rank {r}: {e}"))?;
            }
            ran += 1;
        }
        if ran == 0 {
            return Err(format!(
                "no world size runs on {gpus} GPU(s) without {MULTI_RANK_GPU_ENV}=1"
            )
            .into());
        }
        Ok(())
    }
}
