//~ expect: `Replicate` is not a loss placement: backward() seeds ones, which is exact only for `Partial<Sum>` or `Invariant` axes
use dtensor::core::Tape;
use dtensor::prelude::*;
// A Replicate loss would be counted once per rank: seeding ones on every rank is wrong.
fn f(x: DTensor<layout![Dp: Replicate]>) {
    let tape = Tape::new();
    let loss = tape.leaf(x);
    let _ = loss.backward();
}
fn main() {}
