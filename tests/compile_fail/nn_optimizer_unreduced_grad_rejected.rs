//~ expect: a `Partial` gradient is not reduced to the parameter's `Replicate` placement
use dtensor::nn::{AdamW, ColWeight, Grad, Optimizer, Param};
use dtensor::prelude::*;
// A weight Replicate over Dp gets a gradient Partial over Dp: it must be all-reduced
// (reduce_grad) before the step.
fn f(p: &mut Param<ColWeight>, g: &DTensor<Grad<ColWeight>>, opt: &AdamW) {
    let _ = opt.update(p, g);
}
fn main() {}
