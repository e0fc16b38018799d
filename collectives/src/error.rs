use dtensor_kernels::DType;
use std::time::Duration;

/// What a collective can report. Every rank of a failed collective gets one of these.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Ranks called the same collective slot with arguments that disagree.
    #[error("collective mismatch in {op} (group of {size} on {backend}): {detail}")]
    CollectiveMismatch {
        op: &'static str,
        backend: &'static str,
        size: usize,
        /// Which ranks said what, e.g. "rank 0 called all_reduce(f32, 16 elems), rank 1 called all_gather(f32, 8 elems)".
        detail: String,
    },
    /// A peer panicked, returned an error, or returned before joining this collective.
    /// `rank` is the peer's rank in the world (launch) group.
    #[error("rank {rank} failed ({reason}); {op} on this rank cannot complete")]
    RankFailed {
        rank: usize,
        op: &'static str,
        reason: String,
    },
    /// Peers did not arrive within the configured timeout.
    #[error("{op} timed out after {waited:?} waiting for ranks {missing:?}")]
    Timeout {
        op: &'static str,
        waited: Duration,
        missing: Vec<usize>,
    },
    /// This rank's own arguments are inconsistent (buffer lengths vs counts, a root or
    /// peer out of range, dtypes of send and recv differ).
    #[error("{op}: invalid argument: {detail}")]
    InvalidArgument { op: &'static str, detail: String },
    /// `recv` found a message of another dtype or length than its buffer.
    #[error("{op}: message from rank {src} (tag {tag}) is {got_len} x {got_dtype}, buffer is {want_len} x {want_dtype}")]
    MessageMismatch {
        op: &'static str,
        src: usize,
        tag: u32,
        got_len: usize,
        got_dtype: DType,
        want_len: usize,
        want_dtype: DType,
    },
    /// The backend was not compiled in (e.g. `mpi` without the `mpi` feature).
    #[error("{backend} backend: not compiled with the `{feature}` feature")]
    NotCompiled {
        backend: &'static str,
        feature: &'static str,
    },
    /// A communicator was used after its backend was shut down (an MPI handle kept past
    /// `Mpi::finalize`): no call reaches the library any more.
    #[error("{op}: the {backend} backend has been finalized in this process; its communicators cannot be used any more")]
    Finalized {
        op: &'static str,
        backend: &'static str,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
