//! `causal_attention`: fused causal self-attention over a rank's whole samples
//! and heads, with its tape twin, which records the output and log-sum-exp the forward's
//! kernel saved. Context-parallel attention is in [`context`](crate::context).

use super::{describe, output, shape_err, want_rank};
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::ops::{self, CausalAttention, CausalAttentionOutput};
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
        Ok(attention_parts(self, cfg)?.0)
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::causal_attention`]: the kernel's backward recomputes the probabilities
    /// from the saved log-sum-exp.
    pub fn causal_attention(&self, cfg: &CausalAttention) -> Result<Var<'t, L>>
    where
        L: AttentionLayout,
    {
        let (y, saved) = attention_parts(self.value(), cfg)?;
        let (xv, cfg) = (self.value().as_any().clone(), *cfg);
        Ok(self.unary(y, false, move |dy| {
            let dx = ops::causal_attention_backward(
                dy.as_local(),
                xv.as_local(),
                &saved.out,
                &saved.lse,
                &cfg,
            )?;
            grad_of("Var::causal_attention", dx, &xv)
        }))
    }
}

/// Attention's forward with the kernel's saved statistics (the output and the per-row
/// log-sum-exp its backward needs).
fn attention_parts<L: Layout>(
    x: &DTensor<L>,
    cfg: &CausalAttention,
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
    let saved = ops::causal_attention(a.as_local(), cfg)?;
    let global = [
        a.global_shape()[0],
        a.global_shape()[1] / group * g * cfg.head_dim,
    ];
    let y = output(OP, saved.out.clone(), &global, a)?;
    Ok((y, saved))
}
