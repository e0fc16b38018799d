// RoPE takes every placement its rule allows: tokens or heads split, whole, pending sums,
// and the CP token order over a Cp axis.
use dtensor::core::{RopePositions, Var};
use dtensor::kernels::ops::{Rope, RopeStyle};
use dtensor::prelude::*;

type Q = layout![Dp: Shard<0>, Cp: Shard<0>, Tp: Shard<1>];

fn f<'t>(
    q: &Var<'t, Q>,
    p: &DTensor<layout![Dp: Partial, Tp: Partial<Avg>]>,
    i: &DTensor<layout![Dp: Invariant, Tp: Replicate]>,
) -> Result<()> {
    let cfg = Rope::new(4, 10_000.0, RopeStyle::HalfSplit);
    let positions = RopePositions::ContextParallel {
        layout: CpLayout::new(8, 2, true)?,
        blocks: 2,
        offset: 0,
    };
    let _: Var<'t, Q> = q.rope(&cfg, &positions)?;
    let _ = p.rope(&cfg, &RopePositions::sequential(8))?;
    let _ = i.rope(&cfg, &RopePositions::documents(&[3, 5]))?;
    Ok(())
}
fn main() {}
