//! Fault injection under load: 1,000 randomized runs of a short GPT training loop on four
//! thread ranks, where one rank fails at a random communicator call.
//!
//! Each run picks (from a seeded RNG, seed printed) a parallel layout, the failing rank,
//! the call index (uniform over the calls that rank makes in a clean run of that layout)
//! and a fault kind:
//!
//! - `error`: the call returns an `Err` (the rank's closure returns it, as a failing rank
//!   would);
//! - `panic`: the call panics (the rank's closure panics);
//! - `leave`: the rank's closure returns `Ok` early, from inside the call, without joining
//!   it ("returned before joining");
//! - `stop`: the rank never joins the call or any later one: it sits in the call until
//!   every other rank has finished (so its peers can only notice it by the timeout), then
//!   returns an error.
//!
//! Every other rank must return `Err` (never `Ok`, never a panic), the failing rank's
//! outcome must be the injected one, and the run must end within a deadline (a watchdog
//! per run; a hang fails the test with the run's parameters). The counts per fault kind ×
//! what the peers saw are printed at the end.
//!
//! The fault sits in a `Communicator` wrapper ([`FaultComm`]) around the world: it counts
//! every call that moves data or agrees on something (collectives, `send`/`recv`,
//! `barrier`, `split`, and the `start_*` asynchronous collectives, counted when started),
//! one counter per rank shared with the communicators `split` returns, so the mesh's axis
//! communicators count too.
//!
//! The layouts cover the collectives a training step issues: all-reduce, all-gather,
//! reduce-scatter (TP + SP, FSDP), asynchronous all-reduce (DDP buckets) and all-gather
//! (FSDP prefetch), send/recv (ring attention over `Cp`) and all-to-all (Ulysses
//! attention over `Cp`), and the splits that build the mesh.
//!
//! Alone in its test binary: it installs a panic hook that silences injected panics.

use dtensor::collectives::threads::{self, RankError};
use dtensor::collectives::{Buffer, Request, Slice, SliceMut};
#[cfg(feature = "cuda")]
use dtensor::collectives::{DeviceBuffer, DeviceRequest};
#[cfg(feature = "cuda")]
use dtensor::kernels::cuda::{DeviceView, DeviceViewMut};
use dtensor::nn::*;
use dtensor::placement::ParallelConfig;
use dtensor::prelude::*;
use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

type CommResult<T> = dtensor::collectives::Result<T>;
type CommError = dtensor::collectives::Error;

const RUNS: usize = 1000;
/// The RNG's seed; `FAULT_INJECTION_SEED` (decimal or 0x-hex) replays another.
const SEED: u64 = 0x5EED_FA17;

fn seed() -> u64 {
    std::env::var("FAULT_INJECTION_SEED")
        .ok()
        .and_then(|s| match s.trim().strip_prefix("0x") {
            Some(hex) => u64::from_str_radix(hex, 16).ok(),
            None => s.trim().parse().ok(),
        })
        .unwrap_or(SEED)
}
const WORLD: usize = 4;
/// The threads backend's timeout in every run: how long a rank waits for a stopped peer.
const TIMEOUT: Duration = Duration::from_millis(250);
/// Runs in flight at once (a stopped rank mostly sleeps, so runs overlap well).
const CONCURRENT: usize = 4;
/// A run that has not ended after this long is a hang.
const DEADLINE: Duration = Duration::from_secs(10);
/// Training steps per run.
const STEPS: usize = 2;
/// Tokens per sample, samples per batch.
const SEQ: usize = 8;
const BATCH: usize = 2;

/// What the failing rank does at its chosen call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    Error,
    Panic,
    Leave,
    Stop,
}

const KINDS: [Kind; 4] = [Kind::Error, Kind::Panic, Kind::Leave, Kind::Stop];

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Error => "error",
            Kind::Panic => "panic",
            Kind::Leave => "leave",
            Kind::Stop => "stop",
        })
    }
}

/// The marker in the messages of injected errors and panics.
const INJECTED: &str = "injected fault";

/// The panic payload of a `leave`: caught by the rank's closure, which then returns `Ok`.
struct Leave;

/// A fault: on call `at` (0-based, this rank's count), do `kind`.
#[derive(Clone, Copy, Debug)]
struct Fault {
    at: u64,
    kind: Kind,
}

/// What one run shares between its ranks: when the fault fired, and when each of the
/// other ranks finished (a stopped rank waits for them all).
#[derive(Default)]
struct RunState {
    finished: AtomicUsize,
    fired_at: Mutex<Option<Instant>>,
    /// The latest finish of a rank other than the failing one.
    last_peer_done: Mutex<Option<Instant>>,
}

impl RunState {
    /// A rank other than the failing one has finished (however its closure ended).
    fn peer_done(&self) {
        let now = Instant::now();
        let mut last = self.last_peer_done.lock().unwrap();
        *last = Some(last.map_or(now, |t| t.max(now)));
        self.finished.fetch_add(1, Ordering::SeqCst);
    }

    /// How long after the fault the last peer finished.
    fn peer_latency(&self) -> Option<Duration> {
        let fired = (*self.fired_at.lock().unwrap())?;
        let done = (*self.last_peer_done.lock().unwrap())?;
        Some(done.saturating_duration_since(fired))
    }
}

/// One rank's fault state, shared by its world communicator and every communicator split
/// from it.
struct RankState {
    calls: AtomicU64,
    fault: Option<Fault>,
    /// The op the fault fired at, and whether it was an asynchronous start; once set, no
    /// call reaches the real communicator again.
    fired: Mutex<Option<(&'static str, bool)>>,
    run: Arc<RunState>,
}

impl RankState {
    fn new(fault: Option<Fault>, run: Arc<RunState>) -> Arc<RankState> {
        Arc::new(RankState {
            calls: AtomicU64::new(0),
            fault,
            fired: Mutex::new(None),
            run,
        })
    }

    fn fired(&self) -> Option<(&'static str, bool)> {
        *self.fired.lock().unwrap()
    }
}

/// A communicator that forwards to `inner` and injects its rank's fault.
struct FaultComm {
    inner: Arc<dyn Communicator>,
    state: Arc<RankState>,
}

impl FaultComm {
    fn wrap(inner: Arc<dyn Communicator>, state: Arc<RankState>) -> Arc<dyn Communicator> {
        Arc::new(FaultComm { inner, state })
    }

    /// Counts a call of `op` (`start`: an asynchronous start); `Err` if it must not reach
    /// the real communicator.
    fn enter(&self, op: &'static str, start: bool) -> CommResult<()> {
        match self.state.fired() {
            // The fault hit an asynchronous start: its error shows only at the request's
            // wait, so the rank may go on issuing calls until then. Its communicator is
            // broken: they fail alike.
            Some((_, true)) => return Err(injected_error(op)),
            // The fault hit a blocking call: only a rank that swallowed the error gets
            // here. The test then sees this error instead of the injected one and fails.
            Some((first, false)) => {
                return Err(CommError::InvalidArgument {
                    op,
                    detail: format!("called after the {INJECTED} at {first}"),
                })
            }
            None => {}
        }
        let i = self.state.calls.fetch_add(1, Ordering::SeqCst);
        match self.state.fault {
            Some(f) if f.at == i => {
                *self.state.fired.lock().unwrap() = Some((op, start));
                *self.state.run.fired_at.lock().unwrap() = Some(Instant::now());
                self.fire(op, f.kind)
            }
            _ => Ok(()),
        }
    }

    fn fire(&self, op: &'static str, kind: Kind) -> CommResult<()> {
        match kind {
            Kind::Error => Err(injected_error(op)),
            Kind::Panic => panic!("{INJECTED}: panic at {op}"),
            Kind::Leave => std::panic::panic_any(Leave),
            Kind::Stop => {
                // Never joins this call nor any later one: its peers can only give up on it
                // by the timeout (or because a peer that did has departed). It returns once
                // they all have; if they hang, the watchdog fails the run first.
                let start = Instant::now();
                while self.state.run.finished.load(Ordering::SeqCst) < WORLD - 1
                    && start.elapsed() < 2 * DEADLINE
                {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(injected_error(op))
            }
        }
    }

    fn start<B: Send + 'static>(
        &self,
        op: &'static str,
        f: impl FnOnce(&dyn Communicator) -> Request<B, B>,
    ) -> Request<B, B> {
        match self.enter(op, true) {
            Ok(()) => f(&*self.inner),
            Err(e) => Request::ready(op, Err(e)),
        }
    }
}

fn injected_error(op: &'static str) -> CommError {
    CommError::InvalidArgument {
        op,
        detail: INJECTED.into(),
    }
}

fn is_injected(e: &CommError) -> bool {
    matches!(e, CommError::InvalidArgument { detail, .. } if detail == INJECTED)
}

/// Blocking calls that count, and may fire the fault before reaching the inner communicator.
macro_rules! counted {
    ($($(#[$cfg:meta])? fn $name:ident($($arg:ident: $ty:ty),*);)*) => {$(
        $(#[$cfg])?
        fn $name(&self, $($arg: $ty),*) -> CommResult<()> {
            self.enter(stringify!($name), false)?;
            self.inner.$name($($arg),*)
        }
    )*};
}

/// Asynchronous starts that count as the collective `op` (their fault shows at the wait).
macro_rules! started {
    ($($(#[$cfg:meta])? fn $name:ident($($arg:ident: $ty:ty),*) -> $req:ty = $op:literal;)*) => {$(
        $(#[$cfg])?
        fn $name(&self, $($arg: $ty),*) -> $req {
            self.start($op, |c| c.$name($($arg),*))
        }
    )*};
}

/// Every call that moves data or agrees on something counts; the rest (`rank`, `counters`,
/// …) are the inner communicator's.
impl dtensor::collectives::Forward for FaultComm {
    fn inner(&self) -> &dyn Communicator {
        &*self.inner
    }
    fn split(&self, color: usize, key: usize) -> CommResult<Arc<dyn Communicator>> {
        self.enter("split", false)?;
        let child = self.inner.split(color, key)?;
        Ok(FaultComm::wrap(child, self.state.clone()))
    }
    counted! {
        fn all_reduce(buf: SliceMut<'_>, op: ReduceOp);
        fn all_gather(send: Slice<'_>, recv: SliceMut<'_>);
        fn all_gatherv(send: Slice<'_>, recv: SliceMut<'_>, counts: &[usize]);
        fn all_gatherv_in_place(buf: SliceMut<'_>, counts: &[usize]);
        fn reduce_scatterv_in_place(buf: SliceMut<'_>, counts: &[usize], op: ReduceOp);
        fn all_gather_cols(send: Slice<'_>, recv: SliceMut<'_>, rows: usize, widths: &[usize]);
        fn reduce_scatter_cols(send: Slice<'_>, recv: SliceMut<'_>, rows: usize,
            widths: &[usize], op: ReduceOp);
        fn all_to_all_cols(send: Slice<'_>, rows: usize, send_widths: &[usize],
            recv: SliceMut<'_>, recv_counts: &[usize]);
        fn reduce_scatter(send: Slice<'_>, recv: SliceMut<'_>, op: ReduceOp);
        fn reduce_scatterv(send: Slice<'_>, recv: SliceMut<'_>, counts: &[usize], op: ReduceOp);
        fn all_to_all(send: Slice<'_>, recv: SliceMut<'_>);
        fn all_to_allv(send: Slice<'_>, send_counts: &[usize], recv: SliceMut<'_>,
            recv_counts: &[usize]);
        fn broadcast(buf: SliceMut<'_>, root: usize);
        fn send(buf: Slice<'_>, dst: usize, tag: u32);
        fn recv(buf: SliceMut<'_>, src: usize, tag: u32);
        fn barrier();
        #[cfg(feature = "cuda")]
        fn all_reduce_device(buf: DeviceViewMut<'_>, op: ReduceOp);
        #[cfg(feature = "cuda")]
        fn all_gather_device(send: DeviceView<'_>, recv: DeviceViewMut<'_>);
        #[cfg(feature = "cuda")]
        fn all_gatherv_device(send: DeviceView<'_>, recv: DeviceViewMut<'_>, counts: &[usize]);
        #[cfg(feature = "cuda")]
        fn reduce_scatter_device(send: DeviceView<'_>, recv: DeviceViewMut<'_>, op: ReduceOp);
        #[cfg(feature = "cuda")]
        fn reduce_scatterv_device(send: DeviceView<'_>, recv: DeviceViewMut<'_>,
            counts: &[usize], op: ReduceOp);
        #[cfg(feature = "cuda")]
        fn all_to_all_device(send: DeviceView<'_>, recv: DeviceViewMut<'_>);
        #[cfg(feature = "cuda")]
        fn all_to_allv_device(send: DeviceView<'_>, send_counts: &[usize],
            recv: DeviceViewMut<'_>, recv_counts: &[usize]);
        #[cfg(feature = "cuda")]
        fn broadcast_device(buf: DeviceViewMut<'_>, root: usize);
        #[cfg(feature = "cuda")]
        fn send_device(buf: DeviceView<'_>, dst: usize, tag: u32);
        #[cfg(feature = "cuda")]
        fn recv_device(buf: DeviceViewMut<'_>, src: usize, tag: u32);
    }
    started! {
        fn start_all_reduce(buf: Buffer, op: ReduceOp) -> Request = "all_reduce";
        fn start_all_gather(send: Buffer, recv: Buffer) -> Request = "all_gather";
        fn start_all_gatherv(send: Buffer, recv: Buffer, counts: &[usize]) -> Request
            = "all_gatherv";
        fn start_reduce_scatter(send: Buffer, recv: Buffer, op: ReduceOp) -> Request
            = "reduce_scatter";
        fn start_reduce_scatterv(send: Buffer, recv: Buffer, counts: &[usize], op: ReduceOp)
            -> Request = "reduce_scatterv";
        #[cfg(feature = "cuda")]
        fn start_all_reduce_device(buf: DeviceBuffer, op: ReduceOp) -> DeviceRequest
            = "all_reduce";
        #[cfg(feature = "cuda")]
        fn start_all_gather_device(send: DeviceBuffer, recv: DeviceBuffer) -> DeviceRequest
            = "all_gather";
        #[cfg(feature = "cuda")]
        fn start_all_gatherv_device(send: DeviceBuffer, recv: DeviceBuffer, counts: &[usize])
            -> DeviceRequest = "all_gatherv";
        #[cfg(feature = "cuda")]
        fn start_reduce_scatter_device(send: DeviceBuffer, recv: DeviceBuffer, op: ReduceOp)
            -> DeviceRequest = "reduce_scatter";
        #[cfg(feature = "cuda")]
        fn start_reduce_scatterv_device(send: DeviceBuffer, recv: DeviceBuffer,
            counts: &[usize], op: ReduceOp) -> DeviceRequest = "reduce_scatterv";
    }
}

/// The parallel layouts the runs draw from (all on four ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Setup {
    /// dp=2, tp=2, SP, DDP with gradient buckets (asynchronous all-reduces).
    DdpBuckets,
    /// dp=2, tp=2, SP, FSDP (all-gathers prefetched asynchronously, reduce-scatters).
    Fsdp,
    /// cp=2, tp=2, SP, ring attention (send/recv).
    CpRing,
    /// cp=2, tp=2, all-to-all (Ulysses) attention.
    CpAllToAll,
}

const SETUPS: [Setup; 4] = [
    Setup::DdpBuckets,
    Setup::Fsdp,
    Setup::CpRing,
    Setup::CpAllToAll,
];

impl Setup {
    fn parallel(self) -> ParallelConfig {
        let (dp, cp) = match self {
            Setup::DdpBuckets | Setup::Fsdp => (2, 1),
            Setup::CpRing | Setup::CpAllToAll => (1, 2),
        };
        ParallelConfig {
            dp,
            cp,
            tp: 2,
            sp: self != Setup::CpAllToAll,
            ..ParallelConfig::default()
        }
    }

    fn context(self) -> ContextParallel {
        ContextParallel {
            strategy: match self {
                Setup::CpAllToAll => CpStrategy::AllToAll,
                _ => CpStrategy::Ring,
            },
            zigzag: true,
        }
    }
}

fn config(setup: Setup) -> GptConfig {
    GptConfig {
        vocab: 16,
        hidden: 8,
        heads: 4,
        kv_heads: None,
        rope_style: dtensor::kernels::ops::RopeStyle::Interleaved,
        layers: 1,
        ffn: 16,
        seq_len: SEQ,
        norm: NormKind::Rms,
        activation: Activation::SwiGlu,
        bias: true,
        eps: 1e-5,
        dtype: DType::F32,
        seed: 7,
        // FSDP gathers one layer ahead with asynchronous all-gathers.
        precision: Precision::default().prefetched(setup == Setup::Fsdp),
        context: setup.context(),
        ..GptConfig::small(DType::F32)
    }
}

/// `STEPS` AdamW steps of the tiny GPT, then a world barrier (a training loop ends with
/// a collective of every rank, e.g. its checkpoint or its metrics); the last loss.
fn train_as<M: SeqMode, D: DataMode>(world: &Arc<dyn Communicator>, setup: Setup) -> Result<f64> {
    let mesh = DeviceMesh::new(world.clone(), model_mesh(&setup.parallel())?)?;
    let cfg = config(setup);
    let tokens = SEQ * BATCH;
    let seq: Vec<i64> = (0..=tokens)
        .map(|i| ((i * i * 5 + i * 7 + 3) % cfg.vocab) as i64)
        .collect();
    let ids = Tensor::from_vec(seq[..tokens].to_vec(), &[tokens])?;
    let targets = Tensor::from_vec(seq[1..].to_vec(), &[tokens])?;
    let order = |t: &Tensor| -> Result<DTensor<Ids>> {
        DTensor::from_global(&to_stream_order(t, SEQ, &cfg.context, &mesh)?, &mesh)
    };
    let (ids, targets) = (order(&ids)?, order(&targets)?);
    let mut model = Gpt::<M, D>::new(cfg, &mesh)?;
    if setup == Setup::DdpBuckets {
        model.ddp_bucket_bytes = Some(256);
    }
    let mut opt = AdamW::new(1e-2);
    let mut loss = 0.0;
    for _ in 0..STEPS {
        loss = model.train_step(&ids, &targets, &mut opt, 1.0)?.loss;
    }
    world.barrier()?;
    Ok(loss)
}

fn train(world: &Arc<dyn Communicator>, setup: Setup) -> Result<f64> {
    match setup {
        Setup::DdpBuckets => train_as::<Sp, Ddp>(world, setup),
        Setup::Fsdp => train_as::<Sp, Fsdp>(world, setup),
        Setup::CpRing => train_as::<Sp, Ddp>(world, setup),
        Setup::CpAllToAll => train_as::<NoSp, Ddp>(world, setup),
    }
}

/// How a rank's closure ended.
#[derive(Debug)]
enum Outcome {
    /// Trained to the end.
    Done,
    /// Left early (a `leave` fault).
    Left,
}

/// One run's parameters.
#[derive(Clone, Copy, Debug)]
struct Params {
    run: usize,
    setup: Setup,
    rank: usize,
    fault: Option<Fault>,
}

/// One run's results: each rank's outcome, and the op the fault fired at.
struct Report {
    results: Vec<std::result::Result<Outcome, RankError<Error>>>,
    fired: Option<String>,
    calls: Vec<u64>,
    elapsed: Duration,
    /// How long after the fault fired the last other rank finished.
    peer_latency: Option<Duration>,
}

/// Runs `STEPS` training steps on the wrapped world, with `p.fault` on rank `p.rank`.
fn run(p: Params) -> Report {
    let started = Instant::now();
    let run_state = Arc::new(RunState::default());
    let states: Vec<Arc<RankState>> = (0..WORLD)
        .map(|r| RankState::new(p.fault.filter(|_| r == p.rank), run_state.clone()))
        .collect();
    let options = threads::Options { timeout: TIMEOUT };
    let results = threads::launch_with(WORLD, options, |world| -> Result<Outcome> {
        let rank = world.rank();
        let world = FaultComm::wrap(world, states[rank].clone());
        // Counts this rank finished however its closure ends (a stopped rank waits for it).
        struct Finished<'a>(&'a RunState);
        impl Drop for Finished<'_> {
            fn drop(&mut self) {
                self.0.peer_done();
            }
        }
        let _finished = (rank != p.rank).then(|| Finished(&run_state));
        match catch_unwind(AssertUnwindSafe(|| train(&world, p.setup))) {
            Ok(r) => r.map(|_| Outcome::Done),
            Err(payload) if payload.is::<Leave>() => Ok(Outcome::Left),
            Err(payload) => std::panic::resume_unwind(payload),
        }
    });
    Report {
        results,
        fired: states[p.rank]
            .fired()
            .map(|(op, start)| format!("{}{op}", if start { "start_" } else { "" })),
        calls: states
            .iter()
            .map(|s| s.calls.load(Ordering::SeqCst))
            .collect(),
        elapsed: started.elapsed(),
        peer_latency: run_state.peer_latency(),
    }
}

/// What a peer of the failing rank got, for the table.
fn peer_label(
    r: &std::result::Result<Outcome, RankError<Error>>,
) -> std::result::Result<String, String> {
    match r {
        Err(RankError::Returned(Error::Collective(e))) => Ok(match e {
            CommError::RankFailed { reason, .. } => {
                let why = if reason.starts_with("returned an error") {
                    "error"
                } else if reason.starts_with("panicked") {
                    "panic"
                } else if reason.starts_with("returned before joining") {
                    "left"
                } else {
                    "other"
                };
                format!("RankFailed({why})")
            }
            CommError::Timeout { .. } => "Timeout".into(),
            CommError::CollectiveMismatch { .. } => return Err(format!("a mismatch: {e}")),
            other => format!("{other:?}"),
        }),
        Err(RankError::Returned(e)) => Err(format!("a non-collective error: {e}")),
        Err(RankError::Panicked(msg)) => Err(format!("a panic: {msg}")),
        Ok(o) => Err(format!("Ok({o:?})")),
    }
}

/// Checks the failing rank's outcome against the injected fault.
fn check_faulty(kind: Kind, r: &std::result::Result<Outcome, RankError<Error>>) -> bool {
    match (kind, r) {
        (Kind::Error | Kind::Stop, Err(RankError::Returned(Error::Collective(e)))) => {
            is_injected(e)
        }
        (Kind::Panic, Err(RankError::Panicked(msg))) => msg.starts_with(INJECTED),
        (Kind::Leave, Ok(Outcome::Left)) => true,
        _ => false,
    }
}

/// A tiny deterministic RNG (splitmix64).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Silences the panics this test injects; any other panic is reported as usual.
fn quiet_injected_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload: &(dyn Any + Send) = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied());
        let injected = payload.is::<Leave>() || msg.is_some_and(|m| m.starts_with(INJECTED));
        if !injected {
            default(info);
        }
    }));
}

/// Runs `p` on its own thread, which sends its report to `done` (a hung run never does).
fn spawn_run(p: Params, done: mpsc::Sender<(usize, Report)>) {
    std::thread::Builder::new()
        .name(format!("fault-run-{}", p.run))
        .spawn(move || {
            let _ = done.send((p.run, run(p)));
        })
        .expect("spawn a run");
}

#[test]
fn every_peer_of_a_failing_rank_errs_within_the_timeout() {
    quiet_injected_panics();
    let t0 = Instant::now();

    // Clean runs: each rank's call count per setup (the range the fault index is drawn
    // from), and the clean run must succeed on every rank.
    let mut clean_calls = BTreeMap::new();
    for setup in SETUPS {
        let p = Params {
            run: usize::MAX,
            setup,
            rank: 0,
            fault: None,
        };
        let report = run(p);
        for (r, res) in report.results.iter().enumerate() {
            if let Err(e) = res {
                panic!("clean run of {setup:?}: rank {r} failed: {e}");
            }
        }
        println!(
            "clean {setup:?}: calls per rank {:?}, {:.1} ms",
            report.calls,
            report.elapsed.as_secs_f64() * 1e3
        );
        clean_calls.insert(setup, report.calls);
    }

    let seed = seed();
    println!("fault injection: {RUNS} runs, seed {seed:#x}, timeout {TIMEOUT:?}");
    let mut rng = Rng(seed);
    let params: Vec<Params> = (0..RUNS)
        .map(|run| {
            let setup = SETUPS[rng.below(SETUPS.len() as u64) as usize];
            let rank = rng.below(WORLD as u64) as usize;
            let at = rng.below(clean_calls[&setup][rank]);
            let kind = KINDS[rng.below(KINDS.len() as u64) as usize];
            Params {
                run,
                setup,
                rank,
                fault: Some(Fault { at, kind }),
            }
        })
        .collect();

    // (kind, what a peer saw) -> count; (kind, op the fault fired at) -> count.
    let mut seen: BTreeMap<(Kind, String), usize> = BTreeMap::new();
    let mut ops: BTreeMap<String, usize> = BTreeMap::new();
    let mut slowest = (Duration::ZERO, 0);
    // Per kind: total run time, and the longest a peer took to fail after the fault.
    let mut time_per_kind: BTreeMap<Kind, (Duration, Duration)> = BTreeMap::new();
    let mut failures = Vec::new();
    // Up to CONCURRENT runs in flight, each on its own thread; every run must report
    // within DEADLINE of its start, or the test fails naming it.
    let (done_tx, done_rx) = mpsc::channel();
    let mut in_flight: BTreeMap<usize, Instant> = BTreeMap::new();
    let mut next = 0;
    while next < RUNS || !in_flight.is_empty() {
        while next < RUNS && in_flight.len() < CONCURRENT {
            in_flight.insert(next, Instant::now());
            spawn_run(params[next], done_tx.clone());
            next += 1;
        }
        let (&oldest, &since) = in_flight
            .iter()
            .min_by_key(|(_, t)| **t)
            .expect("a run in flight");
        let left = DEADLINE.saturating_sub(since.elapsed());
        let Ok((id, report)) = done_rx.recv_timeout(left) else {
            panic!(
                "run hung (no end within {DEADLINE:?}): {:?}",
                params[oldest]
            );
        };
        in_flight.remove(&id);
        let p = params[id];
        let fault = p.fault.expect("a fault");
        let t = time_per_kind.entry(fault.kind).or_default();
        t.0 += report.elapsed;
        t.1 = t.1.max(report.peer_latency.unwrap_or_default());
        if report.elapsed > slowest.0 {
            slowest = (report.elapsed, p.run);
        }
        let Some(op) = report.fired else {
            failures.push(format!(
                "{p:?}: the fault never fired (calls {:?})",
                report.calls
            ));
            continue;
        };
        *ops.entry(op.clone()).or_default() += 1;
        if !check_faulty(fault.kind, &report.results[p.rank]) {
            failures.push(format!(
                "{p:?} at {op}: the failing rank's outcome is {:?}",
                report.results[p.rank]
            ));
        }
        for (r, res) in report.results.iter().enumerate() {
            if r == p.rank {
                continue;
            }
            match peer_label(res) {
                Ok(label) => *seen.entry((fault.kind, label)).or_default() += 1,
                Err(why) => failures.push(format!("{p:?} at {op}: rank {r} got {why}")),
            }
        }
    }

    println!("{:<6} {:<22} {:>6}", "fault", "peers saw", "count");
    for ((kind, label), n) in &seen {
        println!("{:<6} {:<22} {:>6}", kind.to_string(), label, n);
    }
    let by_kind: BTreeMap<Kind, usize> = params.iter().fold(BTreeMap::new(), |mut m, p| {
        *m.entry(p.fault.unwrap().kind).or_default() += 1;
        m
    });
    for (kind, n) in &by_kind {
        let (total, latency) = time_per_kind[kind];
        println!(
            "{kind}: {n} runs, mean {:.1} ms per run, peers all failed within {:.1} ms of the fault",
            total.as_secs_f64() * 1e3 / *n as f64,
            latency.as_secs_f64() * 1e3
        );
    }
    println!("faults fired at: {ops:?}");
    println!(
        "slowest run {:.0} ms (run {}); total {:.1} s",
        slowest.0.as_secs_f64() * 1e3,
        slowest.1,
        t0.elapsed().as_secs_f64()
    );
    assert!(
        failures.is_empty(),
        "{} of {RUNS} runs broke the contract:\n{}",
        failures.len(),
        failures.join("\n")
    );
}
