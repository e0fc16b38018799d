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
//! by cudarc's per-buffer events. Every blocking call returns only once its data has
//! moved; the asynchronous ones own their buffers instead (see below).
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
//! after the communicator was aborted (after which NCCL touches no buffer). An asynchronous
//! call moves its owned buffers into the job it queues, so the same holds without the
//! handle waiting.
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
//! - Asynchronous calls take device buffers (`start_*_device`, below); the host
//!   `start_*` methods refuse host buffers like every host method. `send_device` /
//!   `recv_device` queue on the rank's worker behind its requests (on the CPU backends
//!   they do not wait for requests).
//!
//! # Asynchronous collectives: what overlaps on the GPU
//!
//! `start_all_reduce_device`, `start_all_gather(v)_device` and
//! `start_reduce_scatter(v)_device` take owned `DeviceBuffer`s
//! (a device tensor moved in, O(1)) and return a
//! `DeviceRequest` at once. The call becomes one job on the rank's
//! worker, queued behind every call issued before it on any handle of the rank: the
//! worker makes its stream wait for the buffers' pending writes (cudarc's per-buffer
//! events, as for the blocking calls: a kernel that wrote `send` on the compute stream is
//! ordered before NCCL reads it, without the caller synchronizing), runs the agreement,
//! enqueues the NCCL call on its stream, and polls an event recorded after it (with
//! `ncclCommGetAsyncError`, bounded by the timeout, exactly as a blocking call does).
//! Then it records the call on the buffers' events, counts it, and sends the result buffer
//! to the request: [`Request::test`](crate::Request::test) polls for that answer and
//! [`Request::wait`](crate::Request::wait) blocks for it.
//!
//! | runs concurrently | with |
//! |---|---|
//! | the caller's thread: host code and kernel launches on the compute stream | the whole request (agreement, NCCL kernels, completion polling on the worker) |
//! | compute-stream kernels that do not touch the request's buffers | NCCL's kernels on the communicator's own stream (their SMs permitting) |
//! | a request's NCCL kernels | nothing else of the same rank's NCCL: calls run one after another, in issue order (blocking calls too, so the "Mixing" rule of [`Request`](crate::Request) holds) |
//!
//! The caller cannot read `recv` (or the all-reduced buffer) early: it is moved into the
//! request and comes back from `wait` only once the data phase has finished. A request
//! dropped unwaited waits (its rule on every backend); the buffers stay in the worker's job
//! until NCCL is done with them, or until the communicator was aborted and its stream
//! drained after a failure, so no memory NCCL still writes is freed. Failures come from
//! `wait` as from the blocking call: `RankFailed`, `Timeout` (within the timeout; the
//! communicator is then aborted and every later call returns the same error),
//! `CollectiveMismatch`, `InvalidArgument` (also for a buffer on another GPU than the
//! communicator's). The threads and MPI backends keep the trait's default, which runs the
//! blocking device call at start and so refuses with its `InvalidArgument`.
//!
//! ```no_run
//! # #[cfg(feature = "nccl")] {
//! use dtensor_collectives::{nccl, Communicator, DeviceBuffer, ReduceOp};
//! use dtensor_kernels::Tensor;
//! type BoxError = Box<dyn std::error::Error + Send + Sync>;
//! let results = nccl::launch(2, |comm| -> Result<Tensor, BoxError> {
//!     let shard = Tensor::from_fn(&[4], |_| comm.rank() as f32).to_device(comm.device())?;
//!     let recv = DeviceBuffer::zeros(comm.device(), shard.dtype(), 8)?;
//!     let gather = comm.start_all_gather_device(DeviceBuffer::from_tensor(shard)?, recv);
//!     // ... compute on the device while the gather moves ...
//!     Ok(gather.wait()?.into_tensor())
//! });
//! # }
//! ```
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
//! rank-ordered reductions, buffered sends, tag matching, overlap with a `send` that the
//! peers wait for (sends queue behind requests on the worker), one handle shared by
//! several threads of a rank, and column-block calls that agree on rows (there are no
//! device column-block calls; the staged ones are the trait's defaults). The suite's other
//! asynchronous cases run on the backend's own `start_*_device` calls (the adapter stages
//! a request's buffers in at start and out at `wait`).
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
