//! Criterion benchmarks of the redistribution kernels on the threads backend: S0→R and
//! S(last)→R (all-gather), P→S0 (reduce-scatter), P→I (all-reduce), S0→S1 (all-to-all) and
//! R→S0 (a local chunk), on 2 and 4 ranks, 1 MiB / 16 MiB / 128 MiB in total, f32 and bf16,
//! each group with a single-thread memcpy of the same size for scale. Throughput is the
//! total (gathered / reduced) size; `examples/bench_report.rs` prints the same cases as
//! one-line records with bus bandwidth and the memcpy ratio.
//!
//! `cargo bench --bench redistribute` (all cases take several minutes);
//! `cargo bench --bench redistribute -- 'f32/2 ranks'` filters.

mod support;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use dtensor::prelude::DType;
use std::time::Duration;
use support::{group_with_memcpy, Op, RankPool};

fn redistribution(c: &mut Criterion) {
    for bytes in [1usize << 20, 16 << 20, 128 << 20] {
        for dtype in [DType::F32, DType::BF16] {
            for ranks in [2usize, 4] {
                let mut group = group_with_memcpy(
                    c,
                    format!("{dtype}/{ranks} ranks/{} MiB", bytes >> 20),
                    bytes,
                    Duration::from_secs(if bytes >= 128 << 20 { 3 } else { 1 }),
                );
                for op in Op::ALL {
                    let pool = RankPool::new(op, ranks, bytes, dtype);
                    group.bench_with_input(BenchmarkId::from_parameter(op.name()), &op, |b, _| {
                        b.iter_custom(|iters| pool.run(iters))
                    });
                }
                group.finish();
            }
        }
    }
}

criterion_group!(benches, redistribution);
criterion_main!(benches);
