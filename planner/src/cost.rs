//! A step-time estimate to rank compositions, and the search over them.
//!
//! **Cost model.** One optimizer step takes
//!
//! `time = compute / (1 − bubble) + Σ_axis bytes_per_rank(axis) / bandwidth(axis)`
//!
//! - `compute`: `6·N·tokens` FLOPs for forward and backward (`N` the parameters a token
//!   passes through: all dense ones, `top_k/experts` of the experts), `+2·N·tokens` with
//!   recomputation, plus attention's `12·layers·seq·hidden` per token (`×4/3` recomputed),
//!   divided over the ranks and by the device's sustained FLOP/s (`--tflops`);
//! - `bubble`: the schedule's ([`crate::bubble`]);
//! - communication is *not* overlapped with compute (dtensor's default: overlap is off),
//!   and each axis's bytes a rank sends cross at the bandwidth of that axis's groups:
//!   the mesh is laid out `[Pp, Dp, Ep, Cp, Tp]` with `Tp` innermost (consecutive ranks),
//!   so an axis's group spans `stride·degree` consecutive ranks (`stride` = the product of
//!   the degrees inside it); it is on the fast intra-node link (`--intra-gbps`, GB/s per
//!   rank) when that span fits in a node (`--node-size`), otherwise on the inter-node link
//!   (`--inter-gbps`, GB/s per rank);
//! - a latency term of `latency_us` per collective call is ignored for ranking (the
//!   bytes dominate for the models the presets name).
//!
//! Compositions whose per-rank memory ([`crate::Memory::total`]) exceeds the device's are
//! refused with the excess.

use crate::{plan, Axis, Composition, DataKind, Model, ParallelConfig, Plan};

/// The machine: devices per node, per-rank bandwidth inside and across nodes (GB/s),
/// sustained compute (TFLOP/s), memory per device (GiB).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Interconnect {
    /// Devices (ranks) per node.
    pub node_size: usize,
    /// Bandwidth per rank inside a node, GB/s (10⁹ bytes per second).
    pub intra_gbps: f64,
    /// Bandwidth per rank across nodes, GB/s.
    pub inter_gbps: f64,
    /// Sustained compute per device, TFLOP/s (10¹² FLOP per second).
    pub tflops: f64,
    /// Memory per device, GiB (2³⁰ bytes); compositions needing more are ranked last.
    pub memory_gib: f64,
}

impl Default for Interconnect {
    /// An 8×H200 node: NVLink 900 GB/s, 400 Gb/s InfiniBand per GPU (50 GB/s), 400
    /// TFLOP/s sustained bf16, 141 GB (131 GiB) of memory.
    fn default() -> Self {
        Interconnect {
            node_size: 8,
            intra_gbps: 900.0,
            inter_gbps: 50.0,
            tflops: 400.0,
            memory_gib: 131.0,
        }
    }
}

/// A ranked composition.
#[derive(Clone, Debug)]
pub struct Ranked {
    /// The composition's plan (bytes, memory, bubble).
    pub plan: Plan,
    /// Estimated seconds per step.
    pub step_secs: f64,
    /// Seconds of it spent on communication, per axis.
    pub comm_secs: Vec<(Axis, f64)>,
    /// Bytes over the device's memory (0: fits).
    pub over_bytes: u64,
}

/// Whether `axis`'s groups fit inside a node.
pub fn intra_node(c: &Composition, axis: Axis, node_size: usize) -> bool {
    let order = Axis::ALL;
    let deg = |a: Axis| crate::degree(c, a);
    let i = order.iter().position(|&a| a == axis).unwrap();
    let stride: usize = order[i + 1..].iter().map(|&a| deg(a)).product();
    stride * deg(axis) <= node_size
}

/// The step-time estimate of `p` on `net` (see the module docs).
pub fn estimate(p: &Plan, net: &Interconnect) -> Ranked {
    let (m, c) = (&p.model, &p.composition);
    let tokens = p.tokens as f64;
    let active: u64 = crate::param_list(m, 1, 1, false)
        .iter()
        .map(|q| match (q.kind, m.moe) {
            (crate::Kind::ExpertW, Some(moe)) => q.global * moe.top_k as u64 / moe.experts as u64,
            _ => q.global,
        })
        .sum();
    let attn = 12.0 * m.layers as f64 * m.seq_len as f64 * m.hidden as f64;
    let (mul, attn_mul) = if c.recompute {
        (8.0, 4.0 / 3.0)
    } else {
        (6.0, 1.0)
    };
    let flops = (mul * active as f64 + attn * attn_mul) * tokens / c.world() as f64;
    let compute = flops / (net.tflops * 1e12) / (1.0 - p.bubble);
    let mut comm_secs = Vec::new();
    let mut total = compute;
    for a in Axis::ALL {
        let per_rank = p.axis_bytes(a) as f64 / c.world() as f64;
        if per_rank == 0.0 {
            continue;
        }
        let bw = if intra_node(c, a, net.node_size) {
            net.intra_gbps
        } else {
            net.inter_gbps
        };
        let s = per_rank / (bw * 1e9);
        comm_secs.push((a, s));
        total += s;
    }
    let limit = (net.memory_gib * (1u64 << 30) as f64) as u64;
    let over_bytes = p.peak_bytes().saturating_sub(limit);
    Ranked {
        plan: p.clone(),
        step_secs: total,
        comm_secs,
        over_bytes,
    }
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Every composition of `devices` ranks the model admits (SP on whenever `tp > 1`, bf16
/// compute, DDP / ZeRO-1 / FSDP, with and without recomputation, ring CP, 1F1B for
/// `pp > 1`, and the fewest microbatches (gradient accumulation) that fit), estimated and
/// sorted: those that fit by step time, then those that do not by how much they exceed
/// the memory.
pub fn rank(model: &Model, devices: usize, net: &Interconnect) -> Vec<Ranked> {
    let mut out = Vec::new();
    for &tp in &divisors(devices) {
        for &pp in &divisors(devices / tp) {
            for &cp in &divisors(devices / tp / pp) {
                for &ep in &divisors(devices / tp / pp / cp) {
                    if ep > 1 && model.moe.is_none() {
                        continue;
                    }
                    let dp = devices / tp / pp / cp / ep;
                    let per_data = model.global_batch / (dp * ep).max(1);
                    // Microbatch counts to try, fewest first (pp > 1: at least pp).
                    let ms: Vec<usize> = divisors(per_data.max(1))
                        .into_iter()
                        .filter(|&m| m >= pp)
                        .collect();
                    for data in [DataKind::Ddp, DataKind::Zero1, DataKind::Fsdp] {
                        if dp == 1 && data != DataKind::Ddp {
                            continue;
                        }
                        for recompute in [false, true] {
                            // The fewest microbatches that fit (more only add traffic
                            // and bubble); if none fits, the most (least memory).
                            let mut chosen: Option<Ranked> = None;
                            for &m in &ms {
                                let degrees = ParallelConfig {
                                    pp,
                                    dp,
                                    ep,
                                    cp,
                                    tp,
                                    sp: tp > 1,
                                };
                                let c = Composition {
                                    data,
                                    recompute,
                                    microbatches: m,
                                    bf16: true,
                                    ..Composition::of(degrees)
                                };
                                if let Ok(p) = plan(model, &c) {
                                    let r = estimate(&p, net);
                                    let fits = r.over_bytes == 0;
                                    chosen = Some(r);
                                    if fits {
                                        break;
                                    }
                                }
                            }
                            out.extend(chosen);
                        }
                    }
                }
            }
        }
    }
    out.sort_by(|a, b| {
        (a.over_bytes > 0)
            .cmp(&(b.over_bytes > 0))
            .then(if a.over_bytes > 0 {
                a.over_bytes.cmp(&b.over_bytes)
            } else {
                a.step_secs.total_cmp(&b.step_secs)
            })
    });
    out
}
