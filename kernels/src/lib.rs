//! # dtensor-kernels
//!
//! What one rank computes on its own memory: the local dense [`Tensor`] (shape, dtype,
//! contiguous row-major [`Storage`]), the element types ([`DType`], [`Element`]), and the
//! kernels the distributed layer needs: chunk / cat / pack / unpack along any dim (the data
//! movement around collectives), elementwise arithmetic, and fixed-order reductions (so
//! replicas stay bitwise identical).
//!
//! Kernels run single-threaded inside a rank: ranks are the parallelism.
//!
//! ```
//! use dtensor_kernels::{Tensor, DType};
//! let t = Tensor::from_fn(&[4, 3], |i| i as f32);
//! let parts = t.chunk(0, 3).unwrap();            // torch.chunk: extents 2, 2, 0
//! assert_eq!(parts[2].shape(), &[0, 3]);
//! assert_eq!(Tensor::cat(&parts, 0).unwrap(), t);
//! assert_eq!(t.to_dtype(DType::F64).dtype(), DType::F64);
//! ```

#![warn(missing_docs)]

#[macro_use]
mod dispatch;
#[macro_use]
pub(crate) mod spec;
mod cpu;
#[cfg(feature = "cuda")]
#[macro_use]
pub mod cuda;
/// Stand-ins for the `cuda` module in a build without the feature: the same entry points,
/// each returning [`Error::CudaNotCompiled`], so every caller compiles on a CPU-only build.
#[cfg(not(feature = "cuda"))]
#[path = "cuda_stub.rs"]
pub mod cuda;
pub mod dtype;
pub mod error;
pub mod memory;
pub mod ops;
pub mod pool;
pub mod reduce;
mod shape;
pub mod storage;
mod tensor;

pub use dtype::{words_as_mut, DType, Element, ReduceOp, Slice, SliceMut};
pub use error::{Error, Result};
pub use half;
pub use shape::{checked_numel, chunk_sizes, numel};
pub use storage::{CpuBuffer, CpuStorage, Storage, StorageElement, Tensor};

/// A tensor shape: extents, outermost first. Inline for up to 4 dims.
pub type Shape = smallvec::SmallVec<[usize; 4]>;
