//~ expect: is not a dtensor element type: the element types are f32, f64, bf16, f16, i32 and i64
// The audit's P1: a downstream type claiming to be f32 (a `char` inside, so most f32 bit
// patterns are invalid for it). If this compiled, a `Slice::F32` could be viewed as `&[Evil]`.
use dtensor::kernels::{DType, Element, Slice, SliceMut};

#[derive(Clone, Copy, Default, PartialEq, PartialOrd, Debug)]
struct Evil(char);

impl Element for Evil {
    const DTYPE: DType = DType::F32;
    fn zero() -> Self {
        Evil('0')
    }
    fn one() -> Self {
        Evil('1')
    }
    fn add(self, _: Self) -> Self {
        self
    }
    fn mul(self, _: Self) -> Self {
        self
    }
    fn div_count(self, _: usize) -> Self {
        self
    }
    fn from_f64(_: f64) -> Self {
        Evil('0')
    }
    fn to_f64(self) -> f64 {
        0.0
    }
    fn slice(_: &[Self]) -> Slice<'_> {
        Slice::F32(&[])
    }
    fn slice_mut(_: &mut [Self]) -> SliceMut<'_> {
        SliceMut::F32(&mut [])
    }
}

fn main() {
    let data = [1.0f32, 2.0];
    let _ = Slice::F32(&data).typed::<Evil>();
}
