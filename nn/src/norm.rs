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

use crate::init::Init;
use crate::linear::ParamInit;
use crate::optim::{join_name, Module, Param, ParamVisitor};
use crate::seq::{SeqMode, Stream, StreamParam};
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
pub struct Norm<M: SeqMode> {
    pub weight: Param<StreamParam<M>>,
    pub bias: Option<Param<StreamParam<M>>>,
    pub kind: NormKind,
    pub eps: f64,
}

impl<M: SeqMode> Norm<M> {
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
        let w = dtensor_core::DTensor::<StreamParam<M>>::from_global_fn(
            &[hidden],
            init.dtype,
            mesh,
            |i| 1.0 + normal.value(init.seed, init.id, i as u64),
        )?;
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

    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
    ) -> Result<Var<'t, Stream<M>>> {
        let w = self.weight.on(tape);
        match &self.bias {
            Some(b) => x.layer_norm::<1, _>(&w, &b.on(tape), self.eps),
            None => x.rms_norm::<1, _>(&w, self.eps),
        }
    }
}

impl<M: SeqMode> Module for Norm<M> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        v.visit(&join_name(prefix, "weight"), &mut self.weight)?;
        match &mut self.bias {
            Some(b) => v.visit(&join_name(prefix, "bias"), b),
            None => Ok(()),
        }
    }
}
