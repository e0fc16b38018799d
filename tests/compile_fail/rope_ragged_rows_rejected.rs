//~ expect: cannot feed RoPE: it rotates each row by its position, read from the row's global index
// Rows an MoE dispatch routed to experts (`Ragged`) have lost their global index, so RoPE
// cannot know their positions.
use dtensor::core::RopePositions;
use dtensor::kernels::ops::{Rope, RopeStyle};
use dtensor::prelude::*;

#[derive(Clone, Copy, Debug, Default)]
struct Layer;

fn f(x: DTensor<layout![Ep: Ragged<Layer>]>) {
    let cfg = Rope::new(4, 10_000.0, RopeStyle::HalfSplit);
    let _ = x.rope(&cfg, &RopePositions::sequential(8));
}
fn main() {}
