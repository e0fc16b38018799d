//! RMSNorm and LayerNorm on the residual stream, sequence-parallel aware.
//!
//! Without SP the stream is `Invariant` over `Tp`, every `Tp` rank normalises the same
//! tokens, and the weight is `Invariant` (its gradient too). With SP the stream is
//! `Shard<0>` over `Tp`, each rank normalises its own tokens with the same weight, which is
//! therefore `Replicate` over `Tp`, and its gradient `Partial`: the optimizer does not take
//! it until [`NormGrads::reduce`] has all-reduced it over `Tp` (Megatron's hand-written
//! `allreduce_sequence_parallel_grads`, here demanded by the type).

use crate::init::Init;
use crate::linear::ParamInit;
use crate::optim::{dp_average, GradNorm, Optimizer, Param};
use crate::seq::{pointwise, ReducedTp, SeqMode, Stream, StreamParam, StreamParamGrad};
use dtensor_core::{DTensor, DeviceMesh, Result};
use dtensor_kernels::{ops, Tensor};
use dtensor_placement::Invariant;
use std::sync::Arc;

/// Which normalisation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `x·rstd·w`.
    Rms,
    /// `(x − mean)·rstd·w + b`.
    Layer,
}

/// A norm over the last (feature) dim of the stream.
pub struct Norm<M: SeqMode> {
    pub weight: Param<StreamParam<M>>,
    pub bias: Option<Param<StreamParam<M>>>,
    pub kind: NormKind,
    pub eps: f64,
}

/// What [`Norm::forward`] keeps for its backward.
pub struct NormCtx {
    x: Tensor,
    mean: Option<Tensor>,
    rstd: Tensor,
}

/// A norm's raw gradients (`Partial` over `Dp`; over `Tp` too under SP).
pub struct NormGrads<M: SeqMode> {
    pub weight: DTensor<StreamParamGrad<M>>,
    pub bias: Option<DTensor<StreamParamGrad<M>>>,
}

/// A norm's gradients reduced to its parameters' placements.
pub struct NormGradsReduced {
    pub weight: DTensor<ReducedTp<Invariant>>,
    pub bias: Option<DTensor<ReducedTp<Invariant>>>,
}

impl<M: SeqMode> NormGrads<M> {
    /// Collective: all-reduce over `Tp` under SP ([`SeqMode::reduce_param_grad`]), then
    /// the DDP average over `Dp`.
    pub fn reduce(self) -> Result<NormGradsReduced> {
        let r = |g: DTensor<StreamParamGrad<M>>| dp_average(M::reduce_param_grad(g)?);
        Ok(NormGradsReduced {
            weight: r(self.weight)?,
            bias: self.bias.map(r).transpose()?,
        })
    }
}

impl NormGradsReduced {
    pub fn norm(&self, n: &mut GradNorm) -> Result<()> {
        n.add(&self.weight)?;
        self.bias.as_ref().map_or(Ok(()), |b| n.add(b))
    }
    pub fn scale(&self, f: f64) -> Result<Self> {
        Ok(NormGradsReduced {
            weight: self.weight.scale(f)?,
            bias: self.bias.as_ref().map(|b| b.scale(f)).transpose()?,
        })
    }
}

impl<M: SeqMode> Norm<M> {
    /// Weight ones (id `init.id`), LayerNorm bias zeros (id + 1). `init.std`, if not
    /// zero, perturbs the weight around 1 (for tests).
    pub fn new(
        kind: NormKind,
        hidden: usize,
        eps: f64,
        init: ParamInit,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let w = Init::Normal { std: init.std }.param::<StreamParam<M>>(
            init.seed,
            init.id,
            &[hidden],
            init.dtype,
            mesh,
        )?;
        let w = pointwise(&w, |t| Ok(t.map(|v| v + 1.0)))?;
        let bias = match kind {
            NormKind::Layer => Some(Param::new(init.bias().param::<StreamParam<M>>(
                init.seed,
                init.id + 1,
                &[hidden],
                init.dtype,
                mesh,
            )?)),
            NormKind::Rms => None,
        };
        Ok(Norm {
            weight: Param::new(w),
            bias,
            kind,
            eps,
        })
    }

    pub fn forward(&self, x: &DTensor<Stream<M>>) -> Result<(DTensor<Stream<M>>, NormCtx)> {
        let w = self.weight.local();
        let (y, mean, rstd) = match &self.bias {
            Some(b) => {
                let o = ops::layer_norm(x.as_local(), w, b.local(), self.eps)?;
                (o.y, Some(o.mean), o.rstd)
            }
            None => {
                let o = ops::rms_norm(x.as_local(), w, self.eps)?;
                (o.y, None, o.rstd)
            }
        };
        let y = pointwise(x, |_| Ok(y))?;
        Ok((
            y,
            NormCtx {
                x: x.as_local().clone(),
                mean,
                rstd,
            },
        ))
    }

    pub fn backward(
        &self,
        ctx: NormCtx,
        dy: &DTensor<Stream<M>>,
    ) -> Result<(DTensor<Stream<M>>, NormGrads<M>)> {
        let mesh = dy.device_mesh();
        let w = self.weight.local();
        let shape = self.weight.value().global_shape();
        let (dx, dw, db) = match &ctx.mean {
            Some(mean) => {
                let g = ops::layer_norm_backward(dy.as_local(), &ctx.x, w, mean, &ctx.rstd)?;
                (g.dx, g.dweight, Some(g.dbias))
            }
            None => {
                let g = ops::rms_norm_backward(dy.as_local(), &ctx.x, w, &ctx.rstd)?;
                (g.dx, g.dweight, None)
            }
        };
        let dx = pointwise(dy, |_| Ok(dx))?;
        let weight = DTensor::from_local(dw, shape, mesh)?;
        let bias = db
            .map(|b| DTensor::from_local(b, shape, mesh))
            .transpose()?;
        Ok((dx, NormGrads { weight, bias }))
    }

    pub fn apply(&mut self, g: &NormGradsReduced, opt: &impl Optimizer) -> Result<()> {
        opt.update(&mut self.weight, &g.weight)?;
        if let (Some(p), Some(gb)) = (&mut self.bias, &g.bias) {
            opt.update(p, gb)?;
        }
        Ok(())
    }
}
