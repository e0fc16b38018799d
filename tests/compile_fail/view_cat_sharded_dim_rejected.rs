//~ expect: `Shard<0>` splits dim 0, which narrow and cat cut or join on every rank alike
use dtensor::prelude::*;
// Joined along the sharded rows, each rank's chunk of the result would hold rows of both.
fn f(a: DTensor<layout![Tp: Shard<0>]>, b: DTensor<layout![Tp: Shard<0>]>) {
    let _ = DTensor::cat::<0>(&[&a, &b]);
}
fn main() {}
