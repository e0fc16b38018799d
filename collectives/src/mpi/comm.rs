//! [`MpiComm`]: one process's end of an MPI communicator, and the data phase of each
//! collective. The collectives themselves live on `MpiCore`, which the handle's blocking
//! calls (on the caller's thread) and its progress worker (the asynchronous `start_*`
//! calls, on the worker's thread) share. The protocol is described in the `mpi` module docs.

use crate::args::{counts_sum, equal_blocks, is_multiple, same_dtype};
use crate::call::wire::{self, Header, Verdict, HEADER_WORDS};
use crate::call::{Call, ROWS_DIFFER};
use crate::columns;
use crate::mismatch::{described_call, split_described};
use crate::progress::{busy_error, Progress};
use crate::{
    Buffer, CollectiveKind, Communicator, CounterSnapshot, Counters, Error, Request, Result,
};
use dtensor_kernels::reduce::reduce_into;
use dtensor_kernels::{chunk_sizes, DType, Element, ReduceOp, Slice, SliceMut};
use mpi::ffi;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard};
use std::time::{Duration, Instant};

const BACKEND: &str = "mpi";
/// Tags on the control communicator.
const TAG_HEADER: c_int = 1;
const TAG_DESCRIBE: c_int = 2;
/// An empty message a rank sends each peer when it gives up on the group (a timeout in the
/// agreement), so that a peer arriving late learns it (see [`MpiCore::agree`]).
const TAG_WITHDRAW: c_int = 3;
/// Words in front of each point-to-point payload: dtype code and length in elements.
const P2P_HEAD: usize = 2;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Panics on an MPI error code. With MPI's default error handler (`MPI_ERRORS_ARE_FATAL`)
/// the library aborts the job before returning one, so this is an internal invariant.
fn ok(rc: c_int, what: &str) {
    assert!(
        rc == ffi::MPI_SUCCESS as c_int,
        "{what} failed with MPI error {rc}"
    );
}

/// Whether `MPI_Finalize` has run (after which no handle may be freed).
pub(crate) fn finalized() -> bool {
    let mut flag: c_int = 0;
    // SAFETY: MPI_Finalized may be called at any time, even before MPI_Init.
    unsafe { ffi::MPI_Finalized(&mut flag) };
    flag != 0
}

/// True once [`finalize_with`] has run `MPI_Finalize`. Handles are `Arc`s and may outlive
/// the `Mpi` that made them, and calling MPI after `MPI_Finalize` is erroneous (OpenMPI
/// happens to abort; another library may crash or hang). So every handle method holds a
/// read lock on this for as long as it uses MPI, and finalizing takes the write lock: a
/// method either sees `true` and makes no MPI call, or runs to its end before
/// `MPI_Finalize` starts. Checking `MPI_Finalized` alone would leave a window between the
/// check and the call in which another thread could finalize.
static FINALIZED: RwLock<bool> = RwLock::new(false);

/// Permission to call MPI for the guard's lifetime, or [`Error::Finalized`]. Taken once
/// per public entry point and never while the same thread already holds one (a second
/// read lock can deadlock behind a waiting writer).
fn alive(op: &'static str) -> Result<RwLockReadGuard<'static, bool>> {
    let guard = FINALIZED.read().unwrap_or_else(PoisonError::into_inner);
    if *guard {
        return Err(Error::Finalized {
            op,
            backend: BACKEND,
        });
    }
    Ok(guard)
}

/// Runs `finalize` (which calls `MPI_Finalize`) once no handle method is inside MPI, and
/// marks MPI finalized for every handle (see [`FINALIZED`]). The caller must not hold an
/// [`alive`] guard.
pub(crate) fn finalize_with(finalize: impl FnOnce()) {
    let mut done = FINALIZED.write().unwrap_or_else(PoisonError::into_inner);
    finalize();
    *done = true;
}

/// The MPI datatype that moves elements of `bytes` bytes. Values are never interpreted by
/// MPI (every reduction runs in our kernels), so unsigned integers of the element's size
/// carry every dtype, bf16 and f16 included, and counts stay in elements.
fn datatype(bytes: usize) -> ffi::MPI_Datatype {
    // SAFETY: reading the predefined datatype handles mpi-sys exports.
    unsafe {
        match bytes {
            2 => ffi::RSMPI_UINT16_T,
            4 => ffi::RSMPI_UINT32_T,
            _ => ffi::RSMPI_UINT64_T,
        }
    }
}

fn status_ignore() -> *mut ffi::MPI_Status {
    // SAFETY: reading a constant mpi-sys exports.
    unsafe { ffi::RSMPI_STATUS_IGNORE }
}

fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading a constant mpi-sys exports.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// An MPI communicator handle this crate owns (freed on drop, unless MPI is finalized).
pub(crate) struct RawComm(pub(crate) ffi::MPI_Comm);

// SAFETY: a communicator handle is an opaque reference into the MPI library, which was
// initialized with MPI_THREAD_MULTIPLE (`init` refuses less), so any thread may use it.
// Collectives on one communicator never run concurrently: the handle's `Progress` orders
// its blocking calls and its worker's requests, and `MpiCore::busy` checks it.
unsafe impl Send for RawComm {}
// SAFETY: as above.
unsafe impl Sync for RawComm {}

impl RawComm {
    /// `MPI_Comm_dup`: collective over `comm`.
    pub(crate) fn dup(comm: ffi::MPI_Comm) -> RawComm {
        let mut out = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
        // SAFETY: `comm` is a valid communicator; MPI writes the new handle.
        unsafe {
            ok(ffi::MPI_Comm_dup(comm, out.as_mut_ptr()), "MPI_Comm_dup");
            RawComm(out.assume_init())
        }
    }
}

impl Drop for RawComm {
    fn drop(&mut self) {
        // Under the lock `finalize_with` takes, so MPI cannot be finalized between the
        // check and the free. `finalized()` also covers an MPI_Finalize run outside
        // `Mpi::finalize` (this crate never does, but the check is cheap).
        let done = FINALIZED.read().unwrap_or_else(PoisonError::into_inner);
        if !*done && !finalized() {
            // SAFETY: an owned, valid communicator, freed once, while MPI is initialized.
            unsafe { ffi::MPI_Comm_free(&mut self.0) };
        }
    }
}

/// An MPI request with the buffers it reads or writes, kept alive until it completes.
struct Pending {
    requests: Vec<ffi::MPI_Request>,
    _buffers: Vec<Vec<u64>>,
}

// SAFETY: requests are opaque handles into the thread-safe (MPI_THREAD_MULTIPLE) library.
unsafe impl Send for Pending {}

impl Pending {
    /// Tests the requests; true once all are complete (and freed by MPI).
    fn test(&mut self) -> bool {
        let mut flag: c_int = 0;
        // SAFETY: valid (or null) requests whose buffers this struct keeps alive.
        unsafe {
            ok(
                ffi::MPI_Testall(
                    self.requests.len() as c_int,
                    self.requests.as_mut_ptr(),
                    &mut flag,
                    status_ignore(),
                ),
                "MPI_Testall",
            )
        };
        flag != 0
    }
}

/// A received point-to-point message whose dtype or length did not match the buffer of
/// the `recv` that got it: it stays queued here for the next `recv` from that source.
struct Parked {
    dtype: DType,
    len: usize,
    /// The whole message: [`P2P_HEAD`] words, then the payload.
    message: Vec<u64>,
}

/// Rank `rank()`'s handle on an MPI communicator (the world from
/// [`init`](super::init), or a [`split`](Communicator::split) of it). Each handle counts its
/// own calls and bytes.
///
/// `send` copies the buffer and returns at once; dropping a handle waits (up to the
/// timeout) until MPI has delivered its sends, so a message nobody receives delays the drop.
///
/// Its asynchronous collectives (`start_*`) run on a progress worker of its own, a thread
/// started with the first request that runs them in start order through the same
/// agreement and data phases as the blocking calls (see the `mpi` module docs for why a
/// thread, and [`crate::Request`] for the rules). The handle's drop lets the worker finish
/// what was started, then joins it.
///
/// Invariants: `data` and `ctrl` have the same members in the same order (`ctrl` is a
/// duplicate of `data`, so the headers never mix with data or user messages); `members[r]`
/// is the world rank of group rank `r`; once `failed` is set, every collective returns it.
pub struct MpiComm {
    core: Arc<MpiCore>,
    progress: Progress,
}

/// What runs a handle's collectives (see the module docs); the fields' invariants are
/// [`MpiComm`]'s.
pub(crate) struct MpiCore {
    data: RawComm,
    ctrl: RawComm,
    rank: usize,
    size: usize,
    members: Vec<usize>,
    timeout: Duration,
    counters: Counters,
    /// A collective is in flight on this handle (two at once would mix their messages).
    /// `Progress` already serializes the handle's collectives; this is the last line.
    busy: AtomicBool,
    /// Reused receive space for reductions and in-place gathers (u64: aligned for every
    /// dtype), so a collective does not page-fault a fresh allocation each call.
    scratch: Mutex<Vec<u64>>,
    /// Reused send space: column blocks packed one after another before they are sent
    /// (`reduce_scatter_cols`, `all_to_all_cols`). Locked before `scratch` when both are.
    packed: Mutex<Vec<u64>>,
    /// `send`s not yet known complete (MPI may still read their buffers).
    sending: Mutex<Vec<Pending>>,
    /// Per `(src, tag)`: messages taken off MPI's queue but not yet delivered. Held for
    /// the whole of a `recv`, so that concurrent `recv`s from one `(src, tag)` take the
    /// queue and MPI's messages in order; a `send` from another thread only needs
    /// `sending`.
    parked: Mutex<HashMap<(usize, u32), VecDeque<Parked>>>,
    /// A timeout or a departed peer: the group cannot run collectives any more.
    failed: Mutex<Option<Error>>,
}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.core.rank)
            .field("size", &self.core.size)
            .field("world_ranks", &self.core.members)
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

/// Rank and size of a communicator.
fn rank_size(comm: ffi::MPI_Comm) -> (usize, usize) {
    let (mut rank, mut size): (c_int, c_int) = (0, 0);
    // SAFETY: a valid communicator.
    unsafe {
        ok(ffi::MPI_Comm_rank(comm, &mut rank), "MPI_Comm_rank");
        ok(ffi::MPI_Comm_size(comm, &mut size), "MPI_Comm_size");
    }
    (rank as usize, size as usize)
}

/// `v` as an MPI count, or why not.
fn count(v: usize, what: &str) -> Result<c_int, String> {
    c_int::try_from(v).map_err(|_| {
        format!(
            "{what} is {v} elements, more than MPI's int counts allow ({})",
            c_int::MAX
        )
    })
}

/// Counts and their displacements (prefix sums) as MPI ints, or why not.
fn counts_displs(counts: &[usize], what: &str) -> Result<(Vec<c_int>, Vec<c_int>), String> {
    let mut c = Vec::with_capacity(counts.len());
    let mut d = Vec::with_capacity(counts.len());
    let mut acc = 0usize;
    for &v in counts {
        d.push(count(acc, &format!("the displacement in {what}"))?);
        c.push(count(v, what)?);
        acc += v;
    }
    Ok((c, d))
}

/// `slice` of `len` elements of `T` at the start of `words`, growing it as needed. The
/// words are viewed as `T`s by a checked cast, not a pointer cast.
fn scratch_of<T: Element>(words: &mut Vec<u64>, len: usize) -> &mut [T] {
    let need = (len * std::mem::size_of::<T>()).div_ceil(8);
    if words.len() < need {
        words.resize(need, 0);
    }
    &mut dtensor_kernels::words_as_mut::<T>(&mut words[..need])[..len]
}

/// The send data of a column-block call: with one row, `s` itself; with more, `s`'s column
/// blocks (`counts[p] / rows` columns each; exact, as the counts are `rows · widths`,
/// `col_counts`) packed one after another into the reused send space, whose lock the
/// caller holds in `guard` for as long as it uses the result.
fn packed_cols<'g, 'm: 'g, T: Element>(
    guard: &'g mut Option<MutexGuard<'m, Vec<u64>>>,
    space: &'m Mutex<Vec<u64>>,
    s: &'g [T],
    rows: usize,
    counts: &[usize],
) -> &'g [T] {
    if rows <= 1 {
        return s;
    }
    let blocks = scratch_of::<T>(guard.insert(lock(space)), s.len());
    let widths: Vec<usize> = counts.iter().map(|c| c / rows).collect();
    columns::pack_into(s, blocks, rows, &widths);
    blocks
}

fn ptr<T>(s: &[T]) -> *const c_void {
    s.as_ptr().cast()
}

fn ptr_mut<T>(s: &mut [T]) -> *mut c_void {
    s.as_mut_ptr().cast()
}

/// `s` as a typed slice, if its dtype is `T`'s.
fn typed<T: Element>(s: Slice<'_>) -> Option<&[T]> {
    s.typed()
}

/// The bytes of a typed buffer.
fn bytes_of<'a>(s: &Slice<'a>) -> &'a [u8] {
    let (p, n) = s.as_bytes_ptr();
    // SAFETY: `p` is valid for reads of `n` bytes while `s` lives.
    unsafe { std::slice::from_raw_parts(p, n) }
}

impl MpiCore {
    /// The core of a handle on `data` (whose members are the given world ranks), with a
    /// private duplicate for the headers. Collective over `data`.
    fn new(data: RawComm, members: Vec<usize>, timeout: Duration) -> MpiCore {
        let ctrl = RawComm::dup(data.0);
        let (rank, size) = rank_size(data.0);
        debug_assert_eq!(members.len(), size);
        MpiCore {
            data,
            ctrl,
            rank,
            size,
            members,
            timeout,
            counters: Counters::default(),
            busy: AtomicBool::new(false),
            scratch: Mutex::new(Vec::new()),
            packed: Mutex::new(Vec::new()),
            sending: Mutex::new(Vec::new()),
            parked: Mutex::new(HashMap::new()),
            failed: Mutex::new(None),
        }
    }

    /// This rank's index in the world.
    fn world_rank(&self) -> usize {
        self.members[self.rank]
    }

    /// Peers of `me` in the order `me+1, …, n-1, 0, …, me-1`.
    fn others(&self) -> impl Iterator<Item = usize> {
        let (me, n) = (self.rank, self.size);
        (1..n).map(move |i| (me + i) % n)
    }

    /// Agrees with every peer that they all called the same collective with agreeing
    /// arguments (see `call/wire.rs`): `Ok` means go on with the data phase; otherwise every
    /// rank returns an error. Runs under the busy flag (the caller holds it).
    ///
    /// A rank that times out in the header exchange cannot take back the header it sent
    /// nor the receives it posted (MPI may be using their buffers, so they are leaked). A
    /// peer that arrives later matches them and would pass the exchange against a rank
    /// that has already returned `Timeout`, then wait forever in the data phase. Two
    /// defences:
    ///
    /// 1. The rank that times out also sends every peer a withdrawal (`TAG_WITHDRAW`), and
    ///    each rank looks for one right after its own header exchange: a late rank finds
    ///    it (it was sent before the late rank arrived) and returns `RankFailed` naming
    ///    the rank that gave up, before any data moves. This covers a late arrival, the
    ///    case a slow peer produces.
    /// 2. No round of messages can close the remaining race (a rank timing out at the
    ///    very moment its late peer completes the exchange, before the withdrawal
    ///    lands): a second "go" round would only move it to that round's timeout. So the
    ///    data phase itself is bounded: non-blocking collectives polled up to the
    ///    timeout ([`MpiCore::wait_data`]), and past it the job is aborted with a message
    ///    naming the op and the ranks that withdrew. Aborting, not returning an error,
    ///    because MPI still owns the caller's buffers and cannot give them back.
    ///
    /// Together: every rank ends with an error or the job ends with an abort, within
    /// about twice the timeout; none hangs.
    fn agree(&self, call: &Call, dtype: Option<DType>, invalid: Option<String>) -> Result<()> {
        let op = call.name();
        if let Some(e) = lock(&self.failed).clone() {
            return Err(e);
        }
        let header = call.header(dtype, invalid.is_some(), self.rank);
        let headers = self.all_headers(header, op)?;
        self.check_withdrawn(op)?;
        match wire::check(&headers, self.rank) {
            Verdict::Go => Ok(()),
            Verdict::Invalid => {
                // The peers see a mismatch and exchange descriptions: take part.
                let detail = invalid.unwrap_or_default();
                self.all_strings(op, &described_call(&call.describe(dtype), Some(&detail)));
                Err(Error::InvalidArgument { op, detail })
            }
            Verdict::Departed { rank } => {
                let e = Error::RankFailed {
                    rank: self.members[rank],
                    op,
                    reason: "returned before joining".into(),
                };
                *lock(&self.failed) = Some(e.clone());
                Err(e)
            }
            Verdict::Mismatch(what) => {
                // Every rank has the same verdict, so all name their rows or none do.
                let described = if what == ROWS_DIFFER {
                    call.describe_rows(dtype)
                } else {
                    call.describe(dtype)
                };
                let all = self.all_strings(op, &described_call(&described, invalid.as_deref()));
                let (what, described) = split_described(what, &all);
                Err(Error::CollectiveMismatch {
                    op,
                    backend: BACKEND,
                    size: self.size,
                    detail: wire::mismatch_detail(&what, &described, &self.members),
                })
            }
        }
    }

    /// Sends this rank's header to every peer and receives theirs (indexed by group
    /// rank), waiting at most the timeout. Returning means every peer has arrived, so this
    /// exchange is also a barrier. On timeout the group is failed for good: the pending
    /// receives (and their buffers) are leaked, since MPI may still write into them.
    fn all_headers(&self, mine: Header, op: &'static str) -> Result<Vec<Header>> {
        let n = self.size;
        let mut headers = vec![[0u64; HEADER_WORDS]; n];
        headers[self.rank] = mine;
        if n == 1 {
            return Ok(headers);
        }
        let send = Box::new(mine);
        let words = HEADER_WORDS as c_int;
        let u64_type = datatype(8);
        let peers: Vec<usize> = self.others().collect();
        let mut recvs = vec![null_request(); peers.len()];
        let mut sends = vec![null_request(); peers.len()];
        for (i, &p) in peers.iter().enumerate() {
            // SAFETY: `headers` and `send` outlive the requests: they are waited for
            // below, or leaked on timeout.
            unsafe {
                ok(
                    ffi::MPI_Irecv(
                        headers[p].as_mut_ptr().cast(),
                        words,
                        u64_type,
                        p as c_int,
                        TAG_HEADER,
                        self.ctrl.0,
                        &mut recvs[i],
                    ),
                    "MPI_Irecv",
                );
                ok(
                    ffi::MPI_Isend(
                        send.as_ptr().cast(),
                        words,
                        u64_type,
                        p as c_int,
                        TAG_HEADER,
                        self.ctrl.0,
                        &mut sends[i],
                    ),
                    "MPI_Isend",
                );
            }
        }
        let start = Instant::now();
        let mut pending = Pending {
            requests: recvs,
            _buffers: Vec::new(),
        };
        let mut spins = 0u32;
        while !pending.test() {
            let waited = start.elapsed();
            if waited >= self.timeout {
                let missing = peers
                    .iter()
                    .zip(pending.requests.iter_mut())
                    .filter_map(|(&p, req)| {
                        let mut flag: c_int = 0;
                        // SAFETY: a valid (or completed, null) request.
                        unsafe { ffi::MPI_Test(req, &mut flag, status_ignore()) };
                        (flag == 0).then_some(self.members[p])
                    })
                    .collect();
                std::mem::forget(headers);
                std::mem::forget(send);
                std::mem::forget(sends);
                self.withdraw();
                let e = Error::Timeout {
                    op,
                    waited,
                    missing,
                };
                *lock(&self.failed) = Some(e.clone());
                return Err(e);
            }
            backoff(&mut spins);
        }
        // Every peer has posted its receive for this header, so the sends complete.
        // SAFETY: valid requests over `send`, which lives until they complete.
        unsafe {
            ok(
                ffi::MPI_Waitall(sends.len() as c_int, sends.as_mut_ptr(), status_ignore()),
                "MPI_Waitall",
            )
        };
        drop(send);
        Ok(headers)
    }

    /// Every rank's string (indexed by group rank). Only on the mismatch path, after a
    /// header exchange in which every peer arrived, so the peers are normally all here;
    /// bounded by the timeout all the same, like a data phase (see [`MpiCore::agree`]).
    fn all_strings(&self, op: &'static str, mine: &str) -> Vec<String> {
        let n = self.size;
        let mut out = vec![String::new(); n];
        out[self.rank] = mine.to_string();
        let bytes = mine.as_bytes();
        let byte_type = datatype_u8();
        let mut sends = vec![null_request(); n];
        for p in self.others() {
            // SAFETY: `bytes` lives until the sends complete (waited below).
            unsafe {
                ok(
                    ffi::MPI_Isend(
                        bytes.as_ptr().cast(),
                        bytes.len() as c_int,
                        byte_type,
                        p as c_int,
                        TAG_DESCRIBE,
                        self.ctrl.0,
                        &mut sends[p],
                    ),
                    "MPI_Isend",
                )
            };
        }
        let start = Instant::now();
        for p in self.others() {
            let (mut message, status) = self.probe_or_abort(op, p, TAG_DESCRIBE, start);
            let mut len: c_int = 0;
            // SAFETY: a matched message and its status: receive exactly its size.
            unsafe {
                ok(
                    ffi::MPI_Get_count(&status, byte_type, &mut len),
                    "MPI_Get_count",
                );
                let mut buf = vec![0u8; len.max(0) as usize];
                ok(
                    ffi::MPI_Mrecv(
                        buf.as_mut_ptr().cast(),
                        len,
                        byte_type,
                        &mut message,
                        status_ignore(),
                    ),
                    "MPI_Mrecv",
                );
                out[p] = String::from_utf8_lossy(&buf).into_owned();
            }
        }
        // `bytes` lives until the sends complete (or the job is aborted).
        self.wait_data(op, &mut sends);
        out
    }

    /// `MPI_Improbe` for a message from `p` on `ctrl` until one comes, or abort the job
    /// once `start` is the timeout ago (as in a data phase).
    fn probe_or_abort(
        &self,
        op: &'static str,
        p: usize,
        tag: c_int,
        start: Instant,
    ) -> (ffi::MPI_Message, ffi::MPI_Status) {
        loop {
            let mut flag: c_int = 0;
            let mut message = std::mem::MaybeUninit::<ffi::MPI_Message>::uninit();
            let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
            // SAFETY: a valid communicator; MPI writes the message and status when it
            // sets `flag`, and only then are they read.
            unsafe {
                ok(
                    ffi::MPI_Improbe(
                        p as c_int,
                        tag,
                        self.ctrl.0,
                        &mut flag,
                        message.as_mut_ptr(),
                        status.as_mut_ptr(),
                    ),
                    "MPI_Improbe",
                );
                if flag != 0 {
                    return (message.assume_init(), status.assume_init());
                }
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                self.abort_stalled(op, waited);
            }
            data_backoff(waited);
        }
    }

    /// Runs one collective: busy flag, agreement, then `data` (the data phase), then the
    /// counters.
    fn run(
        &self,
        call: Call,
        dtype: Option<DType>,
        invalid: Option<String>,
        data: impl FnOnce(),
    ) -> Result<()> {
        let op = call.name();
        let _alive = alive(op)?;
        if self.busy.swap(true, Ordering::Acquire) {
            return Err(busy_error(op));
        }
        let _busy = Busy(&self.busy);
        let start = std::time::Instant::now();
        self.agree(&call, dtype, invalid)?;
        let agreed = std::time::Instant::now();
        data();
        let es = dtype.map_or(0, DType::size_in_bytes) as u64;
        let (sent, received) = call.elements_moved(self.rank, self.size);
        self.counters
            .record_timed(call.kind(), sent * es, received * es, start, agreed);
        Ok(())
    }

    /// Reduce-scatter's exchange: block `p` of `send` (blocks of `counts`) goes to rank
    /// `p`; block `rank()` of every rank lands in slot `p` of the returned scratch (slot
    /// `k` at `k · counts[rank()]`, this rank's own block copied in), ready to be reduced
    /// in rank order.
    fn exchange_blocks<T: Element>(
        &self,
        op: &'static str,
        send: &[T],
        counts: &[usize],
    ) -> MutexGuard<'_, Vec<u64>> {
        let (me, n) = (self.rank, self.size);
        let c = counts[me];
        let off: usize = counts[..me].iter().sum();
        let mut scratch = lock(&self.scratch);
        let slots = scratch_of::<T>(&mut scratch, n * c);
        let mut scounts: Vec<c_int> = counts.iter().map(|&v| v as c_int).collect();
        let mut sdispls = Vec::with_capacity(n);
        let mut acc = 0;
        for &v in counts {
            sdispls.push(acc as c_int);
            acc += v;
        }
        let mut rcounts = vec![c as c_int; n];
        let rdispls: Vec<c_int> = (0..n).map(|p| (p * c) as c_int).collect();
        scounts[me] = 0;
        rcounts[me] = 0;
        let t = datatype(std::mem::size_of::<T>());
        let mut req = null_request();
        // SAFETY: the counts and displacements stay inside `send` (Σ counts = its length)
        // and `slots` (n · c elements); validated to fit MPI ints before the agreement.
        // Buffers and arrays outlive the request: `wait_data` returns only once it is
        // complete (or ends the process).
        unsafe {
            ok(
                ffi::MPI_Ialltoallv(
                    ptr(send),
                    scounts.as_ptr(),
                    sdispls.as_ptr(),
                    t,
                    ptr_mut(slots),
                    rcounts.as_ptr(),
                    rdispls.as_ptr(),
                    t,
                    self.data.0,
                    &mut req,
                ),
                "MPI_Ialltoallv",
            )
        };
        self.wait_data(op, std::slice::from_mut(&mut req));
        slots[me * c..(me + 1) * c].copy_from_slice(&send[off..off + c]);
        scratch
    }

    /// `dst = ⊕ slots` in rank order (slots as left by [`exchange_blocks`]).
    fn reduce_slots<T: Element>(scratch: &mut Vec<u64>, n: usize, dst: &mut [T], op: ReduceOp) {
        let c = dst.len();
        let slots = scratch_of::<T>(scratch, n * c);
        let srcs: Vec<&[T]> = if c == 0 {
            vec![&[][..]; n]
        } else {
            slots.chunks(c).collect()
        };
        reduce_into(dst, &srcs, op);
    }

    /// `buf` (blocks of `counts`) all-gathered in place: this rank's block is sent from a
    /// scratch copy (MPI forbids overlapping send and receive buffers, and rsmpi does not
    /// expose `MPI_IN_PLACE`).
    fn gather_in_place<T: Element>(&self, op: &'static str, buf: &mut [T], counts: &[usize]) {
        let me = self.rank;
        let off: usize = counts[..me].iter().sum();
        let own = counts[me];
        let mut scratch = lock(&self.scratch);
        let tmp = scratch_of::<T>(&mut scratch, own);
        tmp.copy_from_slice(&buf[off..off + own]);
        let rcounts: Vec<c_int> = counts.iter().map(|&v| v as c_int).collect();
        let mut displs = Vec::with_capacity(counts.len());
        let mut acc = 0;
        for &v in counts {
            displs.push(acc as c_int);
            acc += v;
        }
        let t = datatype(std::mem::size_of::<T>());
        let mut req = null_request();
        // SAFETY: counts validated to sum to `buf.len()` and to fit MPI ints; buffers and
        // arrays outlive the request (`wait_data`).
        unsafe {
            ok(
                ffi::MPI_Iallgatherv(
                    ptr(tmp),
                    own as c_int,
                    t,
                    ptr_mut(buf),
                    rcounts.as_ptr(),
                    displs.as_ptr(),
                    t,
                    self.data.0,
                    &mut req,
                ),
                "MPI_Iallgatherv",
            )
        };
        self.wait_data(op, std::slice::from_mut(&mut req));
    }

    /// Waits (up to the timeout) for this handle's buffered sends; leaks what is left.
    fn drain_sends(&self) {
        let mut sending = lock(&self.sending);
        let start = Instant::now();
        let mut spins = 0;
        while !sending.is_empty() && start.elapsed() < self.timeout {
            sending.retain_mut(|p| !p.test());
            backoff(&mut spins);
        }
        for p in sending.drain(..) {
            std::mem::forget(p);
        }
    }

    /// Waits for data-phase requests (their buffers and argument arrays must outlive
    /// this call), at most the timeout from now. The data phase starts only after the
    /// agreement, so normally every peer is in it too and this takes transfer time. It
    /// stalls only when a peer gave up on the collective in the window described in
    /// [`MpiCore::agree`]; then the job is aborted: MPI owns the caller's buffers until
    /// the requests complete, which they never will, so returning is not possible.
    fn wait_data(&self, op: &'static str, requests: &mut [ffi::MPI_Request]) {
        let start = Instant::now();
        while !test_all(requests) {
            let waited = start.elapsed();
            if waited >= self.timeout {
                self.abort_stalled(op, waited);
            }
            data_backoff(waited);
        }
    }

    /// Ends the job from a data phase that cannot finish (see [`MpiCore::wait_data`]),
    /// naming the op and the peers known to have given up.
    fn abort_stalled(&self, op: &'static str, waited: Duration) -> ! {
        let left = self.withdrawn();
        let who = if left.is_empty() {
            format!(
                "a peer in group {:?} (world ranks) stopped taking part",
                self.members
            )
        } else {
            format!("ranks {left:?} gave up on it (they timed out waiting for this rank)")
        };
        abort(
            self.world_rank(),
            &format!(
                "{op}: the data phase did not finish within the timeout ({waited:?}): {who}; \
                 aborting the job, since MPI still holds this rank's buffers"
            ),
            1,
        )
    }

    /// A barrier as a data phase: `MPI_Ibarrier`, bounded by [`MpiCore::wait_data`].
    fn data_barrier(&self, op: &'static str) {
        if self.size == 1 {
            return;
        }
        let mut req = null_request();
        // SAFETY: a valid communicator; the request is waited for.
        unsafe { ok(ffi::MPI_Ibarrier(self.data.0, &mut req), "MPI_Ibarrier") };
        self.wait_data(op, std::slice::from_mut(&mut req));
    }

    /// Tells every peer that this rank has left the group (see [`MpiCore::agree`]).
    fn withdraw(&self) {
        static NOTHING: u64 = 0;
        for p in self.others() {
            let mut req = null_request();
            // SAFETY: an empty message (nothing is read from the buffer); freeing the
            // request lets MPI deliver it without anyone waiting on it.
            unsafe {
                ok(
                    ffi::MPI_Isend(
                        (&NOTHING as *const u64).cast(),
                        0,
                        datatype(8),
                        p as c_int,
                        TAG_WITHDRAW,
                        self.ctrl.0,
                        &mut req,
                    ),
                    "MPI_Isend",
                );
                ok(ffi::MPI_Request_free(&mut req), "MPI_Request_free");
            }
        }
    }

    /// The world ranks of the peers whose withdrawal has arrived (taking the messages).
    fn withdrawn(&self) -> Vec<usize> {
        let mut left: Vec<usize> = self
            .others()
            .filter(|&p| {
                let mut flag: c_int = 0;
                let mut message = std::mem::MaybeUninit::<ffi::MPI_Message>::uninit();
                let mut sink = 0u64;
                // SAFETY: a valid communicator; the matched empty message is received
                // once, into nothing.
                unsafe {
                    ok(
                        ffi::MPI_Improbe(
                            p as c_int,
                            TAG_WITHDRAW,
                            self.ctrl.0,
                            &mut flag,
                            message.as_mut_ptr(),
                            status_ignore(),
                        ),
                        "MPI_Improbe",
                    );
                    if flag != 0 {
                        ok(
                            ffi::MPI_Mrecv(
                                (&mut sink as *mut u64).cast(),
                                0,
                                datatype(8),
                                message.as_mut_ptr(),
                                status_ignore(),
                            ),
                            "MPI_Mrecv",
                        );
                    }
                }
                flag != 0
            })
            .map(|p| self.members[p])
            .collect();
        left.sort_unstable();
        left
    }

    /// After a header exchange: `Err` (and the group failed) if a peer has withdrawn, i.e.
    /// the exchange passed only against what a rank that already timed out left behind.
    fn check_withdrawn(&self, op: &'static str) -> Result<()> {
        if ignoring_withdrawals() {
            return Ok(());
        }
        let left = self.withdrawn();
        let Some(&rank) = left.first() else {
            return Ok(());
        };
        let e = Error::RankFailed {
            rank,
            op,
            reason: format!(
                "timed out waiting for this rank and left the group{}",
                if left.len() > 1 {
                    format!("; so did ranks {:?}", &left[1..])
                } else {
                    String::new()
                }
            ),
        };
        *lock(&self.failed) = Some(e.clone());
        Err(e)
    }
}

/// Fault injection for `scripts/mpi-tests.sh`, in debug builds only: with
/// `DTENSOR_MPI_TEST_IGNORE_WITHDRAWALS` set, a late rank does not look for withdrawals,
/// which reproduces on demand the race of `agree`'s note 2 (otherwise a matter of
/// microseconds), so that the bounded data phase and its abort are tested.
fn ignoring_withdrawals() -> bool {
    static IGNORE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    cfg!(debug_assertions)
        && *IGNORE.get_or_init(|| std::env::var_os("DTENSOR_MPI_TEST_IGNORE_WITHDRAWALS").is_some())
}

/// `MPI_Testall`: true once every request is complete (MPI frees them and sets them null).
fn test_all(requests: &mut [ffi::MPI_Request]) -> bool {
    let mut flag: c_int = 0;
    // SAFETY: valid (or null) requests whose buffers the caller keeps alive.
    unsafe {
        ok(
            ffi::MPI_Testall(
                requests.len() as c_int,
                requests.as_mut_ptr(),
                &mut flag,
                status_ignore(),
            ),
            "MPI_Testall",
        )
    };
    flag != 0
}

fn datatype_u8() -> ffi::MPI_Datatype {
    // SAFETY: reading a predefined datatype handle.
    unsafe { ffi::RSMPI_UINT8_T }
}

/// Polls politely: spin briefly, then yield, then sleep (ranks may share cores under
/// `--oversubscribe`).
fn backoff(spins: &mut u32) {
    *spins += 1;
    match *spins {
        0..=64 => std::hint::spin_loop(),
        65..=2048 => std::thread::yield_now(),
        s => std::thread::sleep(Duration::from_micros(u64::from((s - 2048).min(1000)))),
    }
}

/// Polls a data phase, `waited` into it. OpenMPI moves a non-blocking collective on only
/// inside our test calls, so a sleep between tests stalls the transfer: spin for the
/// first millisecond (what a blocking MPI collective does, and most phases end in it),
/// then yield (under `--oversubscribe` the peer may need this core); sleep briefly only
/// once the phase has taken longer than transfers here do, when a peer is most likely
/// gone.
fn data_backoff(waited: Duration) {
    if waited < Duration::from_millis(1) {
        std::hint::spin_loop();
    } else if waited < Duration::from_secs(1) {
        std::thread::yield_now();
    } else {
        std::thread::sleep(Duration::from_micros(100));
    }
}

impl Drop for MpiCore {
    fn drop(&mut self) {
        // After finalize the sends cannot be tested any more (and MPI_Finalize waited
        // for them).
        if let Ok(_alive) = alive("drop") {
            self.drain_sends();
        }
    }
}

/// The collectives themselves, as the handle's blocking calls and its worker's requests
/// both run them (documented on the `Communicator` methods of the same names).
impl MpiCore {
    fn all_reduce(&self, buf: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let call = Call::AllReduce { len: buf.len(), op };
        let name = call.name();
        let dtype = buf.dtype();
        let invalid = count(buf.len(), "buf").err();
        dtensor_kernels::with_slice!(SliceMut, buf, |b: T| {
            self.run(call, Some(dtype), invalid, || {
                if n == 1 {
                    return;
                }
                // Reduce-scatter of `chunk_sizes` blocks, reduced here in rank order, then
                // all-gather: the threads backend's pattern and byte counts.
                let blocks = chunk_sizes(b.len(), n);
                let off: usize = blocks[..me].iter().sum();
                let mut scratch = self.exchange_blocks::<T>(name, b, &blocks);
                Self::reduce_slots(&mut scratch, n, &mut b[off..off + blocks[me]], op);
                drop(scratch);
                self.gather_in_place(name, b, &blocks);
            })
        })
    }

    fn all_gather(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()> {
        let n = self.size;
        let call = Call::AllGather {
            send: send.len(),
            recv: recv.len(),
        };
        let dtype = send.dtype();
        let invalid = same_dtype(&send, &recv)
            .or_else(|| is_multiple(("recv", recv.len()), ("send", send.len()), n))
            .or_else(|| count(recv.len(), "recv").err());
        let k = send.len() as c_int;
        let t = datatype(dtype.size_in_bytes());
        let sp = send.as_bytes_ptr().0;
        let name = call.name();
        dtensor_kernels::with_slice!(SliceMut, recv, |r: T| {
            self.run(call, Some(dtype), invalid, || {
                let mut req = null_request();
                // SAFETY: `recv` holds n · k elements of the same dtype (validated); both
                // buffers outlive the request (`wait_data`).
                unsafe {
                    ok(
                        ffi::MPI_Iallgather(
                            sp.cast(),
                            k,
                            t,
                            ptr_mut(r),
                            k,
                            t,
                            self.data.0,
                            &mut req,
                        ),
                        "MPI_Iallgather",
                    )
                };
                self.wait_data(name, std::slice::from_mut(&mut req));
            })
        })
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

    /// All-gather of `counts[p]` elements per rank; with `rows > 1` each piece is a
    /// `rows`-row column block of the result (see `Communicator::all_gather_cols`),
    /// gathered into the reused scratch and interleaved from there. `rows` is part of the
    /// agreement (the header's rows word), so ranks that agree on counts but not on rows
    /// get `CollectiveMismatch`, as on the threads backend.
    fn all_gather_rows(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        counts: &[usize],
        rows: usize,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let call = Call::AllGatherV {
            send: send.len(),
            recv: recv.len(),
            counts: counts.to_vec(),
            rows,
        };
        let dtype = send.dtype();
        let mut cd = (Vec::new(), Vec::new());
        let invalid = same_dtype(&send, &recv).or_else(|| match counts_sum(counts, "counts", n) {
            Err(e) => Some(e),
            Ok(_) if send.len() != counts[me] => Some(format!(
                "send has {} elements but counts[{me}] = {}",
                send.len(),
                counts[me]
            )),
            Ok(total) if recv.len() != total => Some(format!(
                "recv has {} elements but counts sum to {total}",
                recv.len()
            )),
            Ok(total) => match counts_displs(counts, "counts").and(count(total, "recv")) {
                Ok(_) => {
                    cd = counts_displs(counts, "counts").unwrap_or_default();
                    None
                }
                Err(e) => Some(e),
            },
        });
        let t = datatype(dtype.size_in_bytes());
        let sp = send.as_bytes_ptr().0;
        let own = send.len() as c_int;
        let name = call.name();
        dtensor_kernels::with_slice!(SliceMut, recv, |r: T| {
            self.run(call, Some(dtype), invalid, || {
                let gather = |dst: &mut [T]| {
                    let mut req = null_request();
                    // SAFETY: counts validated against both buffers (`dst` is `recv` or
                    // scratch of its length) and MPI's int range; buffers and arrays
                    // outlive the request (`wait_data`).
                    unsafe {
                        ok(
                            ffi::MPI_Iallgatherv(
                                sp.cast(),
                                own,
                                t,
                                ptr_mut(dst),
                                cd.0.as_ptr(),
                                cd.1.as_ptr(),
                                t,
                                self.data.0,
                                &mut req,
                            ),
                            "MPI_Iallgatherv",
                        )
                    };
                    self.wait_data(name, std::slice::from_mut(&mut req));
                };
                if rows > 1 {
                    let mut scratch = lock(&self.scratch);
                    let blocks = scratch_of::<T>(&mut scratch, r.len());
                    gather(blocks);
                    // Exact: the counts are `rows · widths` (`col_counts`).
                    let widths: Vec<usize> = counts.iter().map(|c| c / rows).collect();
                    columns::unpack(blocks, r, rows, &widths);
                } else {
                    gather(r);
                }
            })
        })
    }

    fn all_gatherv_in_place(&self, buf: SliceMut<'_>, counts: &[usize]) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let own = counts.get(me).copied().unwrap_or(0);
        let call = Call::AllGatherV {
            send: own,
            recv: buf.len(),
            counts: counts.to_vec(),
            rows: 1,
        };
        let dtype = buf.dtype();
        let invalid = match counts_sum(counts, "counts", n) {
            Err(e) => Some(e),
            Ok(total) if buf.len() != total => Some(format!(
                "buffer has {} elements but counts sum to {total}",
                buf.len()
            )),
            Ok(total) => counts_displs(counts, "counts")
                .and(count(total, "buffer"))
                .err(),
        };
        dtensor_kernels::with_slice!(SliceMut, buf, |b: T| {
            let name = call.name();
            self.run(call, Some(dtype), invalid, || {
                self.gather_in_place(name, b, counts)
            })
        })
    }

    fn reduce_scatterv_in_place(
        &self,
        buf: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let own = counts.get(me).copied().unwrap_or(0);
        let call = Call::ReduceScatterV {
            send: buf.len(),
            recv: own,
            counts: counts.to_vec(),
            op,
            rows: 1,
        };
        let dtype = buf.dtype();
        let invalid = match counts_sum(counts, "counts", n) {
            Err(e) => Some(e),
            Ok(total) if buf.len() != total => Some(format!(
                "buffer has {} elements but counts sum to {total}",
                buf.len()
            )),
            Ok(total) => counts_displs(counts, "counts")
                .and(count(total, "buffer"))
                .and(count(own * n, "the received blocks"))
                .err(),
        };
        dtensor_kernels::with_slice!(SliceMut, buf, |b: T| {
            let name = call.name();
            self.run(call, Some(dtype), invalid, || {
                let off: usize = counts[..me].iter().sum();
                let mut scratch = self.exchange_blocks::<T>(name, b, counts);
                Self::reduce_slots(&mut scratch, n, &mut b[off..off + own], op);
            })
        })
    }

    fn reduce_scatter(&self, send: Slice<'_>, recv: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        let n = self.size;
        let call = Call::ReduceScatter {
            send: send.len(),
            recv: recv.len(),
            op,
        };
        let dtype = send.dtype();
        let invalid = same_dtype(&send, &recv)
            .or_else(|| is_multiple(("send", send.len()), ("recv", recv.len()), n))
            .or_else(|| count(send.len(), "send").err());
        let counts = vec![recv.len(); n];
        dtensor_kernels::with_slice!(SliceMut, recv, |r: T| {
            self.run(call, Some(dtype), invalid, || {
                let Some(s) = typed::<T>(send) else {
                    return;
                };
                let mut scratch = self.exchange_blocks::<T>("reduce_scatter", s, &counts);
                Self::reduce_slots(&mut scratch, n, r, op);
            })
        })
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

    /// Reduce-scatter of blocks of `counts[p]` elements; with `rows > 1` the blocks are
    /// `rows`-row column blocks of `send` (see `Communicator::reduce_scatter_cols`),
    /// packed into the reused send space first. `rows` is agreed as in
    /// [`all_gather_rows`](Self::all_gather_rows).
    fn reduce_scatter_rows(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
        rows: usize,
    ) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let call = Call::ReduceScatterV {
            send: send.len(),
            recv: recv.len(),
            counts: counts.to_vec(),
            op,
            rows,
        };
        let dtype = send.dtype();
        let invalid = same_dtype(&send, &recv).or_else(|| match counts_sum(counts, "counts", n) {
            Err(e) => Some(e),
            Ok(total) if send.len() != total => Some(format!(
                "send has {} elements but counts sum to {total}",
                send.len()
            )),
            Ok(_) if recv.len() != counts[me] => Some(format!(
                "recv has {} elements but counts[{me}] = {}",
                recv.len(),
                counts[me]
            )),
            Ok(total) => counts_displs(counts, "counts")
                .and(count(total, "send"))
                .and(count(counts[me] * n, "the received blocks"))
                .err(),
        });
        dtensor_kernels::with_slice!(SliceMut, recv, |r: T| {
            let name = call.name();
            self.run(call, Some(dtype), invalid, || {
                let Some(s) = typed::<T>(send) else {
                    return;
                };
                let mut packed = None;
                let s = packed_cols(&mut packed, &self.packed, s, rows, counts);
                let mut scratch = self.exchange_blocks::<T>(name, s, counts);
                Self::reduce_slots(&mut scratch, n, r, op);
            })
        })
    }

    fn all_to_all(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()> {
        let n = self.size;
        let call = Call::AllToAll {
            send: send.len(),
            recv: recv.len(),
        };
        let dtype = send.dtype();
        let invalid = same_dtype(&send, &recv)
            .or_else(|| equal_blocks(send.len(), recv.len(), n))
            .or_else(|| count(send.len(), "send").err());
        let k = (send.len() / n) as c_int;
        let t = datatype(dtype.size_in_bytes());
        let sp = send.as_bytes_ptr().0;
        dtensor_kernels::with_slice!(SliceMut, recv, |r: T| {
            let name = call.name();
            self.run(call, Some(dtype), invalid, || {
                let mut req = null_request();
                // SAFETY: both buffers hold n · k elements of the same dtype (validated)
                // and outlive the request (`wait_data`).
                unsafe {
                    ok(
                        ffi::MPI_Ialltoall(
                            sp.cast(),
                            k,
                            t,
                            ptr_mut(r),
                            k,
                            t,
                            self.data.0,
                            &mut req,
                        ),
                        "MPI_Ialltoall",
                    )
                };
                self.wait_data(name, std::slice::from_mut(&mut req));
            })
        })
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

    /// All-to-all of `send_counts[p]` elements to rank `p`; with `rows > 1` this rank's
    /// blocks are `rows`-row column blocks of `send` (see `Communicator::all_to_all_cols`),
    /// packed into the reused send space first. `rows` is this rank's own (a rank's rows
    /// may differ from its peers'); the agreement pairs up the element counts.
    fn all_to_all_rows(
        &self,
        send: Slice<'_>,
        send_counts: &[usize],
        recv: SliceMut<'_>,
        recv_counts: &[usize],
        rows: usize,
    ) -> Result<()> {
        let n = self.size;
        let call = Call::AllToAllV {
            send: send.len(),
            recv: recv.len(),
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
            rows,
        };
        let dtype = send.dtype();
        let check = |buf: &str, counts: &[usize], len: usize| -> Option<String> {
            let name = format!("{buf}_counts");
            match counts_sum(counts, &name, n) {
                Err(e) => Some(e),
                Ok(total) if total != len => Some(format!(
                    "{buf} has {len} elements but {name} sum to {total}"
                )),
                Ok(_) => counts_displs(counts, &name).err(),
            }
        };
        let invalid = same_dtype(&send, &recv)
            .or_else(|| check("send", send_counts, send.len()))
            .or_else(|| check("recv", recv_counts, recv.len()));
        let (sc, sd) = counts_displs(send_counts, "").unwrap_or_default();
        let (rc, rd) = counts_displs(recv_counts, "").unwrap_or_default();
        let t = datatype(dtype.size_in_bytes());
        dtensor_kernels::with_slice!(SliceMut, recv, |r: T| {
            let name = call.name();
            self.run(call, Some(dtype), invalid, || {
                let Some(s) = typed::<T>(send) else {
                    return;
                };
                let mut packed = None;
                let s = packed_cols(&mut packed, &self.packed, s, rows, send_counts);
                let mut req = null_request();
                // SAFETY: counts validated against both buffers and MPI's int range; the
                // agreement checked that every pair of ranks agrees on its counts.
                // Buffers and arrays outlive the request (`wait_data`).
                unsafe {
                    ok(
                        ffi::MPI_Ialltoallv(
                            ptr(s),
                            sc.as_ptr(),
                            sd.as_ptr(),
                            t,
                            ptr_mut(r),
                            rc.as_ptr(),
                            rd.as_ptr(),
                            t,
                            self.data.0,
                            &mut req,
                        ),
                        "MPI_Ialltoallv",
                    )
                };
                self.wait_data(name, std::slice::from_mut(&mut req));
            })
        })
    }

    fn broadcast(&self, buf: SliceMut<'_>, root: usize) -> Result<()> {
        let n = self.size;
        let call = Call::Broadcast {
            len: buf.len(),
            root,
        };
        let dtype = buf.dtype();
        let invalid = if root >= n {
            Some(format!("root {root} is out of range for a group of {n}"))
        } else {
            count(buf.len(), "buf").err()
        };
        let len = buf.len() as c_int;
        let t = datatype(dtype.size_in_bytes());
        dtensor_kernels::with_slice!(SliceMut, buf, |b: T| {
            self.run(call, Some(dtype), invalid, || {
                let mut req = null_request();
                // SAFETY: every rank's buffer holds `len` elements (agreed) and outlives
                // the request (`wait_data`).
                unsafe {
                    ok(
                        ffi::MPI_Ibcast(ptr_mut(b), len, t, root as c_int, self.data.0, &mut req),
                        "MPI_Ibcast",
                    )
                };
                self.wait_data("broadcast", std::slice::from_mut(&mut req));
            })
        })
    }

    fn send(&self, buf: Slice<'_>, dst: usize, tag: u32) -> Result<()> {
        let n = self.size;
        if dst >= n {
            return Err(Error::InvalidArgument {
                op: "send",
                detail: format!("destination {dst} is out of range for a group of {n}"),
            });
        }
        let tag = tag_of(tag, "send")?;
        let bytes = bytes_of(&buf);
        // One MPI message per send: the header words, then the payload. Two messages
        // (header, then payload) are not atomic: sends from two threads to one (dst, tag)
        // could interleave as header, header, payload, payload, and the receiver would
        // take a header for data.
        let words = P2P_HEAD + bytes.len().div_ceil(8);
        let count = c_int::try_from(words).map_err(|_| Error::InvalidArgument {
            op: "send",
            detail: format!(
                "buf is {} elements ({} bytes); a message travels as 8-byte words and MPI's \
                 int counts allow at most {} of them",
                buf.len(),
                bytes.len(),
                c_int::MAX
            ),
        })?;
        let _alive = alive("send")?;
        let mut message = vec![0u64; words];
        message[0] = crate::call::dtype_code(buf.dtype());
        message[1] = buf.len() as u64;
        // SAFETY: `message` has room for `bytes.len()` bytes after its head; the two do
        // not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                message[P2P_HEAD..].as_mut_ptr().cast::<u8>(),
                bytes.len(),
            )
        };
        let mut requests = vec![null_request()];
        // SAFETY: the buffer moves into `Pending` (heap storage does not move) and lives
        // until the request completes.
        unsafe {
            ok(
                ffi::MPI_Isend(
                    message.as_ptr().cast(),
                    count,
                    datatype(8),
                    dst as c_int,
                    tag,
                    self.data.0,
                    &mut requests[0],
                ),
                "MPI_Isend",
            );
        }
        let mut sending = lock(&self.sending);
        sending.retain_mut(|p| !p.test());
        sending.push(Pending {
            requests,
            _buffers: vec![message],
        });
        drop(sending);
        self.counters
            .record(CollectiveKind::Send, bytes.len() as u64, 0);
        Ok(())
    }

    fn recv(&self, mut buf: SliceMut<'_>, src: usize, tag: u32) -> Result<()> {
        let n = self.size;
        if src >= n {
            return Err(Error::InvalidArgument {
                op: "recv",
                detail: format!("source {src} is out of range for a group of {n}"),
            });
        }
        let user_tag = tag;
        let tag = tag_of(tag, "recv")?;
        let _alive = alive("recv")?;
        let (want_dtype, want_len) = (buf.dtype(), buf.len());
        let mismatch = |got_dtype: DType, got_len: usize| Error::MessageMismatch {
            op: "recv",
            src,
            tag: user_tag,
            got_len,
            got_dtype,
            want_len,
            want_dtype,
        };
        lock(&self.sending).retain_mut(|p| !p.test());
        let mut parked = lock(&self.parked);
        let (dst, bytes) = buf.as_bytes_mut_ptr();
        debug_assert_eq!(bytes, want_len * want_dtype.size_in_bytes());
        // Delivers a whole message (head, then payload) of this dtype and length.
        let deliver = |message: &[u64]| {
            // SAFETY: the message holds `want_len` elements of `want_dtype` after its
            // head (checked by the caller), i.e. `bytes` bytes; `dst` has room for them.
            unsafe {
                std::ptr::copy_nonoverlapping(message[P2P_HEAD..].as_ptr().cast::<u8>(), dst, bytes)
            };
            self.counters.record(CollectiveKind::Recv, 0, bytes as u64);
        };
        if let Some(queue) = parked.get_mut(&(src, user_tag)) {
            if let Some(front) = queue.front() {
                if front.dtype != want_dtype || front.len != want_len {
                    return Err(mismatch(front.dtype, front.len));
                }
                let m = queue.pop_front().expect("front exists");
                deliver(&m.message);
                return Ok(());
            }
        }
        // Wait (up to the timeout) for the oldest message from (src, tag).
        let start = Instant::now();
        let mut spins = 0;
        let mut message = std::mem::MaybeUninit::<ffi::MPI_Message>::uninit();
        let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
        loop {
            let mut flag: c_int = 0;
            // SAFETY: a valid communicator; MPI writes the message handle and status when
            // flag is set.
            unsafe {
                ok(
                    ffi::MPI_Improbe(
                        src as c_int,
                        tag,
                        self.data.0,
                        &mut flag,
                        message.as_mut_ptr(),
                        status.as_mut_ptr(),
                    ),
                    "MPI_Improbe",
                )
            };
            if flag != 0 {
                break;
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                return Err(Error::Timeout {
                    op: "recv",
                    waited,
                    missing: vec![self.members[src]],
                });
            }
            backoff(&mut spins);
        }
        let mut words: c_int = 0;
        // SAFETY: the status of the matched message.
        unsafe {
            ok(
                ffi::MPI_Get_count(status.as_ptr(), datatype(8), &mut words),
                "MPI_Get_count",
            )
        };
        // Only `send` puts messages on `data` outside collectives, and each is one whole
        // message of u64 words (MPI_UNDEFINED, a negative count, cannot happen).
        let words = usize::try_from(words).expect("a message of whole u64 words");
        let mut whole = vec![0u64; words];
        // SAFETY: the matched message, received once, into exactly its size.
        unsafe {
            ok(
                ffi::MPI_Mrecv(
                    whole.as_mut_ptr().cast(),
                    words as c_int,
                    datatype(8),
                    message.as_mut_ptr(),
                    status_ignore(),
                ),
                "MPI_Mrecv",
            )
        };
        let got_dtype = whole
            .first()
            .copied()
            .and_then(crate::call::dtype_from_code);
        let got_len = whole.get(1).map(|&l| l as usize);
        let (Some(got_dtype), Some(got_len)) = (got_dtype, got_len) else {
            panic!("recv: a {words}-word message from rank {src} without a valid head");
        };
        assert_eq!(
            Some(words),
            got_len
                .checked_mul(got_dtype.size_in_bytes())
                .map(|b| P2P_HEAD + b.div_ceil(8)),
            "recv: the head of a message from rank {src} does not match its size"
        );
        if got_dtype != want_dtype || got_len != want_len {
            parked
                .entry((src, user_tag))
                .or_default()
                .push_back(Parked {
                    dtype: got_dtype,
                    len: got_len,
                    message: whole,
                });
            return Err(mismatch(got_dtype, got_len));
        }
        deliver(&whole);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        // The header exchange completes only once every rank has arrived: a barrier. The
        // bounded `MPI_Ibarrier` after it closes the race in `agree`'s note 2, in which a
        // late rank would return `Ok` where its peer returned `Timeout`.
        self.run(Call::Barrier, None, None, || self.data_barrier("barrier"))
    }

    fn split(&self, color: usize, key: usize) -> Result<MpiCore> {
        let call = Call::Split { color, key };
        let invalid = count(color, "color")
            .and(count(key, "key"))
            .err()
            .map(|e| e.replace(" elements", ""));
        let mut out = None;
        self.run(call, None, invalid, || {
            // MPI_Comm_split has no non-blocking form. Once this bounded barrier completes,
            // every rank is in this data phase and goes straight on to the split, so the
            // blocking calls below cannot wait for a rank that gave up.
            self.data_barrier("split");
            let mut new = std::mem::MaybeUninit::<ffi::MPI_Comm>::uninit();
            // SAFETY: every rank of the group calls MPI_Comm_split (agreed); MPI writes
            // the new handle (never MPI_COMM_NULL: every color is a valid one).
            let new = unsafe {
                ok(
                    ffi::MPI_Comm_split(
                        self.data.0,
                        color as c_int,
                        key as c_int,
                        new.as_mut_ptr(),
                    ),
                    "MPI_Comm_split",
                );
                RawComm(new.assume_init())
            };
            let (_, size) = rank_size(new.0);
            let mut members = vec![0u64; size];
            let me = self.world_rank() as u64;
            // SAFETY: one u64 from each member of the new communicator.
            unsafe {
                ok(
                    ffi::MPI_Allgather(
                        (&me as *const u64).cast(),
                        1,
                        datatype(8),
                        members.as_mut_ptr().cast(),
                        1,
                        datatype(8),
                        new.0,
                    ),
                    "MPI_Allgather",
                )
            };
            let members = members.into_iter().map(|w| w as usize).collect();
            out = Some(MpiCore::new(new, members, self.timeout));
        })?;
        Ok(out.expect("a completed split made a communicator"))
    }

    /// The end-of-program exchange (see `Call::Leave`): `Ok` when every rank of this group
    /// is leaving too; otherwise the peers still in collectives fail with `RankFailed`
    /// and this returns which ranks were left waiting.
    pub(crate) fn leave(&self) -> Result<()> {
        let op = Call::Leave.name();
        let _alive = alive(op)?;
        if self.busy.swap(true, Ordering::Acquire) {
            return Err(Error::InvalidArgument {
                op,
                detail: "a collective is still in flight on the world communicator".into(),
            });
        }
        let _busy = Busy(&self.busy);
        if let Some(e) = lock(&self.failed).clone() {
            return Err(e);
        }
        let header = Call::Leave.header(None, false, self.rank);
        let headers = self.all_headers(header, op)?;
        self.check_withdrawn(op)?;
        let waiting: Vec<usize> = headers
            .iter()
            .enumerate()
            .filter(|(_, h)| h[1] != header[1])
            .map(|(r, _)| self.members[r])
            .collect();
        if waiting.is_empty() {
            self.drain_sends();
            Ok(())
        } else {
            Err(Error::InvalidArgument {
                op,
                detail: format!(
                    "this rank's program ended while ranks {waiting:?} were still in \
                     collectives with it"
                ),
            })
        }
    }
}

impl MpiComm {
    /// A handle on `data` (whose members are the given world ranks), with a private
    /// duplicate for the headers. Collective over `data`.
    pub(crate) fn new(data: RawComm, members: Vec<usize>, timeout: Duration) -> MpiComm {
        MpiComm::of(MpiCore::new(data, members, timeout))
    }

    fn of(core: MpiCore) -> MpiComm {
        let world_rank = core.world_rank();
        MpiComm {
            core: Arc::new(core),
            progress: Progress::new(format!("rank-{world_rank}-progress"), world_rank),
        }
    }

    /// This rank's index in the world.
    pub fn world_rank(&self) -> usize {
        self.core.world_rank()
    }

    /// The end-of-program exchange (see `MpiCore::leave`), after the requests started on
    /// this handle.
    pub(crate) fn leave(&self) -> Result<()> {
        self.gated(Call::Leave.name(), MpiCore::leave)
    }

    /// A blocking collective: after the requests started before it (see `Progress`). The
    /// gate comes before `alive`: a caller holding the finalize read lock while it waits
    /// for the worker, which needs that lock too, could deadlock behind a waiting
    /// `finalize_with`.
    fn gated<R>(&self, op: &'static str, f: impl FnOnce(&MpiCore) -> Result<R>) -> Result<R> {
        let _gate = self.progress.blocking(op)?;
        f(&self.core)
    }

    /// Queues `job` on this handle's progress worker.
    fn start(
        &self,
        op: &'static str,
        job: impl FnOnce(&MpiCore) -> Result<Buffer> + Send + 'static,
    ) -> Request {
        let core = self.core.clone();
        self.progress.submit(op, move || job(&core))
    }
}

impl Drop for MpiComm {
    /// Ends the progress worker once it has finished the requests already started (each
    /// within the timeout, or the job is aborted); the core's drop then waits for the
    /// handle's sends.
    fn drop(&mut self) {
        self.progress.shutdown();
    }
}

impl Communicator for MpiComm {
    crate::progress::forward_to_core!();

    fn rank(&self) -> usize {
        self.core.rank
    }

    fn size(&self) -> usize {
        self.core.size
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        let core = self.gated("split", |c| c.split(color, key))?;
        Ok(Arc::new(MpiComm::of(core)))
    }
}

/// A user tag as an MPI tag (MPI guarantees tags up to 32767; OpenMPI and MPICH allow up
/// to 2³¹−1).
fn tag_of(tag: u32, op: &'static str) -> Result<c_int> {
    c_int::try_from(tag).map_err(|_| Error::InvalidArgument {
        op,
        detail: format!("tag {tag} is larger than MPI allows ({})", c_int::MAX),
    })
}

/// Prints `rank R failed: {message}` to stderr and ends the whole job with exit code
/// `code` (`MPI_Abort`).
pub(super) fn abort(rank: usize, message: &str, code: i32) -> ! {
    // One write of the whole line: ranks share the terminal (or mpirun's pipe), and a line
    // written in pieces interleaves with a peer's (`rank rank 1 failed: …0 failed: …`).
    let line = format!("rank {rank} failed: {message}\n");
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
    let _ = std::io::stderr().flush();
    let _ = std::io::stdout().flush();
    // SAFETY: MPI is initialized (an `Mpi` exists); MPI_Abort does not return.
    unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code) };
    std::process::exit(code)
}
