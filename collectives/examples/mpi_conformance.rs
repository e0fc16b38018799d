//! The conformance suite of the threads backend (`tests/threads.rs`), in essence, against
//! the MPI backend: every collective and dtype against slow references, uneven counts with
//! zeros, bitwise-identical order-sensitive all-reduce (and bitwise equal to the threads
//! backend), in-place variants, send / recv, split into sub-groups, counters, and
//! mismatches failing on every rank; and the asynchronous collectives (`start_*`): equal
//! to the blocking ones bit for bit, several in flight, waits in any order, dropped
//! unwaited, mixed with blocking calls, counted alike, mismatches from `wait`, and
//! progress while the caller computes.
//!
//! Run under MPI (built with `--features mpi`):
//!
//! ```text
//! mpirun --oversubscribe -np 4 target/debug/examples/mpi_conformance
//! ```
//!
//! Rank 0 prints one line per case and a final `N passed, M failed`; the exit code is 1 if
//! any case failed on any rank. Every case runs on the world and again on two halves of it
//! (a split), so group sizes 1..=n are covered.

use dtensor_collectives::{
    mpi, threads, Buffer, CollectiveKind, Communicator, CommunicatorExt, CounterSnapshot, DType,
    Element, Error, ReduceOp, Request, StorageElement,
};
use dtensor_kernels::half::{bf16, f16};
use std::fmt::Debug;
use std::sync::Arc;

type Comm = Arc<dyn Communicator>;

const OPS: [ReduceOp; 4] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min];

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

/// Uneven counts with zeros: `[3, 0, 5, 1]` cut to `n`.
fn uneven(n: usize) -> Vec<usize> {
    (0..n).map(|r| [3, 0, 5, 1][r % 4]).collect()
}

fn a2a<T: Element>(p: usize, q: usize, j: usize) -> T {
    val(p * 8 + q, j)
}

/// What went wrong on this rank in one case (the case goes on: its peers still make the
/// same calls in the same order).
#[derive(Default)]
struct Fails(Vec<String>);

impl Fails {
    fn eq<T: Debug + PartialEq>(&mut self, got: &T, want: &T, what: impl FnOnce() -> String) {
        if got != want {
            let mut g = format!("{got:?}");
            let mut w = format!("{want:?}");
            g.truncate(300);
            w.truncate(300);
            self.0.push(format!("{}: got {g}, want {w}", what()));
        }
    }
    fn check(&mut self, ok: bool, what: impl FnOnce() -> String) {
        if !ok {
            self.0.push(what());
        }
    }
}

type Case = fn(&Comm, &mut Fails) -> Result<(), Error>;

macro_rules! each_dtype {
    ($f:ident($($arg:expr),*)) => {{
        $f::<f32>($($arg),*)?;
        $f::<f64>($($arg),*)?;
        $f::<bf16>($($arg),*)?;
        $f::<f16>($($arg),*)?;
        $f::<i32>($($arg),*)?;
        $f::<i64>($($arg),*)?;
    }};
}

fn bits<T: Element>(v: &[T]) -> String {
    format!("{v:?}")
}

// ---------------------------------------------------------------------------------------
// Data movement against references
// ---------------------------------------------------------------------------------------

fn all_reduce_t<T: Element>(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for len in [0, 1, 5, 37, 5000] {
        for op in OPS {
            let mut buf = vals::<T>(r, len);
            comm.all_reduce_in_place(&mut buf, op)?;
            let expect: Vec<T> = (0..len)
                .map(|i| reduce_ref(&(0..n).map(|p| val(p, i)).collect::<Vec<T>>(), op))
                .collect();
            f.eq(&bits(&buf), &bits(&expect), || {
                format!("{} n={n} len={len} op={op}", T::DTYPE)
            });
        }
    }
    Ok(())
}

fn all_reduce_every_dtype_op_matches_reference(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    each_dtype!(all_reduce_t(comm, f));
    Ok(())
}

fn all_reduce_order_sensitive_sum_bitwise_identical_and_equal_to_threads(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    // (1e16 + 1) - 1e16 == 0 but 1e16 + (1 - 1e16) == 1: only one order gives the reference.
    let (r, n) = (comm.rank(), comm.size());
    let len = 10_001;
    let x = |rank: usize, i: usize| [1.0e16, 1.0, -1.0e16, 0.5][(rank + i) % 4];
    let mut buf: Vec<f64> = (0..len).map(|i| x(r, i)).collect();
    comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
    let expect: Vec<f64> = (0..len)
        .map(|i| (1..n).fold(x(0, i), |a, p| a + x(p, i)))
        .collect();
    let b: Vec<u64> = buf.iter().map(|v| v.to_bits()).collect();
    let e: Vec<u64> = expect.iter().map(|v| v.to_bits()).collect();
    f.check(b == e, || "not the left-to-right sum".into());
    // Every rank holds the same bits: gather rank 0's hash of them.
    let h = b.iter().fold(0u64, |a, &v| a.rotate_left(5) ^ v) as i64;
    let all = comm.all_gather_vec(&[h])?;
    f.check(all.iter().all(|&v| v == all[0]), || {
        format!("replicas differ: {all:?}")
    });
    // The threads backend, same ranks and values, gives the same bits (bf16 too).
    let th = threads::launch(n, |c| {
        let mut v: Vec<f64> = (0..len).map(|i| x(c.rank(), i)).collect();
        c.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        let mut w: Vec<bf16> = vals(c.rank(), 3001);
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
    let mut w: Vec<bf16> = vals(r, 3001);
    comm.all_reduce_in_place(&mut w, ReduceOp::Avg)?;
    f.eq(&bits(&w), &bits(&tw), || {
        "bf16 avg differs from the threads backend".into()
    });
    Ok(())
}

fn all_gather_t<T: Element>(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for k in [0, 1, 7, 3000] {
        let send = vals::<T>(r, k);
        let mut recv = vec![T::zero(); n * k];
        comm.all_gather(T::slice(&send), T::slice_mut(&mut recv))?;
        let expect: Vec<T> = (0..n).flat_map(|p| vals::<T>(p, k)).collect();
        f.eq(&bits(&recv), &bits(&expect), || {
            format!("{} n={n} k={k}", T::DTYPE)
        });
        f.eq(&bits(&comm.all_gather_vec(&send)?), &bits(&expect), || {
            "all_gather_vec".into()
        });
    }
    Ok(())
}

fn all_gather_every_dtype_matches_reference(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    each_dtype!(all_gather_t(comm, f));
    Ok(())
}

fn all_gatherv_t<T: Element>(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for counts in [uneven(n), vec![0; n]] {
        let send = vals::<T>(r, counts[r]);
        let mut recv = vec![T::zero(); counts.iter().sum()];
        comm.all_gatherv(T::slice(&send), T::slice_mut(&mut recv), &counts)?;
        let expect: Vec<T> = (0..n).flat_map(|p| vals::<T>(p, counts[p])).collect();
        f.eq(&bits(&recv), &bits(&expect), || {
            format!("{} counts={counts:?}", T::DTYPE)
        });
    }
    Ok(())
}

fn all_gatherv_uneven_counts_with_zeros_matches_reference(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    each_dtype!(all_gatherv_t(comm, f));
    Ok(())
}

fn reduce_scatter_t<T: Element>(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for k in [0, 1, 9, 2100] {
        for op in OPS {
            let send = vals::<T>(r, n * k);
            let mut recv = vec![T::zero(); k];
            comm.reduce_scatter(T::slice(&send), T::slice_mut(&mut recv), op)?;
            let expect: Vec<T> = (r * k..(r + 1) * k)
                .map(|i| reduce_ref(&(0..n).map(|p| val(p, i)).collect::<Vec<T>>(), op))
                .collect();
            f.eq(&bits(&recv), &bits(&expect), || {
                format!("{} k={k} op={op}", T::DTYPE)
            });
        }
    }
    Ok(())
}

fn reduce_scatter_every_dtype_op_matches_reference(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    each_dtype!(reduce_scatter_t(comm, f));
    Ok(())
}

fn reduce_scatterv_t<T: Element>(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for counts in [uneven(n), vec![0; n]] {
        for op in OPS {
            let total: usize = counts.iter().sum();
            let off: usize = counts[..r].iter().sum();
            let send = vals::<T>(r, total);
            let mut recv = vec![T::zero(); counts[r]];
            comm.reduce_scatterv(T::slice(&send), T::slice_mut(&mut recv), &counts, op)?;
            let expect: Vec<T> = (off..off + counts[r])
                .map(|i| reduce_ref(&(0..n).map(|p| val(p, i)).collect::<Vec<T>>(), op))
                .collect();
            f.eq(&bits(&recv), &bits(&expect), || {
                format!("{} counts={counts:?} op={op}", T::DTYPE)
            });
        }
    }
    Ok(())
}

fn reduce_scatterv_uneven_counts_with_zeros_matches_reference(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    each_dtype!(reduce_scatterv_t(comm, f));
    Ok(())
}

fn all_to_all_t<T: Element>(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
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
            format!("{} k={k}", T::DTYPE)
        });
    }
    Ok(())
}

fn all_to_all_every_dtype_matches_reference(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    each_dtype!(all_to_all_t(comm, f));
    Ok(())
}

fn all_to_allv_t<T: Element>(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
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
    f.eq(&bits(&recv), &bits(&expect), || format!("{}", T::DTYPE));
    Ok(())
}

fn all_to_allv_uneven_counts_with_zeros_matches_reference(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    each_dtype!(all_to_allv_t(comm, f));
    Ok(())
}

fn broadcast_t<T: Element>(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for root in 0..n {
        for len in [0, 1, 33] {
            let mut buf = vals::<T>(r, len);
            comm.broadcast_in_place(&mut buf, root)?;
            f.eq(&bits(&buf), &bits(&vals::<T>(root, len)), || {
                format!("{} root={root} len={len}", T::DTYPE)
            });
        }
    }
    Ok(())
}

fn broadcast_every_dtype_root_matches_root(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    each_dtype!(broadcast_t(comm, f));
    Ok(())
}

fn in_place_t<T: Element>(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    let counts: Vec<usize> = uneven(n).iter().map(|&c| c * 700).collect();
    let total: usize = counts.iter().sum();
    let offsets: Vec<usize> = (0..n).map(|p| counts[..p].iter().sum()).collect();
    let mut buf: Vec<T> = vec![T::from_f64(-7.0); total];
    buf[offsets[r]..offsets[r] + counts[r]].copy_from_slice(&vals::<T>(r, counts[r]));
    comm.all_gatherv_in_place(T::slice_mut(&mut buf), &counts)?;
    let expect: Vec<T> = (0..n).flat_map(|p| vals::<T>(p, counts[p])).collect();
    f.eq(&bits(&buf), &bits(&expect), || {
        format!("{} all_gatherv_in_place", T::DTYPE)
    });
    for op in OPS {
        let mut buf: Vec<T> = vals::<T>(r, total);
        comm.reduce_scatterv_in_place(T::slice_mut(&mut buf), &counts, op)?;
        let expect: Vec<T> = (offsets[r]..offsets[r] + counts[r])
            .map(|i| reduce_ref(&(0..n).map(|k| val(k, i)).collect::<Vec<T>>(), op))
            .collect();
        f.eq(
            &bits(&buf[offsets[r]..offsets[r] + counts[r]]),
            &bits(&expect),
            || format!("{} reduce_scatterv_in_place {op}", T::DTYPE),
        );
    }
    Ok(())
}

fn in_place_all_gatherv_and_reduce_scatterv_match_reference(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    each_dtype!(in_place_t(comm, f));
    Ok(())
}

fn barrier_repeated_all_ranks_pass(comm: &Comm, _f: &mut Fails) -> Result<(), Error> {
    for _ in 0..20 {
        comm.barrier()?;
    }
    Ok(())
}

fn send_recv_ring_large_symmetric_fifo_and_mismatch_stays_queued(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    // Everyone sends before anyone receives: large messages (past MPI's eager limit) must
    // not deadlock, since `send` never waits for its receiver.
    let big: Vec<f32> = vals(r, 1 << 20);
    comm.send(f32::slice(&big), next, 7)?;
    let mut got = vec![0.0f32; 1 << 20];
    comm.recv(f32::slice_mut(&mut got), prev, 7)?;
    f.check(got == vals::<f32>(prev, 1 << 20), || "ring payload".into());
    // FIFO per (src, tag), tags kept apart.
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
    // A recv of the wrong length or dtype fails and leaves the message queued.
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
    f.eq(&right, &[1.5, 2.5], || "queued message".into());
    // Out of range peers are this rank's own error.
    let e = comm.send(f32::slice(&[1.0]), n, 0);
    f.check(matches!(e, Err(Error::InvalidArgument { .. })), || {
        format!("send out of range: {e:?}")
    });
    comm.barrier()
}

/// Many threads `send` on one handle to the same (dst, tag) while this thread receives:
/// every `recv` must return exactly one whole message. A send that travels as two MPI
/// messages (a header, then the payload) can interleave with another thread's pair, and
/// then `recv` returns a header as data or reads a payload as a header. Each message is
/// `[thread, seq, thread ^ 0x55, !seq]` as i32, so a header (`[1, 0, 4, 0]` for 4 x i32)
/// or a mixed-up message fails the check, and `seq` must grow per thread (MPI keeps one
/// thread's sends to one (dst, tag) in order).
fn send_from_many_threads_each_recv_gets_one_whole_message(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    // 8 x 2500 per rank and case: while a send was two MPI messages, this failed on every
    // run at -np 2 (a payload read as a head: "attempt to multiply with overflow"). Fewer
    // threads or messages make the interleaving rarer.
    const THREADS: usize = 8;
    const PER_THREAD: usize = 2500;
    let (r, n) = (comm.rank(), comm.size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let mut next_seq = [0i32; THREADS];
    let (mut bad, mut errors, mut first_bad) = (0usize, 0usize, None);
    let sent: Vec<Result<(), Error>> = std::thread::scope(|s| {
        let senders: Vec<_> = (0..THREADS)
            .map(|t| {
                let comm = comm.clone();
                s.spawn(move || -> Result<(), Error> {
                    for i in 0..PER_THREAD as i32 {
                        let t = t as i32;
                        comm.send(i32::slice(&[t, i, t ^ 0x55, !i]), next, 11)?;
                    }
                    Ok(())
                })
            })
            .collect();
        for k in 0..THREADS * PER_THREAD {
            let mut m = [0i32; 4];
            match comm.recv(i32::slice_mut(&mut m), prev, 11) {
                Ok(()) => {
                    let [t, i, x, y] = m;
                    let whole = (0..THREADS as i32).contains(&t) && x == t ^ 0x55 && y == !i;
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
        f.check(false, || format!("a sender thread failed: {e}"));
    }
    f.check(bad == 0 && errors == 0, || {
        format!(
            "{} messages: {bad} Ok with wrong data, {errors} errors; first: {}",
            THREADS * PER_THREAD,
            first_bad.unwrap_or_default()
        )
    });
    comm.barrier()
}

fn split_rows_columns_and_keys_order_new_ranks(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    // Reverse keys: new rank = n-1-r within one group.
    let rev = comm.split(0, n - 1 - r)?;
    f.eq(&rev.rank(), &(n - 1 - r), || "reversed key rank".into());
    let got = rev.all_gather_vec(&[r as i64])?;
    let want: Vec<i64> = (0..n).rev().map(|p| p as i64).collect();
    f.eq(&got, &want, || "reversed group order".into());
    // Ties keep the parent order.
    let tie = comm.split(0, 0)?;
    f.eq(&tie.rank(), &r, || "tied keys".into());
    if n % 2 == 0 && n >= 2 {
        // A 2 x (n/2) mesh: rows and columns, used one after the other.
        let cols = n / 2;
        let row = comm.split(r / cols, r % cols)?;
        let col = comm.split(r % cols, r / cols)?;
        let mut v = vec![r as f32; 4];
        row.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        let base = (r / cols) * cols;
        let want = (base..base + cols).map(|p| p as f32).sum::<f32>();
        f.eq(&v, &vec![want; 4], || "row sum".into());
        let got = col.all_gather_vec(&[r as i32])?;
        let want: Vec<i32> = (0..2).map(|i| (i * cols + r % cols) as i32).collect();
        f.eq(&got, &want, || "column gather".into());
        // A sub-group's mismatch names its world ranks.
        let e = if row.rank() == 0 {
            row.all_reduce_in_place(&mut [0.0f32; 2], ReduceOp::Sum)
        } else {
            row.barrier()
        };
        if cols > 1 {
            let ok = matches!(&e, Err(Error::CollectiveMismatch { .. }));
            f.check(ok, || format!("sub-group mismatch: {e:?}"));
            if r >= cols {
                let msg = e.as_ref().err().map(|e| e.to_string()).unwrap_or_default();
                f.check(msg.contains("world ranks"), || msg.clone());
            }
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Counters
// ---------------------------------------------------------------------------------------

fn delta(comm: &Comm, g: impl FnOnce() -> Result<(), Error>) -> Result<CounterSnapshot, Error> {
    let before = comm.counters();
    g()?;
    Ok(comm.counters().since(&before))
}

fn counters_every_collective_match_table(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    use CollectiveKind::*;
    let (r, n) = (comm.rank(), comm.size());
    let peers = (n - 1) as u64;
    let b = |elems: usize| (elems * 4) as u64;
    let mut expect = |what: &str, d: CounterSnapshot, kind, sent: u64, received: u64| {
        f.eq(&d.calls(kind), &1, || format!("{what}: calls {d}"));
        f.eq(&(d.bytes_sent, d.bytes_received), &(sent, received), || {
            format!("{what}: bytes")
        });
    };
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
    let d = delta(comm, || comm.broadcast_in_place(&mut bc, n - 1))?;
    let (s, rcv) = if r == n - 1 {
        (b(7) * peers, 0)
    } else {
        (0, b(7))
    };
    expect("broadcast", d, Broadcast, s, rcv);
    let d = delta(comm, || comm.barrier())?;
    expect("barrier", d, Barrier, 0, 0);
    if n > 1 {
        let d = delta(comm, || comm.send(f32::slice(&[1.0; 3]), (r + 1) % n, 9))?;
        expect("send", d, Send, b(3), 0);
        let mut m = [0.0f32; 3];
        let d = delta(comm, || {
            comm.recv(f32::slice_mut(&mut m), (r + n - 1) % n, 9)
        })?;
        expect("recv", d, Recv, 0, b(3));
    }
    let before = comm.counters();
    let sub = comm.split(0, r)?;
    expect("split", comm.counters().since(&before), Split, 0, 0);
    f.eq(&sub.counters(), &CounterSnapshot::default(), || {
        "a new handle starts from zero".into()
    });
    // A failed collective records nothing.
    let before = comm.counters();
    let mut v = vec![0.0f32; 4 + r];
    let e = comm.all_reduce_in_place(&mut v, ReduceOp::Sum);
    if n > 1 {
        f.check(e.is_err(), || "different lengths must fail".into());
        f.eq(&comm.counters(), &before, || "failed call counted".into());
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Mismatches: every rank fails, the group stays usable
// ---------------------------------------------------------------------------------------

/// Runs `g`, expects `CollectiveMismatch` containing each needle on every rank but those
/// `g` makes fail with `InvalidArgument` (given by `invalid_on`), then checks a matching
/// all_reduce still works.
fn expect_mismatch(
    comm: &Comm,
    f: &mut Fails,
    what: &str,
    needles: &[&str],
    invalid_on: Option<usize>,
    g: impl FnOnce() -> Result<(), Error>,
) -> Result<(), Error> {
    let e = g();
    match (&e, invalid_on == Some(comm.rank())) {
        (Err(Error::InvalidArgument { .. }), true) => {}
        (
            Err(Error::CollectiveMismatch {
                detail, backend, ..
            }),
            false,
        ) => {
            f.eq(backend, &"mpi", || format!("{what}: backend"));
            for needle in needles {
                f.check(detail.contains(needle), || {
                    format!("{what}: {detail:?} lacks {needle:?}")
                });
            }
        }
        _ => f.0.push(format!("{what}: unexpected {e:?}")),
    }
    let mut v = vec![1i32; 3];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    f.eq(&v, &vec![comm.size() as i32; 3], || {
        format!("{what}: group unusable after")
    });
    Ok(())
}

fn mismatch_every_kind_every_rank_errs_and_group_stays_usable(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    if n < 2 {
        return Ok(());
    }
    expect_mismatch(
        comm,
        f,
        "different op",
        &["ranks called different collectives", "rank 0: all_reduce"],
        None,
        || {
            if r == 0 {
                comm.all_reduce_in_place(&mut [0.0f32; 16], ReduceOp::Sum)
            } else {
                comm.all_gather_vec(&[0.0f32; 8]).map(drop)
            }
        },
    )?;
    expect_mismatch(comm, f, "lengths", &["lengths differ"], None, || {
        comm.all_reduce_in_place(&mut vec![0.0f32; 4 + r], ReduceOp::Sum)
    })?;
    expect_mismatch(comm, f, "dtypes", &["dtypes differ"], None, || {
        if r == 0 {
            comm.all_gather_vec(&[0.0f64; 2]).map(drop)
        } else {
            comm.all_gather_vec(&[0.0f32; 2]).map(drop)
        }
    })?;
    expect_mismatch(comm, f, "roots", &["roots differ"], None, || {
        comm.broadcast_in_place(&mut [0i64; 3], r.min(1))
    })?;
    expect_mismatch(comm, f, "reduce ops", &["reduce ops differ"], None, || {
        let op = if r == 0 { ReduceOp::Max } else { ReduceOp::Sum };
        comm.all_reduce_in_place(&mut [0.0f32; 3], op)
    })?;
    expect_mismatch(comm, f, "counts", &["counts differ"], None, || {
        let mut counts = vec![1; n];
        if r == 0 {
            counts[0] = 2;
        }
        let total = counts.iter().sum();
        let mut out = vec![0.0f32; counts[r]];
        comm.reduce_scatterv(
            f32::slice(&vec![0.0; total]),
            f32::slice_mut(&mut out),
            &counts,
            ReduceOp::Sum,
        )
    })?;
    expect_mismatch(comm, f, "all_to_allv pairs", &["pair up"], None, || {
        // Rank 0 expects 2 elements from rank 1, which sends it 1.
        let sc = vec![1; n];
        let mut rc = vec![1; n];
        if r == 0 {
            rc[1] = 2;
        }
        let send = vec![0i32; n];
        let mut recv = vec![0i32; rc.iter().sum()];
        comm.all_to_allv(i32::slice(&send), &sc, i32::slice_mut(&mut recv), &rc)
    })?;
    expect_mismatch(
        comm,
        f,
        "invalid argument",
        &["rank 1 passed invalid arguments", "recv has 5 elements"],
        Some(1),
        || {
            // Rank 1's recv is the wrong size: it gets InvalidArgument, its peers a mismatch.
            let k = if r == 1 { 5 } else { 2 * n };
            let mut recv = vec![0.0f32; k];
            comm.all_gather(f32::slice(&[0.0, 0.0]), f32::slice_mut(&mut recv))
        },
    )?;
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Asynchronous collectives
// ---------------------------------------------------------------------------------------

fn async_t<T: StorageElement>(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    for len in [0, 1, 37, 5000] {
        for op in OPS {
            let what = |c: &str| format!("{} {c} n={n} len={len} op={op}", T::DTYPE);
            let mut blocking = vals::<T>(r, len);
            comm.all_reduce_in_place(&mut blocking, op)?;
            let got = comm.start_all_reduce_vec(vals::<T>(r, len), op).wait()?;
            f.eq(&bits(&got), &bits(&blocking), || what("all_reduce"));
            let k = len / n + 1;
            let send = vals::<T>(r, n * k);
            let mut blocking = vec![T::zero(); k];
            comm.reduce_scatter(T::slice(&send), T::slice_mut(&mut blocking), op)?;
            let got = comm.start_reduce_scatter_vec(send, op).wait()?;
            f.eq(&bits(&got), &bits(&blocking), || what("reduce_scatter"));
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
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    each_dtype!(async_t(comm, f));
    Ok(())
}

fn async_in_flight_any_wait_order_dropped_and_mixed_with_blocking(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    let len = 3000;
    let sum_of = |i: usize, j: usize| (0..n).map(|p| val::<f32>(p + i, j)).collect::<Vec<_>>();
    // Six in flight; the last waited first: every earlier one has completed by then.
    let mut reqs: Vec<Option<Request<Vec<f32>>>> = (0..6)
        .map(|i| {
            Some(match i % 3 {
                0 => comm.start_all_reduce_vec(vals::<f32>(r + i, len), ReduceOp::Sum),
                1 => comm.start_all_gather_vec(vals::<f32>(r + i, len)),
                _ => comm.start_reduce_scatter_vec(vals::<f32>(r + i, n * len), ReduceOp::Max),
            })
        })
        .collect();
    let mut results = vec![Vec::new(); 6];
    results[5] = reqs[5].take().expect("once").wait()?;
    for req in reqs.iter_mut().flatten() {
        f.check(req.test(), || {
            format!(
                "{} started before a completed one is not complete",
                req.op()
            )
        });
    }
    for i in [2, 0, 4, 1, 3] {
        results[i] = reqs[i].take().expect("once").wait()?;
    }
    for (i, got) in results.iter().enumerate() {
        let expect: Vec<f32> = match i % 3 {
            0 => (0..len)
                .map(|j| reduce_ref(&sum_of(i, j), ReduceOp::Sum))
                .collect(),
            1 => (0..n).flat_map(|p| vals::<f32>(p + i, len)).collect(),
            _ => (r * len..(r + 1) * len)
                .map(|j| reduce_ref(&sum_of(i, j), ReduceOp::Max))
                .collect(),
        };
        f.eq(&bits(got), &bits(&expect), || format!("request {i}"));
    }
    // Dropped unwaited (on rank 0 only, then on every rank): the collective still runs
    // and later calls still pair up.
    let before = comm.counters();
    let a = comm.start_all_reduce_vec(vec![1i64; 4], ReduceOp::Sum);
    if r == 0 {
        drop(a);
        f.eq(
            &comm
                .counters()
                .since(&before)
                .calls(CollectiveKind::AllReduce),
            &1,
            || "a dropped request was not complete after its drop".into(),
        );
    } else {
        f.eq(&a.wait()?, &vec![n as i64; 4], || {
            "beside a dropped request".into()
        });
    }
    drop(comm.start_all_gather_vec(vec![r as i32; 3]));
    // Mixed: rank r alternates blocking and asynchronous calls in its own pattern; a
    // blocking call first completes the requests started before it.
    let blocking = |i: usize| (i + r) % 2 == 0;
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
    let mut v = [1.0f32; 3];
    comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
    f.eq(&v, &[n as f32; 3], || "group unusable after drops".into());
    Ok(())
}

fn async_counters_equal_blocking(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    let counts = uneven(n);
    let blocking = delta(comm, || {
        comm.all_reduce_in_place(&mut [1.0f32; 10], ReduceOp::Sum)?;
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
    let asynchronous = delta(comm, || {
        let reqs = [
            comm.start_all_reduce(Buffer::from(vec![1.0f32; 10]), ReduceOp::Sum),
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
        for q in reqs {
            q.wait()?;
        }
        Ok(())
    })?;
    f.eq(&asynchronous, &blocking, || {
        "async counters differ from blocking".into()
    });
    Ok(())
}

fn async_mismatch_every_rank_from_wait_and_group_stays_usable(
    comm: &Comm,
    f: &mut Fails,
) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    if n < 2 {
        return Ok(());
    }
    expect_mismatch(
        comm,
        f,
        "async different op",
        &["ranks called different collectives", "rank 0: all_reduce"],
        None,
        || {
            if r == 0 {
                comm.start_all_reduce_vec(vec![0.0f32; 16], ReduceOp::Sum)
                    .wait()
                    .map(drop)
            } else {
                comm.start_all_gather_vec(vec![0.0f32; 8]).wait().map(drop)
            }
        },
    )?;
    expect_mismatch(comm, f, "async lengths", &["lengths differ"], None, || {
        comm.start_all_reduce_vec(vec![0.0f32; 4 + r], ReduceOp::Sum)
            .wait()
            .map(drop)
    })?;
    expect_mismatch(comm, f, "async dtypes", &["dtypes differ"], None, || {
        if r == 0 {
            comm.start_all_gather_vec(vec![0.0f64; 2]).wait().map(drop)
        } else {
            comm.start_all_gather_vec(vec![0.0f32; 2]).wait().map(drop)
        }
    })?;
    expect_mismatch(
        comm,
        f,
        "async reduce ops",
        &["reduce ops differ"],
        None,
        || {
            let op = if r == 0 { ReduceOp::Max } else { ReduceOp::Sum };
            comm.start_reduce_scatter_vec(vec![0.0f32; 2 * n], op)
                .wait()
                .map(drop)
        },
    )?;
    expect_mismatch(
        comm,
        f,
        "async vs blocking lengths",
        &["lengths differ"],
        None,
        || {
            if r == 0 {
                comm.all_reduce_in_place(&mut [0i64; 3], ReduceOp::Sum)
            } else {
                comm.start_all_reduce_vec(vec![0i64; 5], ReduceOp::Sum)
                    .wait()
                    .map(drop)
            }
        },
    )?;
    expect_mismatch(
        comm,
        f,
        "async invalid argument",
        &["rank 1 passed invalid arguments"],
        Some(1),
        || {
            let k = if r == 1 { 5 } else { 2 * n };
            comm.start_all_gather(Buffer::from(vec![0.0f32; 2]), Buffer::zeros(DType::F32, k))
                .wait()
                .map(drop)
        },
    )?;
    Ok(())
}

/// Rank 0 starts a large all-reduce and tells its peers (by `send`, which does not wait for
/// requests); they start their side only then, so rank 0's request cannot complete inside
/// its `start`. Rank 0 then computes, polling `test` (which never blocks), and must see the
/// request complete and counted before it calls `wait`: the progress thread moved the
/// data while rank 0 computed. The deadline only turns a stall into a failure.
fn async_overlap_completes_while_caller_computes(comm: &Comm, f: &mut Fails) -> Result<(), Error> {
    let (r, n) = (comm.rank(), comm.size());
    if n < 2 {
        return Ok(());
    }
    let len = 1 << 20;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let buf = vec![r as f32 + 1.0; len];
    let before = comm.counters().calls(CollectiveKind::AllReduce);
    let got = if r == 0 {
        let mut req = comm.start_all_reduce_vec(buf, ReduceOp::Sum);
        f.check(!req.test(), || "complete before the peers started".into());
        for p in 1..n {
            comm.send(i32::slice(&[1]), p, 77)?;
        }
        let (mut acc, mut slices) = (1.0f64, 0u64);
        while !req.test() && std::time::Instant::now() < deadline {
            for i in 0..1000 {
                acc = std::hint::black_box(acc * 1.000_000_1 + f64::from(i));
            }
            slices += 1;
        }
        std::hint::black_box(acc);
        f.check(req.test(), || "no progress without wait".into());
        f.eq(
            &(comm.counters().calls(CollectiveKind::AllReduce) - before),
            &1,
            || "not counted before wait".into(),
        );
        f.check(slices > 0, || "no compute overlapped".into());
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

const CASES: &[(&str, Case)] = &[
    (
        "all_reduce_every_dtype_op_matches_reference",
        all_reduce_every_dtype_op_matches_reference,
    ),
    (
        "all_reduce_order_sensitive_sum_bitwise_identical_and_equal_to_threads",
        all_reduce_order_sensitive_sum_bitwise_identical_and_equal_to_threads,
    ),
    (
        "all_gather_every_dtype_matches_reference",
        all_gather_every_dtype_matches_reference,
    ),
    (
        "all_gatherv_uneven_counts_with_zeros_matches_reference",
        all_gatherv_uneven_counts_with_zeros_matches_reference,
    ),
    (
        "reduce_scatter_every_dtype_op_matches_reference",
        reduce_scatter_every_dtype_op_matches_reference,
    ),
    (
        "reduce_scatterv_uneven_counts_with_zeros_matches_reference",
        reduce_scatterv_uneven_counts_with_zeros_matches_reference,
    ),
    (
        "all_to_all_every_dtype_matches_reference",
        all_to_all_every_dtype_matches_reference,
    ),
    (
        "all_to_allv_uneven_counts_with_zeros_matches_reference",
        all_to_allv_uneven_counts_with_zeros_matches_reference,
    ),
    (
        "broadcast_every_dtype_root_matches_root",
        broadcast_every_dtype_root_matches_root,
    ),
    (
        "in_place_all_gatherv_and_reduce_scatterv_match_reference",
        in_place_all_gatherv_and_reduce_scatterv_match_reference,
    ),
    (
        "barrier_repeated_all_ranks_pass",
        barrier_repeated_all_ranks_pass,
    ),
    (
        "send_recv_ring_large_symmetric_fifo_and_mismatch_stays_queued",
        send_recv_ring_large_symmetric_fifo_and_mismatch_stays_queued,
    ),
    (
        "send_from_many_threads_each_recv_gets_one_whole_message",
        send_from_many_threads_each_recv_gets_one_whole_message,
    ),
    (
        "split_rows_columns_and_keys_order_new_ranks",
        split_rows_columns_and_keys_order_new_ranks,
    ),
    (
        "counters_every_collective_match_table",
        counters_every_collective_match_table,
    ),
    (
        "mismatch_every_kind_every_rank_errs_and_group_stays_usable",
        mismatch_every_kind_every_rank_errs_and_group_stays_usable,
    ),
    (
        "async_every_kind_dtype_op_equals_blocking_bitwise",
        async_every_kind_dtype_op_equals_blocking_bitwise,
    ),
    (
        "async_in_flight_any_wait_order_dropped_and_mixed_with_blocking",
        async_in_flight_any_wait_order_dropped_and_mixed_with_blocking,
    ),
    (
        "async_counters_equal_blocking",
        async_counters_equal_blocking,
    ),
    (
        "async_mismatch_every_rank_from_wait_and_group_stays_usable",
        async_mismatch_every_rank_from_wait_and_group_stays_usable,
    ),
    (
        "async_overlap_completes_while_caller_computes",
        async_overlap_completes_while_caller_computes,
    ),
];

fn main() {
    // An optional argument runs only the cases whose name contains it.
    let filter = std::env::args().nth(1).unwrap_or_default();
    let cases: Vec<(&str, Case)> = CASES
        .iter()
        .copied()
        .filter(|(name, _)| name.contains(filter.as_str()))
        .collect();
    let failed = mpi::run(|world| {
        let (r, n) = (world.rank(), world.size());
        // The world, then each half of it (sizes n/2 and n - n/2).
        let half = world.split(usize::from(r >= n / 2), r)?;
        let mut failed = 0;
        for (label, comm) in [("world", &world), ("half", &half)] {
            for &(name, case) in &cases {
                let mut fails = Fails::default();
                if let Err(e) = case(comm, &mut fails) {
                    fails.0.push(format!("error: {e}"));
                }
                // Agree across the world on whether the case passed anywhere.
                let mut bad = [i32::from(!fails.0.is_empty())];
                world.all_reduce_in_place(&mut bad, ReduceOp::Max)?;
                for msg in &fails.0 {
                    eprintln!("  rank {r} [{label} n={}] {name}: {msg}", comm.size());
                }
                if r == 0 {
                    let verdict = if bad[0] == 0 { "ok" } else { "FAILED" };
                    println!("{name} [{label} of {}] ... {verdict}", comm.size());
                }
                failed += bad[0] as usize;
            }
        }
        world.barrier()?;
        if r == 0 {
            let total = 2 * cases.len();
            println!("mpi conformance on {n} ranks:");
            println!("{} passed, {failed} failed", total - failed);
        }
        Ok::<_, Error>(failed)
    });
    if failed > 0 {
        std::process::exit(1);
    }
}
