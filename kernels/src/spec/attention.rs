//! Fused causal self-attention: its configuration, output and the checks of `qkv`.

use super::*;

pub(crate) const OP: &str = "ops::causal_attention";
pub(crate) const OP_BACK: &str = "ops::causal_attention_backward";

/// The shape parameters of [`causal_attention`](crate::ops::causal_attention) (the head
/// counts are read off `qkv`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CausalAttention {
    /// Tokens per sample: `qkv`'s rows are samples of this many tokens, one after another.
    pub seq_len: usize,
    /// The head dim `d` (any size).
    pub head_dim: usize,
    /// Query heads per KV head, `g = heads / kv_heads`: 1 for multi-head attention, `heads`
    /// for multi-query attention (the grouped fused layout: see
    /// [`crate::ops::attention`](mod@crate::ops::attention)).
    pub q_per_kv: usize,
    /// The score scale; `None` is `1/√head_dim`.
    pub scale: Option<f64>,
}

impl CausalAttention {
    /// Multi-head attention (`q_per_kv = 1`) with the score scale `1/√head_dim`.
    pub fn new(seq_len: usize, head_dim: usize) -> CausalAttention {
        CausalAttention {
            seq_len,
            head_dim,
            q_per_kv: 1,
            scale: None,
        }
    }

    /// The same with `q_per_kv` query heads per KV head.
    pub fn grouped(self, q_per_kv: usize) -> CausalAttention {
        CausalAttention { q_per_kv, ..self }
    }

    /// The score scale in use.
    pub fn score_scale(&self) -> f64 {
        self.scale
            .unwrap_or_else(|| 1.0 / (self.head_dim as f64).sqrt())
    }

    /// Columns of the fused QKV per KV group: `(q_per_kv + 2)·head_dim` (`None` on
    /// overflow).
    pub fn group_cols(&self) -> Option<usize> {
        self.q_per_kv.checked_add(2)?.checked_mul(self.head_dim)
    }
}

/// What [`causal_attention`](crate::ops::causal_attention) returns: the output and the statistic its backward takes.
#[derive(Clone, Debug, PartialEq)]
pub struct CausalAttentionOutput {
    /// `[tokens, heads·head_dim]`, `qkv`'s dtype.
    pub out: Tensor,
    /// `[tokens, heads]`: each row's log-sum-exp of its scaled scores, compute dtype.
    pub lse: Tensor,
}

/// Validated sizes of one call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub(crate) tokens: usize,
    /// Query heads, `kv_heads · g`.
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    /// Query heads per KV head.
    pub(crate) g: usize,
    /// The score scale.
    pub(crate) scale: f64,
    /// Samples.
    pub(crate) batch: usize,
    pub(crate) s: usize,
    pub(crate) d: usize,
    /// Columns of `qkv`.
    pub(crate) cols: usize,
}

/// Checks `qkv` (`[tokens, kv_heads·(g+2)·head_dim]`, float) against `cfg`; returns the
/// sizes.
pub(crate) fn check_qkv<L: Layout + ?Sized>(
    op: &'static str,
    qkv: &L,
    cfg: &CausalAttention,
) -> Result<Dims> {
    let bad = |detail: String| Err(Error::Invalid { op, detail });
    if qkv.rank() != 2 {
        return bad(format!(
            "qkv must be [tokens, kv_heads·(q_per_kv+2)·head_dim], got shape {:?}",
            qkv.shape()
        ));
    }
    want_float(op, qkv)?;
    let (tokens, cols) = (qkv.shape()[0], qkv.shape()[1]);
    let (s, d) = (cfg.seq_len, cfg.head_dim);
    if d == 0 {
        return bad("head_dim must be nonzero".into());
    }
    if s == 0 || tokens % s != 0 {
        return bad(format!(
            "{tokens} tokens are not whole samples of seq_len {s}"
        ));
    }
    let g = cfg.q_per_kv;
    if g == 0 {
        return bad("q_per_kv must be at least 1".into());
    }
    let Some(group_cols) = cfg.group_cols() else {
        return bad(format!(
            "(q_per_kv + 2)·head_dim overflows usize (q_per_kv {g}, head_dim {d})"
        ));
    };
    if cols % group_cols != 0 {
        return bad(format!(
            "{cols} qkv columns are not whole KV groups of (q_per_kv + 2)·head_dim = {group_cols} ({g} q heads, k, v per group)"
        ));
    }
    let scale = cfg.score_scale();
    if !scale.is_finite() {
        return bad(format!("score scale {scale} must be finite"));
    }
    let kv_heads = cols / group_cols;
    Ok(Dims {
        tokens,
        heads: kv_heads * g,
        kv_heads,
        g,
        scale,
        batch: tokens / s,
        s,
        d,
        cols,
    })
}
