//! Mixture-of-experts building blocks over the `Ep` mesh axis: a top-k [`Routing`],
//! [`dispatch`] of tokens to their experts' ranks and [`combine`] back (both an
//! all-to-all-v over `Ep`, each the other's backward), the [`grouped matmul`](Dispatched::grouped_matmul_t)
//! of dispatched rows by their experts' weights, and the Switch load-balancing
//! [`aux_loss`]. Every op records its backward on the [`Tape`](crate::Tape).
//!
//! Model: tokens `[tokens, hidden]` are `Shard<0>` over `Ep`; `E` experts, each `Ep` rank
//! owning `E / ep` whole experts (weights `[E, out, in]`, `Shard<0>` over `Ep`). Per token
//! the router picks `k ∈ {1, 2}` experts.
//!
//! | op | placement over Ep | collective over Ep | backward |
//! |---|---|---|---|
//! | [`route`] | logits `S0` → gates `S0` (`[tokens, k]`) | all-to-all of counts (`E/ep` per peer) | softmax / top-k gather |
//! | [`dispatch`] | `S0` → `Ragged<B>` | all-to-all-v of rows | the reverse all-to-all-v, then a sum over a token's copies |
//! | [`Dispatched::grouped_matmul_t`] | `Ragged<B>` · `S0` → `Ragged<B>` | none | `dx` `Ragged`, `dW` `S0` (whole on the owner) |
//! | [`combine`] | `Ragged<B>` (+ gates `S0`) → `S0` | all-to-all-v of rows | the forward all-to-all-v; gates get `⟨dy, y⟩` |
//! | [`aux_loss`] | logits `S0` → `Partial<Sum>` | all-reduce of `E + 1` counts | `E/T·softmax'(f)` |
//! | [`aux_loss_global`] | the same, statistics over every axis sharding the rows | one all-reduce of `E + 1` counts per such axis | the same |
//!
//! **Ragged rows.** A dispatched tensor's rows are grouped by local expert, then by source
//! rank, then by token order (then top-k slot). How many rows a rank holds is data: the
//! [`Routing`] carries the counts, exchanged by an all-to-all before any row moves, and
//! the tensor records its own row count as its global extent of dim 0.
//!
//! **Tying a combine to its dispatch.** A routing's brand `B` (any marker type; `()` by
//! default) is in the dispatched layout, `Ragged<B>`, and survives every row-wise op, so a
//! combine by a routing of another brand does not compile. Two routings of one brand (a
//! layer called twice) are told apart at run time: each routing has a unique id, which a
//! [`Dispatched`] value carries, and a combine or grouped matmul with another routing's
//! rows is an `Err`.
//!
//! **Capacity.** With a capacity factor `c`, each (source rank, expert) pair keeps at
//! most `⌈c · tokens · k / E⌉` copies (`tokens`: the source rank's), the first ones in
//! token order, then slot order; a dropped copy is not sent and contributes zero to its
//! token's output (a residual around the MoE block passes the token through); its gate
//! gets no gradient. Without one (dropless) every copy is sent.
//!
//! **Host and device.** On a device mesh the routing decision runs on the host (the
//! all-to-all-v needs its counts there): [`route`] and the aux loss each copy the router
//! logits (`[tokens, E]`) down once and send their results up (gates `[tokens, k]`, a
//! scalar); their backwards bring the small output gradient down and send the logits'
//! gradient up, reusing the forward's probabilities. [`dispatch`] and [`combine`] stay on
//! the device: row gathers and scatter-adds (in a fixed order, so the same bits every run),
//! an elementwise product by each row's gate and a row sum for the gates' gradient.
//!
//! **Bytes.** Let `out` be the kept copies a rank sends to other Ep ranks and `in` those it
//! receives from them ([`Routing::remote_copies_sent`], [`Routing::remote_copies_received`]),
//! `row = hidden_local · dtype_bytes`. Copies that stay on their rank cross no wire.
//!
//! | call | bytes sent over Ep by the rank | received |
//! |---|---|---|
//! | [`route`] (count exchange, i64) | `(ep − 1) · E/ep · 8` | the same |
//! | [`dispatch`] forward / combine's backward | `out · row` | `in · row` |
//! | [`combine`] forward / dispatch's backward | `in · row` | `out · row` |
//!
//! So a forward and backward of one MoE block send `2 · (out + in) · row` plus the count
//! exchange; summed over ranks, `out = in`: each routed copy that leaves its rank crosses
//! the wire four times (dispatch, combine, and their adjoints), `hidden · dtype_bytes` each.
//! `tests/moe.rs` checks this against the Ep communicator's counters.

use crate::any::AnyDTensor;
use crate::device_mesh::DeviceMesh;
use crate::error::{Error, Result};
use crate::tape::{grad_of, Var};
use crate::transfer;
use crate::typed::DTensor;
use dtensor_collectives::{Communicator, ReduceOp};
use dtensor_kernels::{ops, DType, Tensor};
use dtensor_placement::{
    AxisKind, Brand, CombineLayout, CombineOut, DispatchLayout, DispatchOut, DispatchedBy, Ep,
    ExpertTokens, GroupedMatmulLayout, GroupedMatmulOut, Layout, NotSplitLayout, Select, SumLayout,
    SumOut,
};
use std::fmt;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// How the router picks experts.
#[derive(Clone, Debug, PartialEq)]
pub struct RouterConfig {
    /// Number of experts `E` (a multiple of the `Ep` size).
    pub experts: usize,
    /// Experts per token: 1 or 2.
    pub top_k: usize,
    /// `Some(c)`: each (source rank, expert) keeps at most `⌈c · tokens · k / E⌉` copies,
    /// dropping later tokens; `None`: dropless.
    pub capacity_factor: Option<f64>,
    /// Divide the k gates of a token by their sum (Mixtral-style); otherwise the gates are
    /// the softmax probabilities themselves (Switch-style).
    pub normalize_gates: bool,
    /// An aux-loss-free load-balancing bias per expert (DeepSeek-V3): added to the
    /// probabilities for the *selection* only, never to the gates.
    pub selection_bias: Option<Vec<f64>>,
}

impl RouterConfig {
    /// Dropless top-`k` of `experts`, gates not renormalized, no bias.
    pub fn new(experts: usize, top_k: usize) -> Self {
        RouterConfig {
            experts,
            top_k,
            capacity_factor: None,
            normalize_gates: false,
            selection_bias: None,
        }
    }
}

static NEXT_ROUTING: AtomicU64 = AtomicU64::new(1);

/// One rank's routing of its local tokens: per token its `k` experts and whether each copy
/// was kept; per destination rank the rows it sends; per source rank and local expert the
/// rows it receives (exchanged by [`route`]'s all-to-all of counts). Branded `B` (see the
/// module docs) and identified by a unique [`id`](Self::id).
pub struct Routing<B: Brand = ()> {
    id: u64,
    experts: usize,
    ep: usize,
    top_k: usize,
    tokens: usize,
    /// `[tokens · k]`: the chosen expert of each (token, slot).
    choices: Vec<usize>,
    /// `[tokens · k]`: within capacity (sent).
    kept: Vec<bool>,
    /// The (token, slot) flat index of each sent row, in send order (destination rank,
    /// then its local expert, then token, then slot).
    send_slots: Vec<usize>,
    /// Rows sent to each rank.
    send_counts: Vec<usize>,
    /// `[ep][E/ep]`: rows received from each source rank for each local expert.
    recv_counts: Vec<Vec<usize>>,
    /// Expert-major position `i` of the dispatched rows is source-major position `perm[i]`.
    perm: Vec<usize>,
    /// `[E]`: this rank's selections per expert, before capacity.
    selected: Vec<usize>,
    comm: Arc<dyn Communicator>,
    mesh: Arc<DeviceMesh>,
    _brand: PhantomData<B>,
}

impl<B: Brand> fmt::Debug for Routing<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Routing")
            .field("id", &self.id)
            .field("experts", &self.experts)
            .field("ep", &self.ep)
            .field("top_k", &self.top_k)
            .field("tokens", &self.tokens)
            .field("send_counts", &self.send_counts)
            .field("recv_counts", &self.recv_counts)
            .finish()
    }
}

impl<B: Brand> Routing<B> {
    /// A number no other routing of this process has.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// Number of experts `E` routed among (over the whole `Ep` group).
    pub fn experts(&self) -> usize {
        self.experts
    }
    /// Experts each token is sent to (`k`: 1 or 2).
    pub fn top_k(&self) -> usize {
        self.top_k
    }
    /// Experts each Ep rank owns (`E / ep`).
    pub fn local_experts(&self) -> usize {
        self.experts / self.ep
    }
    /// This rank's tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }
    /// `[tokens · k]`: the expert of each (token, slot).
    pub fn choices(&self) -> &[usize] {
        &self.choices
    }
    /// `[tokens · k]`: whether each (token, slot) copy is within capacity.
    pub fn kept(&self) -> &[bool] {
        &self.kept
    }
    /// Rows this rank sends to each Ep rank (itself included).
    pub fn send_counts(&self) -> &[usize] {
        &self.send_counts
    }
    /// Rows this rank receives from each Ep rank (itself included).
    pub fn recv_counts(&self) -> Vec<usize> {
        self.recv_counts.iter().map(|c| c.iter().sum()).collect()
    }
    /// Rows this rank's experts receive, per local expert (the grouped matmul's groups).
    pub fn groups(&self) -> Vec<usize> {
        (0..self.local_experts())
            .map(|e| self.recv_counts.iter().map(|c| c[e]).sum())
            .collect()
    }
    /// Kept copies this rank sends to other ranks (what crosses the wire each way).
    pub fn remote_copies_sent(&self) -> usize {
        let me = self.comm.rank();
        self.send_counts
            .iter()
            .enumerate()
            .filter(|&(d, _)| d != me)
            .map(|(_, c)| c)
            .sum()
    }
    /// Copies this rank receives from other ranks.
    pub fn remote_copies_received(&self) -> usize {
        let me = self.comm.rank();
        self.recv_counts()
            .iter()
            .enumerate()
            .filter(|&(s, _)| s != me)
            .map(|(_, c)| c)
            .sum()
    }
    /// Copies dropped here by the capacity.
    pub fn dropped(&self) -> usize {
        self.kept.iter().filter(|k| !**k).count()
    }

    /// Collective over Ep: tokens per expert over the Ep group, and drops.
    pub fn stats(&self) -> Result<RoutingStats> {
        self.stats_over(&[AxisKind::Ep])
    }

    /// Collective over each of `axes` (those of this routing's mesh; others are skipped):
    /// tokens per expert, and drops, summed over the ranks of those axes. Pass every axis
    /// that shards the tokens (the data axes, `Ep`, `Cp`, and `Tp` under sequence
    /// parallelism) for the whole batch's statistics.
    pub fn stats_over(&self, axes: &[AxisKind]) -> Result<RoutingStats> {
        let e = self.experts;
        let mut buf = vec![0i64; e + 3];
        for (&x, &k) in self.choices.iter().zip(&self.kept) {
            if k {
                buf[x] += 1;
            }
        }
        buf[e] = self.dropped() as i64;
        buf[e + 1] = self.tokens as i64;
        buf[e + 2] = self.choices.len() as i64;
        for &a in axes {
            if let Some(c) = self.mesh.comm(a) {
                transfer::all_reduce_values(&**c, &mut buf, ReduceOp::Sum)?;
            }
        }
        let per_expert: Vec<usize> = buf[..e].iter().map(|&c| c as usize).collect();
        Ok(RoutingStats {
            min: per_expert.iter().copied().min().unwrap_or(0),
            max: per_expert.iter().copied().max().unwrap_or(0),
            mean: per_expert.iter().sum::<usize>() as f64 / e as f64,
            per_expert,
            dropped: buf[e] as usize,
            tokens: buf[e + 1] as usize,
            copies: buf[e + 2] as usize,
        })
    }
}

/// What a routing did over its Ep group ([`Routing::stats`]): a receipt prints it.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutingStats {
    /// Tokens routed to each expert (kept copies).
    pub per_expert: Vec<usize>,
    /// Fewest copies any one expert received (the least-loaded expert).
    pub min: usize,
    /// Mean copies per expert: `per_expert`'s sum over `E`.
    pub mean: f64,
    /// Most copies any one expert received (the most-loaded expert).
    pub max: usize,
    /// Copies dropped by the capacity.
    pub dropped: usize,
    /// Tokens over the group.
    pub tokens: usize,
    /// Copies selected (`tokens · k`), kept or dropped.
    pub copies: usize,
}

impl fmt::Display for RoutingStats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tokens per expert: min {} mean {:.2} max {} ({} experts); dropped {} of {} copies ({} tokens)",
            self.min,
            self.mean,
            self.max,
            self.per_expert.len(),
            self.dropped,
            self.copies,
            self.tokens
        )
    }
}

fn invalid(op: &'static str, detail: String) -> Error {
    Error::ShapeMismatch { op, detail }
}

fn ep_comm(op: &'static str, mesh: &DeviceMesh) -> Result<Arc<dyn Communicator>> {
    mesh.comm(AxisKind::Ep).cloned().ok_or_else(|| {
        dtensor_placement::Error::AxisNotInMesh {
            op,
            axis: AxisKind::Ep,
            mesh: mesh.mesh().to_string(),
        }
        .into()
    })
}

/// `t` (computed on the host) where `like` is: copied up to its device, or itself.
fn beside(t: Tensor, like: &Tensor) -> Result<Tensor> {
    Ok(match like.device() {
        Some(dev) => t.to_device(dev)?,
        None => t,
    })
}

/// Softmax of each row of `v` (`[rows, cols]`), in f64.
fn softmax_rows(v: &[f64], cols: usize) -> Vec<f64> {
    let mut p = v.to_vec();
    for row in p.chunks_mut(cols.max(1)) {
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let mut s = 0.0;
        for x in row.iter_mut() {
            *x = (*x - m).exp();
            s += *x;
        }
        row.iter_mut().for_each(|x| *x /= s);
    }
    p
}

/// The top-`k` columns of `scores` (largest first; ties to the lower index).
fn top_k(scores: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

/// Collective over Ep: routes this rank's tokens from router logits `[tokens, E]`
/// (`Shard<0>` over `Ep`). Returns the routing (after the all-to-all of counts) and the
/// gates `[tokens, k]`, laid out as the logits, on the tape: the softmax probability of
/// each chosen expert (divided by the chosen ones' sum if
/// [`normalize_gates`](RouterConfig::normalize_gates)).
#[allow(clippy::type_complexity)]
pub fn route<'t, B: Brand, L, I>(
    logits: &Var<'t, L>,
    cfg: &RouterConfig,
) -> Result<(Routing<B>, Var<'t, L>)>
where
    L: Select<Ep, I> + NotSplitLayout<1>,
    <L as Select<Ep, I>>::P: ExpertTokens,
{
    const OP: &str = "moe::route";
    let lv = logits.value().as_any();
    let mesh = lv.device_mesh().clone();
    let comm = ep_comm(OP, &mesh)?;
    let (ep, e, k) = (comm.size(), cfg.experts, cfg.top_k);
    if e == 0 || e % ep != 0 {
        return Err(invalid(
            OP,
            format!("{e} experts do not divide over an Ep axis of {ep} ranks"),
        ));
    }
    if k > e {
        return Err(invalid(
            OP,
            format!("top-k {k} is larger than the number of experts {e}"),
        ));
    }
    if !(1..=2).contains(&k) {
        return Err(invalid(OP, format!("top-k must be 1 or 2, got {k}")));
    }
    let shape = lv.local_shape();
    if shape.len() != 2 || shape[1] != e {
        return Err(invalid(
            OP,
            format!("router logits must be [tokens, {e}], got local shape {shape:?}"),
        ));
    }
    if let Some(b) = &cfg.selection_bias {
        if b.len() != e {
            return Err(invalid(
                OP,
                format!("selection bias has {} entries for {e} experts", b.len()),
            ));
        }
    }
    if let Some(c) = cfg.capacity_factor {
        if c.is_nan() || c <= 0.0 {
            return Err(invalid(OP, format!("capacity factor {c} must be > 0")));
        }
    }
    let tokens = shape[0];
    let el = e / ep;
    // The routing decision runs on the host: the counts must be there for the all-to-all-v
    // anyway. One copy of the logits down (`[tokens, E]`, a no-op on the host).
    let probs = softmax_rows(&lv.as_local().to_host()?.to_f64_vec(), e);
    // Selection: probabilities plus the bias (which never reaches the gates).
    let mut choices = Vec::with_capacity(tokens * k);
    for t in 0..tokens {
        let mut s = probs[t * e..(t + 1) * e].to_vec();
        if let Some(b) = &cfg.selection_bias {
            s.iter_mut().zip(b).for_each(|(x, b)| *x += b);
        }
        choices.extend(top_k(&s, k));
    }
    let mut selected = vec![0usize; e];
    choices.iter().for_each(|&x| selected[x] += 1);
    // Capacity, per (this rank, expert), first come first kept.
    let cap = cfg
        .capacity_factor
        .map(|c| (c * (tokens * k) as f64 / e as f64).ceil() as usize);
    let mut used = vec![0usize; e];
    let kept: Vec<bool> = choices
        .iter()
        .map(|&x| {
            used[x] += 1;
            cap.is_none_or(|c| used[x] <= c)
        })
        .collect();
    // Send order: by expert (so by destination rank, then its local expert), then slot
    // index (token, then slot).
    let mut by_expert: Vec<Vec<usize>> = vec![Vec::new(); e];
    for (i, (&x, &kp)) in choices.iter().zip(&kept).enumerate() {
        if kp {
            by_expert[x].push(i);
        }
    }
    let send_slots: Vec<usize> = by_expert.iter().flatten().copied().collect();
    let send_counts: Vec<usize> = (0..ep)
        .map(|d| (d * el..(d + 1) * el).map(|x| by_expert[x].len()).sum())
        .collect();
    // The count exchange: block d holds this rank's rows for rank d's local experts.
    let send: Vec<i64> = by_expert.iter().map(|v| v.len() as i64).collect();
    let mut recv = vec![0i64; e];
    transfer::all_to_all_values(&*comm, &send, &mut recv)?;
    let recv_counts: Vec<Vec<usize>> = recv
        .chunks(el)
        .map(|c| c.iter().map(|&x| x as usize).collect())
        .collect();
    // Received rows arrive source-major (source, then local expert); the dispatched
    // tensor is expert-major (local expert, then source).
    let mut src_offset = vec![0usize; ep];
    let mut acc = 0;
    for (s, c) in recv_counts.iter().enumerate() {
        src_offset[s] = acc;
        acc += c.iter().sum::<usize>();
    }
    let mut perm = Vec::with_capacity(acc);
    for x in 0..el {
        for (s, c) in recv_counts.iter().enumerate() {
            let start = src_offset[s] + c[..x].iter().sum::<usize>();
            perm.extend(start..start + c[x]);
        }
    }
    let routing = Routing {
        id: NEXT_ROUTING.fetch_add(1, Ordering::Relaxed),
        experts: e,
        ep,
        top_k: k,
        tokens,
        choices: choices.clone(),
        kept,
        send_slots,
        send_counts,
        recv_counts,
        perm,
        selected,
        comm,
        mesh,
        _brand: PhantomData,
    };
    // The gates: a gather of the chosen probabilities (normalized or not), on the tape.
    let normalize = cfg.normalize_gates;
    let gates_of = move |p: &[f64]| -> Vec<f64> {
        let mut g = Vec::with_capacity(tokens * k);
        for t in 0..tokens {
            let sel = &choices[t * k..(t + 1) * k];
            let s: f64 = sel.iter().map(|&x| p[t * e + x]).sum();
            g.extend(
                sel.iter()
                    .map(|&x| p[t * e + x] / if normalize { s } else { 1.0 }),
            );
        }
        g
    };
    let gv = gates_of(&probs);
    let choices = routing.choices.clone();
    let global = [lv.global_shape()[0], k];
    // The gates go up to the logits' device (`[tokens, k]`); the backward brings their
    // gradient down (`[tokens, k]`) and the logits' gradient up (`[tokens, E]`), reusing
    // the forward's probabilities.
    let gates = logits.custom::<L>(
        "moe::route (gates)",
        &global,
        |x| beside(Tensor::from_f64_vec(gv, &[tokens, k], x.dtype())?, x),
        move |dy, x| {
            let p = probs;
            let dg = dy.to_host()?.to_f64_vec();
            let mut dl = vec![0.0; tokens * e];
            for t in 0..tokens {
                let sel = &choices[t * k..(t + 1) * k];
                let pt = &p[t * e..(t + 1) * e];
                let mut dp = vec![0.0; e];
                let s: f64 = sel.iter().map(|&x| pt[x]).sum();
                let dgt = &dg[t * k..(t + 1) * k];
                if normalize {
                    let cross: f64 = sel.iter().zip(dgt).map(|(&x, g)| g * pt[x]).sum();
                    for (&x, g) in sel.iter().zip(dgt) {
                        dp[x] += g / s - cross / (s * s);
                    }
                } else {
                    for (&x, g) in sel.iter().zip(dgt) {
                        dp[x] += g;
                    }
                }
                let dot: f64 = pt.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for i in 0..e {
                    dl[t * e + i] = pt[i] * (dp[i] - dot);
                }
            }
            beside(Tensor::from_f64_vec(dl, &[tokens, e], x.dtype())?, x)
        },
    )?;
    Ok((routing, gates))
}

/// Dispatched rows on the tape, with the id of the routing that dispatched them and the
/// rows per local expert: what [`combine`] and the grouped matmul check.
pub struct Dispatched<'t, L: Layout> {
    var: Var<'t, L>,
    routing: u64,
    groups: Arc<[usize]>,
}

impl<L: Layout> Clone for Dispatched<'_, L> {
    fn clone(&self) -> Self {
        Dispatched {
            var: self.var.clone(),
            routing: self.routing,
            groups: self.groups.clone(),
        }
    }
}

impl<'t, L: Layout> Dispatched<'t, L> {
    /// The rows, as a value on the tape.
    pub fn var(&self) -> &Var<'t, L> {
        &self.var
    }
    /// The id of the routing that dispatched these rows.
    pub fn routing_id(&self) -> u64 {
        self.routing
    }
    /// Rows per local expert.
    pub fn groups(&self) -> &[usize] {
        &self.groups
    }

    /// A row-wise op (an activation, a norm): `f` must keep every row where it is (an `Err`
    /// if the local row count changed); the result stays tied to the same routing.
    pub fn map_rows<M: Layout>(
        &self,
        f: impl FnOnce(&Var<'t, L>) -> Result<Var<'t, M>>,
    ) -> Result<Dispatched<'t, M>> {
        let y = f(&self.var)?;
        let (before, after) = (
            self.var.value().local_shape()[0],
            y.value().local_shape().first().copied().unwrap_or(0),
        );
        if before != after {
            return Err(Error::InvalidUse {
                op: "Dispatched::map_rows",
                detail: format!("a row-wise op changed the rows from {before} to {after}"),
            });
        }
        Ok(Dispatched {
            var: y,
            routing: self.routing,
            groups: self.groups.clone(),
        })
    }

    /// Grouped `x·W[e]ᵀ`: each row times its local expert's weight transposed; `w` is
    /// `[experts, out, in]` (`Shard<0>` over Ep: this rank's experts). Backward: `dx` by
    /// the same groups, `dW[e] = Σ dyᵀ·x` over expert `e`'s rows, laid out as `W`'s dual
    /// (`Shard<0>` over Ep, `Partial` over data axes that replicate `W`).
    pub fn grouped_matmul_t<LW: GroupedMatmulLayout<L>>(
        &self,
        w: &Var<'t, LW>,
    ) -> Result<Dispatched<'t, GroupedMatmulOut<L, LW>>> {
        const OP: &str = "Dispatched::grouped_matmul_t";
        let (xv, wv) = (
            self.var.value().as_any().clone(),
            w.value().as_any().clone(),
        );
        if wv.local_shape().len() != 3 || wv.local_shape()[0] != self.groups.len() {
            return Err(invalid(
                OP,
                format!(
                    "expert weights of local shape {:?} for rows of {} local experts (groups {:?})",
                    wv.local_shape(),
                    self.groups.len(),
                    &*self.groups
                ),
            ));
        }
        let local = ops::grouped_matmul_t(xv.as_local(), wv.as_local(), &self.groups)?;
        let global = [xv.global_shape()[0], wv.global_shape()[1]];
        let y: DTensor<GroupedMatmulOut<L, LW>> = crate::compute::output(OP, local, &global, &xv)?;
        let groups = self.groups.clone();
        let var = self.var.binary(w, y, move |dy, want| {
            let g = ops::grouped_matmul_t_backward(
                dy.as_local(),
                xv.as_local(),
                wv.as_local(),
                &groups,
            )?;
            Ok((
                want[0].then(|| grad_of(OP, g.dx, &xv)).transpose()?,
                want[1].then(|| grad_of(OP, g.dw, &wv)).transpose()?,
            ))
        });
        Ok(Dispatched {
            var,
            routing: self.routing,
            groups: self.groups.clone(),
        })
    }
}

/// Rows from `send` (`send_counts[p]` rows for rank `p`) to their ranks over `comm`;
/// returns the received rows (`recv_counts[p]` from rank `p`), `[Σ recv, h]`.
fn exchange_rows(
    comm: &dyn Communicator,
    send: &Tensor,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Result<Tensor> {
    let h = send.shape()[1];
    let mut recv = Tensor::zeros_on(send.device(), &[recv_counts.iter().sum(), h], send.dtype())?;
    let sc: Vec<usize> = send_counts.iter().map(|c| c * h).collect();
    let rc: Vec<usize> = recv_counts.iter().map(|c| c * h).collect();
    transfer::all_to_allv(comm, send, &sc, &mut recv, &rc)?;
    Ok(recv)
}

/// Collective over Ep: sends each kept (token, slot) copy of `x` (`[tokens, hidden]`,
/// `Shard<0>` over Ep) to the rank owning its expert (an all-to-all-v). The result, on
/// each rank, is the rows of its local experts, grouped by local expert, then source
/// rank, then token order: `Ragged<B>` over Ep. Backward: the reverse all-to-all-v, and
/// each token's gradient is the sum over its copies.
pub fn dispatch<'t, B: Brand, L, I>(
    x: &Var<'t, L>,
    routing: &Routing<B>,
) -> Result<Dispatched<'t, DispatchOut<L, B>>>
where
    L: Select<Ep, I> + DispatchLayout<B>,
    <L as Select<Ep, I>>::P: ExpertTokens,
{
    const OP: &str = "moe::dispatch";
    let xv = x.value().as_any().clone();
    check_mesh(OP, &xv, routing)?;
    let shape = xv.local_shape();
    if shape.len() != 2 || shape[0] != routing.tokens {
        return Err(invalid(
            OP,
            format!(
                "tokens of local shape {shape:?} for a routing of {} tokens",
                routing.tokens
            ),
        ));
    }
    let k = routing.top_k;
    let rows: Vec<usize> = routing.send_slots.iter().map(|s| s / k).collect();
    let send = ops::gather_rows(xv.as_local(), &rows)?;
    let recv_counts = routing.recv_counts();
    let recv = exchange_rows(&*routing.comm, &send, &routing.send_counts, &recv_counts)?;
    let local = ops::gather_rows(&recv, &routing.perm)?;
    let global = [local.shape()[0], xv.global_shape()[1]];
    let y: DTensor<DispatchOut<L, B>> = crate::compute::output(OP, local, &global, &xv)?;
    let (comm, perm, send_counts) = (
        routing.comm.clone(),
        routing.perm.clone(),
        routing.send_counts.clone(),
    );
    let n = routing.tokens;
    let var = x.unary(y, true, move |dy| {
        let src_major = ops::scatter_add_rows(dy.as_local(), &perm, perm.len())?;
        let back = exchange_rows(&*comm, &src_major, &recv_counts, &send_counts)?;
        grad_of(OP, ops::scatter_add_rows(&back, &rows, n)?, &xv)
    });
    Ok(Dispatched {
        var,
        routing: routing.id,
        groups: routing.groups().into(),
    })
}

fn check_mesh<B: Brand>(op: &'static str, t: &AnyDTensor, routing: &Routing<B>) -> Result<()> {
    if !Arc::ptr_eq(t.device_mesh(), &routing.mesh) {
        return Err(Error::MeshMismatch {
            op,
            lhs: t.device_mesh().mesh().to_string(),
            rhs: format!("the routing's mesh {}", routing.mesh.mesh()),
        });
    }
    Ok(())
}

/// Collective over Ep: sends each expert output row back to its token's rank (the reverse
/// all-to-all-v) and sums a token's copies weighted by its gates (`[tokens, k]`, from
/// [`route`]): `out[t] = Σ_slots gate[t, s] · y[copy (t, s)]`, a dropped copy counting
/// zero. Backward: `dy = gate · dout` sent forward again (an all-to-all-v), and
/// `dgate[t, s] = ⟨dout[t], y[copy (t, s)]⟩` (zero for a dropped copy), so the router
/// trains. `y` must come from this routing's dispatch: another brand does not compile,
/// another routing of the same brand is an `Err`.
pub fn combine<'t, B: Brand, LY, LG, I>(
    y: &Dispatched<'t, LY>,
    gates: &Var<'t, LG>,
    routing: &Routing<B>,
) -> Result<Var<'t, CombineOut<LY, LG>>>
where
    LY: Layout + Select<Ep, I>,
    <LY as Select<Ep, I>>::P: DispatchedBy<B>,
    LG: CombineLayout<LY>,
{
    const OP: &str = "moe::combine";
    if y.routing != routing.id {
        return Err(Error::InvalidUse {
            op: OP,
            detail: format!(
                "these rows were dispatched by routing #{}, not by routing #{} that combines them",
                y.routing, routing.id
            ),
        });
    }
    let (yv, gv) = (
        y.var.value().as_any().clone(),
        gates.value().as_any().clone(),
    );
    check_mesh(OP, &yv, routing)?;
    let (n, k) = (routing.tokens, routing.top_k);
    if gv.local_shape() != [n, k] {
        return Err(invalid(
            OP,
            format!(
                "gates of local shape {:?} for a routing of {n} tokens and top-{k}",
                gv.local_shape()
            ),
        ));
    }
    if yv.local_shape().len() != 2 || yv.local_shape()[0] != routing.perm.len() {
        return Err(invalid(
            OP,
            format!(
                "expert outputs of local shape {:?} for {} dispatched rows",
                yv.local_shape(),
                routing.perm.len()
            ),
        ));
    }
    let h = yv.local_shape()[1];
    let recv_counts = routing.recv_counts();
    let src_major = ops::scatter_add_rows(yv.as_local(), &routing.perm, routing.perm.len())?;
    // `back`: the sent copies' outputs, `[m, h]` in send order (row i is slot `slots[i]`).
    let back = exchange_rows(
        &*routing.comm,
        &src_major,
        &recv_counts,
        &routing.send_counts,
    )?;
    let slots = routing.send_slots.clone();
    let token_of: Vec<usize> = slots.iter().map(|s| s / k).collect();
    // Each sent copy's gate broadcast along its row, `[m, h]`, in the rows' dtype.
    let g = in_dtype(gv.as_local(), yv.dtype())?;
    let g_rows = gate_rows(&g, &slots, n * k, h)?;
    // out[t] = Σ over t's kept copies in send order of gate · row: a product per element,
    // then a scatter-add (in the accumulation type, in send order: deterministic).
    let local = ops::scatter_add_rows(&back.mul(&g_rows)?, &token_of, n)?;
    let global = [gv.global_shape()[0], yv.global_shape()[1]];
    let value: DTensor<CombineOut<LY, LG>> = crate::compute::output(OP, local, &global, &gv)?;
    let (comm, perm, send_counts) = (
        routing.comm.clone(),
        routing.perm.clone(),
        routing.send_counts.clone(),
    );
    let (y_id, g_id) = (y.var.id(), gates.id());
    Ok(gates
        .tape()
        .record(value, true, &[y_id, g_id], move |dout, store| {
            // Each sent copy's token gradient, `[m, h]`.
            let d_rows = ops::gather_rows(dout.as_local(), &token_of)?;
            let dsend = d_rows.mul(&g_rows)?;
            let recv = exchange_rows(&*comm, &dsend, &send_counts, &recv_counts)?;
            let dy = ops::gather_rows(&recv, &perm)?;
            store.accumulate::<LY>(y_id, grad_of(OP, dy, &yv)?)?;
            // dgate[slot] = ⟨dout[t], row⟩: a row sum, scattered to the slots (a dropped
            // slot stays zero).
            let m = slots.len();
            let dots = ops::sum_dim(&d_rows.mul(&back)?, 1)?.reshape(&[m, 1])?;
            let dg = ops::scatter_add_rows(&dots, &slots, n * k)?.reshape(&[n, k])?;
            let dg = in_dtype(&dg, gv.dtype())?;
            store.accumulate::<LG>(g_id, grad_of(OP, dg, &gv)?)
        }))
}

/// `t` in `dtype` (itself, no copy, if it is already), where `t` is.
fn in_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    Ok(if t.dtype() == dtype {
        t.clone()
    } else {
        t.try_to_dtype(dtype)?
    })
}

/// `[m, h]`: row `i` is the gate of slot `slots[i]` (of `gates`, `[n, k]`, `n · k =
/// slots_total`) repeated `h` times, in `gates`' memory (host or device).
fn gate_rows(gates: &Tensor, slots: &[usize], slots_total: usize, h: usize) -> Result<Tensor> {
    let flat = gates.clone().reshape(&[slots_total, 1])?;
    let picked = ops::gather_rows(&flat, slots)?.reshape(&[slots.len()])?;
    Ok(ops::sum_dim_backward(&picked, 1, h)?)
}

/// Router logits `[tokens, E]` that sum over both dims (what [`aux_loss`] and
/// [`aux_loss_global`] take).
pub trait AuxLossLayout: SumLayout<1, Out: SumLayout<0>> {}
impl<L: SumLayout<1, Out: SumLayout<0>>> AuxLossLayout for L {}

/// The layout of the aux loss of logits laid out `L`: a scalar, their sum over both dims.
pub type AuxLossOut<L> = SumOut<SumOut<L, 1>, 0>;

/// Collective over Ep: the Switch load-balancing loss `E · Σ_i f_i · P_i` over the Ep
/// group, where `f_i` is the fraction of the group's `tokens · k` selections that chose
/// expert `i` (before capacity; a constant) and `P_i` the mean router probability of
/// expert `i` over the group's tokens (differentiable). Each rank holds its tokens' term:
/// `Partial<Sum>` where the logits' rows were `Shard<0>`. `logits` must be the ones the
/// routing was made from.
pub fn aux_loss<'t, B: Brand, L: AuxLossLayout>(
    logits: &Var<'t, L>,
    routing: &Routing<B>,
) -> Result<Var<'t, AuxLossOut<L>>> {
    aux_loss_impl("moe::aux_loss", logits, routing, false)
}

/// [`aux_loss`] with statistics over the whole batch: `f_i` and `P_i` (and the token count
/// `T`) are summed over every mesh axis on which the logits' rows are `Shard<0>` (`Ep`,
/// the data axes, `Cp`, and `Tp` under sequence parallelism), not over `Ep` alone, so a
/// run on any mesh computes the loss a one-rank run computes on the same tokens. One more
/// all-reduce of `E + 1` counts per such axis; the result is `Partial<Sum>` on exactly
/// those axes, its terms adding up to `E · Σ_i f_i · P_i`.
pub fn aux_loss_global<'t, B: Brand, L: AuxLossLayout>(
    logits: &Var<'t, L>,
    routing: &Routing<B>,
) -> Result<Var<'t, AuxLossOut<L>>> {
    aux_loss_impl("moe::aux_loss_global", logits, routing, true)
}

fn aux_loss_impl<'t, B: Brand, L: AuxLossLayout>(
    op: &'static str,
    logits: &Var<'t, L>,
    routing: &Routing<B>,
    global: bool,
) -> Result<Var<'t, AuxLossOut<L>>> {
    let lv = logits.value().as_any();
    check_mesh(op, lv, routing)?;
    let e = routing.experts;
    if lv.local_shape() != [routing.tokens, e] {
        return Err(invalid(
            op,
            format!(
                "logits of local shape {:?} for a routing of {} tokens and {e} experts",
                lv.local_shape(),
                routing.tokens
            ),
        ));
    }
    let mut buf: Vec<i64> = routing.selected.iter().map(|&c| c as i64).collect();
    buf.push(routing.tokens as i64);
    if global {
        // Every axis sharding the rows (Ep among them), in mesh order.
        let mesh = lv.device_mesh();
        for (a, p) in L::placements().iter().enumerate() {
            if *p == dtensor_placement::Placement::Shard(0) {
                if let Some(c) = mesh.comm(mesh.mesh().axes()[a].0) {
                    transfer::all_reduce_values(&**c, &mut buf, ReduceOp::Sum)?;
                }
            }
        }
    } else {
        transfer::all_reduce_values(&*routing.comm, &mut buf, ReduceOp::Sum)?;
    }
    let total = buf[e] as f64;
    let copies = total * routing.top_k as f64;
    let f: Vec<f64> = buf[..e].iter().map(|&c| c as f64 / copies).collect();
    let scale = e as f64 / total;
    let tokens = routing.tokens;
    // The probabilities on the host: one more copy of the logits down (`[tokens, E]`);
    // the loss (a scalar) goes up, and in the backward its gradient (a scalar) comes down
    // and the logits' gradient (`[tokens, E]`) goes up.
    let p = softmax_rows(&lv.as_local().to_host()?.to_f64_vec(), e);
    let s: f64 = p
        .chunks(e)
        .map(|row| row.iter().zip(&f).map(|(a, b)| a * b).sum::<f64>())
        .sum();
    logits.custom::<AuxLossOut<L>>(
        op,
        &[],
        |x| beside(Tensor::from_f64_vec(vec![scale * s], &[], x.dtype())?, x),
        move |dy, x| {
            let d = dy.to_host()?.to_f64_vec()[0] * scale;
            let mut dl = vec![0.0; tokens * e];
            for t in 0..tokens {
                let pt = &p[t * e..(t + 1) * e];
                let dot: f64 = pt.iter().zip(&f).map(|(a, b)| a * b).sum();
                for i in 0..e {
                    dl[t * e + i] = d * pt[i] * (f[i] - dot);
                }
            }
            beside(Tensor::from_f64_vec(dl, &[tokens, e], x.dtype())?, x)
        },
    )
}
