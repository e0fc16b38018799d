//~ expect: `char` is not a dtensor element type: the element types are f32, f64, bf16, f16, i32 and i64
// A typed view exists only for the element types: no reinterpretation as anything else.
use dtensor::kernels::Slice;

fn main() {
    let data = [1.0f32, 2.0];
    let _ = Slice::F32(&data).typed::<char>();
}
