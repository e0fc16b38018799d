//! An emulator of NCCL's point-to-point semantics over any host communicator, so that the
//! host tests can catch what only the GPU path would otherwise show.
//!
//! Our host backends buffer: a `send` returns at once, and a `recv` takes the oldest
//! message with its tag out of a queue per source. NCCL does neither, and code that is
//! correct on the host can hang or mismatch on GPUs. [`Unbuffered`] wraps a host
//! communicator (the threads backend in tests) and gives its `send` and `recv` the
//! protocol of the [`nccl`](crate::nccl) backend's `send_device` / `recv_device`:
//!
//! 1. the sender sends a header (the caller's dtype, length and tag) on one internal
//!    channel per pair of ranks, then waits for the receiver's answer;
//! 2. the receiver takes the *next* header from that sender (whatever its tag), answers
//!    whether it matches its own dtype, length and tag, and on a match receives the data,
//!    which the sender sends once it has the answer.
//!
//! | NCCL semantics | emulated? |
//! |---|---|
//! | a send completes only once its receiver has posted the matching receive (rendezvous) | yes: `send` returns after the receiver's answer. Two ranks that both send to each other first wait until the inner communicator's timeout ([`Error::Timeout`]), where the NCCL backend waits for its own timeout |
//! | no tags: messages between a pair match in call order | yes: every message travels on one internal channel per pair; a `recv` whose tag differs from the next message's fails on both ends, naming both tags ([`Error::CollectiveMismatch`]). On NCCL itself an untagged mismatch of equal sizes would silently deliver the wrong data; our NCCL backend checks the same header and fails the same way |
//! | one call at a time per rank (the NCCL backend runs a rank's calls on one worker thread) | for `send`/`recv` only: they take a lock shared by the handle and every group split from it, so two threads of a rank never interleave their messages; collectives do not take it |
//! | stream order: a rank's `send`/`recv` queue behind the asynchronous collectives it started before (its one worker and stream) | yes: a `send` or `recv` first waits for every request this rank started, on any of its groups, that has not completed (the request keeps its result for its own `wait`). Blocking collectives do not (they wait for the earlier requests of their own handle, as the inner backend does) |
//! | reduction order (NCCL's ring and tree algorithms choose it) | no: collectives are the inner backend's, unchanged (rank order on the threads backend) |
//! | device memory, streams, NCCL's own timeouts and errors | no: host buffers only (the `*_device` calls go to the inner host backend, which refuses them) |
//!
//! Collectives, `barrier` and labels go to the inner communicator ([`Forward`](crate::Forward)),
//! and `split` returns a wrapped child, so code that builds a mesh over an `Unbuffered` world
//! runs every axis under these rules. [`counters`](Communicator::counters) leaves out the
//! protocol's own messages (a header and an answer per message): a `send` counts once
//! with its payload's bytes, as on NCCL.
//!
//! The conformance suite runs over it on 2 and 4 thread ranks (`tests/unbuffered.rs`),
//! with NCCL's declarations about point-to-point calls and request progress in `UNSUPPORTED` (feature `conformance`); the pipeline schedules and
//! ring attention run over it in the workspace's `tests/rendezvous.rs`, bitwise against
//! the plain threads backend.
//!
//! ```
//! use dtensor_collectives::{threads, unbuffered, Element, Error};
//! use std::time::Duration;
//!
//! let opts = threads::Options { timeout: Duration::from_secs(2) };
//! // Rank 0 sends first, rank 1 receives first: a rendezvous meets.
//! let ok = unbuffered::launch_with(2, opts.clone(), |comm| {
//!     let mut v = [0.0f32; 2];
//!     if comm.rank() == 0 {
//!         comm.send(f32::slice(&[1.0, 2.0]), 1, 7)?;
//!     } else {
//!         comm.recv(f32::slice_mut(&mut v), 0, 7)?;
//!     }
//!     Ok::<_, Error>(v)
//! });
//! assert_eq!(ok[1].as_ref().unwrap(), &[1.0, 2.0]);
//! // Both send first: fine on the buffered threads backend, a timeout here (and a hang
//! // on NCCL).
//! let crossed = unbuffered::launch_with(2, opts, |comm| {
//!     let peer = 1 - comm.rank();
//!     comm.send(f32::slice(&[1.0]), peer, 7)?;
//!     comm.recv(f32::slice_mut(&mut [0.0f32]), peer, 7)
//! });
//! assert!(crossed.iter().all(|r| r.is_err()));
//! ```

use crate::call::{check_p2p_header, p2p_header, P2pHeaderCheck};
use crate::threads::{self, Options, RankError};
use crate::{
    Buffer, CollectiveKind, Communicator, CounterSnapshot, Counters, Element, Error, Pending,
    ReduceOp, Request, Result, Slice, SliceMut,
};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// The internal tag of headers and payloads: one FIFO channel per ordered pair of ranks.
const DATA: u32 = 0;
/// The internal tag of the receiver's answer to a header.
const ANSWER: u32 = 1;

const HEADER_BYTES: u64 = 4 * 8;
const ANSWER_BYTES: u64 = 8;

/// What the emulator lacks of the conformance suite's optional capabilities, with the
/// reason a case that needs one is reported unsupported: what NCCL lacks about
/// point-to-point calls and request progress (the NCCL backend declares these too, and
/// more about its collectives, which the emulator does not emulate). Feature
/// `conformance`.
#[cfg(feature = "conformance")]
pub const UNSUPPORTED: &[(crate::conformance::Need, &str)] = &[
    (
        crate::conformance::Need::BufferedSend,
        "rendezvous sends (as NCCL): a send returns only once its receiver has taken the \
         header, so nothing is buffered",
    ),
    (
        crate::conformance::Need::TagMatching,
        "no tags (as NCCL): messages between a pair arrive in call order, the tag is only \
         checked",
    ),
    (
        crate::conformance::Need::SharedHandle,
        "one send or recv at a time per rank (as NCCL's worker thread): a thread's recv \
         waits behind another thread's send, which waits for the peer's receiver (the \
         collective cases of this need delegate to the inner backend and are reported \
         with it)",
    ),
    (
        crate::conformance::Need::Overlap,
        "send and recv wait for the rank's requests in flight (as NCCL's stream order): the \
         case's send that lets the peers start would wait for the request it is meant to \
         unblock",
    ),
];

/// A host communicator whose `send`/`recv` follow NCCL's semantics (see the module docs).
pub struct Unbuffered {
    inner: Arc<dyn Communicator>,
    /// This rank's state, shared by the groups split from its world.
    rank: Arc<RankState>,
    /// The protocol's own messages, which the inner communicator counted.
    overhead: Counters,
}

/// What NCCL's one worker and stream per rank order: the point-to-point calls, and the
/// asynchronous requests they queue behind.
#[derive(Default)]
struct RankState {
    /// One point-to-point call at a time on this rank.
    p2p: Mutex<()>,
    /// Requests started on this rank (any of its groups), as `send`/`recv` find them.
    in_flight: Mutex<Vec<Weak<Slot>>>,
}

/// A request in flight, shared by the caller's [`Request`] and the rank's next
/// point-to-point call, whichever waits for it first.
type Slot = Mutex<Option<InFlight>>;

enum InFlight {
    Running(Request),
    Done(Result<Buffer>),
}

/// The caller's side of a tracked request.
struct Tracked(Arc<Slot>);

impl Pending for Tracked {
    fn test(&mut self) -> bool {
        match &mut *lock(&self.0) {
            Some(InFlight::Running(r)) => r.test(),
            _ => true,
        }
    }
    fn wait(self: Box<Self>) -> Result<Buffer> {
        // The lock is held while waiting: a point-to-point call on another thread waits
        // for the request too.
        let mut slot = lock(&self.0);
        match slot.take() {
            Some(InFlight::Running(r)) => r.wait(),
            Some(InFlight::Done(result)) => result,
            None => Err(Error::InvalidArgument {
                op: "wait",
                detail: "request already completed".into(),
            }),
        }
    }
}

/// A lock whose poisoning only means another thread panicked mid-call (the inner
/// communicator reports that to the peers).
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Unbuffered {
    /// Wraps one rank's communicator.
    pub fn new(inner: Arc<dyn Communicator>) -> Unbuffered {
        Unbuffered::sharing(inner, Arc::default())
    }

    fn sharing(inner: Arc<dyn Communicator>, rank: Arc<RankState>) -> Unbuffered {
        Unbuffered {
            inner,
            rank,
            overhead: Counters::default(),
        }
    }

    /// The wrapped communicator.
    pub fn inner(&self) -> &Arc<dyn Communicator> {
        &self.inner
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size() || peer == self.rank() {
            return Err(Error::InvalidArgument {
                op,
                detail: format!(
                    "peer {peer} must be another rank of the {} (NCCL cannot send to its own \
                     rank outside a group; unbuffered emulator)",
                    self.size()
                ),
            });
        }
        Ok(())
    }

    /// Starts a point-to-point call: one at a time on this rank, after the requests the
    /// rank started before it (on NCCL they run first on its worker and stream). A
    /// request's own error is its waiter's to see, as on the inner backend.
    fn begin_p2p(&self) -> MutexGuard<'_, ()> {
        let one = lock(&self.rank.p2p);
        let started = std::mem::take(&mut *lock(&self.rank.in_flight));
        for slot in started.iter().filter_map(Weak::upgrade) {
            let mut slot = lock(&slot);
            *slot = match slot.take() {
                Some(InFlight::Running(r)) => Some(InFlight::Done(r.wait())),
                other => other,
            };
        }
        one
    }

    /// The caller's request for `r`, which this rank's next point-to-point call waits for.
    fn track(&self, r: Request) -> Request {
        let op = r.op();
        let slot = Arc::new(Mutex::new(Some(InFlight::Running(r))));
        let mut in_flight = lock(&self.rank.in_flight);
        in_flight.retain(|w| w.strong_count() > 0);
        in_flight.push(Arc::downgrade(&slot));
        Request::new(op, Box::new(Tracked(slot)))
    }
}

// Only the point-to-point calls, `split` (a wrapped child), the counters and the requests'
// tracking change; every other call is the inner communicator's.
impl crate::Forward for Unbuffered {
    fn inner(&self) -> &dyn Communicator {
        &*self.inner
    }

    fn send(&self, buf: Slice<'_>, dst: usize, tag: u32) -> Result<()> {
        const OP: &str = "send";
        self.check_peer(OP, dst)?;
        let _one = self.begin_p2p();
        let (dtype, len) = (buf.dtype(), buf.len());
        // NCCL's header (`call::p2p_header`), as i64 words: the inner backend's dtype.
        let header = p2p_header(dtype, len, tag).map(|w| w as i64);
        self.inner.send(i64::slice(&header), dst, DATA)?;
        self.overhead.record(CollectiveKind::Send, HEADER_BYTES, 0);
        let mut answer = [0i64];
        self.inner.recv(i64::slice_mut(&mut answer), dst, ANSWER)?;
        self.overhead.record(CollectiveKind::Recv, 0, ANSWER_BYTES);
        if answer[0] != 1 {
            return Err(Error::CollectiveMismatch {
                op: OP,
                backend: self.inner.backend(),
                size: self.inner.size(),
                detail: format!(
                    "rank {dst} refused this rank's message ({dtype} x {len}, tag {tag}): its \
                     recv expected another dtype, length or tag (unbuffered emulator: \
                     messages between two ranks match in call order, as on NCCL)"
                ),
            });
        }
        self.inner.send(buf, dst, DATA)
    }

    fn recv(&self, buf: SliceMut<'_>, src: usize, tag: u32) -> Result<()> {
        const OP: &str = "recv";
        self.check_peer(OP, src)?;
        let _one = self.begin_p2p();
        let (dtype, len) = (buf.dtype(), buf.len());
        let mut header = [0i64; 4];
        self.inner.recv(i64::slice_mut(&mut header), src, DATA)?;
        self.overhead.record(CollectiveKind::Recv, 0, HEADER_BYTES);
        let check = check_p2p_header(&header.map(|w| w as u64), dtype, len, tag);
        let agrees = check == P2pHeaderCheck::Agrees;
        self.inner
            .send(i64::slice(&[i64::from(agrees)]), src, ANSWER)?;
        self.overhead.record(CollectiveKind::Send, ANSWER_BYTES, 0);
        match check {
            P2pHeaderCheck::Agrees => self.inner.recv(buf, src, DATA),
            P2pHeaderCheck::Message { got_dtype, got_len } => Err(Error::MessageMismatch {
                op: OP,
                src,
                tag,
                got_len,
                got_dtype,
                want_len: len,
                want_dtype: dtype,
            }),
            P2pHeaderCheck::Tag {
                got_dtype,
                got_len,
                got_tag,
            } => Err(Error::CollectiveMismatch {
                op: OP,
                backend: self.inner.backend(),
                size: self.inner.size(),
                detail: format!(
                    "the next message from rank {src} has tag {got_tag} ({} x {got_len}), but \
                     this recv asked for tag {tag} ({dtype} x {len}): NCCL has no tags, \
                     messages between two ranks match in call order, so on NCCL this recv \
                     would take that message (unbuffered emulator)",
                    got_dtype.map_or("an unknown dtype".to_string(), |d| d.to_string()),
                ),
            }),
        }
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        let child = self.inner.split(color, key)?;
        Ok(Arc::new(Unbuffered::sharing(child, self.rank.clone())))
    }
    fn counters(&self) -> CounterSnapshot {
        // The overhead first: it is recorded after the inner call counted it, so the
        // inner snapshot taken second holds at least as much.
        let overhead = self.overhead.snapshot();
        self.inner.counters().since(&overhead)
    }

    fn start_all_reduce(&self, buf: Buffer, op: ReduceOp) -> Request {
        self.track(self.inner.start_all_reduce(buf, op))
    }
    fn start_all_gather(&self, send: Buffer, recv: Buffer) -> Request {
        self.track(self.inner.start_all_gather(send, recv))
    }
    fn start_all_gatherv(&self, send: Buffer, recv: Buffer, counts: &[usize]) -> Request {
        self.track(self.inner.start_all_gatherv(send, recv, counts))
    }
    fn start_reduce_scatter(&self, send: Buffer, recv: Buffer, op: ReduceOp) -> Request {
        self.track(self.inner.start_reduce_scatter(send, recv, op))
    }
    fn start_reduce_scatterv(
        &self,
        send: Buffer,
        recv: Buffer,
        counts: &[usize],
        op: ReduceOp,
    ) -> Request {
        self.track(self.inner.start_reduce_scatterv(send, recv, counts, op))
    }
}

impl fmt::Debug for Unbuffered {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Unbuffered({} rank {} of {})",
            self.backend(),
            self.rank(),
            self.size()
        )
    }
}

/// [`threads::launch_with`] with every rank's world communicator wrapped in
/// [`Unbuffered`]: `options.timeout` bounds every wait, so a rendezvous that never meets
/// is an [`Error::Timeout`], not a hang.
pub fn launch_with<T, E, F>(
    world_size: usize,
    options: Options,
    f: F,
) -> Vec<Result<T, RankError<E>>>
where
    F: Fn(Arc<dyn Communicator>) -> Result<T, E> + Sync,
    T: Send,
    E: Send + fmt::Display,
{
    threads::launch_with(world_size, options, |world| {
        f(Arc::new(Unbuffered::new(world)))
    })
}
