//~ expect: this DTensor's layout has no mesh axis `Pp`
use dtensor::prelude::*;
fn f(x: DTensor<layout![Dp: Shard<0>, Tp: Shard<1>]>) {
    let _ = x.all_gather(Pp);
}
fn main() {}
