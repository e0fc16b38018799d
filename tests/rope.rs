//! `DTensor::rope` / `Var::rope` on meshes against one rank, bitwise: rows at their global
//! positions under `Shard<0>` (nested over two axes), heads split over `Tp`, the CP token
//! order of context parallelism (zigzag and contiguous chunks, with data blocks), packed
//! documents whose positions restart; and the run-time refusals. (The gradients against
//! finite differences, for every placement the rule allows, are in `autograd.rs`.)

mod common;

use common::{dist, float_global, on_mesh};
use dtensor::prelude::*;
use dtensor_core::RopePositions;
use dtensor_kernels::ops::{self, Rope, RopeScaling, RopeStyle};
use std::sync::Arc;

fn configs() -> [Rope; 2] {
    [
        Rope::new(4, 10_000.0, RopeStyle::Interleaved),
        Rope {
            rotary_dim: 2,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 16,
            },
            ..Rope::new(4, 10_000.0, RopeStyle::HalfSplit)
        },
    ]
}

/// The forward and the input gradient (seeded with `seed`) of RoPE on `x` laid out as `L`
/// on the mesh `axes`, both as full tensors in the tensor's own row order.
fn rope_on<L: dtensor_core::compute::rope::RopeLayout>(
    axes: &[(AxisKind, usize)],
    x: &Tensor,
    seed: &Tensor,
    cfg: &Rope,
    positions: &RopePositions,
) -> (Tensor, Tensor) {
    let results = on_mesh(axes, |m: &Arc<DeviceMesh>| {
        let tape = Tape::new();
        let xv = tape.leaf(dist::<L>(x, m));
        let y = xv.rope(cfg, positions)?;
        // The typed op and its twin compute the same local values.
        assert_eq!(
            xv.value().rope(cfg, positions)?.as_local(),
            y.value().as_local()
        );
        let y_full = y.value().full_tensor()?;
        let mut grads = y.backward_with(dist::<L::Grad>(seed, m))?;
        let dx: DTensor<L::Grad> = grads.take(&xv)?;
        Ok((y_full, dx.full_tensor()?))
    });
    // Every rank agrees.
    for r in &results[1..] {
        assert_eq!(r, &results[0]);
    }
    results.into_iter().next().unwrap()
}

#[test]
fn rope_sharded_rows_and_heads_equal_one_rank_bitwise() {
    // 12 tokens (samples of 6), 3 heads of 4: rows split over Dp and Tp nested, heads over
    // Tp (3 heads over 3 ranks). (No `Replicate`: its gradient is `Partial`, whose seeded
    // terms sum to the one-rank gradient only to rounding; `autograd.rs` checks it.)
    let (x, seed) = (float_global(&[12, 12]), float_global(&[12, 12]).scale(-0.5));
    let positions = RopePositions::Sequential {
        seq_len: 6,
        offset: 5,
    };
    let global: Vec<usize> = (0..12).map(|g| 5 + g % 6).collect();
    for cfg in configs() {
        let want = (
            ops::rope(&x, &global, &cfg).unwrap(),
            ops::rope_backward(&seed, &global, &cfg).unwrap(),
        );
        let one = rope_on::<layout![Dp: Shard<0>, Tp: Shard<1>]>(
            &[(AxisKind::Dp, 1), (AxisKind::Tp, 1)],
            &x,
            &seed,
            &cfg,
            &positions,
        );
        assert_eq!(one, want, "{cfg:?}: one rank is the kernel");
        let p = &positions;
        let dp2tp2 = [(AxisKind::Dp, 2), (AxisKind::Tp, 2)];
        let dp2tp3 = [(AxisKind::Dp, 2), (AxisKind::Tp, 3)];
        let got = [
            rope_on::<layout![Dp: Shard<0>, Tp: Shard<1>]>(&dp2tp3, &x, &seed, &cfg, p),
            rope_on::<layout![Dp: Shard<0>, Tp: Shard<0>]>(&dp2tp2, &x, &seed, &cfg, p),
            rope_on::<layout![Dp: Invariant, Tp: Shard<0>]>(&dp2tp3, &x, &seed, &cfg, p),
            rope_on::<layout![Dp: Shard<0>, Tp: Invariant]>(&dp2tp2, &x, &seed, &cfg, p),
        ];
        for (i, g) in got.iter().enumerate() {
            assert_eq!(g, &want, "{cfg:?}: layout {i}");
        }
    }
}

#[test]
fn rope_cp_order_back_in_natural_order_equals_one_rank_bitwise() {
    // 2 data blocks × 2 samples of 8 tokens, 2 heads of 4.
    let seq = 8;
    let (x, seed) = (float_global(&[32, 8]), float_global(&[32, 8]).scale(0.25));
    let offset = 3;
    let natural: Vec<usize> = (0..32).map(|n| offset + n % seq).collect();
    for cfg in configs() {
        let want = (
            ops::rope(&x, &natural, &cfg).unwrap(),
            ops::rope_backward(&seed, &natural, &cfg).unwrap(),
        );
        for zigzag in [true, false] {
            let layout = CpLayout::new(seq, 2, zigzag).unwrap();
            for (blocks, axes) in [
                (1, vec![(AxisKind::Cp, 2)]),
                (2, vec![(AxisKind::Dp, 2), (AxisKind::Cp, 2)]),
            ] {
                let (xc, sc) = (
                    layout.to_cp_order(&x, blocks).unwrap(),
                    layout.to_cp_order(&seed, blocks).unwrap(),
                );
                let positions = RopePositions::ContextParallel {
                    layout,
                    blocks,
                    offset,
                };
                let (y, dx) = if blocks == 1 {
                    rope_on::<layout![Cp: Shard<0>]>(&axes, &xc, &sc, &cfg, &positions)
                } else {
                    rope_on::<layout![Dp: Shard<0>, Cp: Shard<0>]>(
                        &axes, &xc, &sc, &cfg, &positions,
                    )
                };
                let back = (
                    layout.from_cp_order(&y, blocks).unwrap(),
                    layout.from_cp_order(&dx, blocks).unwrap(),
                );
                assert_eq!(back, want, "{cfg:?} zigzag {zigzag}, {blocks} blocks");
            }
            // Heads split over Tp as well.
            let positions = RopePositions::ContextParallel {
                layout,
                blocks: 1,
                offset,
            };
            let (xc, sc) = (
                layout.to_cp_order(&x, 1).unwrap(),
                layout.to_cp_order(&seed, 1).unwrap(),
            );
            let (y, dx) = rope_on::<layout![Cp: Shard<0>, Tp: Shard<1>]>(
                &[(AxisKind::Cp, 2), (AxisKind::Tp, 2)],
                &xc,
                &sc,
                &cfg,
                &positions,
            );
            assert_eq!(
                (
                    layout.from_cp_order(&y, 1).unwrap(),
                    layout.from_cp_order(&dx, 1).unwrap()
                ),
                want
            );
        }
    }
}

#[test]
fn rope_cp_positions_are_those_of_the_cp_permutation() {
    for zigzag in [true, false] {
        for (seq, cp) in [(8, 2), (12, 3), (16, 4)] {
            let layout = CpLayout::new(seq, cp, zigzag).unwrap();
            for blocks in [1, 2, 3] {
                let tokens = blocks * 2 * seq;
                let perm = layout.permutation(tokens, blocks).unwrap();
                let positions = RopePositions::ContextParallel {
                    layout,
                    blocks,
                    offset: 7,
                };
                let got = positions.of_rows(0..tokens, tokens).unwrap();
                let want: Vec<usize> = perm.iter().map(|n| 7 + n % seq).collect();
                assert_eq!(
                    got, want,
                    "seq {seq}, cp {cp}, zigzag {zigzag}, {blocks} blocks"
                );
                // Any window of rows is the same slice.
                assert_eq!(
                    positions.of_rows(5..tokens - 3, tokens).unwrap(),
                    want[5..tokens - 3]
                );
            }
        }
    }
}

#[test]
fn rope_packed_documents_restart_their_positions_on_every_layout() {
    let lengths = [5, 1, 3, 7];
    let docs = RopePositions::documents(&lengths);
    let ids: Vec<usize> = lengths.iter().flat_map(|&n| 0..n).collect();
    assert_eq!(ids[..9], [0, 1, 2, 3, 4, 0, 0, 1, 2]);
    assert_eq!(docs.of_rows(0..16, 16).unwrap(), ids);
    let (x, seed) = (float_global(&[16, 8]), float_global(&[16, 8]).scale(2.0));
    for cfg in configs() {
        let want = (
            ops::rope(&x, &ids, &cfg).unwrap(),
            ops::rope_backward(&seed, &ids, &cfg).unwrap(),
        );
        let dp2tp2 = [(AxisKind::Dp, 2), (AxisKind::Tp, 2)];
        let got = [
            rope_on::<layout![Dp: Shard<0>, Tp: Shard<0>]>(&dp2tp2, &x, &seed, &cfg, &docs),
            rope_on::<layout![Dp: Shard<0>, Tp: Shard<1>]>(&dp2tp2, &x, &seed, &cfg, &docs),
        ];
        for g in got {
            assert_eq!(g, want, "{cfg:?}");
        }
    }
}

#[test]
fn rope_partial_terms_rotate_into_the_rotated_sum() {
    // RoPE is linear: each rank rotates its term; the all-reduced result is the rotation
    // of the sum (to rounding: the terms are summed after rotating).
    let x = float_global(&[6, 8]);
    let cfg = configs()[1];
    let global: Vec<usize> = (0..6).map(|g| g % 3).collect();
    let want = ops::rope(&x, &global, &cfg).unwrap().to_f64_vec();
    let results = on_mesh(&[(AxisKind::Tp, 2)], |m| {
        let p = dist::<layout![Tp: Partial]>(&x, m);
        let y = p.rope(&cfg, &RopePositions::sequential(3))?;
        let s: DTensor<layout![Tp: Invariant]> = y.all_reduce(Tp)?;
        Ok(s.as_local().to_f64_vec())
    });
    for r in results {
        for (a, b) in r.iter().zip(&want) {
            assert!((a - b).abs() <= 1e-12 * (1.0 + b.abs()), "{a} vs {b}");
        }
    }
}

#[test]
fn rope_refusals_name_the_op_shapes_and_placements() {
    let cfg = Rope::new(4, 10_000.0, RopeStyle::HalfSplit);
    let err = |axes: &[(AxisKind, usize)], f: &(dyn Fn(&Arc<DeviceMesh>) -> Result<()> + Sync)| {
        let mesh = Mesh::new(axes).unwrap();
        threads::launch(mesh.world_size(), |world| {
            let dm = DeviceMesh::new(world, mesh.clone())?;
            f(&dm)
        })
        .into_iter()
        .next()
        .unwrap()
        .expect_err("expected an Err")
        .to_string()
    };
    // 3 heads of 4 over 2 ranks: 6 columns each, not whole heads.
    let msg = err(&[(AxisKind::Tp, 2)], &|m| {
        let x = dist::<layout![Tp: Shard<1>]>(&float_global(&[4, 12]), m);
        x.rope(&cfg, &RopePositions::sequential(4)).map(|_| ())
    });
    for part in ["DTensor::rope", "[4, 12]", "S(1)", "head_dim 4"] {
        assert!(msg.contains(part), "{msg:?} should mention {part}");
    }
    let msg = err(&[(AxisKind::Dp, 2)], &|m| {
        let x = dist::<layout![Dp: Shard<0>]>(&float_global(&[4, 8]), m);
        x.rope(&cfg, &RopePositions::documents(&[2, 1])).map(|_| ())
    });
    assert!(
        msg.contains("DTensor::rope") && msg.contains("3 explicit positions"),
        "{msg}"
    );
    let msg = err(&[(AxisKind::Dp, 1)], &|m| {
        let x = dist::<layout![Dp: Shard<0>]>(&float_global(&[2, 2, 4]), m);
        x.rope(&cfg, &RopePositions::sequential(2)).map(|_| ())
    });
    assert!(
        msg.contains("DTensor::rope") && msg.contains("[2, 2, 4]"),
        "{msg}"
    );
    let msg = err(&[(AxisKind::Dp, 1)], &|m| {
        let x = dist::<layout![Dp: Shard<0>]>(&float_global(&[6, 8]), m);
        let layout = CpLayout::new(4, 2, true)?;
        let p = RopePositions::ContextParallel {
            layout,
            blocks: 1,
            offset: 0,
        };
        x.rope(&cfg, &p).map(|_| ())
    });
    assert!(msg.contains("6 tokens are not 1 equal blocks"), "{msg}");
    // The kernel's own checks come through with its name.
    let msg = err(&[(AxisKind::Dp, 1)], &|m| {
        let x = dist::<layout![Dp: Shard<0>]>(&float_global(&[2, 8]), m);
        let odd = Rope {
            rotary_dim: 3,
            ..cfg
        };
        x.rope(&odd, &RopePositions::sequential(2)).map(|_| ())
    });
    assert!(
        msg.contains("ops::rope") && msg.contains("rotary_dim 3"),
        "{msg}"
    );
}
