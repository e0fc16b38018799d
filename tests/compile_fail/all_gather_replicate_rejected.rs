//~ expect: this mesh axis is `Replicate`, not `Shard<D>`: all_gather / all_to_all need a sharded axis
use dtensor::prelude::*;
fn f(x: DTensor<layout![Dp: Shard<0>, Tp: Replicate]>) {
    let _ = x.all_gather(Tp);
}
fn main() {}
