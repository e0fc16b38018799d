//! The thread backend against slow, obviously correct references, plus its failure modes.

use dtensor_collectives::threads::{launch, launch_with, Options, RankError};
use dtensor_collectives::{
    Buffer, CollectiveKind, Communicator, CommunicatorExt, CounterSnapshot, DType, Element, Error,
    ReduceOp, Request, Slice, SliceMut, StorageElement,
};
use dtensor_kernels::half::{bf16, f16};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Every reduce op; under Miri Avg (Sum's combine plus the kernel's in-place division
/// loop) and Max (the comparing combine).
fn ops() -> Vec<ReduceOp> {
    unless_miri(
        vec![ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min],
        vec![ReduceOp::Avg, ReduceOp::Max],
    )
}

/// `full`, or the smaller `miri` when the tests run under Miri (`cargo +nightly miri
/// test`), which interprets every step about 1000x slower and would not finish in CI's
/// budget with the full set.
fn unless_miri<T>(full: T, miri: T) -> T {
    if cfg!(miri) {
        miri
    } else {
        full
    }
}

fn opts(timeout: Duration) -> Options {
    Options { timeout }
}

/// Generous: tests that must not hit a timeout use this.
fn long() -> Options {
    opts(Duration::from_secs(60))
}

/// Small integers: exact in every dtype, distinct enough to catch misplaced elements.
fn val<T: Element>(rank: usize, i: usize) -> T {
    T::from_f64(((rank * 31 + i * 7) % 97) as f64 - 48.0)
}

fn vals<T: Element>(rank: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| val(rank, i)).collect()
}

/// A length past the reduction kernel's 2048-element block, shrunk under Miri (which runs
/// `cargo +nightly miri test` about 1000x slower).
fn big(len: usize) -> usize {
    if cfg!(miri) {
        11
    } else {
        len
    }
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

/// Uneven counts with zeros: `[3, 0, 5, 1]` cut to `n`.
fn uneven(n: usize) -> Vec<usize> {
    (0..n).map(|r| [3, 0, 5, 1][r % 4]).collect()
}

fn bits<T: Element>(v: &[T]) -> String {
    format!("{v:?}")
}

/// Runs `$f::<T>(args)` for every dtype: f32, f64, bf16, f16, i32 and i64. Under Miri only
/// one dtype of each element size (f32, bf16, i64): what Miri checks (bounds, aliasing,
/// races) depends on the byte offsets, not on the arithmetic.
macro_rules! each_dtype {
    ($f:ident($($arg:expr),*)) => {{
        $f::<f32>($($arg),*);
        $f::<bf16>($($arg),*);
        $f::<i64>($($arg),*);
        if !cfg!(miri) {
            $f::<f64>($($arg),*);
            $f::<f16>($($arg),*);
            $f::<i32>($($arg),*);
        }
    }};
}

/// The group sizes the data tests cover: 1 to 4, or 1 to 3 under Miri. Three ranks still
/// give uneven blocks, and a reduction over more than two sources, which is the reduce
/// kernel's other code path.
fn ranks() -> std::ops::RangeInclusive<usize> {
    if cfg!(miri) {
        1..=3
    } else {
        1..=4
    }
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
// Data movement against references
// ---------------------------------------------------------------------------------------

fn check_all_reduce<T: Element>(n: usize) {
    all_ok(launch_with(n, long(), |comm| {
        let r = comm.rank();
        // Under Miri, 1 element over 3 ranks still gives empty blocks, 11 uneven ones.
        for len in unless_miri(vec![0, 1, 5, 37, 5000], vec![1, 11]) {
            for op in ops() {
                let mut buf = vals::<T>(r, len);
                comm.all_reduce_in_place(&mut buf, op)?;
                let expect: Vec<T> = (0..len)
                    .map(|i| reduce_ref(&(0..n).map(|p| val(p, i)).collect::<Vec<T>>(), op))
                    .collect();
                assert_eq!(bits(&buf), bits(&expect), "n={n} len={len} op={op}");
            }
        }
        Ok(())
    }));
}

#[test]
fn all_reduce_every_size_dtype_op_matches_reference() {
    for n in ranks() {
        each_dtype!(check_all_reduce(n));
    }
}

#[test]
fn all_reduce_order_sensitive_sum_bitwise_identical_across_ranks() {
    // (1e16 + 1) - 1e16 == 0 but 1e16 + (1 - 1e16) == 1: only one order gives the reference.
    let len = big(10_001);
    let x = |rank: usize, i: usize| [1.0e16, 1.0, -1.0e16, 0.5][(rank + i) % 4];
    let out = all_ok(launch_with(3, long(), |comm| {
        let mut buf: Vec<f64> = (0..len).map(|i| x(comm.rank(), i)).collect();
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
        Ok(buf)
    }));
    let expect: Vec<f64> = (0..len).map(|i| (x(0, i) + x(1, i)) + x(2, i)).collect();
    // Element 0 is 1e16 + 1 - 1e16: exactly 1, but 0 left to right.
    assert_eq!(expect[0], 0.0);
    for buf in &out {
        let b: Vec<u64> = buf.iter().map(|v| v.to_bits()).collect();
        let e: Vec<u64> = expect.iter().map(|v| v.to_bits()).collect();
        assert!(b == e, "not the left-to-right sum");
    }
}

fn check_all_gather<T: Element>(n: usize) {
    all_ok(launch_with(n, long(), |comm| {
        let r = comm.rank();
        for k in unless_miri(vec![0, 1, 7, 3000], vec![0, 7]) {
            let send = vals::<T>(r, k);
            let mut recv = vec![T::zero(); n * k];
            comm.all_gather(T::slice(&send), T::slice_mut(&mut recv))?;
            let expect: Vec<T> = (0..n).flat_map(|p| vals::<T>(p, k)).collect();
            assert_eq!(bits(&recv), bits(&expect), "n={n} k={k}");
            assert_eq!(bits(&comm.all_gather_vec(&send)?), bits(&expect));
        }
        Ok(())
    }));
}

#[test]
fn all_gather_every_size_dtype_matches_reference() {
    for n in ranks() {
        each_dtype!(check_all_gather(n));
    }
}

fn check_all_gatherv<T: Element>(n: usize) {
    all_ok(launch_with(n, long(), |comm| {
        let r = comm.rank();
        for counts in [uneven(n), vec![0; n]] {
            let send = vals::<T>(r, counts[r]);
            let mut recv = vec![T::zero(); counts.iter().sum()];
            comm.all_gatherv(T::slice(&send), T::slice_mut(&mut recv), &counts)?;
            let expect: Vec<T> = (0..n).flat_map(|p| vals::<T>(p, counts[p])).collect();
            assert_eq!(bits(&recv), bits(&expect), "n={n} counts={counts:?}");
        }
        Ok(())
    }));
}

#[test]
fn all_gatherv_uneven_counts_with_zeros_matches_reference() {
    for n in ranks() {
        each_dtype!(check_all_gatherv(n));
    }
}

fn check_reduce_scatter<T: Element>(n: usize) {
    all_ok(launch_with(n, long(), |comm| {
        let r = comm.rank();
        for k in unless_miri(vec![0, 1, 9, 2100], vec![0, 9]) {
            for op in ops() {
                let send = vals::<T>(r, n * k);
                let mut recv = vec![T::zero(); k];
                comm.reduce_scatter(T::slice(&send), T::slice_mut(&mut recv), op)?;
                let expect: Vec<T> = (r * k..(r + 1) * k)
                    .map(|i| reduce_ref(&(0..n).map(|p| val(p, i)).collect::<Vec<T>>(), op))
                    .collect();
                assert_eq!(bits(&recv), bits(&expect), "n={n} k={k} op={op}");
            }
        }
        Ok(())
    }));
}

#[test]
fn reduce_scatter_every_size_dtype_op_matches_reference() {
    for n in ranks() {
        each_dtype!(check_reduce_scatter(n));
    }
}

fn check_reduce_scatterv<T: Element>(n: usize) {
    all_ok(launch_with(n, long(), |comm| {
        let r = comm.rank();
        for counts in [uneven(n), vec![0; n]] {
            for op in ops() {
                let total: usize = counts.iter().sum();
                let start: usize = counts[..r].iter().sum();
                let send = vals::<T>(r, total);
                let mut recv = vec![T::zero(); counts[r]];
                comm.reduce_scatterv(T::slice(&send), T::slice_mut(&mut recv), &counts, op)?;
                let expect: Vec<T> = (start..start + counts[r])
                    .map(|i| reduce_ref(&(0..n).map(|p| val(p, i)).collect::<Vec<T>>(), op))
                    .collect();
                assert_eq!(
                    bits(&recv),
                    bits(&expect),
                    "n={n} counts={counts:?} op={op}"
                );
            }
        }
        Ok(())
    }));
}

#[test]
fn reduce_scatterv_uneven_counts_with_zeros_matches_reference() {
    for n in ranks() {
        each_dtype!(check_reduce_scatterv(n));
    }
}

/// Element `j` of the block rank `p` sends to rank `q`.
fn a2a<T: Element>(p: usize, q: usize, j: usize) -> T {
    val(p * 8 + q, j)
}

fn check_all_to_all<T: Element>(n: usize) {
    all_ok(launch_with(n, long(), |comm| {
        let r = comm.rank();
        for k in [0, 1, 6] {
            let send: Vec<T> = (0..n)
                .flat_map(|q| (0..k).map(move |j| a2a(r, q, j)))
                .collect();
            let mut recv = vec![T::zero(); n * k];
            comm.all_to_all(T::slice(&send), T::slice_mut(&mut recv))?;
            let expect: Vec<T> = (0..n)
                .flat_map(|p| (0..k).map(move |j| a2a(p, r, j)))
                .collect();
            assert_eq!(bits(&recv), bits(&expect), "n={n} k={k}");
        }
        Ok(())
    }));
}

#[test]
fn all_to_all_every_size_dtype_matches_reference() {
    for n in ranks() {
        each_dtype!(check_all_to_all(n));
    }
}

fn check_all_to_allv<T: Element>(n: usize) {
    // Rank p sends (p + 2q) % 3 elements to rank q: zeros included, nothing symmetric.
    let c = |p: usize, q: usize| (p + 2 * q) % 3;
    all_ok(launch_with(n, long(), |comm| {
        let r = comm.rank();
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
        assert_eq!(bits(&recv), bits(&expect), "n={n}");
        Ok(())
    }));
}

#[test]
fn all_to_allv_uneven_counts_with_zeros_matches_reference() {
    for n in ranks() {
        each_dtype!(check_all_to_allv(n));
    }
}

fn check_broadcast<T: Element>(n: usize) {
    all_ok(launch_with(n, long(), |comm| {
        let r = comm.rank();
        for root in 0..n {
            for len in unless_miri(vec![0, 1, 33], vec![0, 5]) {
                let mut buf = vals::<T>(r, len);
                comm.broadcast_in_place(&mut buf, root)?;
                assert_eq!(bits(&buf), bits(&vals::<T>(root, len)), "n={n} root={root}");
            }
        }
        Ok(())
    }));
}

#[test]
fn broadcast_every_size_dtype_root_matches_root() {
    for n in ranks() {
        each_dtype!(check_broadcast(n));
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

// ---------------------------------------------------------------------------------------
// Point to point
// ---------------------------------------------------------------------------------------

#[test]
fn send_recv_fifo_per_tag_delivers_in_order() {
    all_ok(launch_with(2, long(), |comm| {
        if comm.rank() == 0 {
            comm.send(f32::slice(&[1.0, 1.5]), 1, 5)?;
            comm.send(f32::slice(&[2.0, 2.5]), 1, 5)?;
            comm.send(i64::slice(&[9]), 1, 7)?;
        } else {
            let mut t7 = [0i64];
            comm.recv(i64::slice_mut(&mut t7), 0, 7)?;
            assert_eq!(t7, [9]);
            let mut a = [0.0f32; 2];
            comm.recv(f32::slice_mut(&mut a), 0, 5)?;
            assert_eq!(a, [1.0, 1.5]);
            comm.recv(f32::slice_mut(&mut a), 0, 5)?;
            assert_eq!(a, [2.0, 2.5]);
        }
        Ok(())
    }));
}

#[test]
fn send_recv_symmetric_exchange_does_not_deadlock() {
    all_ok(launch_with(4, long(), |comm| {
        let (r, n) = (comm.rank(), comm.size());
        let send = vals::<f64>(r, 1000);
        let right = (r + 1) % n;
        let left = (r + n - 1) % n;
        comm.send(f64::slice(&send), right, 0)?;
        let mut got = vec![0.0f64; 1000];
        comm.recv(f64::slice_mut(&mut got), left, 0)?;
        assert_eq!(got, vals::<f64>(left, 1000));
        Ok(())
    }));
}

#[test]
fn recv_wrong_length_or_dtype_message_mismatch_and_message_stays_queued() {
    all_ok(launch_with(2, long(), |comm| {
        if comm.rank() == 0 {
            comm.send(f32::slice(&[1.0, 2.0, 3.0]), 1, 4)?;
            comm.barrier()?;
        } else {
            let mut four = [0.0f32; 4];
            let err = comm.recv(f32::slice_mut(&mut four), 0, 4).unwrap_err();
            assert_eq!(
                err,
                Error::MessageMismatch {
                    op: "recv",
                    src: 0,
                    tag: 4,
                    got_len: 3,
                    got_dtype: dtensor_collectives::DType::F32,
                    want_len: 4,
                    want_dtype: dtensor_collectives::DType::F32,
                }
            );
            let mut f64s = [0.0f64; 3];
            let err = comm.recv(f64::slice_mut(&mut f64s), 0, 4).unwrap_err();
            assert!(matches!(err, Error::MessageMismatch { .. }), "{err}");
            let mut three = [0.0f32; 3];
            comm.recv(f32::slice_mut(&mut three), 0, 4)?;
            assert_eq!(three, [1.0, 2.0, 3.0]);
            comm.barrier()?;
        }
        Ok(())
    }));
}

#[test]
fn send_recv_peer_out_of_range_invalid_argument() {
    all_ok(launch_with(2, long(), |comm| {
        let err = comm.send(f32::slice(&[1.0]), 2, 0).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { op: "send", .. }),
            "{err}"
        );
        let mut b = [0.0f32];
        let err = comm.recv(f32::slice_mut(&mut b), 7, 0).unwrap_err();
        assert!(
            matches!(err, Error::InvalidArgument { op: "recv", .. }),
            "{err}"
        );
        Ok(())
    }));
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

// ---------------------------------------------------------------------------------------
// Split
// ---------------------------------------------------------------------------------------

#[test]
fn split_two_by_two_rows_and_columns_run_concurrently() {
    let out = all_ok(launch_with(4, long(), |comm| {
        let r = comm.rank();
        let (row, col) = (r / 2, r % 2);
        let rows = comm.split(row, col)?;
        let cols = comm.split(col, row)?;
        assert_eq!((rows.rank(), rows.size()), (col, 2));
        assert_eq!((cols.rank(), cols.size()), (row, 2));
        let mut sums = Vec::new();
        let mut gathers = Vec::new();
        for i in 0..50 {
            // Rows reduce while columns gather, alternating which goes first.
            let mut v = vec![(r * 100 + i) as f64; 3];
            if i % 2 == 0 {
                rows.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
                gathers.push(cols.all_gather_vec(&[r as i64])?);
            } else {
                gathers.push(cols.all_gather_vec(&[r as i64])?);
                rows.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
            }
            sums.push(v[0]);
        }
        Ok((row, col, sums, gathers))
    }));
    for (row, col, sums, gathers) in out {
        for (i, s) in sums.iter().enumerate() {
            let a = 2 * row * 100 + i;
            let b = (2 * row + 1) * 100 + i;
            assert_eq!(*s, (a + b) as f64);
        }
        for g in gathers {
            assert_eq!(g, vec![col as i64, 2 + col as i64]);
        }
    }
}

#[test]
fn split_keys_order_new_ranks_and_ties_keep_parent_order() {
    let out = all_ok(launch_with(4, long(), |comm| {
        let r = comm.rank();
        let reversed = comm.split(0, 3 - r)?;
        let tied = comm.split(r % 2, 0)?;
        let alone = comm.split(r, 0)?;
        let gathered = reversed.all_gather_vec(&[r as i32])?;
        Ok((
            reversed.rank(),
            gathered,
            tied.rank(),
            tied.size(),
            alone.rank(),
            alone.size(),
        ))
    }));
    for (r, (rev, gathered, tied, tied_size, alone, alone_size)) in out.into_iter().enumerate() {
        assert_eq!(rev, 3 - r);
        assert_eq!(gathered, vec![3, 2, 1, 0]);
        assert_eq!((tied, tied_size), (r / 2, 2));
        assert_eq!((alone, alone_size), (0, 1));
    }
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

// ---------------------------------------------------------------------------------------
// Counters
// ---------------------------------------------------------------------------------------

/// Runs `f` and returns what it added to the handle's counters.
fn delta(
    comm: &Arc<dyn Communicator>,
    f: impl FnOnce() -> Result<(), Error>,
) -> Result<CounterSnapshot, Error> {
    let before = comm.counters();
    f()?;
    Ok(comm.counters().since(&before))
}

fn one(kind: CollectiveKind, sent: u64, received: u64) -> (CollectiveKind, u64, u64) {
    (kind, sent, received)
}

#[test]
fn counters_every_collective_match_table() {
    use CollectiveKind::*;
    const F32: usize = 4;
    let out = all_ok(launch_with(3, long(), |comm| {
        let r = comm.rank();
        let mut got: Vec<(CollectiveKind, u64, u64)> = Vec::new();
        let mut note = |d: CounterSnapshot| {
            let kinds: Vec<_> = CollectiveKind::ALL
                .into_iter()
                .filter(|&k| d.calls(k) > 0)
                .collect();
            assert_eq!(kinds.len(), 1, "{d}");
            assert_eq!(d.calls(kinds[0]), 1, "{d}");
            got.push((kinds[0], d.bytes_sent, d.bytes_received));
        };
        let mut a = vec![1.0f32; 10];
        note(delta(&comm, || {
            comm.all_reduce_in_place(&mut a, ReduceOp::Sum)
        })?);
        let mut g = vec![0.0f32; 15];
        note(delta(&comm, || {
            comm.all_gather(f32::slice(&[1.0; 5]), f32::slice_mut(&mut g))
        })?);
        let counts = [2, 0, 3];
        let send = vec![1.0f32; counts[r]];
        note(delta(&comm, || {
            comm.all_gatherv(f32::slice(&send), f32::slice_mut(&mut g[..5]), &counts)
        })?);
        let mut rs = [0.0f32; 2];
        note(delta(&comm, || {
            comm.reduce_scatter(
                f32::slice(&[1.0; 6]),
                f32::slice_mut(&mut rs),
                ReduceOp::Sum,
            )
        })?);
        let counts = [1, 0, 4];
        let mut rsv = vec![0.0f32; counts[r]];
        note(delta(&comm, || {
            comm.reduce_scatterv(
                f32::slice(&[1.0; 5]),
                f32::slice_mut(&mut rsv),
                &counts,
                ReduceOp::Sum,
            )
        })?);
        let mut t = [0.0f32; 6];
        note(delta(&comm, || {
            comm.all_to_all(f32::slice(&[1.0; 6]), f32::slice_mut(&mut t))
        })?);
        let sc = [[1, 2, 0], [0, 1, 3], [2, 0, 1]];
        let rc: Vec<usize> = (0..3).map(|p| sc[p][r]).collect();
        let send = vec![1.0f32; sc[r].iter().sum()];
        let mut recv = vec![0.0f32; rc.iter().sum()];
        note(delta(&comm, || {
            comm.all_to_allv(f32::slice(&send), &sc[r], f32::slice_mut(&mut recv), &rc)
        })?);
        let mut b = [0.0f32; 7];
        note(delta(&comm, || comm.broadcast_in_place(&mut b, 1))?);
        note(delta(&comm, || comm.barrier())?);
        match r {
            0 => note(delta(&comm, || comm.send(f32::slice(&[1.0; 3]), 1, 0))?),
            1 => {
                let mut m = [0.0f32; 3];
                note(delta(&comm, || comm.recv(f32::slice_mut(&mut m), 0, 0))?)
            }
            _ => {}
        }
        let before = comm.counters();
        let sub = comm.split(0, r)?;
        note(comm.counters().since(&before));
        // A new handle starts from zero.
        assert_eq!(sub.counters(), CounterSnapshot::default());
        Ok(got)
    }));
    let b = |elems: usize| (elems * F32) as u64;
    // Per rank, per call: (kind, bytes sent, bytes received), from counters.rs's table.
    let expect = [
        vec![
            one(AllReduce, b(6 + 4 * 2), b(4 * 2 + 6)), // blocks [4, 4, 2], own 4
            one(AllGather, b(5 * 2), b(10)),
            one(AllGather, b(2 * 2), b(3)),
            one(ReduceScatter, b(4), b(2 * 2)),
            one(ReduceScatter, b(4), b(2)), // own block 1 from 2 peers
            one(AllToAll, b(4), b(4)),
            one(AllToAll, b(2), b(2)),
            one(Broadcast, 0, b(7)),
            one(Barrier, 0, 0),
            one(Send, b(3), 0),
            one(Split, 0, 0),
        ],
        vec![
            one(AllReduce, b(6 + 4 * 2), b(4 * 2 + 6)),
            one(AllGather, b(5 * 2), b(10)),
            one(AllGather, 0, b(5)),
            one(ReduceScatter, b(4), b(2 * 2)),
            one(ReduceScatter, b(5), 0),
            one(AllToAll, b(4), b(4)),
            one(AllToAll, b(3), b(2)),
            one(Broadcast, b(7 * 2), 0),
            one(Barrier, 0, 0),
            one(Recv, 0, b(3)),
            one(Split, 0, 0),
        ],
        vec![
            one(AllReduce, b(8 + 2 * 2), b(2 * 2 + 8)), // own block 2
            one(AllGather, b(5 * 2), b(10)),
            one(AllGather, b(3 * 2), b(2)),
            one(ReduceScatter, b(4), b(2 * 2)),
            one(ReduceScatter, b(1), b(4 * 2)),
            one(AllToAll, b(4), b(4)),
            one(AllToAll, b(2), b(3)),
            one(Broadcast, 0, b(7)),
            one(Barrier, 0, 0),
            one(Split, 0, 0),
        ],
    ];
    for (r, (got, want)) in out.iter().zip(&expect).enumerate() {
        assert_eq!(got, want, "rank {r}");
    }
}

#[test]
fn counters_failed_collective_records_nothing() {
    all_ok(launch_with(2, long(), |comm| {
        let before = comm.counters();
        let mut v = vec![0.0f32; 4 + comm.rank()];
        assert!(comm.all_reduce_in_place(&mut v, ReduceOp::Sum).is_err());
        assert_eq!(comm.counters(), before);
        Ok(())
    }));
}

// ---------------------------------------------------------------------------------------
// Mismatches and invalid arguments: every rank fails, the group stays usable
// ---------------------------------------------------------------------------------------

/// Runs `f` on 2 ranks; asserts every rank gets `CollectiveMismatch` whose detail contains
/// each of `needles`, and that a matching all_reduce still works afterwards.
fn expect_mismatch(
    needles: &[&str],
    f: impl Fn(&Arc<dyn Communicator>) -> Result<(), Error> + Sync,
) {
    let details = all_ok(launch_with(2, long(), |comm| {
        let err = f(&comm).expect_err("a mismatched call must fail");
        let Error::CollectiveMismatch {
            backend,
            size,
            detail,
            ..
        } = err
        else {
            panic!("expected CollectiveMismatch, got {err}");
        };
        assert_eq!((backend, size), ("threads", 2));
        let mut v = [comm.rank() as f32 + 1.0; 3];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        assert_eq!(v, [3.0; 3]);
        Ok(detail)
    }));
    assert_eq!(details[0], details[1], "ranks must agree on the diagnosis");
    for n in needles {
        assert!(details[0].contains(n), "{:?} lacks {n:?}", details[0]);
    }
}

#[test]
fn collective_different_op_every_rank_mismatch() {
    expect_mismatch(
        &[
            "different collectives",
            "rank 0: all_reduce(f32 x 16, sum)",
            "rank 1: all_gather(f32 x 8 -> 16)",
        ],
        |comm| {
            if comm.rank() == 0 {
                comm.all_reduce_in_place(&mut [0.0f32; 16], ReduceOp::Sum)
            } else {
                comm.all_gather(f32::slice(&[0.0; 8]), f32::slice_mut(&mut [0.0; 16]))
            }
        },
    );
}

#[test]
fn all_reduce_different_length_every_rank_mismatch() {
    expect_mismatch(&["lengths differ", "f32 x 16", "f32 x 8"], |comm| {
        let mut v = vec![0.0f32; if comm.rank() == 0 { 16 } else { 8 }];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)
    });
}

#[test]
fn all_gather_different_dtype_every_rank_mismatch() {
    expect_mismatch(&["dtypes differ", "f32 x 4", "f64 x 4"], |comm| {
        if comm.rank() == 0 {
            comm.all_gather_vec(&[0.0f32; 4]).map(drop)
        } else {
            comm.all_gather_vec(&[0.0f64; 4]).map(drop)
        }
    });
}

#[test]
fn broadcast_different_root_every_rank_mismatch() {
    expect_mismatch(&["roots differ", "root 0", "root 1"], |comm| {
        comm.broadcast_in_place(&mut [0i64; 5], comm.rank())
    });
}

#[test]
fn all_reduce_different_reduce_op_every_rank_mismatch() {
    expect_mismatch(&["reduce ops differ", "sum", "max"], |comm| {
        let op = [ReduceOp::Sum, ReduceOp::Max][comm.rank()];
        comm.all_reduce_in_place(&mut [0.0f64; 4], op)
    });
}

#[test]
fn reduce_scatterv_different_counts_every_rank_mismatch() {
    expect_mismatch(&["counts differ", "[1, 2]", "[2, 1]"], |comm| {
        let counts = [[1, 2], [2, 1]][comm.rank()];
        let mut recv = vec![0.0f32; counts[comm.rank()]];
        comm.reduce_scatterv(
            f32::slice(&[0.0; 3]),
            f32::slice_mut(&mut recv),
            &counts,
            ReduceOp::Sum,
        )
    });
}

#[test]
fn all_to_allv_counts_disagree_every_rank_mismatch() {
    expect_mismatch(
        &["rank 0 sends 2 elements to rank 1, which expects 1"],
        |comm| {
            let (sc, rc) = if comm.rank() == 0 {
                ([1, 2], [1, 1])
            } else {
                ([1, 1], [1, 1])
            };
            let send = vec![0.0f32; sc.iter().sum()];
            let mut recv = vec![0.0f32; 2];
            comm.all_to_allv(f32::slice(&send), &sc, f32::slice_mut(&mut recv), &rc)
        },
    );
}

#[test]
fn all_gather_recv_wrong_size_invalid_argument_and_peer_mismatch() {
    let errs = all_ok(launch_with(2, long(), |comm| {
        let mut recv = vec![0.0f32; if comm.rank() == 0 { 7 } else { 8 }];
        Ok(comm
            .all_gather(f32::slice(&[0.0; 4]), f32::slice_mut(&mut recv))
            .unwrap_err())
    }));
    assert!(
        matches!(&errs[0], Error::InvalidArgument { op: "all_gather", detail } if detail.contains("recv has 7")),
        "{}",
        errs[0]
    );
    assert!(
        matches!(&errs[1], Error::CollectiveMismatch { detail, .. } if detail.contains("rank 0 passed invalid arguments")),
        "{}",
        errs[1]
    );
}

#[test]
fn collective_bad_local_arguments_invalid_argument_naming_op() {
    all_ok(launch_with(2, long(), |comm| {
        let r = comm.rank();
        // Every rank passes bad arguments of its own: each gets InvalidArgument.
        let err = comm.broadcast_in_place(&mut [0.0f32; 2], 2).unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    op: "broadcast",
                    ..
                }
            ),
            "{err}"
        );
        let err = comm
            .all_gather(f32::slice(&[0.0; 2]), f64::slice_mut(&mut [0.0; 4]))
            .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidArgument { op: "all_gather", detail } if detail.contains("f32") && detail.contains("f64")),
            "{err}"
        );
        let err = comm
            .all_gatherv(f32::slice(&[0.0; 2]), f32::slice_mut(&mut [0.0; 2]), &[2])
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    op: "all_gatherv",
                    ..
                }
            ),
            "{err}"
        );
        let err = comm
            .reduce_scatter(
                f32::slice(&[0.0; 3]),
                f32::slice_mut(&mut [0.0; 2]),
                ReduceOp::Sum,
            )
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    op: "reduce_scatter",
                    ..
                }
            ),
            "{err}"
        );
        let err = comm
            .all_to_all(f32::slice(&[0.0; 3]), f32::slice_mut(&mut [0.0; 3]))
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidArgument {
                    op: "all_to_all",
                    ..
                }
            ),
            "{err}"
        );
        let err = comm
            .reduce_scatterv(
                f32::slice(&[0.0; 3]),
                f32::slice_mut(&mut [0.0; 2]),
                &[1, 2],
                ReduceOp::Sum,
            )
            .unwrap_err();
        // Rank 1's recv matches counts[1] = 2; rank 0's does not.
        if r == 0 {
            assert!(
                matches!(
                    err,
                    Error::InvalidArgument {
                        op: "reduce_scatterv",
                        ..
                    }
                ),
                "{err}"
            );
        } else {
            assert!(matches!(err, Error::CollectiveMismatch { .. }), "{err}");
        }
        comm.barrier()?;
        Ok(())
    }));
}

#[test]
fn collective_same_handle_from_two_threads_invalid_argument() {
    all_ok(launch_with(2, long(), |comm| {
        if comm.rank() == 0 {
            std::thread::scope(|s| {
                let first = s.spawn(|| comm.barrier());
                std::thread::sleep(Duration::from_millis(100));
                let err = comm.barrier().unwrap_err();
                assert!(
                    matches!(err, Error::InvalidArgument { op: "barrier", .. }),
                    "{err}"
                );
                comm.send(i32::slice(&[1]), 1, 0)?;
                first.join().expect("barrier thread")
            })
        } else {
            let mut go = [0i32];
            comm.recv(i32::slice_mut(&mut go), 0, 0)?;
            comm.barrier()
        }
    }));
}

// ---------------------------------------------------------------------------------------
// Departures and timeouts
// ---------------------------------------------------------------------------------------

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

// ---------------------------------------------------------------------------------------
// In-place all-gather and reduce-scatter (the threads backend's own, and the trait's
// default through a wrapper that does not override them)
// ---------------------------------------------------------------------------------------

/// Forwards everything to a `ThreadComm` except the in-place calls, so the trait's default
/// implementations run.
struct DefaultsOnly(Arc<dyn Communicator>);

impl Communicator for DefaultsOnly {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn backend(&self) -> &'static str {
        "defaults-only"
    }
    fn all_reduce(&self, buf: SliceMut<'_>, op: ReduceOp) -> Result<(), Error> {
        self.0.all_reduce(buf, op)
    }
    fn all_gather(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<(), Error> {
        self.0.all_gather(send, recv)
    }
    fn all_gatherv(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        counts: &[usize],
    ) -> Result<(), Error> {
        self.0.all_gatherv(send, recv, counts)
    }
    fn reduce_scatter(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.0.reduce_scatter(send, recv, op)
    }
    fn reduce_scatterv(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<(), Error> {
        self.0.reduce_scatterv(send, recv, counts, op)
    }
    fn all_to_all(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<(), Error> {
        self.0.all_to_all(send, recv)
    }
    fn all_to_allv(
        &self,
        send: Slice<'_>,
        sc: &[usize],
        recv: SliceMut<'_>,
        rc: &[usize],
    ) -> Result<(), Error> {
        self.0.all_to_allv(send, sc, recv, rc)
    }
    fn broadcast(&self, buf: SliceMut<'_>, root: usize) -> Result<(), Error> {
        self.0.broadcast(buf, root)
    }
    fn send(&self, buf: Slice<'_>, dst: usize, tag: u32) -> Result<(), Error> {
        self.0.send(buf, dst, tag)
    }
    fn recv(&self, buf: SliceMut<'_>, src: usize, tag: u32) -> Result<(), Error> {
        self.0.recv(buf, src, tag)
    }
    fn barrier(&self) -> Result<(), Error> {
        self.0.barrier()
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>, Error> {
        self.0.split(color, key)
    }
    fn counters(&self) -> CounterSnapshot {
        self.0.counters()
    }
}

fn check_in_place<T: Element>(n: usize, defaults: bool) {
    let counts: Vec<usize> = uneven(n).iter().map(|&c| big(c * 700)).collect();
    let total: usize = counts.iter().sum();
    let offsets: Vec<usize> = (0..n).map(|r| counts[..r].iter().sum()).collect();
    all_ok(launch_with(n, long(), |comm| {
        let comm: Arc<dyn Communicator> = if defaults {
            Arc::new(DefaultsOnly(comm))
        } else {
            comm
        };
        let r = comm.rank();
        // all-gather: the own piece is in place, the rest is garbage to overwrite.
        let mut buf: Vec<T> = vec![T::from_f64(-7.0); total];
        buf[offsets[r]..offsets[r] + counts[r]].copy_from_slice(&vals::<T>(r, counts[r]));
        let before = comm.counters();
        comm.all_gatherv_in_place(T::slice_mut(&mut buf), &counts)?;
        let d = comm.counters().since(&before);
        for p in 0..n {
            assert_eq!(
                &buf[offsets[p]..offsets[p] + counts[p]],
                vals::<T>(p, counts[p]).as_slice(),
                "piece {p}"
            );
        }
        assert_eq!(d.calls(CollectiveKind::AllGather), 1);
        // reduce-scatter: block r of every rank's buffer, reduced into block r of this one.
        let mut buf: Vec<T> = vals::<T>(r, total);
        comm.reduce_scatterv_in_place(T::slice_mut(&mut buf), &counts, ReduceOp::Sum)?;
        let own = &buf[offsets[r]..offsets[r] + counts[r]];
        for (j, got) in own.iter().enumerate() {
            let i = offsets[r] + j;
            let terms: Vec<T> = (0..n).map(|k| val::<T>(k, i)).collect();
            assert_eq!(*got, reduce_ref(&terms, ReduceOp::Sum), "element {i}");
        }
        Ok(())
    }));
}

#[test]
fn in_place_all_gatherv_and_reduce_scatterv_match_reference() {
    for n in ranks() {
        for defaults in [false, true] {
            check_in_place::<f32>(n, defaults);
            check_in_place::<bf16>(n, defaults);
            check_in_place::<i64>(n, defaults);
        }
    }
}

#[test]
fn in_place_buffer_of_wrong_length_invalid_argument_and_peer_mismatch() {
    let results = launch_with(2, long(), |comm| {
        let len = if comm.rank() == 0 { 4 } else { 5 };
        let mut buf = vec![0.0f32; len];
        comm.all_gatherv_in_place(f32::slice_mut(&mut buf), &[2, 2])
    });
    let e0 = results[0].as_ref().unwrap_err().to_string();
    let e1 = results[1].as_ref().unwrap_err().to_string();
    assert!(e0.contains("collective mismatch"), "{e0}");
    assert!(
        e1.contains("buffer has 5 elements but counts sum to 4"),
        "{e1}"
    );
}

// ---------------------------------------------------------------------------------------
// Column-block collectives (a non-leading tensor dim seen as `rows × Σ widths`)
// ---------------------------------------------------------------------------------------

/// Element (row, global column) of rank `p`'s matrix.
fn cell<T: Element>(p: usize, row: usize, col: usize) -> T {
    T::from_f64(((p * 53 + row * 11 + col * 3) % 89) as f64 - 44.0)
}

fn check_columns<T: Element>(n: usize, defaults: bool) {
    // More than one row, or the calls take the plain (non-column) path; 2 under Miri.
    let rows = if cfg!(miri) { 2 } else { 3 };
    let widths: Vec<usize> = uneven(n).iter().map(|&w| w * 2).collect();
    let total: usize = widths.iter().sum();
    let offsets: Vec<usize> = (0..n).map(|p| widths[..p].iter().sum()).collect();
    all_ok(launch_with(n, long(), |comm| {
        let comm: Arc<dyn Communicator> = if defaults {
            Arc::new(DefaultsOnly(comm))
        } else {
            comm
        };
        let me = comm.rank();
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
                    assert_eq!(
                        all[r * total + c],
                        cell::<T>(p, r, c),
                        "gather row {r} col {c}"
                    );
                }
            }
        }
        // reduce_scatter_cols: each rank holds rows × total; rank me gets its columns summed.
        let full: Vec<T> = (0..rows * total)
            .map(|i| cell(me, i / total, i % total))
            .collect();
        let mut out = vec![T::zero(); rows * widths[me]];
        comm.reduce_scatter_cols(
            T::slice(&full),
            T::slice_mut(&mut out),
            rows,
            &widths,
            ReduceOp::Sum,
        )?;
        for r in 0..rows {
            for (j, c) in (offsets[me]..offsets[me] + widths[me]).enumerate() {
                let terms: Vec<T> = (0..n).map(|k| cell(k, r, c)).collect();
                assert_eq!(
                    out[r * widths[me] + j],
                    reduce_ref(&terms, ReduceOp::Sum),
                    "scatter row {r} col {c}"
                );
            }
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
                    assert_eq!(
                        recv[at],
                        cell::<T>(p, r, c),
                        "all_to_all from {p} row {r} col {c}"
                    );
                    at += 1;
                }
            }
        }
        Ok(())
    }));
}

#[test]
fn column_block_collectives_match_reference() {
    for n in ranks() {
        for defaults in [false, true] {
            check_columns::<f32>(n, defaults);
            check_columns::<bf16>(n, defaults);
            check_columns::<i64>(n, defaults);
        }
    }
}

#[test]
fn column_block_rows_disagree_every_rank_mismatch() {
    let results = launch_with(2, long(), |comm| {
        let send = vec![0.0f32; 4];
        let mut recv = vec![0.0f32; 2];
        // Same element counts ([2, 2]) but 2 rows of width 1 against 1 row of width 2.
        let (rows, widths): (usize, &[usize]) = if comm.rank() == 0 {
            (2, &[1, 1])
        } else {
            (1, &[2, 2])
        };
        comm.reduce_scatter_cols(
            f32::slice(&send),
            f32::slice_mut(&mut recv),
            rows,
            widths,
            ReduceOp::Sum,
        )
    });
    for r in &results {
        let e = r.as_ref().unwrap_err().to_string();
        assert!(e.contains("rows of the column blocks differ"), "{e}");
        assert!(e.contains("2 rows"), "{e}");
    }
}

#[test]
fn column_collectives_with_overflowing_widths_are_invalid_on_every_rank() {
    // rows × width wraps usize: before the checked count it wrapped into a "valid" count.
    let huge = usize::MAX / 2 + 1;
    let results = launch_with(2, long(), |comm| -> Result<Vec<String>, Error> {
        let send = [0.0f32; 4];
        let mut recv = [0.0f32; 8];
        let widths = [huge, 2];
        let errs = vec![
            comm.all_gather_cols(Slice::F32(&send), SliceMut::F32(&mut recv), 2, &widths),
            comm.reduce_scatter_cols(
                Slice::F32(&send),
                SliceMut::F32(&mut recv),
                2,
                &widths,
                ReduceOp::Sum,
            ),
            comm.all_to_all_cols(
                Slice::F32(&send),
                2,
                &widths,
                SliceMut::F32(&mut recv),
                &[4, 4],
            ),
        ];
        Ok(errs
            .into_iter()
            .map(|e| format!("{:?}", e.unwrap_err()))
            .collect())
    });
    for errs in all_ok(results) {
        for e in errs {
            assert!(
                e.contains("InvalidArgument") && e.contains("overflow"),
                "{e}"
            );
        }
    }
}

// ---------------------------------------------------------------------------------------
// Asynchronous collectives (`start_*`, `Request`): the blocking calls' results, errors and
// counters; ordering, dropping, mixing with blocking calls; progress while the caller
// computes
// ---------------------------------------------------------------------------------------

/// Every asynchronous call against the blocking call with the same inputs: the same bits,
/// for each size, length and reduce op.
fn check_async_equals_blocking<T: StorageElement>(n: usize) {
    all_ok(launch_with(n, long(), |comm| {
        let r = comm.rank();
        // Under Miri one length and op: the data phases are the blocking calls' (checked
        // above); what is new here is the worker, the owned buffers and the hand-back.
        for len in unless_miri(vec![0, 1, 37, 5000], vec![11]) {
            for op in unless_miri(ops(), vec![ReduceOp::Avg]) {
                // all_reduce
                let mut blocking = vals::<T>(r, len);
                comm.all_reduce_in_place(&mut blocking, op)?;
                let got = comm.start_all_reduce_vec(vals::<T>(r, len), op).wait()?;
                assert_eq!(
                    bits(&got),
                    bits(&blocking),
                    "all_reduce n={n} len={len} {op}"
                );
                // reduce_scatter of n blocks of `len / n + 1`
                let k = len / n + 1;
                let mut blocking = vec![T::zero(); k];
                let send = vals::<T>(r, n * k);
                comm.reduce_scatter(T::slice(&send), T::slice_mut(&mut blocking), op)?;
                let got = comm.start_reduce_scatter_vec(send, op).wait()?;
                assert_eq!(
                    bits(&got),
                    bits(&blocking),
                    "reduce_scatter n={n} k={k} {op}"
                );
                // reduce_scatterv, uneven counts with zeros
                let counts: Vec<usize> = uneven(n).iter().map(|c| c * (len % 7 + 1)).collect();
                let send = vals::<T>(r, counts.iter().sum());
                let mut blocking = vec![T::zero(); counts[r]];
                comm.reduce_scatterv(T::slice(&send), T::slice_mut(&mut blocking), &counts, op)?;
                let recv = Buffer::zeros(T::DTYPE, counts[r]);
                let got = comm
                    .start_reduce_scatterv(Buffer::from(send), recv, &counts, op)
                    .wait()?
                    .into_vec::<T>()
                    .expect("the dtype given");
                assert_eq!(
                    bits(&got),
                    bits(&blocking),
                    "reduce_scatterv {counts:?} {op}"
                );
            }
            // all_gather and all_gatherv
            let send = vals::<T>(r, len);
            let blocking = comm.all_gather_vec(&send)?;
            let got = comm.start_all_gather_vec(send).wait()?;
            assert_eq!(bits(&got), bits(&blocking), "all_gather n={n} len={len}");
            let counts: Vec<usize> = uneven(n).iter().map(|c| c * (len % 5)).collect();
            let send = vals::<T>(r, counts[r]);
            let mut blocking = vec![T::zero(); counts.iter().sum()];
            comm.all_gatherv(T::slice(&send), T::slice_mut(&mut blocking), &counts)?;
            let recv = Buffer::zeros(T::DTYPE, blocking.len());
            let got = comm
                .start_all_gatherv(Buffer::from(send), recv, &counts)
                .wait()?;
            assert_eq!(got, Buffer::from(blocking), "all_gatherv {counts:?}");
        }
        Ok(())
    }));
}

#[test]
fn async_every_size_dtype_op_equals_blocking_bitwise() {
    for n in ranks() {
        each_dtype!(check_async_equals_blocking(n));
    }
}

#[test]
fn async_order_sensitive_sum_is_the_left_to_right_sum_on_every_rank() {
    let len = big(10_001);
    let x = |rank: usize, i: usize| [1.0e16, 1.0, -1.0e16, 0.5][(rank + i) % 4];
    let out = all_ok(launch_with(3, long(), |comm| {
        let buf: Vec<f64> = (0..len).map(|i| x(comm.rank(), i)).collect();
        comm.start_all_reduce_vec(buf, ReduceOp::Sum).wait()
    }));
    let expect: Vec<u64> = (0..len)
        .map(|i| ((x(0, i) + x(1, i)) + x(2, i)).to_bits())
        .collect();
    for buf in &out {
        let b: Vec<u64> = buf.iter().map(|v| v.to_bits()).collect();
        assert!(b == expect, "not the left-to-right sum");
    }
}

#[test]
fn async_several_in_flight_complete_in_start_order_and_wait_in_any_order() {
    all_ok(launch_with(3, long(), |comm| {
        let (r, n) = (comm.rank(), comm.size());
        let len = big(3000);
        let mut reqs: Vec<Request<Vec<f32>>> = (0..6)
            .map(|i| match i % 3 {
                0 => comm.start_all_reduce_vec(vals::<f32>(r + i, len), ReduceOp::Sum),
                1 => comm.start_all_gather_vec(vals::<f32>(r + i, len)),
                _ => comm.start_reduce_scatter_vec(vals::<f32>(r + i, n * len), ReduceOp::Max),
            })
            .collect();
        // The last one first: once it completed, every request started before it has.
        let last = reqs.pop().expect("six requests");
        let last = last.wait()?;
        for req in &mut reqs {
            assert!(req.test(), "{} started earlier is not complete", req.op());
        }
        assert_eq!(comm.counters().collectives(), 6);
        // The rest in a shuffled order.
        let mut reqs: Vec<Option<Request<Vec<f32>>>> = reqs.into_iter().map(Some).collect();
        let mut results: Vec<Vec<f32>> = vec![Vec::new(); 5];
        for i in [2, 0, 4, 1, 3] {
            results[i] = reqs[i].take().expect("once").wait()?;
        }
        results.push(last);
        for (i, got) in results.into_iter().enumerate() {
            let expect: Vec<f32> = match i % 3 {
                0 => (0..len)
                    .map(|j| {
                        reduce_ref(
                            &(0..n).map(|p| val(p + i, j)).collect::<Vec<f32>>(),
                            ReduceOp::Sum,
                        )
                    })
                    .collect(),
                1 => (0..n).flat_map(|p| vals::<f32>(p + i, len)).collect(),
                _ => (r * len..(r + 1) * len)
                    .map(|j| {
                        reduce_ref(
                            &(0..n).map(|p| val(p + i, j)).collect::<Vec<f32>>(),
                            ReduceOp::Max,
                        )
                    })
                    .collect(),
            };
            assert_eq!(bits(&got), bits(&expect), "request {i}");
        }
        Ok(())
    }));
}

#[test]
fn async_waited_out_of_order_across_ranks_still_match() {
    // Rank 0 waits for its requests newest first, rank 1 oldest first: the waits do not
    // take part in the matching, the start order does.
    let out = all_ok(launch_with(2, long(), |comm| {
        let r = comm.rank();
        let reqs: Vec<_> = (0..4)
            .map(|i| comm.start_all_reduce_vec(vec![(r * 10 + i) as i64; 5], ReduceOp::Sum))
            .collect();
        let mut got = vec![Vec::new(); 4];
        let order: Vec<usize> = if r == 0 {
            vec![3, 2, 1, 0]
        } else {
            vec![0, 1, 2, 3]
        };
        let mut reqs: Vec<Option<_>> = reqs.into_iter().map(Some).collect();
        for i in order {
            got[i] = reqs[i].take().expect("once").wait()?;
        }
        Ok(got)
    }));
    for got in out {
        for (i, v) in got.iter().enumerate() {
            assert_eq!(v, &vec![(10 + 2 * i) as i64; 5]);
        }
    }
}

#[test]
fn async_dropped_unwaited_still_runs_and_later_collectives_match() {
    all_ok(launch_with(3, long(), |comm| {
        let r = comm.rank();
        let before = comm.counters();
        // Dropped at once on rank 0, waited elsewhere: the collective runs on every rank.
        let req = comm.start_all_reduce_vec(vec![1.0f32; 64], ReduceOp::Sum);
        if r == 0 {
            drop(req);
            // The drop waited: counted, and nothing of it is pending any more.
            assert_eq!(
                comm.counters()
                    .since(&before)
                    .calls(CollectiveKind::AllReduce),
                1
            );
        } else {
            assert_eq!(req.wait()?, vec![3.0f32; 64]);
        }
        // Dropped on every rank, in the middle of a sequence.
        let a = comm.start_all_gather_vec(vec![r as i32; 2]);
        drop(comm.start_reduce_scatter_vec(vec![1.0f64; 6], ReduceOp::Sum));
        let b = comm.start_all_reduce_vec(vec![2i64; 3], ReduceOp::Sum);
        assert_eq!(a.wait()?, vec![0, 0, 1, 1, 2, 2]);
        assert_eq!(b.wait()?, vec![6i64; 3]);
        // Later blocking calls still pair up.
        let mut v = [1.0f32; 4];
        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        assert_eq!(v, [3.0; 4]);
        let d = comm.counters().since(&before);
        assert_eq!(
            (
                d.calls(CollectiveKind::AllReduce),
                d.calls(CollectiveKind::AllGather),
                d.calls(CollectiveKind::ReduceScatter)
            ),
            (3, 1, 1)
        );
        Ok(())
    }));
}

#[test]
fn async_mixed_with_blocking_blocking_call_waits_for_earlier_requests() {
    all_ok(launch_with(3, long(), |comm| {
        let r = comm.rank();
        // The same sequence on every rank, each rank choosing which calls are blocking:
        // all_reduce, all_gather, reduce_scatter, barrier, all_reduce.
        let blocking = |i: usize| (i + r) % 2 == 0;
        let mut pending: Vec<Request<Vec<f32>>> = Vec::new();
        let mut results: Vec<Vec<f32>> = Vec::new();
        for i in 0..5 {
            if blocking(i) {
                match i {
                    0 | 4 => {
                        let mut v = vec![i as f32; 8];
                        comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
                        results.push(v);
                    }
                    1 => results.push(comm.all_gather_vec(&[r as f32])?),
                    2 => {
                        let mut out = vec![0.0f32; 2];
                        comm.reduce_scatter(
                            f32::slice(&[1.0; 6]),
                            f32::slice_mut(&mut out),
                            ReduceOp::Sum,
                        )?;
                        results.push(out);
                    }
                    _ => {
                        comm.barrier()?;
                        results.push(Vec::new());
                    }
                }
                // The rule: a blocking call first completes every request started before
                // it on this handle.
                for req in &mut pending {
                    assert!(
                        req.test(),
                        "{} before a blocking call not complete",
                        req.op()
                    );
                }
            } else {
                match i {
                    0 | 4 => {
                        pending.push(comm.start_all_reduce_vec(vec![i as f32; 8], ReduceOp::Sum))
                    }
                    1 => pending.push(comm.start_all_gather_vec(vec![r as f32])),
                    2 => {
                        pending.push(comm.start_reduce_scatter_vec(vec![1.0f32; 6], ReduceOp::Sum))
                    }
                    _ => {
                        // No asynchronous barrier: a blocking one in its place.
                        comm.barrier()?;
                        results.push(Vec::new());
                        continue;
                    }
                }
                results.push(Vec::new());
            }
        }
        let mut pending = pending.into_iter();
        for (i, slot) in results.iter_mut().enumerate() {
            if i != 3 && !blocking(i) {
                *slot = pending
                    .next()
                    .expect("one request per asynchronous call")
                    .wait()?;
            }
        }
        assert_eq!(results[0], vec![0.0; 8]);
        assert_eq!(results[1], vec![0.0, 1.0, 2.0]);
        assert_eq!(results[2], vec![3.0; 2]);
        assert_eq!(results[4], vec![12.0; 8]);
        Ok(())
    }));
}

#[test]
fn async_counters_equal_blocking_counted_once_on_completion() {
    use CollectiveKind::*;
    all_ok(launch_with(3, long(), |comm| {
        let r = comm.rank();
        let len = 10;
        let blocking = delta(&comm, || {
            comm.all_reduce_in_place(&mut vec![1.0f32; len], ReduceOp::Sum)?;
            comm.all_gather_vec(&[1.0f64; 4])?;
            let mut out = [0i32; 2];
            comm.reduce_scatter(i32::slice(&[1; 6]), i32::slice_mut(&mut out), ReduceOp::Sum)?;
            let counts = uneven(3);
            let mut out = vec![0.0f32; counts.iter().sum()];
            comm.all_gatherv(
                f32::slice(&vec![0.0; counts[r]]),
                f32::slice_mut(&mut out),
                &counts,
            )
        })?;
        let before = comm.counters();
        let mut reqs = vec![
            comm.start_all_reduce(Buffer::from(vec![1.0f32; len]), ReduceOp::Sum),
            comm.start_all_gather(Buffer::from(vec![1.0f64; 4]), Buffer::zeros(DType::F64, 12)),
            comm.start_reduce_scatter(
                Buffer::from(vec![1i32; 6]),
                Buffer::zeros(DType::I32, 2),
                ReduceOp::Sum,
            ),
        ];
        let counts = uneven(3);
        reqs.push(comm.start_all_gatherv(
            Buffer::zeros(DType::F32, counts[r]),
            Buffer::zeros(DType::F32, counts.iter().sum()),
            &counts,
        ));
        // Counted when complete, before wait: test() until done, then compare.
        let deadline = Instant::now() + Duration::from_secs(60);
        while !reqs.iter_mut().all(|q| q.test()) {
            assert!(Instant::now() < deadline, "requests never completed");
            std::thread::yield_now();
        }
        let completed = comm.counters().since(&before);
        for q in reqs {
            q.wait()?;
        }
        let waited = comm.counters().since(&before);
        assert_eq!(completed, blocking, "async counters differ from blocking");
        assert_eq!(waited, blocking, "wait counted again");
        assert_eq!(
            (
                blocking.calls(AllReduce),
                blocking.calls(AllGather),
                blocking.calls(ReduceScatter)
            ),
            (1, 2, 1)
        );
        Ok(())
    }));
}

#[test]
fn async_overlap_collective_completes_while_caller_computes() {
    // Rank 1 starts its side only once rank 0's start has returned, so rank 0's request
    // cannot have completed inside its start. Rank 0 then computes, polling `test` (which
    // never blocks), and must see the all-reduce complete, counted and all, before it ever
    // calls `wait`: the data moved on another thread while this one computed. No timing
    // threshold: the deadline only turns a broken worker into a failure instead of a hang.
    let len = big(1 << 20);
    let rank0_started = std::sync::atomic::AtomicBool::new(false);
    let out = all_ok(launch_with(2, long(), |comm| {
        let deadline = Instant::now() + Duration::from_secs(60);
        let buf = vec![comm.rank() as f32 + 1.0; len];
        if comm.rank() == 1 {
            while !rank0_started.load(std::sync::atomic::Ordering::Acquire) {
                assert!(Instant::now() < deadline, "rank 0 never started");
                std::thread::yield_now();
            }
            return Ok((0, comm.start_all_reduce_vec(buf, ReduceOp::Sum).wait()?));
        }
        let mut req = comm.start_all_reduce_vec(buf, ReduceOp::Sum);
        assert!(!req.test(), "complete before rank 1 started its side");
        assert_eq!(comm.counters().calls(CollectiveKind::AllReduce), 0);
        rank0_started.store(true, std::sync::atomic::Ordering::Release);
        // Compute: a dependent chain the optimizer cannot drop, in slices between polls.
        let (mut acc, mut slices) = (1.0f64, 0u64);
        while !req.test() {
            assert!(Instant::now() < deadline, "no progress without wait");
            for i in 0..1000 {
                acc = std::hint::black_box(acc * 1.000_000_1 + f64::from(i));
            }
            slices += 1;
        }
        std::hint::black_box(acc);
        // Complete and counted before wait was called.
        assert_eq!(comm.counters().calls(CollectiveKind::AllReduce), 1);
        Ok((slices, req.wait()?))
    }));
    for (_, v) in &out {
        assert!(v.iter().all(|&x| x == 3.0));
    }
    assert!(out[0].0 > 0, "rank 0 computed while the all-reduce ran");
}

#[test]
fn async_mismatch_every_rank_collective_mismatch_from_wait() {
    expect_mismatch(
        &[
            "different collectives",
            "rank 0: all_reduce(f32 x 16, sum)",
            "rank 1: all_gather(f32 x 8 -> 16)",
        ],
        |comm| {
            if comm.rank() == 0 {
                comm.start_all_reduce_vec(vec![0.0f32; 16], ReduceOp::Sum)
                    .wait()
                    .map(drop)
            } else {
                comm.start_all_gather_vec(vec![0.0f32; 8]).wait().map(drop)
            }
        },
    );
    expect_mismatch(&["lengths differ"], |comm| {
        let len = 4 + comm.rank();
        comm.start_all_reduce_vec(vec![0.0f32; len], ReduceOp::Sum)
            .wait()
            .map(drop)
    });
    expect_mismatch(&["dtypes differ"], |comm| {
        if comm.rank() == 0 {
            comm.start_all_gather_vec(vec![0.0f64; 2]).wait().map(drop)
        } else {
            comm.start_all_gather_vec(vec![0.0f32; 2]).wait().map(drop)
        }
    });
    expect_mismatch(&["reduce ops differ"], |comm| {
        let op = if comm.rank() == 0 {
            ReduceOp::Max
        } else {
            ReduceOp::Sum
        };
        comm.start_reduce_scatter_vec(vec![0.0f32; 4], op)
            .wait()
            .map(drop)
    });
    // Blocking on one rank, asynchronous on the other: still matched, still a mismatch.
    expect_mismatch(&["lengths differ"], |comm| {
        if comm.rank() == 0 {
            comm.all_reduce_in_place(&mut [0i64; 3], ReduceOp::Sum)
        } else {
            comm.start_all_reduce_vec(vec![0i64; 5], ReduceOp::Sum)
                .wait()
                .map(drop)
        }
    });
}

#[test]
fn async_invalid_argument_on_one_rank_mismatch_on_its_peers() {
    let results = all_ok(launch_with(2, long(), |comm| {
        // Rank 1's recv is the wrong size.
        let recv = Buffer::zeros(DType::F32, if comm.rank() == 1 { 5 } else { 4 });
        let e = comm
            .start_all_gather(Buffer::from(vec![0.0f32; 2]), recv)
            .wait()
            .expect_err("invalid on rank 1");
        // A matching request still works afterwards.
        assert_eq!(
            comm.start_all_reduce_vec(vec![1i32], ReduceOp::Sum)
                .wait()?,
            vec![2]
        );
        Ok(e)
    }));
    assert!(
        matches!(&results[0], Error::CollectiveMismatch { detail, .. } if detail.contains("rank 1 passed invalid arguments")),
        "{}",
        results[0]
    );
    assert!(
        matches!(
            &results[1],
            Error::InvalidArgument {
                op: "all_gather",
                ..
            }
        ),
        "{}",
        results[1]
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

#[test]
fn async_start_while_another_thread_blocks_on_the_handle_invalid_argument() {
    all_ok(launch_with(2, long(), |comm| {
        if comm.rank() == 0 {
            std::thread::scope(|s| {
                let first = s.spawn(|| comm.barrier());
                std::thread::sleep(Duration::from_millis(100));
                let err = comm
                    .start_all_reduce_vec(vec![1.0f32], ReduceOp::Sum)
                    .wait()
                    .unwrap_err();
                assert!(
                    matches!(
                        err,
                        Error::InvalidArgument {
                            op: "all_reduce",
                            ..
                        }
                    ),
                    "{err}"
                );
                comm.send(i32::slice(&[1]), 1, 0)?;
                first.join().expect("barrier thread")
            })
        } else {
            let mut go = [0i32];
            comm.recv(i32::slice_mut(&mut go), 0, 0)?;
            comm.barrier()
        }
    }));
}

#[test]
fn async_on_split_groups_and_after_dropping_the_handle() {
    all_ok(launch_with(4, long(), |comm| {
        let r = comm.rank();
        let row = comm.split(r / 2, r)?;
        let a = row.start_all_reduce_vec(vec![r as i32; 3], ReduceOp::Sum);
        let b = comm.start_all_reduce_vec(vec![1i32; 3], ReduceOp::Sum);
        // Dropping the handle lets its worker finish what was started: `a` still completes.
        drop(row);
        let want = if r < 2 { 1 } else { 5 };
        assert_eq!(a.wait()?, vec![want; 3]);
        assert_eq!(b.wait()?, vec![4; 3]);
        Ok(())
    }));
}

#[test]
fn async_default_stand_in_runs_at_start_with_the_same_results() {
    all_ok(launch_with(3, long(), |comm| {
        let r = comm.rank();
        let wrapped = DefaultsOnly(comm.clone());
        let mut a = wrapped.start_all_reduce_vec(vals::<bf16>(r, big(700)), ReduceOp::Avg);
        // The stand-in ran the blocking call at start: already complete.
        assert!(a.test());
        let blocking = {
            let mut v = vals::<bf16>(r, big(700));
            comm.all_reduce_in_place(&mut v, ReduceOp::Avg)?;
            v
        };
        assert_eq!(bits(&a.wait()?), bits(&blocking));
        assert_eq!(
            wrapped.start_all_gather_vec(vec![r as i64]).wait()?,
            vec![0, 1, 2]
        );
        assert_eq!(
            wrapped
                .start_reduce_scatter_vec(vec![1.0f32; 6], ReduceOp::Sum)
                .wait()?,
            vec![3.0; 2]
        );
        let counts = [1, 0, 2];
        let got = wrapped
            .start_all_gatherv(
                Buffer::from(vec![r as i32; counts[r]]),
                Buffer::zeros(DType::I32, 3),
                &counts,
            )
            .wait()?;
        assert_eq!(got, Buffer::from(vec![0i32, 2, 2]));
        let got = wrapped
            .start_reduce_scatterv(
                Buffer::from(vec![1i32; 3]),
                Buffer::zeros(DType::I32, counts[r]),
                &counts,
                ReduceOp::Sum,
            )
            .wait()?;
        assert_eq!(got.len(), counts[r]);
        // Mismatch through the stand-in: every rank, from wait.
        let e = wrapped
            .start_all_reduce_vec(vec![0.0f32; 1 + r], ReduceOp::Sum)
            .wait()
            .unwrap_err();
        assert!(matches!(e, Error::CollectiveMismatch { .. }), "{e}");
        Ok(())
    }));
}
