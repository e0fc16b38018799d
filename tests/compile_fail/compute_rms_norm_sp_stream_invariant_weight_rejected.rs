//~ expect: no norm rule for input `Shard<0>` with weight `Invariant` over dim 1 on a mesh axis
use dtensor::prelude::*;
// Under sequence parallelism each Tp rank normalizes other tokens, so the weight's gradient
// is a sum over Tp: the weight must be Replicate there, not Invariant.
fn f(x: DTensor<layout![Dp: Shard<0>, Tp: Shard<0>]>, w: DTensor<layout![Dp: Replicate, Tp: Invariant]>) {
    let _ = x.rms_norm::<1, _>(&w, 1e-5);
}
fn main() {}
