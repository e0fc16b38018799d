use dtensor::nn::{AdamW, ColW, Fsdp, MasterLayout, Optimizer, Param};
use dtensor::prelude::*;
// The control of nn_fsdp_grad_all_reduced_rejected: a reduce-scattered gradient is taken.
type Master = MasterLayout<Fsdp, ColW>;
fn f(p: &mut Param<Master>, g: &DTensor<layout![Dp: Shard<1>, Ep: Invariant, Cp: Invariant, Tp: Shard<0>]>, opt: &AdamW) {
    let _ = opt.update(p, g);
}
fn main() {}
