//~ expect: no matmul rule for `Invariant` · `Shard<0>`ᵀ on a mesh axis
use dtensor::prelude::*;
// An Invariant activation times a column-parallel weight: its gradient would come back
// Partial, which Invariant cannot hold. Megatron's `f` (to_replicate) must come first.
fn f(x: DTensor<layout![Tp: Invariant]>, w: DTensor<layout![Tp: Shard<0>]>) {
    let _ = x.matmul_t(&w);
}
fn main() {}
