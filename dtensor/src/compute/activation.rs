//! Activations: `gelu`, `silu`, `swiglu`, with their tape twins. Non-linear, so no axis
//! may be `Partial`.

use super::{output, same_mesh, same_shape};
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::ops;
use dtensor_placement::{Layout, PointwiseLayout, SameAs};

impl<L: Layout> DTensor<L> {
    /// GELU (tanh approximation); no axis may be `Partial`.
    pub fn gelu(&self) -> Result<DTensor<L>>
    where
        L: PointwiseLayout,
    {
        let a = self.as_any();
        output(
            "DTensor::gelu",
            ops::gelu(a.as_local())?,
            a.global_shape(),
            a,
        )
    }

    /// SiLU `x·σ(x)`; no axis may be `Partial`.
    pub fn silu(&self) -> Result<DTensor<L>>
    where
        L: PointwiseLayout,
    {
        let a = self.as_any();
        output(
            "DTensor::silu",
            ops::silu(a.as_local())?,
            a.global_shape(),
            a,
        )
    }

    /// SwiGLU `silu(gate)⊙up` (`self` is the gate); both laid out alike, no `Partial`.
    pub fn swiglu<M: SameAs<L>>(&self, up: &DTensor<M>) -> Result<DTensor<L>>
    where
        L: PointwiseLayout,
    {
        const OP: &str = "DTensor::swiglu";
        let (a, b) = (self.as_any(), up.as_any());
        same_mesh(OP, a, b)?;
        same_shape(OP, a, b)?;
        output(
            OP,
            ops::swiglu(a.as_local(), b.as_local())?,
            a.global_shape(),
            a,
        )
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::gelu`].
    pub fn gelu(&self) -> Result<Var<'t, L>>
    where
        L: PointwiseLayout,
    {
        let y = self.value().gelu()?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            grad_of(
                "Var::gelu",
                ops::gelu_backward(dy.as_local(), xv.as_local())?,
                &xv,
            )
        }))
    }

    /// [`DTensor::silu`].
    pub fn silu(&self) -> Result<Var<'t, L>>
    where
        L: PointwiseLayout,
    {
        let y = self.value().silu()?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            grad_of(
                "Var::silu",
                ops::silu_backward(dy.as_local(), xv.as_local())?,
                &xv,
            )
        }))
    }

    /// [`DTensor::swiglu`] (`self` is the gate).
    pub fn swiglu<M: SameAs<L>>(&self, up: &Var<'t, M>) -> Result<Var<'t, L>>
    where
        L: PointwiseLayout,
    {
        let y = self.value().swiglu(up.value())?;
        let (gv, uv) = (self.value().as_any().clone(), up.value().as_any().clone());
        Ok(self.binary(up, y, move |dy, _want| {
            let g = ops::swiglu_backward(dy.as_local(), gv.as_local(), uv.as_local())?;
            Ok((
                Some(grad_of("Var::swiglu", g.d_gate, &gv)?),
                Some(grad_of("Var::swiglu", g.d_up, &uv)?),
            ))
        }))
    }
}
