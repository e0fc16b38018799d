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

/// HSDP's placements over `[dp_replicate, dp_shard]`.
type Tokens = layout![DpReplicate: Shard<0>, DpShard: Shard<0>];
type W1Stored = layout![DpReplicate: Replicate, DpShard: Shard<1>];
type W2Stored = layout![DpReplicate: Replicate, DpShard: Shard<0>];
/// `W1Stored`'s raw gradient: reduce-scattered over dp_shard, pending over dp_replicate.
type W1Grad = layout![DpReplicate: Partial, DpShard: Shard<1>];

/// Trains `y = gelu(x·W1ᵀ)·W2ᵀ` on the mean of `Σ y²` over all tokens for 3 AdamW steps on
/// an HSDP mesh of `axes`; returns the losses and the whole parameters.
fn hsdp_mlp(axes: &[(AxisKind, usize); 2]) -> (Vec<f64>, Vec<Tensor>) {
    use dtensor::core::Tape;
    use dtensor::nn::{AdamW, Init, Optimizer, Param};
    const N: usize = 8;
    const H: usize = 4;
    const F: usize = 6;
    let x = Init::Normal { std: 1.0 }.full(5, 0, &[N, H], DType::F64);
    let w1 = Init::Normal { std: 0.5 }.full(5, 1, &[F, H], DType::F64);
    let w2 = Init::Normal { std: 0.5 }.full(5, 2, &[H, F], DType::F64);
    let mut ranks = on_mesh(axes, |mesh| {
        let root = |t: &Tensor| Some(t.clone()).filter(|_| mesh.rank() == 0);
        let xs = DTensor::<Tokens>::distribute(root(&x).as_ref(), 0, mesh)?;
        let mut p1 = Param::new(DTensor::<W1Stored>::distribute(
            root(&w1).as_ref(),
            0,
            mesh,
        )?);
        let mut p2 = Param::new(DTensor::<W2Stored>::distribute(
            root(&w2).as_ref(),
            0,
            mesh,
        )?);
        let mut opt = AdamW::new(0.05);
        let mut losses = Vec::new();
        for _ in 0..3 {
            let tape = Tape::new();
            // Forward: each parameter gathered over dp_shard only (FSDP within a group).
            let w1 = p1.on(&tape).all_gather(DpShard)?;
            let w2 = p2.on(&tape).all_gather(DpShard)?;
            let y = tape
                .constant(xs.clone())
                .matmul_t(&w1)?
                .gelu()?
                .matmul_t(&w2)?;
            let loss = y
                .mul(&y)?
                .sum_dim::<1>()?
                .sum_dim::<0>()?
                .scale(1.0 / N as f64)?;
            losses.push(
                loss.value()
                    .clone()
                    .all_reduce(DpShard)?
                    .all_reduce(DpReplicate)?
                    .as_local()
                    .to_f64_vec()[0],
            );
            let mut g = loss.backward()?;
            // The gathers' adjoints reduce-scattered over dp_shard; what is left pending
            // is the sum over the replica groups.
            let g1: DTensor<W1Grad> = p1.grad(&mut g)?;
            let g2 = p2.grad(&mut g)?;
            opt.begin_step();
            opt.update(&mut p1, &g1.all_reduce(DpReplicate)?)?;
            opt.update(&mut p2, &g2.all_reduce(DpReplicate)?)?;
        }
        Ok((
            losses,
            vec![p1.value().full_tensor()?, p2.value().full_tensor()?],
        ))
    });
    for r in &ranks {
        assert_eq!(r, &ranks[0], "replicas agree bitwise");
    }
    ranks.swap_remove(0)
}

#[test]
fn hsdp_2x2_trains_like_one_rank() {
    let (want_l, want_p) = hsdp_mlp(&[(DpReplicate::KIND, 1), (DpShard::KIND, 1)]);
    let (l, p) = hsdp_mlp(&HSDP);
    assert!(want_l[2] < want_l[0], "the loss goes down: {want_l:?}");
    for (a, b) in l.iter().zip(&want_l) {
        assert!((a - b).abs() <= 1e-12 * b.abs(), "loss {a} vs {b}");
    }
    for (a, b) in p.iter().zip(&want_p) {
        let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
        let scale = b.iter().fold(0f64, |m, v| m.max(v.abs()));
        let err = a
            .iter()
            .zip(&b)
            .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
        assert!(err <= 1e-12 * scale, "params differ by {err:e}");
    }
}
