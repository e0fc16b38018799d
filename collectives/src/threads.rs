//! The default backend: N ranks as threads of one process, exchanging buffers through
//! shared memory.
//!
//! [`launch`] runs one closure per rank, each on its own thread (`rank-<r>`), and hands it
//! an `Arc<dyn Communicator>` ([`ThreadComm`]). Collectives copy each byte once, straight
//! from the sender's buffer into the receiver's.
//!
//! Every collective runs the same protocol:
//!
//! 1. **join**: post a descriptor (call, dtype, lengths, counts, root, reduce op, buffer
//!    addresses) and wait, up to the timeout, until every member has posted;
//! 2. **check**: every rank checks all posts alike, so all agree to fail or to go on;
//! 3. **data**: each rank reads its peers' buffers through the posted addresses and writes
//!    only into its own receive buffer, so every byte is copied once, with no staging;
//! 4. **leave**: wait until every member is done reading, so no rank returns (and frees or
//!    mutates a buffer) while a peer still reads it.
//!
//! Who reads and writes what during the data phase (rank `r` of `n`):
//!
//! | call | rank `r` reads | rank `r` writes |
//! |---|---|---|
//! | all_gather(v) | every rank's `send` | its `recv` |
//! | reduce_scatter(v) | block `r` of every rank's `send` | its `recv` |
//! | all_reduce, phase 1 | block `r` of every rank's `buf` | block `r` of its `buf` |
//! | all_reduce, phase 2 (after a middle barrier) | block `p` of rank `p`'s `buf` | blocks `p ≠ r` of its `buf` |
//! | all_to_all(v) | block `r` of every rank's `send` | its `recv` |
//! | broadcast | the root's `buf` (non-roots) | its `buf` (non-roots) |
//!
//! No region is written while another rank reads it, and each reduced element is combined
//! by one rank in rank order `0..n`, so all replicas hold the same bits.
//!
//! The data phase reaches posted buffers only through a `View` (`view.rs`), whose two
//! dereferencing methods check every range against the length the poster declared, and
//! refuse to read the receive buffer the rank is writing. Why the rest is sound (a poster
//! cannot return while peers read, every rank reaches every barrier) is written down as
//! the protocol invariants in `group.rs`.
//!
//! A rank waits for the others by spinning briefly on the barrier's generation, then
//! blocking on a condvar (it only spins when the world has no more ranks than cores).
//!
//! Failures never hang:
//!
//! | what happens | what the peers get |
//! |---|---|
//! | ranks call different collectives, dtypes, lengths, counts, roots or reduce ops | every rank: [`Error::CollectiveMismatch`] naming who said what |
//! | a rank passes inconsistent buffers (e.g. `recv` not `size × send`) | that rank: [`Error::InvalidArgument`]; its peers: [`Error::CollectiveMismatch`] |
//! | a rank's closure panics, errors or returns | pending and later collectives of every group containing it: [`Error::RankFailed`] |
//! | a rank does not arrive within [`Options::timeout`] | the waiting ranks: [`Error::Timeout`] naming the missing ranks; the group stays failed |
//!
//! After a mismatch or invalid argument the group stays usable: every rank failed the same
//! call together. After a departure or timeout it stays failed. `RankFailed::rank` and
//! `Timeout::missing` are world ranks; mismatch details use group ranks (and list the
//! group's world ranks when they differ).
//!
//! Asynchronous collectives (`start_*`, see [`crate::Request`]) run this same protocol on
//! a progress worker of the handle: a thread started with the handle's first request,
//! which runs the requests one after another in start order and posts the buffers each
//! request owns, so the data phase moves bytes while the caller's thread computes. A
//! blocking call on the handle first waits for the requests started before it, so the
//! worker and the caller never run a collective of one handle at once (the protocol allows
//! one post per rank per group). Dropping the handle lets its worker finish what was
//! started, then joins it.
//!
//! `split` creates the new groups when its join completes (one per color, ordered by
//! `(key, parent rank)`); every group is registered with the world, so a departure
//! reaches all groups containing that rank. `send` copies into a per-`(src, dst, tag)`
//! FIFO mailbox and returns; `recv` waits for it (with the timeout).
//!
//! [`Error::CollectiveMismatch`]: crate::Error::CollectiveMismatch
//! [`Error::InvalidArgument`]: crate::Error::InvalidArgument
//! [`Error::RankFailed`]: crate::Error::RankFailed
//! [`Error::Timeout`]: crate::Error::Timeout

mod call;
mod comm;
mod group;
mod view;

pub use comm::ThreadComm;

use crate::Communicator;
use group::{Group, World};
use std::any::Any;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;
use std::time::Duration;

/// The environment variable that sets the default [`Options::timeout`], in seconds.
pub const TIMEOUT_ENV: &str = "DTENSOR_TIMEOUT_SECS";

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(120);

/// How a [`launch_with`] world behaves.
#[derive(Clone, Debug)]
pub struct Options {
    /// How long a rank waits in a collective (or a `recv`) for its peers before giving up
    /// with [`Error::Timeout`](crate::Error::Timeout).
    pub timeout: Duration,
}

impl Default for Options {
    /// `timeout` from `DTENSOR_TIMEOUT_SECS` (seconds, may be fractional) if set and
    /// valid, else 120 s.
    fn default() -> Options {
        let timeout = std::env::var(TIMEOUT_ENV)
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .and_then(|s| Duration::try_from_secs_f64(s).ok())
            .unwrap_or(DEFAULT_TIMEOUT);
        Options { timeout }
    }
}

/// How one rank's closure failed.
#[derive(Debug)]
pub enum RankError<E> {
    /// The closure returned this error.
    Returned(E),
    /// The closure panicked with this message.
    Panicked(String),
}

impl<E: fmt::Display> fmt::Display for RankError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankError::Returned(e) => write!(f, "returned an error: {e}"),
            RankError::Panicked(msg) => write!(f, "panicked: {msg}"),
        }
    }
}

impl<E: fmt::Display + fmt::Debug> std::error::Error for RankError<E> {}

/// Runs `f` on `world_size` ranks, each a thread, with the default [`Options`]; returns
/// each rank's result in rank order.
pub fn launch<T, E, F>(world_size: usize, f: F) -> Vec<Result<T, RankError<E>>>
where
    F: Fn(Arc<dyn Communicator>) -> Result<T, E> + Sync,
    T: Send,
    E: Send + fmt::Display,
{
    launch_with(world_size, Options::default(), f)
}

/// Runs `f` on `world_size` ranks, each a thread named `rank-<r>`, and returns each rank's
/// result in rank order. `f` may borrow from the caller (the threads are scoped).
///
/// When a rank's closure ends, by returning `Ok`, returning `Err` or panicking, the rank
/// has *departed*: collectives its peers are waiting in or call later, on any group
/// containing it, fail with [`Error::RankFailed`](crate::Error::RankFailed).
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
    if world_size == 0 {
        return Vec::new();
    }
    let world = World::new(world_size, options);
    let group = Group::create(&world, (0..world_size).collect());
    let (world, f) = (&world, &f);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let comm: Arc<dyn Communicator> = Arc::new(ThreadComm::new(group.clone(), rank));
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || run_rank(world, rank, comm, f))
                    .map_err(|e| {
                        let msg = format!("could not start its thread: {e}");
                        world.depart(rank, msg.clone());
                        RankError::Panicked(msg)
                    })
            })
            .collect();
        drop(group);
        handles
            .into_iter()
            .map(|h| {
                h?.join()
                    .unwrap_or_else(|p| Err(RankError::Panicked(panic_message(p.as_ref()))))
            })
            .collect()
    })
}

/// One rank's thread: runs the closure, then marks the rank departed with why.
fn run_rank<T, E, F>(
    world: &World,
    rank: usize,
    comm: Arc<dyn Communicator>,
    f: &F,
) -> Result<T, RankError<E>>
where
    F: Fn(Arc<dyn Communicator>) -> Result<T, E>,
    E: fmt::Display,
{
    let (result, reason) = match catch_unwind(AssertUnwindSafe(|| f(comm))) {
        Ok(Ok(v)) => (Ok(v), "returned before joining".to_string()),
        Ok(Err(e)) => {
            let reason = format!("returned an error: {e}");
            (Err(RankError::Returned(e)), reason)
        }
        Err(payload) => {
            let msg = panic_message(payload.as_ref());
            let reason = format!("panicked: {msg}");
            (Err(RankError::Panicked(msg)), reason)
        }
    };
    world.depart(rank, reason);
    result
}

/// The message of a panic payload (`panic!("...")` carries a `&str` or a `String`).
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic payload>".to_string()
    }
}
