//! Fused causal self-attention: its configuration, output, the checks of `qkv`, and the
//! RoPE tables both backends rotate by.

use super::float::AccFloat;
use super::*;

pub(crate) const OP: &str = "ops::causal_attention";
pub(crate) const OP_BACK: &str = "ops::causal_attention_backward";

/// The shape parameters of [`causal_attention`](crate::ops::causal_attention) (the head count is read off `qkv`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CausalAttention {
    /// Tokens per sample: `qkv`'s rows are samples of this many tokens, one after another.
    pub seq_len: usize,
    /// The head dim `d` (even: RoPE rotates pairs).
    pub head_dim: usize,
    /// RoPE's base (10000 in most models).
    pub rope_base: f64,
    /// Added to every token's position (its index within its sample). Since q and k share
    /// it here and RoPE scores depend only on position differences, it changes the result
    /// by rounding alone. Attending one chunk's queries to another chunk's keys (context
    /// parallelism) takes separate q and k positions: [`attention_block`](fn@crate::ops::attention_block).
    pub pos_offset: usize,
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
    if d == 0 || d % 2 != 0 {
        return bad(format!(
            "head_dim {d} must be even and nonzero (RoPE rotates pairs)"
        ));
    }
    if s == 0 || tokens % s != 0 {
        return bad(format!(
            "{tokens} tokens are not whole samples of seq_len {s}"
        ));
    }
    if cfg.pos_offset.checked_add(s - 1).is_none() {
        return bad(format!(
            "pos_offset {} + seq_len {s} overflows usize: the last tokens have no position",
            cfg.pos_offset
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
    if !(cfg.rope_base.is_finite() && cfg.rope_base > 0.0) {
        return bad(format!(
            "rope_base {} must be positive and finite",
            cfg.rope_base
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

/// RoPE's cosines and sines for the `s` positions of a sample, `[s, d/2]`, computed in `f64`
/// (as `pos / base^(2p/d)`) and rounded once into the compute type.
pub(crate) struct Rope<A> {
    pub(crate) cos: Vec<A>,
    pub(crate) sin: Vec<A>,
    pub(crate) half: usize,
}

impl<A: AccFloat> Rope<A> {
    pub(crate) fn new(cfg: &CausalAttention) -> Self {
        Rope::for_positions(
            (0..cfg.seq_len).map(|i| cfg.pos_offset + i),
            cfg.head_dim,
            cfg.rope_base,
        )
    }

    /// The table for rows at the given positions (row `i` rotates by `positions[i]`).
    pub(crate) fn for_positions(
        positions: impl ExactSizeIterator<Item = usize>,
        d: usize,
        base: f64,
    ) -> Self {
        let half = d / 2;
        let freq: Vec<f64> = (0..half)
            .map(|p| base.powf(2.0 * p as f64 / d as f64))
            .collect();
        let n = positions.len();
        let (mut cos, mut sin) = (Vec::with_capacity(n * half), Vec::with_capacity(n * half));
        for pos in positions {
            let pos = pos as f64;
            for f in &freq {
                let (sn, cs) = (pos / f).sin_cos();
                cos.push(A::lit(cs));
                sin.push(A::lit(sn));
            }
        }
        Rope { cos, sin, half }
    }

    /// The cos and sin tables, each `[positions, d/2]` row-major (what the device kernels
    /// read).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn into_tables(self) -> (Vec<A>, Vec<A>) {
        (self.cos, self.sin)
    }
}
