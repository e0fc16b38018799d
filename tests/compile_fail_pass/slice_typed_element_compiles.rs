// Control for the element-type cases: the typed view of an element type compiles.
use dtensor::kernels::{half::bf16, Slice, SliceMut};

fn main() {
    let data = [1.0f32, 2.0];
    assert_eq!(Slice::F32(&data).typed::<f32>(), Some(&data[..]));
    assert_eq!(Slice::F32(&data).typed::<bf16>(), None);
    let mut out = [0i64; 2];
    if let Some(o) = SliceMut::I64(&mut out).typed_mut::<i64>() {
        o[0] = 7;
    }
    assert_eq!(out[0], 7);
}
