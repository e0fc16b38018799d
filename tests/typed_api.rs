//! The typed API: each named transition gives the layout its type says, `_vjp` adjoints
//! accept only the dual gradient and return the dual of the input, typed plans print and
//! run, and elementwise ops follow the placement rules.

// Layouts are written inline so each result shows its type; real code names them with
// aliases (`type ColWeight = layout![..]`).
#![allow(clippy::type_complexity)]

mod common;

use common::*;
use dtensor::prelude::*;

const DP_TP: [(AxisKind, usize); 2] = [(AxisKind::Dp, 2), (AxisKind::Tp, 2)];

#[test]
fn named_transitions_give_their_typed_layouts() {
    on_mesh(&DP_TP, |mesh| {
        let g = int_global(&[6, 5]);
        let src = (mesh.rank() == 0).then_some(&g);
        let x = DTensor::<layout![Dp: Shard<0>, Tp: Shard<1>]>::distribute(src, 0, mesh)?;
        assert_eq!(x.placements(), &[Placement::Shard(0), Placement::Shard(1)]);

        let r: DTensor<layout![Dp: Shard<0>, Tp: Replicate]> = x.clone().all_gather(Tp)?;
        assert_eq!(
            r.as_local(),
            &expected_local(mesh.mesh(), r.placements(), mesh.coords(), &g)
        );
        let i: DTensor<layout![Dp: Shard<0>, Tp: Invariant]> =
            x.clone().all_gather_invariant(Tp)?;
        let back: DTensor<layout![Dp: Shard<0>, Tp: Shard<1>]> = i.clone().chunk(Tp)?;
        assert_eq!(back.as_local(), x.as_local());
        let rr: DTensor<layout![Dp: Shard<0>, Tp: Replicate]> = i.clone().to_replicate(Tp)?;
        let ii: DTensor<layout![Dp: Shard<0>, Tp: Invariant]> = rr.clone().to_invariant(Tp)?;
        assert_eq!(ii.as_local(), i.as_local());
        // Dp's all-to-all touches dims 0 and 1, so Tp (sharding dim 1 inside it) moves
        // first; the named call refuses the other order at run time (see errors.rs).
        let t: DTensor<layout![Dp: Shard<1>, Tp: Shard<0>]> =
            r.clone().all_to_all::<_, _, 1>(Dp)?.chunk(Tp)?;
        assert_eq!(
            t.as_local(),
            &expected_local(mesh.mesh(), t.placements(), mesh.coords(), &g)
        );
        assert_eq!(t.full_tensor()?, g);

        let p: DTensor<layout![Dp: Shard<0>, Tp: Partial]> = rr.clone().replicate_to_partial(Tp)?;
        let s: DTensor<layout![Dp: Shard<0>, Tp: Shard<1>]> = p.clone().reduce_scatter(Tp)?;
        assert_eq!(s.as_local(), x.as_local());
        let ar: DTensor<layout![Dp: Shard<0>, Tp: Invariant]> = p.all_reduce(Tp)?;
        assert_eq!(ar.as_local(), i.as_local());
        let pi: DTensor<layout![Dp: Shard<0>, Tp: Partial]> = ii.invariant_to_partial(Tp)?;
        assert_eq!(pi.full_tensor()?, g);
        let pad: DTensor<layout![Dp: Shard<0>, Tp: Partial]> = x.pad_to_partial(Tp)?;
        assert_eq!(pad.full_tensor()?, g);
        Ok(())
    });
}

#[test]
fn vjp_backward_returns_the_dual_gradient() {
    on_mesh(&DP_TP, |mesh| {
        let g = int_global(&[4, 6]);
        let h = int_global(&[4, 6]).scale(-2.0);
        let src = (mesh.rank() == 0).then_some(&g);
        let hsrc = (mesh.rank() == 0).then_some(&h);

        // Megatron's f: Invariant -> Replicate; its backward all-reduces the Partial gradient.
        let x = DTensor::<layout![Dp: Replicate, Tp: Invariant]>::distribute(src, 0, mesh)?;
        let (y, adj) = x.to_replicate_vjp(Tp)?;
        assert_eq!(
            y.placements(),
            &[Placement::Replicate, Placement::Replicate]
        );
        let gy = spread_partial_terms(
            DTensor::<layout![Dp: Partial, Tp: Partial]>::distribute(hsrc, 0, mesh)?.into_any(),
        );
        let gy = DTensor::<layout![Dp: Partial, Tp: Partial]>::try_from_any(gy)?;
        let before = mesh.comm(AxisKind::Tp).unwrap().counters();
        let gx: DTensor<layout![Dp: Partial, Tp: Invariant]> = adj.backward(gy)?;
        let after = mesh.comm(AxisKind::Tp).unwrap().counters();
        assert_eq!(after.since(&before).calls(CollectiveKind::AllReduce), 1);
        assert_eq!(gx.full_tensor()?, h);

        // all_gather's backward is a reduce-scatter.
        let x = DTensor::<layout![Dp: Replicate, Tp: Shard<1>]>::distribute(src, 0, mesh)?;
        let tp = mesh.comm(AxisKind::Tp).unwrap().clone();
        let before = tp.counters();
        let (_y, adj) = x.all_gather_vjp(Tp)?;
        // The adjoint records the forward step with the bytes it moved.
        let moved = tp.counters().since(&before).bytes_received;
        assert_eq!(adj.forward_plan().bytes_received(), moved);
        assert_eq!(moved, 4 * 3 * 8, "the peer's 4x3 f64 half");
        let gy = DTensor::<layout![Dp: Partial, Tp: Partial]>::distribute(hsrc, 0, mesh)?;
        let before = mesh.comm(AxisKind::Tp).unwrap().counters();
        let gx: DTensor<layout![Dp: Partial, Tp: Shard<1>]> = adj.backward(gy)?;
        let after = mesh.comm(AxisKind::Tp).unwrap().counters();
        assert_eq!(after.since(&before).calls(CollectiveKind::ReduceScatter), 1);
        assert_eq!(gx.full_tensor()?, h);

        // A multi-axis plan's adjoint runs the adjoint steps in reverse.
        let x = DTensor::<layout![Dp: Shard<0>, Tp: Shard<0>]>::distribute(src, 0, mesh)?;
        let (y, adj) = x.redistribute_vjp::<layout![Dp: Replicate, Tp: Shard<1>]>()?;
        assert_eq!(y.full_tensor()?, g);
        assert_eq!(
            adj.forward_plan().collectives(),
            2,
            "{}",
            adj.forward_plan()
        );
        let gy = DTensor::<layout![Dp: Partial, Tp: Shard<1>]>::distribute(hsrc, 0, mesh)?;
        let gx: DTensor<layout![Dp: Shard<0>, Tp: Shard<0>]> = adj.backward(gy)?;
        assert_eq!(
            gx.as_local(),
            &expected_local(mesh.mesh(), gx.placements(), mesh.coords(), &h)
        );
        Ok(())
    });
}

#[test]
fn typed_plan_prints_and_runs() {
    let texts = on_mesh(&DP_TP, |mesh| {
        let g = int_global(&[8, 4]);
        let src = (mesh.rank() == 0).then_some(&g);
        let x = DTensor::<layout![Dp: Shard<0>, Tp: Shard<0>]>::distribute(src, 0, mesh)?;
        let plan = x.plan::<layout![Dp: Replicate, Tp: Shard<0>]>()?;
        let text = plan.to_string();
        assert_eq!(plan.plan().count(CollectiveKind::AllGather), 2);
        assert_eq!(plan.plan().collectives(), 2);
        let y = plan.run(x)?;
        assert_eq!(
            y.as_local(),
            &expected_local(mesh.mesh(), y.placements(), mesh.coords(), &g)
        );
        Ok(text)
    });
    let t = &texts[0];
    assert!(
        t.starts_with(
            "plan [S(0), S(0)] -> [R, S(0)] for global shape [8, 4]: 3 steps, 2 collectives"
        ),
        "{t}"
    );
    // f64: tp gathers 2x4 -> 4x4 (8 elements from its peer), dp 4x4 -> 8x4 (16 elements).
    assert!(
        t.contains("1. tp: S(0) -> R  all_gather (all_gather, 64 B received)"),
        "{t}"
    );
    assert!(
        t.contains("2. dp: S(0) -> R  all_gather (all_gather, 128 B received)"),
        "{t}"
    );
    assert!(t.contains("3. tp: R -> S(0)  chunk (local)"), "{t}");
}

#[test]
fn elementwise_ops_follow_placement_rules() {
    on_mesh(&DP_TP, |mesh| {
        let g = int_global(&[4, 4]);
        let src = (mesh.rank() == 0).then_some(&g);
        let p = DTensor::<layout![Dp: Replicate, Tp: Partial]>::distribute(src, 0, mesh)?;
        let p = DTensor::<layout![Dp: Replicate, Tp: Partial]>::try_from_any(
            spread_partial_terms(p.into_any()),
        )?;
        // Partial + Partial and scaling are linear: exact after the reduction.
        let sum = p.add(&p)?.scale(0.5)?;
        assert_eq!(sum.full_tensor()?, g);
        let r = sum.all_reduce(Tp)?.to_replicate(Tp)?;
        let relu = r.map(|v| v.max(0.0))?;
        assert_eq!(relu.full_tensor()?, g.map(|v| v.max(0.0)));
        let sq = r.mul(&r)?;
        assert_eq!(sq.full_tensor()?, g.mul(&g).unwrap());
        let gelu = r.gelu()?;
        let x = 1.5f64;
        let want = 0.5
            * x
            * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh());
        let one = DTensor::<layout![Dp: Replicate, Tp: Replicate]>::from_local(
            Tensor::from_vec(vec![x], &[1]).unwrap(),
            &[1],
            mesh,
        )?;
        assert_eq!(one.gelu()?.as_local().to_f64_vec(), vec![want]);
        assert_eq!(gelu.global_shape(), &[4, 4]);
        Ok(())
    });
}

#[test]
fn receipt_reports_each_axis() {
    let receipts = on_mesh(&DP_TP, |mesh| {
        let g = int_global(&[4, 4]);
        let src = (mesh.rank() == 0).then_some(&g);
        let x = DTensor::<layout![Dp: Shard<0>, Tp: Shard<1>]>::distribute(src, 0, mesh)?;
        let _ = x.all_gather(Tp)?.all_gather(Dp)?;
        Ok(mesh.receipt())
    });
    // tp: 2x2 -> 2x4 receives 4 f64; dp: 2x4 -> 4x4 receives 8 f64.
    assert_eq!(
        receipts[0],
        "dp: all_gather=1 sent=64B received=64B\ntp: all_gather=1 sent=32B received=32B\n"
    );
}

/// R → S(0) is a view of the replicated buffer (no copy, so its time does not grow with
/// size), and gathering that shard back writes only the peers' rows around it.
#[test]
fn chunk_of_leading_dim_is_zero_copy_and_gather_reuses_the_buffer() {
    on_mesh(&[(AxisKind::Tp, 2)], |mesh| {
        let g = int_global(&[6, 4]);
        let r = DTensor::<layout![Tp: Replicate]>::from_local(g.deep_clone(), &[6, 4], mesh)?;
        let keep = r.as_local().clone(); // shares the buffer
        let s: DTensor<layout![Tp: Shard<0>]> = r.chunk(Tp)?;
        assert!(s.as_local().shares_storage_with(&keep), "chunk copied");
        drop(keep);
        // Where the full buffer starts: this rank's rows begin 3·4 elements in on rank 1.
        let shard_start = s.as_local().as_slice::<f64>()?.as_ptr();
        let buffer_start = shard_start.wrapping_sub(mesh.rank() * 12);
        let back: DTensor<layout![Tp: Replicate]> = s.all_gather(Tp)?;
        assert_eq!(back.as_local(), &g);
        assert_eq!(
            back.as_local().as_slice::<f64>()?.as_ptr(),
            buffer_start,
            "gathered in place"
        );
        Ok(())
    });
}
