//! Criterion: matmul at transformer shapes through our wrapper and through the `gemm` crate
//! directly (single-threaded, f32). Throughput is in floating-point operations (2·m·n·k),
//! so criterion's "elem/s" reads as FLOP/s.
//!
//! `cargo bench --bench gemm`

#[path = "support/gemm_cases.rs"]
mod gemm_cases;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use gemm_cases::{GemmCase, CASES};
use std::time::Duration;

fn gemm_shapes(c: &mut Criterion) {
    for (name, m, n, k, ta, tb) in CASES {
        let mut case = GemmCase::new(m, n, k, ta, tb);
        let mut group = c.benchmark_group(format!("gemm f32 {name}"));
        group.throughput(Throughput::Elements(case.flops()));
        group.sample_size(10);
        group.measurement_time(Duration::from_secs(3));
        group.bench_function("ours", |b| b.iter(|| case.run_ours()));
        group.bench_function("gemm_direct", |b| b.iter(|| case.run_direct()));
        group.finish();
    }
}

criterion_group!(benches, gemm_shapes);
criterion_main!(benches);
