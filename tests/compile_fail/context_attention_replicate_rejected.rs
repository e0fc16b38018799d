//~ expect: context attention needs the tokens `Shard<0>` over its Cp axis, got `Replicate`
use dtensor::prelude::*;
fn f(x: DTensor<layout![Dp: Shard<0>, Cp: Replicate]>, cfg: &ContextAttention) {
    let _ = x.context_attention(Cp, cfg);
}
fn main() {}
