//! [`Error`], what a collective reports on every rank when it cannot complete, and the
//! crate's [`Result`] alias.

use dtensor_kernels::DType;
use std::time::Duration;

/// What a collective can report. Every rank of a failed collective gets one of these.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Ranks called the same collective slot with arguments that disagree.
    #[error("collective mismatch in {op} (group of {size} on {backend}): {detail}")]
    CollectiveMismatch {
        /// The collective this rank called, e.g. `"all_reduce"`.
        op: &'static str,
        /// The backend's name (`"threads"`, `"mpi"`).
        backend: &'static str,
        /// The number of ranks in the group.
        size: usize,
        /// Which ranks said what, e.g. "rank 0 called all_reduce(f32, 16 elems), rank 1 called all_gather(f32, 8 elems)".
        detail: String,
    },
    /// A peer panicked, returned an error, or returned before joining this collective.
    /// `rank` is the peer's rank in the world (launch) group.
    #[error("rank {rank} failed ({reason}); {op} on this rank cannot complete")]
    RankFailed {
        /// The failed peer's rank in the world (launch) group.
        rank: usize,
        /// The collective this rank was in, or about to start, when it learned of the
        /// failure.
        op: &'static str,
        /// What happened to the peer: its panic message, its error, or that it returned.
        reason: String,
    },
    /// Peers did not arrive within the configured timeout.
    #[error("{op} timed out after {waited:?} waiting for ranks {missing:?}")]
    Timeout {
        /// The collective that timed out.
        op: &'static str,
        /// How long this rank waited.
        waited: Duration,
        /// The peers that had not arrived, as ranks of the world (launch) group.
        missing: Vec<usize>,
    },
    /// This rank's own arguments are inconsistent (buffer lengths vs counts, a root or
    /// peer out of range, dtypes of send and recv differ).
    #[error("{op}: invalid argument: {detail}")]
    InvalidArgument {
        /// The call that refused.
        op: &'static str,
        /// Which argument was wrong and how, in words.
        detail: String,
    },
    /// `recv` found a message of another dtype or length than its buffer.
    #[error("{op}: message from rank {src} (tag {tag}) is {got_len} x {got_dtype}, buffer is {want_len} x {want_dtype}")]
    MessageMismatch {
        /// The receiving call (`"recv"`).
        op: &'static str,
        /// The sending rank.
        src: usize,
        /// The message tag both sides used.
        tag: u32,
        /// The message's length in elements.
        got_len: usize,
        /// The message's element type.
        got_dtype: DType,
        /// The receive buffer's length in elements.
        want_len: usize,
        /// The receive buffer's element type.
        want_dtype: DType,
    },
    /// The backend was not compiled in (e.g. `mpi` without the `mpi` feature).
    #[error("{backend} backend: not compiled with the `{feature}` feature")]
    NotCompiled {
        /// The backend asked for (`"mpi"`).
        backend: &'static str,
        /// The cargo feature that compiles it in.
        feature: &'static str,
    },
    /// The backend cannot run on this machine: a library it loads at run time is missing
    /// (libnccl, the CUDA driver), or there is no GPU for it.
    #[error("{backend} backend: {detail}")]
    Unavailable {
        /// The backend asked for (`"nccl"`).
        backend: &'static str,
        /// What is missing and how to provide it.
        detail: String,
    },
    /// A call into the backend's library failed (an NCCL or CUDA error code), or the
    /// library reported an asynchronous error; the communicator is aborted and every later
    /// call on it returns this error again.
    #[error("{op} on {backend}: {detail}")]
    Library {
        /// The call that failed.
        op: &'static str,
        /// The backend (`"nccl"`).
        backend: &'static str,
        /// The library's error code and message.
        detail: String,
    },
    /// A communicator was used after its backend was shut down (an MPI handle kept past
    /// `Mpi::finalize`): no call reaches the library any more.
    #[error("{op}: the {backend} backend has been finalized in this process; its communicators cannot be used any more")]
    Finalized {
        /// The call that was refused.
        op: &'static str,
        /// The backend that was shut down (`"mpi"`).
        backend: &'static str,
    },
}

/// `std::result::Result` with this crate's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
