//~ expect: no elementwise-product rule for `Partial` ⊙ `Partial` on a mesh axis
use dtensor::prelude::*;
fn f(x: DTensor<layout![Tp: Partial]>) {
    let _ = x.mul(&x);
}
fn main() {}
