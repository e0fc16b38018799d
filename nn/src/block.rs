//! The pre-norm transformer block and a small GPT built from the parallel layers.
//!
//! Block: `h = x + attn(norm1(x))`, `y = h + mlp(norm2(h))`; the residual stream stays in
//! the sequence mode's layout ([`Stream<M>`](crate::Stream)) throughout: `Shard<0>` over
//! `Tp` with SP, `Invariant` without.
//!
//! GPT: vocab-parallel embedding → blocks → final norm → column-parallel LM head (vocab
//! sharded over `Tp`) → vocab-parallel cross-entropy. The logits are never gathered.

use crate::attention::{
    AttentionConfig, AttentionCtx, AttentionGrads, AttentionGradsReduced, ParallelAttention,
};
use crate::embedding::{
    mean_loss, vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward,
    CrossEntropyCtx, EmbeddingCtx, EmbeddingGrads, EmbeddingGradsReduced, VocabParallelEmbedding,
};
use crate::linear::{ColumnCtx, ColumnGrads, ColumnGradsReduced, ColumnParallelLinear, ParamInit};
use crate::mlp::{Activation, MlpCtx, MlpGrads, MlpGradsReduced, ParallelMlp};
use crate::norm::{Norm, NormCtx, NormGrads, NormGradsReduced, NormKind};
use crate::optim::{clip_coefficient, GradNorm, Optimizer};
use crate::seq::{pointwise, Ids, SeqMode, Stream, TokenInvariant};
use dtensor_core::{DTensor, DeviceMesh, Result};
use dtensor_kernels::{DType, Tensor};
use std::sync::Arc;

/// The shape of a GPT.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptConfig {
    pub vocab: usize,
    pub hidden: usize,
    pub heads: usize,
    pub layers: usize,
    pub ffn: usize,
    pub seq_len: usize,
    pub norm: NormKind,
    pub activation: Activation,
    /// Biases in the linear layers.
    pub bias: bool,
    pub eps: f64,
    pub dtype: DType,
    pub seed: u64,
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
        }
    }

    fn attention(&self) -> AttentionConfig {
        AttentionConfig {
            hidden: self.hidden,
            heads: self.heads,
            seq_len: self.seq_len,
            rope_base: 10000.0,
        }
    }
}

/// Pre-norm transformer block.
pub struct TransformerBlock<M: SeqMode> {
    pub norm1: Norm<M>,
    pub attn: ParallelAttention<M>,
    pub norm2: Norm<M>,
    pub mlp: ParallelMlp<M>,
}

/// What [`TransformerBlock::forward`] keeps for its backward.
pub struct BlockCtx<M: SeqMode> {
    n1: NormCtx,
    attn: AttentionCtx<M>,
    n2: NormCtx,
    mlp: MlpCtx<M>,
}

/// A block's raw gradients.
pub struct BlockGrads<M: SeqMode> {
    pub norm1: NormGrads<M>,
    pub attn: AttentionGrads<M>,
    pub norm2: NormGrads<M>,
    pub mlp: MlpGrads<M>,
}

/// A block's reduced gradients.
pub struct BlockGradsReduced {
    pub norm1: NormGradsReduced,
    pub attn: AttentionGradsReduced,
    pub norm2: NormGradsReduced,
    pub mlp: MlpGradsReduced,
}

impl<M: SeqMode> BlockGrads<M> {
    pub fn reduce(self) -> Result<BlockGradsReduced> {
        Ok(BlockGradsReduced {
            norm1: self.norm1.reduce()?,
            attn: self.attn.reduce()?,
            norm2: self.norm2.reduce()?,
            mlp: self.mlp.reduce()?,
        })
    }
}

impl BlockGradsReduced {
    pub fn norm(&self, n: &mut GradNorm) -> Result<()> {
        self.norm1.norm(n)?;
        self.attn.norm(n)?;
        self.norm2.norm(n)?;
        self.mlp.norm(n)
    }
    pub fn scale(&self, f: f64) -> Result<Self> {
        Ok(BlockGradsReduced {
            norm1: self.norm1.scale(f)?,
            attn: self.attn.scale(f)?,
            norm2: self.norm2.scale(f)?,
            mlp: self.mlp.scale(f)?,
        })
    }
}

impl<M: SeqMode> TransformerBlock<M> {
    /// Parameter ids `init.id .. init.id + 16`.
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
            mlp: ParallelMlp::new(
                cfg.hidden,
                cfg.ffn,
                cfg.activation,
                cfg.bias,
                init.with_id(id + 8),
                out_std,
                mesh,
            )?,
        })
    }

    pub fn forward(&self, x: DTensor<Stream<M>>) -> Result<(DTensor<Stream<M>>, BlockCtx<M>)> {
        let (a, n1) = self.norm1.forward(&x)?;
        let (a, attn) = self.attn.forward(a)?;
        let h = x.add(&a)?;
        let (m, n2) = self.norm2.forward(&h)?;
        let (m, mlp) = self.mlp.forward(m)?;
        let y = h.add(&m)?;
        Ok((y, BlockCtx { n1, attn, n2, mlp }))
    }

    pub fn backward(
        &self,
        ctx: BlockCtx<M>,
        dy: &DTensor<Stream<M>>,
    ) -> Result<(DTensor<Stream<M>>, BlockGrads<M>)> {
        let (dm, mlp) = self.mlp.backward(ctx.mlp, dy)?;
        let (dm, norm2) = self.norm2.backward(ctx.n2, &dm)?;
        let dh = dy.add(&dm)?;
        let (da, attn) = self.attn.backward(ctx.attn, &dh)?;
        let (da, norm1) = self.norm1.backward(ctx.n1, &da)?;
        let dx = dh.add(&da)?;
        Ok((
            dx,
            BlockGrads {
                norm1,
                attn,
                norm2,
                mlp,
            },
        ))
    }

    pub fn apply(&mut self, g: &BlockGradsReduced, opt: &impl Optimizer) -> Result<()> {
        self.norm1.apply(&g.norm1, opt)?;
        self.attn.apply(&g.attn, opt)?;
        self.norm2.apply(&g.norm2, opt)?;
        self.mlp.apply(&g.mlp, opt)
    }
}

/// A small GPT: embedding, `layers` blocks, final norm, LM head (untied).
pub struct Gpt<M: SeqMode> {
    pub config: GptConfig,
    pub embedding: VocabParallelEmbedding,
    pub blocks: Vec<TransformerBlock<M>>,
    pub norm: Norm<M>,
    pub head: ColumnParallelLinear,
}

/// What [`Gpt::forward`] keeps for its backward.
pub struct GptCtx<M: SeqMode> {
    emb: EmbeddingCtx<M>,
    blocks: Vec<BlockCtx<M>>,
    norm: NormCtx,
    head: ColumnCtx<M>,
    loss: CrossEntropyCtx,
    losses: DTensor<TokenInvariant>,
}

/// The model's raw gradients.
pub struct GptGrads<M: SeqMode> {
    pub embedding: EmbeddingGrads,
    pub blocks: Vec<BlockGrads<M>>,
    pub norm: NormGrads<M>,
    pub head: ColumnGrads,
}

/// The model's gradients reduced to the parameters' placements (what the optimizer takes).
pub struct GptGradsReduced {
    pub embedding: EmbeddingGradsReduced,
    pub blocks: Vec<BlockGradsReduced>,
    pub norm: NormGradsReduced,
    pub head: ColumnGradsReduced,
}

impl<M: SeqMode> GptGrads<M> {
    /// Collective: every gradient reduced (SP norm weights and row biases over `Tp`,
    /// everything averaged over `Dp`).
    pub fn reduce(self) -> Result<GptGradsReduced> {
        Ok(GptGradsReduced {
            embedding: self.embedding.reduce()?,
            blocks: self
                .blocks
                .into_iter()
                .map(|b| b.reduce())
                .collect::<Result<_>>()?,
            norm: self.norm.reduce()?,
            head: self.head.reduce()?,
        })
    }
}

impl GptGradsReduced {
    /// Collective: the global gradient norm, every element counted once.
    pub fn global_norm(&self) -> Result<f64> {
        let mut n = GradNorm::new();
        self.embedding.norm(&mut n)?;
        for b in &self.blocks {
            b.norm(&mut n)?;
        }
        self.norm.norm(&mut n)?;
        self.head.norm(&mut n)?;
        n.finish(&self.head.weight)
    }

    pub fn scale(&self, f: f64) -> Result<Self> {
        Ok(GptGradsReduced {
            embedding: self.embedding.scale(f)?,
            blocks: self
                .blocks
                .iter()
                .map(|b| b.scale(f))
                .collect::<Result<_>>()?,
            norm: self.norm.scale(f)?,
            head: self.head.scale(f)?,
        })
    }
}

/// What one training step reports.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepReport {
    /// Mean loss over the global batch, before the update.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
}

impl<M: SeqMode> Gpt<M> {
    /// Parameter ids: embedding 0, block `l` from `10 + 20·l`, final norm `5`, head `7`.
    pub fn new(config: GptConfig, mesh: &Arc<DeviceMesh>) -> Result<Self> {
        let init = ParamInit::new(config.seed, 0, 0.02, config.dtype);
        let embedding = VocabParallelEmbedding::new(config.vocab, config.hidden, init, mesh)?;
        let blocks = (0..config.layers)
            .map(|l| TransformerBlock::new(&config, init.with_id(10 + 20 * l as u64), mesh))
            .collect::<Result<_>>()?;
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
        let head =
            ColumnParallelLinear::new(config.hidden, config.vocab, false, init.with_id(7), mesh)?;
        Ok(Gpt {
            config,
            embedding,
            blocks,
            norm,
            head,
        })
    }

    /// Per-token losses for `ids` predicting `targets` (both `[tokens]`, samples of
    /// `seq_len` tokens one after another).
    pub fn forward(
        &self,
        ids: &DTensor<Ids>,
        targets: &DTensor<Ids>,
    ) -> Result<(DTensor<TokenInvariant>, GptCtx<M>)> {
        let (mut x, emb) = self.embedding.forward::<M>(ids)?;
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            let (y, c) = b.forward(x)?;
            x = y;
            blocks.push(c);
        }
        let (x, norm) = self.norm.forward(&x)?;
        let (logits, head) = self.head.forward::<M>(x)?;
        let (losses, loss) = vocab_parallel_cross_entropy(&logits, targets)?;
        Ok((
            losses.clone(),
            GptCtx {
                emb,
                blocks,
                norm,
                head,
                loss,
                losses,
            },
        ))
    }

    /// Gradients of the mean loss over this `Dp` rank's tokens (averaged over `Dp` by
    /// [`GptGrads::reduce`], that is the mean over the global batch).
    pub fn backward(&self, ctx: GptCtx<M>) -> Result<GptGrads<M>> {
        let n = ctx.losses.local_shape()[0].max(1) as f64;
        let dloss = pointwise(&ctx.losses, |t| Ok(t.map(|_| 1.0 / n)))?;
        let dlogits = vocab_parallel_cross_entropy_backward(ctx.loss, &dloss)?;
        let (dx, head) = self.head.backward(ctx.head, &dlogits)?;
        let (mut dx, norm) = self.norm.backward(ctx.norm, &dx)?;
        let mut blocks = Vec::with_capacity(self.blocks.len());
        for (b, c) in self.blocks.iter().zip(ctx.blocks).rev() {
            let (d, g) = b.backward(c, &dx)?;
            dx = d;
            blocks.push(g);
        }
        blocks.reverse();
        let embedding = self.embedding.backward(ctx.emb, &dx)?;
        Ok(GptGrads {
            embedding,
            blocks,
            norm,
            head,
        })
    }

    pub fn apply(&mut self, g: &GptGradsReduced, opt: &impl Optimizer) -> Result<()> {
        self.embedding.apply(&g.embedding, opt)?;
        for (b, gb) in self.blocks.iter_mut().zip(&g.blocks) {
            b.apply(gb, opt)?;
        }
        self.norm.apply(&g.norm, opt)?;
        self.head.apply(&g.head, opt)
    }

    /// One training step: forward, backward, reduce, clip to `max_norm`, update.
    pub fn train_step(
        &mut self,
        ids: &DTensor<Ids>,
        targets: &DTensor<Ids>,
        opt: &mut impl Optimizer,
        max_norm: f64,
    ) -> Result<StepReport> {
        let (losses, ctx) = self.forward(ids, targets)?;
        let loss = mean_loss(&losses)?;
        let grads = self.backward(ctx)?.reduce()?;
        let grad_norm = grads.global_norm()?;
        let c = clip_coefficient(grad_norm, max_norm);
        let grads = if c < 1.0 { grads.scale(c)? } else { grads };
        opt.begin_step();
        self.apply(&grads, opt)?;
        Ok(StepReport { loss, grad_norm })
    }

    /// Collective: every parameter as a whole tensor, in a fixed order (for checks).
    pub fn full_params(&self) -> Result<Vec<Tensor>> {
        let mut v = vec![self.embedding.weight.value().full_tensor()?];
        for b in &self.blocks {
            for n in [&b.norm1, &b.norm2] {
                v.push(n.weight.value().full_tensor()?);
            }
            v.push(b.attn.qkv.weight.value().full_tensor()?);
            v.push(b.attn.out.weight.value().full_tensor()?);
            v.push(b.mlp.fc1.weight.value().full_tensor()?);
            v.push(b.mlp.fc2.weight.value().full_tensor()?);
            if let Some(bias) = &b.mlp.fc2.bias {
                v.push(bias.value().full_tensor()?);
            }
        }
        v.push(self.norm.weight.value().full_tensor()?);
        v.push(self.head.weight.value().full_tensor()?);
        Ok(v)
    }
}
