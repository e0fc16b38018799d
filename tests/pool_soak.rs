//! Soak: a long loop of mixed collectives on 4 thread ranks must not grow resident memory.
//!
//! Each rank's buffer pool (`dtensor_kernels::pool`) caches freed tensor buffers for reuse;
//! it must track the working set, not fill up to its cap. 10,000 collectives of mixed
//! kinds (all-gather, all-to-all, reduce-scatter, all-reduce, a pad and redistribution
//! plans) on tensors of 24 KiB to 1.5 MiB per rank, with the process's resident memory
//! sampled along the way: it must stay flat, and within a small multiple of the peak bytes
//! of live tensors (summed over the ranks) above the resident memory measured before the
//! loop. Every rank also checks the pool's own bound after every step.
//!
//! Alone in its test binary: resident memory is the whole process's.

use dtensor::kernels::memory;
use dtensor::prelude::*;
use std::sync::Mutex;

/// Resident memory of this process in bytes (Linux); `None` elsewhere.
fn rss_bytes() -> Option<usize> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: usize = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

const MIB: f64 = (1 << 20) as f64;
const RANKS: usize = 4;
const COLLECTIVES: u64 = 10_000;
/// Rank 0 samples resident memory every this many collectives.
const SAMPLE_EVERY: u64 = 250;

/// Per-rank f32 elements for step `i`: 24 KiB to 1.5 MiB, spread over the range
/// (deterministic: every rank computes the same sizes).
fn elems(i: u64) -> usize {
    let x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40; // 24 bits
    let (lo, hi) = (6 << 10, 384 << 10); // 24 KiB, 1.5 MiB of f32
                                         // Log-uniform-ish: square a uniform fraction so small sizes are as common as large.
    let f = (x as f64 / (1u64 << 24) as f64).powi(2);
    lo + ((hi - lo) as f64 * f) as usize
}

#[test]
fn mixed_collectives_keep_resident_memory_flat() {
    let Some(baseline) = rss_bytes() else {
        eprintln!("pool soak: skipped (no /proc/self/statm)");
        return;
    };
    let samples = Mutex::new(Vec::<(u64, usize)>::new());
    let peaks = threads::launch(RANKS, |world| -> Result<usize> {
        let mesh = DeviceMesh::new(world, Mesh::new(&[(AxisKind::Dp, RANKS)])?)?;
        let (s0, s1, r) = (
            Placement::Shard(0),
            Placement::Shard(1),
            Placement::Replicate,
        );
        let count = |mesh: &DeviceMesh| -> u64 {
            mesh.counters()
                .iter()
                .map(|(_, c)| {
                    [
                        CollectiveKind::AllGather,
                        CollectiveKind::ReduceScatter,
                        CollectiveKind::AllReduce,
                        CollectiveKind::AllToAll,
                    ]
                    .iter()
                    .map(|&k| c.calls(k))
                    .sum::<u64>()
                })
                .sum()
        };
        let start = count(&mesh);
        let mut i = 0u64;
        let mut next_sample = 0;
        loop {
            let done = count(&mesh) - start;
            if done >= COLLECTIVES {
                break;
            }
            if mesh.rank() == 0 && done >= next_sample {
                samples
                    .lock()
                    .unwrap()
                    .push((done, rss_bytes().unwrap_or(0)));
                next_sample += SAMPLE_EVERY;
            }
            // A [4·rows, 64] f32 tensor sharded on rows: `rows·64` elements per rank.
            let n = elems(i);
            let rows = (n / 64).max(1);
            let global = [RANKS * rows, 64];
            let local = Tensor::from_fn(&[rows, 64], |k| (k % 7) as f32);
            let x = AnyDTensor::from_local(local, &global, &[s0], &mesh)?;
            match i % 5 {
                // All-gather, then back to shards (a chunk, no collective).
                0 => {
                    let y = x.redistribute(&[r])?;
                    std::hint::black_box(y.redistribute(&[s0])?);
                }
                // All-to-all S0 → S1 and back.
                1 => {
                    let y = x.redistribute(&[s1])?;
                    std::hint::black_box(y.redistribute(&[s0])?);
                }
                // Pad to partial, then reduce-scatter back to S0.
                2 => {
                    let p = x.apply(0, StepKind::PadToPartial { dim: 0 })?;
                    std::hint::black_box(p.apply(0, StepKind::ReduceScatter { dim: 0 })?);
                }
                // Pad to partial, then all-reduce to replicate.
                3 => {
                    let p = x.apply(0, StepKind::PadToPartial { dim: 0 })?;
                    std::hint::black_box(p.apply(0, StepKind::AllReduce)?);
                }
                // A plan: S0 → S1 → R (all-to-all, then column all-gather).
                _ => {
                    let y = x.redistribute(&[s1])?;
                    let plan = y.plan(&[r])?;
                    std::hint::black_box(y.run_plan(&plan)?);
                }
            }
            i += 1;
            // The pool's own bound: cached and live buffers within the peak of live ones
            // (by capacity: up to a size class, a quarter, above their elements).
            let (live, cached) = (memory::live_bytes(), memory::cached_bytes());
            assert!(
                live + cached <= memory::peak_bytes() * 5 / 4,
                "rank {}: live {live} + cached {cached} above 1.25 × peak {}",
                mesh.rank(),
                memory::peak_bytes()
            );
        }
        if mesh.rank() == 0 {
            samples
                .lock()
                .unwrap()
                .push((count(&mesh) - start, rss_bytes().unwrap_or(0)));
        }
        let cached = memory::cached_bytes();
        assert_eq!(memory::release_cached(), cached);
        assert_eq!(memory::cached_bytes(), 0);
        Ok(memory::peak_bytes())
    });
    let peak_live: usize = peaks.into_iter().map(|p| p.unwrap()).sum();
    let samples = samples.into_inner().unwrap();
    let rss: Vec<usize> = samples.iter().map(|s| s.1).collect();
    let show = |s: &[(u64, usize)]| {
        s.iter()
            .map(|(c, b)| format!("{c}: {:.1}", *b as f64 / MIB))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let n = samples.len();
    eprintln!(
        "pool soak: baseline {:.1} MiB, peak live {:.1} MiB (4 ranks); RSS MiB after collectives: first {}; last {}",
        baseline as f64 / MIB,
        peak_live as f64 / MIB,
        show(&samples[..5.min(n)]),
        show(&samples[n.saturating_sub(5)..]),
    );
    // Early steady state: the samples of the first half after the first tenth (warm-up
    // fills the pools); late: the second half. Resident memory moves up and down with what
    // the allocator keeps, so each is the highest sample of its window.
    let early = rss[n / 10..n / 2].iter().copied().max().unwrap();
    let late = rss[n / 2..].iter().copied().max().unwrap();
    let max = rss.iter().copied().max().unwrap();
    // Tensors and the pool hold at most 1.25 × the peak of live bytes (asserted per rank
    // above); the system allocator keeps some freed memory of its own on top. With glibc
    // that was up to 2.5 × peak live above the baseline while freeing a large mmapped
    // buffer raised its mmap threshold, so that later ones came from arenas that kept
    // their pages; the pool now frees its buffers shrunk (`CpuStorage::free_shrunk`) and
    // the threshold stays put. Before the pool followed its working set, 5.5 GB and
    // climbing.
    let limit = baseline + 2 * peak_live;
    eprintln!(
        "pool soak: highest {:.1} MiB = baseline + {:.2} × peak live",
        max as f64 / MIB,
        max.saturating_sub(baseline) as f64 / peak_live as f64
    );
    assert!(
        max <= limit,
        "resident memory {:.1} MiB exceeds baseline {:.1} MiB + 2 × peak live {:.1} MiB",
        max as f64 / MIB,
        baseline as f64 / MIB,
        peak_live as f64 / MIB
    );
    // Flat: the second half grows by at most half the peak live bytes over the first.
    assert!(
        late <= early + peak_live / 2,
        "resident memory grew from {:.1} MiB to {:.1} MiB (peak live {:.1} MiB)",
        early as f64 / MIB,
        late as f64 / MIB,
        peak_live as f64 / MIB
    );
}
