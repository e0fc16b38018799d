//! [`NcclComm`], the handle a rank calls, and the worker thread that owns its raw
//! `ncclComm_t`s and makes every NCCL call (see the module docs for why).

use super::{Options, MULTI_RANK_GPU_ENV};
use crate::call::wire::{self, Header, Verdict, HEADER_WORDS};
use crate::call::{check_p2p_header, p2p_header, Call, P2pHeaderCheck};
use crate::mismatch::{described_call, split_described};
use crate::{
    CollectiveKind, Communicator, CounterSnapshot, Counters, DeviceBuffer, DeviceRequest, Error,
    Pending, ReduceOp, Request, Result, Slice, SliceMut,
};
use cudarc::driver::{
    CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, SyncOnDrop, ValidAsZeroBits,
};
use cudarc::nccl::sys;
use dtensor_kernels::cuda::{Device, DeviceView, DeviceViewMut};
use dtensor_kernels::{with_device_view, DType};
use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(super) const BACKEND: &str = "nccl";

/// How long a rank keeps waiting for a call after one of its peers left, in case the peer
/// completed this call before leaving.
const GRACE: Duration = Duration::from_secs(1);

/// Bytes of one rank's description in a mismatch message (longer ones are cut).
const DESCRIPTION_BYTES: usize = 512;

/// The `version` field of the `ncclConfig_t` we fill: the layout of cudarc's NCCL 2.30
/// bindings (`NCCL_VERSION(2, 30, 0)`).
const CONFIG_VERSION: u32 = 23000;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------------------------------
// NCCL calls and their errors
// ---------------------------------------------------------------------------------------

/// `Ok` for success and for "in progress" (a non-blocking communicator's answer while the
/// call continues in the background).
fn ok(r: sys::ncclResult_t) -> Result<(), sys::ncclResult_t> {
    match r {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
        e => Err(e),
    }
}

/// NCCL's name and text for `code`, and the communicator's last error message.
fn nccl_error(op: &'static str, code: sys::ncclResult_t, raw: sys::ncclComm_t) -> Error {
    // SAFETY: both return pointers to static or communicator-owned NUL-terminated strings
    // (or NULL); `raw` is a live communicator or NULL, which ncclGetLastError accepts.
    let text = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let what = text(unsafe { sys::ncclGetErrorString(code) });
    let last = text(unsafe { sys::ncclGetLastError(raw) });
    let mut detail = format!("NCCL error {code:?}: {what}");
    if !last.is_empty() {
        detail.push_str(&format!(" ({last})"));
    }
    if code == sys::ncclResult_t::ncclInvalidUsage {
        detail.push_str(&format!(
            "; if several ranks share a GPU, NCCL needs version 2.30 or newer and \
             {MULTI_RANK_GPU_ENV}=1"
        ));
    }
    Error::Library {
        op,
        backend: BACKEND,
        detail,
    }
}

fn cuda_error(op: &'static str, e: impl std::fmt::Display) -> Error {
    Error::Library {
        op,
        backend: BACKEND,
        detail: format!("CUDA error: {e}"),
    }
}

/// The state of a communicator's last call: success, in progress, or an error (also when
/// the query itself fails).
fn async_state(raw: sys::ncclComm_t) -> sys::ncclResult_t {
    let mut state = sys::ncclResult_t::ncclSuccess;
    // SAFETY: `raw` is a live communicator (callers check for NULL) and `state` a valid
    // out-pointer.
    let r = unsafe { sys::ncclCommGetAsyncError(raw, &mut state) };
    if r == sys::ncclResult_t::ncclSuccess {
        state
    } else {
        r
    }
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every field "undefined" (NCCL's
/// default) except the header and `blocking`.
fn non_blocking_config() -> sys::ncclConfig_t {
    const UNDEF_INT: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

fn nccl_dtype(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::F64 => sys::ncclDataType_t::ncclFloat64,
        DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
        DType::I32 => sys::ncclDataType_t::ncclInt32,
        DType::I64 => sys::ncclDataType_t::ncclInt64,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => sys::ncclRedOp_t::ncclMin,
    }
}

/// Device address `base` advanced by `elems` elements of `dtype`.
fn offset(base: u64, elems: usize, dtype: DType) -> u64 {
    base + (elems * dtype.size_in_bytes()) as u64
}

// ---------------------------------------------------------------------------------------
// What a call moves, as the worker executes it
// ---------------------------------------------------------------------------------------

/// One peer-to-peer transfer of a grouped exchange: peer, device address, elements.
type Transfer = (usize, u64, usize);

/// The data phase of a call, in raw device addresses (valid while the handle waits).
#[derive(Debug)]
enum Plan {
    /// Nothing after the agreement (barrier, or a rank with invalid arguments).
    Nothing,
    AllReduce {
        buf: u64,
        len: usize,
        dtype: DType,
        op: ReduceOp,
    },
    AllGather {
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
    },
    ReduceScatter {
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    },
    Broadcast {
        buf: u64,
        len: usize,
        root: usize,
        dtype: DType,
    },
    /// Grouped sends and receives (all_gatherv, all_to_all(v)).
    Exchange {
        sends: Vec<Transfer>,
        recvs: Vec<Transfer>,
        dtype: DType,
    },
    /// Grouped `ncclReduce` of block `(root, send address, count)` to its root; `recv` is
    /// this rank's output (written only where it is the root).
    Reduces {
        blocks: Vec<Transfer>,
        recv: u64,
        dtype: DType,
        op: ReduceOp,
    },
}

impl Plan {
    /// True when no element moves. The agreement made every rank's count the same for
    /// the single-call plans, so all ranks skip together (NCCL need not see count 0).
    fn is_empty(&self) -> bool {
        match self {
            Plan::Nothing => true,
            Plan::AllReduce { len, .. } | Plan::Broadcast { len, .. } => *len == 0,
            Plan::AllGather { count, .. } | Plan::ReduceScatter { count, .. } => *count == 0,
            Plan::Exchange { .. } | Plan::Reduces { .. } => false,
        }
    }

    /// Enqueues the data phase on `stream` (non-blocking: it may still be in progress).
    fn enqueue(
        &self,
        raw: sys::ncclComm_t,
        stream: sys::cudaStream_t,
    ) -> Result<(), sys::ncclResult_t> {
        if self.is_empty() {
            return Ok(());
        }
        // SAFETY (every call below): `raw` is a live communicator; the addresses come from
        // device views the caller holds until the call is over (the handle waits for the
        // worker), with the element counts and dtypes the handle checked against them.
        unsafe {
            match self {
                Plan::Nothing => Ok(()),
                Plan::AllReduce {
                    buf,
                    len,
                    dtype,
                    op,
                } => ok(sys::ncclAllReduce(
                    *buf as *const c_void,
                    *buf as *mut c_void,
                    *len,
                    nccl_dtype(*dtype),
                    nccl_op(*op),
                    raw,
                    stream,
                )),
                Plan::AllGather {
                    send,
                    recv,
                    count,
                    dtype,
                } => ok(sys::ncclAllGather(
                    *send as *const c_void,
                    *recv as *mut c_void,
                    *count,
                    nccl_dtype(*dtype),
                    raw,
                    stream,
                )),
                Plan::ReduceScatter {
                    send,
                    recv,
                    count,
                    dtype,
                    op,
                } => ok(sys::ncclReduceScatter(
                    *send as *const c_void,
                    *recv as *mut c_void,
                    *count,
                    nccl_dtype(*dtype),
                    nccl_op(*op),
                    raw,
                    stream,
                )),
                Plan::Broadcast {
                    buf,
                    len,
                    root,
                    dtype,
                } => ok(sys::ncclBroadcast(
                    *buf as *const c_void,
                    *buf as *mut c_void,
                    *len,
                    nccl_dtype(*dtype),
                    *root as i32,
                    raw,
                    stream,
                )),
                Plan::Exchange {
                    sends,
                    recvs,
                    dtype,
                } => grouped(|| {
                    let dt = nccl_dtype(*dtype);
                    for &(peer, addr, count) in sends.iter().filter(|t| t.2 > 0) {
                        ok(sys::ncclSend(
                            addr as *const c_void,
                            count,
                            dt,
                            peer as i32,
                            raw,
                            stream,
                        ))?;
                    }
                    for &(peer, addr, count) in recvs.iter().filter(|t| t.2 > 0) {
                        ok(sys::ncclRecv(
                            addr as *mut c_void,
                            count,
                            dt,
                            peer as i32,
                            raw,
                            stream,
                        ))?;
                    }
                    Ok(())
                }),
                Plan::Reduces {
                    blocks,
                    recv,
                    dtype,
                    op,
                } => grouped(|| {
                    for &(root, addr, count) in blocks.iter().filter(|t| t.2 > 0) {
                        ok(sys::ncclReduce(
                            addr as *const c_void,
                            *recv as *mut c_void,
                            count,
                            nccl_dtype(*dtype),
                            nccl_op(*op),
                            root as i32,
                            raw,
                            stream,
                        ))?;
                    }
                    Ok(())
                }),
            }
        }
    }
}

/// Aborts the child a failed `ncclCommSplit` may have stored in `out` (NCCL stores even a
/// child whose initialization failed), and clears `out`.
fn abort_child(out: &AtomicPtr<sys::ncclComm>) {
    let child = out.swap(std::ptr::null_mut(), Ordering::AcqRel);
    if !child.is_null() {
        // SAFETY: a communicator NCCL handed out and nobody else holds; aborted once.
        let _ = unsafe { sys::ncclCommAbort(child) };
    }
}

/// Runs `calls` between `ncclGroupStart` and `ncclGroupEnd`; the group is closed even
/// when a call fails, and the first error wins.
fn grouped(calls: impl FnOnce() -> Result<(), sys::ncclResult_t>) -> Result<(), sys::ncclResult_t> {
    // SAFETY: group calls take no arguments; they only delimit the calls in between.
    ok(unsafe { sys::ncclGroupStart() })?;
    let r = calls();
    let end = ok(unsafe { sys::ncclGroupEnd() });
    r.and(end)
}

// ---------------------------------------------------------------------------------------
// The worker: owns the raw communicators, on one thread for their whole life
// ---------------------------------------------------------------------------------------

/// One communicator of the worker (the launched one, or one split from it).
struct Slot {
    /// NULL once aborted or destroyed.
    raw: sys::ncclComm_t,
    rank: usize,
    size: usize,
    /// World (launch) rank of each group rank.
    members: Vec<usize>,
    /// Set when the communicator was aborted: what every later call returns.
    failed: Option<Error>,
}

type Job = Box<dyn FnOnce(&mut Worker) + Send>;

/// The rank's NCCL thread. Holds raw `ncclComm_t`s, hence `!Send`: it is created on its
/// thread and never leaves it.
pub(super) struct Worker {
    stream: Arc<CudaStream>,
    timeout: Duration,
    departures: Option<Arc<Departures>>,
    slots: Vec<Option<Slot>>,
}

/// What a handle holds to reach its worker (shared by the communicators split from it).
/// Dropping the last one closes the channel and joins the thread, which destroys what is
/// left.
struct Link {
    tx: Mutex<Option<mpsc::Sender<Job>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The error of a call whose worker has ended (its answer can never come).
fn worker_gone(op: &'static str) -> Error {
    Error::Library {
        op,
        backend: BACKEND,
        detail: "the rank's NCCL worker thread has ended".into(),
    }
}

impl Link {
    /// Runs `job` on the worker and returns its answer; `Err` if the worker is gone.
    fn run<R: Send + 'static>(
        &self,
        op: &'static str,
        job: impl FnOnce(&mut Worker) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        self.submit(job).recv().map_err(|_| worker_gone(op))?
    }

    /// Queues `job` on the worker (behind every job queued before it) and returns where
    /// its answer will arrive. If the worker is gone, the job is dropped unrun and the
    /// receiver reports a disconnected channel.
    fn submit<R: Send + 'static>(
        &self,
        job: impl FnOnce(&mut Worker) -> Result<R> + Send + 'static,
    ) -> mpsc::Receiver<Result<R>> {
        let (rtx, rrx) = mpsc::channel();
        if let Some(tx) = lock(&self.tx).clone() {
            let _ = tx.send(Box::new(move |w: &mut Worker| {
                let _ = rtx.send(job(w));
            }));
        }
        rrx
    }
}

/// The handle's side of an asynchronous device call: the worker's answer, once it came.
/// The worker owns the call's buffers until the data phase has finished (or the
/// communicator was aborted and its stream drained), then sends the result buffer here.
struct Answer {
    op: &'static str,
    rx: mpsc::Receiver<Result<DeviceBuffer>>,
    got: Option<Result<DeviceBuffer>>,
}

impl Pending<DeviceBuffer> for Answer {
    fn test(&mut self) -> bool {
        if self.got.is_none() {
            match self.rx.try_recv() {
                Ok(r) => self.got = Some(r),
                Err(mpsc::TryRecvError::Empty) => return false,
                Err(mpsc::TryRecvError::Disconnected) => self.got = Some(Err(worker_gone(self.op))),
            }
        }
        true
    }

    fn wait(self: Box<Self>) -> Result<DeviceBuffer> {
        match self.got {
            Some(r) => r,
            // Bounded: the worker answers every job within its timeouts (each job queued
            // before this one too), or ends, which disconnects the channel.
            None => self.rx.recv().unwrap_or_else(|_| Err(worker_gone(self.op))),
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        lock(&self.tx).take();
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

/// What [`spawn`] needs to create a rank's world communicator.
pub(super) struct Init {
    pub(super) device: Device,
    pub(super) rank: usize,
    pub(super) size: usize,
    pub(super) id: sys::ncclUniqueId,
    pub(super) options: Options,
    pub(super) departures: Option<Arc<Departures>>,
    /// Whether other ranks of this process may share the GPU (see [`preload_kernels`]).
    pub(super) shared_gpu: bool,
}

/// Loads every kernel of `dtensor-kernels` on `device` (NVRTC compiles each module once per
/// process; later launches find them loaded).
///
/// Ranks of one process that share a GPU share its CUDA context, and loading a kernel may
/// synchronize the whole context (CUDA's lazy-loading notes: "loading kernels might require
/// context synchronization"). A rank loading, say, its first cross-entropy kernel while a
/// peer's NCCL kernel spins waiting for that rank would then deadlock until the timeout (a
/// pipeline stage running kernels its peers never run is enough). Done before the
/// communicator exists, no NCCL kernel can be running yet: none starts before every rank has
/// joined. cuBLAS's own kernels still load lazily (see the module docs), but its handle is
/// made here too (when cuBLAS is present; without it `matmul` says so later).
fn preload_kernels(device: &Device) -> Result<()> {
    const OP: &str = "nccl::launch";
    let _ = device.blas();
    let failed = |err| Error::Library {
        op: OP,
        backend: BACKEND,
        detail: format!("preloading the kernels of a GPU shared by several ranks: {err}"),
    };
    for m in dtensor_kernels::cuda::source::MODULES {
        for e in m.entries().map_err(failed)? {
            device.function(m, &e).map_err(failed)?;
        }
    }
    Ok(())
}

/// Starts rank `init.rank`'s worker, creates its world communicator there (bounded by the
/// timeout) and returns the handle.
pub(super) fn spawn(init: Init) -> Result<NcclComm> {
    const OP: &str = "nccl::launch";
    let Init {
        device,
        rank,
        size,
        id,
        options,
        departures,
        shared_gpu,
    } = init;
    if shared_gpu {
        preload_kernels(&device)?;
    }
    let (tx, rx) = mpsc::channel::<Job>();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<Arc<CudaStream>>>();
    let ctx = device.stream().context().clone();
    let timeout = options.timeout;
    let deps = departures.clone();
    let thread = std::thread::Builder::new()
        .name(format!("nccl-{rank}"))
        .spawn(move || {
            let setup = (|| -> Result<Worker> {
                ctx.bind_to_thread().map_err(|e| cuda_error(OP, e))?;
                let stream = ctx.new_stream().map_err(|e| cuda_error(OP, e))?;
                let mut w = Worker {
                    stream,
                    timeout,
                    departures: deps,
                    slots: Vec::new(),
                };
                let mut raw: sys::ncclComm_t = std::ptr::null_mut();
                let mut config = non_blocking_config();
                // SAFETY: valid out-pointer and config; `id` is the group's unique id.
                let r = unsafe {
                    sys::ncclCommInitRankConfig(&mut raw, size as i32, id, rank as i32, &mut config)
                };
                w.slots.push(Some(Slot {
                    raw,
                    rank,
                    size,
                    members: (0..size).collect(),
                    failed: None,
                }));
                if let Err(code) = ok(r) {
                    return Err(w.fail(0, nccl_error(OP, code, raw)));
                }
                w.settle(0, OP)?;
                Ok(w)
            })();
            match setup {
                Ok(mut w) => {
                    let _ = ready_tx.send(Ok(w.stream.clone()));
                    for job in rx {
                        job(&mut w);
                    }
                    w.close_all();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| Error::Library {
            op: OP,
            backend: BACKEND,
            detail: format!("could not start the NCCL worker thread: {e}"),
        })?;
    let link = Arc::new(Link {
        tx: Mutex::new(Some(tx)),
        thread: Mutex::new(Some(thread)),
    });
    let stream = match ready_rx.recv() {
        Ok(r) => r?,
        Err(_) => {
            return Err(Error::Library {
                op: OP,
                backend: BACKEND,
                detail: "the NCCL worker thread ended during initialization".into(),
            })
        }
    };
    Ok(NcclComm {
        link,
        slot: 0,
        rank,
        size,
        members: (0..size).collect(),
        device,
        stream,
        counters: Arc::default(),
    })
}

impl Worker {
    /// The live communicator of `slot`, or the error it failed with.
    fn raw(&self, slot: usize) -> Result<sys::ncclComm_t> {
        match self.slots.get(slot) {
            Some(Some(s)) => match &s.failed {
                Some(e) => Err(e.clone()),
                None if s.raw.is_null() => Err(Error::Library {
                    op: "nccl",
                    backend: BACKEND,
                    detail: "the communicator was destroyed".into(),
                }),
                None => Ok(s.raw),
            },
            _ => Err(Error::Library {
                op: "nccl",
                backend: BACKEND,
                detail: format!("no communicator {slot} on this rank's worker"),
            }),
        }
    }

    fn slot(&self, slot: usize) -> Result<&Slot> {
        self.raw(slot)?;
        self.slots
            .get(slot)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::Library {
                op: "nccl",
                backend: BACKEND,
                detail: format!("no communicator {slot} on this rank's worker"),
            })
    }

    /// Aborts `slot`'s communicator (NCCL then touches none of the caller's buffers:
    /// its kernels stop, and the worker waits for the stream to drain), records `err` as
    /// what every later call returns, and returns it.
    fn fail(&mut self, slot: usize, err: Error) -> Error {
        if let Some(Some(s)) = self.slots.get_mut(slot) {
            if !s.raw.is_null() {
                // SAFETY: a live communicator, aborted once, then forgotten.
                let _ = unsafe { sys::ncclCommAbort(s.raw) };
                s.raw = std::ptr::null_mut();
            }
            s.failed = Some(err.clone());
        }
        self.drain();
        err
    }

    /// Waits (up to the timeout) for the stream's work to finish after an abort, so that
    /// no kernel writes into a buffer the caller gets back. If it does not finish, the
    /// process is aborted: returning would hand back buffers the GPU may still write.
    fn drain(&self) {
        let Ok(ev) = self.stream.record_event(None) else {
            // A sticky CUDA error: the context is dead and runs nothing any more.
            return;
        };
        let start = Instant::now();
        loop {
            match ev.try_is_complete() {
                Ok(false) => {}
                // Done, or a sticky error (no kernel runs after one).
                _ => return,
            }
            if start.elapsed() > self.timeout {
                eprintln!(
                    "nccl backend: an aborted communicator's kernels did not stop within \
                     {:?}; aborting the process rather than returning buffers the GPU may \
                     still write",
                    self.timeout
                );
                std::process::abort();
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// A peer of `slot` that has left (world rank and why), if any.
    fn departed_peer(&self, slot: usize, only: Option<usize>) -> Option<(usize, String)> {
        let deps = self.departures.as_ref()?;
        let s = self.slots.get(slot)?.as_ref()?;
        s.members
            .iter()
            .enumerate()
            .filter(|&(r, _)| r != s.rank && only.is_none_or(|o| o == r))
            .find_map(|(_, &w)| deps.reason(w).map(|why| (w, why)))
    }

    /// Polls until `slot`'s communicator is no longer "in progress" (creation, split), up
    /// to the timeout.
    fn settle(&mut self, slot: usize, op: &'static str) -> Result<()> {
        self.poll(slot, op, false, None)
    }

    /// Waits until the work enqueued on `slot` is done: NCCL's part of the call, then the
    /// kernels (an event recorded after them). Bounded by the timeout; a peer that left
    /// (`peer`: only that group rank counts) fails it after [`GRACE`].
    fn finish(&mut self, slot: usize, op: &'static str, peer: Option<usize>) -> Result<()> {
        self.poll(slot, op, true, peer)
    }

    fn poll(
        &mut self,
        slot: usize,
        op: &'static str,
        kernels: bool,
        peer: Option<usize>,
    ) -> Result<()> {
        let start = Instant::now();
        let mut gone_since: Option<Instant> = None;
        let mut event: Option<CudaEvent> = None;
        let mut polls = 0u32;
        loop {
            let raw = self.raw(slot)?;
            match async_state(raw) {
                sys::ncclResult_t::ncclSuccess => {
                    if !kernels {
                        return Ok(());
                    }
                    if event.is_none() {
                        match self.stream.record_event(None) {
                            Ok(ev) => event = Some(ev),
                            Err(e) => return Err(self.fail(slot, cuda_error(op, e))),
                        }
                    }
                    if let Some(ev) = &event {
                        match ev.try_is_complete() {
                            Ok(true) => return Ok(()),
                            Ok(false) => {}
                            Err(e) => return Err(self.fail(slot, cuda_error(op, e))),
                        }
                    }
                }
                sys::ncclResult_t::ncclInProgress => {}
                code => {
                    let err = match self.departed_peer(slot, peer) {
                        Some((rank, reason)) => Error::RankFailed { rank, op, reason },
                        None => nccl_error(op, code, raw),
                    };
                    return Err(self.fail(slot, err));
                }
            }
            if let Some((rank, reason)) = self.departed_peer(slot, peer) {
                let since = *gone_since.get_or_insert_with(Instant::now);
                if since.elapsed() >= GRACE {
                    return Err(self.fail(slot, Error::RankFailed { rank, op, reason }));
                }
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                let err = Error::Timeout {
                    op,
                    waited,
                    missing: Vec::new(),
                };
                return Err(self.fail(slot, err));
            }
            // Spin briefly (most calls finish in microseconds), then yield the core.
            polls += 1;
            if polls < 1000 {
                std::hint::spin_loop();
            } else if polls < 2000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(200));
            }
        }
    }

    /// Fails `slot` at once if a peer (or only group rank `peer`) has left before this
    /// call.
    fn check_departed(&mut self, slot: usize, op: &'static str, peer: Option<usize>) -> Result<()> {
        if let Some((rank, reason)) = self.departed_peer(slot, peer) {
            return Err(self.fail(slot, Error::RankFailed { rank, op, reason }));
        }
        Ok(())
    }

    /// All-gathers `mine` (the same length on every rank) over `slot`: `size × mine.len()`
    /// values in group-rank order.
    fn gather<T: DeviceRepr + ValidAsZeroBits + Copy + Default>(
        &mut self,
        slot: usize,
        op: &'static str,
        mine: &[T],
        dtype: sys::ncclDataType_t,
    ) -> Result<Vec<T>> {
        let size = self.slot(slot)?.size;
        let raw = self.raw(slot)?;
        let stream = self.stream.clone();
        let send = stream
            .clone_htod(mine)
            .map_err(|e| self.fail(slot, cuda_error(op, e)))?;
        let mut recv = stream
            .alloc_zeros::<T>(mine.len() * size)
            .map_err(|e| self.fail(slot, cuda_error(op, e)))?;
        let r = {
            let (sp, _rs) = send.device_ptr(&stream);
            let (rp, _rr) = recv.device_ptr_mut(&stream);
            // SAFETY: `send` holds `mine.len()` and `recv` `size × mine.len()` elements of
            // `dtype`, both alive until the call is finished below.
            ok(unsafe {
                sys::ncclAllGather(
                    sp as *const c_void,
                    rp as *mut c_void,
                    mine.len(),
                    dtype,
                    raw,
                    stream.cu_stream() as sys::cudaStream_t,
                )
            })
        };
        if let Err(code) = r {
            return Err(self.fail(slot, nccl_error(op, code, raw)));
        }
        self.finish(slot, op, None)?;
        stream
            .clone_dtoh(&recv)
            .map_err(|e| self.fail(slot, cuda_error(op, e)))
    }

    /// Every rank's string (cut to [`DESCRIPTION_BYTES`]), in group-rank order.
    fn gather_strings(&mut self, slot: usize, op: &'static str, mine: &str) -> Result<Vec<String>> {
        let mut bytes = vec![0u8; DESCRIPTION_BYTES];
        let n = mine.len().min(DESCRIPTION_BYTES);
        bytes[..n].copy_from_slice(&mine.as_bytes()[..n]);
        let all = self.gather(slot, op, &bytes, sys::ncclDataType_t::ncclUint8)?;
        Ok(all
            .chunks(DESCRIPTION_BYTES)
            .map(|c| {
                let end = c.iter().position(|&b| b == 0).unwrap_or(c.len());
                String::from_utf8_lossy(&c[..end]).into_owned()
            })
            .collect())
    }

    /// The agreement before every collective (see the module docs): every rank learns
    /// whether all called the same thing; a mismatch gives every rank the same diagnosis.
    fn agree(
        &mut self,
        slot: usize,
        call: &Call,
        dtype: Option<DType>,
        invalid: Option<String>,
    ) -> Result<()> {
        let op = call.name();
        self.raw(slot)?;
        self.check_departed(slot, op, None)?;
        let (me, size, members) = {
            let s = self.slot(slot)?;
            (s.rank, s.size, s.members.clone())
        };
        let header = call.header(dtype, invalid.is_some(), me);
        let words = self.gather(slot, op, &header, sys::ncclDataType_t::ncclUint64)?;
        let headers: Vec<Header> = words
            .chunks(HEADER_WORDS)
            .map(|c| {
                let mut h = [0u64; HEADER_WORDS];
                h.copy_from_slice(c);
                h
            })
            .collect();
        match wire::check(&headers, me) {
            Verdict::Go => Ok(()),
            Verdict::Invalid => {
                let detail = invalid.unwrap_or_default();
                self.gather_strings(
                    slot,
                    op,
                    &described_call(&call.describe(dtype), Some(&detail)),
                )?;
                Err(Error::InvalidArgument { op, detail })
            }
            Verdict::Departed { rank } => Err(Error::RankFailed {
                rank: members[rank],
                op,
                reason: "returned before joining".into(),
            }),
            Verdict::Mismatch(what) => {
                // A description cut at DESCRIPTION_BYTES loses its tail only.
                let mine = described_call(&call.describe(dtype), invalid.as_deref());
                let all = self.gather_strings(slot, op, &mine)?;
                let (what, described) = split_described(what, &all);
                Err(Error::CollectiveMismatch {
                    op,
                    backend: BACKEND,
                    size,
                    detail: wire::mismatch_detail(&what, &described, &members),
                })
            }
        }
    }

    /// A collective: the agreement, then `plan` (unless this rank's arguments were
    /// invalid, which the agreement reports).
    fn collective(
        &mut self,
        slot: usize,
        call: &Call,
        dtype: Option<DType>,
        invalid: Option<String>,
        plan: &Plan,
    ) -> Result<()> {
        let op = call.name();
        self.agree(slot, call, dtype, invalid)?;
        self.enqueue(slot, op, plan)?;
        self.finish(slot, op, None)
    }

    fn enqueue(&mut self, slot: usize, op: &'static str, plan: &Plan) -> Result<()> {
        let raw = self.raw(slot)?;
        let stream = self.stream.cu_stream() as sys::cudaStream_t;
        plan.enqueue(raw, stream)
            .map_err(|code| self.fail(slot, nccl_error(op, code, raw)))
    }

    /// Moves `words` to (or, with `to_peer` false, from) group rank `peer` over `slot`.
    fn p2p_words(
        &mut self,
        slot: usize,
        op: &'static str,
        peer: usize,
        words: &[u64],
        to_peer: bool,
    ) -> Result<Vec<u64>> {
        let raw = self.raw(slot)?;
        let stream = self.stream.clone();
        let mut buf = stream
            .clone_htod(words)
            .map_err(|e| self.fail(slot, cuda_error(op, e)))?;
        let r = {
            let (p, _g) = buf.device_ptr_mut(&stream);
            let s = stream.cu_stream() as sys::cudaStream_t;
            let dt = sys::ncclDataType_t::ncclUint64;
            // SAFETY: `buf` holds `words.len()` u64s until the call is finished below.
            ok(unsafe {
                if to_peer {
                    sys::ncclSend(p as *const c_void, words.len(), dt, peer as i32, raw, s)
                } else {
                    sys::ncclRecv(p as *mut c_void, words.len(), dt, peer as i32, raw, s)
                }
            })
        };
        if let Err(code) = r {
            return Err(self.fail(slot, nccl_error(op, code, raw)));
        }
        self.finish(slot, op, Some(peer))?;
        stream
            .clone_dtoh(&buf)
            .map_err(|e| self.fail(slot, cuda_error(op, e)))
    }

    /// `send_device`: header to `dst`, its answer back, then the data if it accepted.
    fn send(
        &mut self,
        slot: usize,
        dst: usize,
        tag: u32,
        data: Plan,
        dtype: DType,
        len: usize,
    ) -> Result<()> {
        const OP: &str = "send";
        self.raw(slot)?;
        self.check_departed(slot, OP, Some(dst))?;
        let header = p2p_header(dtype, len, tag);
        self.p2p_words(slot, OP, dst, &header, true)?;
        let answer = self.p2p_words(slot, OP, dst, &[0], false)?;
        if answer.first() != Some(&1) {
            let s = self.slot(slot)?;
            return Err(Error::CollectiveMismatch {
                op: OP,
                backend: BACKEND,
                size: s.size,
                detail: format!(
                    "rank {} refused this rank's message ({dtype} x {len}, tag {tag}): its \
                     recv expected another dtype, length or tag",
                    s.members[dst]
                ),
            });
        }
        self.enqueue(slot, OP, &data)?;
        self.finish(slot, OP, Some(dst))
    }

    /// `recv_device`: the sender's header, this rank's answer, then the data if they agree.
    fn recv(
        &mut self,
        slot: usize,
        src: usize,
        tag: u32,
        data: Plan,
        dtype: DType,
        len: usize,
    ) -> Result<()> {
        const OP: &str = "recv";
        self.raw(slot)?;
        self.check_departed(slot, OP, Some(src))?;
        let header = self.p2p_words(slot, OP, src, &[0; 4], false)?;
        let check = check_p2p_header(&header, dtype, len, tag);
        let agrees = check == P2pHeaderCheck::Agrees;
        self.p2p_words(slot, OP, src, &[u64::from(agrees)], true)?;
        let world_src = self.slot(slot)?.members[src];
        match check {
            P2pHeaderCheck::Agrees => {}
            P2pHeaderCheck::Message { got_dtype, got_len } => {
                return Err(Error::MessageMismatch {
                    op: OP,
                    src: world_src,
                    tag,
                    got_len,
                    got_dtype,
                    want_len: len,
                    want_dtype: dtype,
                })
            }
            P2pHeaderCheck::Tag { got_tag, .. } => {
                return Err(Error::CollectiveMismatch {
                    op: OP,
                    backend: BACKEND,
                    size: self.slot(slot)?.size,
                    detail: format!(
                        "rank {world_src} sent a message with tag {got_tag} (header \
                         {header:?}); this rank expected tag {tag}, {dtype} x {len} (NCCL \
                         delivers messages between two ranks in order: tags are checked, \
                         not matched)"
                    ),
                })
            }
        }
        self.enqueue(slot, OP, &data)?;
        self.finish(slot, OP, Some(src))
    }

    /// `split`: the agreement, every rank's `(color, key)`, then `ncclCommSplit`; returns
    /// the new slot, this rank's place in it and the new group's world ranks.
    fn split(
        &mut self,
        slot: usize,
        color: usize,
        key: usize,
    ) -> Result<(usize, usize, Vec<usize>)> {
        const OP: &str = "split";
        let call = Call::Split { color, key };
        let fits = |v: usize| i32::try_from(v).is_ok();
        let invalid = (!fits(color) || !fits(key))
            .then(|| format!("color {color} and key {key} must fit an NCCL int (≤ 2³¹−1)"));
        self.agree(slot, &call, None, invalid)?;
        let (me, members) = {
            let s = self.slot(slot)?;
            (s.rank, s.members.clone())
        };
        let pairs = self.gather(
            slot,
            OP,
            &[color as u64, key as u64],
            sys::ncclDataType_t::ncclUint64,
        )?;
        let (new_rank, group) =
            split_group(&pairs, color as u64, me).ok_or_else(|| Error::Library {
                op: OP,
                backend: BACKEND,
                detail: "this rank is missing from its own color's group".into(),
            })?;
        let new_members: Vec<usize> = group.iter().map(|&r| members[r]).collect();
        let raw = self.raw(slot)?;
        // On a non-blocking parent, ncclCommSplit returns ncclInProgress with `*newcomm`
        // still NULL: NCCL's own thread stores the child there when the split completes,
        // and until then the *parent's* state is ncclInProgress (NVIDIA/nccl#1472,
        // init.cc `ncclCommInitChildComm`). So the out-pointer lives on the heap (a stack
        // slot could be written after this frame is gone if we give up first), is read
        // only once the parent has settled, and is leaked rather than freed on the
        // failure paths, where that late store may still come.
        let out_box: *mut AtomicPtr<sys::ncclComm> =
            Box::into_raw(Box::new(AtomicPtr::new(std::ptr::null_mut())));
        // SAFETY: a live allocation, freed only below, after the last use of `out`.
        let out: &AtomicPtr<sys::ncclComm> = unsafe { &*out_box };
        let mut config = non_blocking_config();
        // SAFETY: `raw` is live; `out` is a valid out-pointer for as long as NCCL may
        // write it (freed below only after the split completed, else never); color and
        // key fit an int (checked in the agreement).
        let r =
            unsafe { sys::ncclCommSplit(raw, color as i32, key as i32, out.as_ptr(), &mut config) };
        if let Err(code) = ok(r) {
            abort_child(out);
            return Err(self.fail(slot, nccl_error(OP, code, raw)));
        }
        let child = match self.await_child(slot, out) {
            Ok(child) => child,
            Err(e) => {
                // The parent was aborted, which joins NCCL's split job: a child it stored
                // (a failed one) is aborted too.
                abort_child(out);
                return Err(e);
            }
        };
        // SAFETY: the split completed (the child was stored), so NCCL holds no pointer to
        // `out` any more, and `out` is not used after this; `out_box` came from
        // `Box::into_raw` above and is freed once.
        drop(unsafe { Box::from_raw(out_box) });
        let index = self.slots.len();
        self.slots.push(Some(Slot {
            raw: child,
            rank: new_rank,
            size: new_members.len(),
            members: new_members.clone(),
            failed: None,
        }));
        self.settle(index, OP)?;
        Ok((index, new_rank, new_members))
    }

    /// Waits (bounded like [`Worker::settle`]) until the split on `slot` has stored its
    /// child in `out`, and returns it: the parent settles first; some NCCL versions may
    /// report the parent done a moment before the store, so a NULL is polled again.
    fn await_child(
        &mut self,
        slot: usize,
        out: &AtomicPtr<sys::ncclComm>,
    ) -> Result<sys::ncclComm_t> {
        const OP: &str = "split";
        let start = Instant::now();
        loop {
            self.settle(slot, OP)?;
            let child = out.load(Ordering::Acquire);
            if !child.is_null() {
                return Ok(child);
            }
            let waited = start.elapsed();
            if waited >= self.timeout {
                let err = Error::Timeout {
                    op: OP,
                    waited,
                    missing: Vec::new(),
                };
                return Err(self.fail(slot, err));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// Ends `slot`'s communicator: finalize (bounded) and destroy when healthy, abort
    /// otherwise.
    fn close(&mut self, slot: usize) {
        let Some(Some(s)) = self.slots.get(slot) else {
            return;
        };
        if !s.raw.is_null() && s.failed.is_none() {
            let raw = s.raw;
            // SAFETY: a live communicator; destroyed once below, then forgotten.
            let r = unsafe { sys::ncclCommFinalize(raw) };
            match ok(r) {
                // Finalize refused: abort. (The error is read while `raw` is still live.)
                Err(code) => {
                    let err = nccl_error("nccl drop", code, raw);
                    self.fail(slot, err);
                }
                Ok(()) => {
                    // A failed `settle` has aborted the communicator already (NCCL freed
                    // it): `raw` must not reach NCCL again, not even ncclGetLastError.
                    if self.settle(slot, "nccl drop").is_ok() {
                        // SAFETY: live and finalized; destroyed once, then forgotten.
                        let _ = unsafe { sys::ncclCommDestroy(raw) };
                        if let Some(Some(s)) = self.slots.get_mut(slot) {
                            s.raw = std::ptr::null_mut();
                        }
                    }
                }
            }
        }
        if let Some(s) = self.slots.get_mut(slot) {
            *s = None;
        }
    }

    fn close_all(&mut self) {
        for slot in (0..self.slots.len()).rev() {
            self.close(slot);
        }
    }
}

// ---------------------------------------------------------------------------------------
// The handle
// ---------------------------------------------------------------------------------------

/// One rank's end of an NCCL group: a thin handle that forwards each call to the rank's
/// worker thread, which owns the NCCL communicator (see the [module docs](super)).
///
/// Invariants: `slot` names a communicator on `link`'s worker whose group rank is `rank`
/// of `size`, with world ranks `members`; `stream` is the worker's stream, on `device`.
pub struct NcclComm {
    link: Arc<Link>,
    slot: usize,
    rank: usize,
    size: usize,
    members: Vec<usize>,
    device: Device,
    stream: Arc<CudaStream>,
    /// Shared with the jobs of asynchronous calls, which count on completion.
    counters: Arc<Counters>,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("members", &self.members)
            .field("device", &self.device)
            .finish()
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        let slot = self.slot;
        let _ = self.link.run("nccl drop", move |w| {
            w.close(slot);
            Ok(())
        });
    }
}

/// A device address and the cudarc guard that orders later uses of the buffer after the
/// NCCL call (dropped once the call has returned).
type Addr<'a> = (u64, SyncOnDrop<'a>);

fn addr<'a>(v: &'a DeviceView<'_>, stream: &'a CudaStream) -> Addr<'a> {
    with_device_view!(DeviceView, v, |s| s.device_ptr(stream))
}

fn addr_mut<'a>(v: &'a mut DeviceViewMut<'_>, stream: &'a CudaStream) -> Addr<'a> {
    with_device_view!(DeviceViewMut, v, |s| s.device_ptr_mut(stream))
}

fn host_refused(op: &'static str) -> Result<()> {
    Err(Error::InvalidArgument {
        op,
        detail: "nccl backend: host buffers are not staged through the device; pass device \
                 buffers to the `*_device` methods"
            .into(),
    })
}

/// `Some(reason)` when `cond` is false.
fn unless(cond: bool, reason: impl FnOnce() -> String) -> Option<String> {
    (!cond).then(reason)
}

impl NcclComm {
    /// The GPU this rank's buffers must live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The world (launch) rank of each rank of this group.
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// Like [`Communicator::split`], returning the concrete handle.
    pub fn split_nccl(&self, color: usize, key: usize) -> Result<NcclComm> {
        let slot = self.slot;
        let (index, rank, members) = self.link.run("split", move |w| w.split(slot, color, key))?;
        self.counters.record(CollectiveKind::Split, 0, 0);
        Ok(NcclComm {
            link: self.link.clone(),
            slot: index,
            rank,
            size: members.len(),
            members,
            device: self.device.clone(),
            stream: self.stream.clone(),
            counters: Arc::default(),
        })
    }

    /// Runs a collective on the worker and counts it when it succeeds.
    fn run_collective(
        &self,
        call: Call,
        dtype: Option<DType>,
        invalid: Option<String>,
        plan: Plan,
    ) -> Result<()> {
        let slot = self.slot;
        let plan = if invalid.is_some() {
            Plan::Nothing
        } else {
            plan
        };
        let (me, n) = (self.rank, self.size);
        let moved = (invalid.is_none()).then(|| call.elements_moved(me, n));
        let kind = call.kind();
        self.link.run(call.name(), move |w| {
            w.collective(slot, &call, dtype, invalid, &plan)
        })?;
        if let (Some((sent, received)), Some(d)) = (moved, dtype) {
            let b = d.size_in_bytes() as u64;
            self.counters.record(kind, sent * b, received * b);
        }
        Ok(())
    }

    /// Starts an asynchronous device call: queues on the worker a job that owns `send`
    /// (if any) and `out`, runs the agreement, enqueues the data phase `plan(send address,
    /// out address)` on the worker's stream, waits for it there (an event recorded after
    /// its kernels, bounded by the timeout like a blocking call), counts it, and answers
    /// with `out`. Returns at once; the request's `wait` takes the answer.
    ///
    /// Ordering on the GPU is the blocking calls': the views' cudarc events make the
    /// worker's stream wait for the buffers' earlier writes (and, for `out`, reads) before
    /// the agreement and the data phase, and record the NCCL work as the buffers' latest
    /// use once it has finished. The buffers stay in the job until then: dropping the
    /// request (which waits) or its handle cannot free memory NCCL still uses, and after a
    /// failure the worker has aborted the communicator and drained its stream first.
    fn start_device(
        &self,
        call: Call,
        invalid: Option<String>,
        send: Option<DeviceBuffer>,
        mut out: DeviceBuffer,
        plan: impl FnOnce(Option<u64>, u64) -> Plan + Send + 'static,
    ) -> DeviceRequest {
        let op = call.name();
        // The dtype the blocking call names in its header: send's where there is one.
        let dtype = send.as_ref().unwrap_or(&out).dtype();
        let elsewhere = |b: &DeviceBuffer| {
            unless(b.device() == &self.device, || {
                format!(
                    "a buffer on GPU {}, this rank's communicator is on GPU {}",
                    b.device().ordinal(),
                    self.device.ordinal()
                )
            })
        };
        let invalid = invalid
            .or_else(|| send.as_ref().and_then(elsewhere))
            .or_else(|| elsewhere(&out));
        let slot = self.slot;
        let (me, n) = (self.rank, self.size);
        let moved = invalid.is_none().then(|| call.elements_moved(me, n));
        let kind = call.kind();
        let counters = self.counters.clone();
        let rx = self
            .link
            .submit(move |w: &mut Worker| -> Result<DeviceBuffer> {
                let stream = w.stream.clone();
                {
                    let send_view = send.as_ref().map(DeviceBuffer::view).transpose();
                    match (send_view, out.view_mut()) {
                        (Ok(sv), Ok(mut ov)) => {
                            let s = sv.as_ref().map(|v| addr(v, &stream));
                            let o = addr_mut(&mut ov, &stream);
                            let plan = if invalid.is_some() {
                                Plan::Nothing
                            } else {
                                plan(s.as_ref().map(|a| a.0), o.0)
                            };
                            w.collective(slot, &call, Some(dtype), invalid, &plan)?;
                            // `s` and `o` drop here, after the data phase has finished: they
                            // record it on the buffers' events, as the blocking calls do.
                        }
                        // A view that cannot be made (a failed copy on write) is this rank's
                        // invalid argument: its peers learn of it in the agreement.
                        (Err(e), _) | (_, Err(e)) => {
                            let invalid = Some(invalid.unwrap_or_else(|| e.to_string()));
                            w.collective(slot, &call, Some(dtype), invalid, &Plan::Nothing)?;
                        }
                    }
                }
                if let Some((sent, received)) = moved {
                    let b = dtype.size_in_bytes() as u64;
                    counters.record(kind, sent * b, received * b);
                }
                drop(send);
                Ok(out)
            });
        Request::new(op, Box::new(Answer { op, rx, got: None }))
    }

    /// Checks `counts` (one per rank, summing to `total`).
    fn counts_fit(&self, counts: &[usize], total: usize, what: &str) -> Option<String> {
        if counts.len() != self.size {
            return Some(format!(
                "{what}: {} counts for {} ranks",
                counts.len(),
                self.size
            ));
        }
        unless(counts.iter().sum::<usize>() == total, || {
            format!(
                "{what} {counts:?} sum to {}, the buffer holds {total}",
                counts.iter().sum::<usize>()
            )
        })
    }

    /// Why an even collective is invalid, if it is: `whole` (name, length) must hold `size`
    /// blocks of `part` elements (all-gather: recv of send; reduce-scatter: send of recv), in
    /// one dtype. The blocking and the asynchronous device calls check alike.
    fn even_invalid(
        &self,
        dtypes: (DType, DType),
        whole: (&str, usize),
        part: usize,
    ) -> Option<String> {
        let ((send_dtype, recv_dtype), (name, w)) = (dtypes, whole);
        if recv_dtype != send_dtype {
            return Some(format!("send is {send_dtype}, recv is {recv_dtype}"));
        }
        unless(part.checked_mul(self.size) == Some(w), || {
            format!("{name} holds {w} elements, not {} x {part}", self.size)
        })
    }

    /// Why an uneven collective is invalid, if it is: `counts` must split the `whole` buffer
    /// and give this rank's block the length of `own` (name, length; all-gather-v: send,
    /// reduce-scatter-v: recv), in one dtype.
    fn uneven_invalid(
        &self,
        dtypes: (DType, DType),
        whole: usize,
        own: (&str, usize),
        counts: &[usize],
    ) -> Option<String> {
        let ((send_dtype, recv_dtype), (name, o)) = (dtypes, own);
        if recv_dtype != send_dtype {
            return Some(format!("send is {send_dtype}, recv is {recv_dtype}"));
        }
        self.counts_fit(counts, whole, "counts").or_else(|| {
            unless(counts[self.rank] == o, || {
                format!(
                    "{name} holds {o} elements, counts[{}] is {}",
                    self.rank, counts[self.rank]
                )
            })
        })
    }
}

/// An all-gather-v as grouped sends and receives (the blocking and the asynchronous call
/// alike): this rank's `send` (address, length) to each of `n` ranks, rank `p`'s block into
/// `recv` after the blocks of `counts` before it.
fn all_gatherv_plan(
    n: usize,
    send: (u64, usize),
    recv: u64,
    counts: &[usize],
    dtype: DType,
) -> Plan {
    let (sa, s) = send;
    Plan::Exchange {
        sends: (0..n).map(|p| (p, sa, s)).collect(),
        recvs: blocks(counts)
            .into_iter()
            .enumerate()
            .map(|(p, (off, c))| (p, offset(recv, off, dtype), c))
            .collect(),
        dtype,
    }
}

/// A reduce-scatter-v as one reduce per rank (the blocking and the asynchronous call alike):
/// rank `p`'s block of `send`, after the blocks of `counts` before it, reduced into `recv`
/// on rank `p`.
fn reduce_scatterv_plan(
    send: u64,
    recv: u64,
    counts: &[usize],
    dtype: DType,
    op: ReduceOp,
) -> Plan {
    Plan::Reduces {
        blocks: blocks(counts)
            .into_iter()
            .enumerate()
            .map(|(p, (off, c))| (p, offset(send, off, dtype), c))
            .collect(),
        recv,
        dtype,
        op,
    }
}

/// An equal-block all-to-all as grouped sends and receives: block `p` of `send` (`k`
/// elements at element offset `p·k`) to rank `p` of `n`, rank `p`'s block into block `p`
/// of `recv`.
fn all_to_all_plan(n: usize, send: u64, recv: u64, k: usize, dtype: DType) -> Plan {
    Plan::Exchange {
        sends: (0..n).map(|p| (p, offset(send, p * k, dtype), k)).collect(),
        recvs: (0..n).map(|p| (p, offset(recv, p * k, dtype), k)).collect(),
        dtype,
    }
}

/// An all-to-all-v as grouped sends and receives: `send`'s block `p` (address, and the
/// blocks of `send_counts` before it) to rank `p`, rank `p`'s block into `recv` after the
/// blocks of `recv_counts` before it.
fn all_to_allv_plan(send: (u64, &[usize]), recv: (u64, &[usize]), dtype: DType) -> Plan {
    let at = |(base, counts): (u64, &[usize])| -> Vec<Transfer> {
        blocks(counts)
            .into_iter()
            .enumerate()
            .map(|(p, (off, c))| (p, offset(base, off, dtype), c))
            .collect()
    };
    Plan::Exchange {
        sends: at(send),
        recvs: at(recv),
        dtype,
    }
}

/// NCCL's rule for the group `ncclCommSplit` gives rank `me`: the ranks whose color is
/// `color`, ordered by key, ties by rank in the parent. `pairs` holds every parent rank's
/// `(color, key)`, flat. Returns `me`'s rank in the new group and the parent ranks of the
/// group in new-rank order; `None` if `me` is not of that color.
fn split_group(pairs: &[u64], color: u64, me: usize) -> Option<(usize, Vec<usize>)> {
    let mut group: Vec<(u64, usize)> = pairs
        .chunks(2)
        .enumerate()
        .filter(|(_, p)| p[0] == color)
        .map(|(r, p)| (p.get(1).copied().unwrap_or(0), r))
        .collect();
    group.sort();
    let ranks: Vec<usize> = group.into_iter().map(|(_, r)| r).collect();
    let new_rank = ranks.iter().position(|&r| r == me)?;
    Some((new_rank, ranks))
}

/// `(offset, count)` of each block of `counts`.
fn blocks(counts: &[usize]) -> Vec<(usize, usize)> {
    let mut off = 0;
    counts
        .iter()
        .map(|&c| {
            let b = (off, c);
            off += c;
            b
        })
        .collect()
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn backend(&self) -> &'static str {
        BACKEND
    }
    fn device(&self) -> Option<Device> {
        Some(self.device.clone())
    }

    fn all_reduce(&self, _buf: SliceMut<'_>, _op: ReduceOp) -> Result<()> {
        host_refused("all_reduce")
    }
    fn all_gather(&self, _send: Slice<'_>, _recv: SliceMut<'_>) -> Result<()> {
        host_refused("all_gather")
    }
    fn all_gatherv(&self, _send: Slice<'_>, _recv: SliceMut<'_>, _counts: &[usize]) -> Result<()> {
        host_refused("all_gatherv")
    }
    fn all_gatherv_in_place(&self, _buf: SliceMut<'_>, _counts: &[usize]) -> Result<()> {
        host_refused("all_gatherv_in_place")
    }
    fn reduce_scatterv_in_place(
        &self,
        _buf: SliceMut<'_>,
        _counts: &[usize],
        _op: ReduceOp,
    ) -> Result<()> {
        host_refused("reduce_scatterv_in_place")
    }
    fn all_gather_cols(
        &self,
        _send: Slice<'_>,
        _recv: SliceMut<'_>,
        _rows: usize,
        _widths: &[usize],
    ) -> Result<()> {
        host_refused("all_gather_cols")
    }
    fn reduce_scatter_cols(
        &self,
        _send: Slice<'_>,
        _recv: SliceMut<'_>,
        _rows: usize,
        _widths: &[usize],
        _op: ReduceOp,
    ) -> Result<()> {
        host_refused("reduce_scatter_cols")
    }
    fn all_to_all_cols(
        &self,
        _send: Slice<'_>,
        _rows: usize,
        _send_widths: &[usize],
        _recv: SliceMut<'_>,
        _recv_counts: &[usize],
    ) -> Result<()> {
        host_refused("all_to_all_cols")
    }
    fn reduce_scatter(&self, _send: Slice<'_>, _recv: SliceMut<'_>, _op: ReduceOp) -> Result<()> {
        host_refused("reduce_scatter")
    }
    fn reduce_scatterv(
        &self,
        _send: Slice<'_>,
        _recv: SliceMut<'_>,
        _counts: &[usize],
        _op: ReduceOp,
    ) -> Result<()> {
        host_refused("reduce_scatterv")
    }
    fn all_to_all(&self, _send: Slice<'_>, _recv: SliceMut<'_>) -> Result<()> {
        host_refused("all_to_all")
    }
    fn all_to_allv(
        &self,
        _send: Slice<'_>,
        _send_counts: &[usize],
        _recv: SliceMut<'_>,
        _recv_counts: &[usize],
    ) -> Result<()> {
        host_refused("all_to_allv")
    }
    fn broadcast(&self, _buf: SliceMut<'_>, _root: usize) -> Result<()> {
        host_refused("broadcast")
    }
    fn send(&self, _buf: Slice<'_>, _dst: usize, _tag: u32) -> Result<()> {
        host_refused("send")
    }
    fn recv(&self, _buf: SliceMut<'_>, _src: usize, _tag: u32) -> Result<()> {
        host_refused("recv")
    }

    fn barrier(&self) -> Result<()> {
        let slot = self.slot;
        self.link.run("barrier", move |w| {
            w.collective(slot, &Call::Barrier, None, None, &Plan::Nothing)
        })?;
        self.counters.record(CollectiveKind::Barrier, 0, 0);
        Ok(())
    }

    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        Ok(Arc::new(self.split_nccl(color, key)?))
    }

    fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    fn set_label(&self, label: &'static str) {
        self.counters.set_label(label);
    }

    fn all_reduce_device(&self, mut buf: DeviceViewMut<'_>, op: ReduceOp) -> Result<()> {
        let (len, dtype) = (buf.len(), buf.dtype());
        let (a, _g) = addr_mut(&mut buf, &self.stream);
        let plan = Plan::AllReduce {
            buf: a,
            len,
            dtype,
            op,
        };
        self.run_collective(Call::AllReduce { len, op }, Some(dtype), None, plan)
    }

    fn all_gather_device(&self, send: DeviceView<'_>, mut recv: DeviceViewMut<'_>) -> Result<()> {
        let (s, r, dtype) = (send.len(), recv.len(), send.dtype());
        let invalid = self.even_invalid((dtype, recv.dtype()), ("recv", r), s);
        let (sa, _gs) = addr(&send, &self.stream);
        let (ra, _gr) = addr_mut(&mut recv, &self.stream);
        let plan = Plan::AllGather {
            send: sa,
            recv: ra,
            count: s,
            dtype,
        };
        let call = Call::AllGather { send: s, recv: r };
        self.run_collective(call, Some(dtype), invalid, plan)
    }

    fn all_gatherv_device(
        &self,
        send: DeviceView<'_>,
        mut recv: DeviceViewMut<'_>,
        counts: &[usize],
    ) -> Result<()> {
        let (s, r, dtype) = (send.len(), recv.len(), send.dtype());
        let invalid = self.uneven_invalid((dtype, recv.dtype()), r, ("send", s), counts);
        let (sa, _gs) = addr(&send, &self.stream);
        let (ra, _gr) = addr_mut(&mut recv, &self.stream);
        let plan = if invalid.is_some() {
            Plan::Nothing
        } else {
            all_gatherv_plan(self.size, (sa, s), ra, counts, dtype)
        };
        let call = Call::AllGatherV {
            send: s,
            recv: r,
            counts: counts.to_vec(),
            rows: 1,
        };
        self.run_collective(call, Some(dtype), invalid, plan)
    }

    fn reduce_scatter_device(
        &self,
        send: DeviceView<'_>,
        mut recv: DeviceViewMut<'_>,
        op: ReduceOp,
    ) -> Result<()> {
        let (s, r, dtype) = (send.len(), recv.len(), send.dtype());
        let invalid = self.even_invalid((dtype, recv.dtype()), ("send", s), r);
        let (sa, _gs) = addr(&send, &self.stream);
        let (ra, _gr) = addr_mut(&mut recv, &self.stream);
        let plan = Plan::ReduceScatter {
            send: sa,
            recv: ra,
            count: r,
            dtype,
            op,
        };
        let call = Call::ReduceScatter {
            send: s,
            recv: r,
            op,
        };
        self.run_collective(call, Some(dtype), invalid, plan)
    }

    fn reduce_scatterv_device(
        &self,
        send: DeviceView<'_>,
        mut recv: DeviceViewMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        let (s, r, dtype) = (send.len(), recv.len(), send.dtype());
        let invalid = self.uneven_invalid((dtype, recv.dtype()), s, ("recv", r), counts);
        let (sa, _gs) = addr(&send, &self.stream);
        let (ra, _gr) = addr_mut(&mut recv, &self.stream);
        let plan = if invalid.is_some() {
            Plan::Nothing
        } else {
            reduce_scatterv_plan(sa, ra, counts, dtype, op)
        };
        let call = Call::ReduceScatterV {
            send: s,
            recv: r,
            counts: counts.to_vec(),
            op,
            rows: 1,
        };
        self.run_collective(call, Some(dtype), invalid, plan)
    }

    fn all_to_all_device(&self, send: DeviceView<'_>, mut recv: DeviceViewMut<'_>) -> Result<()> {
        let (s, r, dtype) = (send.len(), recv.len(), send.dtype());
        let n = self.size;
        let invalid = if recv.dtype() != dtype {
            Some(format!("send is {dtype}, recv is {}", recv.dtype()))
        } else if s != r || s % n != 0 {
            Some(format!(
                "send ({s}) and recv ({r}) must be equal multiples of {n}"
            ))
        } else {
            None
        };
        let (sa, _gs) = addr(&send, &self.stream);
        let (ra, _gr) = addr_mut(&mut recv, &self.stream);
        let plan = all_to_all_plan(n, sa, ra, s / n, dtype);
        let call = Call::AllToAll { send: s, recv: r };
        self.run_collective(call, Some(dtype), invalid, plan)
    }

    fn all_to_allv_device(
        &self,
        send: DeviceView<'_>,
        send_counts: &[usize],
        mut recv: DeviceViewMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        let (s, r, dtype) = (send.len(), recv.len(), send.dtype());
        let invalid = if recv.dtype() != dtype {
            Some(format!("send is {dtype}, recv is {}", recv.dtype()))
        } else {
            self.counts_fit(send_counts, s, "send_counts")
                .or_else(|| self.counts_fit(recv_counts, r, "recv_counts"))
        };
        let (sa, _gs) = addr(&send, &self.stream);
        let (ra, _gr) = addr_mut(&mut recv, &self.stream);
        let plan = if invalid.is_some() {
            Plan::Nothing
        } else {
            all_to_allv_plan((sa, send_counts), (ra, recv_counts), dtype)
        };
        let call = Call::AllToAllV {
            send: s,
            recv: r,
            send_counts: send_counts.to_vec(),
            recv_counts: recv_counts.to_vec(),
            rows: 1,
        };
        self.run_collective(call, Some(dtype), invalid, plan)
    }

    fn broadcast_device(&self, mut buf: DeviceViewMut<'_>, root: usize) -> Result<()> {
        let (len, dtype) = (buf.len(), buf.dtype());
        let invalid = unless(root < self.size, || {
            format!("root {root} out of range for {} ranks", self.size)
        });
        let (a, _g) = addr_mut(&mut buf, &self.stream);
        let plan = Plan::Broadcast {
            buf: a,
            len,
            root,
            dtype,
        };
        self.run_collective(Call::Broadcast { len, root }, Some(dtype), invalid, plan)
    }

    fn send_device(&self, buf: DeviceView<'_>, dst: usize, tag: u32) -> Result<()> {
        const OP: &str = "send";
        if dst >= self.size || dst == self.rank {
            return Err(Error::InvalidArgument {
                op: OP,
                detail: format!(
                    "destination {dst} must be another rank of the {} (NCCL cannot send to \
                     its own rank outside a group)",
                    self.size
                ),
            });
        }
        let (len, dtype) = (buf.len(), buf.dtype());
        let (a, _g) = addr(&buf, &self.stream);
        let plan = Plan::Exchange {
            sends: vec![(dst, a, len)],
            recvs: Vec::new(),
            dtype,
        };
        let slot = self.slot;
        self.link
            .run(OP, move |w| w.send(slot, dst, tag, plan, dtype, len))?;
        let bytes = (len * dtype.size_in_bytes()) as u64;
        self.counters.record(CollectiveKind::Send, bytes, 0);
        Ok(())
    }

    fn recv_device(&self, mut buf: DeviceViewMut<'_>, src: usize, tag: u32) -> Result<()> {
        const OP: &str = "recv";
        if src >= self.size || src == self.rank {
            return Err(Error::InvalidArgument {
                op: OP,
                detail: format!("source {src} must be another rank of the {}", self.size),
            });
        }
        let (len, dtype) = (buf.len(), buf.dtype());
        let (a, _g) = addr_mut(&mut buf, &self.stream);
        let plan = Plan::Exchange {
            sends: Vec::new(),
            recvs: vec![(src, a, len)],
            dtype,
        };
        let slot = self.slot;
        self.link
            .run(OP, move |w| w.recv(slot, src, tag, plan, dtype, len))?;
        let bytes = (len * dtype.size_in_bytes()) as u64;
        self.counters.record(CollectiveKind::Recv, 0, bytes);
        Ok(())
    }

    fn start_all_reduce_device(&self, buf: DeviceBuffer, op: ReduceOp) -> DeviceRequest {
        let (len, dtype) = (buf.len(), buf.dtype());
        let call = Call::AllReduce { len, op };
        self.start_device(call, None, None, buf, move |_, a| Plan::AllReduce {
            buf: a,
            len,
            dtype,
            op,
        })
    }

    fn start_all_gather_device(&self, send: DeviceBuffer, recv: DeviceBuffer) -> DeviceRequest {
        let (s, r, dtype) = (send.len(), recv.len(), send.dtype());
        let invalid = self.even_invalid((dtype, recv.dtype()), ("recv", r), s);
        let call = Call::AllGather { send: s, recv: r };
        self.start_device(call, invalid, Some(send), recv, move |sa, ra| {
            Plan::AllGather {
                send: sa.unwrap_or(0),
                recv: ra,
                count: s,
                dtype,
            }
        })
    }

    fn start_all_gatherv_device(
        &self,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        counts: &[usize],
    ) -> DeviceRequest {
        let (s, r, dtype) = (send.len(), recv.len(), send.dtype());
        let invalid = self.uneven_invalid((dtype, recv.dtype()), r, ("send", s), counts);
        let call = Call::AllGatherV {
            send: s,
            recv: r,
            counts: counts.to_vec(),
            rows: 1,
        };
        let (counts, n) = (counts.to_vec(), self.size);
        self.start_device(call, invalid, Some(send), recv, move |sa, ra| {
            all_gatherv_plan(n, (sa.unwrap_or(0), s), ra, &counts, dtype)
        })
    }

    fn start_reduce_scatter_device(
        &self,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        op: ReduceOp,
    ) -> DeviceRequest {
        let (s, r, dtype) = (send.len(), recv.len(), send.dtype());
        let invalid = self.even_invalid((dtype, recv.dtype()), ("send", s), r);
        let call = Call::ReduceScatter {
            send: s,
            recv: r,
            op,
        };
        self.start_device(call, invalid, Some(send), recv, move |sa, ra| {
            Plan::ReduceScatter {
                send: sa.unwrap_or(0),
                recv: ra,
                count: r,
                dtype,
                op,
            }
        })
    }

    fn start_reduce_scatterv_device(
        &self,
        send: DeviceBuffer,
        recv: DeviceBuffer,
        counts: &[usize],
        op: ReduceOp,
    ) -> DeviceRequest {
        let (s, r, dtype) = (send.len(), recv.len(), send.dtype());
        let invalid = self.uneven_invalid((dtype, recv.dtype()), s, ("recv", r), counts);
        let call = Call::ReduceScatterV {
            send: s,
            recv: r,
            counts: counts.to_vec(),
            op,
            rows: 1,
        };
        let counts = counts.to_vec();
        self.start_device(call, invalid, Some(send), recv, move |sa, ra| {
            reduce_scatterv_plan(sa.unwrap_or(0), ra, &counts, dtype, op)
        })
    }
}

/// Which world ranks have left their closure, and why (shared by a launch's ranks).
#[derive(Debug)]
pub(super) struct Departures {
    left: Mutex<Vec<Option<String>>>,
}

impl Departures {
    /// No rank of a world of `world_size` has left yet.
    pub(super) fn new(world_size: usize) -> Departures {
        Departures {
            left: Mutex::new(vec![None; world_size]),
        }
    }

    /// Why world rank `rank` left, if it has.
    pub(super) fn reason(&self, rank: usize) -> Option<String> {
        let left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        left.get(rank).cloned().flatten()
    }

    pub(super) fn depart(&self, rank: usize, reason: String) {
        let mut left = self.left.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(slot) = left.get_mut(rank) {
            if slot.is_none() {
                *slot = Some(reason);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn non_blocking_config_is_nccl_config_initializer_with_blocking_0() {
        let c = non_blocking_config();
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.version, 23000);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.minCTAs, i32::MIN);
        assert!(c.netName.is_null() && c.commName.is_null());
    }

    #[test]
    fn blocks_and_offsets_follow_counts() {
        assert_eq!(blocks(&[3, 0, 5]), vec![(0, 3), (3, 0), (3, 5)]);
        assert_eq!(offset(0x1000, 3, DType::BF16), 0x1006);
        assert_eq!(offset(0x1000, 3, DType::F64), 0x1018);
    }

    #[test]
    fn host_buffers_refused_with_the_message() {
        let e = host_refused("all_reduce").unwrap_err();
        assert_eq!(
            e.to_string(),
            "all_reduce: invalid argument: nccl backend: host buffers are not staged through \
             the device; pass device buffers to the `*_device` methods"
        );
    }

    /// Rank `r`'s memory in the model below: `ELEMS` values at device address `base(r)`.
    const ELEMS: usize = 64;
    fn base(r: usize) -> u64 {
        0x7f00_0000_0000 + (r as u64) * 0x1_0000_0000
    }

    /// The element index of device address `addr` in rank `r`'s memory, checking that it
    /// is one (in range, on an element boundary of `dtype`).
    fn index(r: usize, addr: u64, len: usize, dtype: DType) -> usize {
        let bytes = addr
            .checked_sub(base(r))
            .unwrap_or_else(|| panic!("rank {r}: address {addr:#x} below its memory"));
        let size = dtype.size_in_bytes() as u64;
        assert_eq!(
            bytes % size,
            0,
            "rank {r}: {addr:#x} not on a {dtype} boundary"
        );
        let i = (bytes / size) as usize;
        assert!(
            i + len <= ELEMS,
            "rank {r}: [{i}, {}) out of its memory",
            i + len
        );
        i
    }

    /// A host model of NCCL running one grouped exchange per rank (`plans[r]`, addresses
    /// in rank `r`'s memory): the sends from `p` to `q` meet `q`'s receives from `p` in
    /// issue order, with equal counts (NCCL's rule; a mismatch is undefined behaviour
    /// there, a panic here); empty transfers are skipped as `Plan::enqueue` skips them.
    fn run_exchanges(plans: &[Plan], mem: &mut [Vec<f64>]) {
        let n = plans.len();
        let parts = |r: usize| match &plans[r] {
            Plan::Exchange {
                sends,
                recvs,
                dtype,
            } => (sends.clone(), recvs.clone(), *dtype),
            other => panic!("rank {r}: not an exchange: {other:?}"),
        };
        for p in 0..n {
            for q in 0..n {
                let (sends, _, dtype) = parts(p);
                let (_, recvs, rdtype) = parts(q);
                assert_eq!(dtype, rdtype);
                let out: Vec<_> = sends.iter().filter(|t| t.0 == q && t.2 > 0).collect();
                let inn: Vec<_> = recvs.iter().filter(|t| t.0 == p && t.2 > 0).collect();
                assert_eq!(out.len(), inn.len(), "sends {p} -> {q} vs receives");
                for (&(_, sa, c), &(_, ra, rc)) in out.into_iter().zip(inn) {
                    assert_eq!(c, rc, "send {p} -> {q} of {c}, receive of {rc}");
                    let (si, ri) = (index(p, sa, c, dtype), index(q, ra, c, dtype));
                    let data = mem[p][si..si + c].to_vec();
                    mem[q][ri..ri + c].copy_from_slice(&data);
                }
            }
        }
    }

    /// Every rank's memory: its own values `1000·r + i` (distinct everywhere).
    fn memories(n: usize) -> Vec<Vec<f64>> {
        (0..n)
            .map(|r| (0..ELEMS).map(|i| (1000 * r + i) as f64).collect())
            .collect()
    }

    /// Where `recv` starts in rank `r`'s memory (after its send region).
    const RECV_AT: usize = 32;

    #[test]
    fn all_to_allv_plan_delivers_each_block_to_its_peer_at_its_offset() {
        let n = 3;
        let c = |p: usize, q: usize| (p + 2 * q) % 4;
        for dtype in [DType::BF16, DType::F32, DType::F64] {
            let plans: Vec<Plan> = (0..n)
                .map(|r| {
                    let sc: Vec<usize> = (0..n).map(|q| c(r, q)).collect();
                    let rc: Vec<usize> = (0..n).map(|p| c(p, r)).collect();
                    let recv = offset(base(r), RECV_AT, dtype);
                    all_to_allv_plan((base(r), &sc), (recv, &rc), dtype)
                })
                .collect();
            let mut mem = memories(n);
            run_exchanges(&plans, &mut mem);
            for (q, m) in mem.iter().enumerate() {
                let mut want = Vec::new();
                for p in 0..n {
                    let off: usize = (0..q).map(|x| c(p, x)).sum();
                    want.extend((off..off + c(p, q)).map(|i| (1000 * p + i) as f64));
                }
                assert_eq!(
                    &m[RECV_AT..RECV_AT + want.len()],
                    &want[..],
                    "rank {q} {dtype}"
                );
            }
        }
    }

    #[test]
    fn all_to_all_plan_swaps_block_p_of_q_with_block_q_of_p() {
        let (n, k) = (4, 3);
        let plans: Vec<Plan> = (0..n)
            .map(|r| {
                all_to_all_plan(
                    n,
                    base(r),
                    offset(base(r), RECV_AT, DType::F32),
                    k,
                    DType::F32,
                )
            })
            .collect();
        let mut mem = memories(n);
        run_exchanges(&plans, &mut mem);
        for (q, m) in mem.iter().enumerate() {
            let want: Vec<f64> = (0..n)
                .flat_map(|p| (q * k..q * k + k).map(move |i| (1000 * p + i) as f64))
                .collect();
            assert_eq!(&m[RECV_AT..RECV_AT + n * k], &want[..], "rank {q}");
        }
    }

    #[test]
    fn all_gatherv_plan_places_every_piece_in_rank_order_uneven_and_empty() {
        let counts = [3usize, 0, 5, 1];
        let n = counts.len();
        let dtype = DType::I64;
        let plans: Vec<Plan> = (0..n)
            .map(|r| {
                let recv = offset(base(r), RECV_AT, dtype);
                all_gatherv_plan(n, (base(r), counts[r]), recv, &counts, dtype)
            })
            .collect();
        let mut mem = memories(n);
        run_exchanges(&plans, &mut mem);
        let want: Vec<f64> = (0..n)
            .flat_map(|p| (0..counts[p]).map(move |i| (1000 * p + i) as f64))
            .collect();
        for (r, m) in mem.iter().enumerate() {
            assert_eq!(&m[RECV_AT..RECV_AT + want.len()], &want[..], "rank {r}");
        }
    }

    #[test]
    fn reduce_scatterv_plan_reduces_block_p_to_root_p_in_one_call_order() {
        let counts = [2usize, 0, 3];
        let n = counts.len();
        let dtype = DType::F16;
        let plans: Vec<Plan> = (0..n)
            .map(|r| {
                let recv = offset(base(r), RECV_AT, dtype);
                reduce_scatterv_plan(base(r), recv, &counts, dtype, ReduceOp::Sum)
            })
            .collect();
        let blocks_of = |r: usize| match &plans[r] {
            Plan::Reduces { blocks, recv, .. } => (blocks.clone(), *recv),
            other => panic!("not a grouped reduce: {other:?}"),
        };
        // The grouped ncclReduce calls must match across ranks in order: same roots, same
        // counts (the addresses are each rank's own).
        let order = |r: usize| -> Vec<(usize, usize)> {
            blocks_of(r)
                .0
                .iter()
                .filter(|t| t.2 > 0)
                .map(|t| (t.0, t.2))
                .collect()
        };
        for r in 1..n {
            assert_eq!(order(r), order(0), "rank {r}'s reduces");
        }
        let mut mem = memories(n);
        for (j, &(root, count)) in order(0).iter().enumerate() {
            let mut sum = vec![0.0; count];
            for (r, m) in mem.iter().enumerate() {
                let addr = blocks_of(r).0.iter().filter(|t| t.2 > 0).nth(j).unwrap().1;
                let i = index(r, addr, count, dtype);
                for (s, v) in sum.iter_mut().zip(&m[i..i + count]) {
                    *s += v;
                }
            }
            let ri = index(root, blocks_of(root).1, count, dtype);
            mem[root][ri..ri + count].copy_from_slice(&sum);
        }
        for (r, m) in mem.iter().enumerate() {
            let off: usize = counts[..r].iter().sum();
            let want: Vec<f64> = (off..off + counts[r])
                .map(|i| (0..n).map(|p| (1000 * p + i) as f64).sum())
                .collect();
            assert_eq!(&m[RECV_AT..RECV_AT + counts[r]], &want[..], "rank {r}");
        }
    }

    #[test]
    fn split_group_orders_by_key_then_parent_rank_like_nccl() {
        // (color, key) of parent ranks 0..4.
        let pairs = [0, 1, 1, 0, 0, 0, 0, 1, 1, 0];
        assert_eq!(split_group(&pairs, 0, 0), Some((1, vec![2, 0, 3])));
        assert_eq!(split_group(&pairs, 0, 2), Some((0, vec![2, 0, 3])));
        assert_eq!(split_group(&pairs, 0, 3), Some((2, vec![2, 0, 3])));
        assert_eq!(split_group(&pairs, 1, 4), Some((1, vec![1, 4])));
        assert_eq!(split_group(&pairs, 1, 0), None);
    }

    #[test]
    fn dtype_and_op_map_to_nccl() {
        assert_eq!(nccl_dtype(DType::BF16), sys::ncclDataType_t::ncclBfloat16);
        assert_eq!(nccl_dtype(DType::I64), sys::ncclDataType_t::ncclInt64);
        assert_eq!(nccl_op(ReduceOp::Avg), sys::ncclRedOp_t::ncclAvg);
    }
}
