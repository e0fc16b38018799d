//! The schedule types, the four generators, validation and the timing simulation. The
//! [module docs](super) describe the model (stage layout, rendezvous semantics, memory
//! accounting, bubble formulas and their sources).

use dtensor_core::{Error, Result};
pub use dtensor_placement::ScheduleKind;
use std::collections::HashMap;
use std::fmt;

fn invalid(detail: impl Into<String>) -> Error {
    Error::InvalidSchedule {
        detail: detail.into(),
    }
}

/// One step of one rank's program. A runtime executes a rank's actions strictly in order, so
/// everything it needs to know (which microbatch, which model chunk, which neighbour) is in
/// the action itself: no action depends on state the schedule does not spell out.
///
/// `stage` is always a *virtual* stage that lives on the rank running the action (the rank
/// holds chunk `stage / pp` of the model). For communication it names the local end: a send
/// names the stage that produced the data, a receive the stage that will consume it. Pairs
/// therefore differ by one stage:
///
/// | on the sender | matches, on `peer` |
/// |---|---|
/// | `SendActivation { mb, stage: s, peer }` | `RecvActivation { mb, stage: s + 1, .. }` |
/// | `SendGradient { mb, stage: s, peer }` | `RecvGradient { mb, stage: s - 1, .. }` |
///
/// Communication is explicit (rather than implied by the compute actions) because its
/// *order* decides whether blocking sends deadlock; [`Schedule::validate`] checks that order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Action {
    /// Forward of microbatch `mb` through virtual stage `stage`; keeps the activations the
    /// backward will need (one unit of [`LiveCount`]).
    Forward {
        /// Microbatch, `0..m`.
        mb: usize,
        /// Virtual stage, owned by the running rank.
        stage: usize,
    },
    /// Full backward of `mb` through `stage`: input gradient and weight gradient in one pass
    /// (GPipe, 1F1B, interleaved 1F1B). Frees the forward's activations.
    Backward {
        /// Microbatch, `0..m`.
        mb: usize,
        /// Virtual stage, owned by the running rank.
        stage: usize,
    },
    /// Zero-bubble `B`: the input gradient only, the pass the previous stage waits for. Frees
    /// most of the forward's activations; what `W` needs stays until `W`.
    BackwardInput {
        /// Microbatch, `0..m`.
        mb: usize,
        /// Virtual stage, owned by the running rank.
        stage: usize,
    },
    /// Zero-bubble `W`: the weight gradient of `mb` on `stage`. Nothing waits for it but the
    /// optimizer step, which is why it can be moved into the bubbles.
    BackwardWeight {
        /// Microbatch, `0..m`.
        mb: usize,
        /// Virtual stage, owned by the running rank.
        stage: usize,
    },
    /// Sends `stage`'s output activation of `mb` to `peer`, which runs `stage + 1`.
    SendActivation {
        /// Microbatch, `0..m`.
        mb: usize,
        /// The local stage whose forward produced the activation.
        stage: usize,
        /// The rank of `stage + 1`.
        peer: usize,
    },
    /// Receives the input activation of `mb` for `stage` from `peer`, which runs `stage - 1`.
    RecvActivation {
        /// Microbatch, `0..m`.
        mb: usize,
        /// The local stage whose forward will consume the activation.
        stage: usize,
        /// The rank of `stage - 1`.
        peer: usize,
    },
    /// Sends the gradient with respect to `stage`'s input for `mb` to `peer`, which runs
    /// `stage - 1`.
    SendGradient {
        /// Microbatch, `0..m`.
        mb: usize,
        /// The local stage whose backward (full, or `B`) produced the gradient.
        stage: usize,
        /// The rank of `stage - 1`.
        peer: usize,
    },
    /// Receives the gradient with respect to `stage`'s output for `mb` from `peer`, which
    /// runs `stage + 1`.
    RecvGradient {
        /// Microbatch, `0..m`.
        mb: usize,
        /// The local stage whose backward will consume the gradient.
        stage: usize,
        /// The rank of `stage + 1`.
        peer: usize,
    },
}

impl Action {
    /// The microbatch the action works on.
    pub fn mb(self) -> usize {
        match self {
            Action::Forward { mb, .. }
            | Action::Backward { mb, .. }
            | Action::BackwardInput { mb, .. }
            | Action::BackwardWeight { mb, .. }
            | Action::SendActivation { mb, .. }
            | Action::RecvActivation { mb, .. }
            | Action::SendGradient { mb, .. }
            | Action::RecvGradient { mb, .. } => mb,
        }
    }

    /// The virtual stage on the running rank that the action belongs to (see the type docs
    /// for which end of a transfer that is).
    pub fn stage(self) -> usize {
        match self {
            Action::Forward { stage, .. }
            | Action::Backward { stage, .. }
            | Action::BackwardInput { stage, .. }
            | Action::BackwardWeight { stage, .. }
            | Action::SendActivation { stage, .. }
            | Action::RecvActivation { stage, .. }
            | Action::SendGradient { stage, .. }
            | Action::RecvGradient { stage, .. } => stage,
        }
    }

    /// The other rank of a send or receive; `None` for computation.
    pub fn peer(self) -> Option<usize> {
        match self {
            Action::SendActivation { peer, .. }
            | Action::RecvActivation { peer, .. }
            | Action::SendGradient { peer, .. }
            | Action::RecvGradient { peer, .. } => Some(peer),
            _ => None,
        }
    }

    /// Forward or backward work (the time [`Timeline::busy`] counts), as opposed to
    /// communication.
    pub fn is_compute(self) -> bool {
        self.peer().is_none()
    }

    /// The letter [`Timeline::render`] and `Display` use: `F`, `BW` (full backward), `B`,
    /// `W`, or the transfer's name.
    fn tag(self) -> &'static str {
        match self {
            Action::Forward { .. } => "F",
            Action::Backward { .. } => "BW",
            Action::BackwardInput { .. } => "B",
            Action::BackwardWeight { .. } => "W",
            Action::SendActivation { .. } => "SendAct",
            Action::RecvActivation { .. } => "RecvAct",
            Action::SendGradient { .. } => "SendGrad",
            Action::RecvGradient { .. } => "RecvGrad",
        }
    }
}

/// `F(mb 3, stage 5)`, `BW(..)` (full backward), `B(..)` / `W(..)` (zero-bubble split),
/// `SendAct(mb 3, stage 5 -> rank 2)`, `RecvGrad(mb 3, stage 5 <- rank 2)`: short enough for
/// error messages, complete enough to find the action.
impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (tag, mb, stage) = (self.tag(), self.mb(), self.stage());
        match *self {
            Action::SendActivation { peer, .. } | Action::SendGradient { peer, .. } => {
                write!(f, "{tag}(mb {mb}, stage {stage} -> rank {peer})")
            }
            Action::RecvActivation { peer, .. } | Action::RecvGradient { peer, .. } => {
                write!(f, "{tag}(mb {mb}, stage {stage} <- rank {peer})")
            }
            _ => write!(f, "{tag}(mb {mb}, stage {stage})"),
        }
    }
}

/// Microbatches whose activations a rank holds at once, in units of one microbatch on one
/// virtual stage (on an interleaved schedule a unit is one chunk, `1/v` of the rank's
/// layers). Activation memory is what limits `m` in practice, which is why every generator
/// promises a bound ([`Schedule::memory_bound`]) and validation checks it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct LiveCount {
    /// Forwards done whose full backward, or whose input-gradient pass `B`, is not done: the
    /// bulk of the stored activations, which `B` frees.
    pub activations: usize,
    /// Forwards done whose full backward, or whose weight-gradient pass `W`, is not done:
    /// microbatches not finished on this rank. `W` still holds what the weight gradient
    /// needs (the layers' inputs and output gradients). Equal to `activations` on schedules
    /// without the split.
    pub in_flight: usize,
}

impl LiveCount {
    /// Updates the counts for one more action on the rank.
    fn step(&mut self, a: Action) {
        match a {
            Action::Forward { .. } => {
                self.activations += 1;
                self.in_flight += 1;
            }
            Action::Backward { .. } => {
                self.activations = self.activations.saturating_sub(1);
                self.in_flight = self.in_flight.saturating_sub(1);
            }
            Action::BackwardInput { .. } => {
                self.activations = self.activations.saturating_sub(1);
            }
            Action::BackwardWeight { .. } => {
                self.in_flight = self.in_flight.saturating_sub(1);
            }
            _ => {}
        }
    }
}

/// A pipeline schedule as data: one ordered action list per rank.
///
/// Data rather than code so that a schedule can be checked before it runs
/// ([`validate`](Self::validate): completeness, matching sends and receives, deadlock freedom
/// under rendezvous, the kind's memory bound), timed without hardware
/// ([`simulate`](Self::simulate)), printed, compared and edited, and so that the runtime that
/// executes it stays a plain loop over `actions[rank]`.
///
/// Layout: virtual stage `s` in `0..pp * virtual_stages_per_rank` lives on rank `s % pp` as
/// chunk `s / pp` (Megatron's interleaved layout: rank `r` holds chunks `r, r + pp, ...`).
/// Stage 0 holds the embedding, the last stage the head and the loss, so the last stage's
/// backward needs no gradient from anyone.
///
/// The fields are public so that schedules can be written or edited by hand; nothing about
/// them is trusted until `validate` passes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// Pipeline ranks (physical stages).
    pub pp: usize,
    /// Model chunks per rank, `v` (1 except for the interleaved schedule).
    pub virtual_stages_per_rank: usize,
    /// Microbatches per step, `m`.
    pub microbatches: usize,
    /// The generator, for the memory bound and the analytic bubble; `None` for a schedule
    /// written by hand, which gets the structural checks only.
    pub kind: Option<ScheduleKind>,
    /// `actions[r]`: rank `r`'s program, run in order.
    pub actions: Vec<Vec<Action>>,
}

/// Per-action durations for [`Schedule::simulate`]. Only ratios matter for the bubble
/// fraction. A full backward costs `backward_input + backward_weight` (it does the same work
/// as `B` then `W`), so split and unsplit schedules are compared at equal total work.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Costs {
    /// One forward of one microbatch on one virtual stage.
    pub forward: f64,
    /// One input-gradient pass `B`.
    pub backward_input: f64,
    /// One weight-gradient pass `W`.
    pub backward_weight: f64,
    /// One matched send/receive (both ranks are held for it: rendezvous). 0 by default, so
    /// that the bubble is the schedule's alone.
    pub comm: f64,
}

impl Costs {
    /// `forward`, `B` and `W` as given, free communication.
    pub fn new(forward: f64, backward_input: f64, backward_weight: f64) -> Costs {
        Costs {
            forward,
            backward_input,
            backward_weight,
            comm: 0.0,
        }
    }

    /// `F = B = W = 1` (so a full backward is 2), free communication: the assumption of
    /// the zero-bubble paper's handcrafted schedules, and a backward about twice a forward
    /// as in a transformer without recomputation.
    pub fn uniform() -> Costs {
        Costs::new(1.0, 1.0, 1.0)
    }

    /// The same costs with each matched send/receive taking `comm`.
    pub fn with_comm(self, comm: f64) -> Costs {
        Costs { comm, ..self }
    }

    /// A full backward: `backward_input + backward_weight`.
    pub fn backward(&self) -> f64 {
        self.backward_input + self.backward_weight
    }

    /// The duration of `a` (`comm` for either end of a transfer).
    pub fn of(&self, a: Action) -> f64 {
        match a {
            Action::Forward { .. } => self.forward,
            Action::Backward { .. } => self.backward(),
            Action::BackwardInput { .. } => self.backward_input,
            Action::BackwardWeight { .. } => self.backward_weight,
            _ => self.comm,
        }
    }

    fn check(&self) -> Result<()> {
        let all = [
            ("forward", self.forward),
            ("backward_input", self.backward_input),
            ("backward_weight", self.backward_weight),
            ("comm", self.comm),
        ];
        match all.iter().find(|(_, c)| !(c.is_finite() && *c >= 0.0)) {
            Some((name, c)) => Err(invalid(format!(
                "simulate: cost {name} = {c} must be finite and non-negative"
            ))),
            None => Ok(()),
        }
    }
}

impl Default for Costs {
    /// [`Costs::uniform`].
    fn default() -> Self {
        Costs::uniform()
    }
}

/// When one action ran in a simulation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Span {
    /// The action (for a transfer, each rank's own end of it).
    pub action: Action,
    /// When the rank began it: for a transfer, when the later of the two ranks got there.
    pub start: f64,
    /// When it finished: `start` plus its cost.
    pub end: f64,
}

/// The result of [`Schedule::simulate`]: start and end of every action on every rank, in
/// each rank's program order.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    /// `spans[r][i]` is when `actions[r][i]` ran.
    pub spans: Vec<Vec<Span>>,
    /// When the last rank finished.
    pub makespan: f64,
}

impl Timeline {
    /// Time rank `rank` spent computing (communication is not compute: it counts as
    /// bubble, which is what it is for throughput). 0 for a rank that does not exist.
    pub fn busy(&self, rank: usize) -> f64 {
        self.spans.get(rank).map_or(0.0, |spans| {
            spans
                .iter()
                .filter(|s| s.action.is_compute())
                .map(|s| s.end - s.start)
                .sum()
        })
    }

    /// Time rank `rank` did not compute before the makespan.
    pub fn idle(&self, rank: usize) -> f64 {
        self.makespan - self.busy(rank)
    }

    /// Idle time summed over the ranks.
    pub fn total_idle(&self) -> f64 {
        (0..self.spans.len()).map(|r| self.idle(r)).sum()
    }

    /// `total_idle / (ranks × makespan)`: the share of the machine the pipeline wastes,
    /// the quantity [`Schedule::analytic_bubble`] predicts. 0 for an empty timeline.
    pub fn bubble_fraction(&self) -> f64 {
        let area = self.spans.len() as f64 * self.makespan;
        if area > 0.0 {
            self.total_idle() / area
        } else {
            0.0
        }
    }

    /// An ASCII chart, one row per rank and one cell per `unit` of time: `F3` a forward of
    /// microbatch 3, `B3` a backward (the full one, or `B` of zero-bubble), `W3` a weight
    /// pass, dots idle. Chunks of an interleaved schedule are not told apart. Meant for small
    /// integer costs such as [`Costs::uniform`] with `unit = 1.0`; spans are rounded to
    /// cells. Fails if `unit` is not positive or the chart would exceed 100 000 cells a row.
    pub fn render(&self, unit: f64) -> Result<String> {
        if !(unit.is_finite() && unit > 0.0) {
            return Err(invalid(format!("render: unit = {unit} must be positive")));
        }
        let cells = (self.makespan / unit).round();
        if cells > 100_000.0 {
            return Err(invalid(format!(
                "render: {cells} cells a row at unit = {unit}; use a larger unit"
            )));
        }
        let cells = cells as usize;
        let max_mb = self
            .spans
            .iter()
            .flatten()
            .map(|s| s.action.mb())
            .max()
            .unwrap_or(0);
        let width = 1 + max_mb.to_string().len();
        let mut out = String::new();
        for (r, spans) in self.spans.iter().enumerate() {
            let mut row = vec![".".repeat(width); cells];
            for s in spans.iter().filter(|s| s.action.is_compute()) {
                let letter = match s.action {
                    Action::Forward { .. } => "F",
                    Action::BackwardWeight { .. } => "W",
                    _ => "B",
                };
                let label = format!("{:<width$}", format!("{letter}{}", s.action.mb()));
                let (a, b) = ((s.start / unit).round(), (s.end / unit).round());
                for cell in row.iter_mut().take(b as usize).skip(a as usize) {
                    cell.clone_from(&label);
                }
            }
            out.push_str(&format!("rank {r} |{}|\n", row.concat()));
        }
        Ok(out)
    }
}

/// What one rank has done so far for one (microbatch, stage): the index of each action.
#[derive(Clone, Copy, Default)]
struct Seen {
    forward: Option<usize>,
    backward: Option<usize>,
    input: Option<usize>,
    weight: Option<usize>,
    send_act: Option<usize>,
    recv_act: Option<usize>,
    send_grad: Option<usize>,
    recv_grad: Option<usize>,
}

/// The schedule a run's [`Composition`](dtensor_placement::Composition) asks for: its
/// generator for `pp`, its microbatches and (interleaved) its virtual stages. Every rank
/// builds the same.
pub fn for_composition(c: &dtensor_placement::Composition) -> Result<Schedule> {
    let (pp, m) = (c.degrees.pp, c.microbatches);
    match c.schedule {
        ScheduleKind::GPipe => gpipe(pp, m),
        ScheduleKind::OneFOneB => one_f_one_b(pp, m),
        ScheduleKind::Interleaved1F1B => interleaved_1f1b(pp, c.virtual_stages, m),
        ScheduleKind::ZeroBubbleH1 => zero_bubble_h1(pp, m),
    }
}

/// The bubble fraction (idle / (ranks × makespan)) of a generated schedule of `kind` with
/// `pp` ranks, `m` microbatches and `v` chunks per rank (`v` counts only for the interleaved
/// schedule), with uniform costs across stages and free communication; the formulas and
/// their sources are [`Schedule::analytic_bubble`]'s:
///
/// | kind | bubble | [`Schedule::simulate`] gives it exactly at |
/// |---|---|---|
/// | GPipe, 1F1B | `(p − 1)/(m + p − 1)` | any `F : B : W` |
/// | interleaved | `(p − 1)/(v·m + p − 1)` | `F = B + W` (`m` a multiple of `p`) |
/// | ZB-H1 | `(p − 1)/(3m + p − 1)`, `m ≥ p` | `F = B = W` |
///
/// ZB-H1 is not a third of 1F1B's fraction (`(p − 1)/(m + p − 1)/3`): its *idle time* is a
/// third of 1F1B's, `(p − 1)(F + B − W)` against `(p − 1)(F + B + W)`, while the busy time
/// stays `3m` per rank, so the fraction is `(p − 1)/(3m + p − 1)`; at `p = m = 4`, 0.200,
/// not 0.143. `None` for ZB-H1 with `m < p` (no formula: the pipeline never fills) and
/// for a zero size.
pub fn bubble_fraction(kind: ScheduleKind, pp: usize, m: usize, v: usize) -> Option<f64> {
    if pp == 0 || m == 0 || v == 0 {
        return None;
    }
    let (p, m_f, v_f) = (pp as f64, m as f64, v as f64);
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB => Some((p - 1.0) / (m_f + p - 1.0)),
        ScheduleKind::Interleaved1F1B => Some((p - 1.0) / (v_f * m_f + p - 1.0)),
        ScheduleKind::ZeroBubbleH1 => (m >= pp).then(|| (p - 1.0) / (3.0 * m_f + p - 1.0)),
    }
}

impl Schedule {
    /// The generator's name (`1F1B`, `ZB-H1`, …), `custom` for a schedule written by hand.
    pub fn kind_name(&self) -> String {
        self.kind.map_or_else(|| "custom".into(), |k| k.to_string())
    }

    /// Virtual stages in the pipeline: `pp × v`.
    pub fn num_stages(&self) -> usize {
        self.pp.saturating_mul(self.virtual_stages_per_rank)
    }

    /// The rank that runs virtual stage `stage`: `stage % pp`.
    pub fn rank_of(&self, stage: usize) -> usize {
        stage % self.pp.max(1)
    }

    /// The model chunk of `stage` on its rank: `stage / pp`.
    pub fn chunk_of(&self, stage: usize) -> usize {
        stage / self.pp.max(1)
    }

    /// The virtual stages rank `rank` holds, chunk by chunk: `rank, rank + pp, ...`.
    pub fn stages_of(&self, rank: usize) -> Vec<usize> {
        (0..self.virtual_stages_per_rank)
            .map(|c| c * self.pp + rank)
            .collect()
    }

    /// Checks that the schedule can run, before it runs: a bad schedule otherwise shows up
    /// as a hang or a wrong gradient on a cluster, far from its cause. In order:
    ///
    /// 1. sizes and structure: every action's microbatch, stage and peer are in range; a rank
    ///    only runs stages it owns; a transfer goes to the rank that owns the neighbouring
    ///    stage, and never to itself (neighbouring stages on one rank hand over locally);
    /// 2. per rank, in order: every (microbatch, owned stage) has exactly one forward and
    ///    either exactly one full backward or exactly one `B` and one `W`; the forward comes
    ///    first and `B` precedes `W`; a forward follows the receipt of its input (or the
    ///    local forward that produced it; stage 0 reads the data), a backward follows the
    ///    receipt of its output gradient (the last stage starts from the loss); a send
    ///    follows the action that produced its data; nothing is sent or received twice;
    /// 3. every send has its receive on the peer, and every receive its send;
    /// 4. no deadlock under rendezvous semantics (each send waits for its receive and the
    ///    other way round; see the [module docs](super) for why this model): the ranks'
    ///    programs are run together and must all reach their end;
    /// 5. the peak [`LiveCount`] of each rank is within the kind's
    ///    [`memory_bound`](Self::memory_bound).
    ///
    /// The error names the rank, the action index and the first offending action (for a
    /// deadlock: every stuck rank and the action it is stuck at).
    pub fn validate(&self) -> Result<()> {
        self.check_sizes()?;
        self.check_structure()?;
        for rank in 0..self.pp {
            self.check_rank(rank)?;
        }
        self.check_matching()?;
        self.check_deadlock()?;
        self.check_memory()
    }

    /// Each rank's peak [`LiveCount`] over its program (the two counts peak separately, so
    /// they may peak at different actions). Does not need a valid schedule.
    pub fn peak_live(&self) -> Vec<LiveCount> {
        self.actions
            .iter()
            .map(|list| {
                let (mut now, mut peak) = (LiveCount::default(), LiveCount::default());
                for &a in list {
                    now.step(a);
                    peak.activations = peak.activations.max(now.activations);
                    peak.in_flight = peak.in_flight.max(now.in_flight);
                }
                peak
            })
            .collect()
    }

    /// The most live activations rank `rank` may hold under this schedule's kind (`None` for
    /// `Custom` and for a rank outside the pipeline), in [`LiveCount`] units, with `p = pp`
    /// and `r = rank`:
    ///
    /// | kind | `activations` | `in_flight` |
    /// |---|---|---|
    /// | GPipe | `m` | `m` |
    /// | 1F1B | `min(p − r, m)` | same |
    /// | interleaved | `min(v·m, 2(p − r − 1) + (v − 1)·p + 1)` chunks | same |
    /// | ZB-H1 | `min(p − r, m)` | `min(p, m)` |
    ///
    /// 1F1B: rank `r` runs `p − r − 1` warm-up forwards and one more before its first
    /// backward. Interleaved: Megatron's warm-up of `2(p − r − 1) + (v − 1)·p` chunk forwards
    /// plus one; on rank 0 that is `p + (p − 1)/v` stages' worth, a factor
    /// `1 + (p − 1)/(p·v)` over 1F1B's `p`, the first-stage factor of Korthikanti et al.
    /// 2022 ("Reducing Activation Recomputation in Large Transformer Models", whose `m` is
    /// our `v`). ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): `B`
    /// follows the 1F1B pattern, so the activations freed by `B` keep 1F1B's `p − r`; each
    /// rank delays `W` by `r` microbatches so that every rank has `p` microbatches in
    /// flight, which is 1F1B's peak (rank 0's) and no more: the paper's "same peak memory
    /// as 1F1B" is this maximum over ranks, not a per-rank `p − r` for what `W` holds.
    pub fn memory_bound(&self, rank: usize) -> Option<LiveCount> {
        let (p, v, m) = (self.pp, self.virtual_stages_per_rank, self.microbatches);
        if rank >= p || v == 0 {
            return None;
        }
        let r = rank;
        let both = |n: usize| LiveCount {
            activations: n,
            in_flight: n,
        };
        match self.kind? {
            ScheduleKind::GPipe => Some(both(m)),
            ScheduleKind::OneFOneB => Some(both((p - r).min(m))),
            ScheduleKind::Interleaved1F1B => Some(both(
                v.saturating_mul(m).min(
                    (2 * (p - r - 1))
                        .saturating_add((v - 1).saturating_mul(p))
                        .saturating_add(1),
                ),
            )),
            ScheduleKind::ZeroBubbleH1 => Some(LiveCount {
                activations: (p - r).min(m),
                in_flight: p.min(m),
            }),
        }
    }

    /// Runs the schedule under the same rendezvous semantics as `validate` with durations
    /// from `costs`, to compare schedules (or cost models) before paying for hardware: a
    /// compute action starts when the rank's previous action ended; a matched send/receive
    /// starts when the later of the two ranks reaches it and holds both for `costs.comm`.
    /// Validates first: an invalid schedule has no timeline.
    ///
    /// The generators order their transfers for equal per-action costs (see
    /// [`interleaved_1f1b`]); GPipe and 1F1B keep their analytic bubble at any `F : B`
    /// ratio, while an interleaved schedule with a backward unlike its forward pays extra
    /// waits for blocking transfers, which this simulation shows.
    pub fn simulate(&self, costs: Costs) -> Result<Timeline> {
        costs.check()?;
        self.validate()?;
        let spans = self
            .rendezvous(&costs)
            .map_err(|_| invalid("simulate: a validated schedule deadlocked (a bug)"))?;
        let makespan = spans.iter().flatten().map(|s| s.end).fold(0.0, f64::max);
        Ok(Timeline { spans, makespan })
    }

    /// The bubble fraction (idle / (ranks × makespan)) the literature gives for this kind,
    /// with uniform costs across stages, free communication, `p = pp`:
    ///
    /// * GPipe and 1F1B: `(p − 1)/(m + p − 1)`, at any `F : B` ratio (Huang et al. 2019,
    ///   GPipe; Narayanan et al. 2021 §2.2.1: bubble `(p − 1)(t_f + t_b)` against
    ///   `m(t_f + t_b)` of work);
    /// * interleaved: `(p − 1)/(v·m + p − 1)`, from Narayanan et al. 2021 ("Efficient
    ///   Large-Scale Language Model Training on GPU Clusters Using Megatron-LM") §2.2.2,
    ///   whose bubble is `(1/v)·(p − 1)/m` of the ideal time; as a share of the makespan
    ///   that is `(p − 1)/(v·m + p − 1)`. [`simulate`](Self::simulate) reproduces it exactly
    ///   when a chunk's forward costs as much as its full backward (the generator's
    ///   reference, see [`interleaved_1f1b`]);
    /// * ZB-H1: `(p − 1)/(3m + p − 1)` for `m ≥ p`. Qi et al. (ICLR 2024) give a bubble of
    ///   `(p − 1)(T_F + T_B − T_W)` against 1F1B's `(p − 1)(T_F + T_B + T_W)`, a third of it
    ///   at `T_F = T_B = T_W` ([`Costs::uniform`]); per rank the work is `3m`. `None` for
    ///   `m < p`, where the paper gives no formula (the simulated bubble is then larger
    ///   than this expression, still below 1F1B's);
    /// * a schedule written by hand (`kind` is `None`): `None`.
    ///
    /// The formulas are [`bubble_fraction`]'s.
    pub fn analytic_bubble(&self) -> Option<f64> {
        bubble_fraction(
            self.kind?,
            self.pp,
            self.microbatches,
            self.virtual_stages_per_rank,
        )
    }

    /// The other end of a transfer: the peer and the action it must be at. `None` for
    /// computation or a transfer past either end of the pipeline.
    fn counterpart(&self, rank: usize, a: Action) -> Option<(usize, Action)> {
        match a {
            Action::SendActivation { mb, stage, peer } => Some((
                peer,
                Action::RecvActivation {
                    mb,
                    stage: stage + 1,
                    peer: rank,
                },
            )),
            Action::RecvActivation { mb, stage, peer } => Some((
                peer,
                Action::SendActivation {
                    mb,
                    stage: stage.checked_sub(1)?,
                    peer: rank,
                },
            )),
            Action::SendGradient { mb, stage, peer } => Some((
                peer,
                Action::RecvGradient {
                    mb,
                    stage: stage.checked_sub(1)?,
                    peer: rank,
                },
            )),
            Action::RecvGradient { mb, stage, peer } => Some((
                peer,
                Action::SendGradient {
                    mb,
                    stage: stage + 1,
                    peer: rank,
                },
            )),
            _ => None,
        }
    }

    /// Runs every rank's program under rendezvous semantics with durations from `costs`.
    /// A rank advances over computation on its own; a transfer advances both ranks at once,
    /// and only when each is at its end of it. Returns each rank's spans, or, when no rank
    /// can move and some are not done, each rank's program counter.
    fn rendezvous(&self, costs: &Costs) -> std::result::Result<Vec<Vec<Span>>, Vec<usize>> {
        let n = self.actions.len();
        let mut pc = vec![0usize; n];
        let mut clock = vec![0.0f64; n];
        let mut spans: Vec<Vec<Span>> = self
            .actions
            .iter()
            .map(|l| Vec::with_capacity(l.len()))
            .collect();
        loop {
            let mut moved = false;
            for rank in 0..n {
                while let Some(&a) = self.actions[rank].get(pc[rank]) {
                    let (start, end, peer) = if a.is_compute() {
                        (clock[rank], clock[rank] + costs.of(a), None)
                    } else {
                        let Some((q, want)) = self.counterpart(rank, a) else {
                            break;
                        };
                        if q == rank || q >= n || self.actions[q].get(pc[q]) != Some(&want) {
                            break;
                        }
                        let start = clock[rank].max(clock[q]);
                        (start, start + costs.comm, Some((q, want)))
                    };
                    spans[rank].push(Span {
                        action: a,
                        start,
                        end,
                    });
                    clock[rank] = end;
                    pc[rank] += 1;
                    if let Some((q, want)) = peer {
                        spans[q].push(Span {
                            action: want,
                            start,
                            end,
                        });
                        clock[q] = end;
                        pc[q] += 1;
                    }
                    moved = true;
                }
            }
            if !moved {
                break;
            }
        }
        if pc.iter().zip(&self.actions).all(|(&i, l)| i == l.len()) {
            Ok(spans)
        } else {
            Err(pc)
        }
    }

    fn check_sizes(&self) -> Result<()> {
        let (p, v, m) = (self.pp, self.virtual_stages_per_rank, self.microbatches);
        if p == 0 || v == 0 || m == 0 {
            return Err(invalid(format!(
                "pp = {p}, v = {v}, m = {m}: a pipeline needs at least one rank, one chunk \
                 per rank and one microbatch"
            )));
        }
        if self.actions.len() != p {
            return Err(invalid(format!(
                "{} action lists for pp = {p} ranks: one list per rank",
                self.actions.len()
            )));
        }
        Ok(())
    }

    /// Checks 1 of [`validate`](Self::validate).
    fn check_structure(&self) -> Result<()> {
        for (rank, list) in self.actions.iter().enumerate() {
            for (i, &a) in list.iter().enumerate() {
                if let Some(problem) = self.structural_problem(rank, a) {
                    return Err(at(rank, i, a, problem));
                }
            }
        }
        Ok(())
    }

    fn structural_problem(&self, rank: usize, a: Action) -> Option<String> {
        let (n, m, s) = (self.num_stages(), self.microbatches, a.stage());
        if a.mb() >= m {
            return Some(format!(
                "microbatch {} is out of range: the schedule has m = {m}",
                a.mb()
            ));
        }
        if s >= n {
            return Some(format!(
                "stage {s} is out of range: the pipeline has {n} virtual stages"
            ));
        }
        let owner = self.rank_of(s);
        if owner != rank {
            return Some(format!(
                "stage {s} lives on rank {owner} (stage s is on rank s % pp), not on rank \
                 {rank}: a rank only runs the stages it owns"
            ));
        }
        let (other, peer) = match a {
            Action::SendActivation { peer, .. } | Action::RecvGradient { peer, .. } => {
                if s + 1 == n {
                    return Some(format!(
                        "stage {s} is the last stage: there is no next stage to exchange \
                         with"
                    ));
                }
                (s + 1, peer)
            }
            Action::RecvActivation { peer, .. } | Action::SendGradient { peer, .. } => {
                if s == 0 {
                    return Some(
                        "stage 0 is the first stage: there is no previous stage to exchange \
                         with"
                            .into(),
                    );
                }
                (s - 1, peer)
            }
            _ => return None,
        };
        let owner = self.rank_of(other);
        if owner == rank {
            Some(format!(
                "stage {other} is on this rank too: the data stays local, and a send to \
                 oneself would wait forever under rendezvous"
            ))
        } else if peer != owner {
            Some(format!(
                "the peer is rank {peer}, but stage {other} lives on rank {owner}"
            ))
        } else {
            None
        }
    }

    /// Check 2 of [`validate`](Self::validate), for one rank.
    fn check_rank(&self, rank: usize) -> Result<()> {
        let (n, m) = (self.num_stages(), self.microbatches);
        let list = &self.actions[rank];
        // Keyed by (stage, mb) and filled only by what the list holds, so a hand-written
        // schedule with absurd sizes costs no more than its own length.
        let mut seen: HashMap<(usize, usize), Seen> = HashMap::new();
        let get = |seen: &HashMap<(usize, usize), Seen>, stage: usize, mb: usize| {
            seen.get(&(stage, mb)).copied().unwrap_or_default()
        };
        for (i, &a) in list.iter().enumerate() {
            let (mb, s) = (a.mb(), a.stage());
            let err = |problem: String| Err(at(rank, i, a, problem));
            let cur = get(&seen, s, mb);
            let again = |what: &str, first: Option<usize>| {
                first.map(|j| format!("a second {what} (the first is action #{j})"))
            };
            match a {
                Action::Forward { .. } => {
                    if let Some(p) = again("forward", cur.forward) {
                        return err(p);
                    }
                    if s > 0 {
                        let prev = s - 1;
                        if self.rank_of(prev) == rank {
                            if get(&seen, prev, mb).forward.is_none() {
                                return err(format!(
                                    "runs before {}, which produces its input on this rank",
                                    Action::Forward { mb, stage: prev }
                                ));
                            }
                        } else if cur.recv_act.is_none() {
                            return err(format!(
                                "runs before its input activation is received: no {} \
                                 earlier on this rank",
                                Action::RecvActivation {
                                    mb,
                                    stage: s,
                                    peer: self.rank_of(prev)
                                }
                            ));
                        }
                    }
                    seen.entry((s, mb)).or_default().forward = Some(i);
                }
                Action::Backward { .. } | Action::BackwardInput { .. } => {
                    let split = matches!(a, Action::BackwardInput { .. });
                    let (name, first) = if split {
                        ("input-gradient pass B", cur.input)
                    } else {
                        ("full backward", cur.backward)
                    };
                    if let Some(p) = again(name, first) {
                        return err(p);
                    }
                    let other = if split {
                        cur.backward
                    } else {
                        cur.input.or(cur.weight)
                    };
                    if let Some(j) = other {
                        return err(format!(
                            "mixes a full backward and split B/W passes for mb {mb} on stage \
                             {s} (action #{j})"
                        ));
                    }
                    if cur.forward.is_none() {
                        return err(format!(
                            "runs before its forward {}",
                            Action::Forward { mb, stage: s }
                        ));
                    }
                    if s + 1 < n {
                        let next = s + 1;
                        if self.rank_of(next) == rank {
                            let there = get(&seen, next, mb);
                            if there.backward.or(there.input).is_none() {
                                return err(format!(
                                    "runs before the backward of mb {mb} on stage {next}, \
                                     which produces its output gradient on this rank"
                                ));
                            }
                        } else if cur.recv_grad.is_none() {
                            return err(format!(
                                "runs before its output gradient is received: no {} earlier \
                                 on this rank",
                                Action::RecvGradient {
                                    mb,
                                    stage: s,
                                    peer: self.rank_of(next)
                                }
                            ));
                        }
                    }
                    let slot = seen.entry((s, mb)).or_default();
                    if split {
                        slot.input = Some(i);
                    } else {
                        slot.backward = Some(i);
                    }
                }
                Action::BackwardWeight { .. } => {
                    if let Some(p) = again("weight-gradient pass W", cur.weight) {
                        return err(p);
                    }
                    if let Some(j) = cur.backward {
                        return err(format!(
                            "mixes a full backward (action #{j}) and split B/W passes for mb \
                             {mb} on stage {s}"
                        ));
                    }
                    if cur.input.is_none() {
                        return err(format!(
                            "runs before {}: W needs the output gradient B consumed",
                            Action::BackwardInput { mb, stage: s }
                        ));
                    }
                    seen.entry((s, mb)).or_default().weight = Some(i);
                }
                Action::SendActivation { .. } => {
                    if let Some(p) = again("send of this activation", cur.send_act) {
                        return err(p);
                    }
                    if cur.forward.is_none() {
                        return err(format!(
                            "sends before {}, which produces the activation",
                            Action::Forward { mb, stage: s }
                        ));
                    }
                    seen.entry((s, mb)).or_default().send_act = Some(i);
                }
                Action::SendGradient { .. } => {
                    if let Some(p) = again("send of this gradient", cur.send_grad) {
                        return err(p);
                    }
                    if cur.backward.or(cur.input).is_none() {
                        return err(format!(
                            "sends before the backward of mb {mb} on stage {s}, which \
                             produces the gradient"
                        ));
                    }
                    seen.entry((s, mb)).or_default().send_grad = Some(i);
                }
                Action::RecvActivation { .. } => {
                    if let Some(p) = again("receive of this activation", cur.recv_act) {
                        return err(p);
                    }
                    seen.entry((s, mb)).or_default().recv_act = Some(i);
                }
                Action::RecvGradient { .. } => {
                    if let Some(p) = again("receive of this gradient", cur.recv_grad) {
                        return err(p);
                    }
                    seen.entry((s, mb)).or_default().recv_grad = Some(i);
                }
            }
        }
        // Stops at the first gap, which comes within the first `list.len()` pairs.
        for s in (0..self.virtual_stages_per_rank).map(|c| c * self.pp + rank) {
            for mb in 0..m {
                let c = get(&seen, s, mb);
                let missing = |what: String| {
                    invalid(format!(
                        "rank {rank}: {what} in its {} actions (every owned stage runs every \
                         microbatch forward and backward)",
                        list.len()
                    ))
                };
                if c.forward.is_none() {
                    return Err(missing(format!("no forward of mb {mb} on stage {s}")));
                }
                match (c.backward, c.input, c.weight) {
                    (Some(_), _, _) | (None, Some(_), Some(_)) => {}
                    (None, Some(j), None) => {
                        return Err(at(
                            rank,
                            j,
                            Action::BackwardInput { mb, stage: s },
                            format!(
                                "has no weight-gradient pass {}",
                                Action::BackwardWeight { mb, stage: s }
                            ),
                        ))
                    }
                    (None, None, _) => {
                        return Err(missing(format!(
                            "no backward (neither BW nor B and W) of mb {mb} on stage {s}"
                        )))
                    }
                }
            }
        }
        Ok(())
    }

    /// Check 3 of [`validate`](Self::validate). After check 2 no transfer appears twice on
    /// a rank, so "present" here means "exactly once".
    fn check_matching(&self) -> Result<()> {
        let present: Vec<HashMap<Action, usize>> = self
            .actions
            .iter()
            .map(|l| {
                l.iter()
                    .enumerate()
                    .filter(|(_, a)| !a.is_compute())
                    .map(|(i, &a)| (a, i))
                    .collect()
            })
            .collect();
        for (rank, list) in self.actions.iter().enumerate() {
            for (i, &a) in list.iter().enumerate() {
                let Some((q, want)) = self.counterpart(rank, a) else {
                    continue;
                };
                if !present[q].contains_key(&want) {
                    return Err(at(rank, i, a, format!("no matching {want} on rank {q}")));
                }
            }
        }
        Ok(())
    }

    /// Check 4 of [`validate`](Self::validate).
    fn check_deadlock(&self) -> Result<()> {
        let Err(pc) = self.rendezvous(&Costs::new(0.0, 0.0, 0.0)) else {
            return Ok(());
        };
        let stuck: Vec<String> = pc
            .iter()
            .enumerate()
            .filter_map(|(rank, &i)| {
                let a = *self.actions[rank].get(i)?;
                let waits = self
                    .counterpart(rank, a)
                    .map_or(String::new(), |(q, want)| {
                        let there = self.actions[q]
                            .get(pc[q])
                            .map_or("its end".to_string(), |b| {
                                format!("action #{} ({b})", pc[q])
                            });
                        format!(" waits for {want} on rank {q}, which is at {there}")
                    });
                Some(format!("rank {rank}, action #{i} ({a}){waits}"))
            })
            .collect();
        Err(invalid(format!(
            "deadlock under rendezvous semantics (a send blocks until the peer reaches the \
             matching receive, and the other way round): {}",
            stuck.join("; ")
        )))
    }

    /// Check 5 of [`validate`](Self::validate).
    fn check_memory(&self) -> Result<()> {
        for (rank, list) in self.actions.iter().enumerate() {
            let Some(bound) = self.memory_bound(rank) else {
                continue;
            };
            let mut now = LiveCount::default();
            for (i, &a) in list.iter().enumerate() {
                now.step(a);
                let over = if now.activations > bound.activations {
                    Some(("live activations", now.activations, bound.activations))
                } else if now.in_flight > bound.in_flight {
                    Some(("microbatches in flight", now.in_flight, bound.in_flight))
                } else {
                    None
                };
                if let Some((what, got, max)) = over {
                    return Err(at(
                        rank,
                        i,
                        a,
                        format!(
                            "{got} {what} exceed the {} bound of {max} on rank {rank} (see \
                             Schedule::memory_bound)",
                            self.kind_name()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// `rank 2, action #7 (F(mb 1, stage 2)): problem`.
fn at(rank: usize, i: usize, a: Action, problem: String) -> Error {
    invalid(format!("rank {rank}, action #{i} ({a}): {problem}"))
}

/// Prints one line per rank: `rank 0: F(mb 0, stage 0), SendAct(...), ...`.
impl fmt::Display for Schedule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} schedule: pp = {}, v = {}, m = {}",
            self.kind_name(),
            self.pp,
            self.virtual_stages_per_rank,
            self.microbatches
        )?;
        for (rank, list) in self.actions.iter().enumerate() {
            write!(f, "rank {rank}:")?;
            for (i, a) in list.iter().enumerate() {
                write!(f, "{}{a}", if i == 0 { " " } else { ", " })?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

fn check_args(name: &str, pp: usize, v: usize, m: usize) -> Result<()> {
    let what = if pp == 0 {
        "pp must be at least 1 (a pipeline has at least one rank)"
    } else if v == 0 {
        "v must be at least 1 (each rank holds at least one model chunk)"
    } else if m == 0 {
        "m must be at least 1 (a step has at least one microbatch)"
    } else {
        return Ok(());
    };
    Err(invalid(format!(
        "{name}(pp = {pp}, v = {v}, m = {m}): {what}"
    )))
}

/// GPipe (Huang et al. 2019): every rank runs all `m` forwards, then all `m` backwards in
/// the same microbatch order. The simplest schedule and the baseline: its bubble is
/// `(p − 1)/(m + p − 1)` like 1F1B's, but each rank holds all `m` microbatches' activations
/// at the turn, so memory grows with `m`.
///
/// Fails if `pp` or `m` is 0.
pub fn gpipe(pp: usize, m: usize) -> Result<Schedule> {
    check_args("gpipe", pp, 1, m)?;
    let orders = (0..pp)
        .map(|r| {
            let forwards = (0..m).map(|mb| Action::Forward { mb, stage: r });
            let backwards = (0..m).map(|mb| Action::Backward { mb, stage: r });
            forwards.chain(backwards).collect()
        })
        .collect();
    place_transfers(pp, 1, m, ScheduleKind::GPipe, orders)
}

/// 1F1B (PipeDream-Flush; Narayanan et al. 2019, 2021): rank `r` runs `min(p − r − 1, m)`
/// warm-up forwards, then alternates one forward and one backward, then runs the remaining
/// backwards (cool-down). Same bubble as GPipe, but a microbatch's backward starts as soon
/// as possible, so rank `r` never holds more than `p − r` microbatches' activations instead
/// of `m`: `m` can grow to shrink the bubble without growing memory.
///
/// Fails if `pp` or `m` is 0.
pub fn one_f_one_b(pp: usize, m: usize) -> Result<Schedule> {
    check_args("one_f_one_b", pp, 1, m)?;
    let orders = (0..pp)
        .map(|r| {
            let f = |mb| Action::Forward { mb, stage: r };
            let b = |mb| Action::Backward { mb, stage: r };
            let warmup = (pp - 1 - r).min(m);
            let mut list: Vec<Action> = (0..warmup).map(f).collect();
            for k in warmup..m {
                list.push(f(k));
                list.push(b(k - warmup));
            }
            list.extend((m - warmup..m).map(b));
            list
        })
        .collect();
    place_transfers(pp, 1, m, ScheduleKind::OneFOneB, orders)
}

/// Megatron-LM's interleaved 1F1B (Narayanan et al. 2021, §2.2.2): each rank holds `v`
/// chunks (virtual stages `r, r + p, ...`), so a microbatch crosses every rank `v` times
/// and the pipeline fills and drains in steps of one chunk instead of one stage: the bubble
/// shrinks by `v` to `(p − 1)/(v·m + p − 1)`, for `v` times the point-to-point traffic.
///
/// Order on each rank (the `k`-th forward and `k`-th backward of the rank): microbatches
/// go in groups of `p`, chunk by chunk; forward `k` runs chunk `(k / p) mod v` on microbatch
/// `(k / (p·v))·p + k mod p`, backward `k` the same microbatch on chunk
/// `v − 1 − (k / p) mod v`. Rank `r` runs `min(2(p − r − 1) + (v − 1)·p, v·m)` warm-up
/// forwards, then alternates forward and backward, then drains the backwards.
///
/// **Requirement for `v ≥ 2`: `m` a multiple of `pp`**, as in the paper and Megatron-LM's
/// implementation: the order above walks microbatches in groups of exactly `p`, and with a
/// partial last group it would name microbatches that do not exist. (Megatron-LM has since
/// generalised the grouping; that variant is not implemented here.) With `v = 1` the order
/// is plain microbatch order and any `m` works; it is then 1F1B with a deeper warm-up
/// (`2(p − r − 1)` forwards), kept so that `v` can be varied alone.
///
/// Transfers are ordered for equal per-action costs (each chunk's forward as long as its
/// full backward). Under rendezvous with one blocking transfer at a time, a backward of
/// twice the forward leaves some transfers with no instant at which both ranks are between
/// computations, so [`Schedule::simulate`] then shows a larger bubble than the formula;
/// batched or non-blocking transfers (as Megatron-LM uses) avoid those waits.
///
/// Fails if `pp`, `v` or `m` is 0, or `v ≥ 2` and `m % pp != 0`.
pub fn interleaved_1f1b(pp: usize, v: usize, m: usize) -> Result<Schedule> {
    check_args("interleaved_1f1b", pp, v, m)?;
    if v > 1 && !m.is_multiple_of(pp) {
        let (lower, upper) = (m / pp * pp, (m / pp + 1) * pp);
        let hint = if lower == 0 {
            format!("m = {upper}")
        } else {
            format!("m = {lower} or {upper}")
        };
        return Err(invalid(format!(
            "interleaved_1f1b(pp = {pp}, v = {v}, m = {m}): m must be a multiple of pp \
             (the interleaved order runs microbatches in groups of pp per model chunk; try \
             {hint})"
        )));
    }
    let total = v * m;
    let place = |k: usize| (k / (pp * v) * pp + k % pp, (k / pp) % v);
    let orders = (0..pp)
        .map(|r| {
            let f = |k: usize| {
                let (mb, chunk) = place(k);
                Action::Forward {
                    mb,
                    stage: chunk * pp + r,
                }
            };
            let b = |k: usize| {
                let (mb, chunk) = place(k);
                Action::Backward {
                    mb,
                    stage: (v - 1 - chunk) * pp + r,
                }
            };
            let warmup = (2 * (pp - r - 1) + (v - 1) * pp).min(total);
            let mut list: Vec<Action> = (0..warmup).map(f).collect();
            for k in warmup..total {
                list.push(f(k));
                list.push(b(k - warmup));
            }
            list.extend((total - warmup..total).map(b));
            list
        })
        .collect();
    place_transfers(pp, v, m, ScheduleKind::Interleaved1F1B, orders)
}

/// ZB-H1, the memory-efficient handcrafted schedule of Qi et al., "Zero Bubble Pipeline
/// Parallelism" (ICLR 2024). The backward is split into `B` (input gradient: the only part
/// the previous stage waits for) and `W` (weight gradient: needed only by the optimizer).
/// `F` and `B` follow the 1F1B pattern, so gradients travel up the pipeline at the speed of
/// `B` alone; rank `r` delays its `W` passes by `r` microbatches in the steady phase (every
/// rank then has `p` microbatches in flight, 1F1B's peak) and, in the cool-down, runs one
/// pending `W` after each `B` and the rest at the end, filling the time it would spend
/// waiting for gradients. Bubble `(p − 1)/(3m + p − 1)` at `T_F = T_B = T_W` and `m ≥ p`,
/// a third of 1F1B's `(p − 1)(T_F + T_B + T_W)` idle time per rank.
///
/// Fails if `pp` or `m` is 0.
pub fn zero_bubble_h1(pp: usize, m: usize) -> Result<Schedule> {
    check_args("zero_bubble_h1", pp, 1, m)?;
    let orders = (0..pp)
        .map(|r| {
            let f = |mb| Action::Forward { mb, stage: r };
            let b = |mb| Action::BackwardInput { mb, stage: r };
            let w = |mb| Action::BackwardWeight { mb, stage: r };
            let warmup = (pp - 1 - r).min(m);
            let mut list: Vec<Action> = (0..warmup).map(f).collect();
            let (mut backs, mut weights) = (0, 0);
            for k in warmup..m {
                list.push(f(k));
                list.push(b(backs));
                backs += 1;
                if backs - weights > r {
                    list.push(w(weights));
                    weights += 1;
                }
            }
            while backs < m {
                list.push(b(backs));
                backs += 1;
                list.push(w(weights));
                weights += 1;
            }
            list.extend((weights..m).map(w));
            list
        })
        .collect();
    place_transfers(pp, 1, m, ScheduleKind::ZeroBubbleH1, orders)
}

/// Adds the sends and receives to per-rank compute orders, in an order that cannot
/// deadlock under rendezvous.
///
/// The compute orders are first run as a dataflow (each action 1 time unit, each starting
/// when its rank is free and its inputs exist). Every transfer is then given the instant
/// its consumer starts, and all events (computations at their start, transfers at their
/// instant, transfers before computations at equal times) are sorted into one global
/// sequence; each rank's program is that sequence restricted to the rank. Running the
/// global sequence in order is itself a rendezvous execution (both ends of each transfer
/// are next on their ranks when it comes up), so the result cannot deadlock, whatever the
/// real costs. Both ranks of a transfer are between computations at its instant, because
/// with unit costs every computation starts and ends on an integer time; a receive comes
/// right before the computation that needs it, and the send at the same moment, which is
/// how "send forward, receive backward" pairs come out in the right order on both sides
/// instead of both neighbours sending first.
fn place_transfers(
    pp: usize,
    v: usize,
    m: usize,
    kind: ScheduleKind,
    compute: Vec<Vec<Action>>,
) -> Result<Schedule> {
    let mut schedule = Schedule {
        pp,
        virtual_stages_per_rank: v,
        microbatches: m,
        kind: Some(kind),
        actions: Vec::new(),
    };
    let n = schedule.num_stages();
    let exists: std::collections::HashSet<Action> = compute.iter().flatten().copied().collect();
    // The backward (full or B) of `mb` on `stage`: the producer of the gradient for
    // `stage - 1`.
    let grad_pass = |mb: usize, stage: usize| {
        [
            Action::Backward { mb, stage },
            Action::BackwardInput { mb, stage },
        ]
        .into_iter()
        .find(|a| exists.contains(a))
    };
    let inputs = |a: Action| -> Vec<Action> {
        match a {
            Action::Forward { mb, stage } if stage > 0 => vec![Action::Forward {
                mb,
                stage: stage - 1,
            }],
            Action::Backward { mb, stage } | Action::BackwardInput { mb, stage } => {
                let mut deps = vec![Action::Forward { mb, stage }];
                deps.extend((stage + 1 < n).then(|| grad_pass(mb, stage + 1)).flatten());
                deps
            }
            Action::BackwardWeight { mb, stage } => vec![Action::BackwardInput { mb, stage }],
            _ => Vec::new(),
        }
    };

    // Dataflow with unit costs.
    let mut start: HashMap<Action, u64> = HashMap::new();
    let mut end: HashMap<Action, u64> = HashMap::new();
    let mut pc = vec![0usize; pp];
    let mut clock = vec![0u64; pp];
    loop {
        let mut moved = false;
        for (rank, list) in compute.iter().enumerate() {
            while let Some(&a) = list.get(pc[rank]) {
                let deps = inputs(a);
                if deps.iter().any(|d| !end.contains_key(d)) {
                    break;
                }
                let t = deps.iter().map(|d| end[d]).fold(clock[rank], u64::max);
                start.insert(a, t);
                end.insert(a, t + 1);
                clock[rank] = t + 1;
                pc[rank] += 1;
                moved = true;
            }
        }
        if !moved {
            break;
        }
    }
    if let Some((rank, &i)) = pc.iter().enumerate().find(|&(r, &i)| i < compute[r].len()) {
        return Err(at(
            rank,
            i,
            compute[rank][i],
            format!("the {kind} compute order for pp = {pp}, v = {v}, m = {m} cannot run"),
        ));
    }

    // Events: (time, transfers before computations, sequence), rank, action.
    let mut events: Vec<((u64, u8, usize), usize, Action)> = Vec::new();
    let mut seq = 0;
    for (rank, list) in compute.iter().enumerate() {
        for &a in list {
            events.push(((start[&a], 1, seq), rank, a));
            seq += 1;
        }
    }
    for (rank, list) in compute.iter().enumerate() {
        for &a in list {
            let transfer = match a {
                Action::Forward { mb, stage } if stage + 1 < n => {
                    let q = schedule.rank_of(stage + 1);
                    let send = Action::SendActivation { mb, stage, peer: q };
                    let recv = Action::RecvActivation {
                        mb,
                        stage: stage + 1,
                        peer: rank,
                    };
                    Some((
                        q,
                        send,
                        recv,
                        Some(Action::Forward {
                            mb,
                            stage: stage + 1,
                        }),
                    ))
                }
                Action::Backward { mb, stage } | Action::BackwardInput { mb, stage }
                    if stage > 0 =>
                {
                    let q = schedule.rank_of(stage - 1);
                    let send = Action::SendGradient { mb, stage, peer: q };
                    let recv = Action::RecvGradient {
                        mb,
                        stage: stage - 1,
                        peer: rank,
                    };
                    Some((q, send, recv, grad_pass(mb, stage - 1)))
                }
                _ => None,
            };
            let Some((q, send, recv, consumer)) = transfer else {
                continue;
            };
            if q == rank {
                continue; // neighbouring stages on one rank: handed over locally
            }
            let Some(t) = consumer.and_then(|c| start.get(&c)) else {
                return Err(invalid(format!(
                    "the {kind} compute order for pp = {pp}, v = {v}, m = {m} never \
                     consumes what {a} on rank {rank} produces"
                )));
            };
            events.push(((*t, 0, seq), rank, send));
            events.push(((*t, 0, seq), q, recv));
            seq += 1;
        }
    }
    events.sort_by_key(|e| e.0);
    schedule.actions = vec![Vec::new(); pp];
    for (_, rank, a) in events {
        schedule.actions[rank].push(a);
    }
    Ok(schedule)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(r: Result<()>) -> String {
        match r {
            Ok(()) => panic!("expected the schedule to be rejected"),
            Err(e) => e.to_string(),
        }
    }

    fn assert_mentions(message: &str, parts: &[&str]) {
        for p in parts {
            assert!(message.contains(p), "message lacks {p:?}:\n{message}");
        }
    }

    fn position(list: &[Action], a: Action) -> usize {
        list.iter()
            .position(|&x| x == a)
            .unwrap_or_else(|| panic!("{a} not in the list"))
    }

    fn all_generated() -> Vec<Schedule> {
        let mut out = Vec::new();
        for pp in 1..=8 {
            for m in 1..=16 {
                out.push(gpipe(pp, m).unwrap());
                out.push(one_f_one_b(pp, m).unwrap());
                out.push(zero_bubble_h1(pp, m).unwrap());
                // v = 1 takes any m; v ≥ 2 needs m % pp == 0.
                out.push(interleaved_1f1b(pp, 1, m).unwrap());
                for v in [2, 3] {
                    if m % pp == 0 {
                        out.push(interleaved_1f1b(pp, v, m).unwrap());
                    }
                }
            }
        }
        out
    }

    /// `bubble_fraction == num / den` exactly: with integer costs every time is an exact
    /// integer in f64, so the cross-multiplied comparison has no rounding.
    fn bubble_is(t: &Timeline, num: usize, den: usize) -> bool {
        let area = t.spans.len() as f64 * t.makespan;
        t.total_idle() * den as f64 == num as f64 * area
    }

    #[test]
    fn every_generator_validates_and_meets_its_memory_bound_exactly() {
        for s in all_generated() {
            let (p, v, m) = (s.pp, s.virtual_stages_per_rank, s.microbatches);
            s.validate()
                .unwrap_or_else(|e| panic!("{} pp={p} v={v} m={m}: {e}\n{s}", s.kind_name()));
            let peaks = s.peak_live();
            for (r, peak) in peaks.iter().enumerate() {
                let bound = s.memory_bound(r).unwrap();
                let expect = match s.kind.unwrap() {
                    // ZB-H1's in-flight count reaches p only once r W's are pending.
                    ScheduleKind::ZeroBubbleH1 => LiveCount {
                        in_flight: peak.in_flight,
                        ..bound
                    },
                    _ => bound,
                };
                assert_eq!(
                    *peak,
                    expect,
                    "{} pp={p} v={v} m={m} rank {r}",
                    s.kind_name()
                );
                assert!(peak.in_flight <= bound.in_flight);
            }
            if s.kind == Some(ScheduleKind::ZeroBubbleH1) && m >= 2 * p {
                assert!(peaks.iter().all(|l| l.in_flight == p), "pp={p} m={m}");
            }
        }
    }

    #[test]
    fn generators_have_the_documented_shape() {
        // 1F1B rank 1 of 4 with 6 microbatches: 2 warm-up forwards, then F/BW pairs.
        let s = one_f_one_b(4, 6).unwrap();
        let compute: Vec<String> = s.actions[1]
            .iter()
            .filter(|a| a.is_compute())
            .map(|a| a.to_string())
            .collect();
        let f = |k| format!("F(mb {k}, stage 1)");
        let b = |k| format!("BW(mb {k}, stage 1)");
        let want = [
            f(0),
            f(1),
            f(2),
            b(0),
            f(3),
            b(1),
            f(4),
            b(2),
            f(5),
            b(3),
            b(4),
            b(5),
        ];
        assert_eq!(compute, want);
        // Interleaved pp=2, v=2, m=4: rank 0 warms up with 2(p-1) + (v-1)p = 4 forwards.
        let s = interleaved_1f1b(2, 2, 4).unwrap();
        let compute: Vec<String> = s.actions[0]
            .iter()
            .filter(|a| a.is_compute())
            .map(|a| a.to_string())
            .collect();
        assert_eq!(
            compute[..6],
            [
                "F(mb 0, stage 0)",
                "F(mb 1, stage 0)",
                "F(mb 0, stage 2)",
                "F(mb 1, stage 2)",
                "F(mb 2, stage 0)",
                "BW(mb 0, stage 2)",
            ]
        );
        // ZB-H1 on the last of 3 ranks delays each W by 2 microbatches.
        let s = zero_bubble_h1(3, 4).unwrap();
        let compute: Vec<String> = s.actions[2]
            .iter()
            .filter(|a| a.is_compute())
            .map(|a| a.to_string())
            .collect();
        let want = [
            "F(mb 0, stage 2)",
            "B(mb 0, stage 2)",
            "F(mb 1, stage 2)",
            "B(mb 1, stage 2)",
            "F(mb 2, stage 2)",
            "B(mb 2, stage 2)",
            "W(mb 0, stage 2)",
            "F(mb 3, stage 2)",
            "B(mb 3, stage 2)",
            "W(mb 1, stage 2)",
            "W(mb 2, stage 2)",
            "W(mb 3, stage 2)",
        ];
        assert_eq!(compute, want);
    }

    #[test]
    fn generators_reject_bad_sizes_without_panicking() {
        let cases: Vec<(Result<Schedule>, &str)> = vec![
            (gpipe(0, 4), "pp must be at least 1"),
            (gpipe(4, 0), "m must be at least 1"),
            (one_f_one_b(0, 1), "pp must be at least 1"),
            (one_f_one_b(2, 0), "m must be at least 1"),
            (zero_bubble_h1(0, 3), "pp must be at least 1"),
            (zero_bubble_h1(3, 0), "m must be at least 1"),
            (interleaved_1f1b(4, 0, 8), "v must be at least 1"),
            (interleaved_1f1b(0, 2, 8), "pp must be at least 1"),
            (interleaved_1f1b(4, 2, 0), "m must be at least 1"),
            (interleaved_1f1b(4, 2, 6), "m must be a multiple of pp"),
            (interleaved_1f1b(4, 2, 3), "try m = 4)"),
            (interleaved_1f1b(3, 3, 4), "try m = 3 or 6"),
        ];
        for (result, part) in cases {
            let e = result.expect_err(part).to_string();
            assert_mentions(&e, &["invalid pipeline schedule", part]);
        }
        assert_mentions(
            &interleaved_1f1b(4, 2, 6).unwrap_err().to_string(),
            &["interleaved_1f1b(pp = 4, v = 2, m = 6)", "try m = 4 or 8"],
        );
    }

    #[test]
    fn schedule_level_sizes_are_checked() {
        let mut s = one_f_one_b(2, 2).unwrap();
        s.actions.pop();
        assert_mentions(&msg(s.validate()), &["1 action lists for pp = 2"]);
        let mut s = one_f_one_b(2, 2).unwrap();
        s.microbatches = 0;
        assert_mentions(&msg(s.validate()), &["m = 0"]);
        // Absurd sizes on a short hand-written list: answered at once, no allocation or
        // arithmetic sized by them.
        let huge = 1 << 40;
        let s = Schedule {
            pp: 2,
            virtual_stages_per_rank: huge,
            microbatches: huge,
            kind: Some(ScheduleKind::Interleaved1F1B),
            actions: vec![vec![Action::Forward { mb: 0, stage: 0 }], vec![]],
        };
        assert_mentions(
            &msg(s.validate()),
            &["rank 0: no backward (neither BW nor B and W) of mb 0 on stage 0"],
        );
        assert_eq!(s.memory_bound(1).unwrap().in_flight, (huge - 1) * 2 + 1);
        assert_eq!(s.memory_bound(2), None);
    }

    #[test]
    fn a_dropped_receive_is_reported_at_its_consumer() {
        let mut s = one_f_one_b(4, 8).unwrap();
        let recv = Action::RecvActivation {
            mb: 0,
            stage: 2,
            peer: 1,
        };
        let i = position(&s.actions[2], recv);
        s.actions[2].remove(i);
        let f = position(&s.actions[2], Action::Forward { mb: 0, stage: 2 });
        assert_mentions(
            &msg(s.validate()),
            &[
                &format!("rank 2, action #{f} (F(mb 0, stage 2))"),
                "before its input activation is received",
                "no RecvAct(mb 0, stage 2 <- rank 1)",
            ],
        );
    }

    #[test]
    fn a_dropped_send_leaves_an_unmatched_receive() {
        let mut s = gpipe(3, 4).unwrap();
        let send = Action::SendGradient {
            mb: 1,
            stage: 2,
            peer: 1,
        };
        let i = position(&s.actions[2], send);
        s.actions[2].remove(i);
        let r = position(
            &s.actions[1],
            Action::RecvGradient {
                mb: 1,
                stage: 1,
                peer: 2,
            },
        );
        assert_mentions(
            &msg(s.validate()),
            &[
                &format!("rank 1, action #{r} (RecvGrad(mb 1, stage 1 <- rank 2))"),
                "no matching SendGrad(mb 1, stage 2 -> rank 1) on rank 2",
            ],
        );
    }

    #[test]
    fn a_backward_before_its_forward_is_rejected() {
        let mut s = one_f_one_b(4, 8).unwrap();
        let bw = Action::Backward { mb: 0, stage: 3 };
        let i = position(&s.actions[3], bw);
        s.actions[3].remove(i);
        s.actions[3].insert(0, bw);
        assert_mentions(
            &msg(s.validate()),
            &[
                "rank 3, action #0 (BW(mb 0, stage 3))",
                "runs before its forward F(mb 0, stage 3)",
            ],
        );
    }

    #[test]
    fn both_neighbours_sending_first_deadlocks() {
        // 1F1B, pp = 2, m = 2: in the steady phase rank 0 sends mb 1's activation and
        // receives mb 0's gradient while rank 1 does the opposite. Put both sends first.
        let mut s = one_f_one_b(2, 2).unwrap();
        let put_first = |list: &mut Vec<Action>, first: Action, second: Action| {
            let (i, j) = (position(list, first), position(list, second));
            if i > j {
                list.swap(i, j);
            }
        };
        let send_act = Action::SendActivation {
            mb: 1,
            stage: 0,
            peer: 1,
        };
        let recv_grad = Action::RecvGradient {
            mb: 0,
            stage: 0,
            peer: 1,
        };
        let send_grad = Action::SendGradient {
            mb: 0,
            stage: 1,
            peer: 0,
        };
        let recv_act = Action::RecvActivation {
            mb: 1,
            stage: 1,
            peer: 0,
        };
        put_first(&mut s.actions[0], send_act, recv_grad);
        put_first(&mut s.actions[1], send_grad, recv_act);
        let e = msg(s.validate());
        assert_mentions(
            &e,
            &[
                "deadlock under rendezvous",
                &format!(
                    "rank 0, action #{} (SendAct(mb 1, stage 0 -> rank 1)) waits for \
                     RecvAct(mb 1, stage 1 <- rank 0) on rank 1",
                    position(&s.actions[0], send_act)
                ),
                &format!(
                    "rank 1, action #{} (SendGrad(mb 0, stage 1 -> rank 0))",
                    position(&s.actions[1], send_grad)
                ),
            ],
        );
        // The generator's own order of the same four actions passes.
        one_f_one_b(2, 2).unwrap().validate().unwrap();
    }

    #[test]
    fn receiving_out_of_the_senders_order_deadlocks() {
        // GPipe over 3 ranks: rank 1 sends mb 0's activation, then mb 1's. Make rank 2
        // receive mb 1 first (both receives still before both forwards, so every local
        // check passes): each rank then waits for the other.
        let mut s = gpipe(3, 2).unwrap();
        let recv = |mb| Action::RecvActivation {
            mb,
            stage: 2,
            peer: 1,
        };
        let j = position(&s.actions[2], recv(1));
        s.actions[2].remove(j);
        let i = position(&s.actions[2], recv(0));
        s.actions[2].insert(i, recv(1));
        assert!(i + 1 < position(&s.actions[2], Action::Forward { mb: 0, stage: 2 }));
        let send0 = Action::SendActivation {
            mb: 0,
            stage: 1,
            peer: 2,
        };
        assert_mentions(
            &msg(s.validate()),
            &[
                "deadlock under rendezvous",
                &format!(
                    "rank 1, action #{} ({send0}) waits for RecvAct(mb 0, stage 2 <- rank 1) \
                     on rank 2, which is at action #{i} (RecvAct(mb 1, stage 2 <- rank 1))",
                    position(&s.actions[1], send0)
                ),
                &format!("rank 2, action #{i} (RecvAct(mb 1, stage 2 <- rank 1)) waits for"),
            ],
        );
    }

    #[test]
    fn a_duplicated_forward_is_rejected() {
        let mut s = one_f_one_b(4, 8).unwrap();
        let f = Action::Forward { mb: 3, stage: 1 };
        let i = position(&s.actions[1], f);
        s.actions[1].insert(i + 1, f);
        assert_mentions(
            &msg(s.validate()),
            &[
                &format!("rank 1, action #{} (F(mb 3, stage 1))", i + 1),
                &format!("a second forward (the first is action #{i})"),
            ],
        );
    }

    #[test]
    fn an_action_on_a_stage_the_rank_does_not_own_is_rejected() {
        let mut s = interleaved_1f1b(2, 2, 2).unwrap();
        // Rank 0 holds stages 0 and 2; stage 1 is rank 1's.
        s.actions[0].insert(3, Action::Forward { mb: 0, stage: 1 });
        assert_mentions(
            &msg(s.validate()),
            &[
                "rank 0, action #3 (F(mb 0, stage 1))",
                "stage 1 lives on rank 1",
                "only runs the stages it owns",
            ],
        );
    }

    #[test]
    fn wrong_peers_and_sends_to_oneself_are_rejected() {
        let mut s = one_f_one_b(3, 2).unwrap();
        s.actions[0][1] = Action::SendActivation {
            mb: 0,
            stage: 0,
            peer: 2,
        };
        assert_mentions(
            &msg(s.validate()),
            &[
                "rank 0, action #1",
                "the peer is rank 2, but stage 1 lives on rank 1",
            ],
        );
        let mut s = interleaved_1f1b(1, 2, 1).unwrap();
        s.actions[0].insert(
            1,
            Action::SendActivation {
                mb: 0,
                stage: 0,
                peer: 0,
            },
        );
        assert_mentions(&msg(s.validate()), &["rank 0, action #1", "stays local"]);
        let mut s = gpipe(2, 1).unwrap();
        s.actions[1].push(Action::SendActivation {
            mb: 0,
            stage: 1,
            peer: 0,
        });
        assert_mentions(&msg(s.validate()), &["stage 1 is the last stage"]);
    }

    #[test]
    fn a_send_before_its_data_exists_is_rejected() {
        let mut s = gpipe(2, 2).unwrap();
        let send = Action::SendActivation {
            mb: 1,
            stage: 0,
            peer: 1,
        };
        let i = position(&s.actions[0], send);
        s.actions[0].remove(i);
        s.actions[0].insert(0, send);
        assert_mentions(
            &msg(s.validate()),
            &[
                "rank 0, action #0 (SendAct(mb 1, stage 0 -> rank 1))",
                "sends before F(mb 1, stage 0)",
            ],
        );
    }

    #[test]
    fn zero_bubble_split_passes_are_checked() {
        // W before B.
        let mut s = zero_bubble_h1(2, 2).unwrap();
        let w = Action::BackwardWeight { mb: 0, stage: 1 };
        let i = position(&s.actions[1], w);
        s.actions[1].remove(i);
        let b = position(&s.actions[1], Action::BackwardInput { mb: 0, stage: 1 });
        s.actions[1].insert(b, w);
        assert_mentions(
            &msg(s.validate()),
            &[
                &format!("rank 1, action #{b} (W(mb 0, stage 1))"),
                "runs before B(mb 0, stage 1)",
            ],
        );
        // A B without its W.
        let mut s = zero_bubble_h1(2, 2).unwrap();
        let w = Action::BackwardWeight { mb: 1, stage: 0 };
        let i = position(&s.actions[0], w);
        s.actions[0].remove(i);
        let b = position(&s.actions[0], Action::BackwardInput { mb: 1, stage: 0 });
        assert_mentions(
            &msg(s.validate()),
            &[
                &format!("rank 0, action #{b} (B(mb 1, stage 0))"),
                "has no weight-gradient pass W(mb 1, stage 0)",
            ],
        );
        // A full backward next to a split one.
        let mut s = zero_bubble_h1(1, 1).unwrap();
        s.actions[0].push(Action::Backward { mb: 0, stage: 0 });
        assert_mentions(
            &msg(s.validate()),
            &[
                "rank 0, action #3 (BW(mb 0, stage 0))",
                "mixes",
                "(action #1)",
            ],
        );
        let mut s = zero_bubble_h1(1, 1).unwrap();
        s.actions[0][1] = Action::Backward { mb: 0, stage: 0 };
        assert_mentions(
            &msg(s.validate()),
            &["rank 0, action #2 (W(mb 0, stage 0))", "mixes"],
        );
    }

    #[test]
    fn a_missing_backward_is_reported() {
        let mut s = one_f_one_b(1, 3).unwrap();
        s.actions[0].retain(|&a| a != Action::Backward { mb: 2, stage: 0 });
        assert_mentions(
            &msg(s.validate()),
            &[
                "rank 0",
                "no backward (neither BW nor B and W) of mb 2 on stage 0",
            ],
        );
    }

    #[test]
    fn exceeding_the_kinds_memory_bound_is_rejected() {
        // GPipe's order labelled 1F1B holds m = 8 microbatches on rank 0, not p = 4.
        let mut s = gpipe(4, 8).unwrap();
        s.kind = Some(ScheduleKind::OneFOneB);
        let f = position(&s.actions[0], Action::Forward { mb: 4, stage: 0 });
        assert_mentions(
            &msg(s.validate()),
            &[
                &format!("rank 0, action #{f} (F(mb 4, stage 0))"),
                "5 live activations exceed the 1F1B bound of 4 on rank 0",
            ],
        );
        // The same actions as Custom carry no bound.
        s.kind = None;
        s.validate().unwrap();
        assert_eq!(s.memory_bound(0), None);
        assert_eq!(s.analytic_bubble(), None);
    }

    #[test]
    fn gpipe_and_1f1b_bubbles_are_exactly_the_formula() {
        for costs in [
            Costs::uniform(),
            Costs::new(2.0, 1.0, 1.0),
            Costs::new(1.0, 2.0, 1.0),
            Costs::new(3.0, 1.0, 4.0),
        ] {
            for p in 1..=8 {
                for m in 1..=16 {
                    for s in [gpipe(p, m).unwrap(), one_f_one_b(p, m).unwrap()] {
                        let t = s.simulate(costs).unwrap();
                        assert!(
                            bubble_is(&t, p - 1, m + p - 1),
                            "{} p={p} m={m} {costs:?}: {} vs {}",
                            s.kind_name(),
                            t.bubble_fraction(),
                            s.analytic_bubble().unwrap()
                        );
                        let want = (m + p - 1) as f64 * (costs.forward + costs.backward());
                        assert_eq!(t.makespan, want);
                        assert!((t.bubble_fraction() - s.analytic_bubble().unwrap()).abs() < 1e-12);
                    }
                }
            }
        }
    }

    #[test]
    fn interleaved_meets_its_formula_and_beats_1f1b() {
        // A chunk's forward as long as its full backward: the transfers' reference costs.
        let costs = Costs::new(2.0, 1.0, 1.0);
        for p in 1..=8 {
            for v in [2, 3] {
                for m in (p..=16).step_by(p) {
                    let s = interleaved_1f1b(p, v, m).unwrap();
                    let t = s.simulate(costs).unwrap();
                    assert!(
                        bubble_is(&t, p - 1, v * m + p - 1),
                        "p={p} v={v} m={m}: {}",
                        t.bubble_fraction()
                    );
                    let base = one_f_one_b(p, m).unwrap().simulate(costs).unwrap();
                    if p > 1 {
                        assert!(
                            t.bubble_fraction() < base.bubble_fraction(),
                            "p={p} v={v} m={m}"
                        );
                    } else {
                        assert_eq!(t.bubble_fraction(), 0.0);
                        assert_eq!(base.bubble_fraction(), 0.0);
                    }
                }
            }
        }
    }

    #[test]
    fn interleaved_with_a_backward_unlike_its_forward_pays_rendezvous_waits() {
        // What `interleaved_1f1b` documents: its transfers are ordered for F = BW; at
        // BW = 2F some transfers find no instant with both ranks between computations.
        let s = interleaved_1f1b(4, 2, 8).unwrap();
        let t = s.simulate(Costs::uniform()).unwrap();
        let formula = s.analytic_bubble().unwrap();
        assert!(t.bubble_fraction() > formula, "{}", t.bubble_fraction());
        // Still deadlock-free and complete: every action ran once.
        let ran: usize = t.spans.iter().map(Vec::len).sum();
        assert_eq!(ran, s.actions.iter().map(Vec::len).sum::<usize>());
    }

    #[test]
    fn zero_bubble_h1_meets_its_formula_and_beats_1f1b() {
        let costs = Costs::uniform();
        for p in 1..=8 {
            for m in 1..=16 {
                let s = zero_bubble_h1(p, m).unwrap();
                let t = s.simulate(costs).unwrap();
                let base = one_f_one_b(p, m).unwrap().simulate(costs).unwrap();
                if m >= p {
                    assert!(
                        bubble_is(&t, p - 1, 3 * m + p - 1),
                        "p={p} m={m}: {}",
                        t.bubble_fraction()
                    );
                    // A third of 1F1B's idle time per rank: (p-1)(F+B-W) vs (p-1)(F+B+W).
                    assert_eq!(3.0 * t.total_idle(), base.total_idle());
                } else {
                    // No formula from the paper; the pipeline never fills, and the bubble
                    // exceeds the m ≥ p expression.
                    assert_eq!(s.analytic_bubble(), None);
                    let formula = (p - 1) as f64 / (3 * m + p - 1) as f64;
                    assert!(t.bubble_fraction() > formula, "p={p} m={m}");
                }
                if p > 1 {
                    assert!(t.makespan < base.makespan, "p={p} m={m}");
                } else {
                    assert_eq!(t.makespan, base.makespan);
                }
            }
        }
    }

    #[test]
    fn communication_costs_hold_both_ranks() {
        // pp = 2, m = 1: F, send, F, BW, send, BW on the critical path.
        let s = one_f_one_b(2, 1).unwrap();
        let t = s.simulate(Costs::uniform().with_comm(0.5)).unwrap();
        assert_eq!(t.makespan, 1.0 + 0.5 + 1.0 + 2.0 + 0.5 + 2.0);
        for spans in &t.spans {
            for w in spans.windows(2) {
                assert!(w[0].end <= w[1].start, "{spans:?}");
            }
        }
        let send = &t.spans[0][1];
        assert_eq!((send.start, send.end), (1.0, 1.5));
        assert_eq!(t.busy(0), 3.0);
        assert_eq!(t.idle(0), 7.0 - 3.0);
    }

    #[test]
    fn simulate_rejects_bad_costs_and_invalid_schedules() {
        let s = one_f_one_b(2, 2).unwrap();
        for bad in [
            Costs::new(-1.0, 1.0, 1.0),
            Costs::new(1.0, f64::NAN, 1.0),
            Costs::uniform().with_comm(f64::INFINITY),
        ] {
            let e = s.simulate(bad).unwrap_err().to_string();
            assert_mentions(&e, &["must be finite and non-negative"]);
        }
        let mut broken = s.clone();
        broken.actions[1].clear();
        assert!(broken.simulate(Costs::uniform()).is_err());
    }

    #[test]
    fn actions_display_readably() {
        let shown = [
            (Action::Forward { mb: 3, stage: 5 }, "F(mb 3, stage 5)"),
            (Action::Backward { mb: 3, stage: 5 }, "BW(mb 3, stage 5)"),
            (
                Action::BackwardInput { mb: 3, stage: 5 },
                "B(mb 3, stage 5)",
            ),
            (
                Action::BackwardWeight { mb: 3, stage: 5 },
                "W(mb 3, stage 5)",
            ),
            (
                Action::SendActivation {
                    mb: 3,
                    stage: 5,
                    peer: 2,
                },
                "SendAct(mb 3, stage 5 -> rank 2)",
            ),
            (
                Action::RecvActivation {
                    mb: 3,
                    stage: 5,
                    peer: 0,
                },
                "RecvAct(mb 3, stage 5 <- rank 0)",
            ),
            (
                Action::SendGradient {
                    mb: 3,
                    stage: 5,
                    peer: 0,
                },
                "SendGrad(mb 3, stage 5 -> rank 0)",
            ),
            (
                Action::RecvGradient {
                    mb: 3,
                    stage: 5,
                    peer: 2,
                },
                "RecvGrad(mb 3, stage 5 <- rank 2)",
            ),
        ];
        for (a, text) in shown {
            assert_eq!(a.to_string(), text);
        }
        let s = gpipe(2, 1).unwrap().to_string();
        assert_eq!(
            s,
            "GPipe schedule: pp = 2, v = 1, m = 1\n\
             rank 0: F(mb 0, stage 0), SendAct(mb 0, stage 0 -> rank 1), \
             RecvGrad(mb 0, stage 0 <- rank 1), BW(mb 0, stage 0)\n\
             rank 1: RecvAct(mb 0, stage 1 <- rank 0), F(mb 0, stage 1), \
             BW(mb 0, stage 1), SendGrad(mb 0, stage 1 -> rank 0)\n"
        );
    }

    #[test]
    fn layout_helpers_follow_megatron() {
        let s = interleaved_1f1b(4, 3, 4).unwrap();
        assert_eq!(s.num_stages(), 12);
        assert_eq!(s.stages_of(1), vec![1, 5, 9]);
        assert_eq!((s.rank_of(9), s.chunk_of(9)), (1, 2));
    }

    #[test]
    fn render_rejects_bad_units() {
        let t = gpipe(2, 2).unwrap().simulate(Costs::uniform()).unwrap();
        assert!(t.render(0.0).is_err());
        assert!(t.render(1e-9).is_err());
        assert_eq!(
            t.render(1.0).unwrap(),
            "rank 0 |F0F1......B0B0B1B1|\nrank 1 |..F0F1B0B0B1B1....|\n"
        );
    }
}
