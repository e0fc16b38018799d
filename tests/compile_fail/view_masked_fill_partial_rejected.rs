//~ expect: `Partial` holds pending partial sums; reduce it (all_reduce / reduce_scatter) before a non-linear op
use dtensor::prelude::*;
// Every rank would write the value into its term: the sum would hold it once per rank.
fn f(x: DTensor<layout![Tp: Partial]>, mask: DTensor<layout![Tp: Replicate]>) {
    let _ = x.masked_fill(&mask, 0.5);
}
fn main() {}
