//! RMSNorm and LayerNorm on the residual stream, sequence-parallel aware.
//!
//! Without SP the stream is `Invariant` over `Tp`, every `Tp` rank normalises the same
//! tokens, and the weight is `Invariant` (its gradient too). With SP the stream is
//! `Shard<0>` over `Tp`, each rank normalises its own tokens with the same weight, which is
//! therefore `Replicate` over `Tp`, and its gradient `Partial`: the optimizer does not take
//! it until it is all-reduced over `Tp` ([`TpParam::reduce_over_tp`](crate::TpParam)),
//! Megatron's hand-written `allreduce_sequence_parallel_grads`, here demanded by the type.
//! The norm rule (`NormRule`) derives both pairings; an `Invariant` weight on an SP stream
//! does not compile.

use crate::data::{DataMode, Ddp, MasterLayout, StreamP};
use crate::init::{Init, ParamInit};
use crate::params::{join_name, Module, ParamVisitor, Weight};
use crate::seq::{SeqMode, Stream};
use dtensor_core::{DeviceMesh, Result, Tape, Var};
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
#[derive(Clone)]
pub struct Norm<M: SeqMode, D: DataMode = Ddp> {
    /// The scale `w` `[hidden]`: `Invariant` over `Tp`, `Replicate` under SP (see the
    /// module docs).
    pub weight: Weight<D, StreamP<M>>,
    /// LayerNorm's shift `b` `[hidden]`, placed as the weight; `None` for RMSNorm.
    pub bias: Option<Weight<D, StreamP<M>>>,
    /// RMSNorm or LayerNorm.
    pub kind: NormKind,
    /// Added to the mean square (RMS) or the variance (Layer) before the square root.
    pub eps: f64,
}

impl<M: SeqMode, D: DataMode> Norm<M, D> {
    /// Weight `1 + Normal(0, init.std)` (id `init.id`); LayerNorm's bias from
    /// [`ParamInit::bias`] (id + 1).
    pub fn new(
        kind: NormKind,
        hidden: usize,
        eps: f64,
        init: ParamInit,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let normal = Init::Normal { std: init.std };
        let w = dtensor_core::DTensor::<MasterLayout<D, StreamP<M>>>::from_global_fn(
            &[hidden],
            init.dtype,
            mesh,
            |i| 1.0 + normal.value(init.seed, init.id, i as u64),
        )?;
        let bias = match kind {
            NormKind::Layer => Some(Weight::new(
                init.bias().param::<MasterLayout<D, StreamP<M>>>(
                    init.seed,
                    init.id + 1,
                    &[hidden],
                    init.dtype,
                    mesh,
                )?,
                init.precision,
            )?),
            NormKind::Rms => None,
        };
        Ok(Norm {
            weight: Weight::new(w, init.precision)?,
            bias,
            kind,
            eps,
        })
    }

    /// Starts gathering the parameters over `Dp` (FSDP's prefetch; nothing otherwise).
    pub fn prefetch(&self) -> Result<()> {
        self.weight.prefetch()?;
        self.bias.as_ref().map_or(Ok(()), |b| b.prefetch())
    }

    /// Normalises each token of the stream `x` (`[tokens, hidden]`) over its features.
    /// No communication in the forward (FSDP's gather over `Dp` aside); under SP the
    /// weight's gradient comes back `Partial` over `Tp`. `Err` if `x`'s width is not
    /// `hidden`.
    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
    ) -> Result<Var<'t, Stream<M>>> {
        let eps = self.eps;
        match &self.bias {
            // Two parameters in one op: both gathered, kept until the backward under FSDP.
            Some(b) => x.layer_norm::<1, _>(&self.weight.on(tape)?, &b.on(tape)?, eps),
            None => self
                .weight
                .apply(tape, x, move |x, w| x.rms_norm::<1, _>(w, eps)),
        }
    }
}

impl<M: SeqMode, D: DataMode> Module for Norm<M, D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        v.visit(&join_name(prefix, "weight"), &mut self.weight)?;
        match &mut self.bias {
            Some(b) => v.visit(&join_name(prefix, "bias"), b),
            None => Ok(()),
        }
    }
}
