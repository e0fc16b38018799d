//! The optimizer's device step: [`adamw_step`] (`optim.cu`), nn's AdamW on device memory.
//! A child module of [`ops`](super::ops) (re-exported there as `cuda::ops::adamw_step`), so
//! it launches through the same argument helpers.

use super::*;

/// One AdamW step's constants, as nn's `AdamW` computes them for step `t`: the learning
/// rate, the moment decays, `eps`, the decoupled weight decay, and the bias corrections
/// `c1 = 1 − β1ᵗ`, `c2 = 1 − β2ᵗ`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    /// Learning rate.
    pub lr: f64,
    /// First-moment decay β1.
    pub beta1: f64,
    /// Second-moment decay β2.
    pub beta2: f64,
    /// Added to the second moment's root.
    pub eps: f64,
    /// Decoupled weight decay (0 for the parameters that take none).
    pub decay: f64,
    /// `1 − β1ᵗ`.
    pub c1: f64,
    /// `1 − β2ᵗ`.
    pub c2: f64,
}

/// The moments' dtype for a parameter of `dtype`: f32 for f32, f64 otherwise (the host
/// AdamW's choice: the parameter's dtype for f32 and f64, as PyTorch keeps them, and f64 for
/// the 16-bit dtypes).
pub fn adamw_state_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F32 => DType::F32,
        _ => DType::F64,
    }
}

/// AdamW in place on device memory: `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
/// `w ← w − lr·((m/c1)/(√(v/c2) + eps) + decay·w)`, in the host step's order of operations
/// (f32 arithmetic for f32; f64 for f64 and for 16-bit parameters, rounded into `w` once).
/// `g` has `w`'s shape and dtype; `m` and `v` its shape and
/// [`adamw_state_dtype`]. Buffers shared with other tensors are copied first (copy on
/// write).
pub fn adamw_step(
    w: &mut CudaTensor,
    g: &CudaTensor,
    m: &mut CudaTensor,
    v: &mut CudaTensor,
    h: &AdamWStep,
) -> Result<()> {
    const OP: &str = "cuda::ops::adamw_step";
    want_float(OP, w)?;
    let state = adamw_state_dtype(w.dtype());
    check_dst(OP, g, w.shape(), w.dtype())?;
    check_dst(OP, m, w.shape(), state)?;
    check_dst(OP, v, w.shape(), state)?;
    same_device(OP, &[w, g, m, v])?;
    let n = w.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = w.device().clone();
    let f = func(&dev, &source::OPTIM, "adamw", w.dtype())?;
    launch_kernel!(OP, dev, f, grid_for(n);
        dst w, src g, dst m, dst v, f64 h.lr, f64 h.beta1, f64 h.beta2, f64 h.eps, f64 h.decay,
        f64 h.c1, f64 h.c2, u64 n)
}
