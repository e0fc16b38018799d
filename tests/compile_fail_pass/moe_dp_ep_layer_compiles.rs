// The control for the MoE cases: route, dispatch, two grouped matmuls, combine on a
// [Dp, Ep] mesh, and the expert weight's gradient reduced over Dp only.
use dtensor::core::moe::{combine, dispatch, route};
use dtensor::prelude::*;

type Tokens = layout![Dp: Shard<0>, Ep: Shard<0>];
type Experts = layout![Dp: Replicate, Ep: Shard<0>];

#[derive(Clone, Copy, Debug, Default)]
struct Moe0;

fn f<'t>(
    logits: &Var<'t, Tokens>,
    x: &Var<'t, Tokens>,
    w1: &Var<'t, Experts>,
    w2: &Var<'t, Experts>,
) -> Result<DTensor<layout![Dp: Invariant, Ep: Shard<0>]>> {
    let (routing, gates) = route::<Moe0, _, _>(logits, &RouterConfig::new(8, 2))?;
    let d = dispatch(x, &routing)?;
    let h = d.grouped_matmul_t(w1)?.map_rows(|v| v.gelu())?;
    let y = h.grouped_matmul_t(w2)?;
    let out: Var<'t, Tokens> = combine(&y, &gates, &routing)?;
    let loss = out.sum_dim::<1>()?.sum_dim::<0>()?;
    let mut g = loss.backward()?;
    let dw1: DTensor<layout![Dp: Partial, Ep: Shard<0>]> = g.take(w1)?;
    dw1.all_reduce(Dp)
}
fn main() {}
