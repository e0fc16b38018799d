//! Column- and row-parallel linear layers (Megatron's conjugate pair), typed.
//!
//! | layer | weight `[out, in]` | input | output | backward communication |
//! |---|---|---|---|---|
//! | [`ColumnParallelLinear`] | `Shard<0>` on `Tp` | [`Full`] (entered from the stream with [`SeqMode::enter`]) | [`ColOut`] (`Shard<1>`) | the entry's adjoint: `all_reduce` (no SP) or `reduce_scatter` (SP) of the `Partial` input gradient |
//! | [`RowParallelLinear`] | `Shard<1>` on `Tp` | [`ColOut`] | [`RowPartial`], left with [`SeqMode::exit`] for the stream; bias added after the reduction | the exit's adjoint: none (no SP) or `all_gather` (SP) |
//!
//! No flag says whether an input is parallel or an output gathered: the placements do.

use crate::init::Init;
use crate::optim::{dp_average, GradNorm, Optimizer, Param};
use crate::seq::{
    ColOut, ColWeight, ColWeightReduced, Full, Grad, ReducedTp, RowPartial, RowWeight,
    RowWeightReduced, SeqMode, Stream, StreamParam,
};
use dtensor_core::{Adjoint, DTensor, DeviceMesh, Result};
use dtensor_kernels::ops::{self, Transpose};
use dtensor_kernels::DType;
use dtensor_placement::{layout, Dp, Invariant, Partial, PlacementType, Tp};
use std::sync::Arc;

/// Where a layer's parameters come from: a seed, the id of the layer's first parameter
/// (each parameter takes the next id), and the weights' standard deviation.
#[derive(Clone, Copy, Debug)]
pub struct ParamInit {
    pub seed: u64,
    pub id: u64,
    pub std: f64,
    /// Biases' standard deviation (0: zeros, as Megatron initialises them).
    pub bias_std: f64,
    pub dtype: DType,
}

impl ParamInit {
    pub fn new(seed: u64, id: u64, std: f64, dtype: DType) -> Self {
        ParamInit {
            seed,
            id,
            std,
            bias_std: 0.0,
            dtype,
        }
    }
    /// The same init for the parameter ids starting at `id`.
    pub fn with_id(self, id: u64) -> Self {
        ParamInit { id, ..self }
    }
    /// The same init with biases drawn `Normal(0, bias_std)`.
    pub fn with_bias_std(self, bias_std: f64) -> Self {
        ParamInit { bias_std, ..self }
    }
    /// The bias init.
    pub fn bias(&self) -> Init {
        Init::Normal { std: self.bias_std }
    }
}

/// `y = x·Wᵀ (+ b)` with the output features sharded over `Tp`.
pub struct ColumnParallelLinear {
    pub weight: Param<ColWeight>,
    pub bias: Option<Param<ColWeight>>,
}

/// What [`ColumnParallelLinear::forward`] keeps for its backward.
pub struct ColumnCtx<M: SeqMode> {
    x: DTensor<Full>,
    enter: Adjoint<Full, Stream<M>>,
}

/// A column layer's parameter gradients, `Partial` over `Dp`.
pub struct ColumnGrads {
    pub weight: DTensor<Grad<ColWeight>>,
    pub bias: Option<DTensor<Grad<ColWeight>>>,
}

/// A column layer's gradients averaged over `Dp`: what its [`apply`](ColumnParallelLinear::apply) takes.
pub struct ColumnGradsReduced {
    pub weight: DTensor<ColWeightReduced>,
    pub bias: Option<DTensor<ColWeightReduced>>,
}

impl ColumnGrads {
    /// Collective over `Dp`: the DDP all-reduce (average).
    pub fn reduce(self) -> Result<ColumnGradsReduced> {
        Ok(ColumnGradsReduced {
            weight: dp_average(self.weight)?,
            bias: self.bias.map(dp_average).transpose()?,
        })
    }
    /// Sum of two gradients of the same layer (two uses of it).
    pub fn add(&self, o: &ColumnGrads) -> Result<ColumnGrads> {
        Ok(ColumnGrads {
            weight: self.weight.add(&o.weight)?,
            bias: match (&self.bias, &o.bias) {
                (Some(a), Some(b)) => Some(a.add(b)?),
                _ => None,
            },
        })
    }
}

impl ColumnGradsReduced {
    pub fn norm(&self, n: &mut GradNorm) -> Result<()> {
        n.add(&self.weight)?;
        self.bias.as_ref().map_or(Ok(()), |b| n.add(b))
    }
    pub fn scale(&self, f: f64) -> Result<Self> {
        Ok(ColumnGradsReduced {
            weight: self.weight.scale(f)?,
            bias: self.bias.as_ref().map(|b| b.scale(f)).transpose()?,
        })
    }
}

impl ColumnParallelLinear {
    /// Weight `[out, in]` drawn `Normal(0, init.std)` (id `init.id`), bias from [`ParamInit::bias`] (id + 1).
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        init: ParamInit,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let w = Init::Normal { std: init.std }.param::<ColWeight>(
            init.seed,
            init.id,
            &[out_features, in_features],
            init.dtype,
            mesh,
        )?;
        let b = bias
            .then(|| {
                init.bias().param::<ColWeight>(
                    init.seed,
                    init.id + 1,
                    &[out_features],
                    init.dtype,
                    mesh,
                )
            })
            .transpose()?;
        Ok(ColumnParallelLinear {
            weight: Param::new(w),
            bias: b.map(Param::new),
        })
    }

    /// `[out, in]` of the whole weight.
    pub fn out_features(&self) -> usize {
        self.weight.value().global_shape()[0]
    }

    /// The product on tokens already replicated over `Tp`: no communication.
    pub fn forward_full(&self, x: &DTensor<Full>) -> Result<DTensor<ColOut>> {
        let w = self.weight.local();
        let mut y = ops::matmul(x.as_local(), Transpose::No, w, Transpose::Yes)?;
        if let Some(b) = &self.bias {
            ops::add_row_assign(&mut y, b.local())?;
        }
        let global = [x.global_shape()[0], self.out_features()];
        DTensor::from_local(y, &global, x.device_mesh())
    }

    /// The backward of [`forward_full`](Self::forward_full): the input gradient is
    /// `Partial` over `Tp` (each rank holds its output features' share), no communication.
    pub fn backward_full(
        &self,
        x: &DTensor<Full>,
        dy: &DTensor<ColOut>,
    ) -> Result<(DTensor<Grad<Full>>, ColumnGrads)> {
        let mesh = x.device_mesh();
        let w = self.weight.local();
        let dx = ops::matmul(dy.as_local(), Transpose::No, w, Transpose::No)?;
        let dw = ops::matmul(dy.as_local(), Transpose::Yes, x.as_local(), Transpose::No)?;
        let dx = DTensor::from_local(dx, x.global_shape(), mesh)?;
        let weight = DTensor::from_local(dw, self.weight.value().global_shape(), mesh)?;
        let bias = match &self.bias {
            Some(b) => Some(DTensor::from_local(
                ops::sum_rows(dy.as_local())?,
                b.value().global_shape(),
                mesh,
            )?),
            None => None,
        };
        Ok((dx, ColumnGrads { weight, bias }))
    }

    /// Enters the tensor-parallel region from the residual stream (`to_replicate`, or
    /// `all_gather` under SP) and multiplies.
    pub fn forward<M: SeqMode>(
        &self,
        x: DTensor<Stream<M>>,
    ) -> Result<(DTensor<ColOut>, ColumnCtx<M>)> {
        let (x, enter) = M::enter(x)?;
        let y = self.forward_full(&x)?;
        Ok((y, ColumnCtx { x, enter }))
    }

    /// The stream gradient (reduced by the entry's adjoint: `all_reduce`, or
    /// `reduce_scatter` under SP) and the parameter gradients.
    pub fn backward<M: SeqMode>(
        &self,
        ctx: ColumnCtx<M>,
        dy: &DTensor<ColOut>,
    ) -> Result<(DTensor<Stream<M>>, ColumnGrads)> {
        let (dx, grads) = self.backward_full(&ctx.x, dy)?;
        Ok((ctx.enter.backward(dx)?, grads))
    }

    /// One optimizer update from reduced gradients.
    pub fn apply(&mut self, g: &ColumnGradsReduced, opt: &impl Optimizer) -> Result<()> {
        opt.update(&mut self.weight, &g.weight)?;
        if let (Some(p), Some(gb)) = (&mut self.bias, &g.bias) {
            opt.update(p, gb)?;
        }
        Ok(())
    }
}

/// `y = x·Wᵀ (+ b)` with the input features sharded over `Tp`: each rank's product is a
/// `Partial` term; the bias is added once, after the reduction (as Megatron does).
pub struct RowParallelLinear<M: SeqMode> {
    pub weight: Param<RowWeight>,
    pub bias: Option<Param<StreamParam<M>>>,
}

/// What [`RowParallelLinear::forward`] keeps for its backward.
pub struct RowCtx<M: SeqMode> {
    x: DTensor<ColOut>,
    exit: Adjoint<Stream<M>, RowPartial>,
}

/// A row layer's parameter gradients: the weight's `Partial` over `Dp`; the bias's also
/// `Partial` over `Tp` under SP.
pub struct RowGrads<M: SeqMode> {
    pub weight: DTensor<Grad<RowWeight>>,
    #[allow(clippy::type_complexity)]
    pub bias: Option<DTensor<layout![Dp: Partial, Tp: <M::ParamTp as PlacementType>::Grad]>>,
}

/// A row layer's gradients reduced to its parameters' placements.
pub struct RowGradsReduced {
    pub weight: DTensor<RowWeightReduced>,
    pub bias: Option<DTensor<ReducedTp<Invariant>>>,
}

impl<M: SeqMode> RowGrads<M> {
    /// Collective: the bias over `Tp` (SP only), then everything averaged over `Dp`.
    pub fn reduce(self) -> Result<RowGradsReduced> {
        Ok(RowGradsReduced {
            weight: dp_average(self.weight)?,
            bias: self
                .bias
                .map(|b| dp_average(M::reduce_param_grad(b)?))
                .transpose()?,
        })
    }
}

impl RowGradsReduced {
    pub fn norm(&self, n: &mut GradNorm) -> Result<()> {
        n.add(&self.weight)?;
        self.bias.as_ref().map_or(Ok(()), |b| n.add(b))
    }
    pub fn scale(&self, f: f64) -> Result<Self> {
        Ok(RowGradsReduced {
            weight: self.weight.scale(f)?,
            bias: self.bias.as_ref().map(|b| b.scale(f)).transpose()?,
        })
    }
}

impl<M: SeqMode> RowParallelLinear<M> {
    /// Weight `[out, in]` drawn `Normal(0, init.std)` (id `init.id`), bias from [`ParamInit::bias`] (id + 1).
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        init: ParamInit,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let w = Init::Normal { std: init.std }.param::<RowWeight>(
            init.seed,
            init.id,
            &[out_features, in_features],
            init.dtype,
            mesh,
        )?;
        let b = bias
            .then(|| {
                init.bias().param::<StreamParam<M>>(
                    init.seed,
                    init.id + 1,
                    &[out_features],
                    init.dtype,
                    mesh,
                )
            })
            .transpose()?;
        Ok(RowParallelLinear {
            weight: Param::new(w),
            bias: b.map(Param::new),
        })
    }

    pub fn out_features(&self) -> usize {
        self.weight.value().global_shape()[0]
    }

    /// This rank's `Partial` term of `x·Wᵀ` (no bias, no communication).
    pub fn forward_partial(&self, x: &DTensor<ColOut>) -> Result<DTensor<RowPartial>> {
        let y = ops::matmul(
            x.as_local(),
            Transpose::No,
            self.weight.local(),
            Transpose::Yes,
        )?;
        let global = [x.global_shape()[0], self.out_features()];
        DTensor::from_local(y, &global, x.device_mesh())
    }

    /// The product, reduced back into the stream (`all_reduce`, or `reduce_scatter` of the
    /// tokens under SP), plus the bias.
    pub fn forward(&self, x: DTensor<ColOut>) -> Result<(DTensor<Stream<M>>, RowCtx<M>)> {
        let (y, exit) = M::exit(self.forward_partial(&x)?)?;
        let y = match &self.bias {
            Some(b) => {
                let global: Vec<usize> = y.global_shape().to_vec();
                let mesh = y.device_mesh().clone();
                let out = ops::add_row(y.as_local(), b.local())?;
                DTensor::from_local(out, &global, &mesh)?
            }
            None => y,
        };
        Ok((y, RowCtx { x, exit }))
    }

    /// The input gradient (sharded like the input) and the parameter gradients. The
    /// exit's adjoint brings the stream gradient to `Replicate` over `Tp` (an `all_gather`
    /// under SP, nothing otherwise).
    pub fn backward(
        &self,
        ctx: RowCtx<M>,
        dy: &DTensor<Stream<M>>,
    ) -> Result<(DTensor<ColOut>, RowGrads<M>)> {
        let mesh = dy.device_mesh().clone();
        let bias = match &self.bias {
            Some(b) => Some(DTensor::from_local(
                ops::sum_rows(dy.as_local())?,
                b.value().global_shape(),
                &mesh,
            )?),
            None => None,
        };
        let dfull: DTensor<Full> = ctx.exit.backward(dy.clone())?;
        let w = self.weight.local();
        let dx = ops::matmul(dfull.as_local(), Transpose::No, w, Transpose::No)?;
        let dw = ops::matmul(
            dfull.as_local(),
            Transpose::Yes,
            ctx.x.as_local(),
            Transpose::No,
        )?;
        let dx = DTensor::from_local(dx, ctx.x.global_shape(), &mesh)?;
        let weight = DTensor::from_local(dw, self.weight.value().global_shape(), &mesh)?;
        Ok((dx, RowGrads { weight, bias }))
    }

    pub fn apply(&mut self, g: &RowGradsReduced, opt: &impl Optimizer) -> Result<()> {
        opt.update(&mut self.weight, &g.weight)?;
        if let (Some(p), Some(gb)) = (&mut self.bias, &g.bias) {
            opt.update(p, gb)?;
        }
        Ok(())
    }
}
