// Control: every call here is well-typed, so the harness proves it is not rejecting
// everything.
use dtensor::prelude::*;
#[allow(dead_code)]
fn f(
    x: DTensor<layout![Dp: Shard<0>, Tp: Shard<1>]>,
    p: DTensor<layout![Dp: Replicate, Tp: Partial]>,
) -> Result<()> {
    let r = x.all_gather(Tp)?;
    let _ = r.gelu()?;
    let i = p.clone().all_reduce(Tp)?;
    let _ = i.to_replicate(Tp)?;
    let s = p.clone().reduce_scatter::<_, _, 0>(Tp)?;
    let _ = s.all_to_all::<_, _, 1>(Tp)?;
    let _ = p.add(&p)?.scale(0.5)?;
    let (_y, adj) = p.all_reduce_vjp(Tp)?;
    let _ = adj;
    Ok(())
}
fn main() {}
