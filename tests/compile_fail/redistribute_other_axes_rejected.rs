//~ expect: cannot redistribute a DTensor laid out as
use dtensor::prelude::*;
fn f(x: DTensor<layout![Dp: Shard<0>]>) {
    let _ = x.redistribute::<layout![Tp: Replicate]>();
}
fn main() {}
