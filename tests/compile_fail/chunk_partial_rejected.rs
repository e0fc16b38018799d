//~ expect: this mesh axis is `Partial`: chunk slices a `Replicate` or `Invariant` axis, which holds the whole tensor
use dtensor::prelude::*;
fn f(x: DTensor<layout![Tp: Partial]>) {
    let _ = x.chunk::<_, _, 0>(Tp);
}
fn main() {}
