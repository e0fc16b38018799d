//~ expect: no matmul rule for `Shard<0>` · `Shard<1>`ᵀ on a mesh axis
use dtensor::core::Tape;
use dtensor::nn::{ColumnParallelLinear, Fsdp, Full};
use dtensor::prelude::*;
// Under FSDP a column weight is stored `Shard<1>` over Dp. Multiplying the stored shard
// (not all-gathered over Dp) by tokens that are `Shard<0>` over Dp has no rule: the forward
// must gather it (`Weight::on`), whose adjoint reduce-scatters the gradient.
fn f(x: DTensor<Full>, layer: &ColumnParallelLinear<Fsdp>) {
    let tape = Tape::new();
    let _ = tape.leaf(x).matmul_t(&layer.weight.stored(&tape).unwrap());
}
fn main() {}
