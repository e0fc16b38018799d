//! Starting and ending MPI: [`init`], [`Mpi`], and [`run`], which turns a failing rank into
//! a message and an `MPI_Abort` of the whole job.

use super::comm::{abort, finalize_with, MpiComm, RawComm};
use super::{launched_by_mpirun, Options, LAUNCH_HINT};
use crate::{Communicator, Error, Result};
use mpi::environment::{Threading, Universe};
use mpi::ffi;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

/// MPI, initialized for this process: the world communicator, and `MPI_Finalize` when it
/// ends. One per process ([`init`] refuses a second).
///
/// Dropping it runs [`finalize`](Mpi::finalize); if that fails, or if the thread is
/// panicking, it aborts the job instead (finalizing while peers still wait in a
/// collective would hang them).
pub struct Mpi {
    world: Arc<MpiComm>,
    universe: Option<Universe>,
}

impl fmt::Debug for Mpi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Mpi").field("world", &self.world).finish()
    }
}

/// Initializes MPI with the default [`Options`].
pub fn init() -> Result<Mpi> {
    init_with(Options::default())
}

/// Initializes MPI (`MPI_Init_thread` asking for `MPI_THREAD_MULTIPLE`, since a
/// [`Communicator`] may be used from any thread) and returns the world.
///
/// Outside `mpirun`, MPI starts a world of one rank ("singleton"); that is accepted (see
/// [`launched_by_mpirun`]).
pub fn init_with(options: Options) -> Result<Mpi> {
    // Before MPI_Init, which may set the launcher's variables for a singleton.
    launched_by_mpirun();
    let (universe, threading) =
        mpi::initialize_with_threading(Threading::Multiple).ok_or(Error::InvalidArgument {
            op: "mpi::init",
            detail: "MPI is already initialized in this process (call mpi::init once)".into(),
        })?;
    if threading != Threading::Multiple {
        return Err(Error::InvalidArgument {
            op: "mpi::init",
            detail: format!(
                "the MPI library provides thread level {threading:?}; the mpi backend needs \
                 MPI_THREAD_MULTIPLE (OpenMPI and MPICH as packaged by Debian provide it)"
            ),
        });
    }
    // SAFETY: reading the predefined world handle after MPI_Init.
    let world = RawComm::dup(unsafe { ffi::RSMPI_COMM_WORLD });
    let size = {
        let mut s = 0;
        // SAFETY: a valid communicator.
        unsafe { ffi::MPI_Comm_size(world.0, &mut s) };
        s as usize
    };
    let world = Arc::new(MpiComm::new(world, (0..size).collect(), options.timeout));
    Ok(Mpi {
        world,
        universe: Some(universe),
    })
}

impl Mpi {
    /// The world communicator (all ranks `mpirun` started).
    pub fn world(&self) -> Arc<dyn Communicator> {
        self.world.clone()
    }

    /// This process's rank in the world.
    pub fn rank(&self) -> usize {
        self.world.rank()
    }

    /// The number of ranks in the world.
    pub fn size(&self) -> usize {
        self.world.size()
    }

    /// Prints `rank R failed: {message}` to stderr and ends the whole job with exit code
    /// `code` (`MPI_Abort`): every rank is killed, none hangs.
    pub fn abort(&self, message: &str, code: i32) -> ! {
        abort(self.world.world_rank(), message, code)
    }

    /// Ends MPI for this process. Collective over the world: every rank says it is leaving
    /// (one header exchange); a peer still waiting in a collective gets `RankFailed`
    /// naming this rank, and this returns an error naming the peers that were left waiting
    /// (then the job should be aborted, as [`run`] does). Waits at most the timeout.
    ///
    /// Communicators are `Arc`s and may outlive this: after a successful finalize, every
    /// call on one returns [`Error::Finalized`] without touching MPI, and dropping one
    /// frees nothing. A call in flight on another thread finishes before MPI_Finalize runs.
    pub fn finalize(mut self) -> Result<()> {
        self.finish()
    }

    fn finish(&mut self) -> Result<()> {
        let Some(universe) = self.universe.take() else {
            return Ok(());
        };
        let r = self.world.leave();
        if r.is_ok() {
            // MPI_Finalize, once no handle method is inside MPI; from then on every
            // handle still held elsewhere returns `Error::Finalized` and frees nothing.
            finalize_with(|| drop(universe));
        } else {
            std::mem::forget(universe);
        }
        r
    }
}

impl Drop for Mpi {
    fn drop(&mut self) {
        if self.universe.is_none() {
            return;
        }
        if std::thread::panicking() {
            self.abort("panicked while MPI was running", 1);
        }
        if let Err(e) = self.finish() {
            self.abort(&e.to_string(), 1);
        }
    }
}

/// Runs `f` on this rank's world communicator, SPMD style: every rank `mpirun` started runs
/// the same `f`. Returns `f`'s value once every rank has finished.
///
/// If `f` returns an error or panics on any rank, that rank prints `rank R failed: …` (the
/// error or the panic message) and aborts the whole job (`MPI_Abort`, exit code 1): the
/// other ranks are killed wherever they are, so a failure never leaves the job hanging.
/// If MPI cannot start, prints why and exits with code 2. Started outside `mpirun`, it
/// runs as a world of one rank and prints how to launch more ([`LAUNCH_HINT`]).
pub fn run<T, E, F>(f: F) -> T
where
    F: FnOnce(Arc<dyn Communicator>) -> std::result::Result<T, E>,
    E: fmt::Display,
{
    let mut mpi = match init() {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    if !launched_by_mpirun() && mpi.size() == 1 {
        eprintln!("note: not started by mpirun: running as a single rank. {LAUNCH_HINT}");
    }
    let rank = mpi.world.world_rank();
    let result = catch_unwind(AssertUnwindSafe(|| f(mpi.world())));
    match result {
        Ok(Ok(v)) => match mpi.finish() {
            Ok(()) => v,
            Err(e) => abort(rank, &e.to_string(), 1),
        },
        Ok(Err(e)) => abort(rank, &format!("returned an error: {e}"), 1),
        Err(payload) => {
            let msg = if let Some(s) = payload.downcast_ref::<&str>() {
                s.to_string()
            } else if let Some(s) = payload.downcast_ref::<String>() {
                s.clone()
            } else {
                "<non-string panic payload>".to_string()
            };
            abort(rank, &format!("panicked: {msg}"), 1)
        }
    }
}
