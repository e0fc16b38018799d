//~ expect: a `Invariant` gradient is not reduced to the parameter's `Shard<1>` placement
use dtensor::nn::{AdamW, ColW, Fsdp, MasterLayout, Optimizer, Param};
use dtensor::prelude::*;
// An FSDP master is `Shard<1>` over Dp; its gradient must arrive reduce-scattered
// (`Shard<1>`). An all-reduced (`Invariant`) gradient is the whole tensor on every rank:
// the optimizer does not take it for the shard.
type Master = MasterLayout<Fsdp, ColW>;
fn f(p: &mut Param<Master>, g: &DTensor<layout![Dp: Invariant, Ep: Invariant, Cp: Invariant, Tp: Shard<0>]>, opt: &AdamW) {
    let _ = opt.update(p, g);
}
fn main() {}
