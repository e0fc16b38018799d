//! Every error path of the distributed layer: bad shapes, placements, meshes and layouts
//! give an `Err` that names the op, shapes and placements; failing or disagreeing ranks
//! give every rank an `Err`, never a hang.

mod common;

use common::*;
use dtensor::prelude::*;
use dtensor_collectives::threads::{launch_with, Options, RankError};
use std::time::{Duration, Instant};

const DP_TP: [(AxisKind, usize); 2] = [(AxisKind::Dp, 2), (AxisKind::Tp, 2)];

fn err_text<T: std::fmt::Debug>(r: Result<T>) -> String {
    r.expect_err("expected an error").to_string()
}

#[test]
fn from_local_wrong_shape_names_shapes_and_placements() {
    on_mesh(&DP_TP, |mesh| {
        let e = err_text(DTensor::<layout![Dp: Shard<0>, Tp: Replicate]>::from_local(
            Tensor::zeros(&[3, 4], DType::F32),
            &[8, 4],
            mesh,
        ));
        assert!(
            e.contains("DTensor::from_local") && e.contains("[3, 4]") && e.contains("[8, 4]"),
            "{e}"
        );
        assert!(e.contains("[S(0), R]") && e.contains("[4, 4]"), "{e}");
        Ok(())
    });
}

#[test]
fn shard_dim_out_of_range_is_an_error() {
    on_mesh(&DP_TP, |mesh| {
        let e = err_text(DTensor::<layout![Dp: Shard<2>, Tp: Replicate]>::from_local(
            Tensor::zeros(&[4, 4], DType::F32),
            &[4, 4],
            mesh,
        ));
        assert!(
            e.contains("S(2) shards dim 2 of a tensor with 2 dims"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn typed_layout_on_a_mesh_with_other_axes_is_an_error() {
    on_mesh(&DP_TP, |mesh| {
        let e = err_text(
            DTensor::<layout![Tp: Replicate, Dp: Replicate]>::from_local(
                Tensor::zeros(&[4], DType::F32),
                &[4],
                mesh,
            ),
        );
        assert!(
            e.contains("expected a mesh with axes [Tp, Dp]") && e.contains("[dp=2, tp=2]"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn try_from_any_with_other_placements_is_an_error() {
    on_mesh(&DP_TP, |mesh| {
        let x = distribute_any(&int_global(&[4, 4]), &[Placement::Shard(0), SUM], mesh)?;
        let e = err_text(DTensor::<layout![Dp: Shard<0>, Tp: Replicate]>::try_from_any(x));
        assert!(
            e.contains("expected [Dp: S(0), Tp: R]")
                && e.contains("laid out as [Dp: S(0), Tp: P(sum)]"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn distribute_without_a_source_tensor_fails_on_every_rank() {
    let mesh = Mesh::new(&DP_TP).unwrap();
    let results = threads::launch(4, |world| {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        DTensor::<layout![Dp: Replicate, Tp: Replicate]>::distribute(None, 1, &dm)
    });
    for r in results {
        let RankError::Returned(e) = r.unwrap_err() else {
            panic!("expected an Err")
        };
        assert!(
            e.to_string().contains("source rank 1 passed no tensor"),
            "{e}"
        );
    }
    on_mesh(&DP_TP, |mesh| {
        let g = int_global(&[2]);
        let e = err_text(
            DTensor::<layout![Dp: Replicate, Tp: Replicate]>::distribute(Some(&g), 7, mesh),
        );
        assert!(e.contains("source rank 7 outside a world of 4"), "{e}");
        Ok(())
    });
}

#[test]
fn named_transition_breaking_the_nesting_rule_is_an_error() {
    on_mesh(&DP_TP, |mesh| {
        let g = int_global(&[8, 4]);
        let x = DTensor::<layout![Dp: Shard<0>, Tp: Shard<0>]>::distribute(
            (mesh.rank() == 0).then_some(&g),
            0,
            mesh,
        )?;
        let e = err_text(x.clone().all_gather(Dp));
        assert!(
            e.contains("all_gather on axis Dp")
                && e.contains("axis Tp (right of Dp) also shards dim 0"),
            "{e}"
        );
        // The plan orders it correctly.
        let y = x.redistribute::<layout![Dp: Replicate, Tp: Shard<0>]>()?;
        assert_eq!(y.full_tensor()?, g);
        Ok(())
    });
}

#[test]
fn runtime_twin_rejects_wrong_placements() {
    on_mesh(&DP_TP, |mesh| {
        let x = distribute_any(&int_global(&[4, 4]), &[Placement::Replicate, SUM], mesh)?;
        let e = err_text(x.clone().apply(1, StepKind::AllGather { dim: 0 }));
        assert!(
            e.contains("all_gather does not apply to a P(sum) axis (it needs S(0))"),
            "{e}"
        );
        let e = err_text(x.clone().apply(0, StepKind::AllReduce));
        assert!(
            e.contains("all_reduce does not apply to a R axis (it needs Partial)"),
            "{e}"
        );
        let e = err_text(x.clone().apply(0, StepKind::Chunk { dim: 5 }));
        assert!(
            e.contains("dim 5 is outside a tensor of global shape [4, 4]"),
            "{e}"
        );
        let e = err_text(x.clone().apply(2, StepKind::ToReplicate));
        assert!(e.contains("axis index 2 outside the mesh"), "{e}");
        let e = err_text(x.map(|v| v.exp()));
        assert!(
            e.contains("DTensor::map") && e.contains("P(sum) holds pending partial sums"),
            "{e}"
        );
        let e = err_text(x.plan(&[Placement::Replicate, Placement::Partial(PartialOp::Max)]));
        assert!(e.contains("P(sum) cannot become P(max)"), "{e}");
        let m = distribute_any(
            &int_global(&[4, 4]),
            &[Placement::Replicate, Placement::Partial(PartialOp::Max)],
            mesh,
        )?;
        assert!(err_text(m.scale(2.0)).contains("do not scale linearly"));
        assert!(err_text(m.add(&m)).contains("do not add linearly"));
        let r = distribute_any(
            &int_global(&[4, 4]),
            &[Placement::Replicate, Placement::Replicate],
            mesh,
        )?;
        let e = err_text(x.add(&r));
        assert!(
            e.contains("DTensor::add: tensor is laid out as [R, R], expected [R, P(sum)]"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn operands_of_other_shapes_or_meshes_are_errors() {
    on_mesh(&DP_TP, |mesh| {
        let a = distribute_any(&int_global(&[4, 4]), &[Placement::Replicate; 2], mesh)?;
        let b = distribute_any(&int_global(&[4, 2]), &[Placement::Replicate; 2], mesh)?;
        assert!(err_text(a.add(&b)).contains("global shapes [4, 4] and [4, 2] differ"));
        let other = DeviceMesh::new(mesh.world().clone(), Mesh::new(&DP_TP)?)?;
        let c = distribute_any(&int_global(&[4, 4]), &[Placement::Replicate; 2], &other)?;
        assert!(err_text(a.add(&c)).contains("operands are on different meshes"));
        let plan = b.plan(&[Placement::Shard(0), Placement::Replicate])?;
        assert!(err_text(a.run_plan(&plan)).contains("Plan::run: tensor is laid out as [R, R] with global shape [4, 4], expected [R, R] with global shape [4, 2]"));
        Ok(())
    });
}

#[test]
fn adjoint_of_max_reduction_is_not_differentiable() {
    on_mesh(&DP_TP, |mesh| {
        let g = int_global(&[4]);
        let x = DTensor::<layout![Dp: Replicate, Tp: Partial<Max>]>::distribute(
            (mesh.rank() == 0).then_some(&g),
            0,
            mesh,
        )?;
        let (y, adj) = x.all_reduce_vjp(Tp)?;
        assert_eq!(y.full_tensor()?, g);
        let grad = DTensor::<layout![Dp: Partial, Tp: Invariant]>::distribute(
            (mesh.rank() == 0).then_some(&g),
            0,
            mesh,
        )?;
        let e = err_text(adj.backward(grad));
        assert!(
            e.contains("no linear adjoint for all_reduce of a P(max) axis"),
            "{e}"
        );
        Ok(())
    });
}

#[test]
fn device_mesh_of_wrong_world_size_is_an_error() {
    let results = threads::launch(3, |world| {
        DeviceMesh::new(world, Mesh::new(&DP_TP).unwrap()).map(|_| ())
    });
    for r in results {
        let RankError::Returned(e) = r.unwrap_err() else {
            panic!("expected an Err")
        };
        assert!(
            e.to_string()
                .contains("mesh [dp=2, tp=2] needs 4 ranks but the communicator has 3"),
            "{e}"
        );
    }
}

#[test]
fn rank_that_panics_before_a_transition_fails_its_peers() {
    let mesh = Mesh::new(&DP_TP).unwrap();
    let opts = Options {
        timeout: Duration::from_secs(60),
    };
    let start = Instant::now();
    let results = launch_with(4, opts, |world| {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let g = int_global(&[4, 4]);
        let x = DTensor::<layout![Dp: Replicate, Tp: Shard<0>]>::distribute(
            (dm.rank() == 0).then_some(&g),
            0,
            &dm,
        )?;
        if dm.rank() == 1 {
            panic!("rank 1 gives up");
        }
        x.all_gather(Tp)?.full_tensor()
    });
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "took {:?}",
        start.elapsed()
    );
    for (r, res) in results.into_iter().enumerate() {
        match (r, res) {
            (1, Err(RankError::Panicked(m))) => assert!(m.contains("rank 1 gives up")),
            (0, Err(RankError::Returned(e))) => {
                assert!(
                    matches!(
                        &e,
                        Error::Collective(dtensor::collectives::Error::RankFailed { rank: 1, .. })
                    ),
                    "{e}"
                )
            }
            // Ranks 2 and 3 form the other Tp group and never need rank 1 afterwards:
            // full_tensor of a [R, R] tensor is local. A failure stays where it matters.
            (2 | 3, Ok(_)) => {}
            (r, other) => panic!("rank {r}: unexpected {other:?}"),
        }
    }
}

#[test]
fn ranks_calling_different_transitions_all_get_mismatch() {
    let mesh = Mesh::new(&[(AxisKind::Tp, 2)]).unwrap();
    let results = threads::launch(2, |world| {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let x = distribute_any(&int_global(&[4, 4]), &[SUM], &dm)?;
        if dm.rank() == 0 {
            x.apply(0, StepKind::AllReduce).map(|_| ())
        } else {
            x.apply(0, StepKind::ReduceScatter { dim: 0 }).map(|_| ())
        }
    });
    for r in results {
        let RankError::Returned(e) = r.unwrap_err() else {
            panic!("expected an Err")
        };
        assert!(
            matches!(
                &e,
                Error::Collective(dtensor::collectives::Error::CollectiveMismatch { .. })
            ),
            "{e}"
        );
    }
}

#[test]
fn rank_that_never_arrives_times_out_everywhere() {
    let mesh = Mesh::new(&[(AxisKind::Tp, 2)]).unwrap();
    let opts = Options {
        timeout: Duration::from_millis(300),
    };
    let results = launch_with(2, opts, |world| {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let x = distribute_any(&int_global(&[4]), &[Placement::Shard(0)], &dm)?;
        if dm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(1500));
        }
        x.apply(0, StepKind::AllGather { dim: 0 }).map(|_| ())
    });
    let RankError::Returned(e) = results.into_iter().next().unwrap().unwrap_err() else {
        panic!()
    };
    assert!(
        matches!(
            &e,
            Error::Collective(dtensor::collectives::Error::Timeout { .. })
        ),
        "{e}"
    );
    assert!(e.to_string().contains("timed out"), "{e}");
}
