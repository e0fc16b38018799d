//! User-declared mesh axes: HSDP's two data-parallel axes, declared here with
//! `mesh_axis!`, carry a parameter sharded on one and replicated on the other, and its
//! gradient down HSDP's path (reduce-scatter over `dp_shard`, then all-reduce over
//! `dp_replicate`), checked against the same sums taken on one rank.

mod common;

use common::*;
use dtensor::prelude::*;

dtensor::mesh_axis!(
    /// HSDP's replica axis: whole copies of the sharded model.
    pub DpReplicate, "dp_replicate", role = Dp
);
dtensor::mesh_axis!(
    /// HSDP's shard axis: parameters and gradients are split along it.
    pub DpShard, "dp_shard", role = Dp
);

/// `[dp_replicate=2, dp_shard=2]`: 4 ranks.
const HSDP: [(AxisKind, usize); 2] = [(DpReplicate::KIND, 2), (DpShard::KIND, 2)];
const SHAPE: [usize; 2] = [6, 5];

type Param = layout![DpReplicate: Replicate, DpShard: Shard<0>];
type Gathered = layout![DpReplicate: Replicate, DpShard: Replicate];
type Grad = layout![DpReplicate: Partial, DpShard: Partial];
type ShardedGrad = layout![DpReplicate: Partial, DpShard: Shard<0>];
type ReducedGrad = layout![DpReplicate: Invariant, DpShard: Shard<0>];

/// Rank `r`'s regression target: its loss is `½‖W − T_r‖²`, whose gradient is `W − T_r`.
fn target(r: usize) -> Vec<f64> {
    (0..SHAPE.iter().product())
        .map(|i| ((i * 13 + r * 29) % 17) as f64 - 8.0)
        .collect()
}

#[test]
fn hsdp_gathers_params_and_reduces_grads_over_two_dp_axes() {
    let w = int_global(&SHAPE);
    // One rank's view of the whole step: the gradient of Σ_r ½‖W − T_r‖² is Σ_r (W − T_r).
    let wv = w.to_f64_vec();
    let want_grad: Vec<f64> = (0..wv.len())
        .map(|i| (0..4).map(|r| wv[i] - target(r)[i]).sum())
        .collect();
    let want_grad = Tensor::from_vec(want_grad, &SHAPE).unwrap();

    let receipts = on_mesh(&HSDP, |mesh| {
        // Among axes of one role the layout's left one is outer: rank = dp_shard +
        // 2·dp_replicate, so dp_shard groups are neighbouring ranks.
        let r = mesh.rank();
        assert_eq!(mesh.coords(), &[r / 2, r % 2]);
        assert_eq!(mesh.mesh().axes_with_role(AxisRole::Dp).as_slice(), &[0, 1]);
        assert_eq!(mesh.comm(DpShard::KIND).unwrap().size(), 2);

        let p = DTensor::<Param>::distribute(Some(&w).filter(|_| r == 0), 0, mesh)?;
        assert_eq!(p.local_shape(), &[3, 5]);
        let before = mesh.counters();

        // Forward: the parameter is gathered over dp_shard only.
        let full: DTensor<Gathered> = p.all_gather(DpShard)?;
        assert_eq!(full.as_local(), &w);

        // Backward: each rank's own gradient term, summed over all four ranks.
        let local: Vec<f64> = full
            .as_local()
            .to_f64_vec()
            .iter()
            .zip(target(r))
            .map(|(w, t)| w - t)
            .collect();
        let g = DTensor::<Grad>::from_local(Tensor::from_vec(local, &SHAPE)?, &SHAPE, mesh)?;
        let plan = g.plan::<ReducedGrad>()?;
        let printed = plan.plan().to_string();
        assert!(
            printed.contains("dp_shard") && printed.contains("dp_replicate"),
            "{printed}"
        );
        let g: DTensor<ShardedGrad> = g.reduce_scatter(DpShard)?;
        let g: DTensor<ReducedGrad> = g.all_reduce(DpReplicate)?;
        assert_eq!(
            g.as_local(),
            &expected_local(mesh.mesh(), g.placements(), mesh.coords(), &want_grad)
        );
        assert_eq!(g.local_shape(), &[3, 5]);

        // What crossed each axis: two collectives on dp_shard, one on dp_replicate.
        let after = mesh.counters();
        let on = |k: AxisKind| {
            let i = after.iter().position(|(a, _)| *a == k).unwrap();
            after[i].1.since(&before[i].1)
        };
        let (shard, replicate) = (on(DpShard::KIND), on(DpReplicate::KIND));
        assert_eq!(shard.calls(CollectiveKind::AllGather), 1);
        assert_eq!(shard.calls(CollectiveKind::ReduceScatter), 1);
        assert_eq!(shard.collectives(), 2);
        assert_eq!(replicate.calls(CollectiveKind::AllReduce), 1);
        assert_eq!(replicate.collectives(), 1);

        assert_eq!(g.full_tensor()?, want_grad);
        Ok(mesh.receipt())
    });
    for receipt in receipts {
        let lines: Vec<&str> = receipt.lines().collect();
        assert_eq!(lines.len(), 2, "{receipt}");
        assert!(lines[0].starts_with("dp_replicate: "), "{receipt}");
        assert!(lines[1].starts_with("dp_shard: "), "{receipt}");
    }
}

#[test]
fn a_layout_over_other_axes_is_refused_by_name() {
    on_mesh(&HSDP, |mesh| {
        // Same axes, other order: not this mesh's layout.
        let e = DTensor::<layout![DpShard: Shard<0>, DpReplicate: Replicate]>::distribute(
            Some(&int_global(&SHAPE)).filter(|_| mesh.rank() == 0),
            0,
            mesh,
        )
        .expect_err("a layout in the wrong axis order must be refused");
        let msg = e.to_string();
        assert!(msg.contains("[DpShard, DpReplicate]"), "{msg}");
        assert!(msg.contains("[dp_replicate=2, dp_shard=2]"), "{msg}");
        Ok(())
    });
}

#[test]
fn a_mesh_with_two_axes_of_one_name_is_an_error() {
    dtensor::mesh_axis!(Shadow, "dp_shard", role = Dp);
    let e = Mesh::new(&[(DpShard::KIND, 2), (Shadow::KIND, 2)]).unwrap_err();
    assert!(e.to_string().contains("both named `dp_shard`"), "{e}");
}
