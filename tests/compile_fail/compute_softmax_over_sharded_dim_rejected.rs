//~ expect: `Shard<1>` splits or holds partial terms of dim 1, which this op reduces over
use dtensor::prelude::*;
fn f(x: DTensor<layout![Dp: Shard<0>, Tp: Shard<1>]>) {
    let _ = x.softmax::<1>();
}
fn main() {}
