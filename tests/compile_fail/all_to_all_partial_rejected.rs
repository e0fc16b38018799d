//~ expect: this mesh axis is `Partial`, not `Shard<D>`: all_gather / all_to_all need a sharded axis
use dtensor::prelude::*;
fn f(x: DTensor<layout![Tp: Partial]>) {
    let _ = x.all_to_all::<_, _, 1>(Tp);
}
fn main() {}
