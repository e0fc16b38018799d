//! The tensor-parallel MLP: column-parallel up projection, activation on the sharded
//! features (no communication), row-parallel down projection. One entry (`to_replicate` /
//! `all_gather`) and one exit (`all_reduce` / `reduce_scatter`) per call, as Megatron.

use crate::data::{DataMode, Ddp};
use crate::init::ParamInit;
use crate::linear::{ColumnParallelLinear, RowParallelLinear};
use crate::params::{join_name, Module, ParamVisitor};
use crate::seq::{SeqMode, Stream};
use dtensor_core::{DeviceMesh, Result, Tape, Var};
use std::sync::Arc;

/// The MLP's non-linearity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `gelu(x·W1ᵀ)`.
    Gelu,
    /// `silu(x·W1ᵀ) ⊙ (x·Wupᵀ)` (the gate is `fc1`).
    SwiGlu,
}

/// `fc2(act(fc1(x)))`, with `up` as SwiGLU's second projection.
#[derive(Clone)]
pub struct ParallelMlp<M: SeqMode, D: DataMode = Ddp> {
    /// The first projection `[ffn, hidden]`, column-parallel (SwiGLU's gate).
    pub fc1: ColumnParallelLinear<D>,
    /// SwiGLU's second projection `[ffn, hidden]`, column-parallel; `None` for GELU.
    pub up: Option<ColumnParallelLinear<D>>,
    /// The output projection `[hidden, ffn]`, row-parallel: reduced back into the stream.
    pub fc2: RowParallelLinear<M, D>,
    /// The non-linearity between the projections.
    pub activation: Activation,
}

impl<M: SeqMode, D: DataMode> ParallelMlp<M, D> {
    /// Parameter ids: `fc1` from `init.id`, `up` from `+2`, `fc2` from `+4` (drawn with
    /// `out_std`).
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

    /// Starts gathering the parameters over `Dp` (FSDP's prefetch; nothing otherwise).
    pub fn prefetch(&self) -> Result<()> {
        self.fc1.prefetch()?;
        if let Some(up) = &self.up {
            up.prefetch()?;
        }
        self.fc2.prefetch()
    }

    /// The MLP on the stream `x` (`[tokens, hidden]`): enters with `to_replicate`
    /// (`all_gather` of the tokens under SP), computes the `[tokens, ffn/tp]` activation
    /// locally, and leaves with `all_reduce` (`reduce_scatter` under SP). `Err` if the
    /// shapes do not fit or a collective fails.
    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
    ) -> Result<Var<'t, Stream<M>>> {
        let x = M::enter(x)?;
        let h = self.fc1.forward_full(tape, &x)?;
        let a = match &self.up {
            Some(up) => h.swiglu(&up.forward_full(tape, &x)?)?,
            None => h.gelu()?,
        };
        self.fc2.forward(tape, &a)
    }
}

impl<M: SeqMode, D: DataMode> Module for ParallelMlp<M, D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        self.fc1.visit_params(&join_name(prefix, "fc1"), v)?;
        if let Some(up) = &mut self.up {
            up.visit_params(&join_name(prefix, "up"), v)?;
        }
        self.fc2.visit_params(&join_name(prefix, "fc2"), v)
    }
}
