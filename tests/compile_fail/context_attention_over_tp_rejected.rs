//~ expect: context attention runs over a Cp-role mesh axis, not one of role `Tp`
use dtensor::prelude::*;
fn f(x: DTensor<layout![Cp: Replicate, Tp: Shard<0>]>, cfg: &ContextAttention) {
    let _ = x.context_attention(Tp, cfg);
}
fn main() {}
