//! The optimizer step's constants and the checks of its tensors.

use super::{check_dst, want_float};
use crate::{DType, Result, Tensor};

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

/// The moments' dtype for a parameter of `dtype`: f32 for f32, f64 otherwise (the
/// parameter's dtype for f32 and f64, as PyTorch keeps them, and f64 for the 16-bit dtypes).
pub fn adamw_state_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F32 => DType::F32,
        _ => DType::F64,
    }
}

/// `Err` unless `w` is float, `g` has its shape and dtype, and `m`, `v` its shape and
/// [`adamw_state_dtype`].
pub(crate) fn check_adamw(
    op: &'static str,
    w: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
) -> Result<()> {
    want_float(op, w)?;
    let state = adamw_state_dtype(w.dtype());
    check_dst(op, g, w.shape(), w.dtype())?;
    check_dst(op, m, w.shape(), state)?;
    check_dst(op, v, w.shape(), state)
}
