//! Conformance of every single-axis transition (and its adjoint) against the slow
//! reference, on 1-D (4), 2-D (2×2, 4×2), 3-D (2×2×2) and 4-D (2×2×1×2) meshes of thread
//! ranks.
//!
//! For each mesh, each axis, each transition of the table in `dtensor/src/plan.rs`, tensor dims 0, 1 and
//! last, and extents 4k, 4k+1, 4k+2, smaller than the mesh and one row, with the other
//! axes replicated, sharding another dim, or (outer axis) sharding the same dim:
//! - the forward result holds exactly the reference slice of the global tensor (or, for a
//!   `Partial` result, reduces to it), with the placement the table gives;
//! - exactly one collective of the table's kind on that axis (none for local steps), none
//!   on the other axes, and the bytes the counters' table gives;
//! - the adjoint, run on a gradient laid out as the dual of the result, returns a gradient
//!   laid out as the dual of the input holding the same global value;
//! - ranks that must be replicas hold bitwise identical locals.

mod common;

use common::*;
use dtensor::prelude::*;
use dtensor_kernels::chunk_sizes;
use std::collections::BTreeMap;

type CaseOutput = (String, Vec<usize>, Vec<Placement>, Vec<u64>);

/// `(source placement, step)` pairs that exercise every row of the table for dim `d`.
fn transitions(d: usize, ndim: usize) -> Vec<(Placement, StepKind)> {
    let e = (d + 1) % ndim;
    vec![
        (Placement::Shard(d), StepKind::AllGather { dim: d }),
        (Placement::Shard(d), StepKind::AllGatherInvariant { dim: d }),
        (SUM, StepKind::ReduceScatter { dim: d }),
        (SUM, StepKind::AllReduce),
        (Placement::Shard(d), StepKind::AllToAll { from: d, to: e }),
        (Placement::Shard(e), StepKind::AllToAll { from: e, to: d }),
        (Placement::Replicate, StepKind::Chunk { dim: d }),
        (Placement::Invariant, StepKind::Chunk { dim: d }),
        (Placement::Shard(d), StepKind::PadToPartial { dim: d }),
        (Placement::Invariant, StepKind::ToReplicate),
        (Placement::Replicate, StepKind::ToInvariant),
        (
            Placement::Replicate,
            StepKind::ToPartial { op: PartialOp::Sum },
        ),
        (
            Placement::Invariant,
            StepKind::ToPartial { op: PartialOp::Sum },
        ),
    ]
}

/// Expected bytes received by this rank, from the counters' table in dtensor-collectives.
fn expected_bytes(kind: StepKind, n: usize, coord: usize, before: &Tensor, after: &Tensor) -> u64 {
    let elems = match kind {
        StepKind::AllGather { .. } | StepKind::AllGatherInvariant { .. } => {
            after.numel() - before.numel()
        }
        StepKind::ReduceScatter { .. } => after.numel() * (n - 1),
        StepKind::AllReduce => {
            let own = chunk_sizes(before.numel(), n)[coord];
            own * (n - 1) + before.numel() - own
        }
        StepKind::AllToAll { from, to } => {
            // What stays on this rank: its own `from` extent times its own `to` chunk.
            let mut kept: Vec<usize> = before.shape().to_vec();
            kept[to] = after.shape()[to];
            debug_assert_eq!(kept[from], before.shape()[from]);
            after.numel() - kept.iter().product::<usize>()
        }
        _ => 0,
    };
    (elems * 8) as u64
}

fn run_mesh_conformance(axes: &[(AxisKind, usize)]) {
    let ndim = 3;
    let outputs = on_mesh(axes, |mesh| {
        let m = mesh.mesh();
        let mut out: Vec<CaseOutput> = Vec::new();
        let mut checked = 0usize;
        for axis in 0..m.ndim() {
            let n = m.size(axis);
            for d in [0, 1, ndim - 1] {
                let e = (d + 1) % ndim;
                for extent in [8, 9, 10, n.saturating_sub(1).max(1), 1] {
                    let mut shape = vec![5, 3, 6];
                    shape[d] = extent;
                    let g = int_global(&shape);
                    let h = int_global(&shape).scale(3.0).map(|v| v + 1.0);
                    for (src, kind) in transitions(d, ndim) {
                        // Background placements on the other axes.
                        let mut backgrounds: Vec<Vec<Placement>> =
                            vec![vec![Placement::Replicate; m.ndim()]];
                        let free =
                            (0..ndim).find(|x| !kind.dims().contains(x) && *x != d && *x != e);
                        if let Some(f) = free {
                            backgrounds.push(vec![Placement::Shard(f); m.ndim()]);
                        }
                        if axis > 0 {
                            // An outer axis sharding the same dim: the step's group covers
                            // only the outer chunk (nested torch.chunk).
                            let mut b = vec![Placement::Replicate; m.ndim()];
                            b[0] = Placement::Shard(kind.dims().first().copied().unwrap_or(d));
                            backgrounds.push(b);
                        }
                        for (bi, mut placements) in backgrounds.into_iter().enumerate() {
                            placements[axis] = src;
                            let case = format!(
                                "{m} axis {axis} {kind:?} from {src} bg{bi} {placements:?} shape {shape:?}"
                            );
                            let x = distribute_any(&g, &placements, mesh)?;
                            let before = mesh.counters();
                            let y = x.clone().apply(axis, kind)?;
                            let after = mesh.counters();

                            let target = kind.target(src).unwrap();
                            assert_eq!(y.placements()[axis], target, "{case}");
                            for (a, ((_, b0), (_, b1))) in before.iter().zip(&after).enumerate() {
                                let d = b1.since(b0);
                                if a == axis {
                                    let want = kind.collective().map_or(0, |_| 1);
                                    assert_eq!(
                                        d.collectives(),
                                        want,
                                        "{case}: collectives on the axis"
                                    );
                                    if let Some(c) = kind.collective() {
                                        assert_eq!(d.calls(c), 1, "{case}: {} calls", c.name());
                                    }
                                    let coord = mesh.coords()[axis];
                                    let want_bytes =
                                        expected_bytes(kind, n, coord, x.as_local(), y.as_local());
                                    assert_eq!(d.bytes_received, want_bytes, "{case}: bytes");
                                } else {
                                    assert_eq!(
                                        d.collectives(),
                                        0,
                                        "{case}: collectives on axis {a}"
                                    );
                                }
                            }
                            if !target.is_partial()
                                && y.placements().iter().all(|p| !p.is_partial())
                            {
                                let want = expected_local(m, y.placements(), mesh.coords(), &g);
                                assert_eq!(y.as_local(), &want, "{case}: forward local");
                            }
                            assert_eq!(y.full_tensor()?, g, "{case}: forward global value");

                            // Adjoint: gradient of the output (dual layout) -> gradient of
                            // the input (dual layout), same global value.
                            let adj = kind.adjoint(src).unwrap();
                            let dual_out: Vec<Placement> =
                                y.placements().iter().map(|p| p.dual()).collect();
                            let gy = distribute_any(&h, &dual_out, mesh)?;
                            let gx = gy.apply(axis, adj)?;
                            let dual_in: Vec<Placement> =
                                x.placements().iter().map(|p| p.dual()).collect();
                            assert_eq!(
                                gx.placements(),
                                dual_in.as_slice(),
                                "{case}: adjoint layout"
                            );
                            if gx.placements().iter().all(|p| !p.is_partial()) {
                                let want = expected_local(m, gx.placements(), mesh.coords(), &h);
                                assert_eq!(gx.as_local(), &want, "{case}: adjoint local");
                            }
                            assert_eq!(gx.full_tensor()?, h, "{case}: adjoint global value");

                            let bits = y
                                .as_local()
                                .to_f64_vec()
                                .iter()
                                .map(|v| v.to_bits())
                                .collect();
                            out.push((case, mesh.coords().to_vec(), y.placements().to_vec(), bits));
                            checked += 1;
                        }
                    }
                }
            }
        }
        Ok((checked, out))
    });
    let checked = outputs[0].0;
    assert!(checked > 100, "only {checked} cases");
    println!(
        "{} ranks x {checked} transition cases checked",
        outputs.len()
    );
    assert_replicas_identical(outputs.into_iter().map(|(_, o)| o).collect());
}

/// Ranks whose coordinates differ only on `R`/`I` axes must hold identical bits.
fn assert_replicas_identical(per_rank: Vec<Vec<CaseOutput>>) {
    // (case, coordinates with replicated axes masked) -> (rank, bits) of each member.
    type Members<'a> = Vec<(usize, &'a Vec<u64>)>;
    let mut groups: BTreeMap<(String, Vec<usize>), Members> = BTreeMap::new();
    for (rank, outs) in per_rank.iter().enumerate() {
        for (case, coords, placements, bits) in outs {
            let key: Vec<usize> = coords
                .iter()
                .zip(placements)
                .map(|(&c, p)| {
                    if matches!(p, Placement::Replicate | Placement::Invariant) {
                        usize::MAX
                    } else {
                        c
                    }
                })
                .collect();
            groups
                .entry((case.clone(), key))
                .or_default()
                .push((rank, bits));
        }
    }
    for ((case, _), members) in groups {
        for (rank, bits) in &members[1..] {
            assert_eq!(
                *bits, members[0].1,
                "{case}: rank {rank} differs from rank {}",
                members[0].0
            );
        }
    }
}

#[test]
fn transitions_mesh_1d_4_match_reference() {
    run_mesh_conformance(&[(AxisKind::Tp, 4)]);
}

#[test]
fn transitions_mesh_2d_2x2_match_reference() {
    run_mesh_conformance(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)]);
}

#[test]
fn transitions_mesh_2d_4x2_match_reference() {
    run_mesh_conformance(&[(AxisKind::Dp, 4), (AxisKind::Tp, 2)]);
}

#[test]
fn transitions_mesh_3d_2x2x2_match_reference() {
    run_mesh_conformance(&[(AxisKind::Dp, 2), (AxisKind::Cp, 2), (AxisKind::Tp, 2)]);
}

#[test]
fn transitions_mesh_4d_2x2x1x2_match_reference() {
    // Four axes, one of size 1 (a degenerate group must behave like any other).
    run_mesh_conformance(&[
        (AxisKind::Pp, 2),
        (AxisKind::Dp, 2),
        (AxisKind::Cp, 1),
        (AxisKind::Tp, 2),
    ]);
}

/// all_reduce of order-sensitive float terms: every replica gets the same bits, and they
/// equal the left-to-right sum in rank order.
#[test]
fn all_reduce_partial_replicas_bitwise_identical() {
    for axes in [
        vec![(AxisKind::Tp, 4)],
        vec![(AxisKind::Dp, 2), (AxisKind::Tp, 2)],
        vec![(AxisKind::Dp, 2), (AxisKind::Cp, 2), (AxisKind::Tp, 2)],
    ] {
        let shape = [7, 5];
        let outs = on_mesh(&axes, |mesh| {
            let m = mesh.mesh();
            let last = m.ndim() - 1;
            let n = m.size(last);
            // Each rank's term: a float pattern depending on its coordinate on the last axis.
            let c = mesh.coords()[last];
            let term = float_global(&shape).map(|v| v * (1.0 + c as f64 * 1e-3) + c as f64 * 1e7);
            let mut placements = vec![Placement::Replicate; m.ndim()];
            placements[last] = SUM;
            let x = AnyDTensor::from_local(term, &shape, &placements, mesh)?;
            let y = x.redistribute(&vec![Placement::Replicate; m.ndim()])?;
            // Reference: terms summed left to right in coordinate order.
            let terms: Vec<Tensor> = (0..n)
                .map(|k| float_global(&shape).map(|v| v * (1.0 + k as f64 * 1e-3) + k as f64 * 1e7))
                .collect();
            let want = terms[1..]
                .iter()
                .fold(terms[0].clone(), |acc, t| acc.add(t).unwrap());
            assert_eq!(y.as_local(), &want);
            Ok(y.as_local()
                .to_f64_vec()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<u64>>())
        });
        for o in &outs[1..] {
            assert_eq!(o, &outs[0]);
        }
    }
}
