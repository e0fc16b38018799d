//! Context parallelism (CP): causal attention over sequences split across the ranks of a
//! `Cp`-role mesh axis, by a ring of K/V blocks or by an all-to-all to head shards
//! (Ulysses). [`DTensor::context_attention`] and [`Var::context_attention`](crate::Var)
//! run it; [`CpLayout`] puts tokens into the order it expects and back.
//!
//! # Token layout
//!
//! A sample of `seq_len` tokens is cut into `2·cp` equal chunks and CP rank `c` holds
//! chunks `c` and `2·cp−1−c` (*zigzag*: every rank gets one early and one late chunk, so
//! the causal work is balanced), or with zigzag off into `cp` chunks, rank `c` holding
//! chunk `c` (rank `cp−1` then does `2·cp−1` times the work of rank 0). The attention
//! input is the grouped fused `[tokens, kv_heads·(g+2)·d]` QKV of
//! [`causal_attention`](dtensor_kernels::ops::causal_attention), laid out `Shard<0>` over
//! the `Cp` axis, in the **CP token order**: the global tokens are `blocks` equal blocks
//! (one per data-parallel rank: an axis that shards the tokens *outside* `Cp`, left of it
//! in the mesh), and inside a block of `b` whole samples the tokens are arranged chunk
//! major: all of CP rank 0's tokens of every sample (sample by sample, each sample's
//! chunks in position order), then rank 1's, and so on. A plain `Shard<0>` over `Cp` then
//! gives every rank its chunks of every sample of its block. [`CpLayout::to_cp_order`]
//! and [`CpLayout::from_cp_order`] (and their `_vec` twins, for token ids) move a tensor
//! between the natural order (samples one after another) and this one. The causal mask
//! uses each token's true position in its sample; q and k come in already rotated, each
//! row at that position ([`RopePositions::ContextParallel`](crate::RopePositions) gives
//! [`rope`](crate::DTensor::rope) the positions of this order).
//!
//! **Masks.** [`DTensor::context_attention_masked`] narrows the causal mask to packed
//! documents and/or a sliding window ([`AttentionMask`]), with the document ids of the
//! global tokens in *natural* order (what one rank would take): each rank keeps its data
//! block's, and a ring block looks its rows up by their true positions, so a document
//! that starts in another rank's chunk is masked right. A ring block no query of the rank
//! sees ([`BlockAttention::fully_masked`]) travels on without being computed; the
//! all-to-all runs the masked kernel on the gathered natural-order tokens. Either way the
//! result is one rank's masked attention.
//!
//! The output `[tokens, heads·d]` has the input's layout and order. `Cp` must be the
//! innermost axis sharding the tokens (checked), and every rank must hold the same number
//! of whole samples' chunks (checked: the number of samples divides by the data ranks).
//!
//! # Strategies
//!
//! - [`CpStrategy::Ring`]: each rank keeps its queries; the K/V blocks (`[tokens,
//!   kv_heads·2·d]`, the KV heads only: with grouped-query attention a small part of the
//!   QKV) travel around the `Cp` ring by `send`/`recv`, and each rank
//!   merges its partial results by log-sum-exp (online softmax). A block wholly in a
//!   rank's future (zigzag off: ranks `c < o` for owner `o`) is passed on without being
//!   computed. The backward sends the K/V blocks around again; each block's accumulated
//!   `dK`/`dV` travels with it and arrives back at its owner after one more hop.
//! - [`CpStrategy::AllToAll`]: one all-to-all over `Cp` turns the sequence-sharded QKV
//!   into a head-sharded one (each rank all tokens of its data block, `heads/cp` of its
//!   heads), the local kernel runs full-sequence causal attention on it, and an
//!   all-to-all turns the output back. Needs the KV heads a rank holds (per `Tp` rank) to
//!   divide by `cp` (checked): each rank gets whole KV groups.
//!
//! **Typing.** Plain attention refuses `Shard<0>` on a `Cp`-role axis (its token shards are
//! chunks, not samples: see [`AttentionRule`](dtensor_placement::AttentionRule)); this op
//! takes exactly that, `Shard<0>` on its `Cp` axis, and what plain attention takes on every
//! other axis ([`ContextAttentionLayout`]). The all-to-all strategy is, inside, the
//! transition `Shard<0> → Shard<1>` (tokens → heads) on `Cp` and back. It is an op rather
//! than two typed [`all_to_all`](crate::DTensor::all_to_all)s for two reasons: with `Tp`
//! also sharding the heads, the head dim would need "`Tp` outer, `Cp` inner", which a
//! typed `Shard<1>` on both cannot say (shards of one dim nest in mesh order, and `Cp` sits
//! left of `Tp`: see [`plan`](crate::plan)'s nesting rule, which refuses the step); and the
//! gathered tokens come in CP order, which the local kernel must see in natural order, a
//! local permutation no layout type describes.
//!
//! # Overlap
//!
//! `send` is buffered on every backend (the threads backend copies into the peer's
//! mailbox, MPI posts an `Isend` of a copy), so each ring step *issues the next transfer
//! before computing on the current block* and receives after: the K/V transfer of step
//! `s+1` overlaps the compute of step `s`, forward and backward. A `dK`/`dV` block can only
//! leave once this rank has added its share, so its hop overlaps the next step's compute
//! on the receiver only. The all-to-all strategy runs blocking all-to-alls (no overlap).
//!
//! # Communication (per layer, per token a rank holds, `H` its query heads, `K` its KV heads, `d` the head dim)
//!
//! | strategy | forward, elements sent | backward, elements sent |
//! |---|---|---|
//! | ring | K,V: `2·d·K·(cp−1)` | K,V: `2·d·K·(cp−1)` and dK,dV: `2·d·K·cp` (compute dtype) |
//! | all-to-all | QKV + out: `(H+2K+H)·d·(cp−1)/cp` | dout + dQKV: `(H+H+2K)·d·(cp−1)/cp` |
//!
//! (Multi-head attention, `K = H`: the ring's `2·d·H` per hop, the all-to-all's `4·d·H`.)
//!
//! (bytes: times the element size; dK,dV travel in the compute dtype, f32 for bf16). The
//! tests check these against the `Cp` communicator's counters.
//!
//! **When which wins.** The all-to-all moves `4·(cp−1)/cp ≈ 4` elements per `d·H` per token
//! each way, independent of `cp`; the ring moves `2·(cp−1)`, growing with `cp`, so beyond
//! `cp ≈ 3` the all-to-all sends less. But the all-to-all needs `heads (per Tp rank) ≥ cp`
//! and divisible by it, its transfers cannot hide behind compute (they sit on the critical
//! path), and each rank holds all tokens of its heads at once; the ring's transfers hide
//! behind the block compute as long as a block's attention (`∝ tokens_per_rank²·d`)
//! outlasts its transfer (`∝ tokens_per_rank·d`), i.e. for long sequences, and it works
//! with any head count (grouped-query models with few KV heads, or `Tp` already splitting
//! the heads finely). Short sequences and many heads: all-to-all; long sequences, few
//! heads, or `cp` > heads: ring.
//!
//! # Memory
//!
//! A rank holds its QKV, output and lse (`∝ seq/cp` tokens) and, in the ring, two K/V
//! blocks (the current one and the one arriving); the all-to-all strategy holds the
//! head-sharded copy (`seq` tokens × `H/cp` heads, again `∝ seq/cp`). The backward node
//! saves only this rank's QKV (the op's input), output and lse (and, for the all-to-all,
//! the head-sharded QKV, output and lse instead of the output and lse).
//!
//! Measured (`tests/context_parallel.rs`, seq 512, 4 heads of 16, f64, per rank): what the
//! op keeps for its backward is 278,528 B at cp = 1 (the fused kernel), 139,264 B and
//! 69,632 B for the ring at cp = 2 and 4 (exactly seq/cp), 663,552 B and 331,776 B for the
//! all-to-all (seq/cp, but 4/cp of cp = 1: it also keeps the head-sharded QKV). The
//! transient peak of a forward and backward halves from cp = 2 to cp = 4 for both; the
//! ring's at cp = 2 equals the fused kernel's at cp = 1 (its K/V blocks in flight and the
//! dK/dV accumulators in the compute dtype).

use crate::any::AnyDTensor;
use crate::compute::attention::LocalMask;
use crate::compute::{local_range, output};
use crate::error::{Error, Result};
use crate::tape::{grad_of, Var};
use crate::transfer;
use crate::typed::DTensor;
use dtensor_collectives::Communicator;
use dtensor_kernels::ops::{
    self, AttentionMask, BlockAttention, CausalAttention, CausalAttentionOutput,
};
use dtensor_kernels::Tensor;
use dtensor_placement::{AxisKind, ContextAttentionLayout, Layout, MeshAxis, Placement};
use std::sync::Arc;

const OP: &str = "DTensor::context_attention";
const OP_BACK: &str = "Var::context_attention (backward)";

/// Point-to-point tags of the ring (below MPI's guaranteed minimum tag bound, 32767).
const TAG_KV: u32 = 30_001;
const TAG_KV_BACK: u32 = 30_002;
const TAG_DKV: u32 = 30_003;

/// How context-parallel attention moves data over the `Cp` axis (see the
/// [module docs](self)); defined in dtensor-placement, where a run's `Composition` names it.
pub use dtensor_placement::CpStrategy;

/// The parameters of [`DTensor::context_attention`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ContextAttention {
    /// The attention: `seq_len` is the *whole* sample's length (not a rank's share).
    pub attn: CausalAttention,
    /// Zigzag chunks (rank `c` holds chunks `c` and `2·cp−1−c` of `2·cp`) or contiguous
    /// ones (chunk `c` of `cp`).
    pub zigzag: bool,
    /// How the K/V (or the heads) move over `Cp`: ring passes or all-to-all.
    pub strategy: CpStrategy,
}

/// Which positions of a sample each CP rank holds, and the token order that goes with
/// it (see the [module docs](self)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CpLayout {
    seq_len: usize,
    cp: usize,
    zigzag: bool,
}

impl CpLayout {
    /// `Err` unless `seq_len` cuts into `2·cp` (zigzag) or `cp` equal chunks.
    pub fn new(seq_len: usize, cp: usize, zigzag: bool) -> Result<CpLayout> {
        let chunks = if zigzag { 2 * cp } else { cp };
        if cp == 0 || seq_len == 0 || !seq_len.is_multiple_of(chunks) {
            return Err(Error::ShapeMismatch {
                op: "CpLayout::new",
                detail: format!(
                    "sequence length {seq_len} does not split into {} = {chunks} equal chunks over {cp} context-parallel ranks",
                    if zigzag { "2·cp" } else { "cp" }
                ),
            });
        }
        Ok(CpLayout {
            seq_len,
            cp,
            zigzag,
        })
    }

    /// Length of a whole sample, in tokens (all CP ranks' positions together).
    pub fn seq_len(&self) -> usize {
        self.seq_len
    }
    /// Number of context-parallel ranks (the `Cp` axis size).
    pub fn cp(&self) -> usize {
        self.cp
    }
    /// Whether each rank holds the two zigzag chunks `c` and `2·cp−1−c` (else one contiguous
    /// chunk `c`).
    pub fn zigzag(&self) -> bool {
        self.zigzag
    }

    /// Tokens of one sample per chunk.
    pub fn chunk_len(&self) -> usize {
        self.seq_len / if self.zigzag { 2 * self.cp } else { self.cp }
    }

    /// Tokens of one sample a CP rank holds (`seq_len / cp`).
    pub fn tokens_per_rank(&self) -> usize {
        self.seq_len / self.cp
    }

    /// The positions within a sample CP rank `c` holds, in the order it holds them
    /// (increasing).
    pub fn positions(&self, c: usize) -> Vec<usize> {
        let n = self.chunk_len();
        if self.zigzag {
            let late = 2 * self.cp - 1 - c;
            (c * n..(c + 1) * n)
                .chain(late * n..(late + 1) * n)
                .collect()
        } else {
            (c * n..(c + 1) * n).collect()
        }
    }

    /// The CP order of `tokens` natural-order tokens in `blocks` data blocks: entry `i` is
    /// the natural index of the token at CP-order index `i`. `Err` unless the tokens are
    /// `blocks` equal blocks of whole samples.
    pub fn permutation(&self, tokens: usize, blocks: usize) -> Result<Vec<usize>> {
        if blocks == 0
            || !tokens.is_multiple_of(blocks)
            || !(tokens / blocks).is_multiple_of(self.seq_len)
        {
            return Err(Error::ShapeMismatch {
                op: "CpLayout::permutation",
                detail: format!(
                    "{tokens} tokens are not {blocks} equal blocks of whole samples of {} tokens",
                    self.seq_len
                ),
            });
        }
        let block = tokens / blocks;
        let samples = block / self.seq_len;
        let pos: Vec<Vec<usize>> = (0..self.cp).map(|c| self.positions(c)).collect();
        let mut perm = Vec::with_capacity(tokens);
        for blk in 0..blocks {
            for p in &pos {
                for b in 0..samples {
                    perm.extend(p.iter().map(|&q| blk * block + b * self.seq_len + q));
                }
            }
        }
        Ok(perm)
    }

    /// A `[tokens, ...]` tensor (any rank ≥ 1, any dtype) from natural order into CP order.
    pub fn to_cp_order(&self, t: &Tensor, blocks: usize) -> Result<Tensor> {
        let perm = self.permutation(t.shape().first().copied().unwrap_or(0), blocks)?;
        permute_rows(t, &perm)
    }

    /// The inverse of [`to_cp_order`](Self::to_cp_order).
    pub fn from_cp_order(&self, t: &Tensor, blocks: usize) -> Result<Tensor> {
        let perm = self.permutation(t.shape().first().copied().unwrap_or(0), blocks)?;
        permute_rows(t, &invert(&perm))
    }

    /// [`to_cp_order`](Self::to_cp_order) of a vector of per-token values (token ids).
    pub fn to_cp_order_vec<T: Clone>(&self, v: &[T], blocks: usize) -> Result<Vec<T>> {
        let perm = self.permutation(v.len(), blocks)?;
        Ok(perm.iter().map(|&i| v[i].clone()).collect())
    }

    /// [`from_cp_order`](Self::from_cp_order) of a vector of per-token values.
    pub fn from_cp_order_vec<T: Clone>(&self, v: &[T], blocks: usize) -> Result<Vec<T>> {
        let inv = invert(&self.permutation(v.len(), blocks)?);
        Ok(inv.iter().map(|&i| v[i].clone()).collect())
    }
}

fn invert(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

/// Rows of `t` (dim 0, any rank ≥ 1) picked by `src`.
fn permute_rows(t: &Tensor, src: &[usize]) -> Result<Tensor> {
    let shape = t.shape().to_vec();
    if shape.is_empty() {
        return Err(Error::ShapeMismatch {
            op: "CpLayout::to_cp_order",
            detail: "a scalar has no token dim".into(),
        });
    }
    let rest: usize = shape[1..].iter().product();
    let flat = t.clone().reshape(&[shape[0], rest])?;
    Ok(ops::gather_rows(&flat, src)?.reshape(&shape)?)
}

/// Everything one call needs to know about where it runs.
#[derive(Clone)]
struct Geom {
    comm: Arc<dyn Communicator>,
    /// This rank's coordinate on the `Cp` axis, and the axis size.
    c: usize,
    cp: usize,
    layout: CpLayout,
    /// Each CP rank's positions in the sample (the ring blocks' mask).
    pos: Vec<Vec<usize>>,
    /// This rank's query heads (`kv_heads · q_per_kv`).
    heads: usize,
    cfg: ContextAttention,
    /// The mask, with the document ids of this rank's data block (its whole samples, in
    /// natural order).
    mask: LocalMask,
}

/// What the backward needs besides the input.
enum Saved {
    /// `cp = 1`: the fused kernel on this rank's whole samples, nothing moves.
    Local {
        out: Tensor,
        lse: Tensor,
    },
    Ring {
        out: Tensor,
        lse: Tensor,
    },
    AllToAll {
        x: Tensor,
        out: Tensor,
        lse: Tensor,
    },
}

/// Saved state of one context-attention call, for its backward.
pub(crate) struct ContextSaved {
    geom: Geom,
    saved: Saved,
}

fn describe(t: &AnyDTensor) -> String {
    let p: Vec<String> = t.placements().iter().map(|p| p.to_string()).collect();
    format!(
        "QKV global {:?} (local {:?}) laid out as [{}] on mesh {}",
        t.global_shape(),
        t.local_shape(),
        p.join(", "),
        t.device_mesh().mesh()
    )
}

fn bad(detail: String) -> Error {
    Error::ShapeMismatch { op: OP, detail }
}

fn geometry(
    a: &AnyDTensor,
    axis: AxisKind,
    cfg: &ContextAttention,
    mask: &AttentionMask<'_>,
) -> Result<Geom> {
    if a.global_shape().len() != 2 {
        return Err(bad(format!("the QKV must be 2-D, got {}", describe(a))));
    }
    let dm = a.device_mesh();
    let ax = dm.mesh().index_of(axis).ok_or_else(|| {
        bad(format!(
            "axis {axis} is not in the mesh of the {}",
            describe(a)
        ))
    })?;
    if a.placements()[ax] != Placement::Shard(0) {
        return Err(bad(format!(
            "the tokens must be Shard<0> over {axis}, got {}",
            describe(a)
        )));
    }
    let cp = dm.mesh().size(ax);
    let layout = CpLayout::new(cfg.attn.seq_len, cp, cfg.zigzag).map_err(|e| {
        bad(format!(
            "{} ({}; over axis {axis})",
            match e {
                Error::ShapeMismatch { detail, .. } => detail,
                e => e.to_string(),
            },
            describe(a)
        ))
    })?;
    if let Some(b) =
        (ax + 1..a.placements().len()).find(|&b| a.placements()[b] == Placement::Shard(0))
    {
        return Err(bad(format!(
            "axis {} shards the tokens inside {axis}; {axis} must be the innermost axis sharding them (data-parallel axes go left of it): {}",
            dm.mesh().axes()[b].0,
            describe(a)
        )));
    }
    let (d, g) = (cfg.attn.head_dim, cfg.attn.q_per_kv);
    let group = cfg.attn.group_cols().unwrap_or(0);
    let (rows, cols) = (a.local_shape()[0], a.local_shape()[1]);
    if d == 0 || g == 0 || group == 0 || cols % group != 0 {
        return Err(bad(format!(
            "this rank's {cols} columns are not whole KV groups of ({g}+2)·{d} (q_per_kv {g} query heads, k, v; shard the columns by whole KV groups): {}",
            describe(a)
        )));
    }
    let parts: usize = a
        .placements()
        .iter()
        .enumerate()
        .filter(|(_, p)| **p == Placement::Shard(0))
        .map(|(i, _)| dm.mesh().size(i))
        .product();
    let per = layout.tokens_per_rank();
    if rows % per != 0 || rows * parts != a.global_shape()[0] {
        return Err(bad(format!(
            "each rank must hold the chunks of the same whole samples: {rows} local tokens are not samples × seq_len/cp = {per} split evenly over {parts} token shards ({})",
            describe(a)
        )));
    }
    let kv_heads = cols / group;
    if cfg.strategy == CpStrategy::AllToAll && !kv_heads.is_multiple_of(cp) {
        return Err(bad(format!(
            "the all-to-all strategy splits this rank's {kv_heads} KV heads (with their query heads) over cp = {cp} ranks of {axis}: they do not divide (use CpStrategy::Ring, or fewer tensor-parallel ranks); {}",
            describe(a)
        )));
    }
    let heads = kv_heads * g;
    let pos = (0..cp).map(|c| layout.positions(c)).collect();
    // This rank's rows are one CP chunk of its data block (`Cp` innermost): the block's
    // whole samples are natural-order rows `blk·block ..` of the mask's ids.
    let block = rows * cp;
    let blk = local_range(a, 0)?.start / block.max(1);
    let mask = LocalMask::of_range(
        OP,
        a,
        mask,
        blk * block..(blk + 1) * block,
        a.global_shape()[0],
    )?;
    Ok(Geom {
        comm: dm.axis_comm(ax).clone(),
        c: dm.coords()[ax],
        cp,
        layout,
        pos,
        heads,
        cfg: *cfg,
        mask,
    })
}

impl Geom {
    fn next(&self) -> usize {
        (self.c + 1) % self.cp
    }
    fn prev(&self) -> usize {
        (self.c + self.cp - 1) % self.cp
    }
    fn block(&self, owner: usize) -> BlockAttention<'_> {
        BlockAttention {
            head_dim: self.cfg.attn.head_dim,
            q_per_kv: self.cfg.attn.q_per_kv,
            scale: self.cfg.attn.scale,
            q_pos: &self.pos[self.c],
            k_pos: &self.pos[owner],
            mask: self.mask.as_mask(),
        }
    }
    /// One hop round the ring: `t` to the next rank, the previous rank's back (in an order
    /// that cannot deadlock on unbuffered device sends: [`transfer::shift`]).
    fn shift(&self, t: &Tensor, tag: u32) -> Result<Tensor> {
        transfer::shift(&*self.comm, t, self.next(), self.prev(), tag)
    }

    /// The within-block permutation between CP order (what an all-to-all gathers: rank
    /// 0's tokens, then rank 1's, ...) and natural order, for `rows` local tokens.
    fn block_perm(&self, rows: usize) -> Result<Vec<usize>> {
        self.layout.permutation(rows * self.cp, 1)
    }

    fn ring_forward(&self, qkv: &Tensor) -> Result<CausalAttentionOutput> {
        let a = &self.cfg.attn;
        let mut cur = ops::pack_kv(qkv, a.head_dim, a.q_per_kv)?;
        let mut owner = self.c;
        let mut acc: Option<CausalAttentionOutput> = None;
        let samples = qkv.shape()[0] / self.layout.tokens_per_rank();
        for step in 0..self.cp {
            let more = step + 1 < self.cp;
            // The next hop moves before this block's compute.
            let next = if more {
                Some(self.shift(&cur, TAG_KV)?)
            } else {
                None
            };
            let b = self.block(owner);
            if !b.fully_masked(samples) {
                let part = ops::attention_block(qkv, &cur, &b)?;
                match acc.as_mut() {
                    None => acc = Some(part),
                    Some(a) => ops::merge_attention(a, &part)?,
                }
            }
            if let Some(next) = next {
                cur = next;
                owner = (owner + self.cp - 1) % self.cp;
            }
        }
        // The rank's own block (step 0) is never masked: each query sees itself.
        Ok(acc.expect("the diagonal block is computed"))
    }

    fn ring_backward(
        &self,
        dy: &Tensor,
        qkv: &Tensor,
        out: &Tensor,
        lse: &Tensor,
    ) -> Result<Tensor> {
        let (d, g) = (self.cfg.attn.head_dim, self.cfg.attn.q_per_kv);
        let acc = ops::acc_dtype(qkv.dtype());
        let mut cur = ops::pack_kv(qkv, d, g)?;
        let mut dkv = Tensor::zeros_on(qkv.device(), cur.shape(), acc)?;
        let mut dq = Tensor::zeros_on(qkv.device(), &[qkv.shape()[0], self.heads * d], acc)?;
        let mut owner = self.c;
        for step in 0..self.cp {
            let more = step + 1 < self.cp;
            let next = if more {
                Some(self.shift(&cur, TAG_KV_BACK)?)
            } else {
                None
            };
            let b = self.block(owner);
            ops::attention_block_backward(dy, qkv, &cur, out, lse, &b, &mut dq, &mut dkv)?;
            if self.cp > 1 {
                // This block's dK/dV, with this rank's share added, follows it; the last hop
                // takes it home to its owner.
                dkv = self.shift(&dkv, TAG_DKV)?;
            }
            if let Some(next) = next {
                cur = next;
                owner = (owner + self.cp - 1) % self.cp;
            }
        }
        Ok(ops::fuse_qkv_grad(&dq, &dkv, d, g, qkv.dtype())?)
    }

    /// Sequence-sharded `[rows, H·w]` → head-sharded `[cp·rows, (H/cp)·w]` in natural
    /// order (this rank's data block, all tokens, its head group).
    fn to_heads(&self, t: &Tensor) -> Result<Tensor> {
        let rows = t.shape()[0];
        let groups = t.chunk(1, self.cp)?;
        let send = Tensor::cat(&groups, 0)?;
        drop(groups);
        let mut recv = send.zeros_like()?;
        transfer::all_to_all(&*self.comm, &send, &mut recv)?;
        drop(send);
        let inv = invert(&self.block_perm(rows)?);
        Ok(ops::gather_rows(&recv, &inv)?)
    }

    /// The inverse of [`to_heads`](Self::to_heads).
    fn to_tokens(&self, t: &Tensor) -> Result<Tensor> {
        let rows = t.shape()[0] / self.cp;
        let send = ops::gather_rows(t, &self.block_perm(rows)?)?;
        let mut recv = send.zeros_like()?;
        transfer::all_to_all(&*self.comm, &send, &mut recv)?;
        drop(send);
        Ok(Tensor::cat(&recv.chunk(0, self.cp)?, 1)?)
    }

    fn attn_full(&self) -> CausalAttention {
        self.cfg.attn
    }

    /// The local kernel over this rank's whole samples in natural order, under the mask.
    fn full_forward(&self, qkv: &Tensor) -> Result<CausalAttentionOutput> {
        self.mask.forward(qkv, &self.attn_full())
    }

    fn full_backward(
        &self,
        dy: &Tensor,
        qkv: &Tensor,
        out: &Tensor,
        lse: &Tensor,
    ) -> Result<Tensor> {
        let saved = CausalAttentionOutput {
            out: out.clone(),
            lse: lse.clone(),
        };
        self.mask.backward(dy, qkv, &saved, &self.attn_full())
    }

    /// Columns of one KV group of the fused QKV (checked nonzero by [`geometry`]).
    fn group_cols(&self) -> usize {
        self.cfg.attn.group_cols().unwrap_or(1)
    }
}

/// The forward, with what the backward needs.
pub(crate) fn forward<L: Layout>(
    x: &DTensor<L>,
    axis: AxisKind,
    cfg: &ContextAttention,
    mask: &AttentionMask<'_>,
) -> Result<(DTensor<L>, ContextSaved)> {
    let a = x.as_any();
    let geom = geometry(a, axis, cfg, mask)?;
    let qkv = a.as_local();
    let (g, group) = (cfg.attn.q_per_kv, geom.group_cols());
    let global = [
        a.global_shape()[0],
        a.global_shape()[1] / group * g * cfg.attn.head_dim,
    ];
    let (local, saved) = match cfg.strategy {
        // One rank holds whole samples in natural order: plain causal attention, bit for
        // bit what `causal_attention` computes, with no collective.
        _ if geom.cp == 1 => {
            let r = geom.full_forward(qkv)?;
            (
                r.out.clone(),
                Saved::Local {
                    out: r.out,
                    lse: r.lse,
                },
            )
        }
        CpStrategy::Ring => {
            let r = geom.ring_forward(qkv)?;
            let out = r.out.to_dtype(qkv.dtype());
            (out.clone(), Saved::Ring { out, lse: r.lse })
        }
        CpStrategy::AllToAll => {
            let xh = geom.to_heads(qkv)?;
            let r = geom.full_forward(&xh)?;
            let out = geom.to_tokens(&r.out)?;
            (
                out,
                Saved::AllToAll {
                    x: xh,
                    out: r.out,
                    lse: r.lse,
                },
            )
        }
    };
    let y = output(OP, local, &global, a)?;
    Ok((y, ContextSaved { geom, saved }))
}

/// The local QKV gradient from the local output gradient.
pub(crate) fn backward(dy: &Tensor, x: &AnyDTensor, s: &ContextSaved) -> Result<Tensor> {
    let g = &s.geom;
    let qkv = x.as_local();
    if dy.dtype() != qkv.dtype() {
        return Err(Error::ShapeMismatch {
            op: OP_BACK,
            detail: format!("output gradient {} for a {} QKV", dy.dtype(), qkv.dtype()),
        });
    }
    match &s.saved {
        Saved::Local { out, lse } => g.full_backward(dy, qkv, out, lse),
        Saved::Ring { out, lse } => g.ring_backward(dy, qkv, out, lse),
        Saved::AllToAll { x, out, lse } => {
            let dyh = g.to_heads(dy)?;
            let dxh = g.full_backward(&dyh, x, out, lse)?;
            drop(dyh);
            g.to_tokens(&dxh)
        }
    }
}

/// The elements a rank sends over the `Cp` axis for one context attention of `tokens`
/// local tokens, `heads` local query heads and `kv_heads` local KV heads of dim `d`,
/// forward and backward (the module docs' table): `(forward, backward)` in elements of the
/// QKV dtype, and the backward's dK/dV in the compute dtype (`ring` only) as a third
/// figure.
pub fn cp_elements_sent(
    strategy: CpStrategy,
    cp: usize,
    tokens: usize,
    heads: usize,
    kv_heads: usize,
    d: usize,
) -> (usize, usize, usize) {
    let per = tokens * d;
    match strategy {
        CpStrategy::Ring => {
            // Only the KV heads travel.
            let kv = 2 * kv_heads * per * (cp - 1);
            (kv, kv, if cp > 1 { 2 * kv_heads * per * cp } else { 0 })
        }
        CpStrategy::AllToAll => {
            // A rank keeps 1/cp of each all-to-all: the fused QKV (`heads + 2·kv_heads`
            // columns of d) and the output (`heads`).
            let f = |w: usize| w * per * (cp - 1) / cp;
            let (qkv, out) = (heads + 2 * kv_heads, heads);
            (f(qkv) + f(out), f(out) + f(qkv), 0)
        }
    }
}

impl<L: Layout> DTensor<L> {
    /// Context-parallel causal attention over the `Cp`-role axis `axis`, on a fused
    /// grouped `[tokens, kv_heads·(g+2)·d]` QKV (q and k already rotated at their true
    /// positions) laid out `Shard<0>` over it in the CP token order
    /// ([`CpLayout`]; see the [module docs](crate::context)), into `[tokens, heads·d]` laid
    /// out as the input. Other axes take what [`causal_attention`](Self::causal_attention)
    /// takes. `Err` (naming the op, shapes and placements) when the sequence does not cut
    /// into the chunks, when ranks would hold different samples, and, for
    /// [`CpStrategy::AllToAll`], when the local KV heads do not divide by `cp`.
    pub fn context_attention<X: MeshAxis, I>(
        &self,
        axis: X,
        cfg: &ContextAttention,
    ) -> Result<DTensor<L>>
    where
        L: ContextAttentionLayout<X, I>,
    {
        let _ = axis;
        Ok(forward(self, X::KIND, cfg, &AttentionMask::CAUSAL)?.0)
    }

    /// [`context_attention`](Self::context_attention) under `mask`: packed documents and/or
    /// a sliding window ([`AttentionMask`]). The document ids are the global tokens' in
    /// **natural order** (samples one after another, as the single-rank
    /// [`causal_attention_masked`](Self::causal_attention_masked) takes them), not the CP
    /// order of the QKV: every rank passes the same ids and looks up its data block's.
    /// Ring blocks that no query of a rank sees (another document, outside the window) are
    /// passed on without being computed. `Err` as `context_attention`, and when the ids are
    /// not one per global token or the window is 0.
    pub fn context_attention_masked<X: MeshAxis, I>(
        &self,
        axis: X,
        cfg: &ContextAttention,
        mask: &AttentionMask<'_>,
    ) -> Result<DTensor<L>>
    where
        L: ContextAttentionLayout<X, I>,
    {
        let _ = axis;
        Ok(forward(self, X::KIND, cfg, mask)?.0)
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::context_attention`]: one node for the forward and the backward over
    /// the `Cp` axis (ring or all-to-all, see [`context`](crate::context)). It saves this rank's
    /// QKV (the input), output and lse; its backward communicates, so it runs on every
    /// rank even when no gradient reached it.
    pub fn context_attention<X: MeshAxis, I>(
        &self,
        axis: X,
        cfg: &ContextAttention,
    ) -> Result<Var<'t, L>>
    where
        L: ContextAttentionLayout<X, I>,
    {
        self.context_attention_masked(axis, cfg, &AttentionMask::CAUSAL)
    }

    /// [`DTensor::context_attention_masked`]: as [`context_attention`](Self::context_attention),
    /// the node also keeping this rank's data block's document ids.
    pub fn context_attention_masked<X: MeshAxis, I>(
        &self,
        axis: X,
        cfg: &ContextAttention,
        mask: &AttentionMask<'_>,
    ) -> Result<Var<'t, L>>
    where
        L: ContextAttentionLayout<X, I>,
    {
        let _ = axis;
        let (y, saved) = forward(self.value(), X::KIND, cfg, mask)?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, true, move |dy| {
            let dx = backward(dy.as_local(), &xv, &saved)?;
            grad_of("Var::context_attention", dx, &xv)
        }))
    }
}
