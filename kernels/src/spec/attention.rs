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

pub(crate) const OP_MASK: &str = "ops::causal_attention_masked";
pub(crate) const OP_MASK_BACK: &str = "ops::causal_attention_masked_backward";

/// What a query sees besides causality: its own document of a packed sample, and a
/// sliding window. The empty mask ([`AttentionMask::CAUSAL`]) is plain causal attention.
///
/// Query position `i` of a sample sees key position `j` iff
///
/// - `j ≤ i` (causal, always);
/// - with [`documents`](Self::documents): `j` lies in `i`'s document, where a document is a
///   run of consecutive tokens of the sample with the same id (ids need only differ
///   between neighbouring documents: `0, 0, 1, 1, 0` are three documents; a sample's
///   first token always starts one, so documents never cross samples);
/// - with [`window`](Self::window) `w ≥ 1`: `i − w < j`, the Mistral / Hugging Face
///   convention: `w` keys including the query itself (`w = 1` sees only itself).
///
/// Both together: the intersection. Either way the keys a query sees are the contiguous
/// positions `first_key(i) ..= i` (its document's first token or `i + 1 − w`, whichever is
/// later), and `first_key` never decreases along a sample: that is what lets the kernels
/// skip whole key tiles ([`key_tile_masked`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttentionMask<'a> {
    /// One document id per token, in the natural order of the tokens (samples one after
    /// another, as `qkv`'s rows); `None`: each sample is one document.
    pub documents: Option<&'a [u32]>,
    /// The sliding window `w ≥ 1` (keys seen, the query included); `None`: unbounded.
    pub window: Option<usize>,
}

impl<'a> AttentionMask<'a> {
    /// Plain causal attention: no documents, no window.
    pub const CAUSAL: AttentionMask<'static> = AttentionMask {
        documents: None,
        window: None,
    };

    /// The same with packed documents: `ids[t]` is token `t`'s document.
    pub fn documents(self, ids: &'a [u32]) -> AttentionMask<'a> {
        AttentionMask {
            documents: Some(ids),
            ..self
        }
    }

    /// The same with a sliding window of `w` keys (the query included).
    pub fn window(self, w: usize) -> AttentionMask<'a> {
        AttentionMask {
            window: Some(w),
            ..self
        }
    }

    /// Whether this is plain causal attention.
    pub fn is_causal(&self) -> bool {
        self.documents.is_none() && self.window.is_none()
    }

    /// The first key position each query sees: for each of the `samples` samples of
    /// `seq_len` tokens (whose ids are `documents[b·seq_len ..]`), and each of `positions`
    /// (positions in the sample, each below `seq_len`), `first_key`; `samples ·
    /// positions.len()` values, sample by sample. `Err` (naming `op`) when the ids are not
    /// one per token of the samples, the window is 0, or a position lies past the sample.
    pub(crate) fn first_keys(
        &self,
        op: &'static str,
        samples: usize,
        seq_len: usize,
        positions: &[usize],
    ) -> Result<Vec<usize>> {
        let bad = |detail: String| Err(Error::Invalid { op, detail });
        if self.window == Some(0) {
            return bad("the sliding window must be at least 1 key (the query itself)".into());
        }
        if let Some(&p) = positions.iter().find(|&&p| p >= seq_len) {
            return bad(format!(
                "position {p} lies past a sample of {seq_len} tokens"
            ));
        }
        if let Some(ids) = self.documents {
            if Some(ids.len()) != samples.checked_mul(seq_len) {
                return bad(format!(
                    "{} document ids for {samples} samples of {seq_len} tokens: want one per token ({})",
                    ids.len(),
                    samples.saturating_mul(seq_len)
                ));
            }
        }
        let from_window = |p: usize| match self.window {
            Some(w) => (p + 1).saturating_sub(w),
            None => 0,
        };
        let mut first = Vec::with_capacity(samples * positions.len());
        let mut start = vec![0; if self.documents.is_some() { seq_len } else { 0 }];
        for b in 0..samples {
            if let Some(ids) = self.documents {
                let ids = &ids[b * seq_len..(b + 1) * seq_len];
                for p in 1..seq_len {
                    start[p] = if ids[p] == ids[p - 1] {
                        start[p - 1]
                    } else {
                        p
                    };
                }
            }
            first.extend(positions.iter().map(|&p| {
                let doc = start.get(p).copied().unwrap_or(0);
                doc.max(from_window(p))
            }));
        }
        Ok(first)
    }
}

/// Whether a tile of queries sees none of a tile of keys, so a kernel skips it: the
/// queries' positions are increasing and the first of them sees keys from
/// `first_query_first_key` on (the smallest [`AttentionMask`] bound of the tile, as bounds
/// never decrease), the last sits at `last_query`; the keys span `first_key ..= last_key`.
/// The tile is skipped when every key lies after the last query (causality) or before the
/// first query's first visible key (documents, window). On the kernels' aligned square
/// tiles this is exact (a tile kept holds a visible key); on other tiles it errs towards
/// computing, and the per-row ranges mask the rest. Both the host kernels and the device
/// kernels decide with this rule (the device ones per query row, a tile of one).
pub fn key_tile_masked(
    first_query_first_key: usize,
    last_query: usize,
    first_key: usize,
    last_key: usize,
) -> bool {
    first_key > last_query || last_key < first_query_first_key
}
