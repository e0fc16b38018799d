use dtensor::core::StageHop;
use dtensor::nn::{Sp, Stream};
use dtensor::prelude::*;
// The control of pp_hop_receiver_other_layout_rejected: the same layout on both ends.
fn f(hop: &StageHop<Stream<Sp>>, x: &DTensor<Stream<Sp>>) {
    let _ = hop.send(x, 1, 0);
    let _ = hop.recv::<Stream<Sp>>(0, 0);
}
fn main() {}
