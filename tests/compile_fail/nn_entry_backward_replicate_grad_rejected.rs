//~ expect: but this backward needs
use dtensor::nn::{NoSp, SeqMode, Stream};
use dtensor::prelude::*;
// The column entry (Megatron's `f`) takes the input gradient Partial over Tp (each rank
// holds its output features' share) and all-reduces it; a Replicate gradient is refused.
fn f(x: DTensor<Stream<NoSp>>, g: DTensor<layout![Dp: Shard<0>, Tp: Replicate]>) {
    let (_y, adj) = <NoSp as SeqMode>::enter(x).unwrap();
    let _ = adj.backward(g);
}
fn main() {}
