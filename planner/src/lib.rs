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
//! | Cp | ring attention | K,V forward; K,V and dK,dV backward | per rank per layer `2dH(cp−1)T` + `2dH(cp−1)T + 2dH·cp·T` |
//! | Cp | all-to-all attention | QKV in, output back; adjoints | per rank per layer `4dH(cp−1)/cp·T` each way |
//! | Dp, Ep, Cp | the loss (last stage) | all-reduce of 1 element | `2(n−1)` |
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

use std::fmt;
use std::str::FromStr;

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

/// How parameters are held over `Dp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataKind {
    /// Parameters, gradients and optimizer state replicated over `Dp`; gradients
    /// all-reduced once per step.
    Ddp,
    /// ZeRO-1: optimizer state (and masters) sharded over `Dp`; gradients reduce-scattered
    /// once per step, the updated shards all-gathered.
    Zero1,
    /// ZeRO-2: gradients sharded too, reduce-scattered per microbatch; the updated shards
    /// all-gathered once per step.
    Zero2,
    /// FSDP: parameters sharded over `Dp`, all-gathered per microbatch before use (again
    /// in the backward with [`Composition::reshard`]); gradients reduce-scattered per
    /// microbatch.
    Fsdp,
}

/// Attention over `Cp`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpImpl {
    /// Ring attention: K and V pass round the `Cp` ring (send/recv), with an online
    /// softmax; dK and dV travel back in the backward.
    Ring,
    /// All-to-all (Ulysses): QKV re-sharded from the sequence to the heads and the output
    /// back; needs the heads per `Tp` rank to divide by `cp`.
    AllToAll,
}

/// The pipeline schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    /// GPipe: every microbatch's forward, then every backward; bubble
    /// `(pp−1)/(m+pp−1)`, all `m` microbatches' activations live at the peak.
    Gpipe,
    /// 1F1B: after a warm-up, one forward then one backward; GPipe's bubble with at most
    /// `pp − rank` microbatches in flight.
    OneFOneB,
    /// Interleaved 1F1B: each pipeline rank holds [`Composition::virtual_stages`] model
    /// chunks; bubble `(pp−1)/(v·m+pp−1)`.
    Interleaved,
    /// ZB-H1: the backward split into input and weight passes, the weight passes deferred
    /// into the bubble; a third of 1F1B's bubble, one more microbatch in flight.
    ZeroBubble,
}

/// One way to run the model: the degrees and every switch that changes bytes or memory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Composition {
    /// The pipeline degree: the number of pipeline stages ([`Axis::Pp`]).
    pub pp: usize,
    /// The data-parallel degree ([`Axis::Dp`]).
    pub dp: usize,
    /// The expert-parallel degree ([`Axis::Ep`]); above 1 only for a MoE model, whose
    /// expert count it must divide.
    pub ep: usize,
    /// The context-parallel degree ([`Axis::Cp`]); above 1, the sequence must divide into
    /// `2·cp` chunks.
    pub cp: usize,
    /// The tensor-parallel degree ([`Axis::Tp`]); heads, vocabulary and ffn must divide
    /// by it.
    pub tp: usize,
    /// Sequence parallelism over `Tp` (needs `tp > 1`): norms and residuals stay sharded
    /// over the sequence, and each `Tp` all-reduce becomes an all-gather and a
    /// reduce-scatter.
    pub sp: bool,
    /// How parameters, gradients and optimizer state are held over `Dp`.
    pub data: DataKind,
    /// FSDP: gather again in the backward (default true, as train_gpt).
    pub reshard: bool,
    /// Activation recomputation: each block keeps only its input and is run again in the
    /// backward (one more forward's `Tp` traffic and compute, far less activation memory).
    pub recompute: bool,
    /// Microbatches per optimizer step (gradient accumulation, and the pipeline's
    /// microbatches); the global batch must divide by `dp·ep·microbatches`.
    pub microbatches: usize,
    /// The pipeline schedule (used when `pp > 1`).
    pub schedule: ScheduleKind,
    /// Model chunks per pipeline rank (interleaved schedule).
    pub virtual_stages: usize,
    /// How attention runs over `Cp` (used when `cp > 1`).
    pub cp_impl: CpImpl,
    /// bf16 compute copies and activations, f32 masters and optimizer state.
    pub bf16: bool,
    /// With `bf16`: reduce gradients in bf16 (default f32, as train_gpt).
    pub reduce_bf16: bool,
    /// Bytes of a master element (4: f32; train_gpt's `--dtype f64` would be 8).
    pub master_bytes: u64,
}

impl Default for Composition {
    fn default() -> Self {
        Composition {
            pp: 1,
            dp: 1,
            ep: 1,
            cp: 1,
            tp: 1,
            sp: false,
            data: DataKind::Ddp,
            reshard: true,
            recompute: false,
            microbatches: 1,
            schedule: ScheduleKind::OneFOneB,
            virtual_stages: 1,
            cp_impl: CpImpl::Ring,
            bf16: false,
            reduce_bf16: false,
            master_bytes: 4,
        }
    }
}

impl Composition {
    /// The number of ranks: the product of the five degrees.
    pub fn world(&self) -> usize {
        self.pp * self.dp * self.ep * self.cp * self.tp
    }
    /// Bytes of a compute element (parameters as used, activations, stage hops).
    pub fn compute_bytes(&self) -> u64 {
        if self.bf16 {
            2
        } else {
            self.master_bytes
        }
    }
    /// Bytes of a gradient element in the `Dp` reduction.
    pub fn reduce_bytes(&self) -> u64 {
        if self.bf16 && self.reduce_bf16 {
            2
        } else {
            self.master_bytes
        }
    }
    /// Bytes of an FSDP gather element: with bf16 compute and an f32 reduction the gather
    /// runs in f32 and casts after (its adjoint reduce-scatters in f32).
    pub fn gather_bytes(&self) -> u64 {
        if self.bf16 && !self.reduce_bf16 {
            self.master_bytes
        } else {
            self.compute_bytes()
        }
    }
    fn degree(&self, a: Axis) -> usize {
        match a {
            Axis::Pp => self.pp,
            Axis::Dp => self.dp,
            Axis::Ep => self.ep,
            Axis::Cp => self.cp,
            Axis::Tp => self.tp,
        }
    }
    fn stages(&self) -> usize {
        self.pp
            * if self.schedule == ScheduleKind::Interleaved {
                self.virtual_stages
            } else {
                1
            }
    }
}

impl fmt::Display for Composition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        for a in Axis::ALL {
            if self.degree(a) > 1 {
                parts.push(format!("{}={}", a.name(), self.degree(a)));
            }
        }
        if parts.is_empty() {
            parts.push("dp=1".into());
        }
        if self.sp {
            parts.push("sp".into());
        }
        match self.data {
            DataKind::Ddp => {}
            DataKind::Zero1 => parts.push("zero1".into()),
            DataKind::Zero2 => parts.push("zero2".into()),
            DataKind::Fsdp => parts.push(if self.reshard {
                "fsdp".into()
            } else {
                "fsdp,no-reshard".into()
            }),
        }
        if self.recompute {
            parts.push("recompute".into());
        }
        if self.pp > 1 {
            parts.push(format!("m={}", self.microbatches));
            parts.push(match self.schedule {
                ScheduleKind::Gpipe => "gpipe".to_string(),
                ScheduleKind::OneFOneB => "1f1b".to_string(),
                ScheduleKind::Interleaved => format!("interleaved,v={}", self.virtual_stages),
                ScheduleKind::ZeroBubble => "zb".to_string(),
            });
        } else if self.microbatches > 1 {
            parts.push(format!("m={}", self.microbatches));
        }
        if self.cp > 1 && self.cp_impl == CpImpl::AllToAll {
            parts.push("a2a".into());
        }
        if self.bf16 {
            parts.push(if self.reduce_bf16 {
                "bf16,reduce-bf16".into()
            } else {
                "bf16".into()
            });
        }
        write!(f, "{}", parts.join(","))
    }
}

impl FromStr for Composition {
    type Err = String;
    /// `pp=2,dp=2,ep=1,cp=2,tp=2` and the flags `sp`, `zero1`, `zero2`, `fsdp`,
    /// `no-reshard`, `recompute`, `m=<microbatches>` (default `pp`), `gpipe`, `1f1b`
    /// (default), `interleaved`, `zb`, `v=<chunks>` (interleaved, default 2), `ring`
    /// (default), `a2a`, `bf16`, `reduce-bf16`.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut c = Composition::default();
        let mut m = None;
        let mut v = None;
        for item in s.split(',').map(str::trim).filter(|x| !x.is_empty()) {
            let (k, val) = match item.split_once('=') {
                Some((k, v)) => (k.trim(), Some(v.trim())),
                None => (item, None),
            };
            let num = || -> Result<usize, String> {
                val.and_then(|x| x.parse().ok())
                    .filter(|&x: &usize| x > 0)
                    .ok_or_else(|| format!("`{item}`: expected {k}=<positive integer>"))
            };
            match k {
                "pp" => c.pp = num()?,
                "dp" => c.dp = num()?,
                "ep" => c.ep = num()?,
                "cp" => c.cp = num()?,
                "tp" => c.tp = num()?,
                "m" | "microbatches" => m = Some(num()?),
                "v" | "virtual" => v = Some(num()?),
                "sp" => c.sp = true,
                "ddp" => c.data = DataKind::Ddp,
                "zero1" => c.data = DataKind::Zero1,
                "zero2" => c.data = DataKind::Zero2,
                "fsdp" => c.data = DataKind::Fsdp,
                "no-reshard" => c.reshard = false,
                "recompute" => c.recompute = true,
                "gpipe" => c.schedule = ScheduleKind::Gpipe,
                "1f1b" => c.schedule = ScheduleKind::OneFOneB,
                "interleaved" => c.schedule = ScheduleKind::Interleaved,
                "zb" | "zb-h1" => c.schedule = ScheduleKind::ZeroBubble,
                "ring" => c.cp_impl = CpImpl::Ring,
                "a2a" => c.cp_impl = CpImpl::AllToAll,
                "bf16" => c.bf16 = true,
                "reduce-bf16" => {
                    c.bf16 = true;
                    c.reduce_bf16 = true
                }
                _ => return Err(format!("unknown composition item `{item}`")),
            }
        }
        c.microbatches = m.unwrap_or(c.pp);
        if c.schedule == ScheduleKind::Interleaved {
            c.virtual_stages = v.unwrap_or(2);
        }
        if c.sp && c.tp < 2 {
            return Err("`sp` needs tp > 1".into());
        }
        Ok(c)
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
        bubble: bubble(c),
        tokens: (model.global_batch * model.seq_len) as u64,
    })
}

fn validate(m: &Model, c: &Composition) -> Result<(), String> {
    let data_ranks = c.dp * c.ep;
    if m.global_batch % (data_ranks * c.microbatches) != 0 {
        return Err(format!(
            "the batch {} does not divide into {} microbatches over dp·ep = {data_ranks}",
            m.global_batch, c.microbatches
        ));
    }
    if m.heads % c.tp != 0 {
        return Err(format!("{} heads do not divide by tp={}", m.heads, c.tp));
    }
    if m.vocab % c.tp != 0 || m.ffn % c.tp != 0 {
        return Err(format!(
            "vocab {} and ffn {} must divide by tp={}",
            m.vocab, m.ffn, c.tp
        ));
    }
    if m.layers % c.stages() != 0 {
        return Err(format!(
            "{} layers do not divide into {} stages",
            m.layers,
            c.stages()
        ));
    }
    if c.pp > 1 && c.microbatches < c.pp && c.schedule != ScheduleKind::Gpipe {
        return Err(format!(
            "{} microbatches are fewer than pp={}",
            c.microbatches, c.pp
        ));
    }
    if c.cp > 1 {
        if m.seq_len % (2 * c.cp) != 0 {
            return Err(format!(
                "seq {} does not divide into 2·cp = {} chunks",
                m.seq_len,
                2 * c.cp
            ));
        }
        if c.cp_impl == CpImpl::AllToAll && (m.heads / c.tp) % c.cp != 0 {
            return Err(format!(
                "all-to-all CP needs the heads per tp rank ({}) to divide by cp={}",
                m.heads / c.tp,
                c.cp
            ));
        }
    }
    match m.moe {
        Some(moe) if moe.experts % c.ep != 0 => {
            return Err(format!(
                "{} experts do not divide by ep={}",
                moe.experts, c.ep
            ))
        }
        None if c.ep > 1 => return Err("ep > 1 needs a MoE model".into()),
        _ => {}
    }
    if c.sp && c.tp < 2 {
        return Err("sp needs tp > 1".into());
    }
    if c.sp && (m.seq_len * m.global_batch / (c.dp * c.ep * c.cp * c.microbatches)) % c.tp != 0 {
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
    let r = w / c.pp as u64; // ranks per stage
    let (pp, dp, ep, cp, tp) = (
        c.pp as u64,
        c.dp as u64,
        c.ep as u64,
        c.cp as u64,
        c.tp as u64,
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
        c.master_bytes,
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

    // ---- Parameters: Dp, Tp (SP), Ep, Cp.
    let params = param_list(m, c.tp, c.ep, c.sp);
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
        if c.sp && p.tp_replicated() {
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
        let dh = h / tp; // d·H: a tp rank's heads
        let per_rank_layer = match c.cp_impl {
            CpImpl::Ring => {
                let fwd = 2 * dh * (cp - 1) * t * cb;
                let dkv = if c.bf16 { c.master_bytes } else { cb };
                let bwd = 2 * dh * (cp - 1) * t * cb + 2 * dh * cp * t * dkv;
                fwd * (1 + c.recompute as u64) + bwd
            }
            CpImpl::AllToAll => {
                let one = 4 * dh * (cp - 1) * t / cp * cb;
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
        let routed = if c.sp { t / tp } else { t };
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
        let local = if c.sp { t * h / tp } else { t * h };
        add(
            Axis::Pp,
            "stage hops (activation + gradient)",
            boundaries * mb * r * 2 * local * cb,
        );
    }
    items
}

/// The pipeline bubble of the schedule (idle fraction of a rank's step, equal stage
/// costs): GPipe and 1F1B `(pp−1)/(m+pp−1)`, interleaved with `v` chunks
/// `(pp−1)/(v·m+pp−1)`, ZB-H1 a third of 1F1B's (its `W` passes fill two thirds of the
/// cool-down).
pub fn bubble(c: &Composition) -> f64 {
    if c.pp <= 1 {
        return 0.0;
    }
    let (p, m) = (c.pp as f64, c.microbatches as f64);
    match c.schedule {
        ScheduleKind::Gpipe | ScheduleKind::OneFOneB => (p - 1.0) / (m + p - 1.0),
        ScheduleKind::Interleaved => (p - 1.0) / (c.virtual_stages as f64 * m + p - 1.0),
        ScheduleKind::ZeroBubble => (p - 1.0) / (m + p - 1.0) / 3.0,
    }
}

/// Per-rank memory (see [`Memory`]); the busiest pipeline stage.
pub fn memory(m: &Model, c: &Composition) -> Memory {
    let params = param_list(m, c.tp, c.ep, c.sp);
    let stages = c.stages();
    let per_stage = m.layers / stages.max(1);
    let stage_of = |p: &ParamInfo| -> usize {
        match p.place {
            Place::Embedding => 0,
            Place::Block(l) => l / per_stage.max(1),
            Place::Head => stages - 1,
        }
    };
    let (mbytes, cb) = (c.master_bytes, c.compute_bytes());
    let dp = c.dp as u64;
    let mut best = Memory::default();
    // A pipeline rank holds stages r, r+pp, ... (interleaved).
    for rank in 0..c.pp {
        let mut mem = Memory::default();
        for p in params.iter().filter(|p| stage_of(p) % c.pp == rank) {
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
                .filter(|p| stage_of(p) % c.pp == rank && p.dp_shardable())
                .map(|p| p.local * c.compute_bytes())
                .sum();
            act += gathered;
            act_rc += gathered;
        }
        mem.activations = act;
        mem.activations_recompute = act_rc;
        mem.inputs = 2 * 2 * 8 * (m.global_batch * m.seq_len) as u64;
        mem.grads_at_peak = c.microbatches > 1 || c.pp > 1;
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
    let mb = c.master_bytes as f64;
    let tokens = (m.global_batch * m.seq_len) as f64;
    let t = tokens / (c.microbatches * c.dp * c.ep * c.cp) as f64;
    let (h, f, tp) = (m.hidden as f64, m.ffn as f64, c.tp as f64);
    let heads = (m.heads / c.tp) as f64;
    let bias = m.bias as u8 as f64;
    let stats_per_norm = if m.layer_norm { 2.0 } else { 1.0 };
    let stream = if c.sp {
        (6.0 + 2.0 * bias) * h / tp + h
    } else {
        (6.0 + 2.0 * bias) * h
    };
    let mlp = match m.activation {
        Activation::Gelu => (2.0 + bias) * f / tp,
        Activation::SwiGlu => (4.0 + 2.0 * bias) * f / tp,
    };
    let local = 3.0 * (1.0 + bias) * h / tp + h / tp + mlp;
    let stats = 2.0 * stats_per_norm / if c.sp { tp } else { 1.0 };
    let block = (stream + local) * cb + (heads + stats) * 4.0;
    let per_stage_blocks = (m.layers / c.pp) as f64;
    let in_flight = match c.schedule {
        _ if c.pp == 1 => 1.0,
        ScheduleKind::Gpipe => c.microbatches as f64,
        // ZB-H1's deferred weight passes keep one more microbatch's block inputs.
        ScheduleKind::ZeroBubble => (c.pp - rank + 1).min(c.microbatches) as f64,
        _ => (c.pp - rank).min(c.microbatches) as f64,
    };
    let head = if rank == c.pp - 1 {
        let v = m.vocab as f64 / tp;
        let stream = if c.sp { h + h / tp } else { 2.0 * h };
        let stats = stats_per_norm / if c.sp { tp } else { 1.0 };
        (2.0 * mb + 8.0) * v + stream * cb + (1.0 + stats) * 4.0
    } else {
        0.0
    };
    let full = in_flight * t * per_stage_blocks * block + t * head;
    let kept = (1.5 * h / if c.sp { tp } else { 1.0 } + 2.0) * cb;
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
                Axis::Tp if c.sp => "tp+sp".to_string(),
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
        if c.pp > 1 {
            s += &format!("pipeline bubble: {:.3}\n", self.bubble);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn composition_round_trips_through_its_spec() {
        for spec in [
            "dp=2,tp=2,sp",
            "pp=2,dp=2,fsdp,no-reshard,recompute,m=4,gpipe",
            "pp=2,dp=2,zero1,m=2,interleaved,v=2",
            "cp=2,tp=2,a2a,bf16",
            "ep=2,zero2,bf16,reduce-bf16",
        ] {
            let c: Composition = spec.parse().unwrap();
            assert_eq!(c.to_string().parse::<Composition>().unwrap(), c, "{spec}");
        }
        assert!("tp=1,sp".parse::<Composition>().is_err());
        assert!("dp=0".parse::<Composition>().is_err());
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
