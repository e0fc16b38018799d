//~ expect: a `Partial` gradient is not reduced to the parameter's `Replicate` placement
use dtensor::nn::{Optimizer, Param, Sgd, Sp, StreamParam};
use dtensor::prelude::*;
// Under SP a norm weight is Replicate over Tp, so its gradient is Partial over Tp: averaged
// over Dp but not all-reduced over Tp, the optimizer refuses it.
fn f(p: &mut Param<StreamParam<Sp>>, g: &DTensor<layout![Dp: Invariant, Ep: Invariant, Cp: Invariant, Tp: Partial]>) {
    let _ = Sgd { lr: 0.1 }.update(p, g);
}
fn main() {}
