//~ expect: this mesh axis is `Shard<0>`, not `Partial`: all_reduce / reduce_scatter reduce pending partial terms
use dtensor::prelude::*;
fn f(x: DTensor<layout![Tp: Shard<0>]>) {
    let _ = x.reduce_scatter::<_, _, 0>(Tp);
}
fn main() {}
