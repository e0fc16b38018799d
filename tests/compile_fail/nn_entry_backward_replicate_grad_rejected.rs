//~ expect: but this backward needs
use dtensor::prelude::*;
// The column entry (Megatron's `f`, `to_replicate`) gives a Replicate value whose gradient
// is Partial over Tp (each rank holds its output features' share) and is all-reduced; its
// adjoint refuses a Replicate gradient.
fn f(x: DTensor<layout![Dp: Shard<0>, Tp: Invariant]>, g: DTensor<layout![Dp: Shard<0>, Tp: Replicate]>) {
    let (_y, adj) = x.to_replicate_vjp(Tp).unwrap();
    let _ = adj.backward(g);
}
fn main() {}
