//! The backend conformance suite (`dtensor_collectives::conformance`, the same cases the
//! threads backend runs in `tests/threads.rs`) on the MPI backend, plus the MPI backend's
//! own wording of a diagnosis.
//!
//! Run under MPI (built with `--features mpi`):
//!
//! ```text
//! mpirun --oversubscribe -np 4 target/debug/examples/mpi_conformance
//! ```
//!
//! Every case runs on the world and again on two halves of it (a split), so group sizes
//! 1..=n are covered. A case fails if it fails on any rank of the world or of either half;
//! whether it was skipped or unsupported is rank 0's group's verdict. Rank 0 prints one line per case and group, `<case> [world of 4] ...
//! ok` (or `FAILED`, or `skipped: <why>` for a group smaller than the case needs, or
//! `unsupported: <why>` for a capability this backend declares it lacks), then
//! `P passed, F failed, S skipped, U unsupported`; the exit code is 1 if any case failed on
//! any rank. `scripts/mpi-tests.sh` checks that line. An optional argument runs only the
//! cases whose name contains it.

use dtensor_collectives::conformance::{self, Case, Checks, Need, Outcome};
use dtensor_collectives::{mpi, Communicator, CommunicatorExt, Error, ReduceOp};

/// What the MPI backend lacks, and why: nothing (the list stays, for a capability it
/// may lack later).
const UNSUPPORTED: &[(Need, &str)] = &[];

/// The MPI backend words an all-to-all-v mismatch by its agreement (sums of the counts),
/// not by the pair that disagrees; the suite's case checks only the text every backend
/// shares.
fn all_to_allv_counts_disagree_mismatch_says_they_do_not_pair_up(
    comm: &dyn Communicator,
    f: &mut Checks,
) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    // Rank 0 expects 2 elements from rank 1, which sends it 1.
    let sc = vec![1; n];
    let mut rc = vec![1; n];
    if r == 0 {
        rc[1] = 2;
    }
    let send = vec![0i32; n];
    let mut recv = vec![0i32; rc.iter().sum()];
    let e = comm.all_to_allv(
        dtensor_collectives::Element::slice(&send[..]),
        &sc,
        dtensor_collectives::Element::slice_mut(&mut recv[..]),
        &rc,
    );
    let shown = e.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
    f.check(
        matches!(e, Err(Error::CollectiveMismatch { .. })) && shown.contains("pair up"),
        || format!("all_to_allv counts that do not pair up: {e:?}"),
    );
    let mut v = [1i32; 3];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    f.eq(&v, &[n as i32; 3], || "the group is unusable after".into());
    Ok(())
}

/// The MPI backend's own cases, in the suite's form.
const MPI_CASES: &[Case] = &[Case {
    name: "all_to_allv_counts_disagree_mismatch_says_they_do_not_pair_up",
    min_ranks: 2,
    needs: &[],
    miri_ranks: &[],
    run: all_to_allv_counts_disagree_mismatch_says_they_do_not_pair_up,
}];

fn main() {
    let filter = std::env::args().nth(1).unwrap_or_default();
    let cases: Vec<&Case> = conformance::cases()
        .iter()
        .chain(MPI_CASES)
        .filter(|c| c.name.contains(filter.as_str()))
        .collect();
    let failed = mpi::run(|world| {
        let (r, n) = (world.rank(), world.size());
        // The world, then each half of it (sizes n/2 and n - n/2).
        let half = world.split(usize::from(r >= n / 2), r)?;
        let (mut passed, mut failed, mut skipped, mut unsupported) = (0, 0, 0, 0);
        for (label, comm) in [("world", &world), ("half", &half)] {
            for case in &cases {
                let outcome = case.run_on(&**comm, UNSUPPORTED);
                // Agree across the world on whether the case failed anywhere (a half's
                // verdict covers both halves).
                let mut bad = [i32::from(matches!(outcome, Outcome::Failed(_)))];
                world.all_reduce_in_place(&mut bad, ReduceOp::Max)?;
                if let Outcome::Failed(msgs) = &outcome {
                    for msg in msgs {
                        eprintln!(
                            "  rank {r} [{label} of {}] {}: {msg}",
                            comm.size(),
                            case.name
                        );
                    }
                }
                let verdict = match (&outcome, bad[0]) {
                    (_, 1) => {
                        failed += 1;
                        "FAILED".to_string()
                    }
                    (Outcome::Skipped(why), _) => {
                        skipped += 1;
                        format!("skipped: {why}")
                    }
                    (Outcome::Unsupported(why), _) => {
                        unsupported += 1;
                        format!("unsupported: {why}")
                    }
                    _ => {
                        passed += 1;
                        "ok".to_string()
                    }
                };
                if r == 0 {
                    println!("{} [{label} of {}] ... {verdict}", case.name, comm.size());
                }
            }
        }
        world.barrier()?;
        if r == 0 {
            println!("mpi conformance on {n} ranks:");
            println!(
                "{passed} passed, {failed} failed, {skipped} skipped, {unsupported} unsupported"
            );
        }
        Ok::<_, Error>(failed)
    });
    if failed > 0 {
        std::process::exit(1);
    }
}
