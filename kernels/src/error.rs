//! [`Error`], what the local kernels return when their arguments do not fit, and the
//! crate's [`Result`] alias.

use crate::dtype::DType;
use crate::Shape;

/// Everything a local kernel can reject. Each variant names the op and what it was given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Shapes the op cannot combine: two operands, an operand and its destination, or a
    /// tensor and the shape it was asked to take.
    #[error("{op}: shape mismatch: {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        /// The op that refused, e.g. `"Tensor::cat"`.
        op: &'static str,
        /// The shape of the tensor operated on (the left operand).
        lhs: Shape,
        /// The other operand's shape, or the shape asked for.
        rhs: Shape,
    },
    /// Two operands (or an operand and an output) of different element types; kernels
    /// never convert implicitly.
    #[error("{op}: dtype mismatch: {lhs} vs {rhs}")]
    DTypeMismatch {
        /// The op that refused.
        op: &'static str,
        /// The dtype of the tensor operated on (the left operand).
        lhs: DType,
        /// The other operand's dtype, or the dtype the op expected.
        rhs: DType,
    },
    /// A tensor dimension index not below the tensor's rank.
    #[error("{op}: dim {dim} out of range for a tensor of shape {shape:?}")]
    DimOutOfRange {
        /// The op that refused.
        op: &'static str,
        /// The dimension index asked for.
        dim: usize,
        /// The shape of the tensor it was asked of.
        shape: Shape,
    },
    /// A buffer whose element count is not the product of the shape it is given.
    #[error("{op}: {len} elements do not fill shape {shape:?} ({expected} elements)")]
    LengthMismatch {
        /// The op that refused.
        op: &'static str,
        /// The number of elements the buffer holds.
        len: usize,
        /// The number of elements `shape` needs.
        expected: usize,
        /// The shape the buffer was given.
        shape: Shape,
    },
    /// Any other bad argument (an out-of-range index or id, a zero chunk count, a size that
    /// overflows `usize`, an empty list), described in `detail`.
    #[error("{op}: {detail}")]
    Invalid {
        /// The op that refused.
        op: &'static str,
        /// What was wrong with the arguments, in words.
        detail: String,
    },
    /// A cross-entropy target that is neither a class of the vocab (`0..vocab`) nor the
    /// ignore index; `row` is its position among the targets the op was given.
    #[error(
        "{op}: target {id} of row {row} is out of range for vocab {vocab}{}",
        ignore_note(.ignore_index)
    )]
    TargetOutOfRange {
        /// The op that checked the targets, `"ops::ce_targets"`.
        op: &'static str,
        /// The row (position among the targets) holding the bad id.
        row: usize,
        /// The id found there.
        id: i64,
        /// The number of classes: every scored id lies in `0..vocab`.
        vocab: usize,
        /// The id that marks an ignored row, if any.
        ignore_index: Option<i64>,
    },
    /// The CUDA driver library (`libcuda.so.1`) cannot be loaded, or it finds no device.
    #[error("{op}: no CUDA driver found: {detail}")]
    NoCudaDriver {
        /// The entry point that needed the driver, e.g. `"cuda::Device::new"`.
        op: &'static str,
        /// Why: the library names searched, the failing `cuInit`/`cuDeviceGetCount`, or a
        /// device ordinal beyond the count the driver reports.
        detail: String,
    },
    /// A CUDA library other than the driver (NVRTC, cuBLAS) cannot be loaded.
    #[error("{op}: {library} not found: {detail}")]
    CudaLibraryMissing {
        /// The entry point that needed the library, e.g. `"cuda::compile"`.
        op: &'static str,
        /// Which library: `"NVRTC"` or `"cuBLAS"`.
        library: &'static str,
        /// The shared-library names searched and how to make one loadable.
        detail: String,
    },
    /// NVRTC rejected a kernel module; `log` is NVRTC's log.
    #[error("{op}: CUDA kernel module `{module}` failed to compile ({options}):\n{log}")]
    CudaCompile {
        /// The entry point that compiled, `"cuda::compile"`.
        op: &'static str,
        /// The kernel module's name (the stem of its `.cu` file, e.g. `"softmax"`).
        module: &'static str,
        /// The NVRTC options passed (architecture, `--std=c++17`, `--fmad=false`), then
        /// NVRTC's result code in parentheses.
        options: String,
        /// NVRTC's program log: the compiler's errors and warnings.
        log: String,
    },
    /// A CUDA call failed at run time: a driver call (allocation, copy, launch, module
    /// load, synchronization), an NVRTC call other than the compile itself, or cuBLAS.
    #[error("{op}: CUDA error: {detail}")]
    Cuda {
        /// The op whose call failed, e.g. `"ops::matmul"`.
        op: &'static str,
        /// The library's error, as text (with the kernel and module name for a failed
        /// kernel lookup).
        detail: String,
    },
    /// The op (or this case of it) has no CUDA kernel: sizes beyond what a launch, shared
    /// memory or cuBLAS's `i32` dimensions allow, or an op not ported to the GPU.
    #[error("not on cuda: {op}{detail}")]
    NotOnCuda {
        /// The op asked for, e.g. `"ops::causal_attention"`.
        op: &'static str,
        /// Empty, or `": "` followed by why this case has no kernel (it is appended to
        /// `op` in the message).
        detail: String,
    },
    /// Tensors an op would combine are in different places: host memory and a GPU, or two
    /// GPUs. Nothing moves implicitly; copy one with `Tensor::to_device` / `to_host`.
    #[error("{op}: tensors on different devices: {lhs} vs {rhs}")]
    DeviceMismatch {
        /// The op that refused, e.g. `"Tensor::add"`.
        op: &'static str,
        /// Where the first operand is: `"host"` or `"cuda:N"`.
        lhs: String,
        /// Where the operand that differs is.
        rhs: String,
    },
    /// A host-only access (a host slice, a host storage, a host closure) to a tensor whose
    /// elements are in device memory.
    #[error(
        "{op}: the tensor is on {device}, not in host memory (copy it with Tensor::to_host first)"
    )]
    NotOnHost {
        /// The accessor that refused, e.g. `"Tensor::as_slice"`.
        op: &'static str,
        /// Where the tensor is: `"cuda:N"`.
        device: String,
    },
    /// A device-only access (a device view, a `CudaTensor`) to a tensor in host memory.
    #[error("{op}: the tensor is in host memory, not on a CUDA device (copy it with Tensor::to_device first)")]
    NotOnDevice {
        /// The accessor that refused, e.g. `"Tensor::device_view"`.
        op: &'static str,
    },
    /// A CUDA entry point was called in a build without the `cuda` feature.
    #[error(
        "{op}: not compiled with the `cuda` feature (build dtensor-kernels with `--features cuda`)"
    )]
    CudaNotCompiled {
        /// The stand-in that was called, e.g. `"cuda::Device::new"`.
        op: &'static str,
    },
}

/// The end of [`Error::TargetOutOfRange`]'s message: which ignore index the id is not.
fn ignore_note(ignore_index: &Option<i64>) -> String {
    match ignore_index {
        Some(i) => format!(" and is not the ignore index {i}"),
        None => " (no ignore index)".into(),
    }
}

/// `std::result::Result` with this crate's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
