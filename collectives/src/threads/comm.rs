//! [`ThreadComm`]: one rank's handle on a group, and the data phase of each collective.
//!
//! The protocol is described in the `threads` module docs.

use super::call::{self, Call, Problem};
use super::group::{Group, Message};
use super::view::{Buf, Post, RawBuf, View};
use crate::args::{counts_sum, equal_blocks, is_multiple, same_dtype};
use crate::progress::{busy_error, Progress};
use crate::{
    Buffer, CollectiveKind, Communicator, CounterSnapshot, Counters, Error, Request, Result,
};
use dtensor_kernels::{chunk_sizes, DType, Element, ReduceOp, Slice, SliceMut};
use smallvec::SmallVec;
use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const BACKEND: &str = "threads";

/// Runs `$body` with `$T` bound to the element type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::BF16 => {
                type $T = dtensor_kernels::half::bf16;
                $body
            }
            DType::F16 => {
                type $T = dtensor_kernels::half::f16;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
        }
    };
}

/// Rank `rank()`'s handle on a group of ranks running as threads of one process (see
/// [`super::launch`]). Each handle counts its own calls and bytes.
///
/// Its asynchronous collectives (`start_*`) run on a progress worker of its own, a thread
/// started with the first request, that executes them in start order with the same code
/// as the blocking calls (so the same results, errors and counters) while the caller
/// computes; see [`crate::Request`] for the rules. The worker ends with the handle: its
/// drop lets the worker finish the requests already started, then joins it.
pub struct ThreadComm {
    core: Arc<Core>,
    progress: Progress,
}

/// What runs a handle's collectives: shared by the handle (blocking calls, on the caller's
/// thread) and its progress worker (requests, on the worker's thread). `Progress` keeps
/// the two from running a collective of the handle at the same time.
struct Core {
    group: Arc<Group>,
    rank: usize,
    counters: Counters,
    /// A collective is in flight on this handle (two at once would corrupt the protocol).
    /// `Progress` already serializes the handle's collectives; this is the last line.
    busy: AtomicBool,
}

impl fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThreadComm")
            .field("rank", &self.core.rank)
            .field("size", &self.core.group.size())
            .field("world_ranks", &self.core.group.members)
            .finish()
    }
}

/// Clears the handle's busy flag when a collective ends, however it ends.
struct Busy<'a>(&'a AtomicBool);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

impl Core {
    /// The post of an in-place call on `buf` (whose length must be `Σ counts`), with both
    /// addresses at the buffer's start, and the address of this rank's own block in it
    /// (`None` when the arguments are invalid; the post then says why).
    fn post_in_place(
        &self,
        call: Call,
        buf: &mut SliceMut<'_>,
        counts: &[usize],
    ) -> (Post, Option<RawBuf>) {
        let invalid = match counts_sum(counts, "counts", self.n()) {
            Err(e) => Some(e),
            Ok(total) if buf.len() != total => Some(format!(
                "buffer has {} elements but counts sum to {total}",
                buf.len()
            )),
            Ok(_) => None,
        };
        let post = post(call, invalid, None, Some(buf));
        let own = post.invalid.is_none().then(|| {
            let off: usize = counts[..self.rank].iter().sum();
            // In bounds: the counts sum to the buffer's length (checked above).
            post.recv.block(off, counts[self.rank])
        });
        (post, own)
    }

    /// All-gather of `counts[p]` elements per rank; with `rows > 1` each piece is a
    /// `rows`-row column block of the result (see `Communicator::all_gather_cols`).
    fn all_gather_rows(
        &self,
        send: Slice<'_>,
        mut recv: SliceMut<'_>,
        counts: &[usize],
        rows: usize,
    ) -> Result<()> {
        let (n, r) = (self.n(), self.rank);
        let call = Call::AllGatherV {
            send: send.len(),
            recv: recv.len(),
            counts: counts.to_vec(),
            rows,
        };
        let invalid = same_dtype(&send, &recv).or_else(|| match counts_sum(counts, "counts", n) {
            Err(e) => Some(e),
            Ok(_) if send.len() != counts[r] => Some(format!(
                "send has {} elements but counts[{r}] = {}",
                send.len(),
                counts[r]
            )),
            Ok(total) if recv.len() != total => Some(format!(
                "recv has {} elements but counts sum to {total}",
                recv.len()
            )),
            Ok(_) => None,
        });
        self.run(post(call, invalid, Some(&send), Some(&mut recv)))
            .map(drop)
    }

    /// Reduce-scatter of blocks of `counts[p]` elements; with `rows > 1` the blocks are
    /// `rows`-row column blocks of `send` (see `Communicator::reduce_scatter_cols`).
    fn reduce_scatter_rows(
        &self,
        send: Slice<'_>,
        mut recv: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
        rows: usize,
    ) -> Result<()> {
        let (n, r) = (self.n(), self.rank);
        let call = Call::ReduceScatterV {
            send: send.len(),
            recv: recv.len(),
            counts: counts.to_vec(),
            op,
            rows,
        };
        let invalid = same_dtype(&send, &recv).or_else(|| match counts_sum(counts, "counts", n) {
            Err(e) => Some(e),
            Ok(total) if send.len() != total => Some(format!(
                "send has {} elements but counts sum to {total}",
                send.len()
            )),
            Ok(_) if recv.len() != counts[r] => Some(format!(
                "recv has {} elements but counts[{r}] = {}",
                recv.len(),
                counts[r]
            )),
            Ok(_) => None,
        });
        self.run(post(call, invalid, Some(&send), Some(&mut recv)))
            .map(drop)
    }

    /// All-to-all of `send_counts[p]` elements to rank `p`; with `rows > 1` this rank's
    /// blocks are `rows`-row column blocks of `send` (see `Communicator::all_to_all_cols`).
    fn all_to_all_rows(
        &self,
        send: Slice<'_>,
        send_counts: &[usize],
        mut recv: SliceMut<'_>,
        recv_counts: &[usize],
        rows: usize,
    ) -> Result<()> {
        let n = self.n();
        let call = Call::AllToAllV {
            send: send.len(),
            recv: recv.len(),
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
            rows,
        };
        let check = |buf: &str, counts: &[usize], len: usize| -> Option<String> {
            let name = format!("{buf}_counts");
            match counts_sum(counts, &name, n) {
                Err(e) => Some(e),
                Ok(total) if total != len => Some(format!(
                    "{buf} has {len} elements but {name} sum to {total}"
                )),
                Ok(_) => None,
            }
        };
        let invalid = same_dtype(&send, &recv)
            .or_else(|| check("send", send_counts, send.len()))
            .or_else(|| check("recv", recv_counts, recv.len()));
        self.run(post(call, invalid, Some(&send), Some(&mut recv)))
            .map(drop)
    }

    /// This rank's index in the world (the `launch` group).
    fn world_rank(&self) -> usize {
        self.group.members[self.rank]
    }

    fn n(&self) -> usize {
        self.group.size()
    }

    /// Runs one collective through join, check, data and leave; returns the new group
    /// for `split`.
    fn run(&self, post: Post) -> Result<Option<Arc<Group>>> {
        let op = post.call.name();
        if self.busy.swap(true, Ordering::Acquire) {
            return Err(busy_error(op));
        }
        let _busy = Busy(&self.busy);
        let (n, me) = (self.n(), self.rank);
        let start = std::time::Instant::now();
        let joined = self.group.join(me, post, op)?;
        let arrived = std::time::Instant::now();
        let posts = &joined.posts;
        call::check(posts, me, &self.group.members).map_err(|p| match p {
            Problem::Invalid(detail) => Error::InvalidArgument { op, detail },
            Problem::Mismatch(detail) => Error::CollectiveMismatch {
                op,
                backend: BACKEND,
                size: n,
                detail,
            },
        })?;
        // From here to the last barrier every rank takes the same path (they all passed the
        // same `check`), and nothing returns early: a data phase's panic is caught by
        // `guarded` and resumed only after the barrier that follows it, and `sync` fails
        // (if at all) on every rank alike, after every rank stopped touching peer memory.
        let mine = &posts[me];
        match &mine.call {
            Call::Barrier | Call::Split { .. } => {}
            Call::AllReduce { .. } if n == 1 => {}
            Call::AllReduce { .. } => {
                self.data_phase(posts, Phase::AllReduceOwnBlock, op)?;
                self.data_phase(posts, Phase::AllReducePeerBlocks, op)?;
            }
            _ => self.data_phase(posts, Phase::Move, op)?,
        }
        let es = mine.dtype.map_or(0, DType::size_in_bytes) as u64;
        let (sent, received) = mine.call.elements_moved(me, n);
        self.counters
            .record_timed(mine.call.kind(), sent * es, received * es, start, arrived);
        Ok(joined.split)
    }

    /// Runs one data phase on the joined `posts` (which passed `check`), then the barrier
    /// that ends it.
    fn data_phase(&self, posts: &[Post], phase: Phase, op: &'static str) -> Result<()> {
        let me = self.rank;
        let fault = self.guarded(|| {
            let Some(dtype) = posts[me].dtype else {
                return;
            };
            with_dtype!(dtype, T => {
                // SAFETY (the contract of `View::new`):
                // 1. liveness: the join that produced `posts` completed, and the view and
                //    its slices die inside this closure, before `barrier_after` below; every
                //    poster is blocked in this collective until that barrier (`run` on each
                //    rank returns only after its last barrier, `sync` has no timeout);
                // 2. agreement: `run` calls this only after `call::check` passed, and
                //    `check` gives every rank the same verdict;
                // 3. disjoint roles: `Phase::run` follows the reads/writes table of the
                //    module docs, and every rank runs the same phase between the same
                //    barriers;
                // 4. `T` is the element type `with_dtype!` picked for the posts' dtype.
                let mut view = unsafe { View::<T>::new(posts, me) };
                phase.run(&mut view)
            })
        });
        self.barrier_after(fault, op)
    }

    /// Runs a data phase, catching a panic (a broken internal invariant, or a bounds check
    /// of the `View` that failed) so that this rank still reaches the next barrier instead
    /// of freeing buffers its peers are reading (invariant 4 in `group.rs`). A panic that
    /// escaped here would unwind through `run` and release this rank's buffers while its
    /// peers still read them.
    fn guarded(&self, f: impl FnOnce()) -> Option<Box<dyn Any + Send>> {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(()) => None,
            Err(payload) => {
                self.group
                    .record_fault(self.rank, super::panic_message(payload.as_ref()));
                Some(payload)
            }
        }
    }

    /// The barrier after a data phase; resumes this rank's panic once peers are safe.
    fn barrier_after(&self, fault: Option<Box<dyn Any + Send>>, op: &'static str) -> Result<()> {
        let r = self.group.sync(op);
        if let Some(payload) = fault {
            resume_unwind(payload);
        }
        r
    }
}

/// The post for `call` over these buffers (`send: None` for in-place calls, both `None`
/// for calls that move no data). The addresses are taken last, after every other use of
/// the borrowed buffers.
fn post(
    call: Call,
    invalid: Option<String>,
    send: Option<&Slice<'_>>,
    recv: Option<&mut SliceMut<'_>>,
) -> Post {
    let dtype = send
        .map(Slice::dtype)
        .or_else(|| recv.as_ref().map(|r| r.dtype()));
    let recv = recv.map_or(RawBuf::null(), RawBuf::of_mut);
    // Peers only read through `send` (see `Post::send`).
    let send = send.map_or(recv, RawBuf::of);
    Post {
        call,
        dtype,
        send,
        recv,
        invalid,
    }
}

/// The collectives themselves, as the handle's blocking calls and its worker's requests
/// both run them (the handle's `Communicator` methods documented there).
impl Core {
    fn all_reduce(&self, mut buf: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        let call = Call::AllReduce { len: buf.len(), op };
        self.run(post(call, None, None, Some(&mut buf))).map(drop)
    }

    fn all_gather(&self, send: Slice<'_>, mut recv: SliceMut<'_>) -> Result<()> {
        let n = self.n();
        let call = Call::AllGather {
            send: send.len(),
            recv: recv.len(),
        };
        let invalid = same_dtype(&send, &recv)
            .or_else(|| is_multiple(("recv", recv.len()), ("send", send.len()), n));
        self.run(post(call, invalid, Some(&send), Some(&mut recv)))
            .map(drop)
    }

    fn all_gatherv(&self, send: Slice<'_>, recv: SliceMut<'_>, counts: &[usize]) -> Result<()> {
        self.all_gather_rows(send, recv, counts, 1)
    }

    fn all_gather_cols(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        rows: usize,
        widths: &[usize],
    ) -> Result<()> {
        let counts = crate::col_counts("all_gather_cols", rows, widths)?;
        self.all_gather_rows(send, recv, &counts, rows)
    }

    fn all_gatherv_in_place(&self, mut buf: SliceMut<'_>, counts: &[usize]) -> Result<()> {
        let call = Call::AllGatherV {
            send: counts.get(self.rank).copied().unwrap_or(0),
            recv: buf.len(),
            counts: counts.to_vec(),
            rows: 1,
        };
        let (mut post, own) = self.post_in_place(call, &mut buf, counts);
        // Peers read this rank's piece where it already lies; the data phase skips copying
        // a piece onto itself.
        if let Some(own) = own {
            post.send = own;
        }
        self.run(post).map(drop)
    }

    fn reduce_scatterv_in_place(
        &self,
        mut buf: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let call = Call::ReduceScatterV {
            send: buf.len(),
            recv: counts.get(self.rank).copied().unwrap_or(0),
            counts: counts.to_vec(),
            op,
            rows: 1,
        };
        let (mut post, own) = self.post_in_place(call, &mut buf, counts);
        // Peers read block p of this buffer only for p != rank; this rank writes its own
        // block, reading it (and the peers' same blocks) L1 block by block before writing
        // (`reduce_sources_with`), so the result can land where the block lies.
        if let Some(own) = own {
            post.recv = own;
        }
        self.run(post).map(drop)
    }

    fn reduce_scatter(&self, send: Slice<'_>, mut recv: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        let n = self.n();
        let call = Call::ReduceScatter {
            send: send.len(),
            recv: recv.len(),
            op,
        };
        let invalid = same_dtype(&send, &recv)
            .or_else(|| is_multiple(("send", send.len()), ("recv", recv.len()), n));
        self.run(post(call, invalid, Some(&send), Some(&mut recv)))
            .map(drop)
    }

    fn reduce_scatterv(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.reduce_scatter_rows(send, recv, counts, op, 1)
    }

    fn reduce_scatter_cols(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        rows: usize,
        widths: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let counts = crate::col_counts("reduce_scatter_cols", rows, widths)?;
        self.reduce_scatter_rows(send, recv, &counts, op, rows)
    }

    fn all_to_all(&self, send: Slice<'_>, mut recv: SliceMut<'_>) -> Result<()> {
        let n = self.n();
        let call = Call::AllToAll {
            send: send.len(),
            recv: recv.len(),
        };
        let invalid = same_dtype(&send, &recv).or_else(|| equal_blocks(send.len(), recv.len(), n));
        self.run(post(call, invalid, Some(&send), Some(&mut recv)))
            .map(drop)
    }

    fn all_to_allv(
        &self,
        send: Slice<'_>,
        send_counts: &[usize],
        recv: SliceMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.all_to_all_rows(send, send_counts, recv, recv_counts, 1)
    }

    fn all_to_all_cols(
        &self,
        send: Slice<'_>,
        rows: usize,
        send_widths: &[usize],
        recv: SliceMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let send_counts = crate::col_counts("all_to_all_cols", rows, send_widths)?;
        self.all_to_all_rows(send, &send_counts, recv, recv_counts, rows)
    }

    fn broadcast(&self, mut buf: SliceMut<'_>, root: usize) -> Result<()> {
        let n = self.n();
        let call = Call::Broadcast {
            len: buf.len(),
            root,
        };
        let invalid =
            (root >= n).then(|| format!("root {root} is out of range for a group of {n}"));
        self.run(post(call, invalid, None, Some(&mut buf)))
            .map(drop)
    }

    fn send(&self, buf: Slice<'_>, dst: usize, tag: u32) -> Result<()> {
        let n = self.n();
        if dst >= n {
            return Err(Error::InvalidArgument {
                op: "send",
                detail: format!("destination {dst} is out of range for a group of {n}"),
            });
        }
        let (ptr, bytes) = buf.as_bytes_ptr();
        // SAFETY: `ptr` is valid for reads of `bytes` bytes for the lifetime of `buf`.
        let data = unsafe { std::slice::from_raw_parts(ptr, bytes) }.to_vec();
        let msg = Message {
            dtype: buf.dtype(),
            len: buf.len(),
            bytes: data,
        };
        self.group.post_message(self.rank, dst, tag, msg)?;
        self.counters.record(CollectiveKind::Send, bytes as u64, 0);
        Ok(())
    }

    fn recv(&self, mut buf: SliceMut<'_>, src: usize, tag: u32) -> Result<()> {
        let n = self.n();
        if src >= n {
            return Err(Error::InvalidArgument {
                op: "recv",
                detail: format!("source {src} is out of range for a group of {n}"),
            });
        }
        let (want_dtype, want_len) = (buf.dtype(), buf.len());
        let msg = self.group.take_message(src, self.rank, tag, |m| {
            if m.dtype == want_dtype && m.len == want_len {
                Ok(())
            } else {
                Err(Error::MessageMismatch {
                    op: "recv",
                    src,
                    tag,
                    got_len: m.len,
                    got_dtype: m.dtype,
                    want_len,
                    want_dtype,
                })
            }
        })?;
        let (ptr, bytes) = buf.as_bytes_mut_ptr();
        debug_assert_eq!(bytes, msg.bytes.len());
        // SAFETY: dtype and length match, so `ptr` is valid for writes of
        // `msg.bytes.len()` bytes; the message is owned, so the two do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(msg.bytes.as_ptr(), ptr, msg.bytes.len()) };
        self.counters.record(CollectiveKind::Recv, 0, bytes as u64);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.run(post(Call::Barrier, None, None, None)).map(drop)
    }

    /// The new group and this rank's index in it.
    fn split(&self, color: usize, key: usize) -> Result<(Arc<Group>, usize)> {
        let call = Call::Split { color, key };
        let group = self
            .run(post(call, None, None, None))?
            .expect("a completed split hands every member its group");
        let me = self.world_rank();
        let rank = group
            .members
            .iter()
            .position(|&w| w == me)
            .expect("a split group contains its members");
        Ok((group, rank))
    }
}

impl ThreadComm {
    pub(super) fn new(group: Arc<Group>, rank: usize) -> ThreadComm {
        let world_rank = group.members[rank];
        ThreadComm {
            core: Arc::new(Core {
                group,
                rank,
                counters: Counters::default(),
                busy: AtomicBool::new(false),
            }),
            progress: Progress::new(format!("rank-{world_rank}-progress"), world_rank),
        }
    }

    /// A blocking collective: after the requests started before it (see `Progress`).
    fn gated<R>(&self, op: &'static str, f: impl FnOnce(&Core) -> Result<R>) -> Result<R> {
        let _gate = self.progress.blocking(op)?;
        f(&self.core)
    }

    /// Queues `job` on this handle's progress worker.
    fn start(
        &self,
        op: &'static str,
        job: impl FnOnce(&Core) -> Result<Buffer> + Send + 'static,
    ) -> Request {
        let core = self.core.clone();
        self.progress.submit(op, move || job(&core))
    }
}

impl Drop for ThreadComm {
    /// Ends the progress worker, once it has finished the requests already started.
    fn drop(&mut self) {
        self.progress.shutdown();
    }
}

impl Communicator for ThreadComm {
    crate::progress::forward_to_core!();

    fn rank(&self) -> usize {
        self.core.rank
    }

    fn size(&self) -> usize {
        self.core.n()
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        let (group, rank) = self.gated("split", |c| c.split(color, key))?;
        Ok(Arc::new(ThreadComm::new(group, rank)))
    }
}

/// Peers of `me` in the order `me+1, …, n-1, 0, …, me-1`, so ranks start on different
/// peers instead of all reading rank 0 first.
fn others(me: usize, n: usize) -> impl Iterator<Item = usize> {
    (1..n).map(move |i| (me + i) % n)
}

fn prefix_sums(counts: &[usize]) -> SmallVec<[usize; 16]> {
    let mut out = SmallVec::with_capacity(counts.len() + 1);
    let mut acc = 0;
    out.push(0);
    for &c in counts {
        acc += c;
        out.push(acc);
    }
    out
}

/// The blocks of an all-reduce of `len` elements over `n` ranks, and their offsets.
fn all_reduce_blocks(len: usize, n: usize) -> (SmallVec<[usize; 8]>, SmallVec<[usize; 16]>) {
    let blocks = chunk_sizes(len, n);
    let offsets = prefix_sums(&blocks);
    (blocks, offsets)
}

/// One data phase of a joined collective (see the reads/writes table in the module docs).
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// All-reduce, phase 1: block `me` of this rank's buffer = the reduction of block `me`
    /// of every rank's buffer, in rank order. Peers read only their own block index of this
    /// rank's buffer, never block `me`.
    AllReduceOwnBlock,
    /// All-reduce, phase 2 (after the middle barrier): block `p` of this rank's buffer =
    /// block `p` of rank `p`'s buffer (reduced there in phase 1), for every peer `p`. Peers
    /// read only block `me` of this rank's buffer, which this rank does not write.
    AllReducePeerBlocks,
    /// The single phase of every other collective that moves data.
    Move,
}

impl Phase {
    fn run<T: Element>(self, v: &mut View<'_, T>) {
        match self {
            Phase::AllReduceOwnBlock => all_reduce_own_block(v),
            Phase::AllReducePeerBlocks => all_reduce_peer_blocks(v),
            Phase::Move => move_data(v),
        }
    }
}

fn all_reduce_own_block<T: Element>(v: &mut View<'_, T>) {
    let me = v.me();
    let Call::AllReduce { len, op } = v.posts()[me].call else {
        return;
    };
    let (blocks, offsets) = all_reduce_blocks(len, v.posts().len());
    let off = offsets[me];
    // In place: this rank's own source is exactly the block it writes.
    v.reduce_own(off, blocks[me], op, |_| (Buf::Recv, off));
}

fn all_reduce_peer_blocks<T: Element>(v: &mut View<'_, T>) {
    let (me, n) = (v.me(), v.posts().len());
    let Call::AllReduce { len, .. } = v.posts()[me].call else {
        return;
    };
    let (blocks, offsets) = all_reduce_blocks(len, n);
    for p in others(me, n) {
        v.copy_to_own(offsets[p], p, Buf::Recv, offsets[p], blocks[p]);
    }
}

/// The data phase of every collective but barrier, split and all-reduce: this rank reads
/// its peers' `send` buffers (the root's buffer, for broadcast) and writes only its own
/// `recv` (non-roots only, for broadcast), which no peer reads in these calls.
fn move_data<T: Element>(v: &mut View<'_, T>) {
    let posts = v.posts();
    let (me, n) = (v.me(), posts.len());
    match &posts[me].call {
        Call::AllGather { send: k, .. } => {
            for p in std::iter::once(me).chain(others(me, n)) {
                v.copy_to_own(p * k, p, Buf::Send, 0, *k);
            }
        }
        Call::AllGatherV { counts, rows, .. } if *rows > 1 => {
            // Piece p's row r lands in row r of the result, at column offset c_p.
            let (rows, width) = (*rows, counts.iter().sum::<usize>() / rows);
            let offsets = prefix_sums(counts);
            for p in std::iter::once(me).chain(others(me, n)) {
                let (w, c) = (counts[p] / rows, offsets[p] / rows);
                v.copy_rows_to_own((c, width), p, Buf::Send, (0, w), w, rows);
            }
        }
        Call::AllGatherV { counts, .. } => {
            // In place, this rank's own piece already lies where it goes (`copy_to_own`
            // leaves it).
            let offsets = prefix_sums(counts);
            for p in std::iter::once(me).chain(others(me, n)) {
                v.copy_to_own(offsets[p], p, Buf::Send, 0, counts[p]);
            }
        }
        Call::ReduceScatter { recv: k, op, .. } => {
            v.reduce_own(0, *k, *op, |_| (Buf::Send, me * k));
        }
        Call::ReduceScatterV {
            counts, op, rows, ..
        } if *rows > 1 => {
            // Row r of this rank's column block, reduced across ranks row by row.
            let (rows, width) = (*rows, counts.iter().sum::<usize>() / rows);
            let (w, c) = (counts[me] / rows, counts[..me].iter().sum::<usize>() / rows);
            for r in 0..rows {
                v.reduce_own(r * w, w, *op, |_| (Buf::Send, r * width + c));
            }
        }
        Call::ReduceScatterV { counts, op, .. } => {
            // In place, this rank's own source is exactly its `recv` (its block of the
            // buffer), which `reduce_own` allows.
            let off = counts[..me].iter().sum();
            v.reduce_own(0, counts[me], *op, |_| (Buf::Send, off));
        }
        Call::AllToAll { send: len, .. } => {
            let k = len / n;
            for p in std::iter::once(me).chain(others(me, n)) {
                v.copy_to_own(p * k, p, Buf::Send, me * k, k);
            }
        }
        Call::AllToAllV { recv_counts, .. } => {
            let recv_offsets = prefix_sums(recv_counts);
            for p in std::iter::once(me).chain(others(me, n)) {
                let Call::AllToAllV {
                    send_counts, rows, ..
                } = &posts[p].call
                else {
                    continue;
                };
                let src_off: usize = send_counts[..me].iter().sum();
                let dst = recv_offsets[p];
                if *rows > 1 {
                    // Rank p's block for this rank: columns c.. of each of its rows.
                    let rows = *rows;
                    let width = send_counts.iter().sum::<usize>() / rows;
                    let (w, c) = (send_counts[me] / rows, src_off / rows);
                    v.copy_rows_to_own((dst, w), p, Buf::Send, (c, width), w, rows);
                } else {
                    v.copy_to_own(dst, p, Buf::Send, src_off, recv_counts[p]);
                }
            }
        }
        Call::Broadcast { len, root } if me != *root => {
            v.copy_to_own(0, *root, Buf::Recv, 0, *len);
        }
        Call::Broadcast { .. }
        | Call::AllReduce { .. }
        | Call::Barrier
        | Call::Split { .. }
        | Call::Leave => {}
    }
}
