//! The GPT: vocab-parallel embedding → blocks → final norm → column-parallel LM head (vocab
//! sharded over `Tp`) → vocab-parallel cross-entropy (targets equal to [`IGNORE_INDEX`]
//! score nothing; an optional z-loss, [`GptConfig::z_loss`]) → the mean over the scored
//! tokens of the global batch ([`mean_loss_over`](crate::mean_loss_over) with
//! [`BatchTokens`]). The logits are never gathered. [`Gpt::train_step`] is forward,
//! `loss.backward()`, and one [`step`](crate::step) (DP reduction, clipping, update).
//!
//! The forward is written once, for a run of consecutive layers ([`GptSlice`]): the whole
//! model is the run that has the embedding and the loss head, a pipeline stage
//! ([`GptStage`](crate::GptStage)) a run that may lack either. Each layer is built by the
//! same function with the same parameter id wherever it runs (embedding 0, final norm 5,
//! head 7, block `l` from `10 + 20·l`), so a model cut into stages holds exactly the
//! parameters of the whole one, under the same names.

use crate::buckets::DdpBuckets;
#[cfg(doc)]
use crate::buckets::DEFAULT_BUCKET_BYTES;
use crate::data::{ColW, DataMode, Ddp};
use crate::embedding::{
    loss_value, mean_loss_over, vocab_parallel_cross_entropy_with, VocabParallelEmbedding,
};
use crate::init::ParamInit;
use crate::linear::ColumnParallelLinear;
use crate::model::block::TransformerBlock;
use crate::model::config::GptConfig;
use crate::norm::Norm;
use crate::optim::{step_accumulated, Optimizer};
use crate::params::{
    join_name, named_params, GradAccumulator, Module, ParamVisitor, StateVisitor, Weight,
};
use crate::seq::{ColOut, Ids, Loss, SeqMode, Stream};
use dtensor_collectives::trace;
use dtensor_core::{CrossEntropy, DTensor, DeviceMesh, Error, Result, RoutingStats, Tape, Var};
use dtensor_kernels::ops::IGNORE_INDEX;
use dtensor_kernels::Tensor;
use std::sync::Arc;

/// The initialisation every layer of the model draws from (the seed, std 0.02, the
/// masters' dtype and precision); each layer takes its own ids from it.
fn param_init(config: &GptConfig) -> ParamInit {
    ParamInit::new(config.seed, 0, 0.02, config.dtype).with_precision(config.precision)
}

/// The token embedding (parameter id 0).
pub(crate) fn build_embedding<D: DataMode>(
    config: &GptConfig,
    mesh: &Arc<DeviceMesh>,
) -> Result<VocabParallelEmbedding<D>> {
    VocabParallelEmbedding::new(config.vocab, config.hidden, param_init(config), mesh)
}

/// Block `layer` (parameter ids from `10 + 20·layer`).
pub(crate) fn build_block<M: SeqMode, D: DataMode>(
    config: &GptConfig,
    layer: usize,
    mesh: &Arc<DeviceMesh>,
) -> Result<TransformerBlock<M, D>> {
    TransformerBlock::new(
        config,
        param_init(config).with_id(10 + 20 * layer as u64),
        mesh,
    )
}

/// The final norm (id 5) and the LM head (id 7, no bias; `None` when it is tied to the
/// embedding).
#[allow(clippy::type_complexity)]
pub(crate) fn build_head<M: SeqMode, D: DataMode>(
    config: &GptConfig,
    mesh: &Arc<DeviceMesh>,
) -> Result<(Norm<M, D>, Option<ColumnParallelLinear<D>>)> {
    let init = param_init(config);
    let norm = Norm::new(
        config.norm,
        config.hidden,
        config.eps,
        ParamInit {
            std: 0.0,
            ..init.with_id(5)
        },
        mesh,
    )?;
    let head = (!config.tie_embeddings)
        .then(|| {
            ColumnParallelLinear::new(config.hidden, config.vocab, false, init.with_id(7), mesh)
        })
        .transpose()?;
    Ok((norm, head))
}

/// What enters a run of layers: token ids (the first) or the previous run's output.
pub enum SliceInput<'a, 't, M: SeqMode> {
    /// The microbatch's token ids (the run holds the embedding).
    Ids(&'a DTensor<Ids>),
    /// The previous run's output, received over a pipeline hop (a leaf on this tape).
    Hidden(&'a Var<'t, Stream<M>>),
}

/// What leaves a run of layers: the residual stream for the next run, or the loss (the
/// run holds the loss head).
pub enum SliceOutput<'t, M: SeqMode> {
    /// The residual stream, for the next run.
    Hidden(Var<'t, Stream<M>>),
    /// The microbatch's loss.
    Loss(Var<'t, Loss>),
}

/// The loss head, borrowed: the final norm and the LM head's weight (its own, or the
/// embedding's when tied).
pub(crate) type LossHead<'a, M, D> = (&'a Norm<M, D>, &'a Weight<D, ColW>);

/// A run of consecutive layers of a GPT, borrowed: the whole [`Gpt`]'s, or a pipeline
/// stage's.
pub(crate) struct GptSlice<'a, M: SeqMode, D: DataMode> {
    /// The whole model's shape.
    pub config: &'a GptConfig,
    /// The model index of `blocks[0]`.
    pub first_layer: usize,
    /// The token embedding, if the run starts the model.
    pub embedding: Option<&'a VocabParallelEmbedding<D>>,
    /// The blocks, in order.
    pub blocks: &'a [TransformerBlock<M, D>],
    /// Final norm and the LM head's weight (its own, or the embedding's when tied), if the
    /// run ends the model.
    pub head: Option<LossHead<'a, M, D>>,
}

impl<M: SeqMode, D: DataMode> GptSlice<'_, M, D> {
    /// The run's forward of one microbatch, on `tape`: embedding (if it has it), blocks,
    /// loss head (if it has it; it then needs the microbatch's `targets` and the global
    /// batch's token counts, by which the loss is divided so that the losses of all
    /// microbatches and `Dp` ranks add up to the batch mean).
    pub(crate) fn forward<'t>(
        &self,
        tape: &'t Tape,
        input: SliceInput<'_, 't, M>,
        targets: Option<&DTensor<Ids>>,
        batch: BatchTokens,
    ) -> Result<SliceOutput<'t, M>> {
        let (x, aux) = self.trunk(tape, input)?;
        match self.head {
            None if aux.is_empty() => Ok(SliceOutput::Hidden(x)),
            None => Err(Error::InvalidUse {
                op: "GptStage::forward",
                detail: "MoE auxiliary losses need the loss head on the same stage".into(),
            }),
            Some(head) => {
                let targets = targets.ok_or_else(|| Error::InvalidUse {
                    op: "GptStage::forward",
                    detail: "the last stage needs the microbatch's targets".into(),
                })?;
                let (loss, _) = loss(self.config, head, tape, &x, &aux, targets, batch)?;
                Ok(SliceOutput::Loss(loss))
            }
        }
    }

    /// Embedding (or the input) and blocks, with FSDP's prefetch one layer ahead and each
    /// layer on the timeline: the residual stream and the MoE blocks' auxiliary losses.
    #[allow(clippy::type_complexity)]
    fn trunk<'t>(
        &self,
        tape: &'t Tape,
        input: SliceInput<'_, 't, M>,
    ) -> Result<(Var<'t, Stream<M>>, Vec<Var<'t, Loss>>)> {
        let prefetch = self.config.precision.prefetch;
        if prefetch {
            if let Some(e) = &self.embedding {
                e.prefetch()?;
            }
            if let Some(b) = self.blocks.first() {
                b.prefetch()?;
            }
        }
        let mut aux: Vec<Var<'t, Loss>> = Vec::new();
        let mut x = match (input, self.embedding) {
            (SliceInput::Ids(ids), Some(e)) => traced(
                tape,
                || "embedding".into(),
                || e.forward::<M>(tape, &tape.constant(ids.clone())),
            )?,
            (SliceInput::Hidden(h), None) => h.clone(),
            _ => {
                return Err(Error::InvalidUse {
                    op: "GptStage::forward",
                    detail: "the first stage takes token ids, the others the previous stage's \
                             output"
                        .into(),
                })
            }
        };
        for (i, b) in self.blocks.iter().enumerate() {
            if prefetch {
                match (self.blocks.get(i + 1), self.head) {
                    (Some(next), _) => next.prefetch()?,
                    (None, Some((norm, head))) => {
                        norm.prefetch()?;
                        head.prefetch()?;
                    }
                    (None, None) => {}
                }
            }
            let l = self.first_layer + i;
            let (y, a) = traced(
                tape,
                || format!("block.{l}"),
                || {
                    if self.config.recompute {
                        Ok((b.forward_recomputed(&x)?, None))
                    } else {
                        b.forward_with_aux(tape, &x)
                    }
                },
            )?;
            x = y;
            aux.extend(a);
        }
        Ok((x, aux))
    }
}

/// The token counts of a global batch by which each microbatch's loss is divided, each
/// summed over the data axes (`Dp`, `Ep`, `Cp`) and over the microbatches, so they are the
/// same on every rank and for every mesh.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchTokens {
    /// Every token: the MoE auxiliary loss is weighted by a microbatch's share of them.
    pub tokens: usize,
    /// The tokens whose target is not [`IGNORE_INDEX`]: the cross-entropy is their mean.
    pub scored: usize,
}

impl BatchTokens {
    /// Collective over the axes that split the tokens: the counts of the batch whose
    /// microbatches' targets are `targets` (one tensor for the whole batch, or one per
    /// microbatch): one all-reduce of one value per data axis.
    pub fn of(targets: &[DTensor<Ids>]) -> Result<Self> {
        Ok(BatchTokens {
            tokens: targets.iter().map(|t| t.global_shape()[0]).sum(),
            scored: DTensor::scored_tokens_of(targets, Some(IGNORE_INDEX))?,
        })
    }
}

/// The training loss of one microbatch on the last residual stream `x`: the loss head
/// ([`head_loss`]) on the timeline, plus each MoE auxiliary loss in `aux` weighted by
/// `aux_loss_coef` and by the microbatch's share of the batch's tokens (all of them,
/// ignored targets included: the router balances every token it routes), so that the
/// microbatches' terms add up to the batch's. Also the logits it scored.
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
fn loss<'t, M: SeqMode, D: DataMode>(
    config: &GptConfig,
    (norm, head): LossHead<'_, M, D>,
    tape: &'t Tape,
    x: &Var<'t, Stream<M>>,
    aux: &[Var<'t, Loss>],
    targets: &DTensor<Ids>,
    batch: BatchTokens,
) -> Result<(Var<'t, Loss>, Var<'t, ColOut>)> {
    let (mut loss, logits) = traced(
        tape,
        || "head".into(),
        || head_loss(config, (norm, head), tape, x, targets, batch.scored),
    )?;
    if let Some(moe) = config.moe.filter(|m| m.aux_loss_coef != 0.0) {
        let share = targets.global_shape()[0] as f64 / batch.tokens.max(1) as f64;
        for a in aux {
            let a = a.to_dtype(config.dtype)?;
            loss = loss.add(&a.scale(moe.aux_loss_coef * share)?)?;
        }
    }
    Ok((loss, logits))
}

/// Runs `f`, a named layer, on the timeline: a forward span now, and a backward span when
/// the tape's backward passes the layer (nothing when tracing is off).
fn traced<T>(tape: &Tape, name: impl Fn() -> String, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let _span = trace::span_with(&name, "forward");
    let region = tape.trace_begin();
    let out = f()?;
    tape.trace_end(region, name);
    Ok(out)
}

/// The final norm and the LM head on the residual stream `x`: the logits `[tokens,
/// vocab]`, vocabulary sharded over `Tp`, in the masters' dtype (mixed precision: the loss
/// in f32, as Megatron computes it).
fn head_logits<'t, M: SeqMode, D: DataMode>(
    config: &GptConfig,
    (norm, head): LossHead<'_, M, D>,
    tape: &'t Tape,
    x: &Var<'t, Stream<M>>,
) -> Result<Var<'t, ColOut>> {
    let x = norm.forward(tape, x)?;
    // The column-parallel product without bias (ColumnParallelLinear::forward's), on the
    // head's weight or the tied embedding's.
    head.apply(tape, &M::enter(&x)?, |x, w| x.matmul_t(w))?
        .to_dtype(config.dtype)
}

/// The loss head on the residual stream: final norm, LM head (logits sharded over the
/// vocabulary), vocab-parallel cross-entropy (targets equal to [`IGNORE_INDEX`] score
/// nothing; plus the z-loss of [`GptConfig::z_loss`]), summed over this rank's tokens and
/// divided by `scored_tokens` (the global batch's scored tokens, whatever the microbatch),
/// so that the sum over the data ranks and microbatches is the mean over the scored tokens
/// of the global batch. With no ignored target that count is every token: the bits of a
/// plain mean. Also the logits, `[tokens, vocab]` sharded over `Tp` by vocabulary.
fn head_loss<'t, M: SeqMode, D: DataMode>(
    config: &GptConfig,
    (norm, head): LossHead<'_, M, D>,
    tape: &'t Tape,
    x: &Var<'t, Stream<M>>,
    targets: &DTensor<Ids>,
    scored_tokens: usize,
) -> Result<(Var<'t, Loss>, Var<'t, ColOut>)> {
    let logits = head_logits(config, (norm, head), tape, x)?;
    let options = CrossEntropy::default()
        .ignoring(IGNORE_INDEX)
        .with_z_loss(config.z_loss);
    let losses =
        vocab_parallel_cross_entropy_with(&logits, &tape.constant(targets.clone()), options)?;
    Ok((mean_loss_over(&losses, scored_tokens)?, logits))
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
    /// `Tp`, scored by [`vocab_parallel_cross_entropy_with`] without gathering them.
    /// `None` when tied to the embedding ([`GptConfig::tie_embeddings`]).
    pub head: Option<ColumnParallelLinear<D>>,
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
    /// The LM head's weight: its own, or the embedding's when tied.
    fn head_weight(&self) -> &Weight<D, ColW> {
        match &self.head {
            Some(h) => &h.weight,
            None => &self.embedding.weight,
        }
    }

    /// Parameter ids: embedding 0, block `l` from `10 + 20·l`, final norm `5`, head `7`.
    pub fn new(config: GptConfig, mesh: &Arc<DeviceMesh>) -> Result<Self> {
        config.check("Gpt::new")?;
        let embedding = build_embedding(&config, mesh)?;
        let blocks = (0..config.layers)
            .map(|l| build_block(&config, l, mesh))
            .collect::<Result<_>>()?;
        let (norm, head) = build_head(&config, mesh)?;
        Ok(Gpt {
            config,
            ddp_bucket_bytes: None,
            embedding,
            blocks,
            norm,
            head,
        })
    }

    /// The mean loss of `ids` predicting `targets` (both `[tokens]`, samples of `seq_len`
    /// tokens one after another), recorded on `tape`: the mean over the targets that are
    /// not [`IGNORE_INDEX`] (padding, masked prompt tokens) of the whole batch, the same
    /// whatever the mesh; 0 (and zero gradients) if every target is ignored.
    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        ids: &DTensor<Ids>,
        targets: &DTensor<Ids>,
    ) -> Result<Var<'t, Loss>> {
        Ok(self.forward_with_logits(tape, ids, targets)?.0)
    }

    /// The logits of the last residual stream `x`: final norm and LM head, `[tokens,
    /// vocab]` sharded over `Tp` by vocabulary.
    pub(crate) fn logits<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
    ) -> Result<Var<'t, ColOut>> {
        head_logits(&self.config, (&self.norm, self.head_weight()), tape, x)
    }

    /// [`forward`](Self::forward), also handing back the logits it scored: `[tokens,
    /// vocab]`, the vocabulary sharded over `Tp`, the tokens laid out as `ids` (under `Cp`
    /// in its chunk order). For inspection and parity checks; training needs only the loss.
    pub fn forward_with_logits<'t>(
        &self,
        tape: &'t Tape,
        ids: &DTensor<Ids>,
        targets: &DTensor<Ids>,
    ) -> Result<(Var<'t, Loss>, Var<'t, ColOut>)> {
        let whole = GptSlice {
            config: &self.config,
            first_layer: 0,
            embedding: Some(&self.embedding),
            blocks: &self.blocks,
            head: Some((&self.norm, self.head_weight())),
        };
        let (x, aux) = whole.trunk(tape, SliceInput::Ids(ids))?;
        let batch = BatchTokens::of(std::slice::from_ref(targets))?;
        loss(
            &self.config,
            (&self.norm, self.head_weight()),
            tape,
            &x,
            &aux,
            targets,
            batch,
        )
    }

    /// One training step: forward, `backward()`, then [`step`](crate::step) (the DDP average over
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
        let grad_norm = step_accumulated(self, acc, opt, max_norm)?;
        self.update_expert_bias();
        Ok(StepReport {
            loss: value,
            grad_norm,
        })
    }

    /// Aux-loss-free balancing after an optimizer step: every MoE block's
    /// [`MoeMlp::update_bias`](crate::MoeMlp::update_bias) (nothing for dense blocks or without a bias rate).
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
        match &mut self.head {
            Some(h) => h.visit_params(&join_name(prefix, "head"), v),
            None => Ok(()),
        }
    }
    fn visit_state<V: StateVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        for (l, b) in self.blocks.iter_mut().enumerate() {
            b.visit_state(&join_name(prefix, &format!("blocks.{l}")), v)?;
        }
        Ok(())
    }
}
