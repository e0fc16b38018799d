//! # dtensor-planner
//!
//! Arithmetic of a parallel GPT step **as `dtensor-nn` runs it**: for a [`Model`] and a
//! [`Composition`] (the mesh `[Pp?, Dp, Ep, Cp, Tp]`, SP, the data mode, recomputation,
//! the pipeline schedule, CP strategy, precision), [`plan`] gives
//!
//! - the bytes every mesh axis's communicator sends in one optimizer step, summed over the
//!   ranks, itemized ([`Plan::items`]) and per axis ([`Plan::axis_bytes`]), in the byte
//!   convention of `dtensor_collectives::counters` (bytes *sent*, a rank's own piece
//!   staying in place counts nothing): over a group of `n` ranks an all-reduce of `L`
//!   elements sends `2(n−1)·L` in total, an all-gather or reduce-scatter of a tensor of `L`
//!   elements `(n−1)·L`, a broadcast `(n−1)·L`, a send `L`. A size-1 axis moves nothing.
//! - per-rank memory ([`Memory`]): parameters, gradients, optimizer state, activations
//!   with and without recomputation, and the peak the `dtensor_kernels::memory` counter
//!   sees;
//! - the pipeline bubble of the schedule.
//!
//! ```
//! use dtensor_planner::{plan, Axis, Composition, Model};
//! let model = Model::preset("gpt-small").unwrap();
//! let c: Composition = "dp=2,tp=2,sp".parse().unwrap();
//! let p = plan(&model, &c).unwrap();
//! assert!(p.axis_bytes(Axis::Tp) > 0 && p.axis_bytes(Axis::Dp) > 0);
//! assert_eq!(p.axis_bytes(Axis::Pp), 0); // no pipeline: no stage hops
//! assert_eq!(p.bubble, 0.0);
//! ```
//!
//! `planner/tests/reality.rs` runs the GPT on thread ranks and holds the bytes per axis to
//! these figures within 1% (equal to the byte outside MoE dispatch) and the peak per-rank
//! tensor memory within 10%; `planner/tests/table.rs` compares the background notes'
//! bytes-per-token table.
//!
//! ## What moves, per step (`m` microbatches, `T` tokens a rank holds per microbatch =
//! `batch·seq/(m·dp·ep·cp)`, `h` hidden, `R` ranks per pipeline stage)
//!
//! | axis | what | collective | elements per group |
//! |---|---|---|---|
//! | Tp | each block, per microbatch: attention and MLP entries and exits | no SP: 2 all-reduces forward (row exits), 2 backward (the column entries' adjoints); SP: all-gather + reduce-scatter for each | `8(tp−1)·T·h` (recompute: `+4(tp−1)·T·h`) |
//! | Tp | embedding exit, LM-head entry | all-reduce forward / backward (SP: reduce-scatter + all-gather) | `2(tp−1)·T·h` each |
//! | Tp | vocab-parallel cross-entropy | 3 all-reduces of `[T]` in f64 (forward only) | `6(tp−1)·T` |
//! | Tp | SP only: stream parameters' gradients (norms, row biases) | all-reduce, once per step, of the `Dp` shard | `2(tp−1)·h` per parameter |
//! | Dp | gradients | DDP: all-reduce once per step; ZeRO-1: reduce-scatter once + all-gather of the updated shard; ZeRO-2: reduce-scatter per microbatch + all-gather; FSDP: gather per microbatch (again in backward with reshard), reduce-scatter per microbatch; column biases are all-reduced in every mode | see [`plan`] |
//! | Ep, Cp | dense parameters' gradients (the adjoint of the compute copy's `to_replicate`) | all-reduce per microbatch, compute dtype | `2(n−1)·P_local` |
//! | Cp | ring attention | K,V forward; K,V and dK,dV backward (`dG` = a tp rank's KV heads' width, `kv_heads·head_dim/tp`) | per rank per layer `2dG(cp−1)T` + `2dG(cp−1)T + 2dG·cp·T` |
//! | Cp | all-to-all attention | Q, K, V in, output back; adjoints | per rank per layer `(2dH + 2dG)(cp−1)/cp·T` each way |
//! | Dp, Ep, Cp | the loss (last stage) | all-reduce of 1 element | `2(n−1)` |
//! | Dp, Ep, Cp | the global batch's scored-token count (the loss's divisor), every stage, once per step | all-reduce of 1 f64 | `2(n−1)` |
//! | Pp | stage hops | send activation, send gradient, per microbatch per boundary | `T·h` each (SP: `T·h/tp`) per rank |
//! | Pp | the loss | broadcast of one f64 from the last stage | `(pp−1)` |
//!
//! The global gradient norm is reduced over the root world communicator, which is no
//! mesh axis: no axis counts it. MoE dispatch and combine (all-to-all-v over `Ep`) depend
//! on the routing; the plan gives the uniform-routing expectation and the reality tests
//! exclude them.

#![warn(missing_docs)]

pub mod cost;
pub mod model;
pub mod params;

pub use cost::{rank, Interconnect, Ranked};
pub use model::{Activation, Model, Moe, PRESETS};
pub use params::{param_list, Kind, ParamInfo, Place};

pub use dtensor_placement::{
    Composition, CpStrategy, DataKind, MasterDType, ParallelConfig, ScheduleKind,
};

/// A mesh axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Axis {
    /// Pipeline parallelism: the layers cut into stages; outermost in the rank layout,
    /// and never in a tensor's layout (a stage hop is a send/recv).
    Pp,
    /// Data parallelism: the batch split; parameters replicated (DDP) or sharded (ZeRO,
    /// FSDP) over it.
    Dp,
    /// Expert parallelism: MoE experts sharded over it, tokens dispatched by all-to-all;
    /// the batch is split over it too.
    Ep,
    /// Context parallelism: the sequence cut into `2·cp` load-balanced chunks over it.
    Cp,
    /// Tensor parallelism: heads, MLP width and vocabulary sharded over it; innermost
    /// (consecutive ranks, the fastest link).
    Tp,
}

impl Axis {
    /// Every axis, in the rank layout's order `[Pp, Dp, Ep, Cp, Tp]` (outermost first).
    pub const ALL: [Axis; 5] = [Axis::Pp, Axis::Dp, Axis::Ep, Axis::Cp, Axis::Tp];
    /// The lower-case name (`"pp"`, `"dp"`, …) that composition strings and reports use.
    pub fn name(self) -> &'static str {
        match self {
            Axis::Pp => "pp",
            Axis::Dp => "dp",
            Axis::Ep => "ep",
            Axis::Cp => "cp",
            Axis::Tp => "tp",
        }
    }
}

/// The degree of `axis` in `c`.
pub fn degree(c: &Composition, axis: Axis) -> usize {
    let d = &c.degrees;
    match axis {
        Axis::Pp => d.pp,
        Axis::Dp => d.dp,
        Axis::Ep => d.ep,
        Axis::Cp => d.cp,
        Axis::Tp => d.tp,
    }
}

/// One line of the communication bill.
#[derive(Clone, Debug, PartialEq)]
pub struct CommItem {
    /// The mesh axis whose communicators send these bytes.
    pub axis: Axis,
    /// What moves, e.g. `"embedding exit"` or [`MOE_DISPATCH`]; one item per axis and
    /// `what`.
    pub what: &'static str,
    /// Bytes sent in one step, summed over all ranks.
    pub bytes: u64,
}

/// Per-rank memory, bytes (the largest over pipeline stages).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Memory {
    /// Master parameters (and compute copies where they differ: another dtype, or ZeRO's
    /// replicated copy of a sharded master).
    pub params: u64,
    /// Gradients held until the update.
    pub grads: u64,
    /// AdamW's two moments over the master shard.
    pub optimizer: u64,
    /// Activations kept for the backward, without recomputation.
    pub activations: u64,
    /// The same with every block recomputed (only block inputs kept).
    pub activations_recompute: u64,
    /// The step's token ids and targets (i64), as train_gpt holds them: the global
    /// batch and its microbatch copies.
    pub inputs: u64,
    /// Whether the gradients are live at the activation peak (they are when they
    /// accumulate over microbatches or pipeline stages; with one microbatch the peak comes
    /// before the first gradient).
    pub grads_at_peak: bool,
}

impl Memory {
    /// Parameters, gradients, optimizer state and the activations the composition keeps.
    pub fn total(&self, recompute: bool) -> u64 {
        self.params
            + if self.grads_at_peak { self.grads } else { 0 }
            + self.optimizer
            + self.inputs
            + if recompute {
                self.activations_recompute
            } else {
                self.activations
            }
    }
}

/// What [`plan`] found.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// The model planned for.
    pub model: Model,
    /// The composition planned for.
    pub composition: Composition,
    /// The communication bill of one step, itemized (items of 0 bytes left out).
    pub items: Vec<CommItem>,
    /// Per-rank memory of the busiest pipeline rank.
    pub memory: Memory,
    /// Idle fraction of a pipeline rank's step (0 without pipelining).
    pub bubble: f64,
    /// Tokens per step (global).
    pub tokens: u64,
}

impl Plan {
    /// Bytes sent over `axis` in one step, summed over ranks.
    pub fn axis_bytes(&self, axis: Axis) -> u64 {
        self.items
            .iter()
            .filter(|i| i.axis == axis)
            .map(|i| i.bytes)
            .sum()
    }
    /// Bytes over `axis` excluding MoE dispatch (routing-dependent).
    pub fn axis_bytes_without_dispatch(&self, axis: Axis) -> u64 {
        self.items
            .iter()
            .filter(|i| i.axis == axis && i.what != MOE_DISPATCH)
            .map(|i| i.bytes)
            .sum()
    }
    /// Bytes sent over `axis` per token of the global batch (all ranks together: the
    /// step's total divided by the step's tokens).
    pub fn bytes_per_token(&self, axis: Axis) -> f64 {
        self.axis_bytes(axis) as f64 / self.tokens as f64
    }
    /// The peak of live tensor bytes on the busiest rank (what
    /// `dtensor_kernels::memory::peak_bytes` reports).
    pub fn peak_bytes(&self) -> u64 {
        self.memory.total(self.composition.recompute)
    }
}

/// The item name of MoE dispatch and combine traffic.
pub const MOE_DISPATCH: &str = "moe dispatch+combine (uniform routing)";

/// The plan of `model` under `c`, or why `c` cannot run it (as `dtensor-nn` would refuse).
pub fn plan(model: &Model, c: &Composition) -> Result<Plan, String> {
    validate(model, c)?;
    let items = comm(model, c);
    let memory = memory(model, c);
    Ok(Plan {
        model: model.clone(),
        composition: *c,
        items,
        memory,
        bubble: bubble(c)?,
        tokens: (model.global_batch * model.seq_len) as u64,
    })
}

fn validate(m: &Model, c: &Composition) -> Result<(), String> {
    let data_ranks = c.degrees.dp * c.degrees.ep;
    if !m.global_batch.is_multiple_of(data_ranks * c.microbatches) {
        return Err(format!(
            "the batch {} does not divide into {} microbatches over dp·ep = {data_ranks}",
            m.global_batch, c.microbatches
        ));
    }
    if !m.heads.is_multiple_of(c.degrees.tp) {
        return Err(format!(
            "{} heads do not divide by tp={}",
            m.heads, c.degrees.tp
        ));
    }
    if !m.kv_heads.is_multiple_of(c.degrees.tp) {
        return Err(format!(
            "{} KV heads do not divide by tp={} (each tp rank holds whole KV groups)",
            m.kv_heads, c.degrees.tp
        ));
    }
    if !m.vocab.is_multiple_of(c.degrees.tp) || !m.ffn.is_multiple_of(c.degrees.tp) {
        return Err(format!(
            "vocab {} and ffn {} must divide by tp={}",
            m.vocab, m.ffn, c.degrees.tp
        ));
    }
    if !m.layers.is_multiple_of(c.stages()) {
        return Err(format!(
            "{} layers do not divide into {} stages",
            m.layers,
            c.stages()
        ));
    }
    if c.degrees.pp > 1 && c.microbatches < c.degrees.pp && c.schedule != ScheduleKind::GPipe {
        return Err(format!(
            "{} microbatches are fewer than pp={}",
            c.microbatches, c.degrees.pp
        ));
    }
    if c.degrees.cp > 1 {
        if !m.seq_len.is_multiple_of(2 * c.degrees.cp) {
            return Err(format!(
                "seq {} does not divide into 2·cp = {} chunks",
                m.seq_len,
                2 * c.degrees.cp
            ));
        }
        if c.cp_strategy == CpStrategy::AllToAll
            && !(m.kv_heads / c.degrees.tp).is_multiple_of(c.degrees.cp)
        {
            return Err(format!(
                "all-to-all CP needs the KV heads per tp rank ({}) to divide by cp={}",
                m.kv_heads / c.degrees.tp,
                c.degrees.cp
            ));
        }
    }
    match m.moe {
        Some(moe) if moe.experts % c.degrees.ep != 0 => {
            return Err(format!(
                "{} experts do not divide by ep={}",
                moe.experts, c.degrees.ep
            ))
        }
        None if c.degrees.ep > 1 => return Err("ep > 1 needs a MoE model".into()),
        _ => {}
    }
    if c.degrees.sp && c.degrees.tp < 2 {
        return Err("sp needs tp > 1".into());
    }
    if c.degrees.sp
        && !(m.seq_len * m.global_batch
            / (c.degrees.dp * c.degrees.ep * c.degrees.cp * c.microbatches))
            .is_multiple_of(c.degrees.tp)
    {
        return Err("sp: the tokens per rank do not divide by tp".into());
    }
    Ok(())
}

/// The communication bill of one step (see the crate docs for each line).
pub fn comm(m: &Model, c: &Composition) -> Vec<CommItem> {
    let mut items: Vec<CommItem> = Vec::new();
    let mut add = |axis: Axis, what: &'static str, bytes: u64| {
        if bytes > 0 {
            match items.iter_mut().find(|i| i.axis == axis && i.what == what) {
                Some(i) => i.bytes += bytes,
                None => items.push(CommItem { axis, what, bytes }),
            }
        }
    };
    let w = c.world() as u64;
    let r = w / c.degrees.pp as u64; // ranks per stage
    let (pp, dp, ep, cp, tp) = (
        c.degrees.pp as u64,
        c.degrees.dp as u64,
        c.degrees.ep as u64,
        c.degrees.cp as u64,
        c.degrees.tp as u64,
    );
    let mb = c.microbatches as u64;
    let h = m.hidden as u64;
    let layers = m.layers as u64;
    let tokens = (m.global_batch * m.seq_len) as u64;
    // Tokens a rank holds per microbatch (before SP's split over tp).
    let t = tokens / (mb * dp * ep * cp);
    let (cb, rb, gb, lb) = (
        c.compute_bytes(),
        c.reduce_bytes(),
        c.gather_bytes(),
        c.master_bytes(),
    );
    let ar = |n: u64, len: u64| 2 * (n - 1) * len;
    let ag = |n: u64, len: u64| (n - 1) * len;

    // ---- Tp: activations.
    let tp_groups = r / tp;
    let passes = if c.recompute { 3 } else { 2 };
    // Attention and the dense MLP; a MoE MLP has no tensor parallelism inside (its
    // experts are replicated over Tp), so no Tp collectives.
    let tp_regions = if m.moe.is_some() { 1 } else { 2 };
    add(
        Axis::Tp,
        "blocks: attention + MLP entries/exits",
        layers * mb * tp_groups * passes * tp_regions * ar(tp, t * h) * cb,
    );
    add(
        Axis::Tp,
        "embedding exit",
        mb * tp_groups * ar(tp, t * h) * cb,
    );
    add(
        Axis::Tp,
        "LM head entry",
        mb * tp_groups * ar(tp, t * h) * cb,
    );
    add(
        Axis::Tp,
        "cross-entropy statistics",
        mb * tp_groups * 3 * ar(tp, t) * 8,
    );
    // The global batch's scored-token count (the loss's divisor): one f64 all-reduced
    // per step over each axis that splits the tokens, by every stage.
    for (axis, n) in [(Axis::Dp, dp), (Axis::Ep, ep), (Axis::Cp, cp)] {
        add(axis, "scored-token count", (w / n) * ar(n, 1) * 8);
    }

    // ---- Parameters: Dp, Tp (SP), Ep, Cp.
    let params = param_list(m, c.degrees.tp, c.degrees.ep, c.degrees.sp);
    for p in &params {
        let len = p.local;
        // Groups of each axis among the stage's ranks that hold this parameter.
        let dp_groups = r / dp;
        let sharded = c.data != DataKind::Ddp && p.dp_shardable();
        match (c.data, p.dp_shardable()) {
            (DataKind::Ddp, _) | (_, false) => {
                let times =
                    if p.dp_shardable() || !matches!(c.data, DataKind::Zero2 | DataKind::Fsdp) {
                        1
                    } else {
                        mb
                    };
                add(
                    Axis::Dp,
                    "gradient all-reduce",
                    times * dp_groups * ar(dp, len) * rb,
                )
            }
            (DataKind::Zero1, true) => {
                add(
                    Axis::Dp,
                    "gradient reduce-scatter",
                    dp_groups * ag(dp, len) * rb,
                );
                add(
                    Axis::Dp,
                    "updated shard all-gather",
                    dp_groups * ag(dp, len) * cb,
                );
            }
            (DataKind::Zero2, true) => {
                add(
                    Axis::Dp,
                    "gradient reduce-scatter",
                    mb * dp_groups * ag(dp, len) * rb,
                );
                add(
                    Axis::Dp,
                    "updated shard all-gather",
                    dp_groups * ag(dp, len) * cb,
                );
            }
            (DataKind::Fsdp, true) => {
                let recomputed_block = c.recompute && matches!(p.place, Place::Block(_));
                let gathers = 1 + c.reshard as u64 + recomputed_block as u64;
                add(
                    Axis::Dp,
                    "parameter all-gather",
                    gathers * mb * dp_groups * ag(dp, len) * gb,
                );
                add(
                    Axis::Dp,
                    "gradient reduce-scatter",
                    mb * dp_groups * ag(dp, len) * gb,
                );
            }
        }
        if c.degrees.sp && p.tp_replicated() {
            // Once per step, on the master's Dp shard (the shards of a Dp group add up
            // to the whole).
            let total_over_dp = if sharded { len } else { dp * len };
            add(
                Axis::Tp,
                "SP parameter gradients",
                (r / (tp * dp)) * ar(tp, total_over_dp) * lb,
            );
        }
        if p.dense() {
            add(
                Axis::Ep,
                "gradient all-reduce (per microbatch)",
                mb * (r / ep) * ar(ep, len) * cb,
            );
        }
        add(
            Axis::Cp,
            "gradient all-reduce (per microbatch)",
            mb * (r / cp) * ar(cp, len) * cb,
        );
    }

    // ---- Cp: attention.
    if cp > 1 {
        let dh = h / tp; // d·H: a tp rank's query heads
        let dkv = m.kv_width() as u64 / tp; // d·KV: its key (or value) heads
        let per_rank_layer = match c.cp_strategy {
            CpStrategy::Ring => {
                // Only K and V travel the ring.
                let fwd = 2 * dkv * (cp - 1) * t * cb;
                let grad_bytes = if c.bf16 { c.master_bytes() } else { cb };
                let bwd = 2 * dkv * (cp - 1) * t * cb + 2 * dkv * cp * t * grad_bytes;
                fwd * (1 + c.recompute as u64) + bwd
            }
            CpStrategy::AllToAll => {
                // q, k, v in and the output back, each way in the backward.
                let one = (2 * dh + 2 * dkv) * (cp - 1) * t / cp * cb;
                one * (2 + c.recompute as u64)
            }
        };
        add(
            Axis::Cp,
            "attention (ring K/V or all-to-all)",
            r * layers * mb * per_rank_layer,
        );
    }

    // ---- MoE dispatch (uniform routing expectation).
    if let (Some(moe), true) = (m.moe, ep > 1) {
        let k = moe.top_k as u64;
        // Per rank per MoE layer: k copies of each token, (ep−1)/ep of them leave;
        // dispatch + combine, forward and backward.
        // Under SP each tp rank routes its sequence shard.
        let routed = if c.degrees.sp { t / tp } else { t };
        let per = 4 * k * routed * h * (ep - 1) / ep * cb;
        add(
            Axis::Ep,
            MOE_DISPATCH,
            r * layers * mb * per * (1 + c.recompute as u64),
        );
    }

    // ---- The loss (last stage): all-reduce over Dp, Ep, Cp; broadcast over Pp.
    for (axis, n) in [(Axis::Dp, dp), (Axis::Ep, ep), (Axis::Cp, cp)] {
        add(axis, "loss", (r / n) * ar(n, 1) * lb);
    }
    if pp > 1 {
        add(Axis::Pp, "loss broadcast", r * ag(pp, 1) * 8);
        // ---- Pp: hops.
        let boundaries = c.stages() as u64 - 1;
        let local = if c.degrees.sp { t * h / tp } else { t * h };
        add(
            Axis::Pp,
            "stage hops (activation + gradient)",
            boundaries * mb * r * 2 * local * cb,
        );
    }
    items
}

/// The pipeline bubble of the schedule (idle fraction of a rank's step, equal stage
/// costs): dtensor-nn's [`bubble_fraction`](dtensor_nn::pipeline::bubble_fraction), the
/// formula its schedule simulator meets. `Err` where the schedule has none (ZB-H1 with fewer
/// microbatches than stages, which [`plan`] refuses).
pub fn bubble(c: &Composition) -> Result<f64, String> {
    let (pp, m, v) = (c.degrees.pp, c.microbatches, c.virtual_stages);
    dtensor_nn::pipeline::bubble_fraction(c.schedule, pp, m, v).ok_or_else(|| {
        format!(
            "no bubble formula for {} with pp={pp}, {m} microbatches, v={v}",
            c.schedule
        )
    })
}

/// Per-rank memory (see [`Memory`]); the busiest pipeline stage.
pub fn memory(m: &Model, c: &Composition) -> Memory {
    let params = param_list(m, c.degrees.tp, c.degrees.ep, c.degrees.sp);
    let stages = c.stages();
    let per_stage = m.layers / stages.max(1);
    let stage_of = |p: &ParamInfo| -> usize {
        match p.place {
            Place::Embedding => 0,
            Place::Block(l) => l / per_stage.max(1),
            Place::Head => stages - 1,
        }
    };
    let (mbytes, cb) = (c.master_bytes(), c.compute_bytes());
    let dp = c.degrees.dp as u64;
    let mut best = Memory::default();
    // A pipeline rank holds stages r, r+pp, ... (interleaved).
    for rank in 0..c.degrees.pp {
        let mut mem = Memory::default();
        for p in params.iter().filter(|p| stage_of(p) % c.degrees.pp == rank) {
            let sharded = c.data != DataKind::Ddp && p.dp_shardable();
            let shard = if sharded {
                p.local.div_ceil(dp)
            } else {
                p.local
            };
            mem.params += shard * mbytes;
            // Compute copy: ZeRO keeps a replicated one, any mode one in another dtype.
            let work = match c.data {
                DataKind::Zero1 | DataKind::Zero2 if sharded => p.local * cb,
                _ if c.bf16 => shard * cb,
                _ => 0,
            };
            mem.params += work;
            let grad = match c.data {
                DataKind::Zero2 | DataKind::Fsdp => shard,
                _ => p.local,
            };
            mem.grads += grad * mbytes;
            mem.optimizer += 2 * shard * mbytes;
        }
        let (mut act, mut act_rc) = activations(m, c, rank);
        if c.data == DataKind::Fsdp && !c.reshard {
            // Without reshard every gathered parameter is kept until its backward.
            let gathered: u64 = params
                .iter()
                .filter(|p| stage_of(p) % c.degrees.pp == rank && p.dp_shardable())
                .map(|p| p.local * c.compute_bytes())
                .sum();
            act += gathered;
            act_rc += gathered;
        }
        mem.activations = act;
        mem.activations_recompute = act_rc;
        mem.inputs = 2 * 2 * 8 * (m.global_batch * m.seq_len) as u64;
        mem.grads_at_peak = c.microbatches > 1 || c.degrees.pp > 1;
        if mem.total(c.recompute) > best.total(c.recompute) {
            best = mem;
        }
    }
    best
}

/// Activation bytes at a pipeline rank's peak, without and with recomputation. Calibrated
/// on this implementation's tape (what `dtensor_kernels::memory` counts), per token a rank
/// holds per microbatch:
///
/// - a block keeps, in the compute dtype, the stream-shaped tensors (norm outputs, the row
///   layers' reduced outputs, bias sums and residual sums: `8h` with biases, `6h` without;
///   SP: `8h/tp` and one gathered `h`), the tensor-parallel ones (QKV and its bias sum
///   `6h/tp`, the attention output `h/tp`, the MLP's `fc1`, bias sum and activation
///   `3·ffn/tp`; SwiGLU one more `2·ffn/tp`), and in f32 the attention's log-sum-exp
///   (`heads/tp`) and the norms' statistics (1 per norm, LayerNorm 2; SP: `/tp`);
/// - the last stage's loss head keeps the logits, their f64 softmax and its gradient
///   (`(2·master + 8)·vocab/tp` bytes) and `2h` stream values (SP: `h + h/tp`);
/// - with recomputation a block keeps its input and its output's statistics (measured
///   `1.5h + 2` elements) and one block at a time is rebuilt (half a block at the peak).
///
/// Microbatches in flight: 1 without pipelining, `m` under GPipe, `pp − rank` under 1F1B
/// and interleaved, `pp − rank + 1` under ZB-H1 (measured: its deferred weight passes hold
/// one more microbatch).
fn activations(m: &Model, c: &Composition, rank: usize) -> (u64, u64) {
    let cb = c.compute_bytes() as f64;
    let mb = c.master_bytes() as f64;
    let tokens = (m.global_batch * m.seq_len) as f64;
    let t = tokens / (c.microbatches * c.degrees.dp * c.degrees.ep * c.degrees.cp) as f64;
    let (h, f, tp) = (m.hidden as f64, m.ffn as f64, c.degrees.tp as f64);
    let heads = (m.heads / c.degrees.tp) as f64;
    let bias = m.bias as u8 as f64;
    let stats_per_norm = if m.layer_norm { 2.0 } else { 1.0 };
    let stream = if c.degrees.sp {
        (6.0 + 2.0 * bias) * h / tp + h
    } else {
        (6.0 + 2.0 * bias) * h
    };
    let mlp = match m.activation {
        Activation::Gelu => (2.0 + bias) * f / tp,
        Activation::SwiGlu => (4.0 + 2.0 * bias) * f / tp,
    };
    let qkv = h + 2.0 * m.kv_width() as f64;
    let local = (1.0 + bias) * qkv / tp + h / tp + mlp;
    let stats = 2.0 * stats_per_norm / if c.degrees.sp { tp } else { 1.0 };
    let block = (stream + local) * cb + (heads + stats) * 4.0;
    let per_stage_blocks = (m.layers / c.degrees.pp) as f64;
    let in_flight = match c.schedule {
        _ if c.degrees.pp == 1 => 1.0,
        ScheduleKind::GPipe => c.microbatches as f64,
        // ZB-H1's deferred weight passes keep one more microbatch's block inputs.
        ScheduleKind::ZeroBubbleH1 => (c.degrees.pp - rank + 1).min(c.microbatches) as f64,
        _ => (c.degrees.pp - rank).min(c.microbatches) as f64,
    };
    let head = if rank == c.degrees.pp - 1 {
        let v = m.vocab as f64 / tp;
        let stream = if c.degrees.sp { h + h / tp } else { 2.0 * h };
        let stats = stats_per_norm / if c.degrees.sp { tp } else { 1.0 };
        (2.0 * mb + 8.0) * v + stream * cb + (1.0 + stats) * 4.0
    } else {
        0.0
    };
    let full = in_flight * t * per_stage_blocks * block + t * head;
    let kept = (1.5 * h / if c.degrees.sp { tp } else { 1.0 } + 2.0) * cb;
    let rc = in_flight * t * per_stage_blocks * kept + t * (block / 2.0 + head);
    (full as u64, rc as u64)
}

/// `n` with a unit (k, M, B).
pub fn count(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.2} B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{:.2} M", n as f64 / 1e6),
        n if n >= 10_000 => format!("{:.1} k", n as f64 / 1e3),
        n => n.to_string(),
    }
}

/// `bytes` in B, KiB, MiB, GiB or TiB.
pub fn human(bytes: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} {}", units[u])
    } else {
        format!("{v:.2} {}", units[u])
    }
}

impl Plan {
    /// The plan as text: memory per rank, bytes per axis (per step summed over ranks, per
    /// rank, per token per rank) with the items behind them, the bubble.
    pub fn report(&self) -> String {
        let (m, c) = (&self.model, &self.composition);
        let mem = &self.memory;
        let mut s = format!(
            "model {}: {} parameters, {} layers, hidden {}, {} heads, ffn {}, vocab {}, seq {}, batch {} ({} tokens/step){}\n",
            m.name,
            count(m.parameters()),
            m.layers,
            m.hidden,
            m.heads,
            m.ffn,
            m.vocab,
            m.seq_len,
            m.global_batch,
            self.tokens,
            m.moe.map_or(String::new(), |e| format!(", MoE {} experts top-{}", e.experts, e.top_k)),
        );
        s += &format!("composition {c} on {} ranks\n", c.world());
        s += &format!(
            "memory per rank: params {}  grads {}  optimizer {}  activations {} (recomputed: {})  total {}{}\n",
            human(mem.params as f64),
            human(mem.grads as f64),
            human(mem.optimizer as f64),
            human(mem.activations as f64),
            human(mem.activations_recompute as f64),
            human(self.peak_bytes() as f64),
            if c.recompute { " (with recomputation)" } else { "" },
        );
        s += "bytes sent per step: all ranks | per rank | per token (all ranks):\n";
        let world = c.world() as f64;
        for a in Axis::ALL {
            let total = self.axis_bytes(a);
            if total == 0 {
                continue;
            }
            let label = match a {
                Axis::Tp if c.degrees.sp => "tp+sp".to_string(),
                Axis::Dp if c.data == DataKind::Fsdp => "dp (fsdp)".to_string(),
                Axis::Dp if c.data == DataKind::Zero1 => "dp (zero1)".to_string(),
                Axis::Dp if c.data == DataKind::Zero2 => "dp (zero2)".to_string(),
                _ => a.name().to_string(),
            };
            s += &format!(
                "  {:<10} {:>12} | {:>12} | {:>10.1} B\n",
                format!("{label}:"),
                human(total as f64),
                human(total as f64 / world),
                self.bytes_per_token(a)
            );
            for i in self.items.iter().filter(|i| i.axis == a) {
                s += &format!("      {:<44} {:>12}\n", i.what, human(i.bytes as f64));
            }
        }
        if c.degrees.pp > 1 {
            s += &format!("pipeline bubble: {:.3}\n", self.bubble);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn composition_spec_of_the_planner_keeps_parsing() {
        for spec in [
            "dp=2,tp=2,sp",
            "dp=2,tp=2,sp,zero1,m=4",
            "pp=2,dp=2,fsdp,no-reshard,recompute,m=4,gpipe",
            "pp=2,dp=2,zero1,m=2,interleaved,v=2",
            "cp=2,tp=2,a2a,bf16",
            "ep=2,zero2,bf16,reduce-bf16",
        ] {
            let c: Composition = spec.parse().unwrap();
            assert_eq!(
                c.to_string(),
                spec,
                "the planner's reports print the spec as given"
            );
        }
        let issue: Composition = "dp=2,tp=2,sp,zero1,1f1b,m=4".parse().unwrap();
        assert_eq!(issue.to_string(), "dp=2,tp=2,sp,zero1,m=4");
        assert!("tp=1,sp".parse::<Composition>().is_err());
        assert!("dp=2,warp".parse::<Composition>().is_err());
    }

    #[test]
    fn gpt_small_is_train_gpts_model() {
        let m = Model::preset("gpt-small").unwrap();
        // GptConfig::small: embedding 256·64, 2 blocks of 49 856, final norm 64, head 256·64.
        assert_eq!(m.parameters(), 16384 + 2 * 49856 + 64 + 16384);
        assert!((Model::preset("7b").unwrap().parameters() as f64 / 6.74e9 - 1.0).abs() < 0.01);
    }

    #[test]
    fn model_files_parse_and_typos_are_refused() {
        let m = Model::from_json(
            r#"{"vocab":512,"hidden":128,"heads":4,"layers":4,"ffn":512,"seq_len":128,
                "global_batch":16,"norm":"layer","activation":"swiglu","bias":false,
                "moe":{"experts":8,"top_k":2}}"#,
        )
        .unwrap();
        assert!(m.layer_norm && !m.bias && m.activation == Activation::SwiGlu);
        assert_eq!(
            m.moe,
            Some(Moe {
                experts: 8,
                top_k: 2
            })
        );
        let typo = Model::from_json(
            r#"{"vocab":512,"hiden":128,"heads":4,"layers":4,"ffn":512,"seq_len":128,"global_batch":16}"#,
        );
        assert!(typo.unwrap_err().contains("hiden"));
    }

    #[test]
    fn refuses_what_dtensor_refuses() {
        let m = Model::preset("gpt-small").unwrap();
        for spec in ["tp=8", "dp=16", "pp=4", "ep=2", "cp=4,tp=2,a2a", "pp=2,m=1"] {
            assert!(plan(&m, &spec.parse().unwrap()).is_err(), "{spec}");
        }
    }

    #[test]
    fn size_one_axes_move_nothing() {
        let m = Model::preset("gpt-small").unwrap();
        let p = plan(&m, &"dp=1".parse().unwrap()).unwrap();
        assert!(Axis::ALL.iter().all(|&a| p.axis_bytes(a) == 0));
    }

    #[test]
    fn search_refuses_what_does_not_fit() {
        let m = Model::preset("70b").unwrap();
        let net = Interconnect::default();
        let ranked = rank(&m, 8, &net);
        assert!(!ranked.is_empty() && ranked.iter().all(|r| r.over_bytes > 0));
        let ranked = rank(&m, 64, &net);
        assert!(ranked[0].over_bytes == 0);
        assert!(ranked[0].plan.peak_bytes() <= (131u64 << 30));
    }
}
