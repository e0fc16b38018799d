//~ expect: no redistribution turns `Partial` into `Partial<Max>` on a mesh axis
use dtensor::prelude::*;
fn f(x: DTensor<layout![Tp: Partial<Sum>]>) {
    let _ = x.redistribute::<layout![Tp: Partial<Max>]>();
}
fn main() {}
