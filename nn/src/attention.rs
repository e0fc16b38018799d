//! Causal multi-head self-attention with its heads split over `Tp` (Megatron's layout):
//! a column-parallel fused QKV projection (each rank holds whole heads, their q, k and v
//! rows together), local attention with rotary position embeddings, and a row-parallel
//! output projection. With SP the QKV entry all-gathers the tokens and the output leaves
//! with a reduce-scatter; without SP, `to_replicate` and `all_reduce`.
//!
//! Grouped-query attention (Megatron's layout): the fused weight `[(heads +
//! 2·kv_heads)·d, hidden]` stores its rows group by group, a group being one KV head and
//! the `g = heads / kv_heads` query heads it serves: for group `j`, its `g` q heads (`g·d`
//! rows), then its k head (`d`), then its v head (`d`). With `kv_heads = heads` (`g = 1`)
//! that is head by head, q, k, v. `Shard<0>` over `Tp` therefore gives rank `r` groups
//! `r·kv_heads/tp ..`, complete (so `tp` must divide `kv_heads`).
//!
//! Positions: the q and k heads of the fused QKV are rotated by the RoPE op
//! ([`Var::rope`] with [`Rope::on_fused_qkv`]) before the attention, in the pairs
//! [`rope_style`](AttentionConfig::rope_style) names (interleaved `(x[2i], x[2i+1])` by
//! default, or half-split `(x[i], x[i + d/2])` as Hugging Face checkpoints store q and k)
//! with base [`rope_base`](AttentionConfig::rope_base), each token at its position in its sample
//! (under `Cp`, its true position in the CP order: [`RopePositions::ContextParallel`]).
//!
//! The attention itself is the typed op [`Var::context_attention`] over `Cp`, laid out
//! [`ColOut`](crate::ColOut) in and out (samples whole over `Dp` and `Ep`, heads whole over
//! `Tp`, the sequence `Shard<0>` over `Cp`). At `cp = 1` it is the fused causal kernel (a
//! blocked kernel with an online softmax, `dtensor_kernels::ops::causal_attention`); with
//! `cp > 1` it runs as [`ContextParallel`] says: ring attention (K/V blocks passed round
//! the `Cp` ring) or all-to-all (Ulysses: heads gathered per rank for the whole sequence).
//! The plain [`Var::causal_attention`] does not compile here: its rule refuses a sequence
//! sharded over a `Cp` axis. The tokens of a `Cp`-sharded stream are in the CP order
//! ([`CpLayout`]): the data loader permutes ids and targets into it.

use crate::data::{DataMode, Ddp};
use crate::init::ParamInit;
use crate::linear::{ColumnParallelLinear, RowParallelLinear};
use crate::params::{join_name, Module, ParamVisitor};
use crate::seq::{axis_size, SeqMode, Stream};
use dtensor_core::{
    ContextAttention, CpLayout, CpStrategy, DeviceMesh, Error, Result, RopePositions, Tape, Var,
};
use dtensor_kernels::ops::{CausalAttention, Rope, RopeStyle};
use dtensor_kernels::Tensor;
use dtensor_placement::{AxisKind, Cp};
use std::sync::Arc;

/// Shape of an attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionConfig {
    /// Model width: features per token, `heads · head_dim`.
    pub hidden: usize,
    /// Query heads over all `Tp` ranks (each rank holds `heads / tp` whole heads).
    pub heads: usize,
    /// Key/value heads (grouped-query attention: each serves `heads / kv_heads`
    /// consecutive query heads; `heads` is multi-head attention, 1 multi-query). Over
    /// `Tp` each rank holds `kv_heads / tp` whole groups.
    pub kv_heads: usize,
    /// Tokens per sample: the stream's rows are samples of this many tokens, one after
    /// another.
    pub seq_len: usize,
    /// RoPE's base (10000 in most models).
    pub rope_base: f64,
    /// Which columns of a head RoPE pairs: [`RopeStyle::Interleaved`] (`(x[2i], x[2i+1])`,
    /// this GPT's default) or [`RopeStyle::HalfSplit`] (`(x[i], x[i + d/2])`, the Hugging
    /// Face layout of Llama, Mistral and Qwen checkpoints).
    pub rope_style: RopeStyle,
    /// How attention runs over `Cp` (unused at `cp = 1`).
    pub context: ContextParallel,
}

/// Context parallelism's choices for attention over `Cp`.
///
/// Ring attention works for any head count and hides each K/V transfer behind a block's
/// compute (forward: `2·d·heads·(cp−1)` elements sent per token and layer; backward twice
/// that plus the dK/dV trip home). All-to-all (Ulysses) moves `4·d·heads·(cp−1)/cp` each
/// way, less from `cp ≈ 3` on, but needs the heads per `Tp` rank divisible by `cp` and
/// cannot overlap its transfers. Zigzag chunks balance the causal work across `Cp` ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextParallel {
    /// Ring attention (K/V passed round the `Cp` ring) or all-to-all (Ulysses).
    pub strategy: CpStrategy,
    /// Rank `c` holds chunks `c` and `2·cp−1−c` of `2·cp` (load-balanced); otherwise
    /// chunk `c` of `cp`.
    pub zigzag: bool,
}

impl Default for ContextParallel {
    /// Ring attention over zigzag chunks.
    fn default() -> Self {
        ContextParallel {
            strategy: CpStrategy::Ring,
            zigzag: true,
        }
    }
}

impl AttentionConfig {
    /// Features per head, `hidden / heads` (checked to divide evenly by [`check`](Self::check)).
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Query heads per KV head.
    pub fn q_per_kv(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Rows of the fused QKV projection: `(heads + 2·kv_heads)·head_dim`.
    pub fn qkv_rows(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim()
    }

    /// `Err` unless the heads divide the hidden size (into an even head dim), the KV heads
    /// divide the query heads, and `tp` divides the KV heads (each rank holds whole
    /// groups: a KV head and its query heads).
    pub fn check(&self, tp: usize) -> Result<()> {
        let bad = |detail: String| Error::ShapeMismatch {
            op: "ParallelAttention",
            detail,
        };
        if self.heads == 0
            || !self.hidden.is_multiple_of(self.heads)
            || !self.head_dim().is_multiple_of(2)
        {
            return Err(bad(format!(
                "hidden {} must split into {} heads of an even dimension",
                self.hidden, self.heads
            )));
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(bad(format!(
                "{} KV heads do not divide the {} query heads",
                self.kv_heads, self.heads
            )));
        }
        if !self.kv_heads.is_multiple_of(tp) {
            return Err(bad(format!(
                "{} KV heads are not divisible by tp={tp} (each tensor rank holds whole groups of a KV head and its {} query heads)",
                self.kv_heads,
                self.q_per_kv()
            )));
        }
        Ok(())
    }
}

/// Natural-order per-token data `[tokens, ...]` (token ids, targets: samples of `seq_len`
/// tokens one after another) in the order a model's stream on `mesh` holds it: with
/// `cp > 1` the CP order of [`CpLayout`] (each data rank's block
/// of samples chunk-major, so that `Shard<0>` over `Cp` gives every `Cp` rank its chunks of
/// every sample), unchanged at `cp = 1`. Apply it to the global batch before slicing.
pub fn to_stream_order(
    t: &Tensor,
    seq_len: usize,
    context: &ContextParallel,
    mesh: &DeviceMesh,
) -> Result<Tensor> {
    match stream_order(seq_len, context, mesh)? {
        Some((layout, blocks)) => layout.to_cp_order(t, blocks),
        None => Ok(t.clone()),
    }
}

/// The inverse of [`to_stream_order`]: a stream-ordered gathered tensor back in natural
/// token order.
pub fn from_stream_order(
    t: &Tensor,
    seq_len: usize,
    context: &ContextParallel,
    mesh: &DeviceMesh,
) -> Result<Tensor> {
    match stream_order(seq_len, context, mesh)? {
        Some((layout, blocks)) => layout.from_cp_order(t, blocks),
        None => Ok(t.clone()),
    }
}

/// The CP layout and the number of data blocks (`dp·ep`), or `None` at `cp = 1`.
fn stream_order(
    seq_len: usize,
    context: &ContextParallel,
    mesh: &DeviceMesh,
) -> Result<Option<(CpLayout, usize)>> {
    let cp = axis_size(mesh, AxisKind::Cp);
    if cp == 1 {
        return Ok(None);
    }
    let blocks = axis_size(mesh, AxisKind::Dp) * axis_size(mesh, AxisKind::Ep);
    Ok(Some((CpLayout::new(seq_len, cp, context.zigzag)?, blocks)))
}

/// Causal self-attention, heads split over `Tp`.
#[derive(Clone)]
pub struct ParallelAttention<M: SeqMode, D: DataMode = Ddp> {
    /// The fused QKV projection `[(heads + 2·kv_heads)·head_dim, hidden]`, column-parallel:
    /// whole KV groups per `Tp` rank, rows stored group by group (see the module docs).
    pub qkv: ColumnParallelLinear<D>,
    /// The output projection `[hidden, hidden]`, row-parallel: its `Partial` product is
    /// reduced back into the stream.
    pub out: RowParallelLinear<M, D>,
    /// The layer's shape and its context-parallel choices.
    pub config: AttentionConfig,
}

impl<M: SeqMode, D: DataMode> ParallelAttention<M, D> {
    /// Parameter ids `init.id` (QKV weight), `+1` (its bias), `+2` (output weight), `+3`
    /// (its bias). The output projection is drawn with `out_std`.
    pub fn new(
        config: AttentionConfig,
        bias: bool,
        init: ParamInit,
        out_std: f64,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        config.check(axis_size(mesh, AxisKind::Tp))?;
        let h = config.hidden;
        let qkv = ColumnParallelLinear::new(h, config.qkv_rows(), bias, init, mesh)?;
        let out_init = ParamInit {
            std: out_std,
            ..init.with_id(init.id + 2)
        };
        let out = RowParallelLinear::new(h, h, bias, out_init, mesh)?;
        Ok(ParallelAttention { qkv, out, config })
    }

    /// Starts gathering the parameters over `Dp` (FSDP's prefetch; nothing otherwise).
    pub fn prefetch(&self) -> Result<()> {
        self.qkv.prefetch()?;
        self.out.prefetch()
    }

    /// Attention over the stream `x` (`[tokens, hidden]`, samples of `seq_len` tokens one
    /// after another). Enters with `to_replicate` (`all_gather` of the tokens under SP),
    /// leaves with `all_reduce` (`reduce_scatter` under SP); with `cp > 1` the attention
    /// itself passes K/V round the `Cp` ring or all-to-alls the heads. `Err` if the tokens
    /// do not cut into whole samples or the collectives fail.
    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
    ) -> Result<Var<'t, Stream<M>>> {
        let qkv = self.qkv.forward::<M>(tape, x)?;
        let (seq_len, d) = (self.config.seq_len, self.config.head_dim());
        let positions =
            match stream_order(seq_len, &self.config.context, qkv.value().device_mesh())? {
                Some((layout, blocks)) => RopePositions::ContextParallel {
                    layout,
                    blocks,
                    offset: 0,
                },
                None => RopePositions::sequential(seq_len),
            };
        let g = self.config.q_per_kv();
        let rope = Rope::new(d, self.config.rope_base, self.config.rope_style).on_fused_qkv(g);
        let qkv = qkv.rope(&rope, &positions)?;
        let cfg = ContextAttention {
            attn: CausalAttention {
                seq_len,
                head_dim: d,
                q_per_kv: g,
                scale: None,
            },
            zigzag: self.config.context.zigzag,
            strategy: self.config.context.strategy,
        };
        // ColOut: whole heads over Tp, whole samples over Dp and Ep, the sequence over Cp.
        let o = qkv.context_attention(Cp, &cfg)?;
        self.out.forward(tape, &o)
    }
}

impl<M: SeqMode, D: DataMode> Module for ParallelAttention<M, D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        self.qkv.visit_params(&join_name(prefix, "qkv"), v)?;
        self.out.visit_params(&join_name(prefix, "out"), v)
    }
}
