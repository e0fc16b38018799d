//! Which Hugging Face tensors each parameter of dtensor's decoder is made of.
//!
//! A parameter of ours is the Hugging Face tensors behind it stacked along dim 0, each
//! covering a run of our rows ([`Segment`]):
//!
//! | ours | Hugging Face (layer `l`) |
//! |---|---|
//! | `embedding.weight` `[vocab, hidden]` | `model.embed_tokens.weight` |
//! | `blocks.l.norm1.weight` | `model.layers.l.input_layernorm.weight` |
//! | `blocks.l.attn.qkv.weight` `[(heads + 2·kv_heads)·head_dim, hidden]` | `self_attn.{q,k,v}_proj.weight`, grouped: per KV head `j`, the rows of its `g` query heads, then its key head, then its value head |
//! | `blocks.l.attn.qkv.bias` | `self_attn.{q,k,v}_proj.bias`, grouped the same way (Qwen2) |
//! | `blocks.l.attn.q.weight` / `.bias` (more `Tp` ranks than KV heads) | `self_attn.q_proj.weight` / `.bias` |
//! | `blocks.l.attn.kv.weight` / `.bias` (more `Tp` ranks than KV heads) `[2·kv_heads·head_dim, hidden]` | `self_attn.{k,v}_proj.weight` / `.bias`: per KV head its k rows, then its v rows |
//! | `blocks.l.attn.q_norm.weight`, `attn.k_norm.weight` `[head_dim]` | `self_attn.q_norm.weight`, `self_attn.k_norm.weight` (Qwen3) |
//! | `blocks.l.attn.out.weight` / `.bias` | `self_attn.o_proj.weight` / `.bias` |
//! | `blocks.l.norm2.weight` | `model.layers.l.post_attention_layernorm.weight` |
//! | `blocks.l.mlp.fc1.weight`, `mlp.up.weight`, `mlp.fc2.weight` | `mlp.gate_proj.weight`, `mlp.up_proj.weight`, `mlp.down_proj.weight` |
//! | `blocks.l.mlp.router` `[experts, hidden]` | Mixtral `block_sparse_moe.gate.weight`, Qwen3-MoE `mlp.gate.weight` |
//! | `blocks.l.mlp.w1`, `mlp.up`, `mlp.w2` `[experts, out, in]` | expert `e`'s Mixtral `block_sparse_moe.experts.e.w1/w3/w2.weight`, Qwen3-MoE `mlp.experts.e.gate_proj/up_proj/down_proj.weight`, one per row of dim 0 |
//! | `norm.weight` | `model.norm.weight` |
//! | `head.weight` `[vocab, hidden]` | `lm_head.weight` (absent when the embeddings are tied: the decoder's head is its embedding) |
//!
//! Both sides keep a linear layer's weight as `[out, in]` and RoPE's half-split pairing
//! (the decoder is built with [`RopeStyle::HalfSplit`](dtensor_kernels::ops::RopeStyle)),
//! so no tensor is transposed or permuted: loading a rank's slice of a parameter reads,
//! per segment, one block of one Hugging Face tensor.

use super::config::{Architecture, HfConfig};
use std::collections::BTreeMap;
use std::ops::Range;

/// Rows `rows` (dim 0) of one of our parameters, taken from one Hugging Face tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment {
    /// Our rows this segment covers.
    pub rows: Range<usize>,
    /// The Hugging Face tensor's name.
    pub tensor: String,
    /// Where in that tensor the rows come from.
    pub source: Source,
}

/// How a [`Segment`]'s rows sit in its Hugging Face tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// Rows `start..start + len` of a tensor with our trailing dims.
    Rows {
        /// The first row taken.
        start: usize,
    },
    /// The whole tensor is one row of ours: it has one dim fewer (an expert's weight in a
    /// stack `[experts, out, in]`).
    Stacked,
}

/// Our parameters' Hugging Face sources. (Which tensors a checkpoint holds, and their
/// shapes, is [`HfConfig::expected_tensors`]; [`HfWeights::validate`] checks a checkpoint
/// against it.)
///
/// [`HfWeights::validate`]: super::HfWeights::validate
#[derive(Clone, Debug, Default)]
pub struct NameMap {
    ours: BTreeMap<String, Vec<Segment>>,
}

impl NameMap {
    /// The map of the decoder `cfg` describes.
    pub fn new(cfg: &HfConfig) -> NameMap {
        let mut map = NameMap::default();
        let (h, v, hd) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim);
        let (heads, kv, g) = (cfg.heads, cfg.kv_heads, cfg.group());
        map.whole("embedding.weight", "model.embed_tokens.weight", v);
        for l in 0..cfg.layers {
            let ours = |s: &str| format!("blocks.{l}.{s}");
            let theirs = |s: &str| format!("model.layers.{l}.{s}");
            map.whole(&ours("norm1.weight"), &theirs("input_layernorm.weight"), h);
            map.whole(
                &ours("norm2.weight"),
                &theirs("post_attention_layernorm.weight"),
                h,
            );
            let qkv_suffixes: &[&str] = if cfg.qkv_bias {
                &["weight", "bias"]
            } else {
                &["weight"]
            };
            for suffix in qkv_suffixes {
                let [q, k, vv] = ["q_proj", "k_proj", "v_proj"]
                    .map(|p| theirs(&format!("self_attn.{p}.{suffix}")));
                // Megatron's grouped fused layout: group j = its g query heads, its k, its v.
                let mut segments = Vec::with_capacity(3 * kv);
                let mut row = 0;
                for j in 0..kv {
                    for (tensor, start, len) in [
                        (&q, j * g * hd, g * hd),
                        (&k, j * hd, hd),
                        (&vv, j * hd, hd),
                    ] {
                        segments.push(Segment {
                            rows: row..row + len,
                            tensor: tensor.clone(),
                            source: Source::Rows { start },
                        });
                        row += len;
                    }
                }
                map.ours
                    .insert(ours(&format!("attn.qkv.{suffix}")), segments);
                // With more tensor ranks than KV heads the layer keeps q apart (sharded)
                // and the KV heads whole (per KV head its k rows, then its v rows).
                map.whole(&ours(&format!("attn.q.{suffix}")), &q, heads * hd);
                let mut kv_segments = Vec::with_capacity(2 * kv);
                for j in 0..kv {
                    for (n, tensor) in [(0, &k), (1, &vv)] {
                        let row = (2 * j + n) * hd;
                        kv_segments.push(Segment {
                            rows: row..row + hd,
                            tensor: tensor.clone(),
                            source: Source::Rows { start: j * hd },
                        });
                    }
                }
                map.ours
                    .insert(ours(&format!("attn.kv.{suffix}")), kv_segments);
            }
            if cfg.qk_norm {
                for n in ["q_norm", "k_norm"] {
                    map.whole(
                        &ours(&format!("attn.{n}.weight")),
                        &theirs(&format!("self_attn.{n}.weight")),
                        hd,
                    );
                }
            }
            map.whole(
                &ours("attn.out.weight"),
                &theirs("self_attn.o_proj.weight"),
                h,
            );
            if cfg.o_bias {
                map.whole(&ours("attn.out.bias"), &theirs("self_attn.o_proj.bias"), h);
            }
            match &cfg.moe {
                None => {
                    let f = cfg.intermediate_size;
                    for (mine, hf, shape) in [
                        ("mlp.fc1.weight", "mlp.gate_proj.weight", [f, h]),
                        ("mlp.up.weight", "mlp.up_proj.weight", [f, h]),
                        ("mlp.fc2.weight", "mlp.down_proj.weight", [h, f]),
                    ] {
                        map.whole(&ours(mine), &theirs(hf), shape[0]);
                    }
                }
                Some(moe) => {
                    let e = moe.experts;
                    let (block, names) = match cfg.architecture {
                        Architecture::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
                        _ => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
                    };
                    map.whole(
                        &ours("mlp.router"),
                        &theirs(&format!("{block}.gate.weight")),
                        e,
                    );
                    for (mine, hf) in [
                        ("mlp.w1", names[0]),
                        ("mlp.up", names[1]),
                        ("mlp.w2", names[2]),
                    ] {
                        let segments = (0..e)
                            .map(|x| {
                                let tensor = theirs(&format!("{block}.experts.{x}.{hf}.weight"));
                                Segment {
                                    rows: x..x + 1,
                                    tensor,
                                    source: Source::Stacked,
                                }
                            })
                            .collect();
                        map.ours.insert(ours(mine), segments);
                    }
                }
            }
        }
        map.whole("norm.weight", "model.norm.weight", h);
        // Tied: the decoder has no head of its own (it uses the embedding's weight).
        if !cfg.tie_word_embeddings {
            map.whole("head.weight", "lm_head.weight", v);
        }
        map
    }

    /// Our parameter `ours` (`rows` along dim 0) is the whole of `hf`.
    fn whole(&mut self, ours: &str, hf: &str, rows: usize) {
        self.ours.insert(
            ours.to_string(),
            vec![Segment {
                rows: 0..rows,
                tensor: hf.to_string(),
                source: Source::Rows { start: 0 },
            }],
        );
    }

    /// The segments of our parameter `ours`, in row order; `None` for a name the map does
    /// not know.
    pub fn segments(&self, ours: &str) -> Option<&[Segment]> {
        self.ours.get(ours).map(Vec::as_slice)
    }

    /// Our parameter names, sorted.
    pub fn our_names(&self) -> impl Iterator<Item = &str> {
        self.ours.keys().map(String::as_str)
    }
}

/// The parts of `segments` that meet our rows `want`: for each, the Hugging Face tensor,
/// where its rows sit, and the range of *its* dim 0 (for [`Source::Stacked`], `0..1` of
/// the stack) taken.
pub fn overlapping<'a>(
    segments: &'a [Segment],
    want: &'a Range<usize>,
) -> impl Iterator<Item = (&'a Segment, Range<usize>)> + 'a {
    segments.iter().filter_map(move |s| {
        let lo = s.rows.start.max(want.start);
        let hi = s.rows.end.min(want.end);
        (lo < hi).then(|| {
            let within = lo - s.rows.start..hi - s.rows.start;
            let theirs = match s.source {
                Source::Rows { start } => start + within.start..start + within.end,
                Source::Stacked => within,
            };
            (s, theirs)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llama(kv: usize, bias: bool) -> HfConfig {
        let text = format!(
            r#"{{"model_type":"llama","vocab_size":10,"hidden_size":8,"intermediate_size":12,
            "num_hidden_layers":1,"num_attention_heads":4,"num_key_value_heads":{kv},
            "rms_norm_eps":1e-5,"rope_theta":10000.0,"max_position_embeddings":16,
            "attention_bias":{bias},"tie_word_embeddings":false}}"#
        );
        HfConfig::parse(&text, std::path::Path::new("config.json")).unwrap()
    }

    /// Every row of a fused QKV comes from exactly one row of q, k or v, in the grouped
    /// order, and together they cover each of q, k and v exactly once.
    #[test]
    fn grouped_qkv_covers_q_k_v_once_in_group_order() {
        for kv in [1, 2, 4] {
            let cfg = llama(kv, false);
            let map = NameMap::new(&cfg);
            let segs = map.segments("blocks.0.attn.qkv.weight").unwrap();
            let hd = cfg.head_dim;
            let g = cfg.group();
            let mut rows: Vec<(String, usize)> = Vec::new();
            for s in segs {
                let Source::Rows { start } = s.source else {
                    panic!("fused rows are plain rows")
                };
                for i in 0..s.rows.len() {
                    rows.push((s.tensor.clone(), start + i));
                }
            }
            assert_eq!(rows.len(), (4 + 2 * kv) * hd);
            // Row r of group j: q head j·g + i for the first g·hd, then k head j, v head j.
            for (r, (t, src)) in rows.iter().enumerate() {
                let (j, within) = (r / ((g + 2) * hd), r % ((g + 2) * hd));
                let (want_t, want_src) = if within < g * hd {
                    ("q_proj", j * g * hd + within)
                } else if within < (g + 1) * hd {
                    ("k_proj", j * hd + within - g * hd)
                } else {
                    ("v_proj", j * hd + within - (g + 1) * hd)
                };
                assert!(t.contains(want_t), "row {r}: {t}");
                assert_eq!(*src, want_src, "row {r}");
            }
        }
    }

    #[test]
    fn overlapping_clips_to_the_rows_asked_for() {
        let cfg = llama(2, true);
        let map = NameMap::new(&cfg);
        let segs = map.segments("blocks.0.attn.qkv.bias").unwrap();
        // hd = 2, g = 2: group 0 = q rows 0..4, k 0..2, v 0..2 (ours 0..8); group 1 after.
        let got: Vec<(String, Range<usize>)> = overlapping(segs, &(3..10))
            .map(|(s, r)| (s.tensor.rsplit('.').nth(1).unwrap().to_string(), r))
            .collect();
        assert_eq!(
            got,
            vec![
                ("q_proj".into(), 3..4),
                ("k_proj".into(), 0..2),
                ("v_proj".into(), 0..2),
                ("q_proj".into(), 4..6),
            ]
        );
        // Llama's `attention_bias` covers the output projection too (Qwen2 has QKV only).
        assert!(map.segments("blocks.0.attn.out.bias").is_some());
        assert!(NameMap::new(&llama(2, false))
            .segments("blocks.0.attn.out.bias")
            .is_none());
        assert_eq!(
            map.segments("head.weight").unwrap()[0].tensor,
            "lm_head.weight"
        );
    }
}
