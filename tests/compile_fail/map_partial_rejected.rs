//~ expect: holds pending partial sums; reduce it (all_reduce / reduce_scatter) before a non-linear op
use dtensor::prelude::*;
fn f(x: DTensor<layout![Tp: Partial]>) {
    let _ = x.map(|v| v.exp());
}
fn main() {}
