//~ expect: cannot add a `Replicate` operand to a `Partial` operand on the same mesh axis
use dtensor::prelude::*;
fn f(x: DTensor<layout![Tp: Partial]>, y: DTensor<layout![Tp: Replicate]>) {
    let _ = x.add(&y);
}
fn main() {}
