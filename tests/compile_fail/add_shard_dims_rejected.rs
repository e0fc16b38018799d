//~ expect: cannot add a `Shard<1>` operand to a `Shard<0>` operand on the same mesh axis
use dtensor::prelude::*;
fn f(x: DTensor<layout![Dp: Replicate, Tp: Shard<0>]>, y: DTensor<layout![Dp: Replicate, Tp: Shard<1>]>) {
    let _ = x.add(&y);
}
fn main() {}
