use dtensor::nn::*;
use dtensor::prelude::*;
// The well-typed path: raw gradients reduced (Tp under SP, then Dp) before the step.
#[allow(dead_code)]
fn f(
    p: &mut Param<StreamParam<Sp>>,
    g: DTensor<StreamParamGrad<Sp>>,
    w: &mut Param<ColWeight>,
    gw: DTensor<Grad<ColWeight>>,
    opt: &AdamW,
) -> dtensor::Result<()> {
    let g = dp_average(<Sp as SeqMode>::reduce_param_grad(g)?)?;
    opt.update(p, &g)?;
    opt.update(w, &dp_average(gw)?)
}
fn main() {}
