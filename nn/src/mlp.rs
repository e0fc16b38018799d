//! The tensor-parallel MLP: column → activation → row (Megatron's `f … g` pair). With SP
//! the column layer's entry is an `all_gather` of the tokens and the row layer's exit a
//! `reduce_scatter`; without SP, `to_replicate` and `all_reduce`. The activation runs on
//! the `Shard<1>` hidden features, locally.

use crate::linear::{
    ColumnGrads, ColumnGradsReduced, ColumnParallelLinear, ParamInit, RowCtx, RowGrads,
    RowGradsReduced, RowParallelLinear,
};
use crate::optim::{GradNorm, Optimizer};
use crate::seq::{pointwise, ColOut, Full, SeqMode, Stream};
use dtensor_core::{Adjoint, DTensor, DeviceMesh, Result};
use dtensor_kernels::ops;
use std::sync::Arc;

/// The MLP's non-linearity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `gelu(x·W1ᵀ + b1)` (tanh approximation).
    Gelu,
    /// `silu(x·Wgᵀ)·(x·Wuᵀ)`: gate and up are two column layers sharing one entry, so
    /// each rank holds matching shards of both.
    SwiGlu,
}

/// `fc2(act(fc1(x)))`, hidden features sharded over `Tp`.
pub struct ParallelMlp<M: SeqMode> {
    pub fc1: ColumnParallelLinear,
    /// SwiGLU's "up" projection.
    pub up: Option<ColumnParallelLinear>,
    pub fc2: RowParallelLinear<M>,
    pub activation: Activation,
}

/// What [`ParallelMlp::forward`] keeps for its backward.
pub struct MlpCtx<M: SeqMode> {
    x: DTensor<Full>,
    enter: Adjoint<Full, Stream<M>>,
    h1: DTensor<ColOut>,
    h2: Option<DTensor<ColOut>>,
    row: RowCtx<M>,
}

/// The MLP's parameter gradients (raw: `Partial` over `Dp`).
pub struct MlpGrads<M: SeqMode> {
    pub fc1: ColumnGrads,
    pub up: Option<ColumnGrads>,
    pub fc2: RowGrads<M>,
}

/// The MLP's gradients reduced to its parameters' placements.
pub struct MlpGradsReduced {
    pub fc1: ColumnGradsReduced,
    pub up: Option<ColumnGradsReduced>,
    pub fc2: RowGradsReduced,
}

impl<M: SeqMode> MlpGrads<M> {
    /// Collective: the DDP average over `Dp` (and the SP bias reduction over `Tp`).
    pub fn reduce(self) -> Result<MlpGradsReduced> {
        Ok(MlpGradsReduced {
            fc1: self.fc1.reduce()?,
            up: self.up.map(|g| g.reduce()).transpose()?,
            fc2: self.fc2.reduce()?,
        })
    }
}

impl MlpGradsReduced {
    pub fn norm(&self, n: &mut GradNorm) -> Result<()> {
        self.fc1.norm(n)?;
        if let Some(u) = &self.up {
            u.norm(n)?;
        }
        self.fc2.norm(n)
    }
    pub fn scale(&self, f: f64) -> Result<Self> {
        Ok(MlpGradsReduced {
            fc1: self.fc1.scale(f)?,
            up: self.up.as_ref().map(|u| u.scale(f)).transpose()?,
            fc2: self.fc2.scale(f)?,
        })
    }
}

impl<M: SeqMode> ParallelMlp<M> {
    /// `hidden → ffn → hidden`; parameter ids `init.id ..= init.id + 5` (fc1 weight and
    /// bias, up weight and bias, fc2 weight and bias). fc2 is drawn with `out_std`.
    pub fn new(
        hidden: usize,
        ffn: usize,
        activation: Activation,
        bias: bool,
        init: ParamInit,
        out_std: f64,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let fc1 = ColumnParallelLinear::new(hidden, ffn, bias, init, mesh)?;
        let up = match activation {
            Activation::SwiGlu => Some(ColumnParallelLinear::new(
                hidden,
                ffn,
                bias,
                init.with_id(init.id + 2),
                mesh,
            )?),
            Activation::Gelu => None,
        };
        let fc2_init = ParamInit {
            std: out_std,
            ..init.with_id(init.id + 4)
        };
        let fc2 = RowParallelLinear::new(ffn, hidden, bias, fc2_init, mesh)?;
        Ok(ParallelMlp {
            fc1,
            up,
            fc2,
            activation,
        })
    }

    pub fn forward(&self, x: DTensor<Stream<M>>) -> Result<(DTensor<Stream<M>>, MlpCtx<M>)> {
        let (x, enter) = M::enter(x)?;
        let h1 = self.fc1.forward_full(&x)?;
        let (a, h2) = match &self.up {
            Some(up) => {
                let h2 = up.forward_full(&x)?;
                let a = pointwise(&h1, |g| ops::swiglu(g, h2.as_local()))?;
                (a, Some(h2))
            }
            None => (pointwise(&h1, ops::gelu)?, None),
        };
        let (y, row) = self.fc2.forward(a)?;
        Ok((
            y,
            MlpCtx {
                x,
                enter,
                h1,
                h2,
                row,
            },
        ))
    }

    pub fn backward(
        &self,
        ctx: MlpCtx<M>,
        dy: &DTensor<Stream<M>>,
    ) -> Result<(DTensor<Stream<M>>, MlpGrads<M>)> {
        let (da, fc2) = self.fc2.backward(ctx.row, dy)?;
        let (dx, fc1, up) = match (&self.up, &ctx.h2) {
            (Some(up), Some(h2)) => {
                let g = ops::swiglu_backward(da.as_local(), ctx.h1.as_local(), h2.as_local())?;
                let dgate = pointwise(&da, |_| Ok(g.d_gate))?;
                let dup = pointwise(&da, |_| Ok(g.d_up))?;
                let (dx1, g1) = self.fc1.backward_full(&ctx.x, &dgate)?;
                let (dx2, g2) = up.backward_full(&ctx.x, &dup)?;
                (dx1.add(&dx2)?, g1, Some(g2))
            }
            _ => {
                let dh = pointwise(&da, |d| ops::gelu_backward(d, ctx.h1.as_local()))?;
                let (dx1, g1) = self.fc1.backward_full(&ctx.x, &dh)?;
                (dx1, g1, None)
            }
        };
        let dx = ctx.enter.backward(dx)?;
        Ok((dx, MlpGrads { fc1, up, fc2 }))
    }

    pub fn apply(&mut self, g: &MlpGradsReduced, opt: &impl Optimizer) -> Result<()> {
        self.fc1.apply(&g.fc1, opt)?;
        if let (Some(p), Some(gu)) = (&mut self.up, &g.up) {
            p.apply(gu, opt)?;
        }
        self.fc2.apply(&g.fc2, opt)
    }
}
