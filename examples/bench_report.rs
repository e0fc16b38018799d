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
//! `cargo run --release --example bench_report [-- --quick]`
//!
//! With `--backend mpi` (build with `--features mpi`) each process `mpirun` starts is one
//! rank: `mpirun -np 2 target/release/examples/bench_report --backend mpi [--quick]`. The
//! world is the 1-D mesh, so only the cases with `ranks` = the world size run (run again
//! under `-np 4` for the others); rank 0 times them between barriers (rank 0's time, the
//! median of several runs, as above), measures memcpy in its own process, and prints the
//! same lines with `backend=mpi`. The gemm lines are printed by the threads backend only.

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
usage: bench_report [--quick] [--backend threads|mpi]

  --quick              fewer sizes and repetitions
  --backend <b>        threads (default): ranks are threads of this process, 2 and 4 ranks,
                       plus the gemm lines; mpi: each process started by
                       `mpirun -np N` is one rank and the cases with ranks=N run
                       (needs a build with `--features mpi`)
  --help               this text";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Backend {
    Threads,
    Mpi,
}

impl Backend {
    fn name(self) -> &'static str {
        match self {
            Backend::Threads => "threads",
            Backend::Mpi => "mpi",
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

fn sizes(quick: bool) -> &'static [usize] {
    if quick {
        &[1 << 20, 16 << 20]
    } else {
        &[1 << 20, 16 << 20, 128 << 20]
    }
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

fn threads_cases(quick: bool) {
    for &bytes in sizes(quick) {
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
fn mpi_cases(world: std::sync::Arc<dyn Communicator>, quick: bool) -> Result<(), Error> {
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
    for &bytes in sizes(quick) {
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

fn parse_args() -> Result<Option<(bool, Backend)>, String> {
    let (mut quick, mut backend) = (false, Backend::Threads);
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--quick" => quick = true,
            "--backend" => {
                backend = match it.next().as_deref() {
                    Some("threads") => Backend::Threads,
                    Some("mpi") => Backend::Mpi,
                    Some(other) => {
                        return Err(format!("--backend: `{other}` is not threads or mpi"))
                    }
                    None => return Err("--backend needs a value: threads or mpi".into()),
                }
            }
            "--help" | "-h" => return Ok(None),
            other => return Err(format!("unknown flag `{other}` (see --help)")),
        }
    }
    Ok(Some((quick, backend)))
}

fn main() -> ExitCode {
    let (quick, backend) = match parse_args() {
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
    match backend {
        Backend::Threads => {
            gemm_lines(quick);
            threads_cases(quick);
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
            mpi_backend::run(|world| mpi_cases(world, quick));
        }
    }
    ExitCode::SUCCESS
}
