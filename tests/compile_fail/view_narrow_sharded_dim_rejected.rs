//~ expect: `Shard<1>` splits dim 1, which narrow and cat cut or join on every rank alike
use dtensor::prelude::*;
// Columns 2..5 of a tensor whose columns are split over Tp cut across the ranks' chunks.
fn f(x: DTensor<layout![Dp: Shard<0>, Tp: Shard<1>]>) {
    let _ = x.narrow::<1>(2, 3);
}
fn main() {}
