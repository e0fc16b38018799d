//! Fused causal self-attention: its configuration, output and the checks of `qkv`.

use super::*;

pub(crate) const OP: &str = "ops::causal_attention";
pub(crate) const OP_BACK: &str = "ops::causal_attention_backward";

/// The shape parameters of [`causal_attention`](crate::ops::causal_attention) (the head count is read off `qkv`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CausalAttention {
    /// Tokens per sample: `qkv`'s rows are samples of this many tokens, one after another.
    pub seq_len: usize,
    /// The head dim `d`.
    pub head_dim: usize,
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
    pub(crate) heads: usize,
    /// Samples.
    pub(crate) batch: usize,
    pub(crate) s: usize,
    pub(crate) d: usize,
    /// Columns of `qkv`.
    pub(crate) cols: usize,
}

/// Checks `qkv` (`[tokens, heads·3·head_dim]`, float) against `cfg`; returns the sizes.
pub(crate) fn check_qkv<L: Layout + ?Sized>(
    op: &'static str,
    qkv: &L,
    cfg: &CausalAttention,
) -> Result<Dims> {
    let bad = |detail: String| Err(Error::Invalid { op, detail });
    if qkv.rank() != 2 {
        return bad(format!(
            "qkv must be [tokens, heads·3·head_dim], got shape {:?}",
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
    let Some(head_cols) = d.checked_mul(3) else {
        return bad(format!("3·head_dim overflows usize (head_dim {d})"));
    };
    if cols % head_cols != 0 {
        return bad(format!(
            "{cols} qkv columns are not whole heads of 3·head_dim = {head_cols} (q, k, v per head)"
        ));
    }
    Ok(Dims {
        tokens,
        heads: cols / head_cols,
        batch: tokens / s,
        s,
        d,
        cols,
    })
}
