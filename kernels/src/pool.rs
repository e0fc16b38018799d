//! A per-thread cache of freed tensor buffers.
//!
//! A fresh 128 MiB allocation page-faults on every touch (glibc hands blocks over 32 MiB
//! back to the OS on free), which runs at a fraction of memory bandwidth. Ranks run one per
//! thread, so each thread keeps the large buffers its tensors drop and hands them out again
//! for the next tensor of that dtype and a close size, as PyTorch's caching allocator does
//! on GPUs.
//!
//! The cache follows the working set, not its cap:
//!
//! - **Size classes.** A buffer the pool allocates gets a capacity rounded up to a size
//!   class (four per power of two: 1, 1.25, 1.5 and 1.75 × 2^k bytes), so one buffer
//!   serves every request of its class. A request takes the smallest cached buffer of its
//!   dtype whose *capacity* holds it, up to 1.5 × the request (so a buffer wastes at most
//!   a third of itself).
//! - **Capacity, not length.** The cache counts the capacity of what it holds (a buffer
//!   handed out for fewer elements keeps its capacity and its pages).
//! - **Bounded by the thread's peak.** Cached and live buffers together never hold more
//!   than the thread's live buffers ever held at once (by capacity; a high-water mark in
//!   [`crate::memory`] that [`crate::memory::reset_peak`] does not lower), and the cache
//!   never more than 1 GiB: a thread reserves no more than its peak of live tensors, as
//!   if every buffer were freed at once. Beyond it, the buffers cached longest ago go
//!   first (a buffer that does not fit is freed).
//! - **Idle buffers go back.** Every take and recycle of a pooled size ticks the thread's
//!   clock; a buffer not handed out again within [`IDLE_TICKS`] ticks is freed. Cheap and
//!   deterministic: no background thread, no wall clock.
//! - **On demand.** [`trim`] (or [`crate::memory::release_cached`]) empties this thread's
//!   cache; [`cached_bytes`] says what it holds.
//!
//! - **Freed shrunk.** A buffer the pool lets go (idle, over the bound, or trimmed) is
//!   shrunk in place to one element before it is freed, so that glibc hands its pages back
//!   with `mremap` and does not raise its mmap threshold (see
//!   `CpuStorage::free_shrunk`): freed whole, later buffers of that size would come from
//!   per-thread arenas that keep their freed pages resident.
//!
//! Buffers smaller than [`MIN_POOLED_BYTES`] are left to the system allocator.

use crate::dtype::DType;
use crate::storage::cpu::CpuStorage;
use std::cell::RefCell;
use std::collections::VecDeque;

/// Buffers smaller than this are left to the system allocator (fast enough, and cached
/// by malloc itself). Under Miri, which interprets every element write, 1 KiB, so that the
/// pool's tests can exercise it with small buffers in reasonable time.
pub const MIN_POOLED_BYTES: usize = if cfg!(miri) { 1 << 10 } else { 256 << 10 };
/// Most bytes one thread keeps cached (whatever its live bytes); the buffers cached longest
/// ago go first beyond it.
pub const MAX_POOLED_BYTES: usize = 1 << 30;
/// A cached buffer not handed out again within this many pool events on its thread (takes
/// and recycles of pooled sizes) is freed.
pub const IDLE_TICKS: u64 = 4096;

struct Cached {
    data: CpuStorage,
    /// Capacity in bytes.
    bytes: usize,
    /// The thread's clock when it was cached.
    since: u64,
}

#[derive(Default)]
struct Pool {
    /// Oldest first.
    free: VecDeque<Cached>,
    /// Capacity bytes of `free`.
    bytes: usize,
    /// Pool events on this thread so far.
    clock: u64,
}

impl Pool {
    /// Advances the clock and frees the buffers idle for longer than [`IDLE_TICKS`].
    fn tick(&mut self) {
        self.clock += 1;
        while self
            .free
            .front()
            .is_some_and(|c| self.clock - c.since > IDLE_TICKS)
        {
            self.pop_oldest();
        }
    }

    fn pop_oldest(&mut self) {
        if let Some(c) = self.free.pop_front() {
            self.bytes -= c.bytes;
            c.data.free_shrunk();
        }
    }
}

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

/// The size class of a pooled request of `bytes`: the smallest of 2^k, 1.25·2^k, 1.5·2^k,
/// 1.75·2^k at or above it. Requests below [`MIN_POOLED_BYTES`] are their own class.
pub fn size_class(bytes: usize) -> usize {
    if bytes < MIN_POOLED_BYTES {
        return bytes;
    }
    let step = 1usize << (usize::BITS - 1 - bytes.leading_zeros()).saturating_sub(2);
    bytes.div_ceil(step).saturating_mul(step)
}

/// Capacity in bytes of a storage.
fn capacity_bytes(s: &CpuStorage) -> usize {
    s.capacity() * s.dtype().size_in_bytes()
}

/// A cached buffer of `dtype` holding exactly `len` initialized elements (with unspecified
/// values), if one whose capacity holds them with little to spare (`len ≤ capacity ≤
/// 1.5·len` elements) is cached on this thread.
pub(crate) fn take(dtype: DType, len: usize) -> Option<CpuStorage> {
    let need = len * dtype.size_in_bytes();
    if need < MIN_POOLED_BYTES {
        return None;
    }
    POOL.try_with(|p| {
        let mut p = p.borrow_mut();
        p.tick();
        let best = p
            .free
            .iter()
            .enumerate()
            .filter(|(_, c)| {
                c.data.dtype() == dtype && c.bytes >= need && c.bytes <= need + need / 2
            })
            // The tightest fit; of equal ones the most recently cached (warmest).
            .min_by_key(|(i, c)| (c.bytes, usize::MAX - i))
            .map(|(i, _)| i)?;
        let c = p.free.remove(best).expect("index from the scan");
        p.bytes -= c.bytes;
        let mut s = c.data;
        s.set_len(len);
        Some(s)
    })
    .ok()
    .flatten()
}

/// A fresh buffer of `dtype` holding `len` zeros, with room for its whole size class when
/// it is of a pooled size (so that, once cached, it serves every request of that class).
/// The spare capacity is not touched: with the system allocator's zeroed pages it costs no
/// resident memory until a later tensor uses it.
pub(crate) fn alloc_zeroed(dtype: DType, len: usize) -> CpuStorage {
    let size = dtype.size_in_bytes();
    let need = len * size;
    if need < MIN_POOLED_BYTES {
        return CpuStorage::zeros(dtype, len);
    }
    let mut s = CpuStorage::zeros(dtype, size_class(need) / size);
    s.set_len(len);
    s
}

/// Keeps a dropped buffer for reuse on this thread (large ones only, bounded): the cache
/// stays within `room` bytes, the bound [`crate::memory`] sets (passed in, so that the pool
/// sits below the accounting that reports on it).
pub(crate) fn recycle(s: CpuStorage, room: usize) {
    let bytes = capacity_bytes(&s);
    if bytes < MIN_POOLED_BYTES {
        return;
    }
    if bytes > MAX_POOLED_BYTES {
        return s.free_shrunk();
    }
    let _ = POOL.try_with(|p| {
        let mut p = p.borrow_mut();
        p.tick();
        let cap = room.min(MAX_POOLED_BYTES);
        if bytes > cap {
            return s.free_shrunk();
        }
        while p.bytes + bytes > cap {
            p.pop_oldest();
        }
        p.bytes += bytes;
        let since = p.clock;
        p.free.push_back(Cached {
            data: s,
            bytes,
            since,
        });
    });
}

/// Bytes cached on this thread (capacities of the buffers held for reuse).
pub fn cached_bytes() -> usize {
    POOL.try_with(|p| p.borrow().bytes).unwrap_or(0)
}

/// Frees every buffer cached on this thread; returns the bytes released. Each rank thread
/// empties its own cache (a thread cannot reach another's).
pub fn trim() -> usize {
    POOL.try_with(|p| {
        let mut p = p.borrow_mut();
        let bytes = p.bytes;
        while !p.free.is_empty() {
            p.pop_oldest();
        }
        bytes
    })
    .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tensor;

    /// f32 elements of `k` pooling units (MIN_POOLED_BYTES each).
    fn units(k: usize) -> usize {
        k * MIN_POOLED_BYTES / 4
    }

    #[test]
    fn size_classes_are_four_per_power_of_two() {
        let m = MIN_POOLED_BYTES;
        assert_eq!(size_class(m - 1), m - 1);
        assert_eq!(size_class(m), m);
        assert_eq!(size_class(m + 1), m + m / 4);
        assert_eq!(size_class(m + m / 4), m + m / 4);
        assert_eq!(size_class(m + m / 4 + 1), m + m / 2);
        assert_eq!(size_class(2 * m - 1), 2 * m);
        assert_eq!(size_class(3 * m + 1), 3 * m + m / 2);
        for b in [m, m + 7, 5 * m / 3, 7 * m, 1 << 30] {
            let c = size_class(b);
            assert!(c >= b && c <= b + b / 4, "{b} -> {c}");
        }
    }

    #[test]
    fn a_buffer_serves_the_sizes_of_its_class_and_counts_its_capacity() {
        std::thread::spawn(|| {
            // Allocated for 1.1 units: capacity rounded to 1.25 units.
            let a = Tensor::zeros(&[units(11) / 10], DType::F32);
            drop(a);
            assert_eq!(cached_bytes(), size_class(MIN_POOLED_BYTES * 11 / 10));
            assert_eq!(cached_bytes(), MIN_POOLED_BYTES * 5 / 4);
            // A request of exactly 1.25 units reuses it (grown back within its capacity).
            let b = Tensor::for_overwrite(&[units(5) / 4], DType::F32);
            assert_eq!(cached_bytes(), 0);
            drop(b);
            // A smaller one (1 unit) too; it still counts the full capacity when back.
            let c = Tensor::zeros(&[units(1)], DType::F32);
            assert_eq!(cached_bytes(), 0);
            assert!(c.as_slice::<f32>().unwrap().iter().all(|&x| x == 0.0));
            drop(c);
            assert_eq!(cached_bytes(), MIN_POOLED_BYTES * 5 / 4);
            // Another dtype does not take it.
            let d = Tensor::for_overwrite(&[units(1) / 2], DType::F64);
            assert_eq!(cached_bytes(), MIN_POOLED_BYTES * 5 / 4);
            drop(d);
            let held = cached_bytes();
            assert_eq!(trim(), held);
            assert_eq!(cached_bytes(), 0);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn the_cache_holds_at_most_the_threads_peak_of_live_bytes() {
        std::thread::spawn(|| {
            // Live at most 4 units at once: four 1-unit tensors.
            let ts: Vec<Tensor> = (0..4)
                .map(|_| Tensor::zeros(&[units(1)], DType::F32))
                .collect();
            drop(ts);
            assert_eq!(cached_bytes(), 4 * MIN_POOLED_BYTES);
            // One at a time, sixteen 1-unit tensors of the other dtypes and sizes: the
            // cache never exceeds the high-water mark of 4 units.
            for k in 0..16 {
                let t = Tensor::zeros(&[units(1) / 2 + k], DType::F64);
                drop(t);
                assert!(cached_bytes() <= 4 * MIN_POOLED_BYTES);
            }
            trim();
        })
        .join()
        .unwrap();
    }

    #[test]
    fn idle_buffers_are_freed_after_idle_ticks() {
        std::thread::spawn(|| {
            let keep = Tensor::zeros(&[units(2)], DType::F32);
            let idle = Tensor::zeros(&[units(1)], DType::F32);
            drop(idle);
            assert_eq!(cached_bytes(), MIN_POOLED_BYTES);
            // A busy loop on another size: the idle buffer goes after IDLE_TICKS events.
            let busy = Tensor::zeros(&[units(2)], DType::I32);
            drop(busy);
            let ticks = if cfg!(miri) {
                IDLE_TICKS / 8
            } else {
                IDLE_TICKS
            };
            for _ in 0..ticks / 2 {
                drop(Tensor::for_overwrite(&[units(2)], DType::I32));
            }
            if cfg!(miri) {
                // Too slow to run out the clock under Miri: the release call instead.
                trim();
            }
            assert_eq!(
                cached_bytes(),
                if cfg!(miri) { 0 } else { 2 * MIN_POOLED_BYTES },
                "only the busy buffer is left"
            );
            drop(keep);
            trim();
        })
        .join()
        .unwrap();
    }
}
