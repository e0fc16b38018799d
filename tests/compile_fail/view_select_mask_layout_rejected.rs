//~ expect: a mask laid out `Shard<1>` does not match values laid out `Shard<0>` on a mesh axis
use dtensor::prelude::*;
// Each rank needs the mask elements of its own values: a mask split by columns beside
// values split by rows does not have them.
fn f(
    mask: DTensor<layout![Tp: Shard<1>]>,
    a: DTensor<layout![Tp: Shard<0>]>,
    b: DTensor<layout![Tp: Shard<0>]>,
) {
    let _ = DTensor::select(&mask, &a, &b);
}
fn main() {}
