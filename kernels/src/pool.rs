//! A per-thread cache of freed tensor buffers.
//!
//! A fresh 128 MiB allocation page-faults on every touch (glibc hands blocks over 32 MiB
//! back to the OS on free), which runs at a fraction of memory bandwidth. Ranks run one per
//! thread, so each thread keeps the large buffers its tensors drop and hands them out again
//! for the next tensor of that dtype and size, as PyTorch's caching allocator does on GPUs.

use crate::dtype::DType;
use crate::tensor::CpuStorage;
use std::cell::RefCell;

/// Buffers smaller than this are left to the system allocator (fast enough, and cached
/// by malloc itself). Under Miri, which interprets every element write, 1 KiB, so that the
/// pool's tests can exercise it with small buffers in reasonable time.
const MIN_POOLED_BYTES: usize = if cfg!(miri) { 1 << 10 } else { 256 << 10 };
/// Most bytes one thread keeps cached; the oldest buffers go first beyond it.
const MAX_POOLED_BYTES: usize = 1 << 30;

#[derive(Default)]
struct Pool {
    free: Vec<CpuStorage>,
    bytes: usize,
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

/// A cached buffer of `dtype` holding exactly `len` initialized elements (with unspecified
/// values), if one of a close size (`len ≤ size ≤ 2·len`) is cached on this thread.
pub(crate) fn take(dtype: DType, len: usize) -> Option<CpuStorage> {
    if len * dtype.size_in_bytes() < MIN_POOLED_BYTES {
        return None;
    }
    POOL.try_with(|p| {
        let mut p = p.borrow_mut();
        let best = p
            .free
            .iter()
            .enumerate()
            .filter(|(_, s)| s.dtype() == dtype && s.len() >= len && s.len() <= 2 * len)
            .min_by_key(|(_, s)| s.len())
            .map(|(i, _)| i)?;
        let mut s = p.free.remove(best);
        p.bytes -= s.len() * dtype.size_in_bytes();
        s.truncate(len);
        Some(s)
    })
    .ok()
    .flatten()
}

/// Keeps a dropped buffer for reuse on this thread (large ones only, bounded).
pub(crate) fn recycle(s: CpuStorage) {
    let bytes = s.len() * s.dtype().size_in_bytes();
    if !(MIN_POOLED_BYTES..=MAX_POOLED_BYTES).contains(&bytes) {
        return;
    }
    let _ = POOL.try_with(|p| {
        let mut p = p.borrow_mut();
        while p.bytes + bytes > MAX_POOLED_BYTES {
            let old = p.free.remove(0);
            p.bytes -= old.len() * old.dtype().size_in_bytes();
        }
        p.bytes += bytes;
        p.free.push(s);
    });
}

/// Bytes cached on this thread (for tests).
pub fn cached_bytes() -> usize {
    POOL.try_with(|p| p.borrow().bytes).unwrap_or(0)
}
