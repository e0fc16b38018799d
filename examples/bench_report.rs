//! One line per redistribution case, readable in a minute:
//!
//! `op=all_gather ranks=2 bytes=16777216 dtype=f32 time_us=… algbw_GBps=… busbw_GBps=… memcpy_GBps=… ratio=…`
//!
//! `bytes` is the total (gathered / reduced) size; algbw = bytes / time; busbw follows
//! nccl-tests (× (n−1)/n for all-gather, reduce-scatter and all-to-all, × 2(n−1)/n for
//! all-reduce, × 1 for the local chunk); `memcpy_GBps` is one thread copying `bytes`
//! between warm buffers, measured in the same run; ratio = algbw / memcpy_GBps. Times are
//! the median of several runs, each between two barriers.
//!
//! `cargo run --release --example bench_report [-- --quick]`

#[path = "../benches/support/mod.rs"]
mod support;

#[path = "../benches/support/gemm_cases.rs"]
mod gemm_cases;

use dtensor::prelude::DType;
use std::time::{Duration, Instant};
use support::{memcpy_gbps, Op, RankPool};

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

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
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
    let sizes: &[usize] = if quick {
        &[1 << 20, 16 << 20]
    } else {
        &[1 << 20, 16 << 20, 128 << 20]
    };
    for &bytes in sizes {
        let memcpy = memcpy_gbps(bytes, if bytes >= 128 << 20 { 5 } else { 20 });
        for dtype in [DType::F32, DType::BF16] {
            for ranks in [2, 4] {
                for op in Op::ALL {
                    let pool = RankPool::new(op, ranks, bytes, dtype);
                    let reps = if bytes >= 128 << 20 {
                        3
                    } else if bytes >= 16 << 20 {
                        7
                    } else {
                        25
                    };
                    pool.run(1); // warm up: first touches fill the per-rank buffer pools
                    let mut times: Vec<Duration> = (0..reps).map(|_| pool.run(1)).collect();
                    times.sort();
                    let t = times[reps / 2].as_secs_f64();
                    let algbw = bytes as f64 / t / 1e9;
                    println!(
                        "op={} ranks={ranks} bytes={bytes} dtype={dtype} time_us={:.1} algbw_GBps={algbw:.2} busbw_GBps={:.2} memcpy_GBps={memcpy:.2} ratio={:.2}",
                        op.name(),
                        t * 1e6,
                        algbw * op.bus_factor(ranks),
                        algbw / memcpy
                    );
                }
            }
        }
    }
}
