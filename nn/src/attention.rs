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
//! With more `Tp` ranks than KV heads (down to multi-query attention, one KV head) ranks
//! share KV heads, Megatron's way: the q projection is split over `Tp` as above, the KV
//! projection is held whole on every rank, and each rank keeps the KV head its query heads
//! read, in one group of fused rows ([`SharedKvProjection`], which states what that costs).
//!
//! Positions: the q and k heads of the fused QKV are rotated by the RoPE op
//! ([`Var::rope`] with [`Rope::on_fused_qkv`]) before the attention, as
//! [`rope`](AttentionConfig::rope) says: the pairs (interleaved `(x[2i], x[2i+1])`, or
//! half-split `(x[i], x[i + r/2])` as Hugging Face checkpoints store q and k), the base,
//! the frequency scaling and the rotated leading columns of a head; each token at its
//! position in its sample (under `Cp`, its true position in the CP order:
//! [`RopePositions::ContextParallel`]). With [`qk_norm`](AttentionConfig::qk_norm) every q
//! and k head is RMS-normalised over its columns first ([`QkNorm`]).
//!
//! | setting | what it means | Hugging Face architectures |
//! |---|---|---|
//! | [`kv_heads`](AttentionConfig::kv_heads) | grouped-query (or multi-query, 1) attention | Llama 2 70B, Llama 3, Mistral, Qwen2 (GQA); Falcon 7B (MQA) |
//! | [`head_dim`](AttentionConfig::head_dim) | head width apart from `hidden / heads` | Gemma, Qwen3, Mistral Nemo |
//! | [`scale`](AttentionConfig::scale) | softmax scale other than `1/√head_dim` | Gemma 2 (`query_pre_attn_scalar`), Granite |
//! | [`rope`](AttentionConfig::rope) | base, pairing, scaling, rotary dim | Llama 3.1 (llama3 scaling), Qwen2.5 long-context (YaRN), Phi-2 / StableLM (partial rotary) |
//! | [`qkv_bias`](AttentionConfig::qkv_bias), [`out_bias`](AttentionConfig::out_bias) | biases on q, k, v and on the output, separately | Qwen2 (q, k, v only); GPT-2 (both) |
//! | [`qk_norm`](AttentionConfig::qk_norm) | per-head RMSNorm of q and k before RoPE | Qwen3, Gemma 3 |
//!
//! The attention itself is the typed op [`Var::context_attention`] over `Cp`, laid out
//! [`ColOut`] in and out (samples whole over `Dp` and `Ep`, heads whole over
//! `Tp`, the sequence `Shard<0>` over `Cp`). At `cp = 1` it is the fused causal kernel (a
//! blocked kernel with an online softmax, `dtensor_kernels::ops::causal_attention`); with
//! `cp > 1` it runs as [`ContextParallel`] says: ring attention (K/V blocks passed round
//! the `Cp` ring) or all-to-all (Ulysses: heads gathered per rank for the whole sequence).
//! The plain [`Var::causal_attention`] does not compile here: its rule refuses a sequence
//! sharded over a `Cp` axis. The tokens of a `Cp`-sharded stream are in the CP order
//! ([`CpLayout`]): the data loader permutes ids and targets into it.

use crate::data::{ColW, ComputeOf, DataMode, Ddp, MasterLayout, TpSharedW};
use crate::init::{Init, ParamInit};
use crate::linear::{ColumnParallelLinear, RowParallelLinear};
use crate::params::{join_name, Module, ParamVisitor, Weight};
use crate::seq::{axis_size, ColOut, Full, SeqMode, Stream};
use dtensor_core::{
    ContextAttention, CpLayout, CpStrategy, DTensor, DeviceMesh, Error, Result, RopePositions,
    Tape, Var,
};
use dtensor_kernels::ops::{
    self, AttentionMask, BlockAttention, CausalAttention, Rope, RopeScaling, RopeStyle,
};
use dtensor_kernels::Tensor;
use dtensor_placement::{AxisKind, Cp, Tp};
use std::sync::Arc;

/// Shape and options of an attention layer. [`AttentionConfig::new`] gives multi-head
/// attention with whole-head RoPE (base 10000, no scaling), no biases and no q/k norm;
/// set the other fields on it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionConfig {
    /// Model width: features per token of the stream the layer reads and writes.
    pub hidden: usize,
    /// Query heads over all `Tp` ranks (each rank holds `heads / tp` whole heads).
    pub heads: usize,
    /// Key/value heads (grouped-query attention: each serves `heads / kv_heads`
    /// consecutive query heads; `heads` is multi-head attention, 1 multi-query). With
    /// `tp ≤ kv_heads` each `Tp` rank holds `kv_heads / tp` whole groups; with `tp >
    /// kv_heads` every rank holds the KV projection whole (see [`SharedKvProjection`]).
    pub kv_heads: usize,
    /// Features per head; `None` is `hidden / heads`. Any other value decouples the heads
    /// from the width (Gemma, Qwen3): q is `heads · head_dim` wide and the output
    /// projection maps `heads · head_dim` back to `hidden`.
    pub head_dim: Option<usize>,
    /// Tokens per sample: the stream's rows are samples of this many tokens, one after
    /// another.
    pub seq_len: usize,
    /// The softmax scale of `q·kᵀ`; `None` is `1/√head_dim`.
    pub scale: Option<f64>,
    /// Rotary position embedding of the q and k heads.
    pub rope: RopeSettings,
    /// A bias on the q, k and v projections (Qwen2 has one there and none on the output).
    pub qkv_bias: bool,
    /// A bias on the output projection.
    pub out_bias: bool,
    /// `Some(eps)`: RMSNorm over `head_dim` of every q and every k head before RoPE, one
    /// learned weight `[head_dim]` for all q heads and one for all k heads (Qwen3,
    /// Gemma 3); `eps` is added to the mean square.
    pub qk_norm: Option<f64>,
    /// `Some(w)`: a sliding window (Mistral): a query sees the `w` keys up to and
    /// including itself (key `j` for query `i` when `i − w < j ≤ i`, transformers'
    /// `sliding_window`); `None`: every earlier key of its sample.
    pub window: Option<usize>,
    /// How attention runs over `Cp` (unused at `cp = 1`).
    pub context: ContextParallel,
}

/// RoPE as an attention layer applies it: the kernels' [`Rope`] less what the layer knows
/// (the head dim and which heads of its fused QKV rows are rotated).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeSettings {
    /// The base `θ` (`rope_theta`; 10000 in most models).
    pub base: f64,
    /// Which columns of a head pair up: [`RopeStyle::Interleaved`] (`(x[2i], x[2i+1])`,
    /// this GPT's default) or [`RopeStyle::HalfSplit`] (`(x[i], x[i + r/2])`, the Hugging
    /// Face layout of Llama, Mistral and Qwen checkpoints).
    pub style: RopeStyle,
    /// How the frequencies are scaled for long contexts (transformers' `rope_scaling`).
    pub scaling: RopeScaling,
    /// The rotated leading columns of each head (even); `None` rotates the whole head.
    /// Less than the head is transformers' `partial_rotary_factor` (Phi, StableLM).
    pub rotary_dim: Option<usize>,
}

impl RopeSettings {
    /// Whole-head RoPE with base `base` in `style`'s pairs, without scaling.
    pub fn new(base: f64, style: RopeStyle) -> RopeSettings {
        RopeSettings {
            base,
            style,
            scaling: RopeScaling::None,
            rotary_dim: None,
        }
    }
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
    /// Multi-head attention (`kv_heads = heads`, `head_dim = hidden / heads`, scale
    /// `1/√head_dim`) with whole-head RoPE of base 10000 in `style`'s pairs, no biases,
    /// no q/k norm, and the default context parallelism.
    pub fn new(hidden: usize, heads: usize, seq_len: usize, style: RopeStyle) -> Self {
        AttentionConfig {
            hidden,
            heads,
            kv_heads: heads,
            head_dim: None,
            seq_len,
            scale: None,
            rope: RopeSettings::new(10000.0, style),
            qkv_bias: false,
            out_bias: false,
            qk_norm: None,
            window: None,
            context: ContextParallel::default(),
        }
    }

    /// The mask the layer's attention applies: causal, within the window if there is one.
    pub fn mask(&self) -> AttentionMask<'static> {
        AttentionMask {
            window: self.window,
            ..AttentionMask::CAUSAL
        }
    }

    /// Features per head: [`head_dim`](Self::head_dim) when set, else `hidden / heads`
    /// (checked to divide evenly by [`check`](Self::check)).
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden / self.heads.max(1))
    }

    /// Query heads per KV head.
    pub fn q_per_kv(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// Width of the attention's output, the input of the output projection: `heads ·
    /// head_dim`.
    pub fn attn_width(&self) -> usize {
        self.heads * self.head_dim()
    }

    /// Rows of the fused QKV projection: `(heads + 2·kv_heads)·head_dim`.
    pub fn qkv_rows(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim()
    }

    /// The rotated leading columns of each head.
    pub fn rotary_dim(&self) -> usize {
        self.rope.rotary_dim.unwrap_or(self.head_dim())
    }

    /// Whether `tp` ranks hold the KV projection whole ([`SharedKvProjection`]): more
    /// ranks than KV heads.
    pub fn shares_kv(&self, tp: usize) -> bool {
        tp > self.kv_heads
    }

    /// The kernels' RoPE of this layer's fused QKV rows on one `Tp` rank of `tp`.
    pub fn rope_on(&self, tp: usize) -> Rope {
        Rope {
            rotary_dim: self.rotary_dim(),
            scaling: self.rope.scaling,
            ..Rope::new(self.head_dim(), self.rope.base, self.rope.style)
        }
        .on_fused_qkv(self.local_q_per_kv(tp))
    }

    /// Query heads per KV head in one `Tp` rank's fused rows: the group's `q_per_kv` when
    /// ranks hold whole groups, the rank's `heads / tp` when ranks share a KV head.
    pub fn local_q_per_kv(&self, tp: usize) -> usize {
        if self.shares_kv(tp) {
            self.heads / tp
        } else {
            self.q_per_kv()
        }
    }

    /// `Err` unless the heads have a nonzero dim (`hidden / heads` when not set, which
    /// must divide evenly), RoPE rotates an even number of a head's columns, the KV heads
    /// divide the query heads, and over `tp` ranks either `tp` divides the KV heads (each
    /// rank holds whole groups: a KV head and its query heads) or the KV heads divide
    /// `tp` and `tp` divides the query heads (each rank holds whole query heads of one
    /// group, and that group's KV head).
    pub fn check(&self, tp: usize) -> Result<()> {
        let bad = |detail: String| Error::ShapeMismatch {
            op: "ParallelAttention",
            detail,
        };
        if self.window == Some(0) {
            return Err(bad(
                "a sliding window of 0 keys (a query sees at least itself)".into(),
            ));
        }
        if self.heads == 0 || (self.head_dim.is_none() && !self.hidden.is_multiple_of(self.heads)) {
            return Err(bad(format!(
                "hidden {} does not split into {} heads (set head_dim to decouple them)",
                self.hidden, self.heads
            )));
        }
        let (d, r) = (self.head_dim(), self.rotary_dim());
        if d == 0 || r == 0 || !r.is_multiple_of(2) || r > d {
            return Err(bad(format!(
                "RoPE rotates {r} columns of heads of {d}: it needs an even number, at least 2 and at most the head dim"
            )));
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return Err(bad(format!(
                "{} KV heads do not divide the {} query heads",
                self.kv_heads, self.heads
            )));
        }
        if self.scale.is_some_and(|s| !s.is_finite()) {
            return Err(bad(format!("softmax scale {:?} is not finite", self.scale)));
        }
        if self.qk_norm.is_some_and(|e| !(e.is_finite() && e >= 0.0)) {
            return Err(bad(format!(
                "q/k norm epsilon {:?} must be finite and >= 0",
                self.qk_norm
            )));
        }
        if self.shares_kv(tp) {
            if !tp.is_multiple_of(self.kv_heads) || !self.heads.is_multiple_of(tp) {
                return Err(bad(format!(
                    "tp={tp} exceeds the {} KV heads: it must be a multiple of them and divide the {} query heads (each tensor rank holds whole query heads of one group)",
                    self.kv_heads, self.heads
                )));
            }
        } else if !self.kv_heads.is_multiple_of(tp) {
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
    /// The QKV projection: one fused column-parallel weight when each `Tp` rank holds
    /// whole KV groups, a sharded q and a replicated KV weight when ranks share KV heads.
    pub qkv: QkvProjection<D>,
    /// The q/k RMSNorm weights, when [`AttentionConfig::qk_norm`] is set.
    pub qk_norm: Option<QkNorm<D>>,
    /// The output projection `[hidden, heads·head_dim]`, row-parallel: its `Partial`
    /// product is reduced back into the stream.
    pub out: RowParallelLinear<M, D>,
    /// The layer's shape and its context-parallel choices.
    pub config: AttentionConfig,
}

/// The projection of the stream to the fused QKV rows each `Tp` rank attends over: per
/// KV group of the rank, its query heads, then its k head, then its v head.
// One per layer, built once: boxing a variant would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
pub enum QkvProjection<D: DataMode = Ddp> {
    /// `tp` divides the KV heads: the weight `[(heads + 2·kv_heads)·head_dim, hidden]`,
    /// rows group by group (see the module docs), column-parallel, so that each rank's
    /// rows are whole groups.
    Fused(ColumnParallelLinear<D>),
    /// `tp` exceeds the KV heads: ranks share KV heads (see [`SharedKvProjection`]).
    SharedKv(SharedKvProjection<D>),
}

/// The QKV projection when `tp` exceeds the KV heads (down to multi-query attention),
/// Megatron's way: the query heads are split over `Tp` as usual, and every rank reads the
/// KV head of its query heads' group, so the ranks of one group hold its KV weights alike.
///
/// The KV weight `[2·kv_heads·head_dim, hidden]` (per KV head its k rows, then its v rows)
/// is stored `Replicate` over `Tp`. In the forward each rank repeats it per group to `tp`
/// KV heads (`repeat_interleave`) and keeps its own (`chunk`, `Replicate → Shard<0>`, no
/// communication), then joins it under its q rows into one group of fused rows (`heads /
/// tp` q heads, a k head, a v head), multiplied like the fused projection. The tape's
/// backward of those steps zero-pads and sums, so the KV weight's gradient comes back
/// `Partial` over `Tp` and the optimizer takes it only after an all-reduce over `Tp`
/// ([`TpSharedW`]): the ranks of a group add their terms, the others add zeros, and every
/// replica steps with the same bits.
///
/// What it costs against whole groups per rank: every `Tp` rank stores the whole KV
/// projection, `2·kv_heads·head_dim·hidden` elements (and their gradient and optimizer
/// state) instead of `2·head_dim·hidden` per KV head it reads; with the bias,
/// `2·kv_heads·head_dim` more. Each step's gradient all-reduce over `Tp` moves those
/// `2·kv_heads·head_dim·(hidden + 1)` elements (a ring sends `2·(tp−1)/tp` times the
/// bytes per rank), where Megatron reduces `2·head_dim·hidden` over the `tp / kv_heads`
/// ranks of a group. The forward computes only the rank's own k and v (`2·head_dim`
/// columns per token).
#[derive(Clone)]
pub struct SharedKvProjection<D: DataMode = Ddp> {
    /// The query projection `[heads·head_dim, hidden]`, column-parallel (`heads / tp`
    /// whole heads per rank), with its bias when [`AttentionConfig::qkv_bias`] is set.
    pub q: ColumnParallelLinear<D>,
    /// The KV projection `[2·kv_heads·head_dim, hidden]`, `Replicate` over `Tp`.
    pub kv_weight: Weight<D, TpSharedW>,
    /// The KV bias `[2·kv_heads·head_dim]`, `Replicate` over `Tp`.
    pub kv_bias: Option<Weight<D, TpSharedW>>,
    /// q rows per rank (`heads / tp · head_dim`), KV rows per KV head (`2·head_dim`), and
    /// the ranks sharing a KV head (`tp / kv_heads`).
    q_rows: usize,
    kv_rows: usize,
    ranks_per_kv: usize,
}

/// The weights of the per-head q and k RMSNorms (Qwen3): `[head_dim]` each, `Replicate`
/// over `Tp` (every rank applies them to its own heads, so their gradients are all-reduced
/// over `Tp`, [`TpSharedW`]), initialised to ones.
#[derive(Clone)]
pub struct QkNorm<D: DataMode = Ddp> {
    /// The scale of every q head.
    pub q: Weight<D, TpSharedW>,
    /// The scale of every k head.
    pub k: Weight<D, TpSharedW>,
    /// Added to the mean square before the square root.
    pub eps: f64,
}

impl<D: DataMode> QkvProjection<D> {
    /// The fused projection, when ranks hold whole groups.
    pub fn fused(&self) -> Option<&ColumnParallelLinear<D>> {
        match self {
            QkvProjection::Fused(l) => Some(l),
            QkvProjection::SharedKv(_) => None,
        }
    }

    /// The q and shared KV projections, when ranks share KV heads.
    pub fn shared_kv(&self) -> Option<&SharedKvProjection<D>> {
        match self {
            QkvProjection::Fused(_) => None,
            QkvProjection::SharedKv(s) => Some(s),
        }
    }

    /// Starts gathering the parameters over `Dp` (FSDP's prefetch; nothing otherwise).
    fn prefetch(&self) -> Result<()> {
        match self {
            QkvProjection::Fused(l) => l.prefetch(),
            QkvProjection::SharedKv(s) => {
                s.q.prefetch()?;
                s.kv_weight.prefetch()?;
                s.kv_bias.as_ref().map_or(Ok(()), |b| b.prefetch())
            }
        }
    }

    /// This rank's fused QKV rows for the tokens `x`, replicated over `Tp`.
    fn forward_full<'t>(&self, tape: &'t Tape, x: &Var<'t, Full>) -> Result<Var<'t, ColOut>> {
        match self {
            QkvProjection::Fused(l) => l.forward_full(tape, x),
            QkvProjection::SharedKv(s) => {
                let y = x.matmul_t(&s.fused(&s.q.weight.on(tape)?, &s.kv_weight.on(tape)?)?)?;
                match (&s.q.bias, &s.kv_bias) {
                    (Some(qb), Some(kvb)) => y.add_row(&s.fused(&qb.on(tape)?, &kvb.on(tape)?)?),
                    _ => Ok(y),
                }
            }
        }
    }
}

impl<D: DataMode> SharedKvProjection<D> {
    /// This rank's fused rows `[q rows; k rows; v rows]` (one group), `Shard<0>` over `Tp`,
    /// from the q rows (`Shard<0>`) and the whole KV rows (`Replicate`): a weight
    /// (`[rows, hidden]`) or a bias (`[rows]`). Local ops only; the backward zero-pads the
    /// rows other ranks keep and sums the copies.
    fn fused<'t>(
        &self,
        q: &Var<'t, ComputeOf<ColW>>,
        kv: &Var<'t, ComputeOf<TpSharedW>>,
    ) -> Result<Var<'t, ComputeOf<ColW>>> {
        let q = q.split_dim::<0>(self.q_rows)?;
        let kv = kv
            .split_dim::<0>(self.kv_rows)?
            .repeat_interleave::<0>(self.ranks_per_kv)?
            .chunk::<_, _, 0>(Tp)?;
        Var::cat::<1>(&[&q, &kv])?.merge_dims::<0>()
    }
}

impl<D: DataMode> QkNorm<D> {
    /// The fused rows `qkv` (`[tokens, groups·(g + 2)·head_dim]`, `g` query heads per
    /// group) with every q and k head RMS-normalised over its `head_dim` columns, the v
    /// heads unchanged.
    fn forward<'t>(
        &self,
        tape: &'t Tape,
        qkv: &Var<'t, ColOut>,
        head_dim: usize,
        g: usize,
    ) -> Result<Var<'t, ColOut>> {
        // [tokens, groups, g + 2, head_dim]: heads are whole on every rank, so the
        // per-head norm is a norm over the last dim with a replicated weight.
        let heads = qkv.split_dim::<1>(head_dim)?.split_dim::<1>(g + 2)?;
        let q = heads
            .narrow::<2>(0, g)?
            .rms_norm::<3, _>(&self.q.on(tape)?, self.eps)?;
        let k = heads
            .narrow::<2>(g, 1)?
            .rms_norm::<3, _>(&self.k.on(tape)?, self.eps)?;
        let v = heads.narrow::<2>(g + 1, 1)?;
        Var::cat::<2>(&[&q, &k, &v])?
            .merge_dims::<2>()?
            .merge_dims::<1>()
    }
}

impl<M: SeqMode, D: DataMode> ParallelAttention<M, D> {
    /// Parameter ids `init.id` (QKV weight), `+1` (its bias), `+2` (output weight), `+3`
    /// (its bias). The output projection is drawn with `out_std`. When ranks share KV
    /// heads the q and KV weights take their values from the fused weight of the same id
    /// (each element keeps its global index there), so the model is the same at every
    /// `tp`. The q/k norm weights are ones.
    pub fn new(
        config: AttentionConfig,
        init: ParamInit,
        out_std: f64,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let tp = axis_size(mesh, AxisKind::Tp);
        config.check(tp)?;
        let h = config.hidden;
        let qkv = if config.shares_kv(tp) {
            QkvProjection::SharedKv(SharedKvProjection::new(&config, tp, init, mesh)?)
        } else {
            QkvProjection::Fused(ColumnParallelLinear::new(
                h,
                config.qkv_rows(),
                config.qkv_bias,
                init,
                mesh,
            )?)
        };
        let qk_norm = match config.qk_norm {
            Some(eps) => {
                let ones = || -> Result<Weight<D, TpSharedW>> {
                    let w = DTensor::<MasterLayout<D, TpSharedW>>::from_global_fn(
                        &[config.head_dim()],
                        init.dtype,
                        mesh,
                        |_| 1.0,
                    )?;
                    Weight::new(w, init.precision)
                };
                Some(QkNorm {
                    q: ones()?,
                    k: ones()?,
                    eps,
                })
            }
            None => None,
        };
        let out_init = ParamInit {
            std: out_std,
            ..init.with_id(init.id + 2)
        };
        let out = RowParallelLinear::new(config.attn_width(), h, config.out_bias, out_init, mesh)?;
        Ok(ParallelAttention {
            qkv,
            qk_norm,
            out,
            config,
        })
    }

    /// Starts gathering the parameters over `Dp` (FSDP's prefetch; nothing otherwise).
    pub fn prefetch(&self) -> Result<()> {
        self.qkv.prefetch()?;
        if let Some(n) = &self.qk_norm {
            n.q.prefetch()?;
            n.k.prefetch()?;
        }
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
        let qkv = self.qkv.forward_full(tape, &M::enter(x)?)?;
        let mesh = qkv.value().device_mesh().clone();
        let tp = axis_size(&mesh, AxisKind::Tp);
        let (seq_len, d) = (self.config.seq_len, self.config.head_dim());
        let g = self.config.local_q_per_kv(tp);
        let qkv = match &self.qk_norm {
            Some(n) => n.forward(tape, &qkv, d, g)?,
            None => qkv,
        };
        let positions = match stream_order(seq_len, &self.config.context, &mesh)? {
            Some((layout, blocks)) => RopePositions::ContextParallel {
                layout,
                blocks,
                offset: 0,
            },
            None => RopePositions::sequential(seq_len),
        };
        let qkv = qkv.rope(&self.config.rope_on(tp), &positions)?;
        let cfg = ContextAttention {
            attn: CausalAttention {
                seq_len,
                head_dim: d,
                q_per_kv: g,
                scale: self.config.scale,
            },
            zigzag: self.config.context.zigzag,
            strategy: self.config.context.strategy,
        };
        // ColOut: whole heads over Tp, whole samples over Dp and Ep, the sequence over Cp.
        let o = match self.config.window {
            None => qkv.context_attention(Cp, &cfg)?,
            Some(_) => qkv.context_attention_masked(Cp, &cfg, &self.config.mask())?,
        };
        self.out.forward(tape, &o)
    }
    /// Attention of one sample's new tokens `x` (`[t, hidden]`, at positions `start..start
    /// + t`) to every token so far, for generation: the new keys and values (rotated, this
    /// rank's KV heads, packed as [`ops::pack_kv`] packs them) are appended to `cache`
    /// (`[start, …]` before, `[start + t, …]` after) and the queries attend over all of it
    /// with the causal mask. Inference only: the attention itself is not recorded on
    /// `tape` (no gradient flows through it). Needs a mesh whose data and context axes
    /// have size 1 (one sample; `Tp` splits the heads) and no sequence parallelism.
    pub fn forward_cached<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
        cache: &mut Option<Tensor>,
        start: usize,
    ) -> Result<Var<'t, Stream<M>>> {
        const OP: &str = "ParallelAttention::forward_cached";
        let qkv = self.qkv.forward_full(tape, &M::enter(x)?)?;
        let mesh = qkv.value().device_mesh().clone();
        for kind in [AxisKind::Dp, AxisKind::Ep, AxisKind::Cp] {
            if axis_size(&mesh, kind) != 1 {
                return Err(Error::InvalidUse {
                    op: OP,
                    detail: format!(
                        "generation runs one sample: the {kind:?} axis must have size 1, mesh {}",
                        mesh.mesh()
                    ),
                });
            }
        }
        let tp = axis_size(&mesh, AxisKind::Tp);
        let d = self.config.head_dim();
        let g = self.config.local_q_per_kv(tp);
        let qkv = match &self.qk_norm {
            Some(n) => n.forward(tape, &qkv, d, g)?,
            None => qkv,
        };
        let t = qkv.value().global_shape()[0];
        let positions = RopePositions::Sequential {
            seq_len: t,
            offset: start,
        };
        let qkv = qkv.rope(&self.config.rope_on(tp), &positions)?;
        let local = qkv.value().as_local();
        let fresh = ops::pack_kv(local, d, g)?;
        let kv = match cache.take() {
            None if start == 0 => fresh,
            Some(c) if c.shape()[0] == start => Tensor::cat(&[c, fresh], 0)?,
            other => {
                return Err(Error::InvalidUse {
                    op: OP,
                    detail: format!(
                        "the cache holds {} tokens, the new ones start at position {start}",
                        other.map_or(0, |c| c.shape()[0])
                    ),
                })
            }
        };
        let q_pos: Vec<usize> = (start..start + t).collect();
        let k_pos: Vec<usize> = (0..start + t).collect();
        let block = BlockAttention {
            head_dim: d,
            q_per_kv: g,
            scale: self.config.scale,
            q_pos: &q_pos,
            k_pos: &k_pos,
            mask: self.config.mask(),
        };
        // The rule keeps attention off a `Cp` axis that splits the sequence; with one
        // sample at cp = 1 the gather and the chunk back move nothing.
        let o = qkv
            .value()
            .clone()
            .all_gather(Cp)?
            .attention_over_cache(&kv, &block)?
            .chunk::<_, _, 0>(Cp)?;
        *cache = Some(kv);
        self.out.forward(tape, &tape.constant(o))
    }
}

impl<D: DataMode> SharedKvProjection<D> {
    /// The q and KV parameters of `config` over `tp > kv_heads` ranks, valued as the fused
    /// weight (id `init.id`) and bias (`+1`) would be, element by element.
    fn new(
        config: &AttentionConfig,
        tp: usize,
        init: ParamInit,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let (d, g, kv, h) = (
            config.head_dim(),
            config.q_per_kv(),
            config.kv_heads,
            config.hidden,
        );
        // Fused row of q row `r` (head r / d), and of KV row `r` (k, then v, per KV head).
        let group = (g + 2) * d;
        let q_row = move |r: usize| (r / d / g) * group + (r / d % g) * d + r % d;
        let kv_row = move |r: usize| (r / (2 * d)) * group + g * d + r % (2 * d);
        let weight = Init::Normal { std: init.std };
        let (seed, id) = (init.seed, init.id);
        let q_w = DTensor::<MasterLayout<D, ColW>>::from_global_fn(
            &[config.attn_width(), h],
            init.dtype,
            mesh,
            |i| weight.value(seed, id, (q_row(i / h) * h + i % h) as u64),
        )?;
        let kv_w = DTensor::<MasterLayout<D, TpSharedW>>::from_global_fn(
            &[2 * kv * d, h],
            init.dtype,
            mesh,
            |i| weight.value(seed, id, (kv_row(i / h) * h + i % h) as u64),
        )?;
        let (q_b, kv_b) = if config.qkv_bias {
            let bias = init.bias();
            let q_b = DTensor::<MasterLayout<D, crate::ColB>>::from_global_fn(
                &[config.attn_width()],
                init.dtype,
                mesh,
                |i| bias.value(seed, id + 1, q_row(i) as u64),
            )?;
            let kv_b = DTensor::<MasterLayout<D, TpSharedW>>::from_global_fn(
                &[2 * kv * d],
                init.dtype,
                mesh,
                |i| bias.value(seed, id + 1, kv_row(i) as u64),
            )?;
            (
                Some(Weight::new(q_b, init.precision)?),
                Some(Weight::new(kv_b, init.precision)?),
            )
        } else {
            (None, None)
        };
        Ok(SharedKvProjection {
            q: ColumnParallelLinear {
                weight: Weight::new(q_w, init.precision)?,
                bias: q_b,
            },
            kv_weight: Weight::new(kv_w, init.precision)?,
            kv_bias: kv_b,
            q_rows: config.heads / tp * d,
            kv_rows: 2 * d,
            ranks_per_kv: tp / kv,
        })
    }
}

impl<D: DataMode> Module for QkvProjection<D> {
    /// `qkv.weight`, `qkv.bias` (fused); `q.weight`, `q.bias`, `kv.weight`, `kv.bias`
    /// (shared KV), under `prefix`'s parent.
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        match self {
            QkvProjection::Fused(l) => l.visit_params(&join_name(prefix, "qkv"), v),
            QkvProjection::SharedKv(s) => {
                s.q.visit_params(&join_name(prefix, "q"), v)?;
                let kv = join_name(prefix, "kv");
                v.visit(&join_name(&kv, "weight"), &mut s.kv_weight)?;
                match &mut s.kv_bias {
                    Some(b) => v.visit(&join_name(&kv, "bias"), b),
                    None => Ok(()),
                }
            }
        }
    }
}

impl<M: SeqMode, D: DataMode> Module for ParallelAttention<M, D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        self.qkv.visit_params(prefix, v)?;
        if let Some(n) = &mut self.qk_norm {
            v.visit(&join_name(prefix, "q_norm.weight"), &mut n.q)?;
            v.visit(&join_name(prefix, "k_norm.weight"), &mut n.k)?;
        }
        self.out.visit_params(&join_name(prefix, "out"), v)
    }
}
