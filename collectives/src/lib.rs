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
//! - `nccl`: later, behind a feature, with a stand-in that says "not compiled with …".
//!
//! Semantics every backend keeps:
//! - Buffers are rank-ordered: in an all-gather, rank `r`'s piece lands at position `r`.
//! - Reductions combine contributions in rank order `0, 1, …, n-1`, so every rank that
//!   receives the same reduced element receives the same bits.
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

mod args;
mod call;
pub mod columns;
mod counters;
mod error;
mod mismatch;
pub mod mpi;
pub mod threads;

pub use counters::{CollectiveKind, CounterSnapshot, Counters};
pub use dtensor_kernels::{DType, Element, ReduceOp, Slice, SliceMut};
pub use error::{Error, Result};

use std::sync::Arc;

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
    /// Calls and bytes this handle has issued so far.
    fn counters(&self) -> CounterSnapshot;
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
    fn all_reduce_in_place<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce(T::slice_mut(buf), op)
    }
    /// All-gather of equal pieces into a new vector.
    fn all_gather_vec<T: Element>(&self, send: &[T]) -> Result<Vec<T>> {
        let mut out = vec![T::zero(); send.len() * self.size()];
        self.all_gather(T::slice(send), T::slice_mut(&mut out))?;
        Ok(out)
    }
    fn broadcast_in_place<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.broadcast(T::slice_mut(buf), root)
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}
