//! The pre-norm transformer block: `h = x + attn(norm1(x))`, `y = h + mlp(norm2(h))`; the
//! residual stream stays in the sequence mode's layout ([`Stream<M>`](crate::Stream))
//! throughout: `Shard<0>` over `Tp` with SP, `Invariant` without.

use crate::attention::ParallelAttention;
use crate::data::{DataMode, Ddp};
use crate::init::ParamInit;
use crate::mlp::ParallelMlp;
use crate::model::config::GptConfig;
use crate::moe::MoeMlp;
use crate::norm::Norm;
use crate::params::{join_name, Module, ParamVisitor, StateVisitor};
use crate::seq::{Loss, SeqMode, Stream};
use dtensor_core::{DeviceMesh, Error, Result, Tape, Var};
use dtensor_kernels::Tensor;
use std::sync::Arc;

/// A block's MLP: dense (tensor-parallel) or a mixture of experts.
// Held once per block, never moved in a hot loop: boxing would only add an indirection.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub enum BlockMlp<M: SeqMode, D: DataMode = Ddp> {
    /// A dense MLP, column- then row-parallel over `Tp`.
    Dense(ParallelMlp<M, D>),
    /// A mixture of experts, experts sharded over `Ep`.
    Moe(MoeMlp<M, D>),
}

impl<M: SeqMode, D: DataMode> BlockMlp<M, D> {
    /// The dense MLP, if it is one.
    pub fn dense(&self) -> Option<&ParallelMlp<M, D>> {
        match self {
            BlockMlp::Dense(m) => Some(m),
            BlockMlp::Moe(_) => None,
        }
    }
    /// The MoE MLP, if it is one.
    pub fn moe(&self) -> Option<&MoeMlp<M, D>> {
        match self {
            BlockMlp::Dense(_) => None,
            BlockMlp::Moe(m) => Some(m),
        }
    }
    fn prefetch(&self) -> Result<()> {
        match self {
            BlockMlp::Dense(m) => m.prefetch(),
            BlockMlp::Moe(m) => m.prefetch(),
        }
    }
}

impl<M: SeqMode, D: DataMode> Module for BlockMlp<M, D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        match self {
            BlockMlp::Dense(m) => m.visit_params(prefix, v),
            BlockMlp::Moe(m) => m.visit_params(prefix, v),
        }
    }
    fn visit_state<V: StateVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        match self {
            BlockMlp::Dense(_) => Ok(()),
            BlockMlp::Moe(m) => m.visit_state(prefix, v),
        }
    }
}

/// Pre-norm transformer block.
#[derive(Clone)]
pub struct TransformerBlock<M: SeqMode, D: DataMode = Ddp> {
    /// The norm before attention.
    pub norm1: Norm<M, D>,
    /// Self-attention, heads over `Tp`; its output is added to the residual stream.
    pub attn: ParallelAttention<M, D>,
    /// The norm before the MLP.
    pub norm2: Norm<M, D>,
    /// The MLP, dense or MoE; its output is added to the residual stream.
    pub mlp: BlockMlp<M, D>,
}

impl<M: SeqMode, D: DataMode> TransformerBlock<M, D> {
    /// Parameter ids `init.id .. init.id + 16` (an MoE MLP: router `+8`, experts `+9..+12`).
    pub fn new(cfg: &GptConfig, init: ParamInit, mesh: &Arc<DeviceMesh>) -> Result<Self> {
        let id = init.id;
        let out_std = init.std / (2.0 * cfg.layers.max(1) as f64).sqrt();
        let norm_init = ParamInit { std: 0.0, ..init };
        Ok(TransformerBlock {
            norm1: Norm::new(cfg.norm, cfg.hidden, cfg.eps, norm_init.with_id(id), mesh)?,
            attn: ParallelAttention::new(cfg.attention(), init.with_id(id + 2), out_std, mesh)?,
            norm2: Norm::new(
                cfg.norm,
                cfg.hidden,
                cfg.eps,
                norm_init.with_id(id + 6),
                mesh,
            )?,
            mlp: match cfg.moe {
                None => BlockMlp::Dense(ParallelMlp::new(
                    cfg.hidden,
                    cfg.ffn,
                    cfg.activation,
                    cfg.bias,
                    init.with_id(id + 8),
                    out_std,
                    mesh,
                )?),
                Some(moe) => BlockMlp::Moe(MoeMlp::new(
                    cfg.hidden,
                    cfg.ffn,
                    moe,
                    cfg.activation,
                    init.with_id(id + 8),
                    out_std,
                    mesh,
                )?),
            },
        })
    }

    /// Starts gathering the block's parameters over `Dp`, in the order its forward uses
    /// them (FSDP's prefetch; nothing otherwise).
    pub fn prefetch(&self) -> Result<()> {
        self.norm1.prefetch()?;
        self.attn.prefetch()?;
        self.norm2.prefetch()?;
        self.mlp.prefetch()
    }

    /// The block on `x`. `Err` for an MoE block, whose auxiliary loss this would drop:
    /// use [`forward_with_aux`](Self::forward_with_aux).
    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
    ) -> Result<Var<'t, Stream<M>>> {
        match self.forward_with_aux(tape, x)? {
            (y, None) => Ok(y),
            (_, Some(_)) => Err(Error::InvalidUse {
                op: "TransformerBlock::forward",
                detail: "an MoE block has an auxiliary loss: call forward_with_aux".into(),
            }),
        }
    }

    /// The block on `x`, and for an MoE block its MLP's auxiliary loss (unscaled).
    #[allow(clippy::type_complexity)]
    pub fn forward_with_aux<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
    ) -> Result<(Var<'t, Stream<M>>, Option<Var<'t, Loss>>)> {
        let h = x.add(&self.attn.forward(tape, &self.norm1.forward(tape, x)?)?)?;
        let n = self.norm2.forward(tape, &h)?;
        match &self.mlp {
            BlockMlp::Dense(m) => Ok((h.add(&m.forward(tape, &n)?)?, None)),
            BlockMlp::Moe(m) => {
                let (y, aux) = m.forward(tape, &n)?;
                Ok((h.add(&y)?, Some(aux)))
            }
        }
    }

    /// The block on one sample's new tokens for generation, its attention reading and
    /// extending `cache` ([`ParallelAttention::forward_cached`](crate::ParallelAttention::forward_cached));
    /// an MoE block's auxiliary loss is dropped.
    pub fn forward_cached<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
        cache: &mut Option<Tensor>,
        start: usize,
    ) -> Result<Var<'t, Stream<M>>> {
        let a = self
            .attn
            .forward_cached(tape, &self.norm1.forward(tape, x)?, cache, start)?;
        let h = x.add(&a)?;
        let n = self.norm2.forward(tape, &h)?;
        match &self.mlp {
            BlockMlp::Dense(m) => h.add(&m.forward(tape, &n)?),
            BlockMlp::Moe(m) => h.add(&m.forward(tape, &n)?.0),
        }
    }

    /// [`forward`](Self::forward) as a recomputed region: only the input and output stay
    /// on `tape`; the backward runs the block again (its collectives too) and
    /// differentiates that run.
    pub fn forward_recomputed<'t>(&self, x: &Var<'t, Stream<M>>) -> Result<Var<'t, Stream<M>>> {
        let block = self.clone();
        x.checkpoint(move |tape, x| block.forward(tape, x))
    }
}

impl<M: SeqMode, D: DataMode> Module for TransformerBlock<M, D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        self.norm1.visit_params(&join_name(prefix, "norm1"), v)?;
        self.attn.visit_params(&join_name(prefix, "attn"), v)?;
        self.norm2.visit_params(&join_name(prefix, "norm2"), v)?;
        self.mlp.visit_params(&join_name(prefix, "mlp"), v)
    }
    fn visit_state<V: StateVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        self.mlp.visit_state(&join_name(prefix, "mlp"), v)
    }
}
