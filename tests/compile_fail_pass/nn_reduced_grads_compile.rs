use dtensor::core::Gradients;
use dtensor::nn::*;
use dtensor::prelude::*;
// The well-typed path: raw gradients reduced (Dp, then Tp under SP) before the step.
#[allow(dead_code)]
fn f(
    p: &mut Param<StreamParam<Sp>>,
    w: &mut Param<ColWeight>,
    grads: &mut Gradients,
    opt: &AdamW,
) -> dtensor::Result<()> {
    let g = reduce_grad::<Replicate>(p.grad(grads)?)?;
    opt.update(p, &g)?;
    let gw = w.grad(grads)?.all_reduce(Dp)?;
    opt.update(w, &gw)
}
fn main() {}
