//~ expect: these tokens were not dispatched by this routing: the expert axis is `Ragged<LayerA>`, the routing combines `Ragged<LayerB>`
// A combine that expects the dispatch of another routing: the brand of the routing that
// dispatched the rows is in their layout (`Ragged<LayerA>`), so layer B's routing cannot
// combine them.
use dtensor::core::moe::{combine, dispatch, route};
use dtensor::prelude::*;

#[derive(Clone, Copy, Debug, Default)]
struct LayerA;
#[derive(Clone, Copy, Debug, Default)]
struct LayerB;

fn f<'t>(logits: &Var<'t, layout![Ep: Shard<0>]>, x: &Var<'t, layout![Ep: Shard<0>]>) -> Result<()> {
    let cfg = RouterConfig::new(4, 1);
    let (ra, ga) = route::<LayerA, _, _>(logits, &cfg)?;
    let (rb, _) = route::<LayerB, _, _>(logits, &cfg)?;
    let d = dispatch(x, &ra)?;
    let _ = combine(&d, &ga, &rb)?;
    Ok(())
}
fn main() {}
