//! Shared helpers for the NCCL tests (`nccl`, `nccl_conformance`): whether this machine can
//! run them, and whether a GPU run demands that it can.
#![allow(dead_code)]

use dtensor_collectives::nccl;
use dtensor_kernels::cuda;

/// Why the GPU tests cannot run here, if they cannot.
pub fn gpu_missing() -> Option<String> {
    if let Err(e) = nccl::require_library() {
        return Some(e.to_string());
    }
    if !cuda::driver_present() {
        return Some("libcuda.so.1 not found".into());
    }
    match cuda::device_count() {
        Ok(0) => Some("the driver reports 0 devices".into()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// Whether a missing GPU or library must fail the test (set by the GPU runner).
pub fn gpu_required() -> bool {
    std::env::var("DTENSOR_GPU_REQUIRED").as_deref() == Ok("1")
}
