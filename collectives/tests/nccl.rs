//! The NCCL backend. Without a GPU (here and in CI): `launch` gives every rank our error
//! when libnccl or the driver is missing, never a panic or a hang. With GPUs (ignored by
//! default; run with `--include-ignored --test-threads=1` on the GPU machine, with libnccl
//! (a `libnccl.so` link) and NVRTC on `LD_LIBRARY_PATH`, `NCCL_SOCKET_IFNAME=lo`, and
//! `NCCL_MULTI_RANK_GPU_ENABLE=1` when ranks share a GPU): every collective against a
//! reference on 2 (and 3) ranks, for every dtype, replicas bitwise equal across ranks;
//! mismatches, invalid arguments, a failing rank, a timeout and both refusals (host buffers
//! on NCCL, device buffers on threads); the asynchronous device calls (`start_*_device`)
//! against the blocking ones, dropped unwaited, with a late or failing peer, and refused by
//! the threads backend.
#![cfg(feature = "nccl")]

use dtensor_collectives::nccl::{self, NcclComm, Options};
use dtensor_collectives::{
    threads, CollectiveKind, Communicator, CommunicatorExt, DeviceBuffer, DeviceRequest, Error,
    ReduceOp,
};
use dtensor_kernels::cuda::{self, CudaTensor};
use dtensor_kernels::half::{bf16, f16};
use dtensor_kernels::{StorageElement, Tensor};
use std::time::{Duration, Instant};

mod common;
use common::{gpu_missing, gpu_required};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Returns from the test with `SKIPPED: <why>` when there is no GPU or no libnccl; fails
/// instead when `DTENSOR_GPU_REQUIRED=1` (so a GPU run cannot pass by skipping).
macro_rules! require_gpu {
    () => {
        if let Some(why) = gpu_missing() {
            assert!(!gpu_required(), "DTENSOR_GPU_REQUIRED=1 but {why}");
            eprintln!("SKIPPED (needs CUDA GPUs and NCCL): {why}");
            return;
        }
    };
}

// ---------------------------------------------------------------------------------------
// No GPU needed
// ---------------------------------------------------------------------------------------

#[test]
fn launch_without_libnccl_or_driver_errs_on_every_rank() {
    let why = match gpu_missing() {
        Some(why) => why,
        None => {
            eprintln!(
                "SKIPPED: this machine has libnccl, a driver and a GPU (the GPU tests cover it)"
            );
            return;
        }
    };
    let start = Instant::now();
    let results = nccl::launch(3, |_comm| -> Result<(), Error> {
        panic!("the closure must not run without NCCL and a GPU")
    });
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "launch took {:?}",
        start.elapsed()
    );
    assert_eq!(results.len(), 3);
    for r in results {
        match r {
            Err(Error::Unavailable { backend, detail }) => {
                assert_eq!(backend, "nccl");
                assert!(
                    why.contains(&detail) || detail.contains("CUDA") || detail.contains("libcuda"),
                    "{detail}"
                );
            }
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}

#[test]
fn require_library_without_libnccl_names_the_symlink_fix() {
    if nccl::library_present() {
        eprintln!("SKIPPED: libnccl is present on this machine");
        return;
    }
    let e = nccl::require_library().unwrap_err();
    let text = e.to_string();
    assert!(
        text.starts_with("nccl backend: libnccl not found: "),
        "{text}"
    );
    assert!(text.contains("libnccl.so"), "{text}");
    assert!(
        text.contains("add a libnccl.so symlink on LD_LIBRARY_PATH"),
        "{text}"
    );
    // Cached: asking again gives the same answer without another search.
    assert!(!nccl::library_present());
}

#[test]
fn launch_zero_ranks_returns_nothing() {
    let results = nccl::launch(0, |_comm| -> Result<(), Error> { Ok(()) });
    assert!(results.is_empty());
}

// ---------------------------------------------------------------------------------------
// GPU: helpers
// ---------------------------------------------------------------------------------------

/// Rank `rank`'s element `i`: small integers, so sums of a few ranks are exact in every
/// dtype (bf16 included) whatever order NCCL adds them in.
fn value(rank: usize, i: usize) -> f64 {
    ((rank * 7 + i * 3) % 11) as f64 - 5.0
}

fn to_dev<T: StorageElement>(comm: &NcclComm, data: Vec<T>) -> Result<CudaTensor, BoxError> {
    let n = data.len();
    Ok(Tensor::from_vec(data, &[n])?
        .to_device(comm.device())?
        .cuda_tensor()?)
}

fn zeros_dev<T: StorageElement>(comm: &NcclComm, n: usize) -> Result<CudaTensor, BoxError> {
    to_dev(comm, vec![T::zero(); n])
}

fn to_host<T: StorageElement>(t: &CudaTensor) -> Result<Vec<T>, BoxError> {
    Ok(t.to_host()?.as_slice::<T>()?.to_vec())
}

fn bits<T: StorageElement>(v: &[T]) -> Vec<u64> {
    v.iter().map(|x| x.to_f64().to_bits()).collect()
}

fn reduce_ref(op: ReduceOp, vals: &[f64], int: bool) -> f64 {
    let sum: f64 = vals.iter().sum();
    match op {
        ReduceOp::Sum => sum,
        ReduceOp::Avg if int => (sum / vals.len() as f64).trunc(),
        ReduceOp::Avg => sum / vals.len() as f64,
        ReduceOp::Max => vals.iter().cloned().fold(f64::MIN, f64::max),
        ReduceOp::Min => vals.iter().cloned().fold(f64::MAX, f64::min),
    }
}

/// Every rank's result of `f`, unwrapped (a failing rank fails the test with its error).
fn run_ok<T: Send>(n: usize, f: impl Fn(&NcclComm) -> Result<T, BoxError> + Sync) -> Vec<T> {
    nccl::launch(n, |comm| f(&comm))
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
        .collect()
}

fn all_reduce_case<T: StorageElement>(n: usize, len: usize, op: ReduceOp, int: bool) {
    let got = run_ok(n, |comm| {
        let data = (0..len)
            .map(|i| T::from_f64(value(comm.rank(), i)))
            .collect();
        let mut x = to_dev::<T>(comm, data)?;
        comm.all_reduce_device(x.view_mut()?, op)?;
        to_host::<T>(&x)
    });
    for r in &got[1..] {
        assert_eq!(bits(r), bits(&got[0]), "replicas differ ({op}, {len})");
    }
    for (i, g) in got[0].iter().enumerate() {
        let vals: Vec<f64> = (0..n).map(|r| value(r, i)).collect();
        let want = T::from_f64(reduce_ref(op, &vals, int)).to_f64();
        assert_eq!(g.to_f64(), want, "{op} element {i} of {len}");
    }
}

// ---------------------------------------------------------------------------------------
// GPU: data
// ---------------------------------------------------------------------------------------

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn all_reduce_device_every_dtype_and_op_matches_reference_on_2_ranks() {
    require_gpu!();
    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
        for len in [0, 1, 7, 4099] {
            all_reduce_case::<f32>(2, len, op, false);
            all_reduce_case::<f64>(2, len, op, false);
            all_reduce_case::<bf16>(2, len, op, false);
            all_reduce_case::<f16>(2, len, op, false);
            all_reduce_case::<i32>(2, len, op, true);
            all_reduce_case::<i64>(2, len, op, true);
        }
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn all_reduce_device_f32_random_3_ranks_within_tolerance_replicas_bitwise() {
    require_gpu!();
    let len = 100_003;
    let x = |r: usize, i: usize| ((r * 2654435761 + i * 40503) % 1000) as f32 / 997.0 - 0.5;
    let got = run_ok(3, |comm| {
        let mut t = to_dev::<f32>(comm, (0..len).map(|i| x(comm.rank(), i)).collect())?;
        comm.all_reduce_device(t.view_mut()?, ReduceOp::Sum)?;
        to_host::<f32>(&t)
    });
    assert_eq!(bits(&got[1]), bits(&got[0]));
    assert_eq!(bits(&got[2]), bits(&got[0]));
    for (i, g) in got[0].iter().enumerate() {
        let want: f64 = (0..3).map(|r| x(r, i) as f64).sum();
        assert!(
            (*g as f64 - want).abs() <= 1e-6 * 3.0,
            "element {i}: {g} vs {want}"
        );
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn all_gather_and_all_gatherv_device_place_pieces_in_rank_order() {
    require_gpu!();
    let counts = [3usize, 0, 5];
    let got = run_ok(3, |comm| {
        let me = comm.rank();
        let piece: Vec<i64> = (0..4).map(|i| (me * 100 + i) as i64).collect();
        let send = to_dev(comm, piece)?;
        let mut recv = zeros_dev::<i64>(comm, 12)?;
        comm.all_gather_device(send.view()?, recv.view_mut()?)?;
        let own: Vec<f32> = (0..counts[me]).map(|i| (me * 10 + i) as f32).collect();
        let sendv = to_dev(comm, own)?;
        let mut recvv = zeros_dev::<f32>(comm, 8)?;
        comm.all_gatherv_device(sendv.view()?, recvv.view_mut()?, &counts)?;
        Ok((to_host::<i64>(&recv)?, to_host::<f32>(&recvv)?))
    });
    let want: Vec<i64> = (0..3)
        .flat_map(|r| (0..4).map(move |i| (r * 100 + i) as i64))
        .collect();
    let wantv: Vec<f32> = (0..3)
        .flat_map(|r| (0..counts[r]).map(move |i| (r * 10 + i) as f32))
        .collect();
    for (a, b) in got {
        assert_eq!(a, want);
        assert_eq!(b, wantv);
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn reduce_scatter_and_reduce_scatterv_device_reduce_own_block() {
    require_gpu!();
    let counts = [2usize, 0, 3];
    let got = run_ok(3, |comm| {
        let me = comm.rank();
        let send = to_dev(comm, (0..6).map(|i| value(me, i)).collect::<Vec<f64>>())?;
        let mut recv = zeros_dev::<f64>(comm, 2)?;
        comm.reduce_scatter_device(send.view()?, recv.view_mut()?, ReduceOp::Sum)?;
        let sendv = to_dev(
            comm,
            (0..5).map(|i| value(me, i) as i32).collect::<Vec<i32>>(),
        )?;
        let mut recvv = zeros_dev::<i32>(comm, counts[me])?;
        comm.reduce_scatterv_device(sendv.view()?, recvv.view_mut()?, &counts, ReduceOp::Max)?;
        Ok((to_host::<f64>(&recv)?, to_host::<i32>(&recvv)?))
    });
    for (me, (a, b)) in got.into_iter().enumerate() {
        let want: Vec<f64> = (me * 2..me * 2 + 2)
            .map(|i| (0..3).map(|r| value(r, i)).sum())
            .collect();
        assert_eq!(a, want, "rank {me}");
        let off: usize = counts[..me].iter().sum();
        let wantv: Vec<i32> = (off..off + counts[me])
            .map(|i| (0..3).map(|r| value(r, i) as i32).max().unwrap())
            .collect();
        assert_eq!(b, wantv, "rank {me}");
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn all_to_all_and_all_to_allv_device_exchange_blocks() {
    require_gpu!();
    // all_to_allv: rank p sends (p + q) % 3 elements to rank q.
    let c = |p: usize, q: usize| (p + q) % 3;
    let got = run_ok(3, |comm| {
        let me = comm.rank();
        let send = to_dev(
            comm,
            (0..6).map(|i| (me * 10 + i) as f32).collect::<Vec<f32>>(),
        )?;
        let mut recv = zeros_dev::<f32>(comm, 6)?;
        comm.all_to_all_device(send.view()?, recv.view_mut()?)?;
        let send_counts: Vec<usize> = (0..3).map(|q| c(me, q)).collect();
        let recv_counts: Vec<usize> = (0..3).map(|p| c(p, me)).collect();
        let data: Vec<i32> = (0..3)
            .flat_map(|q| (0..c(me, q)).map(move |i| (me * 100 + q * 10 + i) as i32))
            .collect();
        let sendv = to_dev(comm, data)?;
        let mut recvv = zeros_dev::<i32>(comm, recv_counts.iter().sum())?;
        comm.all_to_allv_device(sendv.view()?, &send_counts, recvv.view_mut()?, &recv_counts)?;
        Ok((to_host::<f32>(&recv)?, to_host::<i32>(&recvv)?))
    });
    for (me, (a, b)) in got.into_iter().enumerate() {
        let want: Vec<f32> = (0..3)
            .flat_map(|p| (0..2).map(move |i| (p * 10 + me * 2 + i) as f32))
            .collect();
        assert_eq!(a, want, "rank {me}");
        let wantv: Vec<i32> = (0..3)
            .flat_map(|p| (0..c(p, me)).map(move |i| (p * 100 + me * 10 + i) as i32))
            .collect();
        assert_eq!(b, wantv, "rank {me}");
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn broadcast_send_recv_and_split_device() {
    require_gpu!();
    let got = run_ok(2, |comm| {
        let me = comm.rank();
        let mut b = to_dev(comm, vec![bf16::from_f64(me as f64 + 1.5); 9])?;
        comm.broadcast_device(b.view_mut()?, 1)?;
        // A pair exchange in an order that cannot deadlock (NCCL sends are unbuffered).
        let mut got = zeros_dev::<f16>(comm, 5)?;
        let mine = to_dev(comm, vec![f16::from_f64(me as f64 * 2.0 + 0.5); 5])?;
        if me == 0 {
            comm.send_device(mine.view()?, 1, 7)?;
            comm.recv_device(got.view_mut()?, 1, 8)?;
        } else {
            comm.recv_device(got.view_mut()?, 0, 7)?;
            comm.send_device(mine.view()?, 0, 8)?;
        }
        // Each rank alone in its own color: a group of one.
        let solo = comm.split_nccl(me, 0)?;
        let mut s = to_dev(comm, vec![3.0f32; 4])?;
        solo.all_reduce_device(s.view_mut()?, ReduceOp::Sum)?;
        // Both in one color, keys reversed: new rank 0 is old rank 1.
        let both = comm.split_nccl(0, 1 - me)?;
        let mut t = to_dev(comm, vec![both.rank() as i64; 2])?;
        both.broadcast_device(t.view_mut()?, 0)?;
        let counters = comm.counters();
        Ok((
            to_host::<bf16>(&b)?,
            to_host::<f16>(&got)?,
            to_host::<f32>(&s)?,
            to_host::<i64>(&t)?,
            both.members().to_vec(),
            counters,
        ))
    });
    for (me, (b, g, s, t, members, counters)) in got.into_iter().enumerate() {
        assert_eq!(b, vec![bf16::from_f64(2.5); 9]);
        let other = 1 - me;
        assert_eq!(g, vec![f16::from_f64(other as f64 * 2.0 + 0.5); 5]);
        assert_eq!(s, vec![3.0; 4]);
        assert_eq!(t, vec![0; 2], "new rank 0 broadcasts its new rank, 0");
        assert_eq!(members, vec![1, 0]);
        // broadcast of 9 bf16 from root 1; one send and one recv of 5 f16; two splits.
        let want_sent = if me == 1 { 9 * 2 } else { 0 } + 5 * 2;
        let want_recv = if me == 0 { 9 * 2 } else { 0 } + 5 * 2;
        assert_eq!(
            (counters.bytes_sent, counters.bytes_received),
            (want_sent, want_recv)
        );
        assert_eq!(counters.calls(CollectiveKind::Split), 2);
        assert_eq!(counters.calls(CollectiveKind::Broadcast), 1);
    }
}

// ---------------------------------------------------------------------------------------
// GPU: errors
// ---------------------------------------------------------------------------------------

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn host_buffers_on_nccl_and_device_buffers_on_threads_are_refused() {
    require_gpu!();
    let got = run_ok(2, |comm| {
        let mut host = vec![1.0f32; 4];
        let e = comm
            .all_reduce_in_place(&mut host, ReduceOp::Sum)
            .unwrap_err();
        Ok(e)
    });
    for e in got {
        assert!(
            matches!(&e, Error::InvalidArgument { detail, .. } if detail.starts_with("nccl backend: host buffers are not staged")),
            "{e}"
        );
    }
    let dev = cuda::Device::new(0).unwrap();
    let results = threads::launch(2, |comm| {
        let mut t = Tensor::from_vec(vec![1.0f32; 4], &[4])
            .unwrap()
            .to_device(&dev)
            .unwrap();
        comm.all_reduce_device(t.device_view_mut().unwrap(), ReduceOp::Sum)
    });
    for r in results {
        let e = r.unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("threads backend: device buffers need the nccl backend"),
            "{text}"
        );
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn all_reduce_device_length_mismatch_every_rank_errs_group_stays_usable() {
    require_gpu!();
    let got = run_ok(2, |comm| {
        let me = comm.rank();
        let mut x = zeros_dev::<f32>(comm, 4 + me)?;
        let e = comm
            .all_reduce_device(x.view_mut()?, ReduceOp::Sum)
            .unwrap_err();
        // Invalid arguments on rank 1 only: it gets InvalidArgument, rank 0 a mismatch.
        let send = zeros_dev::<f32>(comm, 2)?;
        let mut recv = zeros_dev::<f32>(comm, if me == 1 { 3 } else { 4 })?;
        let e2 = comm
            .all_gather_device(send.view()?, recv.view_mut()?)
            .unwrap_err();
        let mut y = to_dev(comm, vec![1.0f32; 3])?;
        comm.all_reduce_device(y.view_mut()?, ReduceOp::Sum)?;
        Ok((e, e2, to_host::<f32>(&y)?))
    });
    for (me, (e, e2, y)) in got.into_iter().enumerate() {
        match &e {
            Error::CollectiveMismatch {
                backend, detail, ..
            } => {
                assert_eq!(*backend, "nccl");
                assert!(
                    detail.contains("rank 0: all_reduce(f32 x 4, sum)"),
                    "{detail}"
                );
                assert!(
                    detail.contains("rank 1: all_reduce(f32 x 5, sum)"),
                    "{detail}"
                );
            }
            other => panic!("rank {me}: expected a mismatch, got {other}"),
        }
        if me == 1 {
            assert!(matches!(e2, Error::InvalidArgument { .. }), "{e2}");
        } else {
            assert!(matches!(e2, Error::CollectiveMismatch { .. }), "{e2}");
        }
        assert_eq!(y, vec![2.0; 3]);
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn failing_rank_gives_peer_rank_failed_quickly() {
    require_gpu!();
    assert_failing_peer_reported_quickly(|comm| {
        let mut x = zeros_dev::<f32>(comm, 4)?;
        comm.all_reduce_device(x.view_mut()?, ReduceOp::Sum)?;
        Ok(())
    });
}

/// Rank 1 returns an error at once; rank 0, 200 ms later, runs `op`, which must fail well
/// within the timeout with an error naming rank 1 and its reason.
fn assert_failing_peer_reported_quickly(op: impl Fn(&NcclComm) -> Result<(), BoxError> + Sync) {
    let start = Instant::now();
    let results = nccl::launch(2, |comm| -> Result<(), BoxError> {
        if comm.rank() == 1 {
            return Err("rank 1 gives up".into());
        }
        std::thread::sleep(Duration::from_millis(200));
        op(&comm)
    });
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
    let e0 = results[0].as_ref().unwrap_err().to_string();
    assert!(
        e0.contains("rank 1 failed") && e0.contains("rank 1 gives up"),
        "{e0}"
    );
    assert!(results[1].is_err());
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn late_peer_gives_timeout_then_the_same_error_again() {
    require_gpu!();
    let options = Options {
        timeout: Duration::from_secs(2),
    };
    let start = Instant::now();
    let results = nccl::launch_with(2, options, |comm| -> Result<Vec<String>, BoxError> {
        let mut x = zeros_dev::<f32>(&comm, 4)?;
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_secs(6));
            return Ok(Vec::new());
        }
        let e = comm
            .all_reduce_device(x.view_mut()?, ReduceOp::Sum)
            .unwrap_err();
        let again = comm.barrier().unwrap_err();
        Ok(vec![e.to_string(), again.to_string()])
    });
    assert!(
        start.elapsed() < Duration::from_secs(60),
        "{:?}",
        start.elapsed()
    );
    let errs = results.into_iter().next().unwrap().unwrap();
    assert!(errs[0].contains("timed out after"), "{}", errs[0]);
    assert_eq!(errs[0], errs[1]);
}

#[test]
fn from_host_without_libnccl_or_driver_errs_on_every_rank() {
    if gpu_missing().is_none() {
        eprintln!("SKIPPED: this machine has libnccl, a driver and a GPU (the GPU tests cover it)");
        return;
    }
    let results = threads::launch(3, |host| {
        nccl::from_host(&*host, Options::default()).map(|_| ())
    });
    for r in results {
        match r {
            Err(threads::RankError::Returned(Error::Unavailable {
                backend: "nccl", ..
            })) => {}
            other => panic!("expected Unavailable, got {other:?}"),
        }
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn from_host_over_threads_shares_rank_0_id() {
    require_gpu!();
    let results = threads::launch(2, |host| -> Result<Vec<f32>, BoxError> {
        let comm = nccl::from_host(&*host, Options::default())?;
        let mut x = to_dev(&comm, vec![comm.rank() as f32 + 1.0; 3])?;
        comm.all_reduce_device(x.view_mut()?, ReduceOp::Sum)?;
        to_host::<f32>(&x)
    });
    for r in results {
        assert_eq!(r.unwrap(), vec![3.0; 3]);
    }
}

// ---------------------------------------------------------------------------------------
// GPU: asynchronous device calls (`start_*_device`)
// ---------------------------------------------------------------------------------------

fn dev_buf<T: StorageElement>(comm: &NcclComm, data: Vec<T>) -> Result<DeviceBuffer, BoxError> {
    Ok(DeviceBuffer::from(to_dev(comm, data)?))
}

fn zeros_buf<T: StorageElement>(comm: &NcclComm, n: usize) -> Result<DeviceBuffer, BoxError> {
    Ok(DeviceBuffer::zeros(comm.device(), T::DTYPE, n)?)
}

fn waited<T: StorageElement>(req: DeviceRequest) -> Result<Vec<T>, BoxError> {
    to_host::<T>(&req.wait()?.into_cuda_tensor())
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn start_device_two_gathers_in_flight_equal_blocking_bitwise_on_2_ranks() {
    require_gpu!();
    let counts = [3usize, 5];
    let got = run_ok(2, |comm| {
        let me = comm.rank();
        let piece: Vec<f32> = (0..4099).map(|i| value(me, i) as f32 / 3.0).collect();
        let own: Vec<bf16> = (0..counts[me])
            .map(|i| bf16::from_f64(value(me, i)))
            .collect();
        let grads: Vec<f32> = (0..1001).map(|i| value(me, i) as f32 / 7.0).collect();
        let blocks: Vec<f64> = (0..6).map(|i| value(me, i) / 5.0).collect();
        // Blocking references.
        let send = to_dev(comm, piece.clone())?;
        let mut recv = zeros_dev::<f32>(comm, 2 * 4099)?;
        comm.all_gather_device(send.view()?, recv.view_mut()?)?;
        let sendv = to_dev(comm, own.clone())?;
        let mut recvv = zeros_dev::<bf16>(comm, 8)?;
        comm.all_gatherv_device(sendv.view()?, recvv.view_mut()?, &counts)?;
        let mut g = to_dev(comm, grads.clone())?;
        comm.all_reduce_device(g.view_mut()?, ReduceOp::Sum)?;
        let rs_send = to_dev(comm, blocks.clone())?;
        let mut rs = zeros_dev::<f64>(comm, 3)?;
        comm.reduce_scatter_device(rs_send.view()?, rs.view_mut()?, ReduceOp::Sum)?;
        let mut rsv = zeros_dev::<f64>(comm, [2usize, 4][me])?;
        comm.reduce_scatterv_device(rs_send.view()?, rsv.view_mut()?, &[2, 4], ReduceOp::Max)?;
        let blocking = (
            to_host::<f32>(&recv)?,
            to_host::<bf16>(&recvv)?,
            to_host::<f32>(&g)?,
            to_host::<f64>(&rs)?,
            to_host::<f64>(&rsv)?,
        );
        // The same calls started, two gathers in flight at once, waited newest first.
        let before = comm.counters();
        let a =
            comm.start_all_gather_device(dev_buf(comm, piece)?, zeros_buf::<f32>(comm, 2 * 4099)?);
        let b = comm.start_all_gatherv_device(
            dev_buf(comm, own)?,
            zeros_buf::<bf16>(comm, 8)?,
            &counts,
        );
        let b = waited::<bf16>(b)?;
        let mut a = a;
        assert!(
            a.test(),
            "a request started before a completed one is complete"
        );
        let a = waited::<f32>(a)?;
        let c = comm.start_all_reduce_device(dev_buf(comm, grads)?, ReduceOp::Sum);
        let d = comm.start_reduce_scatter_device(
            dev_buf(comm, blocks.clone())?,
            zeros_buf::<f64>(comm, 3)?,
            ReduceOp::Sum,
        );
        let e = comm.start_reduce_scatterv_device(
            dev_buf(comm, blocks)?,
            zeros_buf::<f64>(comm, [2usize, 4][me])?,
            &[2, 4],
            ReduceOp::Max,
        );
        let started = (
            a,
            b,
            waited::<f32>(c)?,
            waited::<f64>(d)?,
            waited::<f64>(e)?,
        );
        let counted = comm.counters().since(&before);
        Ok((blocking, started, counted))
    });
    for (me, ((ba, bb, bc, bd, be), (a, b, c, d, e), counted)) in got.iter().enumerate() {
        assert_eq!(bits(a), bits(ba), "rank {me}: all_gather");
        assert_eq!(bits(b), bits(bb), "rank {me}: all_gatherv");
        assert_eq!(bits(c), bits(bc), "rank {me}: all_reduce");
        assert_eq!(bits(d), bits(bd), "rank {me}: reduce_scatter");
        assert_eq!(bits(e), bits(be), "rank {me}: reduce_scatterv");
        let want: Vec<f32> = (0..2)
            .flat_map(|r| (0..4099).map(move |i| value(r, i) as f32 / 3.0))
            .collect();
        assert_eq!(bits(a), bits(&want), "rank {me}: gathered pieces");
        assert_eq!(counted.calls(CollectiveKind::AllGather), 2);
        assert_eq!(counted.calls(CollectiveKind::AllReduce), 1);
        assert_eq!(counted.calls(CollectiveKind::ReduceScatter), 2);
    }
    assert_eq!(bits(&got[0].1 .2), bits(&got[1].1 .2), "replicas differ");
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn start_device_returns_before_the_peer_starts_and_test_polls() {
    require_gpu!();
    let got = run_ok(2, |comm| {
        let me = comm.rank();
        let buf = dev_buf(comm, vec![me as f32 + 1.0; 1 << 20])?;
        if me == 1 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        let t0 = Instant::now();
        let mut req = comm.start_all_reduce_device(buf, ReduceOp::Sum);
        let start = t0.elapsed();
        let early = req.test();
        let out = waited::<f32>(req)?;
        Ok((start, early, out.iter().all(|&x| x == 3.0)))
    });
    let (start, early, ok) = &got[0];
    assert!(
        *start < Duration::from_millis(500),
        "rank 0's start blocked for {start:?} (its peer starts 1.5 s late)"
    );
    assert!(!early, "complete before the peer started");
    assert!(*ok && got[1].2);
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn start_device_dropped_unwaited_still_runs_and_later_calls_match() {
    require_gpu!();
    let got = run_ok(2, |comm| {
        let me = comm.rank();
        let before = comm.counters();
        // Dropped at once on rank 0 (the drop waits), waited on rank 1.
        let req =
            comm.start_all_reduce_device(dev_buf(comm, vec![1.0f32; 1 << 20])?, ReduceOp::Sum);
        let waited_on_1 = if me == 0 {
            drop(req);
            None
        } else {
            Some(waited::<f32>(req)?.iter().all(|&x| x == 2.0))
        };
        let after_drop = comm
            .counters()
            .since(&before)
            .calls(CollectiveKind::AllReduce);
        // Dropped on every rank in the middle of a sequence; later calls still pair up.
        let a = comm.start_all_gather_device(
            dev_buf(comm, vec![me as i32; 3])?,
            zeros_buf::<i32>(comm, 6)?,
        );
        drop(comm.start_all_reduce_device(dev_buf(comm, vec![5i64; 7])?, ReduceOp::Max));
        let mut x = to_dev(comm, vec![1.0f32; 4])?;
        comm.all_reduce_device(x.view_mut()?, ReduceOp::Sum)?;
        Ok((
            waited_on_1,
            after_drop,
            waited::<i32>(a)?,
            to_host::<f32>(&x)?,
        ))
    });
    for (me, (w, after_drop, a, x)) in got.into_iter().enumerate() {
        if me == 1 {
            assert_eq!(w, Some(true));
        }
        assert_eq!(
            after_drop, 1,
            "rank {me}: the dropped request was not complete"
        );
        assert_eq!(a, vec![0, 0, 0, 1, 1, 1]);
        assert_eq!(x, vec![2.0; 4]);
    }
}

#[test]
#[ignore = "needs CUDA GPUs and NCCL: run with --include-ignored on the GPU machine"]
fn start_device_failing_or_late_peer_errs_from_wait_within_the_timeout() {
    require_gpu!();
    // A peer that returns: RankFailed from wait.
    assert_failing_peer_reported_quickly(|comm| {
        let req = comm
            .start_all_gather_device(dev_buf(comm, vec![1.0f32; 4])?, zeros_buf::<f32>(comm, 8)?);
        req.wait()?;
        Ok(())
    });
    // A peer that never arrives: Timeout from wait after the 2 s timeout, the start
    // itself returning at once; a request dropped unwaited then returns too.
    let options = Options {
        timeout: Duration::from_secs(2),
    };
    let results = nccl::launch_with(
        2,
        options,
        |comm| -> Result<Option<(Duration, Duration, String)>, BoxError> {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_secs(4));
                return Ok(None);
            }
            let buf = dev_buf(&comm, vec![1.0f32; 4])?;
            let t0 = Instant::now();
            let req = comm.start_all_reduce_device(buf, ReduceOp::Sum);
            let started = t0.elapsed();
            let dropped =
                comm.start_all_reduce_device(dev_buf(&comm, vec![1.0f32; 4])?, ReduceOp::Sum);
            let e = req.wait().unwrap_err().to_string();
            drop(dropped);
            Ok(Some((started, t0.elapsed(), e)))
        },
    );
    let (started, waited, e) = results.into_iter().next().unwrap().unwrap().unwrap();
    assert!(
        started < Duration::from_millis(500),
        "start blocked for {started:?}"
    );
    assert!(waited < Duration::from_secs(30), "wait took {waited:?}");
    assert!(e.contains("timed out after"), "{e}");
}

#[test]
#[ignore = "needs a CUDA GPU (not NCCL): run with --include-ignored on the GPU machine"]
fn start_device_on_threads_refused_with_the_blocking_calls_error() {
    if !cuda::driver_present() || !matches!(cuda::device_count(), Ok(n) if n > 0) {
        assert!(!gpu_required(), "DTENSOR_GPU_REQUIRED=1 but no CUDA device");
        eprintln!("SKIPPED (needs a CUDA GPU): no driver or device");
        return;
    }
    let dev = cuda::Device::new(0).unwrap();
    let results = threads::launch(2, |comm| {
        let buf = || DeviceBuffer::zeros(&dev, dtensor_kernels::DType::F32, 4).unwrap();
        let blocking = comm
            .all_reduce_device(buf().view_mut().unwrap(), ReduceOp::Sum)
            .unwrap_err();
        let errs = [
            comm.start_all_reduce_device(buf(), ReduceOp::Sum).wait(),
            comm.start_all_gather_device(buf(), buf()).wait(),
            comm.start_all_gatherv_device(buf(), buf(), &[2, 2]).wait(),
            comm.start_reduce_scatter_device(buf(), buf(), ReduceOp::Sum)
                .wait(),
            comm.start_reduce_scatterv_device(buf(), buf(), &[2, 2], ReduceOp::Sum)
                .wait(),
        ]
        .map(|r| r.unwrap_err());
        Ok::<_, Error>((blocking, errs))
    });
    for r in results {
        let (blocking, errs) = r.unwrap();
        assert_eq!(
            blocking.to_string(),
            "all_reduce: invalid argument: threads backend: device buffers need the nccl backend"
        );
        for (e, op) in errs.iter().zip([
            "all_reduce",
            "all_gather",
            "all_gatherv",
            "reduce_scatter",
            "reduce_scatterv",
        ]) {
            assert_eq!(
                e.to_string(),
                format!(
                    "{op}: invalid argument: threads backend: device buffers need the nccl backend"
                )
            );
        }
    }
}
