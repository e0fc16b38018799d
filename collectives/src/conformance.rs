//! The backend conformance suite (feature `conformance`): the semantics every
//! [`Communicator`] backend must meet, written once against the trait, as a table of named
//! [`Case`]s that each backend's launcher runs.
//!
//! This is test code shipped in the library so that every backend's tests share it: the
//! threads backend runs it in `tests/threads.rs` (one `#[test]` per case, on groups of 1
//! to 4 thread ranks), the MPI backend in `examples/mpi_conformance.rs` (under
//! `mpirun -np 2` and `-np 4`, on the world and on its two halves; `scripts/mpi-tests.sh`
//! checks its summary), the NCCL backend in `tests/nccl_conformance.rs` (on 2 and 4
//! thread ranks on the GPUs, through the staging adapter `staging`, feature `nccl`;
//! ignored without a GPU, run by `scripts/gpu-check.sh`'s bundle). Enable it only in
//! tests:
//!
//! ```toml
//! [dev-dependencies]
//! dtensor-collectives = { path = "…", features = ["conformance"] }
//! ```
//!
//! # What the suite covers
//!
//! | group of cases | what every backend must do |
//! |---|---|
//! | `all_reduce_*`, `all_gather*`, `reduce_scatter*`, `all_to_all*`, `broadcast_*` | every collective against a slow, obviously correct reference, for every dtype (f32, f64, bf16, f16, i32, i64), every reduce op, empty, short and long buffers (past the reduction kernel's block), uneven counts with zeros |
//! | `*_order_sensitive_*` | reductions combine in rank order `0..n`: order-sensitive f64 sums give the left-to-right result, bitwise the same on every rank, and bitwise the threads backend's ([`Need::RankOrderedReduction`]) |
//! | `all_reduce_any_order_*` | whatever the order: one all-reduce gives every rank the same bits, within rounding of the exact sum or mean |
//! | `in_place_*` | `all_gatherv_in_place`, `reduce_scatterv_in_place`, the backend's own and the trait's defaults over it |
//! | `column_*` | the column-block collectives (`*_cols`), the backend's own and the trait's defaults |
//! | `send_recv_*`, `recv_*`, `send_from_many_threads_*` | a ring that needs no buffering (rank 0 sends first) delivers in order; buffered sends (a ring where everyone sends first never deadlocks, large messages too), FIFO per `(source, tag)`, a receive of the wrong size or dtype fails and leaves the message queued ([`Need::BufferedSend`], [`Need::TagMatching`]); sends from many threads never interleave |
//! | `split_*` | sub-groups per mesh axis: rows and columns used alternately, keys order the new ranks, ties keep the parent order, a sub-group's mismatch names world ranks, async calls on sub-groups |
//! | `counters_*` | every call counts its bytes as `counters.rs`'s table says; a failed call counts nothing; a new handle starts from zero |
//! | `*_mismatch*`, `*_invalid_argument*` | calls that disagree give every rank `CollectiveMismatch` with the same diagnosis; a rank's own bad arguments give it `InvalidArgument` and its peers a mismatch; the group stays usable |
//! | `async_*` | `start_*` requests: bitwise the blocking results, several in flight, waits in any order, dropped unwaited, mixed with blocking calls, counted once on completion, mismatches from `wait`, progress while the caller computes, the trait's stand-ins |
//!
//! What the suite does not cover, because it is the launcher's and differs per backend:
//! a rank that panics, errors, returns early or never arrives (threads: the peers get
//! `RankFailed` / `Timeout`, tested in `tests/threads.rs`; MPI: the job ends naming the
//! rank, tested by `examples/mpi_fail.rs` and `examples/mpi_misuse.rs` under
//! `scripts/mpi-tests.sh`), timeouts, how ranks are started, and backend-specific wording
//! of a diagnosis (each backend's own test checks its words; the suite checks the words
//! all backends share).
//!
//! # Running it: what a backend provides
//!
//! A new backend (NCCL next) provides only a launcher and a list of what it does not
//! support:
//!
//! 1. a way to run a closure on every rank of a group with that rank's
//!    `&dyn Communicator` (threads: `threads::launch`; MPI: `mpi::run`; NCCL: one thread
//!    per GPU, or one process per GPU under `mpirun`);
//! 2. on every rank, for every case of [`cases`]: `case.run_on(comm, UNSUPPORTED)`, which
//!    returns this rank's [`Outcome`];
//! 3. a verdict per case over all ranks: `Failed` if any rank failed (the MPI example
//!    all-reduces a flag; the threads runner collects the ranks' results), and a report
//!    that names every case and counts `Skipped` and `Unsupported` apart from `Passed`.
//!
//! Every case must be run by all ranks of the group, in the same order: a case makes
//! collective calls, and a rank whose check fails goes on making the same calls (failures
//! are recorded in [`Checks`], not thrown), so one failing check never desynchronizes the
//! group. A case returns `Err` only when a collective it needs errs unexpectedly.
//!
//! ## Host buffers
//!
//! The trait's buffers ([`Slice`], [`SliceMut`], [`Buffer`]) are host memory, so every
//! case passes host buffers and reads its results on the host once a call has returned
//! (or a request's `wait` has returned the buffer). A device backend (NCCL) never stages
//! through the host itself: its collectives take device buffers, and its host methods
//! refuse. To run these cases its runner wraps each rank's communicator in the staging
//! adapter `staging::Staging` (feature `nccl`; **test harness only**), which copies the
//! case's buffers to fresh device buffers before each call and back after it, and calls
//! the backend's `*_device` method in between. The in-place calls take the rank's own
//! block into a separate device send buffer there (NCCL has no in-place uneven calls), and
//! the column-block calls are the trait's defaults over the staged calls. No case touches
//! a buffer while a collective on it is in flight: asynchronous calls own their buffers
//! until `wait`.
//!
//! ## Unsupported, explicitly
//!
//! A case lists in [`Case::needs`] the optional capabilities ([`Need`]) it relies on. A
//! backend that lacks one passes `(need, why)` in the `unsupported` list of
//! [`Case::run_on`]; those cases then return [`Outcome::Unsupported`] with the reason,
//! without running, and every runner reports them as such: an unsupported case is never
//! counted as passed. A case whose [`Case::min_ranks`] exceeds the group returns
//! [`Outcome::Skipped`], reported the same way; a runner must run every case on at least
//! one group large enough (the threads tests fail a case that never ran).
//!
//! A case that does not need a capability may still check differently without it:
//! [`Checks::lacks`] tells it what the backend declared. Without
//! [`Need::RankOrderedReduction`] the reference cases check a float `Avg` over a group
//! whose size is not a power of two within rounding (NCCL multiplies each term by a
//! rounded `1/n`); every other reduction of their small integers is exact in any order
//! and stays bitwise.
//!
//! What the current backends declare: threads and MPI support everything (MPI agrees on
//! the rows of a column-block call in the header it exchanges before every collective).
//! NCCL (`staging::UNSUPPORTED`, each with its reason) lacks [`Need::Overlap`] (its
//! requests progress on the rank's worker, where `send`/`recv` queue behind them, so the
//! overlap case's unblocking `send` would wait for its request), [`Need::SharedHandle`] (a
//! rank's calls serialize on its worker thread), [`Need::ColumnRowAgreement`] (no device
//! column-block calls: the trait's defaults), [`Need::RankOrderedReduction`] (NCCL picks
//! the order), [`Need::BufferedSend`] (a send waits for its receive) and
//! [`Need::TagMatching`] (no tags). The cases that need none of these run on it unchanged,
//! and its own GPU tests (`tests/nccl.rs`) check what the suite cannot: a failing rank, a
//! timeout, the refusal of host buffers, its own wording.
//! The unbuffered emulator (`unbuffered`: NCCL's point-to-point semantics over the threads
//! backend, `tests/unbuffered.rs`) declares NCCL's needs about point-to-point calls and
//! request progress, [`Need::BufferedSend`], [`Need::TagMatching`],
//! [`Need::SharedHandle`] and [`Need::Overlap`], and passes every other case.
//!
//! ## Sizes
//!
//! Cases shrink their lengths, dtypes, reduce ops and repetitions under `cfg(miri)` (Miri
//! interprets about 1000x slower than native), keeping one dtype of each element size and
//! lengths that still give empty and uneven blocks. An in-process runner runs each case on
//! [`Case::group_sizes`]: 1 to 4 ranks natively; under Miri 1 to 3 for the data cases (3
//! ranks still give uneven blocks and a reduction over more than two sources) and one
//! size for the others ([`Case::miri_ranks`]). Under MPI the group sizes are the world's
//! and its halves'.

#[cfg(feature = "nccl")]
pub mod staging;

use crate::{
    threads, Buffer, CollectiveKind, Communicator, CommunicatorExt, CounterSnapshot, DType,
    Element, Error, ReduceOp, Request, Result, Slice, SliceMut, StorageElement,
};
use half::{bf16, f16};
use std::fmt::{self, Debug};
use std::sync::Arc;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------
// The table and its runner
// ---------------------------------------------------------------------------------------

/// An optional capability a case relies on; a backend without it declares it unsupported
/// (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    /// Asynchronous progress: a request started with `start_*` completes while the caller
    /// computes, without `wait` (the trait's stand-ins complete at start instead).
    Overlap,
    /// One handle used from several threads of a rank at once (concurrent `send`s; a
    /// second collective while another thread is in one must return `InvalidArgument`).
    SharedHandle,
    /// Column-block collectives whose ranks agree on element counts but not on rows
    /// return `CollectiveMismatch` (the trait's defaults see element counts only).
    ColumnRowAgreement,
    /// Reductions combine contributions in rank order `0, 1, …, n-1`, so order-sensitive
    /// float sums are bitwise the left-to-right sum (and the threads backend's). A backend
    /// without it (NCCL: its ring and tree algorithms choose the order, and its float
    /// `Avg` multiplies each term by `1/n` before summing) still gives every rank the same
    /// bits; the reference cases then check a float `Avg` within rounding
    /// ([`Checks::lacks`]) and the cases about the order itself are unsupported.
    RankOrderedReduction,
    /// A `send` returns before its receiver posts the `recv` (the message is buffered),
    /// so rings where every rank sends first, and several sends before any receive, do
    /// not deadlock, and a `recv` of the wrong size leaves the message queued. NCCL's
    /// sends wait for the matching receive.
    BufferedSend,
    /// `recv` takes the oldest message with its tag from the source, out of a queue that
    /// holds other tags too. NCCL has no tags: messages between a pair arrive in call
    /// order, and the tag is only checked.
    TagMatching,
}

/// One conformance case: a named check that every rank of a group runs together.
#[derive(Clone, Copy)]
pub struct Case {
    /// `<op>_<what>_<expectation>`, unique in [`cases`].
    pub name: &'static str,
    /// The smallest group the case means something on (a mismatch needs two ranks);
    /// smaller groups get [`Outcome::Skipped`].
    pub min_ranks: usize,
    /// Optional capabilities the case relies on.
    pub needs: &'static [Need],
    /// The group sizes an in-process runner covers under Miri (see [`Case::group_sizes`]).
    pub miri_ranks: &'static [usize],
    /// The case, on one rank: records failed checks in `Checks`, returns `Err` only when a
    /// call it needs fails unexpectedly.
    pub run: fn(&dyn Communicator, &mut Checks) -> Result<()>,
}

impl Debug for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Case")
            .field("name", &self.name)
            .field("min_ranks", &self.min_ranks)
            .field("needs", &self.needs)
            .field("miri_ranks", &self.miri_ranks)
            .finish()
    }
}

/// How a case went on one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// It ran and every check held.
    Passed,
    /// It ran and these checks failed (or a call it needed returned an error).
    Failed(Vec<String>),
    /// It did not run: the group is smaller than [`Case::min_ranks`].
    Skipped(String),
    /// It did not run: the backend declared a capability it needs unsupported.
    Unsupported(String),
}

impl Outcome {
    /// `ok`, `FAILED`, `skipped` or `unsupported`, for a report line.
    pub fn verdict(&self) -> &'static str {
        match self {
            Outcome::Passed => "ok",
            Outcome::Failed(_) => "FAILED",
            Outcome::Skipped(_) => "skipped",
            Outcome::Unsupported(_) => "unsupported",
        }
    }
}

impl Case {
    /// The group sizes an in-process runner (threads; NCCL on one machine) runs the case
    /// on: [`group_sizes`], 1 to 4 ranks, natively; under Miri, which interprets about
    /// 1000x slower, the few sizes the case needs (the data cases 1 to 3, most others
    /// one size). Sizes below [`min_ranks`](Case::min_ranks) give [`Outcome::Skipped`].
    pub fn group_sizes(&self) -> Vec<usize> {
        if cfg!(miri) {
            self.miri_ranks.to_vec()
        } else {
            group_sizes().collect()
        }
    }

    /// Runs the case on this rank's `comm` (every rank of the group must call it), unless
    /// the group is too small or the backend lists a capability it needs in
    /// `unsupported` (as `(need, why)`).
    pub fn run_on(&self, comm: &dyn Communicator, unsupported: &[(Need, &str)]) -> Outcome {
        if let Some((need, why)) = unsupported.iter().find(|(n, _)| self.needs.contains(n)) {
            return Outcome::Unsupported(format!(
                "{} backend lacks {need:?}: {why}",
                comm.backend()
            ));
        }
        if comm.size() < self.min_ranks {
            return Outcome::Skipped(format!(
                "needs at least {} ranks, the group has {}",
                self.min_ranks,
                comm.size()
            ));
        }
        let mut checks = Checks {
            failures: Vec::new(),
            lacks: unsupported.iter().map(|&(n, _)| n).collect(),
        };
        if let Err(e) = (self.run)(comm, &mut checks) {
            checks.fail(format!("error: {e}"));
        }
        if checks.failures.is_empty() {
            Outcome::Passed
        } else {
            Outcome::Failed(checks.failures)
        }
    }
}

/// The failed checks of one case on one rank. A case records a failure and goes on, so
/// that its peers' calls still pair up with its own.
#[derive(Debug, Default)]
pub struct Checks {
    failures: Vec<String>,
    /// The capabilities the backend declared unsupported (from [`Case::run_on`]): a case
    /// that does not need one may still check differently without it.
    lacks: Vec<Need>,
}

impl Checks {
    /// Whether the backend running this case declared `need` unsupported. Cases that
    /// do not list `need` use it to check what still holds without it (a float `Avg`
    /// within rounding instead of bitwise, without [`Need::RankOrderedReduction`]).
    pub fn lacks(&self, need: Need) -> bool {
        self.lacks.contains(&need)
    }
    /// Records `what()` unless `ok`.
    pub fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.failures.push(what());
        }
    }
    /// Records `what()` with both values (cut to 300 characters) unless `got == want`.
    pub fn eq<T: Debug + PartialEq>(&mut self, got: &T, want: &T, what: impl FnOnce() -> String) {
        if got != want {
            let mut g = format!("{got:?}");
            let mut w = format!("{want:?}");
            g.truncate(300);
            w.truncate(300);
            self.failures.push(format!("{}: got {g}, want {w}", what()));
        }
    }
    /// Records a failure.
    pub fn fail(&mut self, what: String) {
        self.failures.push(what);
    }
    /// The failures so far.
    pub fn failures(&self) -> &[String] {
        &self.failures
    }
}

/// The group sizes an in-process runner covers natively: 1 to 4 ranks (under Miri each
/// case names its own, [`Case::group_sizes`]).
pub fn group_sizes() -> std::ops::RangeInclusive<usize> {
    1..=4
}

/// Every case, in the order runners run them.
pub fn cases() -> &'static [Case] {
    CASES
}

/// The case named `name`.
pub fn case(name: &str) -> Option<&'static Case> {
    CASES.iter().find(|c| c.name == name)
}

/// Forwards everything to the wrapped communicator except the calls the trait implements
/// itself (in-place and column-block collectives, `start_*`), so that the trait's
/// default implementations run over the backend.
pub struct TraitDefaults<'a>(pub &'a dyn Communicator);

impl Communicator for TraitDefaults<'_> {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn backend(&self) -> &'static str {
        self.0.backend()
    }
    fn all_reduce(&self, buf: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        self.0.all_reduce(buf, op)
    }
    fn all_gather(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()> {
        self.0.all_gather(send, recv)
    }
    fn all_gatherv(&self, send: Slice<'_>, recv: SliceMut<'_>, counts: &[usize]) -> Result<()> {
        self.0.all_gatherv(send, recv, counts)
    }
    fn reduce_scatter(&self, send: Slice<'_>, recv: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        self.0.reduce_scatter(send, recv, op)
    }
    fn reduce_scatterv(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.0.reduce_scatterv(send, recv, counts, op)
    }
    fn all_to_all(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()> {
        self.0.all_to_all(send, recv)
    }
    fn all_to_allv(
        &self,
        send: Slice<'_>,
        send_counts: &[usize],
        recv: SliceMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.0.all_to_allv(send, send_counts, recv, recv_counts)
    }
    fn broadcast(&self, buf: SliceMut<'_>, root: usize) -> Result<()> {
        self.0.broadcast(buf, root)
    }
    fn send(&self, buf: Slice<'_>, dst: usize, tag: u32) -> Result<()> {
        self.0.send(buf, dst, tag)
    }
    fn recv(&self, buf: SliceMut<'_>, src: usize, tag: u32) -> Result<()> {
        self.0.recv(buf, src, tag)
    }
    fn barrier(&self) -> Result<()> {
        self.0.barrier()
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        self.0.split(color, key)
    }
    fn counters(&self) -> CounterSnapshot {
        self.0.counters()
    }
}

// ---------------------------------------------------------------------------------------
// Helpers: values, references, sizes
// ---------------------------------------------------------------------------------------

/// `full`, or the smaller `miri` under Miri.
fn unless_miri<T>(full: T, miri: T) -> T {
    if cfg!(miri) {
        miri
    } else {
        full
    }
}

/// Every reduce op; under Miri Avg (Sum's combine plus the kernel's in-place division
/// loop) and Max (the comparing combine).
fn ops() -> Vec<ReduceOp> {
    unless_miri(
        vec![ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min],
        vec![ReduceOp::Avg, ReduceOp::Max],
    )
}

/// A length past the reduction kernel's 2048-element block, 11 under Miri.
fn big(len: usize) -> usize {
    unless_miri(len, 11)
}

/// Small integers: exact in every dtype, distinct enough to catch misplaced elements.
fn val<T: Element>(rank: usize, i: usize) -> T {
    T::from_f64(((rank * 31 + i * 7) % 97) as f64 - 48.0)
}

fn vals<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| val(rank, i)).collect()
}

/// Left-to-right reduction, then divide for Avg.
fn reduce_ref<T: Element>(xs: &[T], op: ReduceOp) -> T {
    let mut acc = xs[0];
    for &x in &xs[1..] {
        acc = match op {
            ReduceOp::Sum | ReduceOp::Avg => acc.add(x),
            ReduceOp::Max => acc.max_of(x),
            ReduceOp::Min => acc.min_of(x),
        };
    }
    if op == ReduceOp::Avg {
        acc = acc.div_count(xs.len());
    }
    acc
}

/// Element `i` reduced over ranks `0..n` of `val`.
fn reduced<T: Element>(n: usize, i: usize, op: ReduceOp) -> T {
    reduce_ref(&(0..n).map(|p| val(p, i)).collect::<Vec<T>>(), op)
}

/// Uneven counts with zeros: `[3, 0, 5, 1]` cut to `n`.
fn uneven(n: usize) -> Vec<usize> {
    (0..n).map(|r| [3, 0, 5, 1][r % 4]).collect()
}

/// Element `j` of the block rank `p` sends to rank `q`.
fn a2a<T: Element>(p: usize, q: usize, j: usize) -> T {
    val(p * 8 + q, j)
}

/// Element (row, global column) of rank `p`'s matrix.
fn cell<T: Element>(p: usize, row: usize, col: usize) -> T {
    T::from_f64(((p * 53 + row * 11 + col * 3) % 89) as f64 - 44.0)
}

/// Values compared by their printed form: bitwise for the small integers used here, and
/// readable in a failure.
fn bits<T: Element>(v: &[T]) -> String {
    format!("{v:?}")
}

/// The largest magnitude of [`val`] and [`cell`]: the scale of the rounding bound below.
const VAL_MAX: f64 = 48.0;

/// The distance from 1 to the next float of `dtype` (0 for the integers).
fn epsilon(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => f64::from(f32::EPSILON),
        DType::F64 => f64::EPSILON,
        DType::BF16 => bf16::EPSILON.to_f64(),
        DType::F16 => f16::EPSILON.to_f64(),
        DType::I32 | DType::I64 => 0.0,
    }
}

/// Checks reduced values (`op` over `n` ranks of [`val`] or [`cell`] terms) against the
/// left-to-right reference: bitwise, which every order gives for these small integers
/// except a float `Avg` over a group whose size is not a power of two, where a backend
/// that lacks [`Need::RankOrderedReduction`] (NCCL multiplies each term by a rounded
/// `1/n`, then sums in its own order) is checked within `(n + 2)` epsilons of the terms'
/// largest magnitude instead.
fn reduced_eq<T: Element>(
    f: &mut Checks,
    got: &[T],
    want: &[T],
    op: ReduceOp,
    n: usize,
    what: impl FnOnce() -> String,
) {
    let rounded = op == ReduceOp::Avg && T::DTYPE.is_float() && !n.is_power_of_two();
    if !(rounded && f.lacks(Need::RankOrderedReduction)) {
        f.eq(&bits(got), &bits(want), what);
        return;
    }
    let tol = (n + 2) as f64 * epsilon(T::DTYPE) * VAL_MAX;
    let far = got.len() != want.len()
        || got
            .iter()
            .zip(want)
            .any(|(g, w)| (g.to_f64() - w.to_f64()).abs() > tol);
    if far {
        let mut g = bits(got);
        let mut w = bits(want);
        g.truncate(300);
        w.truncate(300);
        f.fail(format!("{} (within {tol:e}): got {g}, want {w}", what()));
    }
}

/// FNV-1a of a string, to compare long texts across ranks with one all-gather.
fn hash(s: &str) -> i64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    }) as i64
}

/// `rank r` or `ranks a, b, …`, as the mismatch diagnosis names ranks.
fn ranks_label(ranks: std::ops::Range<usize>) -> String {
    let list: Vec<String> = ranks.clone().map(|r| r.to_string()).collect();
    let label = if ranks.len() == 1 { "rank" } else { "ranks" };
    format!("{label} {}", list.join(", "))
}

/// Runs `$f::<T>(args)?` for every dtype: f32, f64, bf16, f16, i32 and i64. Under Miri
/// only one dtype of each element size (f32, bf16, i64): what Miri checks (bounds,
/// aliasing, races) depends on the byte offsets, not on the arithmetic.
macro_rules! each_dtype {
    ($f:ident($($arg:expr),*)) => {{
        $f::<f32>($($arg),*)?;
        $f::<bf16>($($arg),*)?;
        $f::<i64>($($arg),*)?;
        if !cfg!(miri) {
            $f::<f64>($($arg),*)?;
            $f::<f16>($($arg),*)?;
            $f::<i32>($($arg),*)?;
        }
    }};
}

/// Runs `g` and returns what it added to the handle's counters.
fn delta(comm: &dyn Communicator, g: impl FnOnce() -> Result<()>) -> Result<CounterSnapshot> {
    let before = comm.counters();
    g()?;
    Ok(comm.counters().since(&before))
}

/// A matching all-reduce after a failed call: the group is still usable.
fn still_usable(comm: &dyn Communicator, f: &mut Checks, what: &str) -> Result<()> {
    let n = comm.size();
    let mut v = [comm.rank() as f32 + 1.0; 3];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    f.eq(&v, &[(n * (n + 1) / 2) as f32; 3], || {
        format!("{what}: the group is unusable after the failed call")
    });
    Ok(())
}

/// The rank whose own arguments are bad in an [`expect_mismatch`] call, with the op its
/// `InvalidArgument` must name (if the backends agree on it) and a text it must contain.
struct Invalid {
    rank: usize,
    op: Option<&'static str>,
    needle: String,
}

/// Runs `g` (every rank) and checks: every rank gets `CollectiveMismatch` from this
/// backend and this group size, whose detail contains every needle and is the same on
/// every rank, except `invalid`'s rank, which gets `InvalidArgument` naming its op; and
/// the group is usable afterwards.
fn expect_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
    what: &str,
    needles: &[String],
    invalid: Option<Invalid>,
    g: impl FnOnce() -> Result<()>,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let e = g();
    let mut diagnosis = 0i64;
    match (&e, invalid.as_ref().filter(|i| i.rank == r)) {
        (Err(Error::InvalidArgument { op, detail }), Some(inv)) => {
            if let Some(want) = inv.op {
                f.eq(op, &want, || format!("{what}: InvalidArgument's op"));
            }
            f.check(detail.contains(&inv.needle), || {
                format!("{what}: {detail:?} lacks {:?}", inv.needle)
            });
        }
        (
            Err(Error::CollectiveMismatch {
                backend,
                size,
                detail,
                ..
            }),
            None,
        ) => {
            f.eq(&(*backend, *size), &(comm.backend(), n), || {
                format!("{what}: backend and size")
            });
            for needle in needles {
                f.check(detail.contains(needle.as_str()), || {
                    format!("{what}: {detail:?} lacks {needle:?}")
                });
            }
            diagnosis = hash(detail);
        }
        (_, inv) => f.fail(format!(
            "{what}: expected {}, got {e:?}",
            if inv.is_some() {
                "InvalidArgument"
            } else {
                "CollectiveMismatch"
            }
        )),
    }
    // The ranks that got a mismatch agree on the diagnosis.
    let all = comm.all_gather_vec(&[diagnosis])?;
    let told: Vec<i64> = (0..n)
        .filter(|&p| invalid.as_ref().is_none_or(|i| i.rank != p))
        .map(|p| all[p])
        .collect();
    f.check(told.iter().all(|&h| h == told[0]), || {
        format!("{what}: the ranks disagree on the diagnosis")
    });
    still_usable(comm, f, what)
}

// ---------------------------------------------------------------------------------------
// Data movement against references
// ---------------------------------------------------------------------------------------

fn all_reduce_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Under Miri, 1 element over 3 ranks still gives empty blocks, 11 uneven ones.
    for len in unless_miri(vec![0, 1, 5, 37, 5000], vec![1, 11]) {
        for op in ops() {
            let mut buf = vals::<T>(r, len);
            comm.all_reduce_in_place(&mut buf, op)?;
            let expect: Vec<T> = (0..len).map(|i| reduced(n, i, op)).collect();
            reduced_eq(f, &buf, &expect, op, n, || {
                format!("{} n={n} len={len} op={op}", T::DTYPE)
            });
        }
    }
    Ok(())
}

fn all_reduce_every_dtype_op_matches_reference(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    each_dtype!(all_reduce_t(comm, f));
    Ok(())
}

/// `(1e16 + 1) - 1e16 == 0` but `1e16 + (1 - 1e16) == 1`: only one order gives the
/// reference.
fn order_sensitive(rank: usize, i: usize) -> f64 {
    [1.0e16, 1.0, -1.0e16, 0.5][(rank + i) % 4]
}

fn all_reduce_order_sensitive_sum_bitwise_identical_and_equal_to_threads(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let x = order_sensitive;
    let len = big(10_001);
    let mut buf: Vec<f64> = (0..len).map(|i| x(r, i)).collect();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
    let expect: Vec<f64> = (0..len)
        .map(|i| (1..n).fold(x(0, i), |a, p| a + x(p, i)))
        .collect();
    if n == 3 {
        // Element 0 is 1e16 + 1 - 1e16: exactly 1, but 0 left to right.
        f.eq(&expect[0], &0.0, || {
            "the reference is not order-sensitive".into()
        });
    }
    let b: Vec<u64> = buf.iter().map(|v| v.to_bits()).collect();
    let e: Vec<u64> = expect.iter().map(|v| v.to_bits()).collect();
    f.check(b == e, || "not the left-to-right sum".into());
    // Every rank holds the same bits: gather each rank's hash of them.
    let h = b.iter().fold(0u64, |a, &v| a.rotate_left(5) ^ v) as i64;
    let all = comm.all_gather_vec(&[h])?;
    f.check(all.iter().all(|&v| v == all[0]), || {
        format!("replicas differ: {all:?}")
    });
    // The threads backend, same ranks and values, gives the same bits (bf16 too).
    let bf_len = big(3001);
    let th = threads::launch(n, |c| {
        let mut v: Vec<f64> = (0..len).map(|i| x(c.rank(), i)).collect();
        c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        let mut w: Vec<bf16> = vals(c.rank(), bf_len);
        c.all_reduce_in_place(&mut w, ReduceOp::Avg)?;
        Ok::<_, Error>((v, w))
    });
    let (tv, tw) = th
        .into_iter()
        .next()
        .expect("rank 0")
        .map_err(|e| Error::InvalidArgument {
            op: "threads::launch",
            detail: e.to_string(),
        })?;
    let tb: Vec<u64> = tv.iter().map(|v| v.to_bits()).collect();
    f.check(tb == b, || {
        "f64 sum differs from the threads backend".into()
    });
    let mut w: Vec<bf16> = vals(r, bf_len);
    comm.all_reduce_in_place(&mut w, ReduceOp::Avg)?;
    f.eq(&bits(&w), &bits(&tw), || {
        "bf16 avg differs from the threads backend".into()
    });
    Ok(())
}

/// Terms that round differently in every order of summation: mixed signs and magnitudes,
/// not small integers.
fn rough(rank: usize, i: usize) -> f64 {
    let m = ((rank * 7919 + i * 104_729) % 1000) as f64 / 997.0 - 0.5;
    m * [1.0, 1.0e3, 1.0e-3, 37.0][(rank + i) % 4]
}

fn any_order_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let len = big(20_000);
    for op in [ReduceOp::Sum, ReduceOp::Avg] {
        let mut buf: Vec<T> = (0..len).map(|i| T::from_f64(rough(r, i))).collect();
        comm.all_reduce_in_place(&mut buf, op)?;
        // Every rank holds the same bits: gather each rank's hash of them.
        let h = hash(&bits(&buf));
        let all = comm.all_gather_vec(&[h])?;
        f.check(all.iter().all(|&v| v == all[0]), || {
            format!("{} {op} n={n}: replicas differ", T::DTYPE)
        });
        // Within rounding of the exact sum of the (rounded) terms: each of the n - 1
        // additions, an Avg's scaling and the final rounding cost at most an epsilon of
        // the terms' magnitude.
        let eps = epsilon(T::DTYPE);
        let mut worst: Option<(usize, f64, f64)> = None;
        for (i, g) in buf.iter().enumerate() {
            let terms: Vec<f64> = (0..n).map(|p| T::from_f64(rough(p, i)).to_f64()).collect();
            let scale = if op == ReduceOp::Avg { n as f64 } else { 1.0 };
            let exact = terms.iter().sum::<f64>() / scale;
            let tol = (n + 2) as f64 * eps * terms.iter().map(|t| t.abs()).sum::<f64>() / scale;
            if (g.to_f64() - exact).abs() > tol && worst.is_none() {
                worst = Some((i, g.to_f64(), exact));
            }
        }
        if let Some((i, g, e)) = worst {
            f.fail(format!(
                "{} {op} n={n}: element {i} is {g}, the exact result {e}",
                T::DTYPE
            ));
        }
    }
    Ok(())
}

/// What a backend without rank-ordered reductions still guarantees (NCCL): one call gives
/// every rank the same bits, within rounding of the exact result, whatever order the
/// backend sums in.
fn all_reduce_any_order_replicas_bitwise_identical_within_rounding(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    any_order_t::<f32>(comm, f)?;
    any_order_t::<bf16>(comm, f)?;
    if !cfg!(miri) {
        any_order_t::<f64>(comm, f)?;
        any_order_t::<f16>(comm, f)?;
    }
    Ok(())
}

fn all_gather_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    for k in unless_miri(vec![0, 1, 7, 3000], vec![0, 7]) {
        let send = vals::<T>(r, k);
        let mut recv = vec![T::zero(); n * k];
        comm.all_gather(T::slice(&send), T::slice_mut(&mut recv))?;
        let expect: Vec<T> = (0..n).flat_map(|p| vals::<T>(p, k)).collect();
        f.eq(&bits(&recv), &bits(&expect), || {
            format!("{} n={n} k={k}", T::DTYPE)
        });
        f.eq(&bits(&comm.all_gather_vec(&send)?), &bits(&expect), || {
            format!("{} all_gather_vec n={n} k={k}", T::DTYPE)
        });
    }
    Ok(())
}

fn all_gather_every_dtype_matches_reference(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    each_dtype!(all_gather_t(comm, f));
    Ok(())
}

fn all_gatherv_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    for counts in [uneven(n), vec![0; n]] {
        let send = vals::<T>(r, counts[r]);
        let mut recv = vec![T::zero(); counts.iter().sum()];
        comm.all_gatherv(T::slice(&send), T::slice_mut(&mut recv), &counts)?;
        let expect: Vec<T> = (0..n).flat_map(|p| vals::<T>(p, counts[p])).collect();
        f.eq(&bits(&recv), &bits(&expect), || {
            format!("{} n={n} counts={counts:?}", T::DTYPE)
        });
    }
    Ok(())
}

fn all_gatherv_uneven_counts_with_zeros_matches_reference(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    each_dtype!(all_gatherv_t(comm, f));
    Ok(())
}

fn reduce_scatter_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    for k in unless_miri(vec![0, 1, 9, 2100], vec![0, 9]) {
        for op in ops() {
            let send = vals::<T>(r, n * k);
            let mut recv = vec![T::zero(); k];
            comm.reduce_scatter(T::slice(&send), T::slice_mut(&mut recv), op)?;
            let expect: Vec<T> = (r * k..(r + 1) * k).map(|i| reduced(n, i, op)).collect();
            reduced_eq(f, &recv, &expect, op, n, || {
                format!("{} n={n} k={k} op={op}", T::DTYPE)
            });
        }
    }
    Ok(())
}

fn reduce_scatter_every_dtype_op_matches_reference(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    each_dtype!(reduce_scatter_t(comm, f));
    Ok(())
}

fn reduce_scatterv_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    for counts in [uneven(n), vec![0; n]] {
        for op in ops() {
            let total: usize = counts.iter().sum();
            let start: usize = counts[..r].iter().sum();
            let send = vals::<T>(r, total);
            let mut recv = vec![T::zero(); counts[r]];
            comm.reduce_scatterv(T::slice(&send), T::slice_mut(&mut recv), &counts, op)?;
            let expect: Vec<T> = (start..start + counts[r])
                .map(|i| reduced(n, i, op))
                .collect();
            reduced_eq(f, &recv, &expect, op, n, || {
                format!("{} n={n} counts={counts:?} op={op}", T::DTYPE)
            });
        }
    }
    Ok(())
}

fn reduce_scatterv_uneven_counts_with_zeros_matches_reference(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    each_dtype!(reduce_scatterv_t(comm, f));
    Ok(())
}

fn all_to_all_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    for k in [0, 1, 6] {
        let send: Vec<T> = (0..n)
            .flat_map(|q| (0..k).map(move |j| a2a(r, q, j)))
            .collect();
        let mut recv = vec![T::zero(); n * k];
        comm.all_to_all(T::slice(&send), T::slice_mut(&mut recv))?;
        let expect: Vec<T> = (0..n)
            .flat_map(|p| (0..k).map(move |j| a2a(p, r, j)))
            .collect();
        f.eq(&bits(&recv), &bits(&expect), || {
            format!("{} n={n} k={k}", T::DTYPE)
        });
    }
    Ok(())
}

fn all_to_all_every_dtype_matches_reference(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    each_dtype!(all_to_all_t(comm, f));
    Ok(())
}

fn all_to_allv_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    // Rank p sends (p + 2q) % 3 elements to rank q: zeros included, nothing symmetric.
    let c = |p: usize, q: usize| (p + 2 * q) % 3;
    let (r, n) = (comm.rank(), comm.size());
    let send_counts: Vec<usize> = (0..n).map(|q| c(r, q)).collect();
    let recv_counts: Vec<usize> = (0..n).map(|p| c(p, r)).collect();
    let send: Vec<T> = (0..n)
        .flat_map(|q| (0..c(r, q)).map(move |j| a2a(r, q, j)))
        .collect();
    let mut recv = vec![T::zero(); recv_counts.iter().sum()];
    comm.all_to_allv(
        T::slice(&send),
        &send_counts,
        T::slice_mut(&mut recv),
        &recv_counts,
    )?;
    let expect: Vec<T> = (0..n)
        .flat_map(|p| (0..c(p, r)).map(move |j| a2a(p, r, j)))
        .collect();
    f.eq(&bits(&recv), &bits(&expect), || {
        format!("{} n={n}", T::DTYPE)
    });
    Ok(())
}

fn all_to_allv_uneven_counts_with_zeros_matches_reference(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    each_dtype!(all_to_allv_t(comm, f));
    Ok(())
}

fn broadcast_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    for root in 0..n {
        for len in unless_miri(vec![0, 1, 33], vec![0, 5]) {
            let mut buf = vals::<T>(r, len);
            comm.broadcast_in_place(&mut buf, root)?;
            f.eq(&bits(&buf), &bits(&vals::<T>(root, len)), || {
                format!("{} n={n} root={root} len={len}", T::DTYPE)
            });
        }
    }
    Ok(())
}

fn broadcast_every_dtype_root_matches_root(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    each_dtype!(broadcast_t(comm, f));
    Ok(())
}

fn barrier_repeated_every_rank_passes_and_counts(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let rounds = unless_miri(20, 3);
    let d = delta(comm, || {
        for _ in 0..rounds {
            comm.barrier()?;
        }
        Ok(())
    })?;
    f.eq(&d.calls(CollectiveKind::Barrier), &(rounds as u64), || {
        "barriers counted".into()
    });
    f.eq(&(d.bytes_sent, d.bytes_received), &(0, 0), || {
        "a barrier moves no counted bytes".into()
    });
    Ok(())
}

// ---------------------------------------------------------------------------------------
// In-place all-gather and reduce-scatter
// ---------------------------------------------------------------------------------------

fn in_place_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let counts: Vec<usize> = uneven(n).iter().map(|&c| big(c * 700)).collect();
    let total: usize = counts.iter().sum();
    let offsets: Vec<usize> = (0..n).map(|p| counts[..p].iter().sum()).collect();
    // all-gather: the own piece is in place, the rest is garbage to overwrite.
    let mut buf: Vec<T> = vec![T::from_f64(-7.0); total];
    buf[offsets[r]..offsets[r] + counts[r]].copy_from_slice(&vals::<T>(r, counts[r]));
    let d = delta(comm, || {
        comm.all_gatherv_in_place(T::slice_mut(&mut buf), &counts)
    })?;
    for p in 0..n {
        f.eq(
            &bits(&buf[offsets[p]..offsets[p] + counts[p]]),
            &bits(&vals::<T>(p, counts[p])),
            || format!("{} all_gatherv_in_place n={n} piece {p}", T::DTYPE),
        );
    }
    f.eq(&d.calls(CollectiveKind::AllGather), &1, || {
        format!("all_gatherv_in_place counted as one all_gather: {d}")
    });
    // reduce-scatter: block r of every rank's buffer, reduced into block r of this one.
    for op in unless_miri(ops(), vec![ReduceOp::Sum]) {
        let mut buf: Vec<T> = vals::<T>(r, total);
        let d = delta(comm, || {
            comm.reduce_scatterv_in_place(T::slice_mut(&mut buf), &counts, op)
        })?;
        let expect: Vec<T> = (offsets[r]..offsets[r] + counts[r])
            .map(|i| reduced(n, i, op))
            .collect();
        reduced_eq(
            f,
            &buf[offsets[r]..offsets[r] + counts[r]],
            &expect,
            op,
            n,
            || format!("{} reduce_scatterv_in_place n={n} {op}", T::DTYPE),
        );
        f.eq(&d.calls(CollectiveKind::ReduceScatter), &1, || {
            format!("reduce_scatterv_in_place counted as one reduce_scatter: {d}")
        });
    }
    Ok(())
}

fn in_place_all_gatherv_and_reduce_scatterv_match_reference(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    each_dtype!(in_place_t(comm, f));
    Ok(())
}

fn in_place_trait_defaults_match_reference(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let comm = &TraitDefaults(comm);
    each_dtype!(in_place_t(comm, f));
    Ok(())
}

fn in_place_buffer_of_wrong_length_invalid_argument_and_peer_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Rank 1's buffer has one element more than the counts.
    let counts = vec![2; n];
    let mut buf = vec![0.0f32; 2 * n + usize::from(r == 1)];
    expect_mismatch(
        comm,
        f,
        "in-place buffer",
        &["rank 1 passed invalid arguments".into()],
        Some(Invalid {
            rank: 1,
            op: None,
            needle: format!(
                "buffer has {} elements but counts sum to {}",
                2 * n + 1,
                2 * n
            ),
        }),
        || comm.all_gatherv_in_place(f32::slice_mut(&mut buf), &counts),
    )
}

// ---------------------------------------------------------------------------------------
// Column-block collectives (a non-leading tensor dim seen as `rows × Σ widths`)
// ---------------------------------------------------------------------------------------

fn columns_t<T: Element>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (me, n) = (comm.rank(), comm.size());
    // More than one row, or the calls take the plain (non-column) path; 2 under Miri.
    let rows = unless_miri(3, 2);
    let widths: Vec<usize> = uneven(n).iter().map(|&w| w * 2).collect();
    let total: usize = widths.iter().sum();
    let offsets: Vec<usize> = (0..n).map(|p| widths[..p].iter().sum()).collect();
    let dt = T::DTYPE;
    // all_gather_cols: each rank holds rows × widths[me]; everyone gets rows × total.
    let mine: Vec<T> = (0..rows * widths[me])
        .map(|i| {
            cell(
                me,
                i / widths[me].max(1),
                offsets[me] + i % widths[me].max(1),
            )
        })
        .collect();
    let mut all = vec![T::from_f64(-1.0); rows * total];
    comm.all_gather_cols(T::slice(&mine), T::slice_mut(&mut all), rows, &widths)?;
    for r in 0..rows {
        for p in 0..n {
            for c in offsets[p]..offsets[p] + widths[p] {
                f.eq(&all[r * total + c], &cell::<T>(p, r, c), || {
                    format!("{dt} n={n} all_gather_cols row {r} col {c}")
                });
            }
        }
    }
    // reduce_scatter_cols: each rank holds rows × total; rank me gets its columns reduced.
    let full: Vec<T> = (0..rows * total)
        .map(|i| cell(me, i / total, i % total))
        .collect();
    for op in unless_miri(ops(), vec![ReduceOp::Sum]) {
        let mut out = vec![T::zero(); rows * widths[me]];
        comm.reduce_scatter_cols(T::slice(&full), T::slice_mut(&mut out), rows, &widths, op)?;
        // Row-major rows × widths[me]: this rank's columns of every row, reduced.
        let expect: Vec<T> = (0..rows)
            .flat_map(|r| {
                (offsets[me]..offsets[me] + widths[me]).map(move |c| {
                    let terms: Vec<T> = (0..n).map(|k| cell(k, r, c)).collect();
                    reduce_ref(&terms, op)
                })
            })
            .collect();
        reduced_eq(f, &out, &expect, op, n, || {
            format!("{dt} n={n} reduce_scatter_cols {op} ({rows} rows, widths {widths:?})")
        });
    }
    // all_to_all_cols: rank p has rows_p = p + 1 rows of `total` columns; rank me gets
    // from each p its columns as a (p + 1) × widths[me] block.
    let my_rows = me + 1;
    let send: Vec<T> = (0..my_rows * total)
        .map(|i| cell(me, i / total, i % total))
        .collect();
    let recv_counts: Vec<usize> = (0..n).map(|p| (p + 1) * widths[me]).collect();
    let mut recv = vec![T::zero(); recv_counts.iter().sum()];
    comm.all_to_all_cols(
        T::slice(&send),
        my_rows,
        &widths,
        T::slice_mut(&mut recv),
        &recv_counts,
    )?;
    let mut at = 0;
    for p in 0..n {
        for r in 0..p + 1 {
            for c in offsets[me]..offsets[me] + widths[me] {
                f.eq(&recv[at], &cell::<T>(p, r, c), || {
                    format!("{dt} n={n} all_to_all_cols from {p} row {r} col {c}")
                });
                at += 1;
            }
        }
    }
    Ok(())
}

fn column_block_collectives_match_reference(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    each_dtype!(columns_t(comm, f));
    Ok(())
}

fn column_block_trait_defaults_match_reference(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let comm = &TraitDefaults(comm);
    each_dtype!(columns_t(comm, f));
    Ok(())
}

fn column_block_rows_disagree_every_rank_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Same element counts (2 per rank) but 2 rows of width 1 on rank 0 against 1 row of
    // width 2 on the others.
    let (rows, widths) = if r == 0 {
        (2, vec![1; n])
    } else {
        (1, vec![2; n])
    };
    // The diagnosis names every rank's rows.
    let needles = [
        "rows of the column blocks differ".to_string(),
        "2 rows".into(),
        "1 row".into(),
    ];
    let (wide, mut narrow) = (vec![0.0f32; 2 * n], vec![0.0f32; 2]);
    expect_mismatch(comm, f, "reduce_scatter_cols rows", &needles, None, || {
        comm.reduce_scatter_cols(
            f32::slice(&wide),
            f32::slice_mut(&mut narrow),
            rows,
            &widths,
            ReduceOp::Sum,
        )
    })?;
    let (narrow, mut wide) = (vec![0.0f32; 2], vec![0.0f32; 2 * n]);
    expect_mismatch(comm, f, "all_gather_cols rows", &needles, None, || {
        comm.all_gather_cols(
            f32::slice(&narrow),
            f32::slice_mut(&mut wide),
            rows,
            &widths,
        )
    })
}

fn column_collectives_with_overflowing_widths_are_invalid_on_every_rank(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let n = comm.size();
    // rows × width wraps usize: before the checked count it wrapped into a "valid" count.
    let huge = usize::MAX / 2 + 1;
    let mut widths = vec![2; n];
    widths[0] = huge;
    let send = [0.0f32; 4];
    let mut recv = [0.0f32; 8];
    let errs = [
        comm.all_gather_cols(f32::slice(&send), f32::slice_mut(&mut recv), 2, &widths),
        comm.reduce_scatter_cols(
            f32::slice(&send),
            f32::slice_mut(&mut recv),
            2,
            &widths,
            ReduceOp::Sum,
        ),
        comm.all_to_all_cols(
            f32::slice(&send),
            2,
            &widths,
            f32::slice_mut(&mut recv),
            &vec![4; n],
        ),
    ];
    for (e, op) in errs
        .iter()
        .zip(["all_gather_cols", "reduce_scatter_cols", "all_to_all_cols"])
    {
        let shown = format!("{e:?}");
        f.check(
            shown.contains("InvalidArgument") && shown.contains("overflow"),
            || format!("{op}: {shown}"),
        );
    }
    still_usable(comm, f, "overflowing widths")
}

// ---------------------------------------------------------------------------------------
// Point to point (a ring: rank r sends to r + 1 and receives from r - 1; on one rank, to
// itself)
// ---------------------------------------------------------------------------------------

fn ring(comm: &dyn Communicator) -> (usize, usize) {
    let (r, n) = (comm.rank(), comm.size());
    ((r + 1) % n, (r + n - 1) % n)
}

fn send_recv_fifo_per_tag_delivers_in_order(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let r = comm.rank();
    let (next, prev) = ring(comm);
    // Two messages on tag 5, one on tag 7 received first.
    comm.send(f32::slice(&[1.0, 1.5]), next, 5)?;
    comm.send(f32::slice(&[2.0, 2.5]), next, 5)?;
    comm.send(i64::slice(&[9, r as i64]), next, 7)?;
    let mut t7 = [0i64; 2];
    comm.recv(i64::slice_mut(&mut t7), prev, 7)?;
    f.eq(&t7, &[9, prev as i64], || "tag 7".into());
    let mut a = [0.0f32; 2];
    comm.recv(f32::slice_mut(&mut a), prev, 5)?;
    f.eq(&a, &[1.0, 1.5], || "tag 5, first".into());
    comm.recv(f32::slice_mut(&mut a), prev, 5)?;
    f.eq(&a, &[2.0, 2.5], || "tag 5, second".into());
    // Interleaved on two tags, received one tag after the other.
    for i in 0..3 {
        comm.send(i64::slice(&[i as i64, r as i64]), next, 1)?;
        comm.send(bf16::slice(&[bf16::from_f32(i as f32)]), next, 2)?;
    }
    for i in 0..3 {
        let mut b = [bf16::ZERO];
        comm.recv(bf16::slice_mut(&mut b), prev, 2)?;
        f.eq(&b[0], &bf16::from_f32(i as f32), || "tag 2 order".into());
    }
    for i in 0..3 {
        let mut m = [0i64; 2];
        comm.recv(i64::slice_mut(&mut m), prev, 1)?;
        f.eq(&m, &[i as i64, prev as i64], || "tag 1 order".into());
    }
    comm.barrier()
}

fn send_recv_symmetric_exchange_does_not_deadlock(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let r = comm.rank();
    let (next, prev) = ring(comm);
    // Everyone sends before anyone receives: large messages too (past MPI's eager limit)
    // must not deadlock, since `send` never waits for its receiver.
    let small = vals::<f64>(r, 1000);
    comm.send(f64::slice(&small), next, 0)?;
    let mut got = vec![0.0f64; 1000];
    comm.recv(f64::slice_mut(&mut got), prev, 0)?;
    f.check(got == vals::<f64>(prev, 1000), || {
        "1000 x f64 payload".into()
    });
    let len = big(1 << 20);
    let large: Vec<f32> = vals(r, len);
    comm.send(f32::slice(&large), next, 7)?;
    let mut got = vec![0.0f32; len];
    comm.recv(f32::slice_mut(&mut got), prev, 7)?;
    f.check(got == vals::<f32>(prev, len), || {
        format!("{len} x f32 payload")
    });
    comm.barrier()
}

/// A ring that needs no buffering: rank 0 sends first, every other rank receives from its
/// predecessor before it sends on, so each send meets a posted receive. Two messages per
/// hop on one tag (in order), of two dtypes, the second large.
fn send_recv_chain_ring_unbuffered_delivers_in_order(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let r = comm.rank();
    let (next, prev) = ring(comm);
    let len = big(1 << 20);
    let send = || -> Result<()> {
        comm.send(f64::slice(&vals::<f64>(r, 1000)), next, 3)?;
        comm.send(f32::slice(&vals::<f32>(r, len)), next, 3)
    };
    if r == 0 {
        send()?;
    }
    let mut small = vec![0.0f64; 1000];
    comm.recv(f64::slice_mut(&mut small), prev, 3)?;
    let mut large = vec![0.0f32; len];
    comm.recv(f32::slice_mut(&mut large), prev, 3)?;
    if r != 0 {
        send()?;
    }
    f.check(small == vals::<f64>(prev, 1000), || {
        "first message (1000 x f64)".into()
    });
    f.check(large == vals::<f32>(prev, len), || {
        format!("second message ({len} x f32)")
    });
    comm.barrier()
}

fn recv_wrong_length_or_dtype_message_mismatch_and_message_stays_queued(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (next, prev) = ring(comm);
    comm.send(f32::slice(&[1.0, 2.0, 3.0]), next, 4)?;
    let mut four = [0.0f32; 4];
    let e = comm.recv(f32::slice_mut(&mut four), prev, 4);
    f.eq(
        &e,
        &Err(Error::MessageMismatch {
            op: "recv",
            src: prev,
            tag: 4,
            got_len: 3,
            got_dtype: DType::F32,
            want_len: 4,
            want_dtype: DType::F32,
        }),
        || "wrong length".into(),
    );
    let mut f64s = [0.0f64; 3];
    let e = comm.recv(f64::slice_mut(&mut f64s), prev, 4);
    f.check(matches!(e, Err(Error::MessageMismatch { .. })), || {
        format!("wrong dtype: {e:?}")
    });
    let mut three = [0.0f32; 3];
    comm.recv(f32::slice_mut(&mut three), prev, 4)?;
    f.eq(&three, &[1.0, 2.0, 3.0], || "the queued message".into());
    // The same with the sizes the other way round.
    comm.send(f64::slice(&[1.5, 2.5]), next, 3)?;
    let mut wrong = [0.0f64; 3];
    let e = comm.recv(f64::slice_mut(&mut wrong), prev, 3);
    f.check(
        matches!(e, Err(Error::MessageMismatch { got_len: 2, .. })),
        || format!("wrong length: {e:?}"),
    );
    let mut wrong = [0.0f32; 2];
    let e = comm.recv(f32::slice_mut(&mut wrong), prev, 3);
    f.check(matches!(e, Err(Error::MessageMismatch { .. })), || {
        format!("wrong dtype: {e:?}")
    });
    let mut right = [0.0f64; 2];
    comm.recv(f64::slice_mut(&mut right), prev, 3)?;
    f.eq(&right, &[1.5, 2.5], || "the queued message".into());
    comm.barrier()
}

fn send_recv_peer_out_of_range_invalid_argument(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let n = comm.size();
    let e = comm.send(f32::slice(&[1.0]), n, 0);
    f.check(
        matches!(e, Err(Error::InvalidArgument { op: "send", .. })),
        || format!("send out of range: {e:?}"),
    );
    let mut b = [0.0f32];
    let e = comm.recv(f32::slice_mut(&mut b), n + 5, 0);
    f.check(
        matches!(e, Err(Error::InvalidArgument { op: "recv", .. })),
        || format!("recv out of range: {e:?}"),
    );
    comm.barrier()
}

/// Many threads `send` on one handle to the same (dst, tag) while this thread receives:
/// every `recv` must return exactly one whole message. A send that travels as two
/// messages (a header, then the payload) can interleave with another thread's pair, and
/// then `recv` returns a header as data or reads a payload as a header. Each message is
/// `[thread, seq, thread ^ 0x55, !seq]` as i32, so a header (`[1, 0, 4, 0]` for 4 x i32)
/// or a mixed-up message fails the check, and `seq` must grow per thread (one thread's
/// sends to one (dst, tag) stay in order).
fn send_from_many_threads_each_recv_gets_one_whole_message(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    // 8 x 2500 per rank and case: while an MPI send was two messages, this failed on every
    // run at -np 2 (a payload read as a head). Fewer threads or messages make the
    // interleaving rarer; under Miri 2 x 3.
    let (threads, per_thread) = unless_miri((8, 2500), (2, 3));
    let (next, prev) = ring(comm);
    let mut next_seq = vec![0i32; threads];
    let (mut bad, mut errors, mut first_bad) = (0usize, 0usize, None);
    let sent: Vec<Result<()>> = std::thread::scope(|s| {
        let senders: Vec<_> = (0..threads)
            .map(|t| {
                s.spawn(move || -> Result<()> {
                    for i in 0..per_thread as i32 {
                        let t = t as i32;
                        comm.send(i32::slice(&[t, i, t ^ 0x55, !i]), next, 11)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for k in 0..threads * per_thread {
            let mut m = [0i32; 4];
            match comm.recv(i32::slice_mut(&mut m), prev, 11) {
                Ok(()) => {
                    let [t, i, x, y] = m;
                    let whole = (0..threads as i32).contains(&t) && x == t ^ 0x55 && y == !i;
                    if whole && next_seq[t as usize] == i {
                        next_seq[t as usize] += 1;
                    } else {
                        bad += 1;
                        first_bad.get_or_insert(format!("recv #{k} returned Ok with {m:?}"));
                    }
                }
                Err(e) => {
                    // The stream is out of step after this: stop rather than wait out a
                    // timeout for each message that will never come.
                    errors += 1;
                    first_bad.get_or_insert(format!("recv #{k} returned {e}"));
                    break;
                }
            }
        }
        senders
            .into_iter()
            .map(|h| h.join().expect("sender thread"))
            .collect()
    });
    for e in sent.into_iter().filter_map(Result::err) {
        f.fail(format!("a sender thread failed: {e}"));
    }
    f.check(bad == 0 && errors == 0, || {
        format!(
            "{} messages: {bad} Ok with wrong data, {errors} errors; first: {}",
            threads * per_thread,
            first_bad.unwrap_or_default()
        )
    });
    comm.barrier()
}

// ---------------------------------------------------------------------------------------
// Split: sub-groups per mesh axis
// ---------------------------------------------------------------------------------------

fn split_rows_and_columns_run_concurrently(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Rows of two ranks (the last one short when n is odd), and the columns across them.
    let (row, col) = (r / 2, r % 2);
    let row_members: Vec<usize> = (0..n).filter(|p| p / 2 == row).collect();
    let col_members: Vec<usize> = (0..n).filter(|p| p % 2 == col).collect();
    let rows = comm.split(row, col)?;
    let cols = comm.split(col, row)?;
    f.eq(
        &(rows.rank(), rows.size()),
        &(col, row_members.len()),
        || "row rank and size".into(),
    );
    f.eq(
        &(cols.rank(), cols.size()),
        &(row, col_members.len()),
        || "column rank and size".into(),
    );
    let want_gather: Vec<i64> = col_members.iter().map(|&p| p as i64).collect();
    for i in 0..unless_miri(50, 4) {
        // Rows reduce while columns gather, alternating which goes first.
        let mut v = vec![(r * 100 + i) as f64; 3];
        let gathered = if i % 2 == 0 {
            rows.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            cols.all_gather_vec(&[r as i64])?
        } else {
            let g = cols.all_gather_vec(&[r as i64])?;
            rows.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            g
        };
        let want: f64 = row_members.iter().map(|&p| (p * 100 + i) as f64).sum();
        f.eq(&v, &vec![want; 3], || format!("row sum {i}"));
        f.eq(&gathered, &want_gather, || format!("column gather {i}"));
    }
    Ok(())
}

fn split_keys_order_new_ranks_and_ties_keep_parent_order(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Reversed keys: new rank n - 1 - r within one group.
    let reversed = comm.split(0, n - 1 - r)?;
    f.eq(&reversed.rank(), &(n - 1 - r), || {
        "reversed key rank".into()
    });
    let got = reversed.all_gather_vec(&[r as i32])?;
    let want: Vec<i32> = (0..n).rev().map(|p| p as i32).collect();
    f.eq(&got, &want, || "reversed group order".into());
    // Tied keys keep the parent order, in one group and in two.
    let tie = comm.split(0, 0)?;
    f.eq(&(tie.rank(), tie.size()), &(r, n), || "tied keys".into());
    let parity = comm.split(r % 2, 0)?;
    let same_parity = (0..n).filter(|p| p % 2 == r % 2).count();
    f.eq(
        &(parity.rank(), parity.size()),
        &(r / 2, same_parity),
        || "tied keys by parity".into(),
    );
    let alone = comm.split(r, 0)?;
    f.eq(&(alone.rank(), alone.size()), &(0, 1), || {
        "a group of one".into()
    });
    Ok(())
}

fn split_sub_group_mismatch_names_world_ranks(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let r = comm.rank();
    let row = comm.split(r / 2, r)?;
    let members: Vec<usize> = (0..comm.size()).filter(|p| p / 2 == r / 2).collect();
    if row.size() < 2 {
        // The last row of an odd group: nothing to disagree with.
        return still_usable(&*row, f, "a row of one");
    }
    // Row rank 0 reduces, its partner waits at a barrier.
    let mut needles = vec!["different collectives".to_string()];
    if members[0] != 0 {
        needles.push(format!("world ranks {members:?}"));
    }
    expect_mismatch(&*row, f, "sub-group mismatch", &needles, None, || {
        if row.rank() == 0 {
            row.all_reduce_in_place(&mut [0.0f32; 2], ReduceOp::Sum)
        } else {
            row.barrier()
        }
    })
}

// ---------------------------------------------------------------------------------------
// Counters: counters.rs's table
// ---------------------------------------------------------------------------------------

fn counters_every_collective_match_table(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    use CollectiveKind::*;
    let (r, n) = (comm.rank(), comm.size());
    let peers = (n - 1) as u64;
    let b = |elems: usize| (elems * 4) as u64;
    // One call of `kind` and nothing else, with these bytes.
    let mut expect = |what: &str, d: CounterSnapshot, kind, sent: u64, received: u64| {
        let kinds: Vec<CollectiveKind> = CollectiveKind::ALL
            .into_iter()
            .filter(|&k| d.calls(k) > 0)
            .collect();
        f.eq(&kinds, &vec![kind], || {
            format!("{what}: kinds counted ({d})")
        });
        f.eq(&d.calls(kind), &1, || format!("{what}: calls ({d})"));
        f.eq(&(d.bytes_sent, d.bytes_received), &(sent, received), || {
            format!("{what}: bytes sent and received")
        });
    };
    // all_reduce of 10: reduce-scatter of `chunk_sizes(10, n)` blocks, then all-gather.
    let len: usize = 10;
    let blocks: Vec<usize> = (0..n)
        .map(|p| {
            let c = len.div_ceil(n);
            (c * (p + 1)).min(len).saturating_sub((c * p).min(len))
        })
        .collect();
    let mut a = vec![1.0f32; len];
    let d = delta(comm, || comm.all_reduce_in_place(&mut a, ReduceOp::Sum))?;
    let moved = b(len - blocks[r]) + b(blocks[r]) * peers;
    expect("all_reduce", d, AllReduce, moved, moved);
    let mut g = vec![0.0f32; 5 * n];
    let d = delta(comm, || {
        comm.all_gather(f32::slice(&[1.0; 5]), f32::slice_mut(&mut g))
    })?;
    expect("all_gather", d, AllGather, b(5) * peers, b(5) * peers);
    let counts = uneven(n);
    let total: usize = counts.iter().sum();
    let send = vec![1.0f32; counts[r]];
    let mut g = vec![0.0f32; total];
    let d = delta(comm, || {
        comm.all_gatherv(f32::slice(&send), f32::slice_mut(&mut g), &counts)
    })?;
    expect(
        "all_gatherv",
        d,
        AllGather,
        b(counts[r]) * peers,
        b(total - counts[r]),
    );
    let mut rs = [0.0f32; 2];
    let d = delta(comm, || {
        comm.reduce_scatter(
            f32::slice(&vec![1.0; 2 * n]),
            f32::slice_mut(&mut rs),
            ReduceOp::Sum,
        )
    })?;
    expect(
        "reduce_scatter",
        d,
        ReduceScatter,
        b(2 * n - 2),
        b(2) * peers,
    );
    let mut rsv = vec![0.0f32; counts[r]];
    let d = delta(comm, || {
        comm.reduce_scatterv(
            f32::slice(&vec![1.0; total]),
            f32::slice_mut(&mut rsv),
            &counts,
            ReduceOp::Sum,
        )
    })?;
    expect(
        "reduce_scatterv",
        d,
        ReduceScatter,
        b(total - counts[r]),
        b(counts[r]) * peers,
    );
    let mut t = vec![0.0f32; 3 * n];
    let d = delta(comm, || {
        comm.all_to_all(f32::slice(&vec![1.0; 3 * n]), f32::slice_mut(&mut t))
    })?;
    expect("all_to_all", d, AllToAll, b(3 * n - 3), b(3 * n - 3));
    let c = |p: usize, q: usize| (p + 2 * q) % 3;
    let sc: Vec<usize> = (0..n).map(|q| c(r, q)).collect();
    let rc: Vec<usize> = (0..n).map(|p| c(p, r)).collect();
    let send = vec![1.0f32; sc.iter().sum()];
    let mut recv = vec![0.0f32; rc.iter().sum()];
    let d = delta(comm, || {
        comm.all_to_allv(f32::slice(&send), &sc, f32::slice_mut(&mut recv), &rc)
    })?;
    expect(
        "all_to_allv",
        d,
        AllToAll,
        b(send.len() - sc[r]),
        b(recv.len() - rc[r]),
    );
    let mut bc = [0.0f32; 7];
    let root = n - 1;
    let d = delta(comm, || comm.broadcast_in_place(&mut bc, root))?;
    let (s, rcv) = if r == root {
        (b(7) * peers, 0)
    } else {
        (0, b(7))
    };
    expect("broadcast", d, Broadcast, s, rcv);
    let d = delta(comm, || comm.barrier())?;
    expect("barrier", d, Barrier, 0, 0);
    if n > 1 {
        // Rank 0 sends first, the others receive first: a chain that needs no buffered
        // sends (Need::BufferedSend), so unbuffered backends count these too.
        let (next, prev) = ring(comm);
        let mut m = [0.0f32; 3];
        let mut send = || -> Result<()> {
            let d = delta(comm, || comm.send(f32::slice(&[1.0; 3]), next, 9))?;
            expect("send", d, Send, b(3), 0);
            Ok(())
        };
        if r == 0 {
            send()?;
        }
        let d = delta(comm, || comm.recv(f32::slice_mut(&mut m), prev, 9))?;
        if r != 0 {
            send()?;
        }
        expect("recv", d, Recv, 0, b(3));
    }
    let before = comm.counters();
    let sub = comm.split(0, r)?;
    expect("split", comm.counters().since(&before), Split, 0, 0);
    f.eq(&sub.counters(), &CounterSnapshot::default(), || {
        "a new handle starts from zero".into()
    });
    Ok(())
}

fn counters_failed_collective_records_nothing(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let before = comm.counters();
    let mut v = vec![0.0f32; 4 + comm.rank()];
    let e = comm.all_reduce_in_place(&mut v, ReduceOp::Sum);
    f.check(e.is_err(), || "different lengths must fail".into());
    f.eq(&comm.counters(), &before, || {
        "a failed call was counted".into()
    });
    still_usable(comm, f, "failed call")
}

// ---------------------------------------------------------------------------------------
// Mismatches and invalid arguments: every rank fails, the group stays usable
// ---------------------------------------------------------------------------------------

fn collective_different_op_every_rank_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let n = comm.size();
    let needles = [
        "different collectives".to_string(),
        "rank 0: all_reduce(f32 x 16, sum)".to_string(),
        format!("{}: all_gather(f32 x 8 -> {})", ranks_label(1..n), 8 * n),
    ];
    expect_mismatch(comm, f, "different op", &needles, None, || {
        if comm.rank() == 0 {
            comm.all_reduce_in_place(&mut [0.0f32; 16], ReduceOp::Sum)
        } else {
            comm.all_gather_vec(&[0.0f32; 8]).map(drop)
        }
    })
}

fn all_reduce_different_length_every_rank_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let needles = ["lengths differ".into(), "f32 x 16".into(), "f32 x 8".into()];
    expect_mismatch(comm, f, "lengths", &needles, None, || {
        let mut v = vec![0.0f32; if comm.rank() == 0 { 16 } else { 8 }];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
    })
}

fn all_gather_different_dtype_every_rank_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let needles = ["dtypes differ".into(), "f32 x 4".into(), "f64 x 4".into()];
    expect_mismatch(comm, f, "dtypes", &needles, None, || {
        if comm.rank() == 0 {
            comm.all_gather_vec(&[0.0f32; 4]).map(drop)
        } else {
            comm.all_gather_vec(&[0.0f64; 4]).map(drop)
        }
    })
}

fn broadcast_different_root_every_rank_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let needles = ["roots differ".into(), "root 0".into(), "root 1".into()];
    expect_mismatch(comm, f, "roots", &needles, None, || {
        comm.broadcast_in_place(&mut [0i64; 5], comm.rank().min(1))
    })
}

fn all_reduce_different_reduce_op_every_rank_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let needles = ["reduce ops differ".into(), "sum".into(), "max".into()];
    expect_mismatch(comm, f, "reduce ops", &needles, None, || {
        let op = if comm.rank() == 0 {
            ReduceOp::Sum
        } else {
            ReduceOp::Max
        };
        comm.all_reduce_in_place(&mut [0.0f64; 4], op)
    })
}

fn reduce_scatterv_different_counts_every_rank_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Rank 0 says [1, 2, 1, …], the others [2, 1, 1, …]: both sum to n + 1.
    let mut counts = vec![1; n];
    counts[usize::from(r != 0)] = 2;
    let show = |c: &[usize]| {
        let s = format!("{c:?}");
        s[..s.len() - 1].to_string()
    };
    let mut mine = vec![1; n];
    mine[1] = 2;
    let mut theirs = vec![1; n];
    theirs[0] = 2;
    let needles = ["counts differ".into(), show(&mine), show(&theirs)];
    let mut recv = vec![0.0f32; counts[r]];
    expect_mismatch(comm, f, "counts", &needles, None, || {
        comm.reduce_scatterv(
            f32::slice(&vec![0.0; n + 1]),
            f32::slice_mut(&mut recv),
            &counts,
            ReduceOp::Sum,
        )
    })?;
    // Counts whose sums differ too: rank 0 says [2, 1, …], the others [1, 1, …].
    let mut counts = vec![1; n];
    if r == 0 {
        counts[0] = 2;
    }
    let total = counts.iter().sum();
    let mut recv = vec![0.0f32; counts[r]];
    let needles = ["counts differ".to_string()];
    expect_mismatch(comm, f, "counts and sums", &needles, None, || {
        comm.reduce_scatterv(
            f32::slice(&vec![0.0; total]),
            f32::slice_mut(&mut recv),
            &counts,
            ReduceOp::Sum,
        )
    })
}

fn all_to_allv_counts_disagree_every_rank_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Rank 0 sends 2 elements to rank 1, which expects 1 (each backend words the
    // diagnosis its own way; both show every rank's counts).
    let mut sc = vec![1; n];
    if r == 0 {
        sc[1] = 2;
    }
    let rc = vec![1; n];
    let mut shown_sc = vec![1; n];
    shown_sc[1] = 2;
    let needles = [format!("send_counts {shown_sc:?}")];
    let send = vec![0.0f32; sc.iter().sum()];
    let mut recv = vec![0.0f32; n];
    expect_mismatch(comm, f, "all_to_allv counts", &needles, None, || {
        comm.all_to_allv(f32::slice(&send), &sc, f32::slice_mut(&mut recv), &rc)
    })
}

fn all_gather_recv_wrong_size_invalid_argument_and_peer_mismatch(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Rank `bad`'s recv is one element short: it gets InvalidArgument, its peers a mismatch
    // that names it (and says why).
    for bad in [0, 1] {
        let k = 4 * n - usize::from(r == bad);
        let mut recv = vec![0.0f32; k];
        let why = format!("recv has {} elements", 4 * n - 1);
        expect_mismatch(
            comm,
            f,
            &format!("rank {bad}'s recv"),
            &[format!("rank {bad} passed invalid arguments"), why.clone()],
            Some(Invalid {
                rank: bad,
                op: Some("all_gather"),
                needle: format!("recv has {}", 4 * n - 1),
            }),
            || comm.all_gather(f32::slice(&[0.0; 4]), f32::slice_mut(&mut recv)),
        )?;
    }
    Ok(())
}

fn collective_bad_local_arguments_invalid_argument_naming_op(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let is_invalid = |e: &Result<()>, op: &str| matches!(e, Err(Error::InvalidArgument { op: o, .. }) if *o == op);
    // Every rank passes bad arguments of its own: each gets InvalidArgument naming the op.
    let e = comm.broadcast_in_place(&mut [0.0f32; 2], n);
    f.check(is_invalid(&e, "broadcast"), || format!("root {n}: {e:?}"));
    let e = comm.all_gather(f32::slice(&[0.0; 2]), f64::slice_mut(&mut vec![0.0; 2 * n]));
    f.check(
        matches!(&e, Err(Error::InvalidArgument { op: "all_gather", detail }) if detail.contains("f32") && detail.contains("f64")),
        || format!("send f32, recv f64: {e:?}"),
    );
    let e = comm.all_gatherv(f32::slice(&[0.0; 2]), f32::slice_mut(&mut [0.0; 2]), &[2]);
    f.check(is_invalid(&e, "all_gatherv"), || {
        format!("one count for {n} ranks: {e:?}")
    });
    let e = comm.reduce_scatter(
        f32::slice(&vec![0.0; 2 * n + 1]),
        f32::slice_mut(&mut [0.0; 2]),
        ReduceOp::Sum,
    );
    f.check(is_invalid(&e, "reduce_scatter"), || {
        format!("send not n x recv: {e:?}")
    });
    let e = comm.all_to_all(
        f32::slice(&vec![0.0; 2 * n + 1]),
        f32::slice_mut(&mut vec![0.0; 2 * n + 1]),
    );
    f.check(is_invalid(&e, "all_to_all"), || {
        format!("send not a multiple of n: {e:?}")
    });
    // counts [1, 2, 2, …] and a recv of 2: every rank's recv matches its count but rank
    // 0's, so rank 0 gets InvalidArgument and its peers a mismatch.
    let mut counts = vec![2; n];
    counts[0] = 1;
    let e = comm.reduce_scatterv(
        f32::slice(&vec![0.0; 2 * n - 1]),
        f32::slice_mut(&mut [0.0; 2]),
        &counts,
        ReduceOp::Sum,
    );
    if r == 0 {
        f.check(is_invalid(&e, "reduce_scatterv"), || {
            format!("recv not counts[0]: {e:?}")
        });
    } else {
        f.check(matches!(e, Err(Error::CollectiveMismatch { .. })), || {
            format!("rank 0's recv not counts[0]: {e:?}")
        });
    }
    still_usable(comm, f, "bad local arguments")
}

/// Rank 0 enters a barrier on one thread, then calls another on a second thread while the
/// first waits: the second is refused (`InvalidArgument`), the first completes.
fn collective_same_handle_from_two_threads_invalid_argument(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    match comm.rank() {
        0 => std::thread::scope(|s| {
            let first = s.spawn(|| comm.barrier());
            std::thread::sleep(Duration::from_millis(100));
            let e = comm.barrier();
            f.check(
                matches!(e, Err(Error::InvalidArgument { op: "barrier", .. })),
                || format!("a second barrier on the handle: {e:?}"),
            );
            comm.send(i32::slice(&[1]), 1, 0)?;
            first.join().expect("barrier thread")
        }),
        1 => {
            let mut go = [0i32];
            comm.recv(i32::slice_mut(&mut go), 0, 0)?;
            comm.barrier()
        }
        _ => comm.barrier(),
    }
}

// ---------------------------------------------------------------------------------------
// Asynchronous collectives (`start_*`, `Request`)
// ---------------------------------------------------------------------------------------

/// Every asynchronous call against the blocking call with the same inputs: the same bits,
/// for each length and reduce op.
fn async_t<T: StorageElement>(comm: &dyn Communicator, f: &mut Checks) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Under Miri one length and op: the data phases are the blocking calls'; what is new
    // here is the worker, the owned buffers and the hand-back.
    for len in unless_miri(vec![0, 1, 37, 5000], vec![11]) {
        for op in unless_miri(ops(), vec![ReduceOp::Avg]) {
            let what = |c: &str| format!("{} {c} n={n} len={len} op={op}", T::DTYPE);
            let mut blocking = vals::<T>(r, len);
            comm.all_reduce_in_place(&mut blocking, op)?;
            let got = comm.start_all_reduce_vec(vals::<T>(r, len), op).wait()?;
            f.eq(&bits(&got), &bits(&blocking), || what("all_reduce"));
            // reduce_scatter of n blocks of `len / n + 1`
            let k = len / n + 1;
            let send = vals::<T>(r, n * k);
            let mut blocking = vec![T::zero(); k];
            comm.reduce_scatter(T::slice(&send), T::slice_mut(&mut blocking), op)?;
            let got = comm.start_reduce_scatter_vec(send, op).wait()?;
            f.eq(&bits(&got), &bits(&blocking), || what("reduce_scatter"));
            // reduce_scatterv, uneven counts with zeros
            let counts: Vec<usize> = uneven(n).iter().map(|c| c * (len % 7 + 1)).collect();
            let send = vals::<T>(r, counts.iter().sum());
            let mut blocking = vec![T::zero(); counts[r]];
            comm.reduce_scatterv(T::slice(&send), T::slice_mut(&mut blocking), &counts, op)?;
            let recv = Buffer::zeros(T::DTYPE, counts[r]);
            let got = comm
                .start_reduce_scatterv(Buffer::from(send), recv, &counts, op)
                .wait()?;
            f.eq(&got, &Buffer::from(blocking), || what("reduce_scatterv"));
        }
        // all_gather and all_gatherv
        let send = vals::<T>(r, len);
        let blocking = comm.all_gather_vec(&send)?;
        let got = comm.start_all_gather_vec(send).wait()?;
        f.eq(&bits(&got), &bits(&blocking), || {
            format!("{} all_gather n={n} len={len}", T::DTYPE)
        });
        let counts: Vec<usize> = uneven(n).iter().map(|c| c * (len % 5)).collect();
        let send = vals::<T>(r, counts[r]);
        let mut blocking = vec![T::zero(); counts.iter().sum()];
        comm.all_gatherv(T::slice(&send), T::slice_mut(&mut blocking), &counts)?;
        let recv = Buffer::zeros(T::DTYPE, blocking.len());
        let got = comm
            .start_all_gatherv(Buffer::from(send), recv, &counts)
            .wait()?;
        f.eq(&got, &Buffer::from(blocking), || {
            format!("{} all_gatherv {counts:?}", T::DTYPE)
        });
    }
    Ok(())
}

fn async_every_kind_dtype_op_equals_blocking_bitwise(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    each_dtype!(async_t(comm, f));
    Ok(())
}

fn async_order_sensitive_sum_is_the_left_to_right_sum_on_every_rank(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let x = order_sensitive;
    let len = big(10_001);
    let buf: Vec<f64> = (0..len).map(|i| x(r, i)).collect();
    let got = comm.start_all_reduce_vec(buf, ReduceOp::Sum).wait()?;
    let b: Vec<u64> = got.iter().map(|v| v.to_bits()).collect();
    let e: Vec<u64> = (0..len)
        .map(|i| (1..n).fold(x(0, i), |a, p| a + x(p, i)).to_bits())
        .collect();
    f.check(b == e, || "not the left-to-right sum".into());
    Ok(())
}

fn async_several_in_flight_complete_in_start_order_and_wait_in_any_order(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let len = big(3000);
    let before = comm.counters();
    let mut reqs: Vec<Option<Request<Vec<f32>>>> = (0..6)
        .map(|i| {
            Some(match i % 3 {
                0 => comm.start_all_reduce_vec(vals::<f32>(r + i, len), ReduceOp::Sum),
                1 => comm.start_all_gather_vec(vals::<f32>(r + i, len)),
                _ => comm.start_reduce_scatter_vec(vals::<f32>(r + i, n * len), ReduceOp::Max),
            })
        })
        .collect();
    // The last one first: once it completed, every request started before it has.
    let mut results = vec![Vec::new(); 6];
    results[5] = reqs[5].take().expect("once").wait()?;
    for req in reqs.iter_mut().flatten() {
        f.check(req.test(), || {
            format!("{} started earlier is not complete", req.op())
        });
    }
    f.eq(&comm.counters().since(&before).collectives(), &6, || {
        "six collectives counted".into()
    });
    // The rest in a shuffled order.
    for i in [2, 0, 4, 1, 3] {
        results[i] = reqs[i].take().expect("once").wait()?;
    }
    let of = |i: usize, j: usize| (0..n).map(|p| val::<f32>(p + i, j)).collect::<Vec<_>>();
    for (i, got) in results.iter().enumerate() {
        let expect: Vec<f32> = match i % 3 {
            0 => (0..len)
                .map(|j| reduce_ref(&of(i, j), ReduceOp::Sum))
                .collect(),
            1 => (0..n).flat_map(|p| vals::<f32>(p + i, len)).collect(),
            _ => (r * len..(r + 1) * len)
                .map(|j| reduce_ref(&of(i, j), ReduceOp::Max))
                .collect(),
        };
        f.eq(&bits(got), &bits(&expect), || format!("request {i}"));
    }
    Ok(())
}

fn async_waited_out_of_order_across_ranks_still_match(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Even ranks wait for their requests newest first, odd ones oldest first: the waits do
    // not take part in the matching, the start order does.
    let mut reqs: Vec<Option<Request<Vec<i64>>>> = (0..4)
        .map(|i| Some(comm.start_all_reduce_vec(vec![(r * 10 + i) as i64; 5], ReduceOp::Sum)))
        .collect();
    let order: Vec<usize> = if r % 2 == 0 {
        vec![3, 2, 1, 0]
    } else {
        vec![0, 1, 2, 3]
    };
    for i in order {
        let got = reqs[i].take().expect("once").wait()?;
        let want = (0..n).map(|p| (p * 10 + i) as i64).sum::<i64>();
        f.eq(&got, &vec![want; 5], || format!("request {i}"));
    }
    Ok(())
}

fn async_dropped_unwaited_still_runs_and_later_collectives_match(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let before = comm.counters();
    // Dropped at once on rank 0, waited elsewhere: the collective runs on every rank.
    let req = comm.start_all_reduce_vec(vec![1.0f32; 64], ReduceOp::Sum);
    if r == 0 {
        drop(req);
        // The drop waited: counted, and nothing of it is pending any more.
        f.eq(
            &comm
                .counters()
                .since(&before)
                .calls(CollectiveKind::AllReduce),
            &1,
            || "a dropped request was not complete after its drop".into(),
        );
    } else {
        f.eq(&req.wait()?, &vec![n as f32; 64], || {
            "beside a dropped request".into()
        });
    }
    // Dropped on every rank, in the middle of a sequence.
    let a = comm.start_all_gather_vec(vec![r as i32; 2]);
    drop(comm.start_reduce_scatter_vec(vec![1.0f64; 2 * n], ReduceOp::Sum));
    let b = comm.start_all_reduce_vec(vec![2i64; 3], ReduceOp::Sum);
    let want: Vec<i32> = (0..n).flat_map(|p| [p as i32; 2]).collect();
    f.eq(&a.wait()?, &want, || {
        "gather before a dropped request".into()
    });
    f.eq(&b.wait()?, &vec![2 * n as i64; 3], || {
        "reduce after a dropped request".into()
    });
    drop(comm.start_all_gather_vec(vec![r as i32; 3]));
    // Later blocking calls still pair up.
    let mut v = [1.0f32; 4];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    f.eq(&v, &[n as f32; 4], || "group unusable after drops".into());
    let d = comm.counters().since(&before);
    f.eq(
        &(
            d.calls(CollectiveKind::AllReduce),
            d.calls(CollectiveKind::AllGather),
            d.calls(CollectiveKind::ReduceScatter),
        ),
        &(3, 2, 1),
        || format!("calls counted: {d}"),
    );
    Ok(())
}

fn async_mixed_with_blocking_blocking_call_waits_for_earlier_requests(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // The same sequence on every rank, each rank choosing which calls are blocking:
    // all_reduce, all_gather, reduce_scatter, barrier, all_reduce.
    let blocking = |i: usize| (i + r).is_multiple_of(2);
    let mut pending: Vec<(usize, Request<Vec<f32>>)> = Vec::new();
    let mut results: Vec<Vec<f32>> = vec![Vec::new(); 5];
    for (i, slot) in results.iter_mut().enumerate() {
        if blocking(i) || i == 3 {
            // (No asynchronous barrier: a blocking one in its place.)
            match i {
                0 | 4 => {
                    let mut v = vec![i as f32; 8];
                    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
                    *slot = v;
                }
                1 => *slot = comm.all_gather_vec(&[r as f32])?,
                2 => {
                    let mut out = vec![0.0f32; 2];
                    comm.reduce_scatter(
                        f32::slice(&vec![1.0; 2 * n]),
                        f32::slice_mut(&mut out),
                        ReduceOp::Sum,
                    )?;
                    *slot = out;
                }
                _ => comm.barrier()?,
            }
            // The rule: a blocking call first completes every request started before it
            // on this handle.
            for (j, req) in &mut pending {
                f.check(req.test(), || {
                    format!("request {j} not complete after the blocking call {i}")
                });
            }
        } else {
            pending.push((
                i,
                match i {
                    0 | 4 => comm.start_all_reduce_vec(vec![i as f32; 8], ReduceOp::Sum),
                    1 => comm.start_all_gather_vec(vec![r as f32]),
                    _ => comm.start_reduce_scatter_vec(vec![1.0f32; 2 * n], ReduceOp::Sum),
                },
            ));
        }
    }
    for (i, req) in pending {
        results[i] = req.wait()?;
    }
    f.eq(&results[0], &vec![0.0; 8], || "call 0".into());
    let gathered: Vec<f32> = (0..n).map(|p| p as f32).collect();
    f.eq(&results[1], &gathered, || "call 1".into());
    f.eq(&results[2], &vec![n as f32; 2], || "call 2".into());
    f.eq(&results[4], &vec![(4 * n) as f32; 8], || "call 4".into());
    // Four all-reduces, each rank alternating in its own pattern.
    let mut pending: Vec<(usize, Request<Vec<f32>>)> = Vec::new();
    for i in 0..4 {
        let v = vec![i as f32; 8];
        if blocking(i) {
            let mut v = v;
            comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            f.eq(&v, &vec![(i * n) as f32; 8], || {
                format!("blocking call {i}")
            });
            for (j, req) in &mut pending {
                f.check(req.test(), || {
                    format!("request {j} not complete after a later blocking call")
                });
            }
        } else {
            pending.push((i, comm.start_all_reduce_vec(v, ReduceOp::Sum)));
        }
    }
    for (i, req) in pending {
        f.eq(&req.wait()?, &vec![(i * n) as f32; 8], || {
            format!("request {i}")
        });
    }
    Ok(())
}

fn async_counters_equal_blocking_counted_once_on_completion(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    use CollectiveKind::*;
    let (r, n) = (comm.rank(), comm.size());
    let len = 10;
    let counts = uneven(n);
    let blocking = delta(comm, || {
        comm.all_reduce_in_place(&mut vec![1.0f32; len], ReduceOp::Sum)?;
        comm.all_gather_vec(&[1.0f64; 4])?;
        let mut out = [0i32; 2];
        comm.reduce_scatter(
            i32::slice(&vec![1; 2 * n]),
            i32::slice_mut(&mut out),
            ReduceOp::Sum,
        )?;
        let mut out = vec![0.0f32; counts.iter().sum()];
        comm.all_gatherv(
            f32::slice(&vec![0.0; counts[r]]),
            f32::slice_mut(&mut out),
            &counts,
        )
    })?;
    let before = comm.counters();
    let mut reqs = [
        comm.start_all_reduce(Buffer::from(vec![1.0f32; len]), ReduceOp::Sum),
        comm.start_all_gather(
            Buffer::from(vec![1.0f64; 4]),
            Buffer::zeros(DType::F64, 4 * n),
        ),
        comm.start_reduce_scatter(
            Buffer::from(vec![1i32; 2 * n]),
            Buffer::zeros(DType::I32, 2),
            ReduceOp::Sum,
        ),
        comm.start_all_gatherv(
            Buffer::zeros(DType::F32, counts[r]),
            Buffer::zeros(DType::F32, counts.iter().sum()),
            &counts,
        ),
    ];
    // Counted when complete, before wait: test() until done, then compare.
    let deadline = Instant::now() + Duration::from_secs(60);
    while !reqs.iter_mut().all(|q| q.test()) {
        if Instant::now() > deadline {
            f.fail("requests never completed".into());
            break;
        }
        std::thread::yield_now();
    }
    let completed = comm.counters().since(&before);
    for q in reqs {
        q.wait()?;
    }
    let waited = comm.counters().since(&before);
    f.eq(&completed, &blocking, || {
        "async counters (on completion) differ from blocking".into()
    });
    f.eq(&waited, &blocking, || "wait counted again".into());
    f.eq(
        &(
            blocking.calls(AllReduce),
            blocking.calls(AllGather),
            blocking.calls(ReduceScatter),
        ),
        &(1, 2, 1),
        || "blocking calls counted".into(),
    );
    Ok(())
}

/// Rank 0 starts a large all-reduce and only then tells its peers (by `send`, which does
/// not wait for requests) to start their side, so its request cannot complete inside its
/// `start`. Rank 0 then computes, polling `test` (which never blocks), and must see the
/// request complete and counted before it calls `wait`: the data moved on another thread
/// while rank 0 computed. No timing threshold: the deadline only turns a broken worker
/// into a failure instead of a hang.
/// A dependent chain of floating-point work the optimizer cannot drop.
fn compute_slice(mut acc: f64) -> f64 {
    for i in 0..1000 {
        acc = std::hint::black_box(acc * 1.000_000_1 + f64::from(i));
    }
    acc
}

fn async_overlap_collective_completes_while_caller_computes(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let len = big(1 << 20);
    let deadline = Instant::now() + Duration::from_secs(60);
    let buf = vec![r as f32 + 1.0; len];
    let before = comm.counters().calls(CollectiveKind::AllReduce);
    let got = if r == 0 {
        let mut req = comm.start_all_reduce_vec(buf, ReduceOp::Sum);
        f.check(!req.test(), || "complete before the peers started".into());
        f.eq(
            &(comm.counters().calls(CollectiveKind::AllReduce) - before),
            &0,
            || "counted before the peers started".into(),
        );
        // Compute while the all-reduce is in flight: it cannot complete yet (the peers
        // wait for rank 0's word), so this slice runs inside the collective's window
        // whatever the scheduler does.
        let mut acc = compute_slice(1.0);
        f.check(!req.test(), || {
            "complete before the peers started (after a slice)".into()
        });
        for p in 1..n {
            comm.send(i32::slice(&[1]), p, 77)?;
        }
        // Keep computing between polls until it completes on its own, without wait. How
        // many slices fit depends on the scheduler (none, when the peers finish it before
        // the first poll), so only completion is checked.
        while !req.test() && Instant::now() < deadline {
            acc = compute_slice(acc);
        }
        std::hint::black_box(acc);
        f.check(req.test(), || "no progress without wait".into());
        // Complete and counted before wait was called.
        f.eq(
            &(comm.counters().calls(CollectiveKind::AllReduce) - before),
            &1,
            || "not counted before wait".into(),
        );
        req.wait()?
    } else {
        let mut go = [0i32];
        comm.recv(i32::slice_mut(&mut go), 0, 77)?;
        comm.start_all_reduce_vec(buf, ReduceOp::Sum).wait()?
    };
    let want = (n * (n + 1) / 2) as f32;
    f.check(got.iter().all(|&x| x == want), || {
        "overlapped all-reduce result".into()
    });
    Ok(())
}

fn async_mismatch_every_rank_collective_mismatch_from_wait(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let needles = [
        "different collectives".to_string(),
        "rank 0: all_reduce(f32 x 16, sum)".to_string(),
        format!("{}: all_gather(f32 x 8 -> {})", ranks_label(1..n), 8 * n),
    ];
    expect_mismatch(comm, f, "async different op", &needles, None, || {
        if r == 0 {
            comm.start_all_reduce_vec(vec![0.0f32; 16], ReduceOp::Sum)
                .wait()
                .map(drop)
        } else {
            comm.start_all_gather_vec(vec![0.0f32; 8]).wait().map(drop)
        }
    })?;
    let lengths = ["lengths differ".to_string()];
    expect_mismatch(comm, f, "async lengths", &lengths, None, || {
        comm.start_all_reduce_vec(vec![0.0f32; 4 + r], ReduceOp::Sum)
            .wait()
            .map(drop)
    })?;
    let dtypes = ["dtypes differ".to_string()];
    expect_mismatch(comm, f, "async dtypes", &dtypes, None, || {
        if r == 0 {
            comm.start_all_gather_vec(vec![0.0f64; 2]).wait().map(drop)
        } else {
            comm.start_all_gather_vec(vec![0.0f32; 2]).wait().map(drop)
        }
    })?;
    let ops = ["reduce ops differ".to_string()];
    expect_mismatch(comm, f, "async reduce ops", &ops, None, || {
        let op = if r == 0 { ReduceOp::Max } else { ReduceOp::Sum };
        comm.start_reduce_scatter_vec(vec![0.0f32; 2 * n], op)
            .wait()
            .map(drop)
    })?;
    // Blocking on one rank, asynchronous on the others: still matched, still a mismatch.
    expect_mismatch(comm, f, "async vs blocking lengths", &lengths, None, || {
        if r == 0 {
            comm.all_reduce_in_place(&mut [0i64; 3], ReduceOp::Sum)
        } else {
            comm.start_all_reduce_vec(vec![0i64; 5], ReduceOp::Sum)
                .wait()
                .map(drop)
        }
    })
}

fn async_invalid_argument_on_one_rank_mismatch_on_its_peers(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    // Rank 1's recv is the wrong size.
    let k = if r == 1 { 2 * n + 1 } else { 2 * n };
    expect_mismatch(
        comm,
        f,
        "async invalid argument",
        &["rank 1 passed invalid arguments".into()],
        Some(Invalid {
            rank: 1,
            op: Some("all_gather"),
            needle: String::new(),
        }),
        || {
            comm.start_all_gather(Buffer::from(vec![0.0f32; 2]), Buffer::zeros(DType::F32, k))
                .wait()
                .map(drop)
        },
    )?;
    // A matching request still works afterwards.
    let got = comm
        .start_all_reduce_vec(vec![1i32], ReduceOp::Sum)
        .wait()?;
    f.eq(&got, &vec![n as i32], || {
        "a request after the failed one".into()
    });
    Ok(())
}

fn async_on_split_groups_and_after_dropping_the_handle(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let row = comm.split(r / 2, r)?;
    let a = row.start_all_reduce_vec(vec![r as i32; 3], ReduceOp::Sum);
    let b = comm.start_all_reduce_vec(vec![1i32; 3], ReduceOp::Sum);
    // Dropping the handle lets its worker finish what was started: `a` still completes.
    drop(row);
    let want: i32 = (0..n).filter(|p| p / 2 == r / 2).map(|p| p as i32).sum();
    f.eq(&a.wait()?, &vec![want; 3], || "row all-reduce".into());
    f.eq(&b.wait()?, &vec![n as i32; 3], || "world all-reduce".into());
    Ok(())
}

fn async_start_while_another_thread_blocks_on_the_handle_invalid_argument(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    match comm.rank() {
        0 => std::thread::scope(|s| {
            let first = s.spawn(|| comm.barrier());
            std::thread::sleep(Duration::from_millis(100));
            let e = comm
                .start_all_reduce_vec(vec![1.0f32], ReduceOp::Sum)
                .wait();
            f.check(
                matches!(
                    e,
                    Err(Error::InvalidArgument {
                        op: "all_reduce",
                        ..
                    })
                ),
                || format!("a request started during a barrier: {e:?}"),
            );
            comm.send(i32::slice(&[1]), 1, 0)?;
            first.join().expect("barrier thread")
        }),
        1 => {
            let mut go = [0i32];
            comm.recv(i32::slice_mut(&mut go), 0, 0)?;
            comm.barrier()
        }
        _ => comm.barrier(),
    }
}

/// The trait's `start_*` stand-ins (for a backend without asynchronous collectives) run
/// the blocking call at start, with the same results and errors.
fn async_trait_default_stand_in_runs_at_start_with_the_same_results(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<()> {
    let (r, n) = (comm.rank(), comm.size());
    let wrapped = TraitDefaults(comm);
    let len = big(700);
    let mut a = wrapped.start_all_reduce_vec(vals::<bf16>(r, len), ReduceOp::Avg);
    // The stand-in ran the blocking call at start: already complete.
    f.check(a.test(), || "the stand-in is not complete at start".into());
    let mut blocking = vals::<bf16>(r, len);
    comm.all_reduce_in_place(&mut blocking, ReduceOp::Avg)?;
    f.eq(&bits(&a.wait()?), &bits(&blocking), || "all_reduce".into());
    let want: Vec<i64> = (0..n as i64).collect();
    f.eq(
        &wrapped.start_all_gather_vec(vec![r as i64]).wait()?,
        &want,
        || "all_gather".into(),
    );
    f.eq(
        &wrapped
            .start_reduce_scatter_vec(vec![1.0f32; 2 * n], ReduceOp::Sum)
            .wait()?,
        &vec![n as f32; 2],
        || "reduce_scatter".into(),
    );
    let counts: Vec<usize> = (0..n).map(|p| [1, 0, 2][p % 3]).collect();
    let total = counts.iter().sum();
    let got = wrapped
        .start_all_gatherv(
            Buffer::from(vec![r as i32; counts[r]]),
            Buffer::zeros(DType::I32, total),
            &counts,
        )
        .wait()?;
    let want: Vec<i32> = (0..n).flat_map(|p| vec![p as i32; counts[p]]).collect();
    f.eq(&got, &Buffer::from(want), || "all_gatherv".into());
    let got = wrapped
        .start_reduce_scatterv(
            Buffer::from(vec![1i32; total]),
            Buffer::zeros(DType::I32, counts[r]),
            &counts,
            ReduceOp::Sum,
        )
        .wait()?;
    f.eq(&got, &Buffer::from(vec![n as i32; counts[r]]), || {
        "reduce_scatterv".into()
    });
    // Mismatch through the stand-in: every rank, from wait.
    let e = wrapped
        .start_all_reduce_vec(vec![0.0f32; 1 + r], ReduceOp::Sum)
        .wait();
    f.check(matches!(e, Err(Error::CollectiveMismatch { .. })), || {
        format!("lengths differ through the stand-in: {e:?}")
    });
    Ok(())
}

// ---------------------------------------------------------------------------------------
// The table
// ---------------------------------------------------------------------------------------

/// A case of `$name` (the function of that name) for groups of at least `$min` ranks, run
/// under Miri on the group sizes `$miri`, needing the capabilities listed last.
macro_rules! case {
    ($name:ident, $min:expr, $miri:expr) => {
        case!($name, $min, $miri, [])
    };
    ($name:ident, $min:expr, $miri:expr, [$($need:ident),*]) => {
        Case {
            name: stringify!($name),
            min_ranks: $min,
            needs: &[$(Need::$need),*],
            miri_ranks: &$miri,
            run: $name,
        }
    };
}

static CASES: &[Case] = &[
    // Data movement against references.
    case!(all_reduce_every_dtype_op_matches_reference, 1, [1, 2, 3]),
    case!(
        all_reduce_order_sensitive_sum_bitwise_identical_and_equal_to_threads,
        1,
        [3],
        [RankOrderedReduction]
    ),
    case!(
        all_reduce_any_order_replicas_bitwise_identical_within_rounding,
        1,
        [3]
    ),
    case!(all_gather_every_dtype_matches_reference, 1, [1, 2, 3]),
    case!(
        all_gatherv_uneven_counts_with_zeros_matches_reference,
        1,
        [1, 2, 3]
    ),
    case!(
        reduce_scatter_every_dtype_op_matches_reference,
        1,
        [1, 2, 3]
    ),
    case!(
        reduce_scatterv_uneven_counts_with_zeros_matches_reference,
        1,
        [1, 2, 3]
    ),
    case!(all_to_all_every_dtype_matches_reference, 1, [1, 2, 3]),
    case!(
        all_to_allv_uneven_counts_with_zeros_matches_reference,
        1,
        [1, 2, 3]
    ),
    case!(broadcast_every_dtype_root_matches_root, 1, [1, 2, 3]),
    case!(barrier_repeated_every_rank_passes_and_counts, 1, [2]),
    // In place.
    case!(
        in_place_all_gatherv_and_reduce_scatterv_match_reference,
        1,
        [1, 2, 3]
    ),
    case!(in_place_trait_defaults_match_reference, 1, [1, 2, 3]),
    case!(
        in_place_buffer_of_wrong_length_invalid_argument_and_peer_mismatch,
        2,
        [2]
    ),
    // Column blocks.
    case!(column_block_collectives_match_reference, 1, [1, 2, 3]),
    case!(column_block_trait_defaults_match_reference, 1, [1, 2, 3]),
    case!(
        column_block_rows_disagree_every_rank_mismatch,
        2,
        [2],
        [ColumnRowAgreement]
    ),
    case!(
        column_collectives_with_overflowing_widths_are_invalid_on_every_rank,
        1,
        [2]
    ),
    // Point to point.
    case!(
        send_recv_fifo_per_tag_delivers_in_order,
        1,
        [2],
        [BufferedSend, TagMatching]
    ),
    case!(
        send_recv_symmetric_exchange_does_not_deadlock,
        1,
        [4],
        [BufferedSend]
    ),
    case!(send_recv_chain_ring_unbuffered_delivers_in_order, 2, [3]),
    case!(
        recv_wrong_length_or_dtype_message_mismatch_and_message_stays_queued,
        1,
        [2],
        [BufferedSend]
    ),
    case!(send_recv_peer_out_of_range_invalid_argument, 1, [2]),
    case!(
        send_from_many_threads_each_recv_gets_one_whole_message,
        1,
        [2],
        [SharedHandle]
    ),
    // Split.
    case!(split_rows_and_columns_run_concurrently, 1, [4]),
    case!(
        split_keys_order_new_ranks_and_ties_keep_parent_order,
        1,
        [4]
    ),
    case!(split_sub_group_mismatch_names_world_ranks, 2, [4]),
    // Counters.
    case!(counters_every_collective_match_table, 1, [3]),
    case!(counters_failed_collective_records_nothing, 2, [2]),
    // Mismatches and invalid arguments.
    case!(collective_different_op_every_rank_mismatch, 2, [2]),
    case!(all_reduce_different_length_every_rank_mismatch, 2, [2]),
    case!(all_gather_different_dtype_every_rank_mismatch, 2, [2]),
    case!(broadcast_different_root_every_rank_mismatch, 2, [2]),
    case!(all_reduce_different_reduce_op_every_rank_mismatch, 2, [2]),
    case!(reduce_scatterv_different_counts_every_rank_mismatch, 2, [2]),
    case!(all_to_allv_counts_disagree_every_rank_mismatch, 2, [2]),
    case!(
        all_gather_recv_wrong_size_invalid_argument_and_peer_mismatch,
        2,
        [2]
    ),
    case!(
        collective_bad_local_arguments_invalid_argument_naming_op,
        2,
        [2]
    ),
    case!(
        collective_same_handle_from_two_threads_invalid_argument,
        2,
        [2],
        [SharedHandle]
    ),
    // Asynchronous collectives.
    case!(
        async_every_kind_dtype_op_equals_blocking_bitwise,
        1,
        [1, 2, 3]
    ),
    case!(
        async_order_sensitive_sum_is_the_left_to_right_sum_on_every_rank,
        1,
        [3],
        [RankOrderedReduction]
    ),
    case!(
        async_several_in_flight_complete_in_start_order_and_wait_in_any_order,
        1,
        [3]
    ),
    case!(async_waited_out_of_order_across_ranks_still_match, 1, [2]),
    case!(
        async_dropped_unwaited_still_runs_and_later_collectives_match,
        1,
        [3]
    ),
    case!(
        async_mixed_with_blocking_blocking_call_waits_for_earlier_requests,
        1,
        [3]
    ),
    case!(
        async_counters_equal_blocking_counted_once_on_completion,
        1,
        [3]
    ),
    case!(
        async_overlap_collective_completes_while_caller_computes,
        2,
        [2],
        [Overlap]
    ),
    case!(
        async_mismatch_every_rank_collective_mismatch_from_wait,
        2,
        [2]
    ),
    case!(
        async_invalid_argument_on_one_rank_mismatch_on_its_peers,
        2,
        [2]
    ),
    case!(async_on_split_groups_and_after_dropping_the_handle, 1, [4]),
    case!(
        async_start_while_another_thread_blocks_on_the_handle_invalid_argument,
        2,
        [2],
        [SharedHandle]
    ),
    case!(
        async_trait_default_stand_in_runs_at_start_with_the_same_results,
        2,
        [3]
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn case_names_unique() {
        let mut names: Vec<&str> = CASES.iter().map(|c| c.name).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), CASES.len());
    }

    #[test]
    fn reduced_eq_is_bitwise_unless_a_float_avg_without_rank_order() {
        let want = [16.0f32 / 3.0, -1.0];
        let near = [f32::from_bits(want[0].to_bits() + 1), -1.0];
        let far = [want[0] + 1.0, -1.0];
        let lacking = || Checks {
            failures: Vec::new(),
            lacks: vec![Need::RankOrderedReduction],
        };
        // Bitwise where the backend sums in rank order, or the op or group is exact.
        let mut f = Checks::default();
        reduced_eq(&mut f, &near, &want, ReduceOp::Avg, 3, || "ordered".into());
        assert_eq!(f.failures().len(), 1);
        let mut f = lacking();
        reduced_eq(&mut f, &near, &want, ReduceOp::Sum, 3, || "sum".into());
        reduced_eq(&mut f, &near, &want, ReduceOp::Avg, 4, || {
            "four ranks".into()
        });
        assert_eq!(f.failures().len(), 2);
        // Within rounding, but not a misplaced value, for a float Avg over 3 ranks.
        let mut f = lacking();
        reduced_eq(&mut f, &near, &want, ReduceOp::Avg, 3, || "near".into());
        assert!(f.failures().is_empty(), "{:?}", f.failures());
        reduced_eq(&mut f, &far, &want, ReduceOp::Avg, 3, || "far".into());
        assert_eq!(f.failures().len(), 1);
        // Integers stay exact.
        let mut f = lacking();
        reduced_eq(&mut f, &[5i32], &[6], ReduceOp::Avg, 3, || "int".into());
        assert_eq!(f.failures().len(), 1);
    }

    #[test]
    fn ranks_label_names_like_the_mismatch_detail() {
        assert_eq!(ranks_label(1..2), "rank 1");
        assert_eq!(ranks_label(1..4), "ranks 1, 2, 3");
    }
}
