//! Host kernel of [`crate::ops::adamw_step`]: AdamW on host tensors whose arguments the
//! front door has checked (f32 arithmetic for f32; f64 for f64, and for 16-bit parameters,
//! rounded into them once), in the order of operations the device kernel (`optim.cu`)
//! repeats. nn's `AdamW` steps through the front door.

use crate::spec::optim::AdamWStep;
use crate::{DType, Result, Tensor};

/// One step over slices of one float type; the constants rounded into it first.
fn step<T: num_traits::Float>(w: &mut [T], g: &[T], m: &mut [T], v: &mut [T], h: &AdamWStep) {
    let c = |x: f64| T::from(x).unwrap_or_else(T::nan);
    let (b1, b2, one) = (c(h.beta1), c(h.beta2), T::one());
    let (c1, c2, eps, lr, decay) = (c(h.c1), c(h.c2), c(h.eps), c(h.lr), c(h.decay));
    for i in 0..w.len() {
        m[i] = b1 * m[i] + (one - b1) * g[i];
        v[i] = b2 * v[i] + (one - b2) * g[i] * g[i];
        let upd = (m[i] / c1) / ((v[i] / c2).sqrt() + eps);
        w[i] = w[i] - lr * (upd + decay * w[i]);
    }
}

pub(crate) fn adamw_step(
    w: &mut Tensor,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    h: &AdamWStep,
) -> Result<()> {
    match w.dtype() {
        DType::F32 => step(
            w.as_mut_slice::<f32>()?,
            g.as_slice::<f32>()?,
            m.as_mut_slice::<f32>()?,
            v.as_mut_slice::<f32>()?,
            h,
        ),
        DType::F64 => step(
            w.as_mut_slice::<f64>()?,
            g.as_slice::<f64>()?,
            m.as_mut_slice::<f64>()?,
            v.as_mut_slice::<f64>()?,
            h,
        ),
        dtype => {
            // 16-bit values: step in f64, round once.
            let mut wf = w.to_f64_vec();
            let gf = g.to_f64_vec();
            step(
                &mut wf,
                &gf,
                m.as_mut_slice::<f64>()?,
                v.as_mut_slice::<f64>()?,
                h,
            );
            *w = Tensor::from_f64_vec(wf, w.shape(), dtype)?;
        }
    }
    Ok(())
}
