//! The NCCL backend (feature `nccl`): one rank per thread, each on a GPU, moving device
//! memory with NCCL. Without the feature, a stand-in whose [`launch`] returns
//! [`Error::NotCompiled`](crate::Error::NotCompiled) on every rank.
//!
//! ```no_run
//! # #[cfg(feature = "nccl")] {
//! use dtensor_collectives::{nccl, Communicator, ReduceOp};
//! use dtensor_kernels::Tensor;
//! type BoxError = Box<dyn std::error::Error + Send + Sync>;
//! // Err on every rank (never a panic or a hang) without libnccl, a driver or a GPU.
//! let results = nccl::launch(2, |comm| -> Result<Vec<f32>, BoxError> {
//!     let host = Tensor::from_fn(&[4], |_| comm.rank() as f32 + 1.0);
//!     let mut x = host.to_device(comm.device())?;
//!     comm.all_reduce_device(x.device_view_mut()?, ReduceOp::Sum)?;
//!     Ok(x.to_host()?.as_slice::<f32>()?.to_vec())
//! });
//! for r in results {
//!     assert_eq!(r.unwrap(), vec![3.0; 4]);
//! }
//! # }
//! ```
//!
//! # Buffers
//!
//! [`NcclComm`] implements the `*_device` methods of [`Communicator`](crate::Communicator)
//! (device views: `Tensor::device_view`/`device_view_mut`, `CudaTensor::view`/`view_mut`,
//! `CudaBuffer::view`/`view_mut`). Its host
//! methods refuse with `InvalidArgument` ("nccl backend: host buffers are not staged …"):
//! nothing on the GPU path copies through the host. The buffers must live on the rank's
//! device ([`NcclComm::device`]); NCCL's work runs on a stream of the communicator's own
//! (several ranks may share a GPU, and one stream per GPU would serialize their kernels
//! into a deadlock), ordered after the buffers' earlier writes and before their later uses
//! by cudarc's per-buffer events. Every call returns only once its data has moved.
//!
//! # Ranks, threads and GPUs
//!
//! [`launch`]`(n, f)` runs `f` on `n` thread ranks; rank `r` uses GPU `r % device_count`.
//! One `ncclUniqueId` made in the process is shared by the ranks. NCCL 2.18 or newer is
//! required ([`require_library`] checks the loaded version). Several ranks on one GPU
//! need NCCL ≥ 2.30 and `NCCL_MULTI_RANK_GPU_ENABLE=1` (older NCCL, or the variable unset,
//! gives `ncclInvalidUsage` at init; the error says so). Ranks of one process on one GPU
//! share its CUDA context, where loading a kernel may synchronize the whole context: a rank
//! loading its first kernel of a module while a peer's NCCL kernel waits for it would hang
//! until the timeout. So when ranks share a GPU, `launch` loads every `dtensor-kernels`
//! kernel on it before creating the communicators (once per process; NVRTC compiles the
//! modules, a few seconds). cuBLAS loads its kernels lazily all the same: set
//! `CUDA_MODULE_LOADING=EAGER` if ranks sharing a GPU can make their first cuBLAS call of a
//! shape while a peer waits in a collective. Set `NCCL_SOCKET_IFNAME=lo` for a single
//! machine. Processes under MPI: [`from_host`]`(&*mpi.world(), options)` on every
//! rank (rank 0's id broadcast over the MPI communicator; any host communicator works, so
//! it needs no `mpi` feature of its own). It is written but, like the rest of this
//! backend, not yet run on a GPU, and not under `mpirun` with NCCL at all.
//!
//! cudarc's `Comm` is `!Send` and its `Drop` panics when the abort fails, so this backend
//! does not use it: each rank has a *worker* thread that creates the raw `ncclComm_t`,
//! keeps it (and the communicators split from it) for its whole life, and makes every NCCL
//! call on it. The handle, [`NcclComm`], only sends the worker a description of each call
//! (raw device addresses, counts) and waits for its answer, so it is `Send + Sync` (as
//! [`Communicator`](crate::Communicator) requires) without any `unsafe impl`: no NCCL
//! handle ever crosses a thread. The caller's borrow of the buffers outlasts the call,
//! because the handle waits for the worker's answer, which comes after the data moved or
//! after the communicator was aborted (after which NCCL touches no buffer).
//!
//! # What each call does
//!
//! | call | NCCL |
//! |---|---|
//! | every collective, `barrier`, `split` | first, the *agreement*: an `ncclAllGather` of the MPI backend's 11-word call header (op, dtype, lengths, a hash of the counts, reduce op, root, rows of a column-block call, "my arguments are invalid") |
//! | `all_reduce_device` | `ncclAllReduce` in place |
//! | `all_gather_device` | `ncclAllGather` |
//! | `all_gatherv_device` | grouped `ncclSend`/`ncclRecv` with every rank (itself included) |
//! | `reduce_scatter_device` | `ncclReduceScatter` |
//! | `reduce_scatterv_device` | grouped `ncclReduce` of block `p` to root `p`, for every `p` |
//! | `all_to_all(v)_device` | grouped `ncclSend`/`ncclRecv` (the agreement's pair hashes check that rank `p` sends rank `q` what `q` expects, as under MPI) |
//! | `broadcast_device` | `ncclBroadcast` in place |
//! | `barrier` | the agreement alone |
//! | `split` | a gather of every rank's `(color, key)`, then `ncclCommSplit` (non-blocking: the child is read once the parent's state leaves `ncclInProgress`) |
//! | `send_device` / `recv_device` | a 4-word header (dtype, length, tag) from the sender, a 1-word answer from the receiver, then the data if they agree |
//!
//! The agreement costs one small all-gather (88 bytes per rank) and two tiny host↔device
//! copies per call, about the latency of an extra collective; in exchange, calls that
//! disagree (NCCL itself does not compare sizes, ops or dtypes: a mismatch is undefined
//! behaviour there, a hang or garbage) give every rank
//! [`Error::CollectiveMismatch`](crate::Error::CollectiveMismatch) with the other
//! backends' wording, and the group stays usable. Counters follow the table in
//! `counters.rs` and count the data phase only, as on the other backends.
//!
//! # Guarantees that change on GPU
//!
//! - Reductions: NCCL's sums are not in rank order `0, 1, …, n-1` (ring and tree
//!   algorithms choose the order and may split elements differently by size). Every rank
//!   still receives the same bits from one call (replicas stay bitwise equal), but the
//!   result is not bitwise that of the threads or MPI backends; float sums agree with them
//!   within rounding. `Avg` is NCCL's (`ncclAvg`); `Max`/`Min` of NaN follow NCCL.
//! - Sends: NCCL has no buffering and no tags. `send_device` waits for the matching
//!   `recv_device` (within the timeout), so two ranks that both send first deadlock until
//!   the timeout; messages between a pair arrive in call order, and the tag is checked
//!   (a different tag, dtype or length fails both sides), not matched.
//! - No asynchronous `start_*` overlap: the trait's stand-ins run the blocking call.
//!
//! # The conformance suite on NCCL
//!
//! The backend conformance suite (`conformance`, the cases every backend passes) runs on
//! this backend in `tests/nccl_conformance.rs` (ignored without a GPU; on 2 and 4 thread
//! ranks), through `conformance::staging::Staging`: a **test-harness-only** adapter that
//! copies each case's host buffers to the device and back around the `*_device` calls.
//! Nothing on the GPU path stages through the host: [`NcclComm`]'s own host methods keep
//! refusing host buffers. The suite's cases that need what the list above takes away are
//! reported `unsupported`, each with its reason (`conformance::staging::UNSUPPORTED`):
//! rank-ordered reductions, buffered sends, tag matching, asynchronous progress, one
//! handle shared by several threads of a rank, and column-block calls that agree on rows
//! (there are no device column-block calls; the staged ones are the trait's defaults).
//! What the suite cannot check (a failing rank, a timeout, the refusals, this backend's
//! wording) is in `tests/nccl.rs`.
//!
//! # Failures
//!
//! Communicators are created non-blocking (`ncclConfig_t.blocking = 0`), so no NCCL call
//! blocks the worker: after each call it polls `ncclCommGetAsyncError` (the call's
//! progress), then an event recorded after the call's kernels, until both are done or
//! the deadline ([`Options::timeout`]) passes.
//!
//! | what happens | what the rank gets |
//! |---|---|
//! | calls disagree (op, dtype, lengths, counts, root, reduce op) | every rank: `CollectiveMismatch`; the group stays usable |
//! | a rank's own arguments are inconsistent | it: `InvalidArgument`; its peers: `CollectiveMismatch` |
//! | host buffers passed | `InvalidArgument`, no NCCL call |
//! | a peer launched by [`launch`] returned, errored or panicked | `RankFailed` naming it, at once if it left before this call, else after a grace of 1 s for a call it may have completed; the communicator is aborted |
//! | NCCL reports an error (`ncclCommGetAsyncError`, a failed call, a CUDA error) | `Library` with NCCL's code and message; the communicator is aborted |
//! | the call does not finish within the timeout | `Timeout` (`missing` is empty: NCCL cannot tell which peer is late); the communicator is aborted |
//! | a call after an abort | the error that caused the abort, again, without an NCCL call |
//!
//! What is not detected: a send/recv pair whose lengths agree but whose *contents* were
//! meant for another pairing (no tags), and calls with agreeing signatures made in a
//! different order by different threads of one rank on two communicators (they serialize
//! on the rank's worker; NCCL may then wait until the timeout).

use std::time::Duration;

#[cfg(feature = "nccl")]
mod comm;
#[cfg(feature = "nccl")]
mod launch;
#[cfg(not(feature = "nccl"))]
mod stand_in;

#[cfg(feature = "nccl")]
pub use comm::NcclComm;
#[cfg(feature = "nccl")]
pub use launch::{from_host, launch, launch_with, library_present, require_library};
#[cfg(not(feature = "nccl"))]
pub use stand_in::{from_host, launch, launch_with, library_present, require_library, NcclComm};

/// The environment variable NCCL ≥ 2.30 reads to allow several ranks on one GPU.
pub const MULTI_RANK_GPU_ENV: &str = "NCCL_MULTI_RANK_GPU_ENABLE";

/// How a [`launch_with`] world behaves.
#[derive(Clone, Debug)]
pub struct Options {
    /// How long a rank waits for a call (its agreement, its data, or the communicator's
    /// creation) before aborting the communicator with
    /// [`Error::Timeout`](crate::Error::Timeout).
    pub timeout: Duration,
}

impl Default for Options {
    /// `timeout` from `DTENSOR_TIMEOUT_SECS`, as for the threads backend (120 s if unset).
    fn default() -> Options {
        Options {
            timeout: crate::threads::Options::default().timeout,
        }
    }
}
