//~ expect: operand to a `Shard<0>` operand on the same mesh axis
use dtensor::core::Tape;
use dtensor::nn::{ColOut, RowParallelLinear, Sp, Stream};
use dtensor::prelude::*;
// A sequence-parallel block must leave the row layer with reduce_scatter; adding the row
// product's pending partial sums to the Shard<0> residual stream does not compile.
fn f(x: DTensor<Stream<Sp>>, h: DTensor<ColOut>, row: &RowParallelLinear<Sp>) {
    let tape = Tape::new();
    let partial = tape.leaf(h).matmul_t(&row.weight.on(&tape).unwrap()).unwrap();
    let _ = tape.leaf(x).add(&partial);
}
fn main() {}
