//~ expect: a stage hop carries tensors laid out as
use dtensor::core::StageHop;
use dtensor::nn::{Full, Sp, Stream};
use dtensor::prelude::*;
// A pipeline hop moves local pieces between stages and never redistributes: the stage
// receiving the sequence-sharded stream cannot take it as `Full` (replicated over Tp).
fn f(hop: &StageHop<Stream<Sp>>) {
    let _ = hop.recv::<Full>(0, 0);
}
fn main() {}
