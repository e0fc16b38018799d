//! [`MpiComm`]: one process's end of an MPI communicator, and the data phase of each
//! collective. The protocol is described in the `mpi` module docs.

use super::call::{self, Call, Header, Verdict, HEADER_WORDS};
use crate::args::{counts_sum, equal_blocks, is_multiple, same_dtype};
use crate::{CollectiveKind, Communicator, CounterSnapshot, Counters, Error, Result};
use dtensor_kernels::reduce::reduce_into;
use dtensor_kernels::{chunk_sizes, DType, Element, ReduceOp, Slice, SliceMut};
use mpi::ffi;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_int, c_void};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

const BACKEND: &str = "mpi";
/// Tags on the control communicator.
const TAG_HEADER: c_int = 1;
const TAG_DESCRIBE: c_int = 2;

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
// Collectives on one communicator never run concurrently: `MpiComm::busy` enforces it.
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
        if !finalized() {
            // SAFETY: an owned, valid communicator, freed once.
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
    data: Vec<u64>,
}

/// Rank `rank()`'s handle on an MPI communicator (the world from
/// [`init`](super::init), or a [`split`](Communicator::split) of it). Each handle counts its
/// own calls and bytes.
///
/// `send` copies the buffer and returns at once; dropping a handle waits (up to the
/// timeout) until MPI has delivered its sends, so a message nobody receives delays the drop.
///
/// Invariants: `data` and `ctrl` have the same members in the same order (`ctrl` is a
/// duplicate of `data`, so the headers never mix with data or user messages); `members[r]`
/// is the world rank of group rank `r`; once `failed` is set, every collective returns it.
pub struct MpiComm {
    data: RawComm,
    ctrl: RawComm,
    rank: usize,
    size: usize,
    members: Vec<usize>,
    timeout: Duration,
    counters: Counters,
    /// A collective is in flight on this handle (two at once would mix their messages).
    busy: AtomicBool,
    /// Reused receive space for reductions and in-place gathers (u64: aligned for every
    /// dtype), so a collective does not page-fault a fresh allocation each call.
    scratch: Mutex<Vec<u64>>,
    /// `send`s not yet known complete (MPI may still read their buffers).
    sending: Mutex<Vec<Pending>>,
    /// Per `(src, tag)`: messages taken off MPI's queue but not yet delivered. Held for
    /// the whole of a `recv`, so the two messages of one `send` are taken together; a
    /// `send` from another thread meanwhile only needs `sending`.
    parked: Mutex<HashMap<(usize, u32), VecDeque<Parked>>>,
    /// A timeout or a departed peer: the group cannot run collectives any more.
    failed: Mutex<Option<Error>>,
}

impl fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("world_ranks", &self.members)
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

impl MpiComm {
    /// A handle on `data` (whose members are the given world ranks), with a private
    /// duplicate for the headers. Collective over `data`.
    pub(crate) fn new(data: RawComm, members: Vec<usize>, timeout: Duration) -> MpiComm {
        let ctrl = RawComm::dup(data.0);
        let (rank, size) = rank_size(data.0);
        debug_assert_eq!(members.len(), size);
        MpiComm {
            data,
            ctrl,
            rank,
            size,
            members,
            timeout,
            counters: Counters::default(),
            busy: AtomicBool::new(false),
            scratch: Mutex::new(Vec::new()),
            sending: Mutex::new(Vec::new()),
            parked: Mutex::new(HashMap::new()),
            failed: Mutex::new(None),
        }
    }

    /// This rank's index in the world.
    pub fn world_rank(&self) -> usize {
        self.members[self.rank]
    }

    /// Peers of `me` in the order `me+1, …, n-1, 0, …, me-1`.
    fn others(&self) -> impl Iterator<Item = usize> {
        let (me, n) = (self.rank, self.size);
        (1..n).map(move |i| (me + i) % n)
    }

    /// Agrees with every peer that they all called the same collective with agreeing
    /// arguments (see `call.rs`): `Ok` means go on with the data phase; otherwise every
    /// rank returns an error. Runs under the busy flag (the caller holds it).
    fn agree(&self, call: &Call, dtype: Option<DType>, invalid: Option<String>) -> Result<()> {
        let op = call.name();
        if let Some(e) = lock(&self.failed).clone() {
            return Err(e);
        }
        let header = call.header(dtype, invalid.is_some(), self.rank);
        let headers = self.all_headers(header, op)?;
        match call::check(&headers, self.rank) {
            Verdict::Go => Ok(()),
            Verdict::Invalid => {
                // The peers see a mismatch and exchange descriptions: take part.
                let detail = invalid.unwrap_or_default();
                self.all_strings(&format!("{}\u{0}{detail}", call.describe(dtype)));
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
                let mine = format!(
                    "{}\u{0}{}",
                    call.describe(dtype),
                    invalid.unwrap_or_default()
                );
                let all = self.all_strings(&mine);
                let (described, invalids): (Vec<String>, Vec<String>) = all
                    .iter()
                    .map(|s| {
                        let (d, i) = s.split_once('\u{0}').unwrap_or((s, ""));
                        (d.to_string(), i.to_string())
                    })
                    .unzip();
                let what = match invalids.iter().position(|i| !i.is_empty()) {
                    Some(r) if what.ends_with("passed invalid arguments") => {
                        format!("{what} ({})", invalids[r])
                    }
                    _ => what,
                };
                Err(Error::CollectiveMismatch {
                    op,
                    backend: BACKEND,
                    size: self.size,
                    detail: call::mismatch_detail(&what, &described, &self.members),
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
    /// header exchange in which every peer arrived, so it needs no timeout.
    fn all_strings(&self, mine: &str) -> Vec<String> {
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
        for p in self.others() {
            // SAFETY: probe for the size, then receive exactly that many bytes.
            unsafe {
                let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::zeroed();
                ok(
                    ffi::MPI_Probe(p as c_int, TAG_DESCRIBE, self.ctrl.0, status.as_mut_ptr()),
                    "MPI_Probe",
                );
                let mut len: c_int = 0;
                ok(
                    ffi::MPI_Get_count(status.as_ptr(), byte_type, &mut len),
                    "MPI_Get_count",
                );
                let mut buf = vec![0u8; len.max(0) as usize];
                ok(
                    ffi::MPI_Recv(
                        buf.as_mut_ptr().cast(),
                        len,
                        byte_type,
                        p as c_int,
                        TAG_DESCRIBE,
                        self.ctrl.0,
                        status_ignore(),
                    ),
                    "MPI_Recv",
                );
                out[p] = String::from_utf8_lossy(&buf).into_owned();
            }
        }
        // SAFETY: valid (or null) requests over `bytes`, alive until here.
        unsafe {
            ok(
                ffi::MPI_Waitall(n as c_int, sends.as_mut_ptr(), status_ignore()),
                "MPI_Waitall",
            )
        };
        out
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
        if self.busy.swap(true, Ordering::Acquire) {
            return Err(Error::InvalidArgument {
                op,
                detail: "another collective is in flight on this handle (a handle is one \
                         rank's end of a group: call its collectives from one thread)"
                    .into(),
            });
        }
        let _busy = Busy(&self.busy);
        self.agree(&call, dtype, invalid)?;
        data();
        let es = dtype.map_or(0, DType::size_in_bytes) as u64;
        let (sent, received) = call.elements_moved(self.rank, self.size);
        self.counters.record(call.kind(), sent * es, received * es);
        Ok(())
    }

    /// Reduce-scatter's exchange: block `p` of `send` (blocks of `counts`) goes to rank
    /// `p`; block `rank()` of every rank lands in slot `p` of the returned scratch (slot
    /// `k` at `k · counts[rank()]`, this rank's own block copied in), ready to be reduced
    /// in rank order.
    fn exchange_blocks<T: Element>(
        &self,
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
        // SAFETY: the counts and displacements stay inside `send` (Σ counts = its length)
        // and `slots` (n · c elements); validated to fit MPI ints before the agreement.
        unsafe {
            ok(
                ffi::MPI_Alltoallv(
                    ptr(send),
                    scounts.as_ptr(),
                    sdispls.as_ptr(),
                    t,
                    ptr_mut(slots),
                    rcounts.as_ptr(),
                    rdispls.as_ptr(),
                    t,
                    self.data.0,
                ),
                "MPI_Alltoallv",
            )
        };
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
    fn gather_in_place<T: Element>(&self, buf: &mut [T], counts: &[usize]) {
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
        // SAFETY: counts validated to sum to `buf.len()` and to fit MPI ints.
        unsafe {
            ok(
                ffi::MPI_Allgatherv(
                    ptr(tmp),
                    own as c_int,
                    t,
                    ptr_mut(buf),
                    rcounts.as_ptr(),
                    displs.as_ptr(),
                    t,
                    self.data.0,
                ),
                "MPI_Allgatherv",
            )
        };
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

impl Drop for MpiComm {
    fn drop(&mut self) {
        if !finalized() {
            self.drain_sends();
        }
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn all_reduce(&self, buf: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let call = Call::AllReduce { len: buf.len(), op };
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
                let mut scratch = self.exchange_blocks::<T>(b, &blocks);
                Self::reduce_slots(&mut scratch, n, &mut b[off..off + blocks[me]], op);
                drop(scratch);
                self.gather_in_place(b, &blocks);
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
        dtensor_kernels::with_slice!(SliceMut, recv, |r: T| {
            self.run(call, Some(dtype), invalid, || {
                // SAFETY: `recv` holds n · k elements of the same dtype (validated).
                unsafe {
                    ok(
                        ffi::MPI_Allgather(sp.cast(), k, t, ptr_mut(r), k, t, self.data.0),
                        "MPI_Allgather",
                    )
                };
            })
        })
    }

    fn all_gatherv(&self, send: Slice<'_>, recv: SliceMut<'_>, counts: &[usize]) -> Result<()> {
        let (n, me) = (self.size, self.rank);
        let call = Call::AllGatherV {
            send: send.len(),
            recv: recv.len(),
            counts: counts.to_vec(),
            rows: 1,
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
        dtensor_kernels::with_slice!(SliceMut, recv, |r: T| {
            self.run(call, Some(dtype), invalid, || {
                // SAFETY: counts validated against both buffers and MPI's int range.
                unsafe {
                    ok(
                        ffi::MPI_Allgatherv(
                            sp.cast(),
                            own,
                            t,
                            ptr_mut(r),
                            cd.0.as_ptr(),
                            cd.1.as_ptr(),
                            t,
                            self.data.0,
                        ),
                        "MPI_Allgatherv",
                    )
                };
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
            self.run(call, Some(dtype), invalid, || {
                self.gather_in_place(b, counts)
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
            self.run(call, Some(dtype), invalid, || {
                let off: usize = counts[..me].iter().sum();
                let mut scratch = self.exchange_blocks::<T>(b, counts);
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
                let mut scratch = self.exchange_blocks::<T>(s, &counts);
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
        let (n, me) = (self.size, self.rank);
        let call = Call::ReduceScatterV {
            send: send.len(),
            recv: recv.len(),
            counts: counts.to_vec(),
            op,
            rows: 1,
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
            self.run(call, Some(dtype), invalid, || {
                let Some(s) = typed::<T>(send) else {
                    return;
                };
                let mut scratch = self.exchange_blocks::<T>(s, counts);
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
            self.run(call, Some(dtype), invalid, || {
                // SAFETY: both buffers hold n · k elements of the same dtype (validated).
                unsafe {
                    ok(
                        ffi::MPI_Alltoall(sp.cast(), k, t, ptr_mut(r), k, t, self.data.0),
                        "MPI_Alltoall",
                    )
                };
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
        let n = self.size;
        let call = Call::AllToAllV {
            send: send.len(),
            recv: recv.len(),
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
            rows: 1,
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
        let sp = send.as_bytes_ptr().0;
        dtensor_kernels::with_slice!(SliceMut, recv, |r: T| {
            self.run(call, Some(dtype), invalid, || {
                // SAFETY: counts validated against both buffers and MPI's int range; the
                // agreement checked that every pair of ranks agrees on its counts.
                unsafe {
                    ok(
                        ffi::MPI_Alltoallv(
                            sp.cast(),
                            sc.as_ptr(),
                            sd.as_ptr(),
                            t,
                            ptr_mut(r),
                            rc.as_ptr(),
                            rd.as_ptr(),
                            t,
                            self.data.0,
                        ),
                        "MPI_Alltoallv",
                    )
                };
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
                // SAFETY: every rank's buffer holds `len` elements (agreed).
                unsafe {
                    ok(
                        ffi::MPI_Bcast(ptr_mut(b), len, t, root as c_int, self.data.0),
                        "MPI_Bcast",
                    )
                };
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
        let len = count(buf.len(), "buf")
            .map_err(|detail| Error::InvalidArgument { op: "send", detail })?;
        let bytes = bytes_of(&buf);
        let mut payload = vec![0u64; bytes.len().div_ceil(8)];
        // SAFETY: `payload` has room for `bytes.len()` bytes; the two do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                payload.as_mut_ptr().cast::<u8>(),
                bytes.len(),
            )
        };
        let head = vec![call::dtype_code(buf.dtype()), buf.len() as u64];
        let mut requests = vec![null_request(); 2];
        // SAFETY: both buffers move into `Pending` (heap storage does not move) and live
        // until the requests complete; two messages on one (dst, tag) arrive in order.
        unsafe {
            ok(
                ffi::MPI_Isend(
                    head.as_ptr().cast(),
                    2,
                    datatype(8),
                    dst as c_int,
                    tag,
                    self.data.0,
                    &mut requests[0],
                ),
                "MPI_Isend",
            );
            ok(
                ffi::MPI_Isend(
                    payload.as_ptr().cast(),
                    len,
                    datatype(buf.dtype().size_in_bytes()),
                    dst as c_int,
                    tag,
                    self.data.0,
                    &mut requests[1],
                ),
                "MPI_Isend",
            );
        }
        let mut sending = lock(&self.sending);
        sending.retain_mut(|p| !p.test());
        sending.push(Pending {
            requests,
            _buffers: vec![head, payload],
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
        let (want_dtype, want_len) = (buf.dtype(), buf.len());
        let es = want_dtype.size_in_bytes();
        let mismatch = |got_dtype: DType, got_len: usize| Error::MessageMismatch {
            op: "recv",
            src,
            tag: user_tag,
            got_len,
            got_dtype,
            want_len,
            want_dtype,
        };
        // Held throughout, so that the two messages of one send are taken together.
        lock(&self.sending).retain_mut(|p| !p.test());
        let mut parked = lock(&self.parked);
        let (dst, bytes) = buf.as_bytes_mut_ptr();
        if let Some(queue) = parked.get_mut(&(src, user_tag)) {
            if let Some(front) = queue.front() {
                if front.dtype != want_dtype || front.len != want_len {
                    return Err(mismatch(front.dtype, front.len));
                }
                let m = queue.pop_front().expect("front exists");
                // SAFETY: same dtype and length, so `dst` has room for `bytes` bytes.
                unsafe { std::ptr::copy_nonoverlapping(m.data.as_ptr().cast(), dst, bytes) };
                self.counters.record(CollectiveKind::Recv, 0, bytes as u64);
                return Ok(());
            }
        }
        // Wait (up to the timeout) for the header message of the oldest send.
        let start = Instant::now();
        let mut spins = 0;
        let mut message = std::mem::MaybeUninit::<ffi::MPI_Message>::uninit();
        loop {
            let mut flag: c_int = 0;
            // SAFETY: a valid communicator; MPI writes the message handle when flag is set.
            unsafe {
                ok(
                    ffi::MPI_Improbe(
                        src as c_int,
                        tag,
                        self.data.0,
                        &mut flag,
                        message.as_mut_ptr(),
                        status_ignore(),
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
        let mut head = [0u64; 2];
        // SAFETY: a matched message of two u64 (our header), received once.
        unsafe {
            ok(
                ffi::MPI_Mrecv(
                    head.as_mut_ptr().cast(),
                    2,
                    datatype(8),
                    message.as_mut_ptr(),
                    status_ignore(),
                ),
                "MPI_Mrecv",
            )
        };
        let got_dtype = call::dtype_from_code(head[0]).unwrap_or(want_dtype);
        let got_len = head[1] as usize;
        let matches = got_dtype == want_dtype && got_len == want_len;
        let mut spare = Vec::new();
        let (into, n_elems) = if matches {
            (dst, want_len)
        } else {
            spare = vec![0u64; (got_len * got_dtype.size_in_bytes()).div_ceil(8)];
            (spare.as_mut_ptr().cast::<u8>(), got_len)
        };
        // SAFETY: the payload follows its header on the same (src, tag) and holds
        // `got_len` elements of `got_dtype`; `into` has room for them.
        unsafe {
            ok(
                ffi::MPI_Recv(
                    into.cast(),
                    n_elems as c_int,
                    datatype(got_dtype.size_in_bytes()),
                    src as c_int,
                    tag,
                    self.data.0,
                    status_ignore(),
                ),
                "MPI_Recv",
            )
        };
        if !matches {
            parked
                .entry((src, user_tag))
                .or_default()
                .push_back(Parked {
                    dtype: got_dtype,
                    len: got_len,
                    data: spare,
                });
            return Err(mismatch(got_dtype, got_len));
        }
        debug_assert_eq!(bytes, want_len * es);
        self.counters.record(CollectiveKind::Recv, 0, bytes as u64);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        // The header exchange completes only once every rank has arrived: a barrier.
        self.run(Call::Barrier, None, None, || {})
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        let call = Call::Split { color, key };
        let invalid = count(color, "color")
            .and(count(key, "key"))
            .err()
            .map(|e| e.replace(" elements", ""));
        let mut out = None;
        self.run(call, None, invalid, || {
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
            out = Some(MpiComm::new(new, members, self.timeout));
        })?;
        let comm = out.expect("a completed split made a communicator");
        Ok(Arc::new(comm))
    }

    fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }
}

impl MpiComm {
    /// The end-of-program exchange (see `Call::Leave`): `Ok` when every rank of this group
    /// is leaving too; otherwise the peers still in collectives fail with `RankFailed`
    /// and this returns which ranks were left waiting.
    pub(crate) fn leave(&self) -> Result<()> {
        let op = Call::Leave.name();
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

/// A user tag as an MPI tag (MPI guarantees tags up to 32767; OpenMPI and MPICH allow up
/// to 2³¹−1).
fn tag_of(tag: u32, op: &'static str) -> Result<c_int> {
    c_int::try_from(tag).map_err(|_| Error::InvalidArgument {
        op,
        detail: format!("tag {tag} is larger than MPI allows ({})", c_int::MAX),
    })
}
