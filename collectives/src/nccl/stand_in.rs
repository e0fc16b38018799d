//! The `nccl` backend when the crate is built without the `nccl` feature: the same entry
//! points, each saying so, so that callers compile (and fail clearly) everywhere.

use super::Options;
use crate::{Error, Result};
use std::sync::Arc;

fn not_compiled() -> Error {
    Error::NotCompiled {
        backend: "nccl",
        feature: "nccl",
    }
}

/// Always false: this build has no NCCL backend.
pub fn library_present() -> bool {
    false
}

/// Returns [`Error::NotCompiled`]: this build has no NCCL backend.
pub fn require_library() -> Result<()> {
    Err(not_compiled())
}

/// One rank's end of an NCCL group. Without the `nccl` feature no value of it exists.
#[derive(Debug)]
pub struct NcclComm {
    _never: std::convert::Infallible,
}

impl NcclComm {
    /// The GPU this rank's buffers must live on. Unreachable without the `nccl` feature.
    pub fn device(&self) -> &dtensor_kernels::cuda::Device {
        match self._never {}
    }
    /// The world (launch) rank of each rank of this group. Unreachable without the `nccl`
    /// feature.
    pub fn members(&self) -> &[usize] {
        match self._never {}
    }
    /// Splits the group, returning the concrete handle. Unreachable without the `nccl`
    /// feature.
    pub fn split_nccl(&self, _color: usize, _key: usize) -> Result<NcclComm> {
        match self._never {}
    }
}

/// Returns [`Error::NotCompiled`] for every rank, without running `f`.
pub fn launch<T, E, F>(world_size: usize, f: F) -> Vec<Result<T, E>>
where
    F: Fn(Arc<NcclComm>) -> Result<T, E> + Sync,
    T: Send,
    E: From<Error> + std::fmt::Display + Send,
{
    launch_with(world_size, Options::default(), f)
}

/// Returns [`Error::NotCompiled`] for every rank, without running `f`.
pub fn launch_with<T, E, F>(world_size: usize, _options: Options, _f: F) -> Vec<Result<T, E>>
where
    F: Fn(Arc<NcclComm>) -> Result<T, E> + Sync,
    T: Send,
    E: From<Error> + std::fmt::Display + Send,
{
    (0..world_size)
        .map(|_| Err(E::from(not_compiled())))
        .collect()
}

/// Returns [`Error::NotCompiled`] without touching `host`: this build has no NCCL backend.
pub fn from_host(_host: &dyn crate::Communicator, _options: Options) -> Result<NcclComm> {
    Err(not_compiled())
}
