//~ expect: `Shard<0>` cannot feed attention on a mesh axis of role `Cp`
// The role, not the name, decides: a user-declared context-parallel axis is refused too.
use dtensor::kernels::ops::CausalAttention;
use dtensor::prelude::*;
mesh_axis!(pub Ring, "ring", role = Cp);
fn f(x: DTensor<layout![Ring: Shard<0>]>, cfg: &CausalAttention) {
    let _ = x.causal_attention(cfg);
}
fn main() {}
