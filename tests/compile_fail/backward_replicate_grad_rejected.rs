//~ expect: gradient laid out as
use dtensor::prelude::*;
// The output of an all-gather is Replicate, so its gradient must arrive Partial.
fn f(x: DTensor<layout![Tp: Shard<0>]>, g: DTensor<layout![Tp: Replicate]>) {
    let (_y, adjoint) = x.all_gather_vjp(Tp).unwrap();
    let _ = adjoint.backward(g);
}
fn main() {}
