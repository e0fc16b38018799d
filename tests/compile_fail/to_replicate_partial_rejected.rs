//~ expect: this mesh axis is `Partial`, not `Invariant`: to_replicate / invariant_to_partial start from `Invariant`
use dtensor::prelude::*;
fn f(x: DTensor<layout![Tp: Partial]>) {
    let _ = x.to_replicate(Tp);
}
fn main() {}
