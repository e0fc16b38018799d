//~ expect: holds pending partial sums; reduce it (all_reduce / reduce_scatter) before a non-linear op
use dtensor::prelude::*;
// A row-parallel product (input features split on both sides) is a pending sum over Tp: its
// type says `Partial`, so it cannot be labelled `Replicate` (a type mismatch) and a
// non-linear op refuses it until it is reduced.
fn f(x: DTensor<layout![Tp: Shard<1>]>, w: DTensor<layout![Tp: Shard<1>]>) {
    let y = x.matmul_t(&w).unwrap();
    let _ = y.gelu();
}
fn main() {}
