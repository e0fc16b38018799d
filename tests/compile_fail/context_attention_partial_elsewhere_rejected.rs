//~ expect: `Partial` cannot feed attention on a mesh axis of role `Tp`
// Off its Cp axis, context attention takes what plain attention takes: no pending sums.
use dtensor::prelude::*;
fn f(x: DTensor<layout![Cp: Shard<0>, Tp: Partial]>, cfg: &ContextAttention) {
    let _ = x.context_attention(Cp, cfg);
}
fn main() {}
