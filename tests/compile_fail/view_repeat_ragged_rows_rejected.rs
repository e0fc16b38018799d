//~ expect: no rule for repeating dim 0 of a `Ragged<Layer>` axis
// Rows an MoE dispatch routed here have data-dependent counts: repeating them in place
// would not be a layout any rank could describe.
use dtensor::prelude::*;

#[derive(Clone, Copy, Debug, Default)]
struct Layer;

fn f(x: DTensor<layout![Ep: Ragged<Layer>]>) {
    let _ = x.repeat_interleave::<0>(2);
}
fn main() {}
