//~ expect: no rule for swapping dims 1 and 0 of a `Shard<0>` axis
use dtensor::prelude::*;
// swap_dims names the smaller dim first.
fn f(x: DTensor<layout![Tp: Shard<0>]>) {
    let _ = x.swap_dims::<1, 0>();
}
fn main() {}
