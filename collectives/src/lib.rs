//! # dtensor-collectives
//!
//! The [`Communicator`] trait: a group of ranks exchanging buffers. It knows ranks, buffers
//! and dtypes, never placements or tensors; `dtensor-core` decides *which* collective a
//! placement change needs, a backend decides *how* bytes move.
//!
//! Backends:
//! - [`threads`] (default): N ranks as threads in one process, shared-memory collectives.
//! - [`mpi`] (feature `mpi`): ranks as processes under `mpirun`, over rsmpi; without the
//!   feature, a stand-in whose `init` returns [`Error::NotCompiled`].
//! - [`nccl`] (feature `nccl`): one rank per thread and GPU, over NCCL, on device
//!   buffers; without the feature, a stand-in whose `launch` returns
//!   [`Error::NotCompiled`].
//!
//! [`unbuffered`] is no backend but a wrapper around one: NCCL's point-to-point semantics
//! (rendezvous sends, no tags) over a host communicator, so host tests see what the GPU
//! path would. Such wrappers implement [`Forward`]: they write only the calls they
//! change, and every other call goes to the wrapped communicator.
//!
//! Every backend passes one conformance suite, `conformance` (feature `conformance`, test
//! code that this crate's tests and examples enable): the semantics below as a table of
//! named cases, each written once against the trait; the module's docs say how a new
//! backend runs it.
//!
//! Semantics every backend keeps:
//! - Buffers are rank-ordered: in an all-gather, rank `r`'s piece lands at position `r`.
//! - Reductions combine contributions in rank order `0, 1, …, n-1`, so every rank that
//!   receives the same reduced element receives the same bits. On [`nccl`] the order is
//!   NCCL's own: every rank still receives the same bits, but not the bits of the CPU
//!   backends (see its "Guarantees that change on GPU").
//! - Calls that disagree across ranks (op, dtype, length, counts, root, reduce op) return
//!   [`Error::CollectiveMismatch`] on every rank.
//! - A rank that panics, errors or returns makes its peers' pending and later collectives
//!   return [`Error::RankFailed`]; a peer that never arrives makes them return
//!   [`Error::Timeout`] after the configured timeout. Never a hang, never UB. (Under MPI a
//!   data phase that cannot finish within the timeout aborts the job instead; see
//!   [`mpi`].)
//!
//! ```
//! use dtensor_collectives::{threads, CommunicatorExt, ReduceOp};
//! let results = threads::launch(4, |comm| {
//!     let mut v = vec![comm.rank() as f32; 3];
//!     comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
//!     Ok::<_, dtensor_collectives::Error>(v)
//! });
//! for r in results {
//!     assert_eq!(r.unwrap(), vec![6.0; 3]);
//! }
//! ```
//!
//! # Device buffers (feature `cuda`)
//!
//! The methods above move host memory ([`Slice`], [`SliceMut`]). With the `cuda` feature
//! the trait also has a `*_device` twin of each data-moving call, taking
//! `dtensor_kernels::cuda::DeviceView` / `DeviceViewMut` (`Tensor::device_view` /
//! `device_view_mut` of a device tensor, or views of a `CudaBuffer` range or a
//! `CudaTensor`). Only the NCCL backend implements them; the threads and MPI backends
//! answer [`Error::InvalidArgument`] ("threads backend: device buffers need the nccl
//! backend"), and the NCCL backend answers the host methods the same way: no backend
//! stages through the host behind the caller's back.
//!
//! Why twins, not a `Device` variant of `Slice`/`SliceMut`: the host enums are matched
//! exhaustively all over the workspace (`with_slice!` hands each arm a typed `&[T]`),
//! and an arm for device memory could only panic there; a variant that exists only with a
//! feature would also change those matches' meaning per build. Separate methods with a
//! refusing default leave every existing match and backend untouched, keep the host and
//! device memory spaces apart in the types, and cost nothing in a build without the
//! feature (the methods do not exist there).
//!
//! # Asynchronous collectives
//!
//! `start_all_reduce`, `start_all_gather(v)` and `start_reduce_scatter(v)` take owned
//! [`Buffer`]s (the `_vec` forms of [`CommunicatorExt`] take `Vec`s) and return a
//! [`Request`] at once; the collective moves data while the caller computes, and
//! [`Request::wait`] returns the result buffer. Results, errors and counters are those of
//! the blocking calls; the rules for ordering, mixing with blocking calls and dropping a
//! request unwaited are on [`Request`]. The threads and MPI backends run requests on a
//! progress thread per handle; a backend that does not override the `start_*` methods
//! gets the trait's stand-ins, which run the blocking call at start (no overlap).
//!
//! With the `cuda` feature, `start_*_device` twins take owned `DeviceBuffer`s (device
//! tensors moved in) and return a `DeviceRequest` (a [`Request`] that gives a
//! `DeviceBuffer` back), under the same rules. The NCCL backend runs them on its worker
//! and stream while the caller computes (see [`nccl`]); the trait's default runs the
//! blocking `*_device` call at start, so the host-memory backends refuse with the
//! blocking call's error.
//!
//! ```
//! use dtensor_collectives::{threads, CommunicatorExt, ReduceOp};
//! let results = threads::launch(2, |comm| {
//!     let grads = comm.start_all_reduce_vec(vec![comm.rank() as f32 + 1.0; 4], ReduceOp::Sum);
//!     let other_work: f32 = (0..1000).map(|i| i as f32).sum(); // overlaps the all-reduce
//!     let grads = grads.wait()?;
//!     Ok::<_, dtensor_collectives::Error>((grads, other_work))
//! });
//! for r in results {
//!     assert_eq!(r.unwrap().0, vec![3.0; 4]);
//! }
//! ```

#![warn(missing_docs)]

mod args;
mod call;
pub mod columns;
#[cfg(feature = "conformance")]
pub mod conformance;
mod counters;
mod error;
mod forward;
mod mismatch;
pub mod mpi;
pub mod nccl;
mod progress;
mod request;
pub mod threads;
pub mod trace;
pub mod unbuffered;

pub use counters::{CollectiveKind, CounterSnapshot, Counters};
pub use dtensor_kernels::{DType, Element, ReduceOp, Slice, SliceMut, StorageElement};
pub use error::{Error, Result};
pub use forward::Forward;
pub use request::{Buffer, Pending, Request};
#[cfg(feature = "cuda")]
pub use request::{DeviceBuffer, DeviceRequest};

use std::sync::Arc;

#[cfg(feature = "cuda")]
use dtensor_kernels::cuda::{DeviceView, DeviceViewMut};

/// A group of `size()` ranks; this handle is rank `rank()`'s end of it.
///
/// Every method is collective over the group (all ranks must call it, in the same order,
/// with agreeing arguments) except `send`/`recv`, which pair one sender with one receiver.
/// Buffers are dtype-erased ([`Slice`], [`SliceMut`]); [`CommunicatorExt`] adds typed
/// conveniences.
pub trait Communicator: Send + Sync {
    /// This rank's index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group.
    fn size(&self) -> usize;
    /// The backend's name (`"threads"`, `"mpi"`, `"nccl"`), for receipts and errors.
    fn backend(&self) -> &'static str;
    /// The GPU whose memory this rank's collectives move: `Some` on the NCCL backend (the
    /// rank's device), `None` (the default) on the host-memory backends. Tensors of a
    /// `DeviceMesh` over this communicator live there.
    fn device(&self) -> Option<dtensor_kernels::cuda::Device> {
        None
    }

    /// Reduces `buf` across ranks, in place; every rank ends with the same bits.
    fn all_reduce(&self, buf: SliceMut<'_>, op: ReduceOp) -> Result<()>;
    /// `recv[r·k .. (r+1)·k] = send` of rank `r`, where `k = send.len()` and
    /// `recv.len() = size·k`.
    fn all_gather(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()>;
    /// Uneven all-gather: rank `r` contributes `counts[r]` elements (its `send`), placed
    /// one after another in rank order; `recv.len() = Σ counts`.
    fn all_gatherv(&self, send: Slice<'_>, recv: SliceMut<'_>, counts: &[usize]) -> Result<()>;
    /// In-place uneven all-gather: `buf` (`Σ counts` elements) already holds this rank's
    /// piece at its position (after `counts[..rank()]`); the peers' pieces are written
    /// around it, so the rank's own piece is never copied (MPI_IN_PLACE).
    ///
    /// The default copies the own piece out and calls [`all_gatherv`](Self::all_gatherv);
    /// backends that can read peers' memory directly override it.
    fn all_gatherv_in_place(&self, buf: SliceMut<'_>, counts: &[usize]) -> Result<()> {
        let off: usize = counts.iter().take(self.rank()).sum();
        let len = counts.get(self.rank()).copied().unwrap_or(0);
        if off + len > buf.len() {
            return Err(Error::InvalidArgument {
                op: "all_gatherv_in_place",
                detail: format!("counts {counts:?} do not fit a buffer of {}", buf.len()),
            });
        }
        dtensor_kernels::with_slice!(SliceMut, buf, |b: T| {
            let own: Vec<T> = b[off..off + len].to_vec();
            self.all_gatherv(
                <T as Element>::slice(&own),
                <T as Element>::slice_mut(b),
                counts,
            )
        })
    }
    /// In-place uneven reduce-scatter: `buf` holds blocks of `counts[0], counts[1], …`;
    /// afterwards this rank's block (after `counts[..rank()]`) holds the reduction of that
    /// block over all ranks. The other blocks of `buf` are left unspecified.
    ///
    /// The default reduces into a temporary and copies it into place; backends that can
    /// read peers' memory directly override it.
    fn reduce_scatterv_in_place(
        &self,
        buf: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let off: usize = counts.iter().take(self.rank()).sum();
        let len = counts.get(self.rank()).copied().unwrap_or(0);
        if off + len > buf.len() {
            return Err(Error::InvalidArgument {
                op: "reduce_scatterv_in_place",
                detail: format!("counts {counts:?} do not fit a buffer of {}", buf.len()),
            });
        }
        dtensor_kernels::with_slice!(SliceMut, buf, |b: T| {
            let mut out: Vec<T> = vec![<T as Element>::zero(); len];
            self.reduce_scatterv(
                <T as Element>::slice(b),
                <T as Element>::slice_mut(&mut out),
                counts,
                op,
            )?;
            b[off..off + len].copy_from_slice(&out);
            Ok(())
        })
    }
    /// Column-block all-gather: rank `p`'s `send` is a row-major `rows × widths[p]` matrix;
    /// `recv` is the row-major `rows × Σ widths` matrix with rank `p`'s columns at offset
    /// `widths[..p]` (an all-gather along a non-leading tensor dim, without a separate
    /// interleaving pass). With `rows = 1` it is [`all_gatherv`](Self::all_gatherv).
    ///
    /// The default gathers contiguously into a temporary and interleaves; backends that
    /// can address peers' memory override it.
    fn all_gather_cols(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        rows: usize,
        widths: &[usize],
    ) -> Result<()> {
        let counts = col_counts("all_gather_cols", rows, widths)?;
        dtensor_kernels::with_slice!(SliceMut, recv, |r: T| {
            let mut tmp: Vec<T> = vec![<T as Element>::zero(); r.len()];
            self.all_gatherv(send, <T as Element>::slice_mut(&mut tmp), &counts)?;
            columns::unpack(&tmp, r, rows, widths);
            Ok(())
        })
    }
    /// Column-block reduce-scatter: `send` is a row-major `rows × Σ widths` matrix; `recv`
    /// (`rows × widths[rank()]`) receives the reduction over ranks of this rank's columns.
    ///
    /// The default packs the column blocks and calls
    /// [`reduce_scatterv`](Self::reduce_scatterv).
    fn reduce_scatter_cols(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        rows: usize,
        widths: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let counts = col_counts("reduce_scatter_cols", rows, widths)?;
        dtensor_kernels::with_slice!(Slice, send, |s: T| {
            let packed = columns::pack(s, rows, widths);
            self.reduce_scatterv(<T as Element>::slice(&packed), recv, &counts, op)
        })
    }
    /// Column-block all-to-all: `send` is this rank's row-major `rows × Σ send_widths`
    /// matrix (`rows` may differ across ranks) whose columns `send_widths[..p]..` go to
    /// rank `p`, as a row-major `rows × send_widths[p]` block; `recv` receives the blocks
    /// from ranks `0, 1, …` one after another, `recv_counts[p]` elements each.
    ///
    /// The default packs the column blocks and calls [`all_to_allv`](Self::all_to_allv).
    fn all_to_all_cols(
        &self,
        send: Slice<'_>,
        rows: usize,
        send_widths: &[usize],
        recv: SliceMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let send_counts = col_counts("all_to_all_cols", rows, send_widths)?;
        dtensor_kernels::with_slice!(Slice, send, |s: T| {
            let packed = columns::pack(s, rows, send_widths);
            self.all_to_allv(
                <T as Element>::slice(&packed),
                &send_counts,
                recv,
                recv_counts,
            )
        })
    }
    /// `recv` = reduction over ranks of block `rank()` of `send`, where `send.len() = size·k`
    /// and `recv.len() = k`.
    fn reduce_scatter(&self, send: Slice<'_>, recv: SliceMut<'_>, op: ReduceOp) -> Result<()>;
    /// Uneven reduce-scatter: `send` is cut into blocks of `counts[0], counts[1], …`; rank
    /// `r` receives the reduction of block `r` (`recv.len() = counts[r]`).
    fn reduce_scatterv(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()>;
    /// Block `p` of `send` goes to rank `p`; block `p` of `recv` comes from rank `p`. All
    /// blocks have `send.len() / size` elements.
    fn all_to_all(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()>;
    /// Uneven all-to-all: `send` holds blocks of `send_counts[p]` elements for rank `p`, one
    /// after another; `recv` receives blocks of `recv_counts[p]` from rank `p`. Rank `p`'s
    /// `send_counts[rank()]` must equal this rank's `recv_counts[p]`.
    fn all_to_allv(
        &self,
        send: Slice<'_>,
        send_counts: &[usize],
        recv: SliceMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()>;
    /// Copies `root`'s `buf` into every other rank's `buf`.
    fn broadcast(&self, buf: SliceMut<'_>, root: usize) -> Result<()>;
    /// Sends `buf` to rank `dst`, matched by the `tag` of its `recv`. Does not wait for the
    /// receiver (the message is buffered), so symmetric exchanges cannot deadlock.
    fn send(&self, buf: Slice<'_>, dst: usize, tag: u32) -> Result<()>;
    /// Receives into `buf` the message rank `src` sent with `tag`; its dtype and length must
    /// match `buf`.
    fn recv(&self, buf: SliceMut<'_>, src: usize, tag: u32) -> Result<()>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// Collective: ranks passing the same `color` form a new group, ordered by `(key, rank)`
    /// (MPI_Comm_split). Failures of any world rank reach the new group too.
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>>;
    /// [`all_reduce`](Self::all_reduce) of device memory (feature `cuda`). The default
    /// refuses: only the NCCL backend moves device memory.
    #[cfg(feature = "cuda")]
    fn all_reduce_device(&self, _buf: DeviceViewMut<'_>, _op: ReduceOp) -> Result<()> {
        Err(device_unsupported(self.backend(), "all_reduce"))
    }
    /// [`all_gather`](Self::all_gather) of device memory (feature `cuda`); the default
    /// refuses.
    #[cfg(feature = "cuda")]
    fn all_gather_device(&self, _send: DeviceView<'_>, _recv: DeviceViewMut<'_>) -> Result<()> {
        Err(device_unsupported(self.backend(), "all_gather"))
    }
    /// [`all_gatherv`](Self::all_gatherv) of device memory (feature `cuda`); the default
    /// refuses.
    #[cfg(feature = "cuda")]
    fn all_gatherv_device(
        &self,
        _send: DeviceView<'_>,
        _recv: DeviceViewMut<'_>,
        _counts: &[usize],
    ) -> Result<()> {
        Err(device_unsupported(self.backend(), "all_gatherv"))
    }
    /// [`reduce_scatter`](Self::reduce_scatter) of device memory (feature `cuda`); the
    /// default refuses.
    #[cfg(feature = "cuda")]
    fn reduce_scatter_device(
        &self,
        _send: DeviceView<'_>,
        _recv: DeviceViewMut<'_>,
        _op: ReduceOp,
    ) -> Result<()> {
        Err(device_unsupported(self.backend(), "reduce_scatter"))
    }
    /// [`reduce_scatterv`](Self::reduce_scatterv) of device memory (feature `cuda`); the
    /// default refuses.
    #[cfg(feature = "cuda")]
    fn reduce_scatterv_device(
        &self,
        _send: DeviceView<'_>,
        _recv: DeviceViewMut<'_>,
        _counts: &[usize],
        _op: ReduceOp,
    ) -> Result<()> {
        Err(device_unsupported(self.backend(), "reduce_scatterv"))
    }
    /// [`all_to_all`](Self::all_to_all) of device memory (feature `cuda`); the default
    /// refuses.
    #[cfg(feature = "cuda")]
    fn all_to_all_device(&self, _send: DeviceView<'_>, _recv: DeviceViewMut<'_>) -> Result<()> {
        Err(device_unsupported(self.backend(), "all_to_all"))
    }
    /// [`all_to_allv`](Self::all_to_allv) of device memory (feature `cuda`); the default
    /// refuses.
    #[cfg(feature = "cuda")]
    fn all_to_allv_device(
        &self,
        _send: DeviceView<'_>,
        _send_counts: &[usize],
        _recv: DeviceViewMut<'_>,
        _recv_counts: &[usize],
    ) -> Result<()> {
        Err(device_unsupported(self.backend(), "all_to_allv"))
    }
    /// [`broadcast`](Self::broadcast) of device memory (feature `cuda`); the default
    /// refuses.
    #[cfg(feature = "cuda")]
    fn broadcast_device(&self, _buf: DeviceViewMut<'_>, _root: usize) -> Result<()> {
        Err(device_unsupported(self.backend(), "broadcast"))
    }
    /// [`send`](Self::send) of device memory (feature `cuda`); the default refuses. Unlike
    /// the host `send`, a device send may wait for its receiver (see the backend's docs).
    #[cfg(feature = "cuda")]
    fn send_device(&self, _buf: DeviceView<'_>, _dst: usize, _tag: u32) -> Result<()> {
        Err(device_unsupported(self.backend(), "send"))
    }
    /// [`recv`](Self::recv) into device memory (feature `cuda`); the default refuses.
    #[cfg(feature = "cuda")]
    fn recv_device(&self, _buf: DeviceViewMut<'_>, _src: usize, _tag: u32) -> Result<()> {
        Err(device_unsupported(self.backend(), "recv"))
    }

    /// Calls and bytes this handle has issued so far.
    fn counters(&self) -> CounterSnapshot;

    /// Names what this communicator carries (a mesh axis) on the [`trace`] timeline; the
    /// first name given sticks. Backends without a timeline ignore it.
    fn set_label(&self, _label: &'static str) {}

    /// Starts [`all_reduce`](Self::all_reduce) of `buf`; [`Request::wait`] returns `buf`
    /// reduced. See [`Request`] for the rules every asynchronous call follows.
    ///
    /// The default (the stand-in for a backend without asynchronous collectives) runs the
    /// blocking call here and returns a completed request: the same results, errors,
    /// order and counters, but no overlap, since it returns only once the collective is
    /// done. The threads and MPI backends override every `start_*` method.
    fn start_all_reduce(&self, mut buf: Buffer, op: ReduceOp) -> Request {
        let r = self.all_reduce(buf.as_slice_mut(), op).map(|()| buf);
        Request::ready("all_reduce", r)
    }
    /// Starts [`all_gather`](Self::all_gather) from `send` into `recv` (`size × send.len()`
    /// elements, its contents overwritten); [`Request::wait`] returns `recv`.
    ///
    /// The default runs the blocking call at start (see
    /// [`start_all_reduce`](Self::start_all_reduce)).
    fn start_all_gather(&self, send: Buffer, mut recv: Buffer) -> Request {
        let r = self
            .all_gather(send.as_slice(), recv.as_slice_mut())
            .map(|()| recv);
        Request::ready("all_gather", r)
    }
    /// Starts [`all_gatherv`](Self::all_gatherv) from `send` into `recv` (`Σ counts`
    /// elements); [`Request::wait`] returns `recv`.
    ///
    /// The default runs the blocking call at start (see
    /// [`start_all_reduce`](Self::start_all_reduce)).
    fn start_all_gatherv(&self, send: Buffer, mut recv: Buffer, counts: &[usize]) -> Request {
        let r = self
            .all_gatherv(send.as_slice(), recv.as_slice_mut(), counts)
            .map(|()| recv);
        Request::ready("all_gatherv", r)
    }
    /// Starts [`reduce_scatter`](Self::reduce_scatter) of `send` (`size × recv.len()`
    /// elements) into `recv`; [`Request::wait`] returns `recv`.
    ///
    /// The default runs the blocking call at start (see
    /// [`start_all_reduce`](Self::start_all_reduce)).
    fn start_reduce_scatter(&self, send: Buffer, mut recv: Buffer, op: ReduceOp) -> Request {
        let r = self
            .reduce_scatter(send.as_slice(), recv.as_slice_mut(), op)
            .map(|()| recv);
        Request::ready("reduce_scatter", r)
    }
    /// Starts [`reduce_scatterv`](Self::reduce_scatterv) of `send` (`Σ counts` elements)
    /// into `recv` (`counts[rank()]`); [`Request::wait`] returns `recv`.
    ///
    /// The default runs the blocking call at start (see
    /// [`start_all_reduce`](Self::start_all_reduce)).
    fn start_reduce_scatterv(
        &self,
        send: Buffer,
        mut recv: Buffer,
        counts: &[usize],
        op: ReduceOp,
    ) -> Request {
        let r = self
            .reduce_scatterv(send.as_slice(), recv.as_slice_mut(), counts, op)
            .map(|()| recv);
        Request::ready("reduce_scatterv", r)
    }

    /// Starts [`all_reduce_device`](Self::all_reduce_device) of `buf` (feature `cuda`);
    /// [`Request::wait`] returns `buf` reduced. The rules of [`Request`] hold as for the
    /// host `start_*` calls.
    ///
    /// The default runs the blocking device call at start and returns a completed request
    /// (so a host-memory backend refuses, with its blocking call's
    /// `InvalidArgument`, "… backend: device buffers need the nccl backend"). The NCCL
    /// backend overrides every `start_*_device` method: the call runs on the rank's NCCL
    /// worker and stream while the caller goes on (see `nccl`'s docs).
    #[cfg(feature = "cuda")]
    fn start_all_reduce_device(&self, mut buf: DeviceBuffer, op: ReduceOp) -> DeviceRequest {
        let r = buf
            .view_mut()
            .and_then(|v| self.all_reduce_device(v, op))
            .map(|()| buf);
        Request::ready("all_reduce", r)
    }
    /// Starts [`all_gather_device`](Self::all_gather_device) from `send` into `recv`
    /// (`size × send.len()` elements, overwritten); [`Request::wait`] returns `recv`. The
    /// default runs the blocking call at start (see
    /// [`start_all_reduce_device`](Self::start_all_reduce_device)).
    #[cfg(feature = "cuda")]
    fn start_all_gather_device(&self, send: DeviceBuffer, mut recv: DeviceBuffer) -> DeviceRequest {
        let r = send
            .view()
            .and_then(|s| Ok((s, recv.view_mut()?)))
            .and_then(|(s, r)| self.all_gather_device(s, r));
        Request::ready("all_gather", r.map(|()| recv))
    }
    /// Starts [`all_gatherv_device`](Self::all_gatherv_device) from `send` into `recv`
    /// (`Σ counts` elements); [`Request::wait`] returns `recv`. The default runs the
    /// blocking call at start.
    #[cfg(feature = "cuda")]
    fn start_all_gatherv_device(
        &self,
        send: DeviceBuffer,
        mut recv: DeviceBuffer,
        counts: &[usize],
    ) -> DeviceRequest {
        let r = send
            .view()
            .and_then(|s| Ok((s, recv.view_mut()?)))
            .and_then(|(s, r)| self.all_gatherv_device(s, r, counts));
        Request::ready("all_gatherv", r.map(|()| recv))
    }
    /// Starts [`reduce_scatter_device`](Self::reduce_scatter_device) of `send`
    /// (`size × recv.len()` elements) into `recv`; [`Request::wait`] returns `recv`. The
    /// default runs the blocking call at start.
    #[cfg(feature = "cuda")]
    fn start_reduce_scatter_device(
        &self,
        send: DeviceBuffer,
        mut recv: DeviceBuffer,
        op: ReduceOp,
    ) -> DeviceRequest {
        let r = send
            .view()
            .and_then(|s| Ok((s, recv.view_mut()?)))
            .and_then(|(s, r)| self.reduce_scatter_device(s, r, op));
        Request::ready("reduce_scatter", r.map(|()| recv))
    }
    /// Starts [`reduce_scatterv_device`](Self::reduce_scatterv_device) of `send`
    /// (`Σ counts` elements) into `recv` (`counts[rank()]`); [`Request::wait`] returns
    /// `recv`. The default runs the blocking call at start.
    #[cfg(feature = "cuda")]
    fn start_reduce_scatterv_device(
        &self,
        send: DeviceBuffer,
        mut recv: DeviceBuffer,
        counts: &[usize],
        op: ReduceOp,
    ) -> DeviceRequest {
        let r = send
            .view()
            .and_then(|s| Ok((s, recv.view_mut()?)))
            .and_then(|(s, r)| self.reduce_scatterv_device(s, r, counts, op));
        Request::ready("reduce_scatterv", r.map(|()| recv))
    }
}

/// The refusal of a device call by a host-memory backend.
#[cfg(feature = "cuda")]
pub(crate) fn device_unsupported(backend: &'static str, op: &'static str) -> Error {
    Error::InvalidArgument {
        op,
        detail: format!("{backend} backend: device buffers need the nccl backend"),
    }
}

/// The element counts of column blocks ([`columns::counts`]), or `InvalidArgument` if they
/// overflow.
pub(crate) fn col_counts(op: &'static str, rows: usize, widths: &[usize]) -> Result<Vec<usize>> {
    columns::counts(rows, widths).ok_or_else(|| Error::InvalidArgument {
        op,
        detail: format!("{rows} rows x widths {widths:?} overflow usize"),
    })
}

/// Typed conveniences over [`Communicator`], for any `T: Element`.
pub trait CommunicatorExt: Communicator {
    /// [`all_reduce`](Communicator::all_reduce) of a typed slice, in place: every rank ends
    /// with the same bits.
    fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce(T::slice_mut(buf), op)
    }
    /// All-gather of equal pieces into a new vector.
    fn all_gather_vec<T: Element>(&self, send: &[T]) -> Result<Vec<T>> {
        let mut out = vec![T::zero(); send.len() * self.size()];
        self.all_gather(T::slice(send), T::slice_mut(&mut out))?;
        Ok(out)
    }
    /// [`broadcast`](Communicator::broadcast) of a typed slice: `root`'s elements
    /// overwrite every other rank's `buf` (same length on every rank).
    fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast(T::slice_mut(buf), root)
    }
    /// [`start_all_reduce`](Communicator::start_all_reduce) of a `Vec`: `wait` returns it
    /// reduced.
    fn start_all_reduce_vec<T: StorageElement>(
        &self,
        buf: Vec<T>,
        op: ReduceOp,
    ) -> Request<Vec<T>> {
        self.start_all_reduce(Buffer::from_vec(buf), op).typed()
    }
    /// [`start_all_gather`](Communicator::start_all_gather) of a `Vec` into a new one of
    /// `size × send.len()` elements, which `wait` returns.
    fn start_all_gather_vec<T: StorageElement>(&self, send: Vec<T>) -> Request<Vec<T>> {
        let recv = vec![T::zero(); send.len() * self.size()];
        self.start_all_gather(Buffer::from_vec(send), Buffer::from_vec(recv))
            .typed()
    }
    /// [`start_reduce_scatter`](Communicator::start_reduce_scatter) of a `Vec` of
    /// `size × k` elements into a new one of `k`, which `wait` returns.
    fn start_reduce_scatter_vec<T: StorageElement>(
        &self,
        send: Vec<T>,
        op: ReduceOp,
    ) -> Request<Vec<T>> {
        let recv = vec![T::zero(); send.len() / self.size().max(1)];
        self.start_reduce_scatter(Buffer::from_vec(send), Buffer::from_vec(recv), op)
            .typed()
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}
