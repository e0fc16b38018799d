//~ expect: no matmul rule for `Partial` · `Partial` on a mesh axis
use dtensor::prelude::*;
// (Σa)(Σb) is not Σ(ab): two pending sums do not multiply.
fn f(x: DTensor<layout![Tp: Partial]>) {
    let _ = x.matmul(&x);
}
fn main() {}
