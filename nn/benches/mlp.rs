//! ParallelMlp forward + the tape's backward on 2048 tokens, hidden 1024 (ffn 4096, GELU, f32), at
//! tp = 1 and tp = 2 (one thread per rank, single-threaded kernels). The goal:
//! tp = 2 at least 1.7× faster than tp = 1 on 2 cores.
//!
//! Ranks are launched once per sample; rank 0 times `iters` iterations between two
//! barriers, so thread start-up and parameter initialisation are not measured.
//!
//! `cargo bench -p dtensor-nn --bench mlp`

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use dtensor_collectives::threads;
use dtensor_core::{DTensor, DeviceMesh, Error, Tape};
use dtensor_kernels::DType;
use dtensor_nn::{Activation, Ddp, Init, NoSp, ParallelMlp, ParamInit, Stream};
use dtensor_placement::{AxisKind, Mesh};
use std::time::{Duration, Instant};

const TOKENS: usize = 2048;
const HIDDEN: usize = 1024;
const FFN: usize = 4 * HIDDEN;

fn run(tp: usize, iters: u64) -> Duration {
    let mesh = Mesh::new(&[(AxisKind::Dp, 1), (AxisKind::Tp, tp)]).unwrap();
    let times = threads::launch(tp, |world| -> Result<Duration, Error> {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let init = ParamInit::new(1, 0, 0.02, DType::F32);
        let mlp =
            ParallelMlp::<NoSp, Ddp>::new(HIDDEN, FFN, Activation::Gelu, true, init, 0.02, &dm)?;
        let x = Init::Normal { std: 1.0 }.param::<Stream<NoSp>>(
            2,
            0,
            &[TOKENS, HIDDEN],
            DType::F32,
            &dm,
        )?;
        let dy: DTensor<Stream<NoSp>> =
            Init::Normal { std: 1.0 }.param(3, 0, &[TOKENS, HIDDEN], DType::F32, &dm)?;
        dm.world().barrier()?;
        let t0 = Instant::now();
        for _ in 0..iters {
            let tape = Tape::new();
            let xv = tape.leaf(x.clone());
            let y = mlp.forward(&tape, &xv)?;
            let mut g = y.backward_with(dy.clone())?;
            criterion::black_box((g.take(&xv)?, mlp.fc1.weight.grad(&mut g)?));
        }
        dm.world().barrier()?;
        Ok(t0.elapsed())
    });
    times
        .into_iter()
        .next()
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}"))
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("parallel_mlp_fwd_bwd_2048x1024");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(20));
    g.throughput(Throughput::Elements(TOKENS as u64));
    for tp in [1, 2] {
        g.bench_function(format!("tp={tp}"), |b| {
            b.iter_custom(|iters| run(tp, iters))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
