// The view ops on the layouts their rules allow, with the output layouts they give.
use dtensor::core::compute::view::SwappedDims;
use dtensor::prelude::*;

type X = layout![Dp: Shard<0>, Tp: Shard<2>];

fn f(
    x: DTensor<X>,
    mask: DTensor<layout![Dp: Shard<0>, Tp: Shard<2>]>,
    table: DTensor<layout![Dp: Replicate, Tp: Shard<1>]>,
    ids: DTensor<layout![Dp: Shard<0>, Tp: Invariant]>,
) -> Result<()> {
    let _: DTensor<X> = x.narrow::<1>(0, 2)?;
    let _: DTensor<X> = DTensor::cat::<1>(&[&x, &x])?;
    let s: DTensor<layout![Dp: Shard<1>, Tp: Shard<2>]> = x.swap_dims::<0, 1>()?;
    let _: DTensor<SwappedDims<layout![Dp: Shard<1>, Tp: Shard<2>], 0, 1>> = s.swap_dims::<0, 1>()?;
    let _: DTensor<X> = x.repeat_interleave::<2>(2)?;
    let _: DTensor<X> = DTensor::select(&mask, &x, &x)?;
    let _: DTensor<X> = x.masked_fill(&mask, f64::NEG_INFINITY)?;
    let _: DTensor<layout![Dp: Shard<0>, Tp: Shard<1>]> = table.gather_rows(&ids)?;
    Ok(())
}
fn main() {}
