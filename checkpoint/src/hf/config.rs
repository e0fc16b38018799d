//! A Hugging Face `config.json` read into the one decoder description every supported
//! architecture maps to ([`HfConfig`]).
//!
//! Each field of the file is one of four kinds, per architecture:
//! - **read**: it shapes the model (sizes, RoPE, biases, window, MoE routing) and is parsed;
//! - **inert**: bookkeeping that does not change the math (`transformers_version`,
//!   `use_cache`, token ids, labels, `initializer_range`, …), kept verbatim for the save;
//! - **fixed**: a switch for a variant we do not implement, accepted only at its
//!   plain value (`hidden_act` = `"silu"`, `attention_dropout` = 0, `pretraining_tp` = 1,
//!   `mlp_bias` = false, …);
//! - anything else: an error naming the field. A checkpoint is never loaded with a setting
//!   silently ignored.
//!
//! Absent or `null` fields take the architecture's own default, as transformers does
//! (Qwen3's `head_dim` is 128, not hidden/heads; Qwen2 has QKV biases with no
//! `attention_bias` key). RoPE settings are read in either spelling: top-level
//! `rope_theta` and `rope_scaling` (transformers 4.x, most published checkpoints) or one
//! `rope_parameters` object (transformers 5.x).

use crate::{Error, Result};
use dtensor_kernels::ops::{Rope, RopeScaling, RopeStyle, RotatedHeads};
use dtensor_kernels::DType;
use serde_json::{Map, Value};
use std::path::Path;

/// The architectures a `config.json` may name (its `model_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Architecture {
    /// `llama`: Llama 2, 3, 3.1, 3.2 (GQA, llama3 RoPE scaling, tied embeddings).
    Llama,
    /// `mistral`: Llama with a sliding attention window.
    Mistral,
    /// `qwen2`: QKV biases.
    Qwen2,
    /// `qwen3`: RMSNorm of q and k over head_dim before RoPE.
    Qwen3,
    /// `mixtral`: Mistral with MoE MLPs (top-k of softmax, renormalised).
    Mixtral,
    /// `qwen3_moe`: Qwen3 with MoE MLPs.
    Qwen3Moe,
}

impl Architecture {
    /// Every supported architecture.
    pub const ALL: [Architecture; 6] = [
        Architecture::Llama,
        Architecture::Mistral,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Mixtral,
        Architecture::Qwen3Moe,
    ];

    /// The `model_type` of its `config.json`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen3Moe => "qwen3_moe",
        }
    }

    /// transformers' causal-LM class (the `architectures` entry of a saved config).
    pub fn causal_lm_class(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
        }
    }

    /// Whether its MLPs are mixtures of experts.
    pub fn is_moe(self) -> bool {
        matches!(self, Architecture::Mixtral | Architecture::Qwen3Moe)
    }

    fn from_model_type(s: &str) -> Option<Architecture> {
        Architecture::ALL.into_iter().find(|a| a.model_type() == s)
    }
}

/// The MoE part of a config (Mixtral, Qwen3-MoE).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per MoE layer (`num_local_experts`, or Qwen3-MoE's `num_experts`).
    pub experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Whether the top-k routing weights are renormalised to sum to one (Mixtral always;
    /// Qwen3-MoE's `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Each expert's hidden size (Mixtral: `intermediate_size`; Qwen3-MoE:
    /// `moe_intermediate_size`).
    pub expert_intermediate: usize,
    /// The load-balancing loss's coefficient (`router_aux_loss_coef`).
    pub router_aux_loss_coef: f64,
    /// Whether transformers adds that loss to the causal-LM loss (`output_router_logits`).
    pub output_router_logits: bool,
}

/// One decoder-only model, as every supported architecture describes it: token embedding,
/// `layers` × (RMSNorm → attention → residual, RMSNorm → MLP or MoE → residual), a final
/// RMSNorm and the LM head.
#[derive(Clone, Debug, PartialEq)]
pub struct HfConfig {
    /// Which architecture (`model_type`).
    pub architecture: Architecture,
    /// Vocabulary size (`vocab_size`).
    pub vocab_size: usize,
    /// Model width (`hidden_size`).
    pub hidden_size: usize,
    /// The dense MLP's hidden size (`intermediate_size`).
    pub intermediate_size: usize,
    /// Decoder layers (`num_hidden_layers`).
    pub layers: usize,
    /// Query heads (`num_attention_heads`).
    pub heads: usize,
    /// Key/value heads (`num_key_value_heads`; absent = `heads`, multi-head attention).
    pub kv_heads: usize,
    /// Columns per head (`head_dim`; the architecture's default when absent).
    pub head_dim: usize,
    /// RMSNorm's epsilon (`rms_norm_eps`).
    pub rms_norm_eps: f64,
    /// RoPE: half-split pairs ("rotate_half", as every supported checkpoint stores q/k),
    /// base and scaling from either spelling of the settings.
    pub rope: Rope,
    /// The longest context the model was configured for (`max_position_embeddings`).
    pub max_position_embeddings: usize,
    /// Whether the LM head is the embedding matrix (`tie_word_embeddings`).
    pub tie_word_embeddings: bool,
    /// Biases on the q, k and v projections (Qwen2 always; others' `attention_bias`).
    pub qkv_bias: bool,
    /// A bias on the output projection (`attention_bias` of Llama and Qwen3).
    pub o_bias: bool,
    /// RMSNorm of q and k over head_dim before RoPE (Qwen3, Qwen3-MoE).
    pub qk_norm: bool,
    /// Keys further back than this many positions are not attended to (Mistral,
    /// Mixtral: `sliding_window`; `None` = full causal attention).
    pub sliding_window: Option<usize>,
    /// The MoE part, for Mixtral and Qwen3-MoE.
    pub moe: Option<MoeConfig>,
    /// The beginning-of-sequence token (`bos_token_id`), when given.
    pub bos_token_id: Option<u32>,
    /// The end-of-sequence tokens (`eos_token_id`: one id or a list).
    pub eos_token_ids: Vec<u32>,
    /// The dtype the weights were saved in (`dtype`, or transformers 4's `torch_dtype`),
    /// when the file says.
    pub stored_dtype: Option<DType>,
    /// The file as read, every field, for writing it back on save.
    pub raw: Map<String, Value>,
}

/// Fields that never change the math, in any architecture.
const INERT: &[&str] = &[
    "_name_or_path",
    "architectures",
    "model_type",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "output_attentions",
    "output_hidden_states",
    "return_dict",
    "id2label",
    "label2id",
    "problem_type",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "tokenizer_class",
    "max_position_embeddings",
];

/// Fields read by every architecture.
const COMMON: &[&str] = &[
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "tie_word_embeddings",
    "dtype",
    "torch_dtype",
];

/// Fields read only by some architectures.
fn specific(arch: Architecture) -> &'static [&'static str] {
    match arch {
        Architecture::Llama => &["attention_bias"],
        Architecture::Mistral => &["sliding_window"],
        // Qwen's window applies only with `use_sliding_window` (checked as fixed), so
        // `sliding_window` and `max_window_layers` are inert there.
        Architecture::Qwen2 => &["sliding_window", "max_window_layers"],
        Architecture::Qwen3 => &["attention_bias", "sliding_window", "max_window_layers"],
        Architecture::Mixtral => &[
            "sliding_window",
            "num_local_experts",
            "num_experts_per_tok",
            "router_aux_loss_coef",
            "output_router_logits",
        ],
        Architecture::Qwen3Moe => &[
            "attention_bias",
            "sliding_window",
            "max_window_layers",
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "norm_topk_prob",
            "moe_intermediate_size",
            "router_aux_loss_coef",
            "output_router_logits",
        ],
    }
}

/// A switch for a variant not implemented: the field is accepted when absent, `null`, or
/// equal to its plain value.
struct Fixed {
    field: &'static str,
    plain: fn(&Value) -> bool,
    wants: &'static str,
}

const FIXED: &[Fixed] = &[
    Fixed {
        field: "hidden_act",
        plain: |v| v == "silu",
        wants: "\"silu\" (SwiGLU)",
    },
    Fixed {
        field: "attention_dropout",
        plain: is_zero,
        wants: "0 (dropout is not implemented)",
    },
    Fixed {
        field: "pretraining_tp",
        plain: |v| v.as_u64() == Some(1),
        wants: "1",
    },
    Fixed {
        field: "mlp_bias",
        plain: |v| v == false,
        wants: "false (MLP biases are not implemented)",
    },
    Fixed {
        field: "use_sliding_window",
        plain: |v| v == false,
        wants: "false (Qwen's per-layer sliding window is not implemented)",
    },
    Fixed {
        field: "layer_types",
        plain: |v| {
            v.as_array()
                .is_some_and(|a| a.iter().all(|t| t == "full_attention"))
        },
        wants: "every layer \"full_attention\"",
    },
    Fixed {
        field: "router_jitter_noise",
        plain: is_zero,
        wants: "0 (router jitter is not implemented)",
    },
    Fixed {
        field: "decoder_sparse_step",
        plain: |v| v.as_u64() == Some(1),
        wants: "1 (every layer an MoE layer)",
    },
    Fixed {
        field: "mlp_only_layers",
        plain: |v| v.as_array().is_some_and(|a| a.is_empty()),
        wants: "[] (every layer an MoE layer)",
    },
    Fixed {
        field: "partial_rotary_factor",
        plain: |v| v.as_f64() == Some(1.0),
        wants: "1.0 (RoPE on whole heads)",
    },
];

fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

/// Reads `config.json` fields; every error names the file and the field.
struct Reader<'a> {
    file: &'a Path,
    obj: &'a Map<String, Value>,
}

impl<'a> Reader<'a> {
    fn err(&self, field: &str, detail: impl std::fmt::Display) -> Error {
        Error::Config {
            file: self.file.to_path_buf(),
            field: field.to_string(),
            detail: detail.to_string(),
        }
    }

    /// The field's value, `None` when absent or `null`.
    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn usize_or(&self, field: &str, default: Option<usize>) -> Result<usize> {
        match self.get(field) {
            None => default.ok_or_else(|| self.err(field, "missing")),
            Some(v) => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.err(field, format!("{v} is not a whole number"))),
        }
    }

    fn positive(&self, field: &str, default: Option<usize>) -> Result<usize> {
        match self.usize_or(field, default)? {
            0 => Err(self.err(field, "must be positive")),
            n => Ok(n),
        }
    }

    fn f64_or(&self, field: &str, default: Option<f64>) -> Result<f64> {
        match self.get(field) {
            None => default.ok_or_else(|| self.err(field, "missing")),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite())
                .ok_or_else(|| self.err(field, format!("{v} is not a finite number"))),
        }
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.err(field, format!("{v} is not true or false"))),
        }
    }

    fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        let one = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| one(v).ok_or_else(|| self.err(field, format!("{v} is not a token id"))))
                .collect(),
            Some(v) => one(v)
                .map(|id| vec![id])
                .ok_or_else(|| self.err(field, format!("{v} is not a token id"))),
        }
    }
}

impl HfConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<HfConfig> {
        let file = dir.join("config.json");
        let text = std::fs::read_to_string(&file).map_err(|e| Error::Io {
            file: file.clone(),
            detail: format!("read: {e}"),
        })?;
        HfConfig::parse(&text, &file)
    }

    /// Parses the text of a `config.json` (`file` names it in errors).
    pub fn parse(text: &str, file: &Path) -> Result<HfConfig> {
        let value: Value = serde_json::from_str(text).map_err(|e| Error::Format {
            file: file.to_path_buf(),
            detail: format!("not JSON: {e}"),
        })?;
        let Value::Object(obj) = value else {
            return Err(Error::Format {
                file: file.to_path_buf(),
                detail: "not a JSON object".into(),
            });
        };
        let r = Reader { file, obj: &obj };
        let model_type = r
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| r.err("model_type", "missing"))?;
        let arch = Architecture::from_model_type(model_type).ok_or_else(|| {
            let known: Vec<&str> = Architecture::ALL.iter().map(|a| a.model_type()).collect();
            r.err(
                "model_type",
                format!(
                    "\"{model_type}\" is not supported (supported: {})",
                    known.join(", ")
                ),
            )
        })?;
        r.check_fields(arch)?;
        let hidden = r.positive("hidden_size", None)?;
        let heads = r.positive("num_attention_heads", None)?;
        let kv_heads = r.positive("num_key_value_heads", Some(heads))?;
        if !heads.is_multiple_of(kv_heads) {
            return Err(r.err(
                "num_key_value_heads",
                format!("{kv_heads} does not divide num_attention_heads {heads}"),
            ));
        }
        // transformers' own defaults: Qwen3's config class sets 128; the others (Qwen3-MoE
        // included) fall back to hidden / heads.
        let default_head_dim = match arch {
            Architecture::Qwen3 => Some(128),
            _ if hidden.is_multiple_of(heads) => Some(hidden / heads),
            _ => None,
        };
        let head_dim = r.positive("head_dim", default_head_dim)?;
        let max_position_embeddings = r.positive("max_position_embeddings", Some(2048))?;
        let rope = r.rope(head_dim, max_position_embeddings)?;
        let attention_bias = r.bool_or("attention_bias", false)?;
        let (qkv_bias, o_bias) = match arch {
            Architecture::Qwen2 => (true, false),
            Architecture::Llama | Architecture::Qwen3 | Architecture::Qwen3Moe => {
                (attention_bias, attention_bias)
            }
            Architecture::Mistral | Architecture::Mixtral => (false, false),
        };
        let sliding_window = match arch {
            Architecture::Mistral | Architecture::Mixtral => match r.get("sliding_window") {
                None => None,
                Some(_) => Some(r.positive("sliding_window", None)?),
            },
            _ => None,
        };
        let intermediate_size = r.positive("intermediate_size", None)?;
        let moe = match arch {
            Architecture::Mixtral => Some(MoeConfig {
                experts: r.positive("num_local_experts", None)?,
                top_k: r.positive("num_experts_per_tok", None)?,
                norm_topk_prob: true,
                expert_intermediate: intermediate_size,
                router_aux_loss_coef: r.f64_or("router_aux_loss_coef", Some(0.001))?,
                output_router_logits: r.bool_or("output_router_logits", false)?,
            }),
            Architecture::Qwen3Moe => {
                let experts = match (r.get("num_experts"), r.get("num_local_experts")) {
                    (Some(_), Some(_)) => {
                        let (a, b) = (
                            r.positive("num_experts", None)?,
                            r.positive("num_local_experts", None)?,
                        );
                        if a != b {
                            return Err(r.err(
                                "num_local_experts",
                                format!("{b} differs from num_experts {a}"),
                            ));
                        }
                        a
                    }
                    (Some(_), None) => r.positive("num_experts", None)?,
                    _ => r.positive("num_local_experts", None)?,
                };
                Some(MoeConfig {
                    experts,
                    top_k: r.positive("num_experts_per_tok", None)?,
                    norm_topk_prob: r.bool_or("norm_topk_prob", false)?,
                    expert_intermediate: r.positive("moe_intermediate_size", None)?,
                    router_aux_loss_coef: r.f64_or("router_aux_loss_coef", Some(0.001))?,
                    output_router_logits: r.bool_or("output_router_logits", false)?,
                })
            }
            _ => None,
        };
        if let Some(m) = &moe {
            if m.top_k > m.experts {
                return Err(r.err(
                    "num_experts_per_tok",
                    format!("{} exceeds the {} experts", m.top_k, m.experts),
                ));
            }
        }
        let eps = r.f64_or("rms_norm_eps", Some(1e-6))?;
        if eps <= 0.0 {
            return Err(r.err("rms_norm_eps", format!("{eps} must be positive")));
        }
        Ok(HfConfig {
            architecture: arch,
            vocab_size: r.positive("vocab_size", None)?,
            hidden_size: hidden,
            intermediate_size,
            layers: r.positive("num_hidden_layers", None)?,
            heads,
            kv_heads,
            head_dim,
            rms_norm_eps: eps,
            rope,
            max_position_embeddings,
            tie_word_embeddings: r.bool_or("tie_word_embeddings", false)?,
            qkv_bias,
            o_bias,
            qk_norm: matches!(arch, Architecture::Qwen3 | Architecture::Qwen3Moe),
            sliding_window,
            moe,
            bos_token_id: r.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: r.token_ids("eos_token_id")?,
            stored_dtype: r.stored_dtype()?,
            raw: obj.clone(),
        })
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
}

impl Reader<'_> {
    /// `dtype` (transformers 5) or `torch_dtype` (4.x), `None` when neither is given.
    fn stored_dtype(&self) -> Result<Option<DType>> {
        let field = match (self.get("dtype"), self.get("torch_dtype")) {
            (Some(_), _) => "dtype",
            (None, Some(_)) => "torch_dtype",
            (None, None) => return Ok(None),
        };
        let value = self.get(field).expect("present");
        let dtype = match value.as_str() {
            Some("float32") => DType::F32,
            Some("bfloat16") => DType::BF16,
            Some("float16") => DType::F16,
            Some("float64") => DType::F64,
            _ => {
                return Err(self.err(
                    field,
                    format!(
                        "{value}: dtensor loads float32, bfloat16, float16 and float64 weights"
                    ),
                ))
            }
        };
        Ok(Some(dtype))
    }

    /// Every field is read, inert, or fixed at its plain value; anything else is refused.
    fn check_fields(&self, arch: Architecture) -> Result<()> {
        for (field, value) in self.obj {
            let f = field.as_str();
            if INERT.contains(&f) || COMMON.contains(&f) || specific(arch).contains(&f) {
                continue;
            }
            match FIXED.iter().find(|x| x.field == f) {
                Some(x) if value.is_null() || (x.plain)(value) => {}
                Some(x) => {
                    return Err(self.err(f, format!("{value} is not implemented (wants {})", x.wants)))
                }
                None => {
                    return Err(self.err(
                        f,
                        format!(
                            "{value}: not a field dtensor implements for {} (a setting it would silently ignore)",
                            arch.model_type()
                        ),
                    ))
                }
            }
        }
        Ok(())
    }

    /// RoPE from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling` (4.x).
    fn rope(&self, head_dim: usize, max_pos: usize) -> Result<Rope> {
        let (params, where_) = match (self.get("rope_parameters"), self.get("rope_scaling")) {
            (Some(_), Some(_)) => {
                return Err(self.err(
                    "rope_scaling",
                    "given beside rope_parameters: one spelling only (rope_parameters holds the scaling in transformers 5)",
                ))
            }
            (Some(p), None) => (Some(p), "rope_parameters"),
            (None, Some(s)) => (Some(s), "rope_scaling"),
            (None, None) => (None, ""),
        };
        let params = match params {
            None => None,
            Some(Value::Object(o)) => Some(o),
            Some(v) => return Err(self.err(where_, format!("{v} is not an object"))),
        };
        let sub = |k: &str| params.and_then(|p| p.get(k)).filter(|v| !v.is_null());
        let field = |k: &str| format!("{where_}.{k}");
        let num = |k: &str| -> Result<Option<f64>> {
            match sub(k) {
                None => Ok(None),
                Some(v) => v
                    .as_f64()
                    .filter(|x| x.is_finite())
                    .map(Some)
                    .ok_or_else(|| self.err(&field(k), format!("{v} is not a finite number"))),
            }
        };
        let need =
            |k: &str| -> Result<f64> { num(k)?.ok_or_else(|| self.err(&field(k), "missing")) };
        let whole = |k: &str, default: usize| -> Result<usize> {
            match sub(k) {
                None => Ok(default),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.err(&field(k), format!("{v} is not a whole number"))),
            }
        };
        let theta = match (self.get("rope_theta"), num("rope_theta")?) {
            (Some(_), Some(_)) => {
                return Err(self.err(
                    "rope_theta",
                    "given both at the top level and in rope_parameters",
                ))
            }
            (Some(_), None) => self.f64_or("rope_theta", None)?,
            (None, Some(t)) => t,
            (None, None) => 10000.0,
        };
        // transformers 4.x wrote `type` before `rope_type`.
        let kind = match (sub("rope_type"), sub("type")) {
            (Some(v), _) | (None, Some(v)) => v
                .as_str()
                .ok_or_else(|| self.err(&field("rope_type"), format!("{v} is not a string")))?,
            (None, None) => "default",
        };
        let known: &[&str] = match kind {
            "default" => &[],
            "linear" => &["factor"],
            "llama3" => &[
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ],
            "yarn" => &[
                "factor",
                "original_max_position_embeddings",
                "beta_fast",
                "beta_slow",
                "attention_factor",
                "mscale",
                "mscale_all_dim",
                "truncate",
            ],
            other => {
                return Err(self.err(
                    &field("rope_type"),
                    format!("\"{other}\" is not implemented (default, linear, llama3, yarn)"),
                ))
            }
        };
        if let Some(p) = params {
            for (k, v) in p {
                let plain = ["rope_type", "type", "rope_theta"].contains(&k.as_str());
                // transformers 5 writes `partial_rotary_factor` into rope_parameters too.
                let whole_head = k == "partial_rotary_factor" && v.as_f64() == Some(1.0);
                if !(plain || whole_head || v.is_null() || known.contains(&k.as_str())) {
                    return Err(self.err(
                        &field(k),
                        format!(
                            "{v}: not a setting of rope_type \"{kind}\" that dtensor implements"
                        ),
                    ));
                }
            }
        }
        let scaling = match kind {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear {
                factor: need("factor")?,
            },
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_position_embeddings: whole("original_max_position_embeddings", 0)
                    .and_then(|n| match n {
                        0 => Err(self.err(&field("original_max_position_embeddings"), "missing")),
                        n => Ok(n),
                    })?,
            },
            "yarn" => {
                let original = whole("original_max_position_embeddings", max_pos)?;
                let factor = match num("factor")? {
                    Some(f) => f,
                    // transformers derives it when left out.
                    None => max_pos as f64 / original as f64,
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: num("beta_fast")?.unwrap_or(32.0),
                    beta_slow: num("beta_slow")?.unwrap_or(1.0),
                    attention_factor: num("attention_factor")?,
                    mscale: num("mscale")?,
                    mscale_all_dim: num("mscale_all_dim")?,
                    truncate: match sub("truncate") {
                        None => true,
                        Some(v) => v.as_bool().ok_or_else(|| {
                            self.err(&field("truncate"), format!("{v} is not true or false"))
                        })?,
                    },
                }
            }
            _ => unreachable!("checked above"),
        };
        let rope = Rope {
            head_dim,
            rotary_dim: head_dim,
            theta,
            style: RopeStyle::HalfSplit,
            scaling,
            heads: RotatedHeads::ALL,
        };
        // The kernels' own checks of the values (positive factors, ordered frequencies).
        rope.validate().map_err(|e| {
            self.err(
                if where_.is_empty() {
                    "rope_theta"
                } else {
                    where_
                },
                e,
            )
        })?;
        Ok(rope)
    }
}
