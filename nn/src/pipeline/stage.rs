//! A pipeline stage of the GPT: a contiguous run of its layers, the first stage with the
//! embedding, the last with the final norm, the LM head and the loss.
//!
//! A stage builds its layers with the model's own constructors (same seed, same parameter
//! ids, same names) and runs the model's forward over them, so a pipelined model is the
//! one-rank model cut into pieces, and its parameters compare by name.

use crate::data::{DataMode, Ddp};
use crate::embedding::VocabParallelEmbedding;
use crate::linear::ColumnParallelLinear;
use crate::model::{
    build_block, build_embedding, build_head, BatchTokens, GptConfig, GptSlice, SliceInput,
    SliceOutput, TransformerBlock,
};
use crate::norm::Norm;
use crate::params::{join_name, Module, ParamVisitor, StateVisitor};
use crate::seq::{Ids, SeqMode};
use dtensor_core::{DTensor, DeviceMesh, Error, Result, Tape};
use std::ops::Range;
use std::sync::Arc;

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
    /// Final norm and LM head (`None` inside when tied to this stage's embedding).
    #[allow(clippy::type_complexity)]
    pub head: Option<(Norm<M, D>, Option<ColumnParallelLinear<D>>)>,
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
        if config.tie_embeddings && !(first && last) {
            return Err(Error::InvalidUse {
                op: "GptStage::new",
                detail: "tied embeddings across pipeline stages are not supported (the first \
                         and last stage would share the weight): run a tied model with pp = 1"
                    .into(),
            });
        }
        config.check("GptStage::new")?;
        if layers.end > config.layers {
            return Err(Error::ShapeMismatch {
                op: "GptStage::new",
                detail: format!("layers {layers:?} of a model with {} layers", config.layers),
            });
        }
        let embedding = first.then(|| build_embedding(&config, mesh)).transpose()?;
        let blocks = layers
            .clone()
            .map(|l| build_block(&config, l, mesh))
            .collect::<Result<_>>()?;
        let head = last.then(|| build_head(&config, mesh)).transpose()?;
        Ok(GptStage {
            config,
            layers,
            embedding,
            blocks,
            head,
        })
    }

    /// This stage's forward of one microbatch, on `tape`: the model's forward over this
    /// stage's layers. The last stage needs the microbatch's `targets` and the global
    /// batch's token counts ([`BatchTokens::of`] all microbatches' targets: the loss is
    /// divided by the scored ones, so the losses of all microbatches and data ranks add up
    /// to the batch mean).
    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        input: SliceInput<'_, 't, M>,
        targets: Option<&DTensor<Ids>>,
        batch: BatchTokens,
    ) -> Result<SliceOutput<'t, M>> {
        GptSlice {
            config: &self.config,
            first_layer: self.layers.start,
            embedding: self.embedding.as_ref(),
            blocks: &self.blocks,
            head: self.head.as_ref().map(|(n, h)| {
                let w = match (h, &self.embedding) {
                    (Some(h), _) => &h.weight,
                    (None, Some(e)) => &e.weight,
                    (None, None) => unreachable!("a tied head is built only with the embedding"),
                };
                (n, w)
            }),
        }
        .forward(tape, input, targets, batch)
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
            if let Some(head) = head {
                head.visit_params(&join_name(prefix, "head"), v)?;
            }
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
