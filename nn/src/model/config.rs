//! The shape of a GPT: one value the model, its pipeline stages and the planner read.

use crate::attention::{AttentionConfig, ContextParallel, RopeSettings};
use crate::data::Precision;
use crate::mlp::Activation;
use crate::moe::MoeConfig;
use crate::norm::NormKind;
use dtensor_core::{Error, Result};
use dtensor_kernels::ops::{RopeScaling, RopeStyle};
use dtensor_kernels::DType;

/// A GPT's attention settings beyond its heads and RoPE pairing; the default (every
/// field `None` or `false`) is multi-head attention with `head_dim = hidden / heads`,
/// scale `1/√head_dim`, whole-head RoPE of base 10000 without scaling, biases as
/// [`GptConfig::bias`] says, and no q/k norm.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// Features per head ([`AttentionConfig::head_dim`]).
    pub head_dim: Option<usize>,
    /// The softmax scale; `None` is `1/√head_dim`.
    pub scale: Option<f64>,
    /// RoPE's base; `None` is 10000.
    pub rope_base: Option<f64>,
    /// RoPE's frequency scaling.
    pub rope_scaling: RopeScaling,
    /// RoPE's rotated columns per head; `None` is the whole head.
    pub rotary_dim: Option<usize>,
    /// A bias on the q, k and v projections even when [`GptConfig::bias`] is off (Qwen2).
    pub qkv_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3), with the model's `eps`.
    pub qk_norm: bool,
    /// A sliding attention window of this many keys (Mistral;
    /// [`AttentionConfig::window`]).
    pub window: Option<usize>,
}

/// The shape of a GPT.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptConfig {
    /// Vocabulary size: rows of the embedding table and columns of the logits.
    pub vocab: usize,
    /// Model width: features per token in the residual stream.
    pub hidden: usize,
    /// Attention (query) heads (they divide `hidden`).
    pub heads: usize,
    /// Key/value heads (grouped-query attention; 1 is multi-query): they divide `heads`,
    /// and the `Tp` size divides them. `None`: as many as `heads` (multi-head attention).
    pub kv_heads: Option<usize>,
    /// RoPE's pairing of a head's columns (interleaved by default; half-split is the
    /// Hugging Face layout).
    pub rope_style: RopeStyle,
    /// The attention layers' further settings (head dim, softmax scale, RoPE scaling
    /// and rotary dim, q/k/v biases, q/k norm); the default is this GPT's attention.
    pub attn: AttentionOptions,
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
    /// `Some`: every block's MLP is a mixture of experts ([`MoeMlp`](crate::MoeMlp)) over `Ep`, and the
    /// training loss adds `aux_loss_coef ·` its auxiliary loss. `None`: dense MLPs.
    pub moe: Option<MoeConfig>,
    /// The z-loss coefficient (PaLM's `z · log²Z` per scored token, `Z` the softmax
    /// normaliser over the whole vocab), finite and ≥ 0; 0 (the default) is off and leaves
    /// the loss bit for bit as without it.
    pub z_loss: f64,
    /// The LM head is the token embedding's weight (`[vocab, hidden]`, used twice: its
    /// gradient is the sum of both uses), as Llama 3.2 1B/3B and small Qwen models tie
    /// them; `false` (the default) keeps a separate head. Not across pipeline stages (the
    /// first and last stage would share the weight): a tied model runs with `pp = 1`.
    pub tie_embeddings: bool,
}

impl GptConfig {
    /// A small byte-level model: 2 layers, hidden 64, 4 heads, sequence 64.
    pub fn small(dtype: DType) -> Self {
        GptConfig {
            vocab: 256,
            hidden: 64,
            heads: 4,
            kv_heads: None,
            rope_style: RopeStyle::Interleaved,
            attn: AttentionOptions::default(),
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
            z_loss: 0.0,
            tie_embeddings: false,
        }
    }

    /// The blocks' attention.
    pub(crate) fn attention(&self) -> AttentionConfig {
        let a = &self.attn;
        AttentionConfig {
            kv_heads: self.kv_heads.unwrap_or(self.heads),
            head_dim: a.head_dim,
            scale: a.scale,
            rope: RopeSettings {
                base: a.rope_base.unwrap_or(10000.0),
                style: self.rope_style,
                scaling: a.rope_scaling,
                rotary_dim: a.rotary_dim,
            },
            qkv_bias: self.bias || a.qkv_bias,
            out_bias: self.bias,
            qk_norm: a.qk_norm.then_some(self.eps),
            window: a.window,
            context: self.context,
            ..AttentionConfig::new(self.hidden, self.heads, self.seq_len, self.rope_style)
        }
    }

    /// `Err` (from `op`) for the options no part of the model supports together.
    pub(crate) fn check(&self, op: &'static str) -> Result<()> {
        if !(self.z_loss.is_finite() && self.z_loss >= 0.0) {
            return Err(Error::InvalidUse {
                op,
                detail: format!(
                    "the z-loss coefficient must be finite and >= 0, got {}",
                    self.z_loss
                ),
            });
        }
        if self.moe.is_some() && self.recompute {
            return Err(Error::InvalidUse {
                op,
                detail: "activation recomputation of MoE blocks is not supported (its \
                         auxiliary loss and routing statistics would be recorded twice)"
                    .into(),
            });
        }
        Ok(())
    }
}
