use crate::dtype::DType;
use crate::Shape;

/// Everything a local kernel can reject. Each variant names the op and what it was given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error("{op}: shape mismatch: {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        op: &'static str,
        lhs: Shape,
        rhs: Shape,
    },
    #[error("{op}: dtype mismatch: {lhs} vs {rhs}")]
    DTypeMismatch {
        op: &'static str,
        lhs: DType,
        rhs: DType,
    },
    #[error("{op}: dim {dim} out of range for a tensor of shape {shape:?}")]
    DimOutOfRange {
        op: &'static str,
        dim: usize,
        shape: Shape,
    },
    #[error("{op}: {len} elements do not fill shape {shape:?} ({expected} elements)")]
    LengthMismatch {
        op: &'static str,
        len: usize,
        expected: usize,
        shape: Shape,
    },
    #[error("{op}: {detail}")]
    Invalid { op: &'static str, detail: String },
    /// The CUDA driver library (`libcuda.so.1`) cannot be loaded, or it finds no device.
    #[error("{op}: no CUDA driver found: {detail}")]
    NoCudaDriver { op: &'static str, detail: String },
    /// A CUDA library other than the driver (NVRTC, cuBLAS) cannot be loaded.
    #[error("{op}: {library} not found: {detail}")]
    CudaLibraryMissing {
        op: &'static str,
        library: &'static str,
        detail: String,
    },
    /// NVRTC rejected a kernel module; `log` is NVRTC's log.
    #[error("{op}: CUDA kernel module `{module}` failed to compile ({options}):\n{log}")]
    CudaCompile {
        op: &'static str,
        module: &'static str,
        options: String,
        log: String,
    },
    /// A CUDA call (driver, cuBLAS) failed.
    #[error("{op}: CUDA error: {detail}")]
    Cuda { op: &'static str, detail: String },
    /// The op (or this case of it) has no CUDA kernel.
    #[error("not on cuda: {op}{detail}")]
    NotOnCuda { op: &'static str, detail: String },
    /// A CUDA entry point was called in a build without the `cuda` feature.
    #[error(
        "{op}: not compiled with the `cuda` feature (build dtensor-kernels with `--features cuda`)"
    )]
    CudaNotCompiled { op: &'static str },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
