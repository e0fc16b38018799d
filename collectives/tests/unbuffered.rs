//! The unbuffered emulator (`dtensor_collectives::unbuffered`): NCCL's point-to-point
//! semantics over the threads backend.
//!
//! - The backend conformance suite over it on 2 and 4 thread ranks, with NCCL's
//!   declarations about point-to-point calls and request progress
//!   (`unbuffered::UNSUPPORTED`): the cases that need buffered sends, tag matching, one
//!   handle shared by threads or progress while a send waits report `unsupported` with the
//!   reason; every other case must pass.
//! - What it adds: a crossed exchange (both ranks send first) times out instead of
//!   completing, a receive of another tag fails on both ends naming both tags, the
//!   protocol's own messages are not counted, split groups are wrapped too, and a send
//!   waits for the requests its rank started before it (stream order).

use dtensor_collectives::conformance::{self, Outcome};
use dtensor_collectives::threads::{self, Options};
use dtensor_collectives::unbuffered::{self, UNSUPPORTED};
use dtensor_collectives::{CollectiveKind, Element, Error};
use std::time::{Duration, Instant};

fn opts(secs: u64) -> Options {
    Options {
        timeout: Duration::from_secs(secs),
    }
}

#[test]
fn conformance_suite_on_unbuffered_threads_2_and_4_ranks() {
    let cases = conformance::cases();
    let mut failed = Vec::new();
    for n in [2, 4] {
        let t0 = Instant::now();
        let results = unbuffered::launch_with(n, opts(10), |comm| {
            Ok::<_, Error>(
                cases
                    .iter()
                    .map(|c| c.run_on(&*comm, UNSUPPORTED))
                    .collect::<Vec<_>>(),
            )
        });
        let per_rank: Vec<Vec<Outcome>> = results
            .into_iter()
            .enumerate()
            .map(|(r, res)| res.unwrap_or_else(|e| panic!("{n} ranks, rank {r}: {e}")))
            .collect();
        let (mut passed, mut unsupported) = (0, 0);
        for (i, case) in cases.iter().enumerate() {
            let first = &per_rank[0][i];
            for (r, o) in per_rank.iter().enumerate() {
                if let Outcome::Failed(msgs) = &o[i] {
                    failed.push(format!("{} on {n} ranks, rank {r}: {msgs:?}", case.name));
                } else if &o[i] != first {
                    failed.push(format!(
                        "{} on {n} ranks: rank {r} says {:?}, rank 0 {first:?}",
                        case.name, o[i]
                    ));
                }
            }
            match first {
                Outcome::Passed => passed += 1,
                Outcome::Unsupported(why) => {
                    unsupported += 1;
                    println!("{} on {n} ranks: unsupported: {why}", case.name);
                }
                Outcome::Skipped(why) => failed.push(format!(
                    "{} on {n} ranks: skipped ({why}), but every case runs on 2 ranks",
                    case.name
                )),
                Outcome::Failed(_) => {}
            }
        }
        println!(
            "unbuffered conformance on {n} ranks: {passed} passed, {unsupported} unsupported, \
             {} cases, {:.1}s",
            cases.len(),
            t0.elapsed().as_secs_f64()
        );
        assert!(failed.is_empty(), "failed:\n{}", failed.join("\n"));
        // Exactly the cases that need what NCCL lacks for point-to-point are unsupported.
        let want = cases
            .iter()
            .filter(|c| {
                c.needs
                    .iter()
                    .any(|n| UNSUPPORTED.iter().any(|(u, _)| u == n))
            })
            .count();
        assert_eq!(unsupported, want, "{n} ranks: unsupported cases");
        assert_eq!(
            passed + unsupported,
            cases.len(),
            "{n} ranks: every case ran"
        );
    }
}

/// Both ranks send first: the threads backend buffers and completes; the emulator's
/// rendezvous waits, and the inner timeout ends it on both ranks.
#[test]
fn send_crossed_exchange_completes_buffered_times_out_unbuffered() {
    let exchange = |comm: std::sync::Arc<dyn dtensor_collectives::Communicator>| {
        let peer = 1 - comm.rank();
        comm.send(f32::slice(&[comm.rank() as f32]), peer, 5)?;
        let mut got = [0.0f32];
        comm.recv(f32::slice_mut(&mut got), peer, 5)?;
        Ok::<_, Error>(got[0])
    };
    for (r, res) in threads::launch_with(2, opts(5), exchange)
        .into_iter()
        .enumerate()
    {
        assert_eq!(res.unwrap(), (1 - r) as f32);
    }
    let t0 = Instant::now();
    for res in unbuffered::launch_with(2, opts(1), exchange) {
        let e = res.unwrap_err().to_string();
        assert!(e.contains("timed out"), "{e}");
    }
    assert!(t0.elapsed() < Duration::from_secs(10));
}

/// Two messages on tags 1 then 2; the receiver asks for tag 2 first. The threads backend
/// matches by tag; under the emulator (as on NCCL) the next message is tag 1's, and both
/// ends fail, the receiver naming both tags.
#[test]
fn recv_other_tag_than_next_message_fails_on_both_ends_naming_both_tags() {
    let run = |comm: std::sync::Arc<dyn dtensor_collectives::Communicator>| {
        if comm.rank() == 0 {
            comm.send(f32::slice(&[1.0]), 1, 1)?;
            comm.send(f32::slice(&[2.0]), 1, 2)?;
            Ok::<_, Error>(0.0)
        } else {
            let mut got = [0.0f32];
            comm.recv(f32::slice_mut(&mut got), 0, 2)?;
            comm.recv(f32::slice_mut(&mut [0.0f32]), 0, 1)?;
            Ok(got[0])
        }
    };
    let buffered = threads::launch_with(2, opts(5), run);
    assert_eq!(buffered[1].as_ref().unwrap(), &2.0);
    let res = unbuffered::launch_with(2, opts(5), run);
    let e0 = res[0].as_ref().unwrap_err().to_string();
    let e1 = res[1].as_ref().unwrap_err().to_string();
    assert!(
        e0.contains("refused this rank's message (f32 x 1, tag 1)"),
        "{e0}"
    );
    assert!(
        e1.contains("has tag 1") && e1.contains("asked for tag 2"),
        "{e1}"
    );
}

/// A send counts once with its payload's bytes (not the header and answer), on the world
/// and on a split group, which is wrapped too (a crossed exchange there times out).
#[test]
fn counters_leave_out_the_protocol_and_split_groups_are_unbuffered() {
    let res = unbuffered::launch_with(4, opts(2), |comm| {
        let r = comm.rank();
        let sub = comm.split(r % 2, r)?; // {0, 2} and {1, 3}
        for c in [&comm, &sub] {
            let before = c.counters();
            let peer = if c.size() == 4 { r ^ 1 } else { 1 - c.rank() };
            let mut got = [0.0f64; 3];
            if c.rank() < peer {
                c.send(f64::slice(&[1.0; 3]), peer, 0)?;
                c.recv(f64::slice_mut(&mut got), peer, 0)?;
            } else {
                c.recv(f64::slice_mut(&mut got), peer, 0)?;
                c.send(f64::slice(&[1.0; 3]), peer, 0)?;
            }
            let d = c.counters().since(&before);
            assert_eq!(d.calls(CollectiveKind::Send), 1);
            assert_eq!(d.calls(CollectiveKind::Recv), 1);
            assert_eq!((d.bytes_sent, d.bytes_received), (24, 24));
        }
        let peer = 1 - sub.rank();
        sub.send(f32::slice(&[0.0]), peer, 0)?;
        Ok::<_, Error>(())
    });
    for res in res {
        let e = res.unwrap_err().to_string();
        assert!(e.contains("timed out"), "{e}");
    }
}

/// Rank 0 starts an all-reduce, then sends to rank 1, which receives before it joins the
/// all-reduce. Buffered and without stream order (threads) that completes; on NCCL the
/// send queues behind the all-reduce, which waits for rank 1: under the emulator both
/// ranks time out.
#[test]
fn send_waits_for_the_ranks_requests_in_flight() {
    let run = |comm: std::sync::Arc<dyn dtensor_collectives::Communicator>| {
        use dtensor_collectives::CommunicatorExt;
        let mut got = [0.0f32];
        if comm.rank() == 0 {
            let r = comm.start_all_reduce_vec(vec![1.0f32; 4], dtensor_collectives::ReduceOp::Sum);
            comm.send(f32::slice(&[3.0]), 1, 0)?;
            r.wait()?;
        } else {
            comm.recv(f32::slice_mut(&mut got), 0, 0)?;
            let r = comm.start_all_reduce_vec(vec![1.0f32; 4], dtensor_collectives::ReduceOp::Sum);
            r.wait()?;
        }
        Ok::<_, Error>(got[0])
    };
    let buffered = threads::launch_with(2, opts(5), run);
    assert_eq!(buffered[1].as_ref().unwrap(), &3.0);
    for res in unbuffered::launch_with(2, opts(1), run) {
        let e = res.unwrap_err().to_string();
        assert!(e.contains("timed out") || e.contains("failed"), "{e}");
    }
}
