//~ expect: this mesh axis is `Invariant`, not `Partial`: all_reduce / reduce_scatter reduce pending partial terms
use dtensor::prelude::*;
fn f(x: DTensor<layout![Dp: Invariant, Tp: Partial]>) {
    let _ = x.all_reduce(Dp);
}
fn main() {}
