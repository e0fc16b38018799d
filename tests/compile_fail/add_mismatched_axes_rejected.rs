//~ expect: cannot add a DTensor laid out as
use dtensor::prelude::*;
fn f(x: DTensor<layout![Dp: Replicate, Tp: Shard<0>]>, y: DTensor<layout![Tp: Shard<0>, Dp: Replicate]>) {
    let _ = x.add(&y);
}
fn main() {}
