//! Misuse the MPI backend must survive without a hang or a call into a finalized MPI, for
//! `scripts/mpi-tests.sh`. Each mode prints one line per check and ends with
//! `misuse <mode>: PASS` (exit code 0) or `misuse <mode>: FAIL` (exit code 1).
//!
//! ```text
//! mpirun -np 2 target/debug/examples/mpi_misuse <late|finalized>
//! DTENSOR_MPI_TEST_IGNORE_WITHDRAWALS=1 mpirun -np 2 target/debug/examples/mpi_misuse stall
//! ```
//!
//! - `late`: the timeout is 0.5 s. While every rank is present, each makes one
//!   sub-communicator per collective (split of the world). Then the last rank sleeps 1.5 s
//!   (three timeouts) before calling each collective on its handle, while the others call
//!   them at once (one thread per handle). The on-time ranks must get `Timeout` naming the
//!   last rank after about 0.5 s. The late rank arrives after they gave up: it must get an
//!   error at once (a rank that timed out withdrew from the group), not `Ok` from a
//!   barrier that nobody else completed nor a hang in a data phase. The world itself is
//!   never failed: it carries a "done" message from the late rank and the final verdict,
//!   then `Mpi::finalize` ends MPI cleanly.
//! - `stall` (a debug build, run with `DTENSOR_MPI_TEST_IGNORE_WITHDRAWALS` set): as
//!   `late` for one all-reduce, but the late rank does not look for withdrawals, as when
//!   a peer times out at the very moment the late rank completes the header exchange. It
//!   then waits in the data phase for a peer that has left: the job must be aborted about
//!   one timeout later with `rank R failed: all_reduce: the data phase did not finish …`
//!   naming the rank that gave up (the script checks the message and the exit code). No
//!   `PASS` line: a collective that returns, or an abort that never comes (the on-time
//!   ranks give up after a while), prints `misuse stall: FAIL`.
//! - `finalized`: after `Mpi::finalize` returned `Ok`, handles kept from before (the world
//!   and a split of it) must return `Error::Finalized` from every method without calling
//!   MPI (OpenMPI would abort the job), asynchronous ones (from `wait`) included, whether
//!   the handle's progress worker ran before finalize or starts after it; and dropping
//!   them must not free them.

use dtensor_collectives::{mpi, Communicator, CommunicatorExt, Element, Error, ReduceOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

type Comm = Arc<dyn Communicator>;

const TIMEOUT: Duration = Duration::from_millis(500);
const LATE_BY: Duration = Duration::from_millis(1500);
/// Generous bounds on a loaded 2-core machine (several MPI ranks per core).
const SLACK: Duration = Duration::from_secs(3);

/// One collective on `comm`, as the late rank and its peers call it.
fn call(op: &str, comm: &Comm) -> Result<(), Error> {
    let n = comm.size();
    match op {
        "barrier" => comm.barrier(),
        "all_reduce" => comm.all_reduce_in_place(&mut [1.0f32; 64], ReduceOp::Sum),
        "all_gather" => comm.all_gather(
            i64::slice(&[2i64; 8]),
            i64::slice_mut(&mut vec![0i64; 8 * n]),
        ),
        "all_to_all" => comm.all_to_all(
            f64::slice(&vec![3.0f64; 4 * n]),
            f64::slice_mut(&mut vec![0.0f64; 4 * n]),
        ),
        "broadcast" => comm.broadcast(i32::slice_mut(&mut [4i32; 16]), 0),
        "split" => comm.split(0, comm.rank()).map(drop),
        other => panic!("unknown op {other}"),
    }
}

const OPS: [&str; 6] = [
    "barrier",
    "all_reduce",
    "all_gather",
    "all_to_all",
    "broadcast",
    "split",
];

/// Rank 0 prints the verdict agreed over the world; returns whether every rank passed.
fn verdict(world: &Comm, mode: &str, failures: &[String]) -> Result<bool, Error> {
    for f in failures {
        eprintln!("rank {}: FAIL: {f}", world.rank());
    }
    let mut bad = [i32::from(!failures.is_empty())];
    world.all_reduce_in_place(&mut bad, ReduceOp::Max)?;
    if world.rank() == 0 {
        let v = if bad[0] == 0 { "PASS" } else { "FAIL" };
        println!("misuse {mode}: {v}");
    }
    Ok(bad[0] == 0)
}

fn late(world: &Comm) -> Result<Vec<String>, Error> {
    let (r, n) = (world.rank(), world.size());
    let last = n - 1;
    let handles: Vec<Comm> = OPS
        .iter()
        .map(|_| world.split(0, r))
        .collect::<Result<_, _>>()?;
    world.barrier()?;
    let mut failures = Vec::new();
    if r == last {
        std::thread::sleep(LATE_BY);
        for (op, comm) in OPS.iter().zip(&handles) {
            let start = Instant::now();
            let got = call(op, comm);
            let took = start.elapsed();
            println!("rank {r} (late): {op} -> {got:?} after {took:.2?}");
            match got {
                Err(Error::RankFailed { rank, .. }) if rank < last && took < SLACK => {}
                other => failures.push(format!(
                    "late rank: {op} returned {other:?} after {took:.2?}; want RankFailed \
                     naming a rank that timed out, at once"
                )),
            }
        }
        for p in 0..last {
            world.send(i32::slice(&[1]), p, 99)?;
        }
    } else {
        let results: Vec<_> = std::thread::scope(|s| {
            let threads: Vec<_> = OPS
                .iter()
                .zip(&handles)
                .map(|(op, comm)| {
                    s.spawn(move || {
                        let start = Instant::now();
                        let got = call(op, comm);
                        (*op, got, start.elapsed())
                    })
                })
                .collect();
            threads
                .into_iter()
                .map(|t| t.join().expect("op thread"))
                .collect()
        });
        for (op, got, took) in results {
            println!("rank {r}: {op} -> {got:?} after {took:.2?}");
            match got {
                Err(Error::Timeout { missing, .. })
                    if missing == [last] && took >= TIMEOUT && took < TIMEOUT + SLACK => {}
                other => failures.push(format!(
                    "on-time rank: {op} returned {other:?} after {took:.2?}; want Timeout \
                     naming rank {last} after about {TIMEOUT:?}"
                )),
            }
        }
        // Wait for the late rank to finish (a recv that times out leaves the group
        // usable, so retry).
        let mut done = [0i32];
        let start = Instant::now();
        loop {
            match world.recv(i32::slice_mut(&mut done), last, 99) {
                Ok(()) => break,
                Err(Error::Timeout { .. }) if start.elapsed() < LATE_BY + 4 * SLACK => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(failures)
}

fn stall(world: &Comm) -> Result<Vec<String>, Error> {
    let (r, n) = (world.rank(), world.size());
    let last = n - 1;
    let comm = world.split(0, r)?;
    world.barrier()?;
    if r == last {
        std::thread::sleep(LATE_BY);
    }
    let start = Instant::now();
    let got = comm.all_reduce_in_place(&mut [1.0f32; 1024], ReduceOp::Sum);
    let took = start.elapsed();
    println!("rank {r}: all_reduce -> {got:?} after {took:.2?}");
    if r != last {
        // The late rank's abort ends this process too; give it time to come.
        std::thread::sleep(LATE_BY + 2 * SLACK);
    }
    Ok(vec![format!(
        "rank {r} is still running {:.2?} after the all_reduce (want the job aborted)",
        start.elapsed()
    )])
}

fn finalized(mpi: mpi::Mpi) -> Result<Vec<String>, Error> {
    let world = mpi.world();
    let r = world.rank();
    let half = world.split(r % 2, r)?;
    // Both handles have been used before MPI goes away; the world's progress worker is
    // running (an asynchronous all-reduce), the half's starts only after finalize.
    half.barrier()?;
    world.all_reduce_in_place(&mut [1.0f32; 8], ReduceOp::Sum)?;
    world
        .start_all_reduce_vec(vec![1.0f32; 8], ReduceOp::Sum)
        .wait()?;
    mpi.finalize()?;
    let mut failures = Vec::new();
    for (label, comm) in [("world", &world), ("half", &half)] {
        let mut buf = [0.0f32; 4];
        let results = [
            ("barrier", comm.barrier()),
            (
                "all_reduce",
                comm.all_reduce_in_place(&mut buf, ReduceOp::Sum),
            ),
            ("broadcast", comm.broadcast(f32::slice_mut(&mut buf), 0)),
            ("split", comm.split(0, 0).map(drop)),
            ("send", comm.send(f32::slice(&buf), 0, 1)),
            ("recv", comm.recv(f32::slice_mut(&mut buf), 0, 1)),
            (
                "start_all_reduce",
                comm.start_all_reduce_vec(vec![1.0f32; 4], ReduceOp::Sum)
                    .wait()
                    .map(drop),
            ),
            (
                "start_all_gather",
                comm.start_all_gather_vec(vec![1i64; 2]).wait().map(drop),
            ),
        ];
        for (op, got) in results {
            println!("rank {r} [{label}] after finalize: {op} -> {got:?}");
            if !matches!(got, Err(Error::Finalized { .. })) {
                failures.push(format!("{label}: {op} returned {got:?}, want Finalized"));
            }
        }
    }
    // Dropping the last references must not call MPI_Comm_free after MPI_Finalize.
    drop(half);
    drop(world);
    Ok(failures)
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let options = mpi::Options { timeout: TIMEOUT };
    let mpi = match mpi::init_with(options) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let passed = match mode.as_str() {
        "late" => {
            let world = mpi.world();
            let outcome = late(&world).and_then(|f| verdict(&world, "late", &f));
            drop(world);
            let ok = outcome.unwrap_or_else(|e| mpi.abort(&e.to_string(), 1));
            mpi.finalize().expect("finalize");
            ok
        }
        "stall" => {
            let failures = stall(&mpi.world()).unwrap_or_else(|e| mpi.abort(&e.to_string(), 1));
            for f in &failures {
                eprintln!("rank {}: FAIL: {f}", mpi.rank());
            }
            println!("misuse stall: FAIL");
            std::process::exit(1);
        }
        "finalized" => {
            let r = mpi.rank();
            let failures = finalized(mpi).expect("finalized");
            // The world is gone: each rank prints its own verdict.
            for f in &failures {
                eprintln!("rank {r}: FAIL: {f}");
            }
            let v = if failures.is_empty() { "PASS" } else { "FAIL" };
            println!("misuse finalized (rank {r}): {v}");
            failures.is_empty()
        }
        other => {
            eprintln!("usage: mpi_misuse <late|stall|finalized> (got {other:?})");
            std::process::exit(2);
        }
    };
    if !passed {
        std::process::exit(1);
    }
}
