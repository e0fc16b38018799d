use dtensor::prelude::*;
// Megatron's MLP on a DP×TP mesh, forward, every layout derived by the compiler.
type Stream = layout![Dp: Shard<0>, Tp: Invariant];
type ColW = layout![Dp: Replicate, Tp: Shard<0>];
type RowW = layout![Dp: Replicate, Tp: Shard<1>];
fn mlp(x: DTensor<Stream>, w1: &DTensor<ColW>, b1: &DTensor<ColW>, w2: &DTensor<RowW>) -> Result<DTensor<Stream>> {
    let h = x.to_replicate(Tp)?.matmul_t(w1)?.add_row(b1)?.gelu()?; // [Dp: S0, Tp: S1]
    let y: DTensor<layout![Dp: Shard<0>, Tp: Partial]> = h.matmul_t(w2)?;
    y.all_reduce(Tp)
}
fn main() {
    let _ = mlp;
}
