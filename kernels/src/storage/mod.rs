//! Where a tensor's elements live: a shared host buffer ([`CpuBuffer`], counted by
//! [`crate::memory`] and recycled by [`crate::pool`]) or one GPU's buffer. [`Tensor`] is
//! the handle over it.
//!
//! The storage floor: it knows buffers, shapes and the devices' memory, and nothing of ops.

pub(crate) mod cpu;
pub(crate) mod tensor;

pub use cpu::{CpuStorage, StorageElement};
pub use tensor::Tensor;

use std::sync::Arc;

/// A host buffer shared by the tensors that view it. When the last view drops it, the
/// buffer goes back to the thread's pool (see [`crate::pool`]).
#[derive(Debug)]
pub struct CpuBuffer {
    pub(crate) data: CpuStorage,
}

impl CpuBuffer {
    /// The whole buffer's elements; a tensor viewing it may use only a run of them (from
    /// its offset, `numel` long).
    pub fn data(&self) -> &CpuStorage {
        &self.data
    }
}

impl CpuBuffer {
    pub(crate) fn new(data: CpuStorage) -> Self {
        let size = data.dtype().size_in_bytes();
        crate::memory::on_alloc(data.len() * size, data.capacity() * size);
        CpuBuffer { data }
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        let data = std::mem::replace(&mut self.data, CpuStorage::F32(Vec::new()));
        let size = data.dtype().size_in_bytes();
        crate::memory::on_free(data.len() * size, data.capacity() * size);
        crate::pool::recycle(data, crate::memory::pool_room());
    }
}

/// Where a tensor's elements live: host memory, or (feature `cuda`) one GPU's memory.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Storage {
    /// Host memory, shared by reference count among the tensors that view it.
    Cpu(Arc<CpuBuffer>),
    /// Device memory of one GPU, shared by reference count like `Cpu`; a device tensor
    /// starts at element 0 of its buffer.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaStorage),
}
