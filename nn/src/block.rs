//! The pre-norm transformer block and a small GPT built from the parallel layers, forward
//! only.
//!
//! Block: `h = x + attn(norm1(x))`, `y = h + mlp(norm2(h))`; the residual stream stays in
//! the sequence mode's layout ([`Stream<M>`](crate::Stream)) throughout: `Shard<0>` over
//! `Tp` with SP, `Invariant` without.
//!
//! GPT: vocab-parallel embedding → blocks → final norm → column-parallel LM head (vocab
//! sharded over `Tp`) → vocab-parallel cross-entropy → [`mean_loss`](crate::mean_loss). The logits are never
//! gathered. [`Gpt::train_step`] is forward, `loss.backward()`, and one [`optim::step`]
//! (DP reduction, clipping, update).

use crate::attention::{AttentionConfig, ContextParallel, ParallelAttention};
use crate::buckets::DdpBuckets;
#[cfg(doc)]
use crate::buckets::DEFAULT_BUCKET_BYTES;
use crate::data::{DataMode, Ddp, Precision};
use crate::embedding::{loss_value, vocab_parallel_cross_entropy, VocabParallelEmbedding};
use crate::linear::{ColumnParallelLinear, ParamInit};
use crate::mlp::{Activation, ParallelMlp};
use crate::moe::{MoeConfig, MoeMlp};
use crate::norm::{Norm, NormKind};
use crate::optim::{
    self, join_name, named_params, GradAccumulator, Module, Optimizer, ParamVisitor, StateVisitor,
};
use crate::pipeline::stage::{StageInput, StageOutput, StageParts};
use crate::pipeline::GptStage;
use crate::seq::{Ids, Loss, SeqMode, Stream};
use dtensor_collectives::trace;
use dtensor_core::{DTensor, DeviceMesh, Error, Result, RoutingStats, Tape, Var};
use dtensor_kernels::{DType, Tensor};
use std::sync::Arc;

/// The shape of a GPT.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptConfig {
    /// Vocabulary size: rows of the embedding table and columns of the logits.
    pub vocab: usize,
    /// Model width: features per token in the residual stream.
    pub hidden: usize,
    /// Attention heads (a multiple of the `Tp` size; they divide `hidden`).
    pub heads: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// The dense MLP's inner width (`fc1`'s output features, sharded over `Tp`).
    pub ffn: usize,
    /// Tokens per sample (the context length; positions for RoPE).
    pub seq_len: usize,
    /// RMSNorm or LayerNorm, for the blocks' norms and the final one.
    pub norm: NormKind,
    /// The MLPs' non-linearity (GELU, or SwiGLU with a second up projection).
    pub activation: Activation,
    /// Biases in the linear layers.
    pub bias: bool,
    /// The norms' epsilon.
    pub eps: f64,
    /// The parameters' (master) dtype.
    pub dtype: DType,
    /// Seed of the deterministic initialisation (the same parameters at any parallel
    /// layout).
    pub seed: u64,
    /// Compute and gradient-reduction dtypes (mixed precision), FSDP's reshard flag.
    pub precision: Precision,
    /// Activation recomputation: each block's forward runs again in the backward instead
    /// of keeping its intermediates (only the block's input is kept).
    pub recompute: bool,
    /// How attention runs over `Cp` (ring or all-to-all, zigzag chunks); unused at `cp = 1`.
    pub context: ContextParallel,
    /// `Some`: every block's MLP is a mixture of experts ([`MoeMlp`]) over `Ep`, and the
    /// training loss adds `aux_loss_coef ·` its auxiliary loss. `None`: dense MLPs.
    pub moe: Option<MoeConfig>,
}

impl GptConfig {
    /// A small byte-level model: 2 layers, hidden 64, 4 heads, sequence 64.
    pub fn small(dtype: DType) -> Self {
        GptConfig {
            vocab: 256,
            hidden: 64,
            heads: 4,
            layers: 2,
            ffn: 256,
            seq_len: 64,
            norm: NormKind::Rms,
            activation: Activation::Gelu,
            bias: true,
            eps: 1e-5,
            dtype,
            seed: 1234,
            precision: Precision::default(),
            recompute: false,
            context: ContextParallel::default(),
            moe: None,
        }
    }

    fn attention(&self) -> AttentionConfig {
        AttentionConfig {
            hidden: self.hidden,
            heads: self.heads,
            seq_len: self.seq_len,
            rope_base: 10000.0,
            context: self.context,
        }
    }
}

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
            attn: ParallelAttention::new(
                cfg.attention(),
                cfg.bias,
                init.with_id(id + 2),
                out_std,
                mesh,
            )?,
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

/// Runs `f`, a named layer, on the timeline: a forward span now, and a backward span when
/// the tape's backward passes the layer (nothing when tracing is off).
pub(crate) fn traced<T>(
    tape: &Tape,
    name: impl Fn() -> String,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let _span = trace::span_with(&name, "forward");
    let region = tape.trace_begin();
    let out = f()?;
    tape.trace_end(region, name);
    Ok(out)
}

/// The loss head on the residual stream: final norm, LM head (logits sharded over the
/// vocabulary), vocab-parallel cross-entropy, summed over this `Dp` rank's tokens and
/// divided by `total_tokens` (the global batch's, whatever the microbatch), so that the
/// sum over `Dp` ranks and microbatches is the mean over the global batch.
pub(crate) fn head_loss<'t, M: SeqMode, D: DataMode>(
    norm: &Norm<M, D>,
    head: &ColumnParallelLinear<D>,
    loss_dtype: DType,
    tape: &'t Tape,
    x: &Var<'t, Stream<M>>,
    targets: &DTensor<Ids>,
    total_tokens: usize,
) -> Result<Var<'t, Loss>> {
    let x = norm.forward(tape, x)?;
    // Mixed precision: the loss in the masters' dtype (f32), as Megatron computes it.
    let logits = head.forward::<M>(tape, &x)?.to_dtype(loss_dtype)?;
    let losses = vocab_parallel_cross_entropy(&logits, &tape.constant(targets.clone()))?;
    losses
        .sum_dim::<0>()?
        .scale(1.0 / total_tokens.max(1) as f64)
}

/// A small GPT under sequence mode `M`, its parameters held over `Dp` as `D` says.
pub struct Gpt<M: SeqMode, D: DataMode = Ddp> {
    /// The model's shape, dtypes and options.
    pub config: GptConfig,
    /// DDP's gradient buckets: all-reduced over `Dp` while the backward runs, `Some(bytes)`
    /// per bucket (PyTorch's default is [`DEFAULT_BUCKET_BYTES`]); `None` (the default)
    /// reduces every gradient after the backward. Overlap pays where a rank's compute
    /// leaves a core (or a copy engine) free for the transfer; with every core computing,
    /// as thread ranks on a small CPU, the bucket copies cost more than they hide.
    pub ddp_bucket_bytes: Option<usize>,
    /// The token embedding `[vocab, hidden]`, vocabulary rows over `Tp`.
    pub embedding: VocabParallelEmbedding<D>,
    /// The transformer blocks, in order.
    pub blocks: Vec<TransformerBlock<M, D>>,
    /// The final norm, before the LM head.
    pub norm: Norm<M, D>,
    /// The LM head `[vocab, hidden]`, column-parallel: logits `Shard<1>` (vocabulary) over
    /// `Tp`, scored by [`vocab_parallel_cross_entropy`] without gathering them.
    pub head: ColumnParallelLinear<D>,
}

/// What one training step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Mean loss over the global batch, before the update.
    pub loss: f64,
    /// Global gradient norm before clipping; not finite when the update was skipped.
    pub grad_norm: f64,
}

impl<M: SeqMode, D: DataMode> Gpt<M, D> {
    /// Parameter ids: embedding 0, block `l` from `10 + 20·l`, final norm `5`, head `7`.
    pub fn new(config: GptConfig, mesh: &Arc<DeviceMesh>) -> Result<Self> {
        // The whole model is the one stage that is both first and last.
        let stage = GptStage::new(config, 0..config.layers, true, true, mesh)?;
        let (Some(embedding), Some((norm, head))) = (stage.embedding, stage.head) else {
            unreachable!("a first and last stage has the embedding and the head")
        };
        Ok(Gpt {
            config,
            ddp_bucket_bytes: None,
            embedding,
            blocks: stage.blocks,
            norm,
            head,
        })
    }

    /// The mean loss of `ids` predicting `targets` (both `[tokens]`, samples of `seq_len`
    /// tokens one after another), recorded on `tape`.
    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        ids: &DTensor<Ids>,
        targets: &DTensor<Ids>,
    ) -> Result<Var<'t, Loss>> {
        let parts = StageParts {
            config: &self.config,
            first_layer: 0,
            embedding: Some(&self.embedding),
            blocks: &self.blocks,
            head: Some((&self.norm, &self.head)),
        };
        let tokens = targets.global_shape()[0];
        match parts.forward(tape, StageInput::Ids(ids), Some(targets), tokens)? {
            StageOutput::Loss(loss) => Ok(loss),
            StageOutput::Hidden(_) => unreachable!("a last stage ends with the loss"),
        }
    }

    /// One training step: forward, `backward()`, then [`optim::step`] (the DDP average over
    /// `Dp`, the SP reduction over `Tp`, clipping to `max_norm`, the update).
    pub fn train_step(
        &mut self,
        ids: &DTensor<Ids>,
        targets: &DTensor<Ids>,
        opt: &mut impl Optimizer,
        max_norm: f64,
    ) -> Result<StepReport> {
        let tape = Tape::new();
        let loss = self.forward(&tape, ids, targets)?;
        let value = loss_value(&loss)?;
        let mut acc = GradAccumulator::new();
        match self.ddp_bucket_bytes {
            Some(cap) => {
                let mut buckets = DdpBuckets::new(self, cap)?;
                let mut grads =
                    loss.backward_hooked(&mut |key, g| buckets.push(&mut acc, key, g))?;
                buckets.flush()?;
                acc.add(self, &mut grads)?;
                buckets.finish(&mut acc)?;
            }
            None => acc.add(self, &mut loss.backward()?)?,
        }
        let grad_norm = optim::step_accumulated(self, acc, opt, max_norm)?;
        self.update_expert_bias();
        Ok(StepReport {
            loss: value,
            grad_norm,
        })
    }

    /// Aux-loss-free balancing after an optimizer step: every MoE block's
    /// [`MoeMlp::update_bias`] (nothing for dense blocks or without a bias rate).
    /// [`train_step`](Self::train_step) calls it; a loop stepping by hand calls it after
    /// each step.
    pub fn update_expert_bias(&self) {
        for b in &self.blocks {
            if let Some(m) = b.mlp.moe() {
                m.update_bias();
            }
        }
    }

    /// The routing statistics each MoE block recorded since the last call (one entry per
    /// forward, oldest first), per block in order; empty for a dense model.
    pub fn take_routing_stats(&self) -> Vec<Vec<RoutingStats>> {
        self.blocks
            .iter()
            .filter_map(|b| b.mlp.moe().map(|m| m.take_stats()))
            .collect()
    }

    /// Collective: every parameter as a whole tensor, in [`Module::visit_params`] order.
    pub fn full_params(&mut self) -> Result<Vec<Tensor>> {
        Ok(named_params(self)?.into_iter().map(|p| p.value).collect())
    }
}

impl<M: SeqMode, D: DataMode> Module for Gpt<M, D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        self.embedding
            .visit_params(&join_name(prefix, "embedding"), v)?;
        for (l, b) in self.blocks.iter_mut().enumerate() {
            b.visit_params(&join_name(prefix, &format!("blocks.{l}")), v)?;
        }
        self.norm.visit_params(&join_name(prefix, "norm"), v)?;
        self.head.visit_params(&join_name(prefix, "head"), v)
    }
    fn visit_state<V: StateVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        for (l, b) in self.blocks.iter_mut().enumerate() {
            b.visit_state(&join_name(prefix, &format!("blocks.{l}")), v)?;
        }
        Ok(())
    }
}
