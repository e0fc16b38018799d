//! The `mpi` backend when the crate is built without the `mpi` feature: the same API, every
//! entry point saying so, so that callers compile (and fail clearly) on a machine without
//! MPI.

use super::Options;
use crate::{Communicator, Error, Result};
use std::fmt;
use std::sync::Arc;

fn not_compiled() -> Error {
    Error::NotCompiled {
        backend: "mpi",
        feature: "mpi",
    }
}

/// MPI, initialized for this process. Without the `mpi` feature no value of it exists:
/// [`init`] always fails.
#[derive(Debug)]
pub struct Mpi {
    _never: std::convert::Infallible,
}

/// Returns [`Error::NotCompiled`]: this build has no MPI backend.
pub fn init() -> Result<Mpi> {
    Err(not_compiled())
}

/// Returns [`Error::NotCompiled`]: this build has no MPI backend.
pub fn init_with(_options: Options) -> Result<Mpi> {
    Err(not_compiled())
}

// The methods of the real `Mpi`, uncallable here (no value exists); their docs say what
// they do with the feature on.
impl Mpi {
    /// The world communicator (all ranks `mpirun` started). Unreachable without the `mpi`
    /// feature.
    pub fn world(&self) -> Arc<dyn Communicator> {
        match self._never {}
    }
    /// This process's rank in the world. Unreachable without the `mpi` feature.
    pub fn rank(&self) -> usize {
        match self._never {}
    }
    /// The number of ranks in the world. Unreachable without the `mpi` feature.
    pub fn size(&self) -> usize {
        match self._never {}
    }
    /// Ends the whole job with exit code `code` (`MPI_Abort`) after printing `message`.
    /// Unreachable without the `mpi` feature.
    pub fn abort(&self, _message: &str, _code: i32) -> ! {
        match self._never {}
    }
    /// Ends MPI for this process, collectively over the world. Unreachable without the
    /// `mpi` feature.
    pub fn finalize(self) -> Result<()> {
        match self._never {}
    }
}

/// Prints that this build has no MPI backend (and how to get one) and exits with code 2.
pub fn run<T, E, F>(_f: F) -> T
where
    F: FnOnce(Arc<dyn Communicator>) -> std::result::Result<T, E>,
    E: fmt::Display,
{
    eprintln!(
        "error: {}: rebuild with `--features mpi` (needs an MPI library such as OpenMPI, \
         and libclang)",
        not_compiled()
    );
    std::process::exit(2)
}
