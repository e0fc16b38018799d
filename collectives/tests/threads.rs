//! The threads backend: the backend conformance suite (`dtensor_collectives::conformance`)
//! on thread ranks, one `#[test]` per case, then what only this backend has (its
//! launcher: thread names, per-rank results; ranks that panic, error, return early or
//! never arrive; shared-memory checks of the barrier; its own wording of a diagnosis).

use dtensor_collectives::conformance::{self, Need, Outcome};
use dtensor_collectives::threads::{launch, launch_with, Options, RankError};
use dtensor_collectives::{CommunicatorExt, Element, Error, ReduceOp};
use std::time::{Duration, Instant};

fn opts(timeout: Duration) -> Options {
    Options { timeout }
}

/// Generous: tests that must not hit a timeout use this.
fn long() -> Options {
    opts(Duration::from_secs(60))
}

/// Unwraps every rank's result, showing which rank failed and how.
fn all_ok<T>(results: Vec<Result<T, RankError<Error>>>) -> Vec<T> {
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

// ---------------------------------------------------------------------------------------
// The conformance suite
// ---------------------------------------------------------------------------------------

/// What the threads backend lacks: nothing.
const UNSUPPORTED: &[(Need, &str)] = &[];

/// Runs case `name` on groups of every size of `Case::group_sizes` (1 to 4 thread ranks;
/// under Miri the few sizes the case names). Fails if any rank fails it on any size, or
/// if it never ran (every size too small); prints the sizes it skipped.
fn run_case(name: &str) {
    let case = conformance::case(name).unwrap_or_else(|| panic!("no conformance case {name}"));
    let mut ran = Vec::new();
    for n in case.group_sizes() {
        let results = launch_with(n, long(), |comm| {
            Ok::<_, Error>(case.run_on(&*comm, UNSUPPORTED))
        });
        let mut failures = Vec::new();
        let mut outcomes = Vec::new();
        for (r, res) in results.into_iter().enumerate() {
            match res {
                Ok(Outcome::Failed(msgs)) => failures.extend(
                    msgs.into_iter()
                        .map(|m| format!("  {n} ranks, rank {r}: {m}")),
                ),
                Ok(outcome) => outcomes.push(outcome),
                Err(e) => failures.push(format!("  {n} ranks, rank {r}: {e}")),
            }
        }
        assert!(
            failures.is_empty(),
            "{name} failed:\n{}",
            failures.join("\n")
        );
        assert!(
            outcomes.iter().all(|o| *o == outcomes[0]),
            "{name} on {n} ranks: the ranks disagree on the outcome: {outcomes:?}"
        );
        match &outcomes[0] {
            Outcome::Passed => ran.push(n),
            Outcome::Skipped(why) => eprintln!("{name} on {n} ranks: skipped: {why}"),
            other => panic!("{name} on {n} ranks: {other:?} on the threads backend"),
        }
    }
    assert!(
        !ran.is_empty(),
        "{name} never ran: every group size was skipped"
    );
}

/// One `#[test]` per conformance case, named after it, and a check that the list is the
/// suite's whole table.
macro_rules! conformance_tests {
    ($($name:ident),* $(,)?) => {
        mod suite {
            $(
                #[test]
                fn $name() {
                    super::run_case(stringify!($name));
                }
            )*
            pub(super) const NAMES: &[&str] = &[$(stringify!($name)),*];
        }
    };
}

conformance_tests!(
    all_reduce_every_dtype_op_matches_reference,
    all_reduce_order_sensitive_sum_bitwise_identical_and_equal_to_threads,
    all_reduce_any_order_replicas_bitwise_identical_within_rounding,
    all_gather_every_dtype_matches_reference,
    all_gatherv_uneven_counts_with_zeros_matches_reference,
    reduce_scatter_every_dtype_op_matches_reference,
    reduce_scatterv_uneven_counts_with_zeros_matches_reference,
    all_to_all_every_dtype_matches_reference,
    all_to_allv_uneven_counts_with_zeros_matches_reference,
    broadcast_every_dtype_root_matches_root,
    barrier_repeated_every_rank_passes_and_counts,
    in_place_all_gatherv_and_reduce_scatterv_match_reference,
    in_place_trait_defaults_match_reference,
    in_place_buffer_of_wrong_length_invalid_argument_and_peer_mismatch,
    column_block_collectives_match_reference,
    column_block_trait_defaults_match_reference,
    column_block_rows_disagree_every_rank_mismatch,
    column_collectives_with_overflowing_widths_are_invalid_on_every_rank,
    send_recv_fifo_per_tag_delivers_in_order,
    send_recv_symmetric_exchange_does_not_deadlock,
    send_recv_chain_ring_unbuffered_delivers_in_order,
    recv_wrong_length_or_dtype_message_mismatch_and_message_stays_queued,
    send_recv_peer_out_of_range_invalid_argument,
    send_from_many_threads_each_recv_gets_one_whole_message,
    split_rows_and_columns_run_concurrently,
    split_keys_order_new_ranks_and_ties_keep_parent_order,
    split_sub_group_mismatch_names_world_ranks,
    counters_every_collective_match_table,
    counters_failed_collective_records_nothing,
    collective_different_op_every_rank_mismatch,
    all_reduce_different_length_every_rank_mismatch,
    all_gather_different_dtype_every_rank_mismatch,
    broadcast_different_root_every_rank_mismatch,
    all_reduce_different_reduce_op_every_rank_mismatch,
    reduce_scatterv_different_counts_every_rank_mismatch,
    all_to_allv_counts_disagree_every_rank_mismatch,
    all_gather_recv_wrong_size_invalid_argument_and_peer_mismatch,
    collective_bad_local_arguments_invalid_argument_naming_op,
    collective_same_handle_from_two_threads_invalid_argument,
    async_every_kind_dtype_op_equals_blocking_bitwise,
    async_order_sensitive_sum_is_the_left_to_right_sum_on_every_rank,
    async_several_in_flight_complete_in_start_order_and_wait_in_any_order,
    async_waited_out_of_order_across_ranks_still_match,
    async_dropped_unwaited_still_runs_and_later_collectives_match,
    async_mixed_with_blocking_blocking_call_waits_for_earlier_requests,
    async_counters_equal_blocking_counted_once_on_completion,
    async_overlap_collective_completes_while_caller_computes,
    async_mismatch_every_rank_collective_mismatch_from_wait,
    async_invalid_argument_on_one_rank_mismatch_on_its_peers,
    async_on_split_groups_and_after_dropping_the_handle,
    async_start_while_another_thread_blocks_on_the_handle_invalid_argument,
    async_trait_default_stand_in_runs_at_start_with_the_same_results,
);

#[test]
fn conformance_every_case_has_a_test() {
    let mut listed: Vec<&str> = suite::NAMES.to_vec();
    let mut table: Vec<&str> = conformance::cases().iter().map(|c| c.name).collect();
    listed.sort_unstable();
    table.sort_unstable();
    assert_eq!(listed, table);
}

// ---------------------------------------------------------------------------------------
// The threads backend only: its launcher, departures and timeouts, shared memory, wording
// ---------------------------------------------------------------------------------------

/// The threads backend words an all-to-all-v mismatch by the pair that disagrees (the
/// suite's case checks only the text every backend shares).
#[test]
fn all_to_allv_counts_disagree_mismatch_names_the_pair() {
    let errs = all_ok(launch_with(2, long(), |comm| {
        let (sc, rc) = if comm.rank() == 0 {
            ([1, 2], [1, 1])
        } else {
            ([1, 1], [1, 1])
        };
        let send = vec![0.0f32; sc.iter().sum()];
        let mut recv = vec![0.0f32; 2];
        Ok(comm
            .all_to_allv(f32::slice(&send), &sc, f32::slice_mut(&mut recv), &rc)
            .unwrap_err())
    }));
    for e in errs {
        let shown = e.to_string();
        assert!(
            shown.contains("rank 0 sends 2 elements to rank 1, which expects 1"),
            "{shown}"
        );
    }
}

#[test]
fn barrier_every_size_all_ranks_pass_together() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    for n in 1..=4 {
        let before = AtomicUsize::new(0);
        all_ok(launch_with(n, long(), |comm| {
            for round in 1..=20 {
                before.fetch_add(1, Ordering::SeqCst);
                comm.barrier()?;
                // Nobody passes barrier `round` before everyone reached it.
                assert!(before.load(Ordering::SeqCst) >= round * n);
                comm.barrier()?;
            }
            Ok(())
        }));
    }
}

#[test]
fn launch_zero_ranks_returns_empty() {
    let results = launch(0, |_comm| Ok::<_, Error>(()));
    assert!(results.is_empty());
}

#[test]
fn launch_threads_named_by_rank() {
    let names = all_ok(launch_with(3, long(), |_comm| {
        Ok(std::thread::current().name().map(str::to_string))
    }));
    assert_eq!(
        names,
        ["rank-0", "rank-1", "rank-2"].map(|s| Some(s.to_string()))
    );
}

#[test]
fn recv_from_departed_rank_gets_queued_message_then_rank_failed() {
    let start = Instant::now();
    let results = launch_with(2, long(), |comm| {
        if comm.rank() == 0 {
            comm.send(f32::slice(&[7.0]), 1, 0)?;
            return Ok(());
        }
        let mut b = [0.0f32];
        comm.recv(f32::slice_mut(&mut b), 0, 0)?;
        assert_eq!(b, [7.0]);
        let err = comm.recv(f32::slice_mut(&mut b), 0, 0).unwrap_err();
        assert!(
            matches!(
                err,
                Error::RankFailed {
                    rank: 0,
                    op: "recv",
                    ..
                }
            ),
            "{err}"
        );
        Ok(())
    });
    all_ok(results);
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn recv_nothing_sent_times_out_naming_source() {
    let results = launch_with(2, opts(Duration::from_millis(200)), |comm| {
        if comm.rank() == 0 {
            std::thread::sleep(Duration::from_millis(500));
            return Ok(());
        }
        let mut b = [0.0f32];
        let err = comm.recv(f32::slice_mut(&mut b), 0, 3).unwrap_err();
        match err {
            Error::Timeout { op, missing, .. } => {
                assert_eq!((op, missing), ("recv", vec![0]));
            }
            other => panic!("expected a timeout, got {other}"),
        }
        Ok::<_, Error>(())
    });
    all_ok(results);
}

#[test]
fn split_member_panics_subgroup_peer_rank_failed_with_world_rank() {
    let start = Instant::now();
    let results = launch_with(4, long(), |comm| {
        let r = comm.rank();
        let rows = comm.split(r / 2, r)?;
        if r == 3 {
            panic!("rank 3 gives up");
        }
        let mut v = [1.0f32; 4];
        if r == 2 {
            // Sub-group rank 1 is world rank 3: the error names the world rank.
            let err = rows.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
            match err {
                Error::RankFailed { rank, op, reason } => {
                    assert_eq!((rank, op), (3, "all_reduce"));
                    assert!(reason.contains("rank 3 gives up"), "{reason}");
                }
                other => panic!("expected RankFailed, got {other}"),
            }
        } else {
            // The other row is unaffected; the world group is not.
            rows.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            assert_eq!(v, [2.0; 4]);
            let err = comm.barrier().unwrap_err();
            assert!(matches!(err, Error::RankFailed { rank: 3, .. }), "{err}");
        }
        Ok::<_, Error>(())
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    for (r, res) in results.into_iter().enumerate() {
        match (r, res) {
            (3, Err(RankError::Panicked(msg))) => assert_eq!(msg, "rank 3 gives up"),
            (3, other) => panic!("rank 3: {other:?}"),
            (r, res) => res.unwrap_or_else(|e| panic!("rank {r}: {e}")),
        }
    }
}

#[test]
fn rank_panics_peers_rank_failed_quickly() {
    let start = Instant::now();
    let results = launch_with(3, long(), |comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(50));
            panic!("boom on rank 1");
        }
        let mut v = [1.0f32; 4];
        Ok::<_, String>(comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err())
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    for r in [0, 2] {
        match &results[r] {
            Ok(Error::RankFailed { rank, op, reason }) => {
                assert_eq!((*rank, *op), (1, "all_reduce"));
                assert_eq!(reason, "panicked: boom on rank 1");
            }
            other => panic!("rank {r}: {other:?}"),
        }
    }
    assert!(matches!(&results[1], Err(RankError::Panicked(m)) if m == "boom on rank 1"));
}

#[test]
fn rank_returns_ok_early_peers_rank_failed() {
    let start = Instant::now();
    let results = launch_with(3, long(), |comm| {
        if comm.rank() == 2 {
            return Ok(None);
        }
        // Rank 2 may leave before or after the others start waiting: either way they fail.
        Ok::<_, Error>(Some(comm.barrier().unwrap_err()))
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    let results = all_ok(results);
    for err in results.into_iter().take(2) {
        let err = err.expect("rank 2 never calls barrier");
        assert!(
            matches!(&err, Error::RankFailed { rank: 2, reason, .. } if reason == "returned before joining"),
            "{err}"
        );
    }
}

#[test]
fn rank_returns_err_peers_rank_failed_with_its_message() {
    let results = launch_with(2, long(), |comm| {
        if comm.rank() == 0 {
            return Err("out of patience".to_string());
        }
        Ok(comm.all_gather_vec(&[1.0f32]).unwrap_err())
    });
    match &results[1] {
        Ok(Error::RankFailed {
            rank: 0, reason, ..
        }) => {
            assert_eq!(reason, "returned an error: out of patience")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(&results[0], Err(RankError::Returned(e)) if e == "out of patience"));
}

#[test]
fn rank_never_arrives_timeout_names_missing_and_group_stays_failed() {
    let start = Instant::now();
    let results = launch_with(3, opts(Duration::from_millis(300)), |comm| {
        let mut v = [1.0f32; 8];
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_millis(900));
            // Late: the group failed meanwhile, so this fails at once instead of waiting.
            let t = Instant::now();
            let err = comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
            assert!(t.elapsed() < Duration::from_millis(200));
            return Ok(err);
        }
        let err = comm.all_reduce_in_place(&mut v, ReduceOp::Sum).unwrap_err();
        match &err {
            Error::Timeout {
                op,
                waited,
                missing,
            } => {
                assert_eq!((*op, missing.as_slice()), ("all_reduce", &[2][..]));
                assert!(*waited >= Duration::from_millis(250), "{waited:?}");
            }
            other => panic!("expected a timeout, got {other}"),
        }
        // Later collectives on the failed group fail too rather than hang.
        assert!(comm.barrier().is_err());
        Ok::<_, Error>(err)
    });
    assert!(start.elapsed() < Duration::from_secs(5));
    let errs = all_ok(results);
    assert!(
        matches!(&errs[2], Error::Timeout { missing, .. } if missing == &[2]),
        "{}",
        errs[2]
    );
}

#[test]
fn launch_returns_each_rank_result_including_panic_message() {
    let results = launch_with(3, long(), |comm| match comm.rank() {
        0 => Ok(10),
        1 => Err("bad input".to_string()),
        _ => panic!("oops on {}", comm.rank()),
    });
    assert!(matches!(results[0], Ok(10)));
    assert!(matches!(&results[1], Err(RankError::Returned(e)) if e == "bad input"));
    assert!(matches!(&results[2], Err(RankError::Panicked(m)) if m == "oops on 2"));
    let shown: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
        .collect();
    assert_eq!(
        shown,
        ["returned an error: bad input", "panicked: oops on 2"]
    );
}

#[test]
fn async_rank_panics_or_errors_peers_wait_rank_failed_quickly() {
    for how in ["panic", "error"] {
        let start = Instant::now();
        let results = launch_with(3, long(), |comm| {
            // Every rank starts A; rank 1 then fails without waiting for it (its drop waits).
            let a = comm.start_all_reduce_vec(vec![1.0f32; 8], ReduceOp::Sum);
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
                if how == "panic" {
                    panic!("boom on rank 1");
                }
                return Err("gave up".to_string());
            }
            let b = comm.start_all_reduce_vec(vec![1.0f32; 8], ReduceOp::Sum);
            let c = comm.start_all_gather_vec(vec![1i64; 2]);
            assert_eq!(a.wait().map_err(|e| e.to_string())?, vec![3.0; 8]);
            Ok((b.wait().unwrap_err(), c.wait().unwrap_err()))
        });
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{how}: {:?}",
            start.elapsed()
        );
        for r in [0, 2] {
            let (b, c) = results[r]
                .as_ref()
                .unwrap_or_else(|e| panic!("rank {r}: {e}"));
            for (e, op) in [(b, "all_reduce"), (c, "all_gather")] {
                let Error::RankFailed {
                    rank: 1,
                    op: got,
                    reason,
                } = e
                else {
                    panic!("{how}: rank {r}: expected RankFailed, got {e}");
                };
                assert_eq!(*got, op);
                let want = if how == "panic" {
                    "panicked: boom on rank 1"
                } else {
                    "returned an error: gave up"
                };
                assert_eq!(reason, want);
            }
        }
    }
}

#[test]
fn async_rank_never_arrives_peers_wait_timeout_late_rank_fails_at_once() {
    let start = Instant::now();
    let results = launch_with(3, opts(Duration::from_millis(300)), |comm| {
        if comm.rank() == 2 {
            std::thread::sleep(Duration::from_millis(900));
            let t = Instant::now();
            let e = comm
                .start_all_reduce_vec(vec![1.0f32; 8], ReduceOp::Sum)
                .wait()
                .unwrap_err();
            assert!(t.elapsed() < Duration::from_millis(200));
            return Ok(e);
        }
        let a = comm.start_all_reduce_vec(vec![1.0f32; 8], ReduceOp::Sum);
        let b = comm.start_all_gather_vec(vec![1.0f32; 8]);
        let e = a.wait().unwrap_err();
        assert!(
            matches!(&e, Error::Timeout { op: "all_reduce", missing, .. } if missing == &[2]),
            "{e}"
        );
        // The request behind it fails too (the group stays failed), at once.
        assert!(matches!(
            b.wait(),
            Err(Error::Timeout {
                op: "all_gather",
                ..
            })
        ));
        Ok::<_, Error>(e)
    });
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    let errs = all_ok(results);
    assert!(
        matches!(&errs[2], Error::Timeout { missing, .. } if missing == &[2]),
        "{}",
        errs[2]
    );
}
