//~ expect: `Shard<0>` cannot feed attention on a mesh axis of role `Cp`
// Over a Cp-role axis, Shard<0> holds chunks of every sequence, not whole samples: plain
// attention would drop the other chunks' keys. context_attention is the op for it.
use dtensor::kernels::ops::CausalAttention;
use dtensor::prelude::*;
fn f(x: DTensor<layout![Dp: Shard<0>, Cp: Shard<0>, Tp: Shard<1>]>, cfg: &CausalAttention) {
    let _ = x.causal_attention(cfg);
}
fn main() {}
