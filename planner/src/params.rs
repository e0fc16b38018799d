//! The GPT's parameters one by one, with the kinds `dtensor_nn::data` gives them: what a
//! kind is sharded over decides every byte of gradient traffic.

use crate::model::{Activation, Model};

// Here rather than in model.rs: the count is the sum of `param_list`, and the model file
// stays a description that imports nothing of the planner.
impl Model {
    /// All parameters (elements), as the GPT holds them.
    pub fn parameters(&self) -> u64 {
        param_list(self, 1, 1, false).iter().map(|p| p.global).sum()
    }
}

/// A parameter's kind (`dtensor_nn::data::ParamKind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Column weight `[out, in]` and the embedding table: `Shard<0>` over `Tp`, `Shard<1>`
    /// over a sharding `Dp`.
    ColW,
    /// Row weight `[out, in]`: `Shard<1>` over `Tp`, `Shard<0>` over a sharding `Dp`.
    RowW,
    /// Column bias `[out]`: `Shard<0>` over `Tp`, `Replicate` over `Dp` in every data mode
    /// (all-reduced, never sharded).
    ColB,
    /// Norm weights and biases, row biases `[hidden]`: replicated over `Tp` (gradient
    /// all-reduced over `Tp` under SP), `Shard<0>` over a sharding `Dp`.
    StreamP,
    /// MoE expert weights `[experts, out, in]`: `Shard<0>` over `Ep`, as `StreamP` over
    /// `Tp`, never reduced over `Ep`.
    ExpertW,
}

/// Where a parameter lives (which pipeline stage holds it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    /// The token embedding table, on the first pipeline stage.
    Embedding,
    /// A parameter of block `l` (0-based), on the stage holding that layer.
    Block(usize),
    /// The final norm and the LM head, on the last pipeline stage.
    Head,
}

/// One parameter.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ParamInfo {
    /// How it is sharded and how its gradient is reduced.
    pub kind: Kind,
    /// Which stage holds it.
    pub place: Place,
    /// Elements of the whole parameter.
    pub global: u64,
    /// Elements one rank holds before any `Dp` sharding (its `Tp` and `Ep` piece).
    pub local: u64,
}

impl ParamInfo {
    /// Dense parameters are replicated over `Ep` (gradient all-reduced there).
    pub fn dense(&self) -> bool {
        self.kind != Kind::ExpertW
    }
    /// Sharded over `Dp` under ZeRO and FSDP (all but the column bias).
    pub fn dp_shardable(&self) -> bool {
        self.kind != Kind::ColB
    }
    /// Replicated over `Tp` with a gradient all-reduced there under SP.
    pub fn tp_replicated(&self) -> bool {
        matches!(self.kind, Kind::StreamP | Kind::ExpertW)
    }
}

/// The parameters in `dtensor_nn`'s visiting order (embedding, blocks, final norm, head),
/// local sizes for `tp`, `ep`. `sp` does not change sizes.
pub fn param_list(m: &Model, tp: usize, ep: usize, _sp: bool) -> Vec<ParamInfo> {
    let (h, f, v) = (m.hidden as u64, m.ffn as u64, m.vocab as u64);
    let (tp, ep) = (tp as u64, ep as u64);
    let mut out = Vec::new();
    let mut push = |kind: Kind, place: Place, global: u64| {
        let local = match kind {
            Kind::ColW | Kind::RowW | Kind::ColB => global / tp,
            Kind::StreamP => global,
            Kind::ExpertW => global / ep,
        };
        out.push(ParamInfo {
            kind,
            place,
            global,
            local,
        });
    };
    push(Kind::ColW, Place::Embedding, v * h);
    let norm = |push: &mut dyn FnMut(Kind, Place, u64), place| {
        push(Kind::StreamP, place, h);
        if m.layer_norm {
            push(Kind::StreamP, place, h);
        }
    };
    for l in 0..m.layers {
        let p = Place::Block(l);
        norm(&mut push, p);
        // Fused QKV column (queries `h` wide, keys and values `kv` each), row output.
        let kv = m.kv_width() as u64;
        push(Kind::ColW, p, (h + 2 * kv) * h);
        if m.bias {
            push(Kind::ColB, p, h + 2 * kv);
        }
        push(Kind::RowW, p, h * h);
        if m.bias {
            push(Kind::StreamP, p, h);
        }
        norm(&mut push, p);
        match m.moe {
            None => {
                let cols = if m.activation == Activation::SwiGlu {
                    2
                } else {
                    1
                };
                for _ in 0..cols {
                    push(Kind::ColW, p, f * h);
                    if m.bias {
                        push(Kind::ColB, p, f);
                    }
                }
                push(Kind::RowW, p, h * f);
                if m.bias {
                    push(Kind::StreamP, p, h);
                }
            }
            Some(moe) => {
                let e = moe.experts as u64;
                // Router `[hidden, experts]`, a stream parameter.
                push(Kind::StreamP, p, h * e);
                let mats = if m.activation == Activation::SwiGlu {
                    3
                } else {
                    2
                };
                for _ in 0..mats {
                    push(Kind::ExpertW, p, e * f * h);
                }
            }
        }
    }
    norm(&mut push, Place::Head);
    // The LM head has no bias (`GptStage` builds it with `bias = false`).
    push(Kind::ColW, Place::Head, v * h);
    out
}
