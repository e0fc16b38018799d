//~ expect: this mesh axis is `Shard<0>`, not `Replicate`: to_invariant / replicate_to_partial start from `Replicate`
use dtensor::prelude::*;
fn f(x: DTensor<layout![Tp: Shard<0>]>) {
    let _ = x.to_invariant(Tp);
}
fn main() {}
