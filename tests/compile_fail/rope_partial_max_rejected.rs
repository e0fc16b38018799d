//~ expect: cannot feed RoPE: it rotates each row by its position, read from the row's global index, and needs terms that add linearly
// A max partial does not rotate linearly (the max of rotated terms is not the rotated max).
use dtensor::core::{RopePositions, Var};
use dtensor::kernels::ops::{Rope, RopeStyle};
use dtensor::prelude::*;

fn f<'t>(x: &Var<'t, layout![Tp: Partial<Max>]>) {
    let cfg = Rope::new(4, 10_000.0, RopeStyle::Interleaved);
    let _ = x.rope(&cfg, &RopePositions::sequential(8));
}
fn main() {}
