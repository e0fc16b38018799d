//! Column- and row-parallel linear layers (Megatron's conjugate pair), forward only: the
//! tape derives the backward, and the types derive every placement.
//!
//! | layer | weight `[out, in]` | input | output | backward communication (from the tape) |
//! |---|---|---|---|---|
//! | [`ColumnParallelLinear`] | `Shard<0>` on `Tp` | [`Full`] (entered from the stream with [`SeqMode::enter`]) | [`ColOut`] (`Shard<1>`) | the entry's adjoint: `all_reduce` (no SP) or `reduce_scatter` (SP) of the `Partial` input gradient |
//! | [`RowParallelLinear`] | `Shard<1>` on `Tp` | [`ColOut`] | `x·Wᵀ` is [`RowPartial`](crate::RowPartial) (derived: `Shard<1>·Shard<1>ᵀ` is a pending sum), left with [`SeqMode::exit`]; bias added after the reduction | the exit's adjoint: none (no SP) or `all_gather` (SP) |
//!
//! No flag says whether an input is parallel or an output gathered: the placements do.

use crate::data::{ColB, ColW, DataMode, Ddp, MasterLayout, RowW, StreamP};
use crate::init::{Init, ParamInit};
use crate::params::{join_name, Module, ParamVisitor, Weight};
use crate::seq::{ColOut, Full, SeqMode, Stream};
use dtensor_core::{DeviceMesh, Result, Tape, Var};
use std::sync::Arc;

/// `y = x·Wᵀ (+ b)` with the output features sharded over `Tp`; parameters held over `Dp`
/// as the data mode `D` says.
#[derive(Clone)]
pub struct ColumnParallelLinear<D: DataMode = Ddp> {
    /// The weight `[out, in]`, `Shard<0>` (output features) over `Tp`.
    pub weight: Weight<D, ColW>,
    /// The bias `[out]`, `Shard<0>` over `Tp` like the weight's rows; `None` without bias.
    pub bias: Option<Weight<D, ColB>>,
}

impl<D: DataMode> ColumnParallelLinear<D> {
    /// Weight `[out, in]` drawn `Normal(0, init.std)` (id `init.id`), bias from [`ParamInit::bias`] (id + 1).
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        init: ParamInit,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let w = Init::Normal { std: init.std }.param::<MasterLayout<D, ColW>>(
            init.seed,
            init.id,
            &[out_features, in_features],
            init.dtype,
            mesh,
        )?;
        let b = bias
            .then(|| {
                let b = init.bias().param::<MasterLayout<D, ColB>>(
                    init.seed,
                    init.id + 1,
                    &[out_features],
                    init.dtype,
                    mesh,
                )?;
                Weight::new(b, init.precision)
            })
            .transpose()?;
        Ok(ColumnParallelLinear {
            weight: Weight::new(w, init.precision)?,
            bias: b,
        })
    }

    /// Starts gathering the parameters over `Dp` (FSDP's prefetch; nothing otherwise).
    pub fn prefetch(&self) -> Result<()> {
        self.weight.prefetch()?;
        self.bias.as_ref().map_or(Ok(()), |b| b.prefetch())
    }

    /// The product on tokens already replicated over `Tp`: no communication (but the
    /// weight's gather over `Dp` under FSDP).
    pub fn forward_full<'t>(&self, tape: &'t Tape, x: &Var<'t, Full>) -> Result<Var<'t, ColOut>> {
        let y = self.weight.apply(tape, x, |x, w| x.matmul_t(w))?;
        match &self.bias {
            Some(b) => y.add_row(&b.on(tape)?),
            None => Ok(y),
        }
    }

    /// Enters the tensor-parallel region from the residual stream (`to_replicate`, or
    /// `all_gather` under SP) and multiplies.
    pub fn forward<'t, M: SeqMode>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
    ) -> Result<Var<'t, ColOut>> {
        self.forward_full(tape, &M::enter(x)?)
    }
}

impl<D: DataMode> Module for ColumnParallelLinear<D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        v.visit(&join_name(prefix, "weight"), &mut self.weight)?;
        match &mut self.bias {
            Some(b) => v.visit(&join_name(prefix, "bias"), b),
            None => Ok(()),
        }
    }
}

/// `y = x·Wᵀ (+ b)` with the input features sharded over `Tp`: each rank's product is a
/// `Partial` term; the bias is added once, after the reduction (as Megatron does).
#[derive(Clone)]
pub struct RowParallelLinear<M: SeqMode, D: DataMode = Ddp> {
    /// The weight `[out, in]`, `Shard<1>` (input features) over `Tp`.
    pub weight: Weight<D, RowW>,
    /// The bias `[out]`, placed over `Tp` as the stream it is added to is (so under SP its
    /// gradient is `Partial` over `Tp`); `None` without bias.
    pub bias: Option<Weight<D, StreamP<M>>>,
}

impl<M: SeqMode, D: DataMode> RowParallelLinear<M, D> {
    /// Weight `[out, in]` drawn `Normal(0, init.std)` (id `init.id`), bias from [`ParamInit::bias`] (id + 1).
    pub fn new(
        in_features: usize,
        out_features: usize,
        bias: bool,
        init: ParamInit,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let w = Init::Normal { std: init.std }.param::<MasterLayout<D, RowW>>(
            init.seed,
            init.id,
            &[out_features, in_features],
            init.dtype,
            mesh,
        )?;
        let b = bias
            .then(|| {
                let b = init.bias().param::<MasterLayout<D, StreamP<M>>>(
                    init.seed,
                    init.id + 1,
                    &[out_features],
                    init.dtype,
                    mesh,
                )?;
                Weight::new(b, init.precision)
            })
            .transpose()?;
        Ok(RowParallelLinear {
            weight: Weight::new(w, init.precision)?,
            bias: b,
        })
    }

    /// Starts gathering the parameters over `Dp` (FSDP's prefetch; nothing otherwise).
    pub fn prefetch(&self) -> Result<()> {
        self.weight.prefetch()?;
        self.bias.as_ref().map_or(Ok(()), |b| b.prefetch())
    }

    /// The product, reduced back into the stream (`all_reduce`, or `reduce_scatter` of the
    /// tokens under SP), plus the bias.
    pub fn forward<'t>(&self, tape: &'t Tape, x: &Var<'t, ColOut>) -> Result<Var<'t, Stream<M>>> {
        let y = M::exit(&self.weight.apply(tape, x, |x, w| x.matmul_t(w))?)?;
        match &self.bias {
            Some(b) => b.apply(tape, &y, |y, b| y.add_row(b)),
            None => Ok(y),
        }
    }
}

impl<M: SeqMode, D: DataMode> Module for RowParallelLinear<M, D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        v.visit(&join_name(prefix, "weight"), &mut self.weight)?;
        match &mut self.bias {
            Some(b) => v.visit(&join_name(prefix, "bias"), b),
            None => Ok(()),
        }
    }
}
