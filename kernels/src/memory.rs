//! Per-thread accounting of the bytes held by live tensor buffers.
//!
//! A rank runs on one thread (or is its own process), so per-thread counters are per-rank
//! counters: they answer "how many bytes of tensors does this rank hold now, and at most
//! since the last reset", which is what FSDP, ZeRO and activation recomputation change.
//! Every host buffer counts from its creation until the last tensor viewing it drops (a
//! buffer dropped on another thread than the one that made it is counted out there: the
//! counters are signed and clamp at zero when read). Buffers cached by the pool for reuse
//! are free memory here, as in PyTorch's `torch.cuda.memory_allocated` (the pool's cache
//! is [`crate::pool::cached_bytes`]).

use std::cell::Cell;

thread_local! {
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

/// A buffer of `bytes` came to life on this thread.
pub(crate) fn on_alloc(bytes: usize) {
    let _ = LIVE.try_with(|l| {
        let now = l.get() + bytes as i64;
        l.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

/// A buffer of `bytes` was dropped on this thread.
pub(crate) fn on_free(bytes: usize) {
    let _ = LIVE.try_with(|l| l.set(l.get() - bytes as i64));
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
        })
        .join()
        .unwrap();
    }
}
