//! Shared helpers for the CUDA tests (`cuda_gpu`, `cuda_gpu_model`): whether a GPU is there,
//! moving tensors to and from it, and comparing its results with the CPU's bit for bit or
//! within a tolerance per dtype.

use dtensor_kernels::cuda::{self, Device};
use dtensor_kernels::{DType, Tensor};

/// The device, or `None` (with the reason on stderr) on a machine without one. With
/// `DTENSOR_GPU_REQUIRED=1` (set by the GPU check's runner) a missing GPU fails the test
/// instead, so a GPU run cannot pass by skipping.
pub fn gpu() -> Option<Device> {
    let missing =
        if !cuda::driver_present() {
            "libcuda.so.1 not found".to_string()
        } else {
            match cuda::device_count() {
                Ok(n) if n > 0 => {
                    return Some(Device::new(0).unwrap_or_else(|e| {
                        panic!("a device is there but Device::new failed: {e}")
                    }))
                }
                Ok(_) => "the driver reports 0 devices".to_string(),
                Err(e) => e.to_string(),
            }
        };
    assert!(
        std::env::var("DTENSOR_GPU_REQUIRED").as_deref() != Ok("1"),
        "DTENSOR_GPU_REQUIRED=1 but no CUDA GPU: {missing}"
    );
    eprintln!("SKIPPED (needs a CUDA GPU): {missing}");
    None
}

/// Deterministic pseudo-random values in `[lo, hi)` (64-bit LCG).
pub fn rand_vec(n: usize, seed: u64, lo: f64, hi: f64) -> Vec<f64> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            lo + (hi - lo) * ((s >> 11) as f64 / (1u64 << 53) as f64)
        })
        .collect()
}

/// A copy of `t` on `dev`.
pub fn up(t: &Tensor, dev: &Device) -> Tensor {
    t.to_device(dev).unwrap()
}

/// A copy of the device tensor `t` in host memory.
pub fn down(t: &Tensor) -> Tensor {
    assert!(t.is_cuda(), "a device result was expected");
    t.to_host().unwrap()
}

/// The elements' bits (NaNs compared by bits too).
pub fn bits(t: &Tensor) -> Vec<u64> {
    match t.dtype() {
        DType::F32 => t
            .as_slice::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::F64 => t
            .as_slice::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        DType::BF16 => t
            .as_slice::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::F16 => t
            .as_slice::<half::f16>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::I32 => t
            .as_slice::<i32>()
            .unwrap()
            .iter()
            .map(|&v| v as u64)
            .collect(),
        DType::I64 => t
            .as_slice::<i64>()
            .unwrap()
            .iter()
            .map(|&v| v as u64)
            .collect(),
    }
}

/// Same shape, dtype and bits.
#[track_caller]
pub fn assert_bitwise(what: &str, gpu: &Tensor, cpu: &Tensor) {
    assert_bits(what, gpu, cpu, false);
}

/// Same shape, dtype and bits; with `any_nan`, a NaN equals any NaN (the payload of an
/// arithmetic result's NaN is not specified by Rust, and the GPU's is canonical).
#[track_caller]
pub fn assert_bits(what: &str, gpu: &Tensor, cpu: &Tensor, any_nan: bool) {
    assert_eq!(gpu.shape(), cpu.shape(), "{what}: shape");
    assert_eq!(gpu.dtype(), cpu.dtype(), "{what}: dtype");
    let (a, b) = (bits(gpu), bits(cpu));
    let (ga, cb) = (gpu.to_f64_vec(), cpu.to_f64_vec());
    let same = |i: usize| a[i] == b[i] || (any_nan && ga[i].is_nan() && cb[i].is_nan());
    if let Some(i) = (0..a.len()).find(|&i| !same(i)) {
        panic!(
            "{what} ({}): element {i} differs: gpu {} vs cpu {} ({} of {} differ)",
            gpu.dtype(),
            gpu.to_f64_vec()[i],
            cpu.to_f64_vec()[i],
            (0..a.len()).filter(|&i| !same(i)).count(),
            a.len()
        );
    }
}

/// Relative tolerance per dtype: a few units of the last place of the stored type.
pub fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-12,
        DType::F32 => 2e-5,
        DType::F16 => 4e-3,
        DType::BF16 => 3e-2,
        _ => 0.0,
    }
}

/// `|gpu − cpu| ≤ tol·scale·(1 + |cpu|)` elementwise, with equal infinities (a masked
/// row's `lse = −∞`) equal.
#[track_caller]
pub fn assert_close(what: &str, gpu: &Tensor, cpu: &Tensor, scale: f64) {
    assert_eq!(gpu.shape(), cpu.shape(), "{what}: shape");
    assert_eq!(gpu.dtype(), cpu.dtype(), "{what}: dtype");
    let t = tol(cpu.dtype()) * scale;
    for (i, (x, y)) in gpu.to_f64_vec().iter().zip(cpu.to_f64_vec()).enumerate() {
        let ok = if y.is_infinite() {
            *x == y
        } else {
            (x - y).abs() <= t * (1.0 + y.abs())
        };
        assert!(
            ok,
            "{what} ({}): element {i}: gpu {x} vs cpu {y} (tolerance {t})",
            cpu.dtype()
        );
    }
}
