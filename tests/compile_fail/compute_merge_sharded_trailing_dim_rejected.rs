//~ expect: no rule for merging dims 0 and 0+1 of a `Shard<1>` axis
use dtensor::prelude::*;
// [samples, seq] with seq sharded: merged, each rank's rows would interleave with the others'.
fn f(x: DTensor<layout![Tp: Shard<1>]>) {
    let _ = x.merge_dims::<0>();
}
fn main() {}
