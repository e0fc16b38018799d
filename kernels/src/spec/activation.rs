//! Activations: the gradients of the gated one (SwiGLU).

use crate::Tensor;

/// The gradients of [`swiglu`](crate::ops::swiglu) with respect to `gate` and `up`.
#[derive(Clone, Debug, PartialEq)]
pub struct SwiGluGrads {
    /// `dy·up·silu'(gate)`: the gradient of the gate input, `gate`'s shape and dtype.
    pub d_gate: Tensor,
    /// `dy·silu(gate)`: the gradient of the up input, `up`'s shape and dtype.
    pub d_up: Tensor,
}
