//~ expect: this mesh axis is `Shard<0>`, not `Partial`: all_reduce / reduce_scatter reduce pending partial terms
// An expert weight's gradient is `Shard<0>` over Ep (each expert's owner holds every token
// routed to it) and `Partial` over the data axis that replicates the weight: it is reduced
// over Dp, never over Ep.
use dtensor::prelude::*;
fn f(dw: DTensor<layout![Dp: Partial, Ep: Shard<0>]>) -> Result<()> {
    let _ = dw.all_reduce(Ep)?;
    Ok(())
}
fn main() {}
