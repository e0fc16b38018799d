//! The tensors a Hugging Face checkpoint of each architecture holds, derived from its
//! [`HfConfig`], and the check of an [`HfWeights`] against them.
//!
//! | tensor | shape | when |
//! |---|---|---|
//! | `model.embed_tokens.weight` | `[vocab, hidden]` | always |
//! | `model.layers.{i}.input_layernorm.weight`, `post_attention_layernorm.weight` | `[hidden]` | always |
//! | `model.layers.{i}.self_attn.q_proj.weight` | `[heads·head_dim, hidden]` | always |
//! | `model.layers.{i}.self_attn.{k,v}_proj.weight` | `[kv_heads·head_dim, hidden]` | always |
//! | `model.layers.{i}.self_attn.o_proj.weight` | `[hidden, heads·head_dim]` | always |
//! | `model.layers.{i}.self_attn.{q,k,v}_proj.bias` | `[heads·head_dim]`, `[kv_heads·head_dim]` | [`HfConfig::qkv_bias`] (Qwen2) |
//! | `model.layers.{i}.self_attn.o_proj.bias` | `[hidden]` | [`HfConfig::o_bias`] |
//! | `model.layers.{i}.self_attn.{q,k}_norm.weight` | `[head_dim]` | [`HfConfig::qk_norm`] (Qwen3) |
//! | `model.layers.{i}.mlp.{gate,up}_proj.weight`, `down_proj.weight` | `[intermediate, hidden]`, `[hidden, intermediate]` | dense MLP |
//! | `model.layers.{i}.block_sparse_moe.gate.weight` | `[experts, hidden]` | Mixtral |
//! | `model.layers.{i}.block_sparse_moe.experts.{e}.{w1,w3}.weight`, `w2.weight` | `[intermediate, hidden]`, `[hidden, intermediate]` | Mixtral (w1 gate, w3 up, w2 down) |
//! | `model.layers.{i}.mlp.gate.weight` | `[experts, hidden]` | Qwen3-MoE |
//! | `model.layers.{i}.mlp.experts.{e}.{gate,up}_proj.weight`, `down_proj.weight` | `[moe_intermediate, hidden]`, `[hidden, moe_intermediate]` | Qwen3-MoE |
//! | `model.norm.weight` | `[hidden]` | always |
//! | `lm_head.weight` | `[vocab, hidden]` | absent when [`HfConfig::tie_word_embeddings`] |
//!
//! Linear weights are stored `[out, in]` (y = x·Wᵀ), as `torch.nn.Linear` keeps them.
//! transformers 5 fuses the experts in memory but writes them one per expert, under the
//! names above, so every published file and every file it saves has this layout.

use super::weights::{HfWeights, INDEX_FILE, SINGLE_FILE};
use super::{Architecture, HfConfig};
use crate::{Error, Result};
use dtensor_kernels::DType;
use std::collections::BTreeMap;
use std::path::Path;

/// One tensor an architecture's checkpoint must hold.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedTensor {
    /// Its Hugging Face name.
    pub name: String,
    /// Its stored shape.
    pub shape: Vec<usize>,
}

impl HfConfig {
    /// Every tensor a checkpoint of this config holds, in the order of the layers (the
    /// table in [`crate::hf::layout`]'s docs).
    pub fn expected_tensors(&self) -> Vec<ExpectedTensor> {
        let (hidden, hd) = (self.hidden_size, self.head_dim);
        let (q_rows, kv_rows) = (self.heads * hd, self.kv_heads * hd);
        let mut out = Vec::new();
        let mut push = |name: String, shape: &[usize]| {
            out.push(ExpectedTensor {
                name,
                shape: shape.to_vec(),
            })
        };
        push(
            "model.embed_tokens.weight".into(),
            &[self.vocab_size, hidden],
        );
        for i in 0..self.layers {
            let layer = format!("model.layers.{i}");
            push(format!("{layer}.input_layernorm.weight"), &[hidden]);
            push(
                format!("{layer}.post_attention_layernorm.weight"),
                &[hidden],
            );
            let attn = format!("{layer}.self_attn");
            for (proj, rows) in [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)] {
                push(format!("{attn}.{proj}.weight"), &[rows, hidden]);
                if self.qkv_bias {
                    push(format!("{attn}.{proj}.bias"), &[rows]);
                }
            }
            push(format!("{attn}.o_proj.weight"), &[hidden, q_rows]);
            if self.o_bias {
                push(format!("{attn}.o_proj.bias"), &[hidden]);
            }
            if self.qk_norm {
                push(format!("{attn}.q_norm.weight"), &[hd]);
                push(format!("{attn}.k_norm.weight"), &[hd]);
            }
            let swiglu = |prefix: &str, [gate, up, down]: [&str; 3], inter: usize| {
                [
                    (format!("{prefix}.{gate}.weight"), [inter, hidden]),
                    (format!("{prefix}.{up}.weight"), [inter, hidden]),
                    (format!("{prefix}.{down}.weight"), [hidden, inter]),
                ]
            };
            match &self.moe {
                None => {
                    for (name, shape) in swiglu(
                        &format!("{layer}.mlp"),
                        ["gate_proj", "up_proj", "down_proj"],
                        self.intermediate_size,
                    ) {
                        push(name, &shape);
                    }
                }
                Some(moe) => {
                    let (block, names) = match self.architecture {
                        Architecture::Mixtral => {
                            (format!("{layer}.block_sparse_moe"), ["w1", "w3", "w2"])
                        }
                        _ => (
                            format!("{layer}.mlp"),
                            ["gate_proj", "up_proj", "down_proj"],
                        ),
                    };
                    push(format!("{block}.gate.weight"), &[moe.experts, hidden]);
                    for e in 0..moe.experts {
                        for (name, shape) in swiglu(
                            &format!("{block}.experts.{e}"),
                            names,
                            moe.expert_intermediate,
                        ) {
                            push(name, &shape);
                        }
                    }
                }
            }
        }
        push("model.norm.weight".into(), &[hidden]);
        if !self.tie_word_embeddings {
            push("lm_head.weight".into(), &[self.vocab_size, hidden]);
        }
        out
    }
}

impl HfWeights {
    /// Checks the checkpoint against the tensors `config` expects
    /// ([`HfConfig::expected_tensors`]): every one present with its shape, none other,
    /// each stored in the dtype the config declares ([`HfConfig::stored_dtype`]; float32
    /// is accepted beside a 16-bit declaration, as transformers keeps some modules in
    /// float32). `Err` naming the tensor and the file that holds it (the index, or the
    /// single file, for a missing one), and how many other tensors are wrong too.
    pub fn validate(&self, config: &HfConfig) -> Result<()> {
        let declared = config.stored_dtype;
        let expected: BTreeMap<String, Vec<usize>> = config
            .expected_tensors()
            .into_iter()
            .map(|t| (t.name, t.shape))
            .collect();
        let arch = config.architecture.model_type();
        let mut problems: Vec<Error> = Vec::new();
        for (name, shape) in &expected {
            match self.info(name) {
                None => problems.push(Error::Tensor {
                    file: self.source().to_path_buf(),
                    tensor: name.clone(),
                    detail: format!(
                        "missing: {arch} with this config.json needs it, shape {shape:?}"
                    ),
                }),
                Some(info) if info.shape != *shape => problems.push(Error::Tensor {
                    file: info.file.clone(),
                    tensor: name.clone(),
                    detail: format!(
                        "stored with shape {:?}, config.json makes it {shape:?}",
                        info.shape
                    ),
                }),
                Some(info) => {
                    if let Some(want) = declared {
                        let widened =
                            info.dtype == DType::F32 && matches!(want, DType::BF16 | DType::F16);
                        if info.dtype != want && !widened {
                            problems.push(Error::Tensor {
                                file: info.file.clone(),
                                tensor: name.clone(),
                                detail: format!(
                                    "stored as {:?}, config.json declares {want:?}",
                                    info.dtype
                                ),
                            });
                        }
                    }
                }
            }
        }
        for name in self.names() {
            if !expected.contains_key(name) {
                let info = self.info(name).expect("a listed name");
                let why = if name == "lm_head.weight" {
                    "unexpected: config.json ties the LM head to the embedding".to_string()
                } else {
                    format!("unexpected: not a tensor of {arch} with this config.json")
                };
                problems.push(Error::Tensor {
                    file: info.file.clone(),
                    tensor: name.to_string(),
                    detail: why,
                });
            }
        }
        let more = problems.len().saturating_sub(1);
        match problems.into_iter().next() {
            None => Ok(()),
            Some(Error::Tensor {
                file,
                tensor,
                detail,
            }) if more > 0 => Err(Error::Tensor {
                file,
                tensor,
                detail: format!("{detail} (and {more} more tensors wrong)"),
            }),
            Some(e) => Err(e),
        }
    }

    /// Maps the weights of `dir` and checks them against `dir/config.json`: both
    /// [`HfConfig::from_dir`] and [`HfWeights::open`] followed by
    /// [`validate`](Self::validate).
    pub fn open_checked(dir: &Path) -> Result<(HfConfig, HfWeights)> {
        let config = HfConfig::from_dir(dir)?;
        let weights = HfWeights::open(dir)?;
        weights.validate(&config)?;
        Ok((config, weights))
    }
}

/// Whether `file` names a weight file of the Hugging Face layout (the single file, the
/// index, or a `model-XXXXX-of-YYYYY.safetensors` shard).
pub(crate) fn is_weight_file(file: &str) -> bool {
    file == SINGLE_FILE
        || file == INDEX_FILE
        || (file.starts_with("model-") && file.ends_with(".safetensors") && file.contains("-of-"))
}
