//! The progress worker behind the asynchronous collectives of the threads and MPI
//! backends: one thread per communicator handle that runs the handle's started requests
//! one after another, in start order, while the caller's thread goes on computing.
//!
//! Why a worker thread rather than progress made inside `wait`: on the threads backend a
//! collective is memory copies that some thread must execute, and on MPI the agreement on
//! a call (a header round trip) must finish before any data may move, and OpenMPI
//! advances a non-blocking collective only inside MPI calls. Either way, without a thread
//! of its own the collective would only move while the caller sits in `wait`.
//!
//! A worker executes the same code as the blocking call (join or agreement, checks, data
//! phase, counters), so results, errors and counters cannot differ between the two.
//!
//! # Ordering
//!
//! A handle's collectives form one sequence. The worker keeps start order (a FIFO), and a
//! blocking call passes through [`Progress::blocking`], which waits until every request
//! started before it has completed and, while the blocking call runs, refuses new
//! requests (only another thread could start one then: a misuse, answered with the same
//! `InvalidArgument` as two concurrent blocking calls). So the worker and a blocking call
//! never run a collective of the same handle at the same time.
//!
//! # Lifetime
//!
//! The worker starts with the first request and ends with its handle: the handle's drop
//! ([`Progress::shutdown`]) lets it finish every queued request (each bounded by the
//! backend's timeout) and joins it. No thread outlives its communicator.

use crate::request::{Buffer, Pending, Request};
use crate::{Error, Result};
use std::any::Any;
use std::collections::VecDeque;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding this mutex (jobs run outside it).
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A queued request: runs the collective and sends its outcome to the request.
type Job = Box<dyn FnOnce() + Send>;

/// What a job sends its request: the collective's result, or the panic that escaped it
/// (re-raised by `wait`, as the blocking call would have raised it).
type Outcome = std::thread::Result<Result<Buffer>>;

#[derive(Default)]
struct Queue {
    jobs: VecDeque<Job>,
    /// Requests queued and requests finished so far; equal when the worker is idle.
    started: u64,
    finished: u64,
    /// A blocking collective is running (or waiting for the queue to drain).
    blocking: bool,
    /// The handle is being dropped: the worker finishes the queue, then ends.
    closed: bool,
}

#[derive(Default)]
struct Shared {
    queue: Mutex<Queue>,
    /// Signals new jobs (to the worker) and finished ones (to a draining blocking call).
    cv: Condvar,
}

/// One handle's queue of started requests and the thread that runs them.
pub(crate) struct Progress {
    shared: Arc<Shared>,
    worker: Mutex<Option<JoinHandle<()>>>,
    /// The worker's thread name.
    name: String,
    /// The handle's world rank, for the error of a request that never ran.
    world_rank: usize,
}

/// The error of a collective started (or called) while another thread holds the handle in
/// a blocking collective.
pub(crate) fn busy_error(op: &'static str) -> Error {
    Error::InvalidArgument {
        op,
        detail: "another collective is in flight on this handle (a handle is one rank's end \
                 of a group: call its collectives from one thread)"
            .into(),
    }
}

/// Held by a blocking collective while it runs: the queue is empty and stays so.
pub(crate) struct Gate<'a>(&'a Shared);

impl Drop for Gate<'_> {
    fn drop(&mut self) {
        lock(&self.0.queue).blocking = false;
    }
}

impl Progress {
    /// A queue whose worker, once started, is the thread `name`.
    pub(crate) fn new(name: String, world_rank: usize) -> Progress {
        Progress {
            shared: Arc::default(),
            worker: Mutex::new(None),
            name,
            world_rank,
        }
    }

    /// Queues `job` (the collective, run on the worker thread) behind the requests started
    /// before it, and returns its request.
    pub(crate) fn submit(
        &self,
        op: &'static str,
        job: impl FnOnce() -> Result<Buffer> + Send + 'static,
    ) -> Request {
        let (tx, rx) = mpsc::sync_channel::<Outcome>(1);
        let job: Job = Box::new(move || {
            // A panic here is a broken internal invariant (the backends turn every failure
            // they expect into an error); it is handed to `wait` and the worker goes on.
            let _ = tx.send(catch_unwind(AssertUnwindSafe(job)));
        });
        {
            let mut q = lock(&self.shared.queue);
            if q.blocking {
                return Request::ready(op, Err(busy_error(op)));
            }
            q.jobs.push_back(job);
            q.started += 1;
        }
        self.shared.cv.notify_all();
        self.ensure_worker();
        Request::new(
            op,
            Box::new(Queued {
                op,
                rx,
                got: None,
                world_rank: self.world_rank,
            }),
        )
    }

    /// Starts the worker if it is not running. If no thread can be started, runs the queue
    /// on this thread instead: the requests still complete, in order, without overlap.
    fn ensure_worker(&self) {
        let mut worker = lock(&self.worker);
        if worker.is_some() {
            return;
        }
        let shared = self.shared.clone();
        let rank = self.world_rank;
        match std::thread::Builder::new()
            .name(self.name.clone())
            .spawn(move || {
                // The worker's collectives show on its rank's row, as its second thread.
                crate::trace::set_row(rank, 1);
                work(&shared)
            }) {
            Ok(handle) => *worker = Some(handle),
            Err(_) => {
                drop(worker);
                while let Some(job) = self.pop() {
                    run_job(&self.shared, job);
                }
            }
        }
    }

    fn pop(&self) -> Option<Job> {
        lock(&self.shared.queue).jobs.pop_front()
    }

    /// For a blocking collective: waits until every request started before has completed,
    /// then holds the handle until the returned gate drops. `Err` if another thread is in
    /// a blocking collective on this handle.
    ///
    /// The wait has no timeout of its own: each queued request ends within the backend's
    /// bounds (a join or agreement bounded by the timeout, after which the group is failed
    /// and later requests fail at once), so the queue drains within them too.
    pub(crate) fn blocking(&self, op: &'static str) -> Result<Gate<'_>> {
        let mut q = lock(&self.shared.queue);
        if q.blocking {
            return Err(busy_error(op));
        }
        q.blocking = true;
        let gate = Gate(&self.shared);
        while q.finished != q.started {
            q = self
                .shared
                .cv
                .wait(q)
                .unwrap_or_else(PoisonError::into_inner);
        }
        Ok(gate)
    }

    /// Lets the worker finish every queued request, then joins it. Called by the handle's
    /// drop, so that no worker thread outlives its communicator.
    pub(crate) fn shutdown(&self) {
        lock(&self.shared.queue).closed = true;
        self.shared.cv.notify_all();
        let handle = lock(&self.worker).take();
        if let Some(h) = handle {
            // The worker never holds a handle, so this never runs on the worker itself;
            // checked all the same, since joining oneself would never return.
            if h.thread().id() != std::thread::current().id() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Progress {
    /// The handles call [`Progress::shutdown`] in their own drop, before their other
    /// fields go (so that the worker's references to the handle's core are gone first);
    /// this only makes a `Progress` dropped any other way end its worker too.
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Runs one job and counts it finished (waking a blocking call that drains the queue).
fn run_job(shared: &Shared, job: Job) {
    job();
    lock(&shared.queue).finished += 1;
    shared.cv.notify_all();
}

/// The worker: runs queued jobs in order until the handle closes and the queue is empty.
fn work(shared: &Shared) {
    loop {
        let job = {
            let mut q = lock(&shared.queue);
            loop {
                if let Some(job) = q.jobs.pop_front() {
                    break job;
                }
                if q.closed {
                    return;
                }
                q = shared.cv.wait(q).unwrap_or_else(PoisonError::into_inner);
            }
        };
        run_job(shared, job);
    }
}

/// A request on the worker's queue: its outcome arrives on `rx`.
struct Queued {
    op: &'static str,
    rx: mpsc::Receiver<Outcome>,
    /// The outcome, once `test` has seen it.
    got: Option<Outcome>,
    world_rank: usize,
}

impl Queued {
    fn finish(outcome: Outcome) -> Result<Buffer> {
        outcome.unwrap_or_else(|payload: Box<dyn Any + Send>| resume_unwind(payload))
    }

    /// The job was dropped without running (only if its worker died, which the workers'
    /// `catch_unwind` rules out): an error, not a hang.
    fn lost(&self) -> Error {
        Error::RankFailed {
            rank: self.world_rank,
            op: self.op,
            reason: "its progress worker ended before running this request".into(),
        }
    }
}

impl Pending for Queued {
    fn test(&mut self) -> bool {
        if self.got.is_none() {
            match self.rx.try_recv() {
                Ok(outcome) => self.got = Some(outcome),
                Err(mpsc::TryRecvError::Empty) => return false,
                Err(mpsc::TryRecvError::Disconnected) => self.got = Some(Ok(Err(self.lost()))),
            }
        }
        true
    }

    fn wait(mut self: Box<Self>) -> Result<Buffer> {
        if let Some(outcome) = self.got.take() {
            return Queued::finish(outcome);
        }
        match self.rx.recv() {
            Ok(outcome) => Queued::finish(outcome),
            Err(mpsc::RecvError) => Err(self.lost()),
        }
    }
}

/// The [`Communicator`](crate::Communicator) methods a backend handle with a progress
/// worker forwards to its core, the same in every such backend: each blocking collective
/// passes the handle's gate (`self.gated(op, …)`) first, `send`/`recv` are outside the
/// collective sequence, and each `start_*` queues the blocking path on the worker
/// (`self.start(op, …)`). The handle provides `gated`, `start` and a `core` whose methods
/// mirror the trait's.
macro_rules! forward_to_core {
    () => {
        fn all_reduce(&self, buf: SliceMut<'_>, op: ReduceOp) -> Result<()> {
            self.gated("all_reduce", |c| c.all_reduce(buf, op))
        }

        fn all_gather(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()> {
            self.gated("all_gather", |c| c.all_gather(send, recv))
        }

        fn all_gatherv(&self, send: Slice<'_>, recv: SliceMut<'_>, counts: &[usize]) -> Result<()> {
            self.gated("all_gatherv", |c| c.all_gatherv(send, recv, counts))
        }

        fn all_gatherv_in_place(&self, buf: SliceMut<'_>, counts: &[usize]) -> Result<()> {
            self.gated("all_gatherv", |c| c.all_gatherv_in_place(buf, counts))
        }

        fn reduce_scatterv_in_place(
            &self,
            buf: SliceMut<'_>,
            counts: &[usize],
            op: ReduceOp,
        ) -> Result<()> {
            self.gated("reduce_scatterv", |c| {
                c.reduce_scatterv_in_place(buf, counts, op)
            })
        }

        fn reduce_scatter(&self, send: Slice<'_>, recv: SliceMut<'_>, op: ReduceOp) -> Result<()> {
            self.gated("reduce_scatter", |c| c.reduce_scatter(send, recv, op))
        }

        fn reduce_scatterv(
            &self,
            send: Slice<'_>,
            recv: SliceMut<'_>,
            counts: &[usize],
            op: ReduceOp,
        ) -> Result<()> {
            self.gated("reduce_scatterv", |c| {
                c.reduce_scatterv(send, recv, counts, op)
            })
        }

        fn all_gather_cols(
            &self,
            send: Slice<'_>,
            recv: SliceMut<'_>,
            rows: usize,
            widths: &[usize],
        ) -> Result<()> {
            self.gated("all_gatherv", |c| {
                c.all_gather_cols(send, recv, rows, widths)
            })
        }

        fn reduce_scatter_cols(
            &self,
            send: Slice<'_>,
            recv: SliceMut<'_>,
            rows: usize,
            widths: &[usize],
            op: ReduceOp,
        ) -> Result<()> {
            self.gated("reduce_scatterv", |c| {
                c.reduce_scatter_cols(send, recv, rows, widths, op)
            })
        }

        fn all_to_all_cols(
            &self,
            send: Slice<'_>,
            rows: usize,
            send_widths: &[usize],
            recv: SliceMut<'_>,
            recv_counts: &[usize],
        ) -> Result<()> {
            self.gated("all_to_allv", |c| {
                c.all_to_all_cols(send, rows, send_widths, recv, recv_counts)
            })
        }

        fn all_to_all(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()> {
            self.gated("all_to_all", |c| c.all_to_all(send, recv))
        }

        fn all_to_allv(
            &self,
            send: Slice<'_>,
            send_counts: &[usize],
            recv: SliceMut<'_>,
            recv_counts: &[usize],
        ) -> Result<()> {
            self.gated("all_to_allv", |c| {
                c.all_to_allv(send, send_counts, recv, recv_counts)
            })
        }

        fn broadcast(&self, buf: SliceMut<'_>, root: usize) -> Result<()> {
            self.gated("broadcast", |c| c.broadcast(buf, root))
        }

        /// Not in the collective sequence: does not wait for pending requests.
        fn send(&self, buf: Slice<'_>, dst: usize, tag: u32) -> Result<()> {
            self.core.send(buf, dst, tag)
        }

        /// Not in the collective sequence: does not wait for pending requests.
        fn recv(&self, buf: SliceMut<'_>, src: usize, tag: u32) -> Result<()> {
            self.core.recv(buf, src, tag)
        }

        fn barrier(&self) -> Result<()> {
            self.gated("barrier", |c| c.barrier())
        }

        fn counters(&self) -> CounterSnapshot {
            self.core.counters.snapshot()
        }

        fn set_label(&self, label: &'static str) {
            self.core.counters.set_label(label)
        }

        fn start_all_reduce(&self, mut buf: Buffer, op: ReduceOp) -> Request {
            self.start("all_reduce", move |c| {
                c.all_reduce(buf.as_slice_mut(), op).map(|()| buf)
            })
        }

        fn start_all_gather(&self, send: Buffer, mut recv: Buffer) -> Request {
            self.start("all_gather", move |c| {
                c.all_gather(send.as_slice(), recv.as_slice_mut())
                    .map(|()| recv)
            })
        }

        fn start_all_gatherv(&self, send: Buffer, mut recv: Buffer, counts: &[usize]) -> Request {
            let counts = counts.to_vec();
            self.start("all_gatherv", move |c| {
                c.all_gatherv(send.as_slice(), recv.as_slice_mut(), &counts)
                    .map(|()| recv)
            })
        }

        fn start_reduce_scatter(&self, send: Buffer, mut recv: Buffer, op: ReduceOp) -> Request {
            self.start("reduce_scatter", move |c| {
                c.reduce_scatter(send.as_slice(), recv.as_slice_mut(), op)
                    .map(|()| recv)
            })
        }

        fn start_reduce_scatterv(
            &self,
            send: Buffer,
            mut recv: Buffer,
            counts: &[usize],
            op: ReduceOp,
        ) -> Request {
            let counts = counts.to_vec();
            self.start("reduce_scatterv", move |c| {
                c.reduce_scatterv(send.as_slice(), recv.as_slice_mut(), &counts, op)
                    .map(|()| recv)
            })
        }
    };
}
pub(crate) use forward_to_core;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Mutex as StdMutex;

    fn progress() -> Progress {
        Progress::new("test-progress".into(), 0)
    }

    fn ok() -> Result<Buffer> {
        Ok(Buffer::from(vec![1i32]))
    }

    #[test]
    fn requests_run_in_start_order_and_wait_in_any_order() {
        let p = progress();
        let log = Arc::new(StdMutex::new(Vec::new()));
        let reqs: Vec<Request> = (0..20)
            .map(|i| {
                let log = log.clone();
                p.submit("job", move || {
                    log.lock().unwrap().push(i);
                    Ok(Buffer::from(vec![i]))
                })
            })
            .collect();
        for (i, r) in reqs.into_iter().enumerate().rev() {
            assert_eq!(r.wait().unwrap(), Buffer::from(vec![i as i32]));
        }
        assert_eq!(*log.lock().unwrap(), (0..20).collect::<Vec<i32>>());
    }

    #[test]
    fn blocking_call_runs_after_the_requests_started_before_it() {
        let p = progress();
        let log = Arc::new(StdMutex::new(Vec::new()));
        let (go, gate) = mpsc::channel::<()>();
        let job_log = log.clone();
        let req = p.submit("job", move || {
            gate.recv().unwrap();
            job_log.lock().unwrap().push("request");
            ok()
        });
        std::thread::scope(|s| {
            let blocking = s.spawn(|| {
                let _gate = p.blocking("blocking").unwrap();
                log.lock().unwrap().push("blocking");
                // While it runs, no request may start (only another thread could try).
                let e = p.submit("late", ok).wait().unwrap_err();
                assert!(
                    matches!(e, Error::InvalidArgument { op: "late", .. }),
                    "{e}"
                );
                // Nor a second blocking call.
                assert!(p.blocking("second").is_err());
            });
            go.send(()).unwrap();
            blocking.join().unwrap();
        });
        assert_eq!(*log.lock().unwrap(), ["request", "blocking"]);
        req.wait().unwrap();
        // The gate is released: requests start again.
        p.submit("after", ok).wait().unwrap();
    }

    #[test]
    fn dropped_request_waits_and_shutdown_finishes_the_queue() {
        let p = progress();
        let done = Arc::new(AtomicU64::new(0));
        for _ in 0..3 {
            let done = done.clone();
            drop(p.submit("job", move || {
                done.fetch_add(1, Ordering::SeqCst);
                ok()
            }));
        }
        // Each drop waited for its request.
        assert_eq!(done.load(Ordering::SeqCst), 3);
        let d = done.clone();
        let (go, gate) = mpsc::channel::<()>();
        let pending = p.submit("queued", move || {
            gate.recv().unwrap();
            d.fetch_add(1, Ordering::SeqCst);
            ok()
        });
        go.send(()).unwrap();
        p.shutdown();
        // The worker ran the queued request before ending.
        assert_eq!(done.load(Ordering::SeqCst), 4);
        let mut pending = pending;
        assert!(pending.test());
        pending.wait().unwrap();
    }

    #[test]
    fn panic_in_a_request_reaches_its_wait_and_the_worker_goes_on() {
        let p = progress();
        let bad = p.submit("bad", || panic!("broken invariant"));
        let good = p.submit("good", ok);
        let caught = catch_unwind(AssertUnwindSafe(|| bad.wait())).unwrap_err();
        assert_eq!(caught.downcast_ref::<&str>(), Some(&"broken invariant"));
        good.wait().unwrap();
        // Dropping a request whose job panics does not panic.
        drop(p.submit("bad again", || panic!("again")));
        p.submit("still good", ok).wait().unwrap();
    }
}
