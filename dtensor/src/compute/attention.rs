//! `causal_attention`: fused causal self-attention over a rank's whole samples
//! and heads, with its tape twin, which records the output and log-sum-exp the forward's
//! kernel saved; `causal_attention_masked` narrows the mask to packed documents and a
//! sliding window ([`AttentionMask`](ops::AttentionMask)). Context-parallel attention is in
//! [`context`](crate::context).
//!
//! A mask's document ids are the *global* tensor's, one per token in its row order; each
//! rank reads those of its own rows, so every rank passes the same ids.

use super::{describe, local_range, output, shape_err, want_rank};
use crate::any::AnyDTensor;
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::ops::{self, AttentionMask, CausalAttention, CausalAttentionOutput};
use dtensor_kernels::Tensor;
use dtensor_placement::{AttentionLayout, Layout};

impl<L: Layout> DTensor<L> {
    /// Fused causal self-attention over a `[tokens, heads·3·d]` QKV (per head: q, k, v
    /// columns together, q and k already rotated, e.g. by [`rope`](Self::rope) with
    /// [`Rope::on_fused_qkv`](ops::Rope::on_fused_qkv); tokens are samples of `cfg.seq_len`
    /// one after another) into
    /// `[tokens, heads·d]`, laid out as the input: a rank holds whole samples and whole heads
    /// (both checked here), so the attention is local.
    pub fn causal_attention(&self, cfg: &CausalAttention) -> Result<DTensor<L>>
    where
        L: AttentionLayout,
    {
        Ok(attention_parts(self, cfg, &LocalMask::causal())?.0)
    }

    /// [`causal_attention`](Self::causal_attention) under `mask`: packed documents (ids of
    /// the global tokens, one per row of the global tensor, in its row order) and/or a
    /// sliding window (see [`AttentionMask`]). `Err` (naming the op, shapes and placements)
    /// as `causal_attention`, and when the ids are not one per global token or the window
    /// is 0.
    pub fn causal_attention_masked(
        &self,
        cfg: &CausalAttention,
        mask: &AttentionMask<'_>,
    ) -> Result<DTensor<L>>
    where
        L: AttentionLayout,
    {
        let local = LocalMask::of_rows(OP_MASKED, self.as_any(), mask, 0)?;
        Ok(attention_parts(self, cfg, &local)?.0)
    }
}

impl<L: Layout> DTensor<L> {
    /// Generation's attention over a KV cache: the queries of this fused QKV (one
    /// sample's new rows, q and k already rotated, at positions `cfg.q_pos`) attend to
    /// `cache`, this rank's keys and values of the same sample so far (its KV heads,
    /// packed as [`ops::pack_kv`] packs them, at positions `cfg.k_pos`), under `cfg.mask`.
    /// The output `[rows, heads·d]` is laid out as the input, by the rule of
    /// [`causal_attention`](Self::causal_attention) (whole heads per rank). Inference only:
    /// there is no tape twin. `Err` (naming the op, shapes and placements) unless the
    /// columns are whole KV groups and the kernel accepts the positions and the cache.
    pub fn attention_over_cache(
        &self,
        cache: &Tensor,
        cfg: &ops::BlockAttention<'_>,
    ) -> Result<DTensor<L>>
    where
        L: AttentionLayout,
    {
        const OP: &str = "DTensor::attention_over_cache";
        let a = self.as_any();
        want_rank(OP, a, 2, "the QKV")?;
        let cols = a.local_shape()[1];
        let group = (cfg.q_per_kv + 2) * cfg.head_dim;
        if cfg.q_per_kv == 0 || cfg.head_dim == 0 || !cols.is_multiple_of(group) {
            return Err(shape_err(
                OP,
                format!(
                    "{}: {cols} columns are not whole KV groups of ({}+2)·{} columns",
                    describe(a),
                    cfg.q_per_kv,
                    cfg.head_dim
                ),
            ));
        }
        let local = a.as_local();
        let out = ops::attention_block(local, cache, cfg)?
            .out
            .try_to_dtype(local.dtype())?;
        let global = [
            a.global_shape()[0],
            a.global_shape()[1] / group * cfg.q_per_kv * cfg.head_dim,
        ];
        output(OP, out, &global, a)
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::causal_attention`]: the kernel's backward recomputes the probabilities
    /// from the saved log-sum-exp.
    pub fn causal_attention(&self, cfg: &CausalAttention) -> Result<Var<'t, L>>
    where
        L: AttentionLayout,
    {
        self.attention_node(cfg, LocalMask::causal())
    }

    /// [`DTensor::causal_attention_masked`]: the node keeps this rank's share of the
    /// document ids for the backward.
    pub fn causal_attention_masked(
        &self,
        cfg: &CausalAttention,
        mask: &AttentionMask<'_>,
    ) -> Result<Var<'t, L>>
    where
        L: AttentionLayout,
    {
        let local = LocalMask::of_rows(OP_MASKED, self.value().as_any(), mask, 0)?;
        self.attention_node(cfg, local)
    }

    fn attention_node(&self, cfg: &CausalAttention, mask: LocalMask) -> Result<Var<'t, L>>
    where
        L: AttentionLayout,
    {
        let (y, saved) = attention_parts(self.value(), cfg, &mask)?;
        let (xv, cfg) = (self.value().as_any().clone(), *cfg);
        Ok(self.unary(y, false, move |dy| {
            let dx = mask.backward(dy.as_local(), xv.as_local(), &saved, &cfg)?;
            grad_of("Var::causal_attention", dx, &xv)
        }))
    }
}

const OP_MASKED: &str = "DTensor::causal_attention_masked";

/// A mask with this rank's share of the document ids, owned (a tape node keeps it for the
/// backward).
#[derive(Clone, Debug, Default)]
pub(crate) struct LocalMask {
    documents: Option<Vec<u32>>,
    window: Option<usize>,
}

impl LocalMask {
    pub(crate) fn causal() -> LocalMask {
        LocalMask::default()
    }

    /// `mask` with the ids of the global rows `rows` (of `tokens` global rows); `Err`
    /// (naming `op` and the tensor `t`) unless there is one id per global row and the
    /// window is at least 1.
    pub(crate) fn of_range(
        op: &'static str,
        t: &AnyDTensor,
        mask: &AttentionMask<'_>,
        rows: std::ops::Range<usize>,
        tokens: usize,
    ) -> Result<LocalMask> {
        if mask.window == Some(0) {
            return Err(shape_err(
                op,
                format!(
                    "the sliding window of the {} must be at least 1 key (the query itself)",
                    describe(t)
                ),
            ));
        }
        let documents = match mask.documents {
            None => None,
            Some(ids) if ids.len() == tokens => Some(ids[rows].to_vec()),
            Some(ids) => {
                return Err(shape_err(
                    op,
                    format!(
                    "{} document ids for the {tokens} global tokens of the {}: want one per token",
                    ids.len(),
                    describe(t)
                ),
                ))
            }
        };
        Ok(LocalMask {
            documents,
            window: mask.window,
        })
    }

    /// `mask` with the ids of `t`'s own rows along `dim`.
    fn of_rows(
        op: &'static str,
        t: &AnyDTensor,
        mask: &AttentionMask<'_>,
        dim: usize,
    ) -> Result<LocalMask> {
        want_rank(op, t, 2, "the QKV")?;
        LocalMask::of_range(op, t, mask, local_range(t, dim)?, t.global_shape()[dim])
    }

    pub(crate) fn as_mask(&self) -> AttentionMask<'_> {
        AttentionMask {
            documents: self.documents.as_deref(),
            window: self.window,
        }
    }

    /// The local kernel under this mask (the plain kernel, its errors naming it, without
    /// one).
    pub(crate) fn forward(
        &self,
        qkv: &Tensor,
        cfg: &CausalAttention,
    ) -> Result<CausalAttentionOutput> {
        let mask = self.as_mask();
        Ok(if mask.is_causal() {
            ops::causal_attention(qkv, cfg)?
        } else {
            ops::causal_attention_masked(qkv, cfg, &mask)?
        })
    }

    /// The backward of [`forward`](Self::forward).
    pub(crate) fn backward(
        &self,
        dout: &Tensor,
        qkv: &Tensor,
        saved: &CausalAttentionOutput,
        cfg: &CausalAttention,
    ) -> Result<Tensor> {
        let mask = self.as_mask();
        let (out, lse) = (&saved.out, &saved.lse);
        Ok(if mask.is_causal() {
            ops::causal_attention_backward(dout, qkv, out, lse, cfg)?
        } else {
            ops::causal_attention_masked_backward(dout, qkv, out, lse, cfg, &mask)?
        })
    }
}

/// Attention's forward with the kernel's saved statistics (the output and the per-row
/// log-sum-exp its backward needs).
fn attention_parts<L: Layout>(
    x: &DTensor<L>,
    cfg: &CausalAttention,
    mask: &LocalMask,
) -> Result<(DTensor<L>, CausalAttentionOutput)> {
    const OP: &str = "DTensor::causal_attention";
    let a = x.as_any();
    want_rank(OP, a, 2, "the QKV")?;
    let (rows, cols) = (a.local_shape()[0], a.local_shape()[1]);
    let (g, group) = (cfg.q_per_kv, cfg.group_cols().unwrap_or(0));
    if cfg.seq_len == 0 || rows % cfg.seq_len != 0 || g == 0 || group == 0 || cols % group != 0 {
        return Err(shape_err(
            OP,
            format!(
                "{}: this rank's {rows} tokens × {cols} columns are not whole samples of {} tokens and whole KV groups of ({g}+2)·{} columns (make the batch divisible by the data ranks, the KV heads by the tensor ranks)",
                describe(a),
                cfg.seq_len,
                cfg.head_dim
            ),
        ));
    }
    let saved = mask.forward(a.as_local(), cfg)?;
    let global = [
        a.global_shape()[0],
        a.global_shape()[1] / group * g * cfg.head_dim,
    ];
    let y = output(OP, saved.out.clone(), &global, a)?;
    Ok((y, saved))
}
