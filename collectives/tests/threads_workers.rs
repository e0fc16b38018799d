//! The threads backend's progress workers end with their communicators: no thread is left
//! behind once `launch` returns. Alone in its own test binary because it counts the
//! process's threads, which tests running alongside would change.

use dtensor_collectives::threads::{launch_with, Options};
use dtensor_collectives::{CommunicatorExt, Error, ReduceOp};
use std::time::Duration;

/// Threads of this process whose name ends in `-progress` (Linux: `/proc/self/task`).
#[cfg(target_os = "linux")]
fn progress_threads() -> usize {
    std::fs::read_dir("/proc/self/task")
        .expect("/proc/self/task")
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end().ends_with("-progress"))
        .count()
}

#[cfg(target_os = "linux")]
#[test]
#[cfg_attr(miri, ignore = "reads /proc, which Miri's isolation hides")]
fn progress_workers_end_with_their_communicators() {
    assert_eq!(progress_threads(), 0);
    let opts = Options {
        timeout: Duration::from_secs(60),
    };
    let during = launch_with(4, opts, |comm| {
        let r = comm.rank();
        let half = comm.split(r / 2, r)?;
        let a = comm.start_all_reduce_vec(vec![1.0f32; 1000], ReduceOp::Sum);
        let b = half.start_all_gather_vec(vec![r as i64; 10]);
        // Left unwaited: the drops wait for them.
        let _c = comm.start_reduce_scatter_vec(vec![1.0f64; 40], ReduceOp::Sum);
        let _d = half.start_all_reduce_vec(vec![2i32; 7], ReduceOp::Max);
        a.wait()?;
        b.wait()?;
        // This rank's two workers (world and half) are running now.
        Ok::<_, Error>(progress_threads())
    });
    for (r, n) in during.into_iter().enumerate() {
        let n = n.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert!(n >= 2, "rank {r} saw {n} progress threads");
    }
    // Every handle was dropped with its rank's closure, and each drop joined its worker.
    assert_eq!(progress_threads(), 0);
}
