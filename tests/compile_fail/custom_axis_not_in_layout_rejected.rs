//~ expect: this DTensor's layout has no mesh axis `DpReplicate`
// A user-declared axis is checked like a built-in one: the layout must have it.
use dtensor::prelude::*;
mesh_axis!(pub DpReplicate, "dp_replicate", role = Dp);
mesh_axis!(pub DpShard, "dp_shard", role = Dp);
fn f(x: DTensor<layout![DpShard: Shard<0>, Tp: Shard<1>]>) {
    let _ = x.all_gather(DpReplicate);
}
fn main() {}
