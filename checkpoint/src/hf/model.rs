//! A Hugging Face model directory as a dtensor model: its `config.json` as a
//! [`GptConfig`], its weights loaded into a [`Gpt`](dtensor_nn::Gpt) on any mesh.

use super::config::HfConfig;
use super::load::{load_params, HfLoadStats};
use super::names::NameMap;
use super::weights::HfWeights;
use crate::{Error, Result};
use dtensor_collectives::Communicator;
use dtensor_kernels::ops::RopeStyle;
use dtensor_kernels::DType;
use dtensor_nn::{Activation, AttentionOptions, GptConfig, Module, MoeConfig, NormKind};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The name of a model directory's configuration.
pub const CONFIG_FILE: &str = "config.json";

/// A Hugging Face model directory, opened: its configuration, its memory-mapped weights
/// (nothing read yet) and the map from dtensor's parameters to its tensors.
#[derive(Debug)]
pub struct HfModel {
    /// The directory.
    pub dir: PathBuf,
    /// Its `config.json`.
    pub config: HfConfig,
    /// Its safetensors files, mapped.
    pub weights: HfWeights,
    /// Which of its tensors each of dtensor's parameters is made of.
    pub names: NameMap,
}

impl HfModel {
    /// Opens `dir`: reads `config.json` (refusing a field dtensor does not implement),
    /// maps the weights and checks them against the architecture
    /// ([`HfWeights::open_checked`]: every tensor present with its shape and dtype, nothing
    /// unexpected). Reads no tensor data.
    pub fn open(dir: &Path) -> Result<HfModel> {
        let (config, weights) = HfWeights::open_checked(dir)?;
        let names = NameMap::new(&config);
        Ok(HfModel {
            dir: dir.to_path_buf(),
            config,
            weights,
            names,
        })
    }

    /// The decoder as dtensor builds it, for samples of `seq_len` tokens and parameters in
    /// `dtype`: RMSNorm, SwiGLU, RoPE's half-split pairing, and the checkpoint's heads, KV
    /// heads, head dim, RoPE base and scaling, q/k/v biases, q/k norm, sliding window,
    /// widths, epsilon, experts and embedding tying. Everything else of a
    /// [`GptConfig`] (precision, recomputation, context parallelism, seed) keeps its
    /// default for the caller to set. `Err` naming the config field when the model needs
    /// something dtensor's decoder does not have.
    pub fn gpt_config(&self, seq_len: usize, dtype: DType) -> Result<GptConfig> {
        let hf = &self.config;
        let refuse = |field: &str, detail: String| Error::Config {
            file: self.dir.join(CONFIG_FILE),
            field: field.to_string(),
            detail,
        };
        if hf.o_bias {
            return Err(refuse(
                "attention_bias",
                "a bias on the output projection without one on the MLP: dtensor's decoder has \
                 biases on q, k and v only (Qwen2) or on every linear layer"
                    .into(),
            ));
        }
        let moe = match &hf.moe {
            None => None,
            Some(m) => {
                if !(1..=2).contains(&m.top_k) {
                    return Err(refuse(
                        "num_experts_per_tok",
                        format!(
                            "{}: dtensor's MoE routes each token to 1 or 2 experts",
                            m.top_k
                        ),
                    ));
                }
                Some(MoeConfig {
                    experts: m.experts,
                    top_k: m.top_k,
                    capacity_factor: None,
                    normalize_gates: m.norm_topk_prob,
                    // transformers adds the balancing loss only when asked to.
                    aux_loss_coef: if m.output_router_logits {
                        m.router_aux_loss_coef
                    } else {
                        0.0
                    },
                    bias_rate: None,
                    ffn: Some(m.expert_intermediate),
                })
            }
        };
        Ok(GptConfig {
            vocab: hf.vocab_size,
            hidden: hf.hidden_size,
            heads: hf.heads,
            kv_heads: Some(hf.kv_heads),
            rope_style: RopeStyle::HalfSplit,
            layers: hf.layers,
            ffn: hf.intermediate_size,
            seq_len,
            norm: NormKind::Rms,
            activation: Activation::SwiGlu,
            bias: false,
            eps: hf.rms_norm_eps,
            attn: AttentionOptions {
                head_dim: Some(hf.head_dim),
                scale: None,
                rope_base: Some(hf.rope.theta),
                rope_scaling: hf.rope.scaling,
                rotary_dim: Some(hf.rope.rotary_dim),
                qkv_bias: hf.qkv_bias,
                qk_norm: hf.qk_norm,
                window: hf.sliding_window,
            },
            moe,
            tie_embeddings: hf.tie_word_embeddings,
            ..GptConfig::small(dtype)
        })
    }

    /// Collective over `world`: sets every parameter of `m` (built from
    /// [`gpt_config`](Self::gpt_config), on any mesh) from the checkpoint, each rank
    /// reading only its own slices ([`load_params`]).
    pub fn load_into(
        &self,
        world: &Arc<dyn Communicator>,
        m: &mut impl Module,
    ) -> Result<HfLoadStats> {
        load_params(world, &self.weights, &self.names, m)
    }
}
