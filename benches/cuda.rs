//! Criterion on GPU 0 (feature `cuda`): the device kernels that move data around the
//! collectives (`Tensor::pack`, `unpack`, `narrow`, `cat` on device tensors) next to a
//! device-to-device copy (`cuMemcpyDtoDAsync`) of the same bytes measured in the same run,
//! and cuBLAS GEMM through `ops::matmul` on device tensors.
//!
//! `cargo bench --bench cuda --features cuda` (on the GPU machine, `scripts/gpu-check.sh`'s
//! bundle runs the binary as `cuda --bench --warm-up-time … --measurement-time …`).
//!
//! What is timed: each of criterion's timed batches starts on an idle stream, queues its
//! iterations and ends with a stream synchronize, so a batch's time covers the device's
//! work, not only the launches (one synchronize per batch, not per iteration: a
//! per-iteration round trip to the host would add its latency to a 64 MiB copy's ~30 µs).
//!
//! Units: a data-movement case's bytes are the bytes it writes (it reads as many), the copy
//! reference's likewise, so GB/s and the ratio compare like with like; a GEMM's "elements"
//! are its 2·m·n·k floating-point operations, so criterion's `elem/s` reads as FLOP/s.
//!
//! Besides criterion's own report, one summary line per case, from the same timed batches
//! (the median time per iteration over the last 10 batches, which are criterion's
//! measurement samples):
//!
//! ```text
//! gpu_bench case=dtod_64MiB bytes=67108864 GBps=…
//! gpu_bench case=pack_f32_64MiB_inner bytes=67108864 GBps=… dtod_GBps=… ratio=…
//! gpu_bench case=gemm_bf16_8192 flop=… ms=… TFLOPs=…
//! ```
//!
//! Without a GPU (or without the driver or NVRTC) it prints `gpu_bench: no CUDA device:
//! <why>` and exits 0; a failing op later (cuBLAS missing, a kernel error) is
//! `gpu_bench: error: <what>` and exit 1.

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput};
use dtensor::kernels::cuda::{CudaTensor, Device, DeviceView, DeviceViewMut};
use dtensor::kernels::ops::{self, Transpose};
use dtensor::kernels::{DType, Tensor};
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

type BoxError = Box<dyn std::error::Error>;

const MIB: usize = 1 << 20;
/// Pieces of a pack / unpack (ranks of an all-to-all or a reduce-scatter).
const PIECES: usize = 8;
/// Sizes of the data-movement cases (bytes of the tensor).
const SIZES_MIB: [usize; 2] = [64, 256];
/// GEMM sizes (m = n = k).
const GEMM_SIZES: [usize; 2] = [4096, 8192];

fn main() -> ExitCode {
    let dev = match Device::new(0) {
        Ok(dev) => dev,
        Err(e) => {
            // A bench, not a test: it says why it measured nothing (the GPU check's report
            // counts it as not run, never as passed).
            println!("gpu_bench: no CUDA device: {e}");
            return ExitCode::SUCCESS;
        }
    };
    // Defaults that keep the whole bench near a minute on an H200; the command line
    // (`--warm-up-time`, `--measurement-time`, `--sample-size`, a filter) overrides them.
    let mut c = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(1))
        .nresamples(10_000)
        .configure_from_args();
    let (major, minor) = dev.compute_capability();
    println!("gpu_bench device=cuda:{} sm_{major}{minor}", dev.ordinal());
    match run(&mut c, &dev) {
        Ok(()) => {
            c.final_summary();
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("gpu_bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(c: &mut Criterion, dev: &Device) -> Result<(), BoxError> {
    let dtod = copies(c, dev)?;
    for mib in SIZES_MIB {
        for dtype in [DType::F32, DType::BF16] {
            moves(c, dev, &dtod, mib, dtype)?;
        }
    }
    for n in GEMM_SIZES {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            gemm(c, dev, n, dtype)?;
        }
    }
    Ok(())
}

/// Runs `op` `iters` times between two stream synchronizations; the time in between.
fn time_batch(
    dev: &Device,
    iters: u64,
    op: &mut dyn FnMut() -> Result<(), BoxError>,
) -> Result<Duration, BoxError> {
    dev.synchronize()?;
    let t0 = Instant::now();
    for _ in 0..iters {
        op()?;
    }
    dev.synchronize()?;
    Ok(t0.elapsed())
}

/// Benchmarks `op` as `id` in `group` and returns its median seconds per iteration over
/// the last 10 timed batches (`None` if criterion did not run it: filtered out). `op` runs
/// once first, so that a failing op is an `Err` here and not a measurement.
fn bench(
    group: &mut BenchmarkGroup<'_, WallTime>,
    id: &str,
    dev: &Device,
    mut op: impl FnMut() -> Result<(), BoxError>,
) -> Result<Option<f64>, BoxError> {
    op()?;
    dev.synchronize()?;
    let mut batches: Vec<(u64, Duration)> = Vec::new();
    let mut failure: Option<String> = None;
    group.bench_function(id, |b| {
        b.iter_custom(|iters| {
            if failure.is_some() {
                // Criterion cannot be told to stop: a long time per iteration ends its
                // warm-up and sampling quickly, and the error is returned below.
                return Duration::from_secs(iters);
            }
            match time_batch(dev, iters, &mut op) {
                Ok(d) => {
                    batches.push((iters, d));
                    d
                }
                Err(e) => {
                    failure = Some(e.to_string());
                    Duration::from_secs(iters)
                }
            }
        })
    });
    if let Some(e) = failure {
        return Err(format!("{id}: {e}").into());
    }
    let mut per_iter: Vec<f64> = batches
        .iter()
        .rev()
        .take(10)
        .filter(|(iters, _)| *iters > 0)
        .map(|(iters, d)| d.as_secs_f64() / *iters as f64)
        .collect();
    if per_iter.is_empty() {
        return Ok(None);
    }
    per_iter.sort_by(f64::total_cmp);
    let mid = per_iter.len() / 2;
    Ok(Some(if per_iter.len() % 2 == 1 {
        per_iter[mid]
    } else {
        (per_iter[mid - 1] + per_iter[mid]) / 2.0
    }))
}

fn gbps(bytes: usize, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// Device-to-device copies of every byte count the data-movement cases write; GB/s by
/// byte count.
fn copies(c: &mut Criterion, dev: &Device) -> Result<BTreeMap<usize, f64>, BoxError> {
    let mut out = BTreeMap::new();
    let mut group = c.benchmark_group("cuda dtod");
    let mut counts: Vec<usize> = SIZES_MIB
        .iter()
        .flat_map(|m| [m * MIB / 2, m * MIB])
        .collect();
    counts.sort_unstable();
    counts.dedup();
    for bytes in counts {
        let n = bytes / 4;
        let src = CudaTensor::zeros(dev, &[n], DType::F32)?;
        let mut dst = CudaTensor::zeros(dev, &[n], DType::F32)?;
        let (DeviceView::F32(s), DeviceViewMut::F32(mut d)) = (src.view()?, dst.view_mut()?) else {
            return Err("f32 tensors gave views of another dtype".into());
        };
        let stream = dev.stream().clone();
        let id = format!("dtod_{}MiB", bytes / MIB);
        group.throughput(Throughput::Bytes(bytes as u64));
        let t = bench(&mut group, &id, dev, || {
            stream
                .memcpy_dtod(&s, &mut d)
                .map_err(|e| format!("cuMemcpyDtoDAsync: {e}").into())
        })?;
        if let Some(t) = t {
            let g = gbps(bytes, t);
            out.insert(bytes, g);
            println!("gpu_bench case={id} bytes={bytes} GBps={g:.1}");
        }
    }
    group.finish();
    Ok(out)
}

/// A `[rows, cols]` device tensor of `dtype` holding varied values in [-0.5, 0.5).
fn matrix(dev: &Device, rows: usize, cols: usize, dtype: DType) -> Result<Tensor, BoxError> {
    let host = Tensor::try_from_fn(&[rows, cols], |i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)?;
    Ok(host.to_device(dev)?.try_to_dtype(dtype)?)
}

/// pack / unpack / narrow / cat of a `mib` MiB `dtype` tensor along its outer dim (0, the
/// contiguous case) and its inner dim (1, strided blocks).
fn moves(
    c: &mut Criterion,
    dev: &Device,
    dtod: &BTreeMap<usize, f64>,
    mib: usize,
    dtype: DType,
) -> Result<(), BoxError> {
    let bytes = mib * MIB;
    let rows = if mib >= 256 { 8192 } else { 4096 };
    let cols = bytes / dtype.size_in_bytes() / rows;
    let x = matrix(dev, rows, cols, dtype)?;
    let shape = [rows, cols];
    let name = format!("{dtype}_{mib}MiB");
    let mut group = c.benchmark_group(format!("cuda moves {name}"));
    // The summary line of one case, its bytes written beside the copy of as many bytes.
    let line = |case: String, written: usize, t: Option<f64>| {
        if let Some(t) = t {
            let g = gbps(written, t);
            match dtod.get(&written) {
                Some(&r) => println!(
                    "gpu_bench case={case} bytes={written} GBps={g:.1} dtod_GBps={r:.1} ratio={:.3}",
                    g / r
                ),
                None => println!("gpu_bench case={case} bytes={written} GBps={g:.1} dtod_GBps=none"),
            }
        }
    };
    for (dim, side) in [(0, "outer"), (1, "inner")] {
        let extent = shape[dim];
        let sizes = vec![extent / PIECES; PIECES];
        group.throughput(Throughput::Bytes(bytes as u64));

        let id = format!("pack_{name}_{side}");
        let t = bench(&mut group, &id, dev, || {
            x.pack(dim, &sizes)?;
            Ok(())
        })?;
        line(id, bytes, t);

        let flat = x.pack(dim, &sizes)?;
        let id = format!("unpack_{name}_{side}");
        let t = bench(&mut group, &id, dev, || {
            Tensor::unpack(&flat, &shape, dim, &sizes)?;
            Ok(())
        })?;
        line(id, bytes, t);
        drop(flat);

        let halves = x.split(dim, &[extent / 2, extent - extent / 2])?;
        let id = format!("cat_{name}_{side}");
        let t = bench(&mut group, &id, dev, || {
            Tensor::cat(&halves, dim)?;
            Ok(())
        })?;
        line(id, bytes, t);
        drop(halves);

        // The middle half: half the bytes written.
        group.throughput(Throughput::Bytes((bytes / 2) as u64));
        let id = format!("narrow_{name}_{side}");
        let t = bench(&mut group, &id, dev, || {
            x.narrow(dim, extent / 4, extent / 2)?;
            Ok(())
        })?;
        line(id, bytes / 2, t);
    }
    group.finish();
    Ok(())
}

/// `ops::matmul` of two `[n, n]` device matrices of `dtype` (cuBLAS; bf16/f16 with f32
/// compute).
fn gemm(c: &mut Criterion, dev: &Device, n: usize, dtype: DType) -> Result<(), BoxError> {
    let a = matrix(dev, n, n, dtype)?;
    let b = matrix(dev, n, n, dtype)?;
    let flop = 2 * (n as u64).pow(3);
    let mut group = c.benchmark_group(format!("cuda gemm {dtype}"));
    group.throughput(Throughput::Elements(flop));
    let id = format!("gemm_{dtype}_{n}");
    let t = bench(&mut group, &id, dev, || {
        ops::matmul(&a, Transpose::No, &b, Transpose::No)?;
        Ok(())
    })?;
    group.finish();
    if let Some(t) = t {
        println!(
            "gpu_bench case={id} flop={flop} ms={:.3} TFLOPs={:.1}",
            t * 1e3,
            flop as f64 / t / 1e12
        );
    }
    Ok(())
}
