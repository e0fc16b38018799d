//~ expect: is a max/min partial: scaling its terms does not scale the reduced value; reduce it first
use dtensor::prelude::*;
fn f(x: DTensor<layout![Tp: Partial<Max>]>) {
    let _ = x.scale(2.0);
}
fn main() {}
