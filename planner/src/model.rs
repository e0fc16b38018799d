//! The model a plan is for: a GPT shape (as `dtensor_nn::GptConfig` builds it) and the
//! global batch of one training step. Presets, or a JSON file (see [`Model::from_json`]).

/// The MLP of every block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `fc1 → GELU → fc2`.
    Gelu,
    /// `fc1 ⊙ SiLU(up) → fc2`: one more column-parallel `[ffn, hidden]` weight.
    SwiGlu,
}

/// A mixture-of-experts MLP in every block (experts sharded over `Ep`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Moe {
    /// Experts per block; `ep` must divide it.
    pub experts: usize,
    /// Experts each token is routed to.
    pub top_k: usize,
}

/// A GPT and its step's batch.
#[derive(Clone, Debug, PartialEq)]
pub struct Model {
    /// A label for reports: the preset's name, a model file's `name`, or `custom`.
    pub name: String,
    /// Vocabulary size: rows of the embedding table and of the LM head (sharded over
    /// `Tp`).
    pub vocab: usize,
    /// Hidden size, the width of the residual stream.
    pub hidden: usize,
    /// Attention (query) heads; `hidden` divides by it (the head dim is `hidden / heads`).
    pub heads: usize,
    /// Key/value heads (grouped-query attention): they divide `heads`; `heads` is
    /// multi-head attention. The fused QKV is `hidden + 2·kv_heads·head_dim` wide.
    pub kv_heads: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// The MLP's inner width (per expert in a MoE model).
    pub ffn: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per optimizer step (all ranks together).
    pub global_batch: usize,
    /// LayerNorm (weight and bias) when true, RMSNorm (weight only) when false.
    pub layer_norm: bool,
    /// Biases in the linear layers (and the LM head).
    pub bias: bool,
    /// The MLP's activation (GELU or SwiGLU).
    pub activation: Activation,
    /// `Some` for a mixture-of-experts MLP in every block, `None` for a dense MLP.
    pub moe: Option<Moe>,
}

/// The preset names [`Model::preset`] knows.
pub const PRESETS: [&str; 4] = ["gpt-small", "7b", "70b", "moe-8x7b"];

impl Model {
    /// Columns per head, `hidden / heads`.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// The key (or value) projection's width, `kv_heads · head_dim` (`hidden` without
    /// grouped-query attention).
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim()
    }

    /// A named model:
    ///
    /// - `gpt-small`: `examples/train_gpt.rs`'s default (`GptConfig::small`): 2 layers,
    ///   hidden 64, 4 heads, ffn 256, byte vocabulary 256, RMSNorm, GELU, biases,
    ///   sequence 64, global batch 8.
    /// - `7b`: Llama-2-7B's shape (hidden 4096, 32 layers, 32 heads, SwiGLU ffn 11008,
    ///   vocab 32000, RMSNorm, no biases; 6.74 B parameters), sequence 4096, batch 256.
    /// - `70b`: hidden 8192, 80 layers, 64 heads, SwiGLU ffn 24576, vocab 32000 (70.3 B
    ///   parameters: full heads and a narrower ffn that keep the count at 70 B, so the
    ///   figures stay those of earlier releases; set [`kv_heads`](Model::kv_heads) 8 and
    ///   `ffn` 28672 for Llama-2-70B's exact grouped-query shape), sequence 4096, batch
    ///   512.
    /// - `moe-8x7b`: Mixtral's shape with full heads: hidden 4096, 32 layers, 32 heads, 8
    ///   experts of SwiGLU ffn 14336, top-2, vocab 32000; sequence 4096, batch 256.
    pub fn preset(name: &str) -> Option<Model> {
        let big = |name: &str, hidden, layers, heads, ffn, batch| Model {
            name: name.to_string(),
            vocab: 32000,
            hidden,
            heads,
            kv_heads: heads,
            layers,
            ffn,
            seq_len: 4096,
            global_batch: batch,
            layer_norm: false,
            bias: false,
            activation: Activation::SwiGlu,
            moe: None,
        };
        Some(match name {
            "gpt-small" => Model {
                name: name.to_string(),
                vocab: 256,
                hidden: 64,
                heads: 4,
                kv_heads: 4,
                layers: 2,
                ffn: 256,
                seq_len: 64,
                global_batch: 8,
                layer_norm: false,
                bias: true,
                activation: Activation::Gelu,
                moe: None,
            },
            "7b" => big(name, 4096, 32, 32, 11008, 256),
            "70b" => big(name, 8192, 80, 64, 24576, 512),
            "moe-8x7b" => Model {
                moe: Some(Moe {
                    experts: 8,
                    top_k: 2,
                }),
                ..big(name, 4096, 32, 32, 14336, 256)
            },
            _ => return None,
        })
    }

    /// A model from JSON: an object with the integer fields `vocab`, `hidden`, `heads`,
    /// `layers`, `ffn`, `seq_len`, `global_batch`, and optionally `name` (string), `kv_heads`
    /// (default: `heads`), `norm`
    /// (`"rms"`, default, or `"layer"`), `activation` (`"gelu"`, default, or `"swiglu"`),
    /// `bias` (bool, default true) and `moe` (`{"experts": n, "top_k": k}`). Unknown fields
    /// are an error (a typo must not pass silently).
    pub fn from_json(text: &str) -> Result<Model, String> {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| format!("model file: {e}"))?;
        let obj = v.as_object().ok_or("model file: expected a JSON object")?;
        const KNOWN: [&str; 13] = [
            "name",
            "vocab",
            "hidden",
            "heads",
            "kv_heads",
            "layers",
            "ffn",
            "seq_len",
            "global_batch",
            "norm",
            "activation",
            "bias",
            "moe",
        ];
        if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(format!(
                "model file: unknown field `{k}` (known: {})",
                KNOWN.join(", ")
            ));
        }
        let int =
            |o: &serde_json::Map<String, serde_json::Value>, k: &str| -> Result<usize, String> {
                o.get(k)
                    .and_then(|x| x.as_u64())
                    .filter(|&x| x > 0)
                    .map(|x| x as usize)
                    .ok_or_else(|| format!("model file: `{k}` must be a positive integer"))
            };
        let moe = match obj.get("moe") {
            None | Some(serde_json::Value::Null) => None,
            Some(m) => {
                let m = m.as_object().ok_or("model file: `moe` must be an object")?;
                Some(Moe {
                    experts: int(m, "experts")?,
                    top_k: int(m, "top_k")?,
                })
            }
        };
        let model = Model {
            name: obj
                .get("name")
                .and_then(|n| n.as_str())
                .unwrap_or("custom")
                .to_string(),
            vocab: int(obj, "vocab")?,
            hidden: int(obj, "hidden")?,
            heads: int(obj, "heads")?,
            kv_heads: match obj.get("kv_heads") {
                None => int(obj, "heads")?,
                Some(_) => int(obj, "kv_heads")?,
            },
            layers: int(obj, "layers")?,
            ffn: int(obj, "ffn")?,
            seq_len: int(obj, "seq_len")?,
            global_batch: int(obj, "global_batch")?,
            layer_norm: match obj.get("norm").and_then(|n| n.as_str()).unwrap_or("rms") {
                "rms" => false,
                "layer" => true,
                other => return Err(format!("model file: norm `{other}` is not rms or layer")),
            },
            activation: match obj
                .get("activation")
                .and_then(|n| n.as_str())
                .unwrap_or("gelu")
            {
                "gelu" => Activation::Gelu,
                "swiglu" => Activation::SwiGlu,
                other => {
                    return Err(format!(
                        "model file: activation `{other}` is not gelu or swiglu"
                    ))
                }
            },
            bias: obj.get("bias").and_then(|b| b.as_bool()).unwrap_or(true),
            moe,
        };
        if !model.hidden.is_multiple_of(model.heads) {
            return Err("model file: `hidden` must divide by `heads`".into());
        }
        if !model.heads.is_multiple_of(model.kv_heads) {
            return Err("model file: `heads` must divide by `kv_heads`".into());
        }
        Ok(model)
    }

    /// A preset name, or a path to a JSON model file.
    pub fn load(name_or_path: &str) -> Result<Model, String> {
        if let Some(m) = Model::preset(name_or_path) {
            return Ok(m);
        }
        let text = std::fs::read_to_string(name_or_path).map_err(|e| {
            format!(
                "`{name_or_path}` is neither a preset ({}) nor a readable file: {e}",
                PRESETS.join(", ")
            )
        })?;
        Model::from_json(&text)
    }
}
