//! Per-thread accounting of the bytes held by live tensor buffers.
//!
//! A rank runs on one thread (or is its own process), so per-thread counters are per-rank
//! counters: they answer "how many bytes of tensors does this rank hold now, and at most
//! since the last reset", which is what FSDP, ZeRO and activation recomputation change.
//! Every host buffer counts from its creation until the last tensor viewing it drops (a
//! buffer dropped on another thread than the one that made it is counted out there: the
//! counters are signed and clamp at zero when read). A buffer counts its elements' bytes
//! (a pooled buffer's spare capacity is not live memory).
//!
//! Buffers cached by the pool for reuse are free memory here, as in PyTorch's
//! `torch.cuda.memory_allocated`; [`cached_bytes`] is the pool's cache on this thread
//! (`torch.cuda.memory_reserved` minus the allocated bytes), which never takes a thread's
//! cached and live buffers together above the most its live buffers ever held (counted
//! by capacity), and [`release_cached`] empties it (`torch.cuda.empty_cache`). See
//! [`crate::pool`].

use std::cell::Cell;

thread_local! {
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
    /// The capacities of the live buffers (a pooled buffer may have room for more
    /// elements than it holds), and their peak since the thread started ([`reset_peak`]
    /// does not lower it): the pool's bound on what it caches.
    static LIVE_CAP: Cell<i64> = const { Cell::new(0) };
    static HIGH_CAP: Cell<i64> = const { Cell::new(0) };
}

/// A buffer of `bytes` (`capacity` bytes allocated) came to life on this thread.
pub(crate) fn on_alloc(bytes: usize, capacity: usize) {
    let _ = LIVE.try_with(|l| {
        let now = l.get() + bytes as i64;
        l.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
    let _ = LIVE_CAP.try_with(|l| {
        let now = l.get() + capacity as i64;
        l.set(now);
        let _ = HIGH_CAP.try_with(|p| p.set(p.get().max(now)));
    });
}

/// A buffer of `bytes` (`capacity` bytes allocated) was dropped on this thread.
pub(crate) fn on_free(bytes: usize, capacity: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get() - bytes as i64));
    let _ = LIVE_CAP.try_with(|l| l.set(l.get() - capacity as i64));
}

/// Room for the pool: the most capacity bytes this thread's live buffers ever held at
/// once, less what they hold now (so that cached and live buffers together never exceed
/// that peak).
pub(crate) fn pool_room() -> usize {
    let live = LIVE_CAP.try_with(|l| l.get()).unwrap_or(0);
    let high = HIGH_CAP.try_with(|l| l.get()).unwrap_or(0);
    (high - live.max(0)).max(0) as usize
}

/// Bytes held by live tensor buffers on this thread.
pub fn live_bytes() -> usize {
    LIVE.try_with(|l| l.get().max(0) as usize).unwrap_or(0)
}

/// The most bytes held at once on this thread since it started or since [`reset_peak`].
pub fn peak_bytes() -> usize {
    PEAK.try_with(|p| p.get().max(0) as usize).unwrap_or(0)
}

/// Starts a new peak window at the current live bytes.
pub fn reset_peak() {
    let now = LIVE.try_with(|l| l.get()).unwrap_or(0);
    let _ = PEAK.try_with(|p| p.set(now));
}

/// Bytes of freed buffers this thread's pool keeps for reuse (their capacities): memory
/// the process holds beyond [`live_bytes`]. See [`crate::pool`].
pub fn cached_bytes() -> usize {
    crate::pool::cached_bytes()
}

/// Frees the buffers this thread's pool keeps for reuse and returns their bytes, as
/// `torch.cuda.empty_cache` does. Per thread: each rank calls it on its own thread. The
/// pool also frees buffers left idle on its own ([`crate::pool::IDLE_TICKS`]); this is
/// for giving memory back at once, e.g. between the phases of a program.
pub fn release_cached() -> usize {
    crate::pool::trim()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DType, Tensor};

    #[test]
    fn live_and_peak_follow_buffers_not_views() {
        // A fresh thread: no other test's tensors.
        std::thread::spawn(|| {
            assert_eq!(live_bytes(), 0);
            let a = Tensor::zeros(&[1000], DType::F32);
            assert_eq!(live_bytes(), 4000);
            let view = a.clone();
            assert_eq!(live_bytes(), 4000, "a view shares the buffer");
            reset_peak();
            let b = Tensor::zeros(&[500], DType::F64);
            assert_eq!(live_bytes(), 8000);
            drop(b);
            assert_eq!(live_bytes(), 4000);
            assert_eq!(peak_bytes(), 8000);
            drop(a);
            assert_eq!(live_bytes(), 4000, "the view keeps the buffer alive");
            drop(view);
            assert_eq!(live_bytes(), 0);
            reset_peak();
            assert_eq!(peak_bytes(), 0);
            // The peak of capacities (pooled sizes round up to a size class: under Miri,
            // which pools from 1 KiB), not lowered by reset_peak.
            assert_eq!(pool_room(), 2 * crate::pool::size_class(4000));
        })
        .join()
        .unwrap();
    }
}

#[cfg(test)]
mod release_tests {
    use super::*;
    use crate::{DType, Tensor};

    #[test]
    fn release_cached_empties_this_threads_pool() {
        std::thread::spawn(|| {
            let n = crate::pool::MIN_POOLED_BYTES / 4;
            let t = Tensor::zeros(&[n], DType::F32);
            assert_eq!((live_bytes(), cached_bytes()), (n * 4, 0));
            drop(t);
            assert_eq!((live_bytes(), cached_bytes()), (0, n * 4));
            assert_eq!(release_cached(), n * 4);
            assert_eq!((cached_bytes(), release_cached()), (0, 0));
        })
        .join()
        .unwrap();
    }
}
