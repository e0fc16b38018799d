//! A pipeline stage of the GPT: a contiguous run of its layers, the first stage with the
//! embedding, the last with the final norm, the LM head and the loss.
//!
//! A stage builds exactly the parameters the whole model would have for its layers (same
//! seed, same parameter ids, same names), so a pipelined model is the one-rank model cut
//! into pieces, and its parameters compare by name.

use crate::block::{head_loss, traced, GptConfig, TransformerBlock};
use crate::data::{DataMode, Ddp};
use crate::embedding::VocabParallelEmbedding;
use crate::linear::{ColumnParallelLinear, ParamInit};
use crate::norm::Norm;
use crate::optim::{join_name, Module, ParamVisitor, StateVisitor};
use crate::seq::{Ids, Loss, SeqMode, Stream};
use dtensor_core::{DTensor, DeviceMesh, Error, Result, Tape, Var};
use std::ops::Range;
use std::sync::Arc;

/// What enters a stage: token ids (the first stage) or the previous stage's output.
pub enum StageInput<'a, 't, M: SeqMode> {
    /// The microbatch's token ids (first stage).
    Ids(&'a DTensor<Ids>),
    /// The previous stage's output, received over the hop (a leaf on this stage's tape).
    Hidden(&'a Var<'t, Stream<M>>),
}

/// What leaves a stage: the residual stream for the next stage, or the loss (the last).
pub enum StageOutput<'t, M: SeqMode> {
    /// The residual stream, for the next stage.
    Hidden(Var<'t, Stream<M>>),
    /// The microbatch's loss (last stage).
    Loss(Var<'t, Loss>),
}

/// Layers `layers` of a GPT, with the embedding if it is the first stage and the loss
/// head if it is the last.
#[derive(Clone)]
pub struct GptStage<M: SeqMode, D: DataMode = Ddp> {
    /// The whole model's shape.
    pub config: GptConfig,
    /// The model's layers this stage holds.
    pub layers: Range<usize>,
    /// The token embedding (first stage only).
    pub embedding: Option<VocabParallelEmbedding<D>>,
    /// The blocks of `layers`, in order.
    pub blocks: Vec<TransformerBlock<M, D>>,
    /// Final norm and LM head.
    pub head: Option<(Norm<M, D>, ColumnParallelLinear<D>)>,
}

impl<M: SeqMode, D: DataMode> GptStage<M, D> {
    /// The stage holding `layers` of the model `config` describes (`first`: the
    /// embedding, `last`: the loss head), on the stage's mesh (`[Dp, Tp]`). Parameter ids
    /// as [`Gpt::new`](crate::Gpt::new) gives them.
    pub fn new(
        config: GptConfig,
        layers: Range<usize>,
        first: bool,
        last: bool,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        if config.moe.is_some() && !(first && last) {
            return Err(Error::InvalidUse {
                op: "GptStage::new",
                detail: "MoE blocks in pipeline stages are not supported (pp > 1): run MoE \
                         models with pp = 1"
                    .into(),
            });
        }
        if config.moe.is_some() && config.recompute {
            return Err(Error::InvalidUse {
                op: "GptStage::new",
                detail: "activation recomputation of MoE blocks is not supported (its \
                         auxiliary loss and routing statistics would be recorded twice)"
                    .into(),
            });
        }
        if layers.end > config.layers {
            return Err(Error::ShapeMismatch {
                op: "GptStage::new",
                detail: format!("layers {layers:?} of a model with {} layers", config.layers),
            });
        }
        let init =
            ParamInit::new(config.seed, 0, 0.02, config.dtype).with_precision(config.precision);
        let embedding = first
            .then(|| VocabParallelEmbedding::new(config.vocab, config.hidden, init, mesh))
            .transpose()?;
        let blocks = layers
            .clone()
            .map(|l| TransformerBlock::new(&config, init.with_id(10 + 20 * l as u64), mesh))
            .collect::<Result<_>>()?;
        let head = last
            .then(|| -> Result<_> {
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
                let head = ColumnParallelLinear::new(
                    config.hidden,
                    config.vocab,
                    false,
                    init.with_id(7),
                    mesh,
                )?;
                Ok((norm, head))
            })
            .transpose()?;
        Ok(GptStage {
            config,
            layers,
            embedding,
            blocks,
            head,
        })
    }

    /// This stage's forward of one microbatch, on `tape`. The last stage needs the
    /// microbatch's `targets` and the global batch's token count (the loss is divided by
    /// it, so the losses of all microbatches and `Dp` ranks add up to the batch mean).
    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        input: StageInput<'_, 't, M>,
        targets: Option<&DTensor<Ids>>,
        total_tokens: usize,
    ) -> Result<StageOutput<'t, M>> {
        StageParts {
            config: &self.config,
            first_layer: self.layers.start,
            embedding: self.embedding.as_ref(),
            blocks: &self.blocks,
            head: self.head.as_ref().map(|(n, h)| (n, h)),
        }
        .forward(tape, input, targets, total_tokens)
    }
}

/// A run of consecutive layers, borrowed: a [`GptStage`]'s, or the whole [`Gpt`](crate::Gpt)'s.
pub(crate) struct StageParts<'a, M: SeqMode, D: DataMode> {
    pub config: &'a GptConfig,
    /// The model index of `blocks[0]`.
    pub first_layer: usize,
    pub embedding: Option<&'a VocabParallelEmbedding<D>>,
    pub blocks: &'a [TransformerBlock<M, D>],
    pub head: Option<(&'a Norm<M, D>, &'a ColumnParallelLinear<D>)>,
}

impl<M: SeqMode, D: DataMode> StageParts<'_, M, D> {
    /// See [`GptStage::forward`]: embedding (first stage), blocks with FSDP's prefetch one
    /// layer ahead and each layer on the timeline, loss head (last stage).
    pub(crate) fn forward<'t>(
        &self,
        tape: &'t Tape,
        input: StageInput<'_, 't, M>,
        targets: Option<&DTensor<Ids>>,
        total_tokens: usize,
    ) -> Result<StageOutput<'t, M>> {
        // FSDP's prefetch, one layer ahead (see `Gpt::forward`).
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
            (StageInput::Ids(ids), Some(e)) => traced(
                tape,
                || "embedding".into(),
                || e.forward::<M>(tape, &tape.constant(ids.clone())),
            )?,
            (StageInput::Hidden(h), None) => h.clone(),
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
        match self.head {
            None if aux.is_empty() => Ok(StageOutput::Hidden(x)),
            None => Err(Error::InvalidUse {
                op: "GptStage::forward",
                detail: "MoE auxiliary losses need the loss head on the same stage".into(),
            }),
            Some((norm, head)) => {
                let targets = targets.ok_or_else(|| Error::InvalidUse {
                    op: "GptStage::forward",
                    detail: "the last stage needs the microbatch's targets".into(),
                })?;
                let mut loss = traced(
                    tape,
                    || "head".into(),
                    || {
                        head_loss(
                            norm,
                            head,
                            self.config.dtype,
                            tape,
                            &x,
                            targets,
                            total_tokens,
                        )
                    },
                )?;
                // Each auxiliary loss is this microbatch's; weighted by its share of the
                // batch so the microbatches' terms add up to the batch's.
                if let Some(moe) = self.config.moe.filter(|m| m.aux_loss_coef != 0.0) {
                    let share = targets.global_shape()[0] as f64 / total_tokens.max(1) as f64;
                    for a in &aux {
                        let a = a.to_dtype(self.config.dtype)?;
                        loss = loss.add(&a.scale(moe.aux_loss_coef * share)?)?;
                    }
                }
                Ok(StageOutput::Loss(loss))
            }
        }
    }
}

impl<M: SeqMode, D: DataMode> Module for GptStage<M, D> {
    /// The names the whole model gives these parameters (`blocks.{l}` with `l` the layer's
    /// index in the model).
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        if let Some(e) = &mut self.embedding {
            e.visit_params(&join_name(prefix, "embedding"), v)?;
        }
        for (b, l) in self.blocks.iter_mut().zip(self.layers.clone()) {
            b.visit_params(&join_name(prefix, &format!("blocks.{l}")), v)?;
        }
        if let Some((norm, head)) = &mut self.head {
            norm.visit_params(&join_name(prefix, "norm"), v)?;
            head.visit_params(&join_name(prefix, "head"), v)?;
        }
        Ok(())
    }
    fn visit_state<V: StateVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        for (b, l) in self.blocks.iter_mut().zip(self.layers.clone()) {
            b.visit_state(&join_name(prefix, &format!("blocks.{l}")), v)?;
        }
        Ok(())
    }
}
