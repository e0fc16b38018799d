//! The MPI backend (feature `mpi`): ranks are processes started by `mpirun`, on one machine
//! or many, exchanging buffers through MPI (rsmpi over OpenMPI or MPICH).
//!
//! ```no_run
//! use dtensor_collectives::{mpi, CommunicatorExt, ReduceOp};
//! // Run as `mpirun -np 4 target/release/examples/my_program`.
//! let sum = mpi::run(|comm| {
//!     let mut v = vec![comm.rank() as f32; 3];
//!     comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
//!     Ok::<_, dtensor_collectives::Error>(v)
//! });
//! ```
//!
//! Without the feature the same API exists and [`init`] returns
//! [`Error::NotCompiled`](crate::Error::NotCompiled) (`run` prints it and exits with code
//! 2), so every caller compiles on a machine without MPI.
//!
//! Entry points:
//!
//! | call | what it does |
//! |---|---|
//! | [`run`]`(|comm| … )` | init, run the closure on the world, finalize; a rank whose closure errors or panics prints `rank R failed: …` and aborts the whole job (exit code 1) |
//! | [`init`] / [`init_with`] | init only; [`Mpi::world`] gives the world communicator, [`Mpi::finalize`] ends |
//! | [`launched_by_mpirun`] | whether `mpirun` started this process; [`LAUNCH_HINT`] says how to |
//! | [`launcher_rank`] | this process's world rank as the launcher set it, before MPI starts |
//!
//! Started without `mpirun`, MPI runs the process as a world of one rank (a "singleton"):
//! accepted, and [`run`] prints a note with [`LAUNCH_HINT`]. A program that needs several
//! ranks checks [`launched_by_mpirun`] or the world size itself.
//!
//! # Semantics, as in every backend
//!
//! Every collective runs two steps on the rank's `MpiComm`:
//!
//! 1. **agree**: each rank sends a fixed 88-byte header (call, dtype, agreed length,
//!    reduce op, root, a hash of the counts, the rows of a column-block call, whether its
//!    own arguments were valid) to every peer on a private duplicate of the communicator,
//!    and receives theirs, waiting at most the timeout (`DTENSOR_TIMEOUT_SECS`, 120 s by
//!    default). Every rank checks all headers alike, so all go on or all fail: calls that
//!    disagree return [`Error::CollectiveMismatch`](crate::Error::CollectiveMismatch) on
//!    every rank (with a second, failure-only exchange of each rank's description, so the
//!    message says who called what), a rank's own bad arguments return
//!    [`Error::InvalidArgument`](crate::Error::InvalidArgument) there. MPI itself does not
//!    detect mismatched calls (it hangs or corrupts memory); this check is the price of
//!    the guarantee: n−1 messages of 88 bytes each way per collective, one round trip of
//!    latency, nothing per element. The rows word is what makes `all_gather_cols` and
//!    `reduce_scatter_cols` calls whose ranks agree on element counts but not on rows a
//!    mismatch ("rows of the column blocks differ", as on the threads backend); it costs
//!    every collective 8 of those bytes per peer, and no message or round of its own. A
//!    rank that times out here cannot take back what it posted, so it also sends each
//!    peer an empty "withdrawn" message; every rank looks for one after its exchange, so
//!    a rank arriving after its peers gave up gets
//!    [`Error::RankFailed`](crate::Error::RankFailed) at once instead of passing against
//!    their leftovers.
//! 2. **data**: non-blocking MPI collectives (`MPI_I…`) move the bytes, polled until done
//!    for at most the timeout. Values travel as unsigned integers of their size (bf16 and
//!    f16 as 16-bit words), so MPI never interprets them. After the agreement every peer
//!    is in the data phase too, so the bound matters only in a race no message round can
//!    close (a peer timing out at the instant this rank completed the exchange, before
//!    its withdrawal lands): then the job is aborted, since MPI still holds the
//!    caller's buffers and no error can be returned safely.
//!
//! | call | data phase |
//! |---|---|
//! | all_gather(v) | `MPI_Iallgather(v)` |
//! | all_gatherv_in_place | own piece copied to scratch, then `MPI_Iallgatherv` (rsmpi does not expose `MPI_IN_PLACE`) |
//! | all_gather_cols | `MPI_Iallgatherv` of the column blocks into reused scratch, then one pass interleaves them into `recv` |
//! | reduce_scatter_cols, all_to_all_cols | the column blocks packed into a reused send space (one pass), then as reduce_scatterv / all_to_allv |
//! | reduce_scatter(v), in place too | `MPI_Ialltoallv` of the blocks into reused scratch, then our kernel reduces block `r` in rank order `0..n` |
//! | all_reduce | reduce-scatter of `chunk_sizes(len, n)` blocks as above, then all-gather of the reduced blocks |
//! | all_to_all(v) | `MPI_Ialltoall(v)` |
//! | broadcast | `MPI_Ibcast` |
//! | barrier | the agreement (it completes only once every rank has arrived), then `MPI_Ibarrier`, so that no rank returns `Ok` where a peer timed out |
//! | split | `MPI_Ibarrier` (it has no non-blocking form, so every rank must be in the data phase first), `MPI_Comm_split` (ordered by `(key, rank)`), then an all-gather of world ranks |
//! | send / recv | one message per send (a 2-word head, dtype and length, then the payload) with `MPI_Isend` from a copy, so `send` never waits for the receiver and sends from several threads never interleave; `recv` probes (`MPI_Improbe`, with the timeout), takes the whole message (`MPI_Mrecv`), and copies the payload into the buffer if dtype and length match (else it stays queued) |
//!
//! **Reductions run in our kernels, never in `MPI_Allreduce`.** MPI leaves the order in
//! which an all-reduce combines contributions to the implementation (OpenMPI picks ring,
//! recursive doubling or others by message size and rank count), so its results need not
//! be bitwise equal to the threads backend's, nor (for some algorithms) across ranks, and
//! MPI has no bf16 / f16. Our reduce-scatter + all-gather is the threads backend's pattern:
//! each block is reduced by one rank, left to right over ranks `0..n`, then copied to every
//! rank, so replicas are bitwise identical and equal to the threads backend's bits for
//! every dtype, and bytes on the wire are `2(n−1)/n · L` per rank, the bandwidth optimum
//! (MPI's ring all-reduce moves the same). The latency is one all-to-all plus one
//! all-gather rather than log n rounds.
//!
//! # Asynchronous collectives: a progress thread per handle
//!
//! `start_all_reduce`, `start_all_gather(v)` and `start_reduce_scatter(v)` (see
//! [`Request`](crate::Request) for the rules) run on a progress thread of the handle,
//! started with its first request: the thread runs the handle's requests one after
//! another, in start order, through exactly the steps above (agreement with its bounded
//! wait and withdrawals, then the `MPI_I…` data phase polled up to the timeout, aborting
//! past it), while the caller's thread computes. A blocking call on the handle first waits
//! for the requests started before it. The handle's drop lets the thread finish what was
//! started, then joins it.
//!
//! Why a thread rather than `MPI_Iallreduce` & co. posted at start and completed by
//! `wait`: [`init`] runs MPI at `MPI_THREAD_MULTIPLE` (it refuses less), so a second
//! thread may call MPI, and the alternative would not overlap:
//!
//! - no data may be posted before the agreement has passed (MPI does not detect
//!   mismatched calls; it hangs or corrupts memory), and the agreement is a round trip to
//!   every peer: posting at start would make `start` wait for the slowest peer to arrive;
//! - OpenMPI moves a non-blocking collective on only inside MPI calls of the process (it
//!   has no asynchronous progress by default), so a request posted at start would mostly
//!   move inside `wait`, after the computation it was meant to overlap;
//! - our all-reduce is two dependent exchanges with our own reduction kernel between
//!   them (see below), which no single MPI request covers.
//!
//! The price: while a data phase runs, the progress thread polls it (spinning for the
//! first millisecond, then yielding), which competes with the caller for a core when
//! ranks share cores (`--oversubscribe`).
//!
//! Counters follow the table in `counters.rs`, as in the threads backend (they count the
//! data phase; the agreement's headers are not counted).
//!
//! # Failures
//!
//! | what happens | what the ranks get |
//! |---|---|
//! | calls disagree | every rank: `CollectiveMismatch`; the group stays usable |
//! | a rank's closure errors or panics (under [`run`]) | it prints `rank R failed: …` and `MPI_Abort`s: `mpirun` kills every rank and exits non-zero |
//! | a rank's closure returns while peers still wait in a world collective | the peers: `RankFailed` naming it ("returned before joining"); it prints `rank R failed: … ranks [..] were still in collectives` and aborts the job |
//! | a peer does not arrive within the timeout | `Timeout` naming the missing world ranks; the group stays failed (under [`run`] the error aborts the job) |
//! | a rank arrives after its peers timed out waiting for it | at once, `RankFailed` naming a peer that gave up ("timed out waiting for this rank and left the group"), never `Ok` nor a hang; the group stays failed |
//! | a data phase does not finish within the timeout (only in the race described under **data** above) | `rank R failed: {op}: the data phase did not finish within the timeout …` naming the ranks that gave up, then `MPI_Abort` of the job |
//! | a handle is used after [`Mpi::finalize`] (handles are `Arc`s and may outlive it) | [`Error::Finalized`](crate::Error::Finalized), without any MPI call; dropping it frees nothing |
//! | an MPI call fails | MPI's default handler aborts the job |
//!
//! Counts are MPI ints: a buffer or displacement past 2³¹−1 elements is an
//! `InvalidArgument`. Tags must fit an MPI tag (MPI promises 32767; OpenMPI and MPICH
//! allow 2³¹−1).
//!
//! # Launching
//!
//! `mpirun -np 4 target/release/examples/mpi_conformance` on one machine (add
//! `--oversubscribe` for more ranks than cores, and `--allow-run-as-root` as root);
//! `mpirun -np 8 --hostfile hosts …` across machines, with the same binary at the same
//! path on each.

use std::time::Duration;

#[cfg(feature = "mpi")]
mod comm;
#[cfg(feature = "mpi")]
mod launch;
#[cfg(not(feature = "mpi"))]
mod stand_in;

#[cfg(feature = "mpi")]
pub use comm::MpiComm;
#[cfg(feature = "mpi")]
pub use launch::{init, init_with, run, Mpi};
#[cfg(not(feature = "mpi"))]
pub use stand_in::{init, init_with, run, Mpi};

/// How to start a program on several MPI ranks.
pub const LAUNCH_HINT: &str = "To run N ranks, start it under MPI: `mpirun -np N <program> \
     [args]` (add `--oversubscribe` for more ranks than cores, `--hostfile FILE` to run \
     across machines).";

/// True if an MPI launcher (`mpirun` / `mpiexec` of OpenMPI, MPICH or a PMI-based
/// scheduler such as Slurm's `srun`) started this process, judged by the environment
/// variables they set. The answer is taken once, at the first call or at [`init`] (a
/// singleton `MPI_Init` sets some of those variables itself). Works without the `mpi`
/// feature.
pub fn launched_by_mpirun() -> bool {
    static LAUNCHED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *LAUNCHED.get_or_init(|| {
        [
            "OMPI_COMM_WORLD_SIZE",
            "PMI_SIZE",
            "PMI_RANK",
            "PMIX_RANK",
            "MPI_LOCALNRANKS",
        ]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
    })
}

/// This process's world rank as an MPI launcher set it in the environment (OpenMPI's
/// `OMPI_COMM_WORLD_RANK`, PMI's `PMI_RANK`, PMIx's `PMIX_RANK`), readable before MPI is
/// initialised; `None` without a launcher. Works without the `mpi` feature.
pub fn launcher_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// How an MPI world behaves.
#[derive(Clone, Debug)]
pub struct Options {
    /// How long a rank waits in a collective (or a `recv`) for its peers before giving up
    /// with [`Error::Timeout`](crate::Error::Timeout).
    pub timeout: Duration,
}

impl Default for Options {
    /// `timeout` from `DTENSOR_TIMEOUT_SECS`, as for the threads backend (120 s if unset).
    fn default() -> Options {
        Options {
            timeout: crate::threads::Options::default().timeout,
        }
    }
}
