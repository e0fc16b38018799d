//! The mixture-of-experts MLP as a layer: a router on the residual stream, top-k
//! [`route`], [`dispatch`] of each token to the `Ep` rank owning its experts, a grouped
//! up projection, the activation, a grouped down projection, and the gate-weighted
//! [`combine`] back into the stream, built from [`dtensor_core::moe`]'s ops. The Switch
//! load-balancing loss ([`aux_loss_global`]) comes with every forward; an optional
//! per-expert selection bias balances without it (DeepSeek-V3).
//!
//! ## Layouts (axes `[Dp, Ep, Cp, Tp]`; `M::Tp` is `Invariant` without SP, `Shard<0>` with SP)
//!
//! | tensor | layout | its gradient |
//! |---|---|---|
//! | tokens in / out ([`Stream<M>`]) `[tokens, hidden]` | `[S0, S0, S0, M::Tp]` | the same |
//! | router weight `[E, hidden]` ([`StreamP<M>`]), compute copy | `[R, R, R, M::ParamTp]` | `[P, P, P, M::ParamTp::Grad]`, reduced over `Dp`, `Ep`, `Cp` (and `Tp` with SP) |
//! | router logits, gates `[tokens, E]`, `[tokens, k]` | `[S0, S0, S0, M::Tp]` | the same |
//! | dispatched rows `[routed rows, hidden]` | `[Rg, Rg, Rg, M::Tp']` (`Ragged<()>` where the tokens were `S0`; without SP `Tp` stays `Invariant`) | the same |
//! | expert weights `[E, ffn, hidden]`, `[E, hidden, ffn]` ([`ExpertW<M>`]), compute copy | `[R, S0, R, M::ParamTp]`: `E/ep` whole experts per `Ep` rank | `[P, S0, P, M::ParamTp::Grad]` |
//! | expert weights, stored ([`MasterLayout`]) | `[Dp: mode, Ep: S0, Cp: I, Tp: M::ParamTp]` (`Dp`: `R` under DDP, `Shard<1>` under ZeRO / FSDP) | reduced: `[Dp: I or S1, Ep: S0, Cp: I, Tp: I]` |
//! | auxiliary loss (scalar) | [`Loss`] `[P, P, P, I]` (with SP, all-reduced over `Tp` first) | `[R, R, R, I]` |
//!
//! **Which axes reduce expert gradients.** An expert's rows come from every token-sharding
//! rank, but the gradient of expert `e` is computed whole on its owner (the dispatch sent
//! it every row routed to `e` from its `Ep` group). So an expert gradient is reduced over
//! the *data* axes that replicate the expert: `Dp` (the data mode's all-reduce or
//! reduce-scatter), `Cp` (the adjoint of the compute copy's `to_replicate`), and `Tp` under
//! SP (the stream parameter's all-reduce, [`TpParam`](crate::TpParam)) — and **never over
//! `Ep`**, whose ranks hold different experts. Dense parameters (the router included) are
//! all-reduced over `Ep` like over any data axis.
//!
//! **Bytes per routed token.** Each copy that leaves its `Ep` rank crosses the wire four
//! times per training step (dispatch, combine and their adjoints), `hidden ·
//! dtype_bytes` each, plus the count exchange of [`route`]: see the table in
//! [`dtensor_core::moe`]'s module docs (`2 · (out + in) · row` per rank and MoE layer).
//! The statistics add two all-reduces of `E + 3` integers per token-sharding axis.
//!
//! **Statistics and balance.** The auxiliary loss is global: `f_i` (fraction of the
//! batch's `tokens · k` selections choosing expert `i`) and `P_i` (mean router probability)
//! are summed over every token-sharding axis, so any mesh computes the loss a one-rank run
//! computes on the same batch. Every forward records the batch's [`RoutingStats`] (tokens
//! per expert, dropped copies), which [`MoeMlp::take_stats`] hands to a receipt. With
//! [`MoeConfig::bias_rate`] `γ`, [`MoeMlp::update_bias`] (called after each optimizer step)
//! moves each expert's selection bias by `γ · sign(mean load − load)`, the loads summed over
//! all token-sharding ranks since the last update: integers, so every replica keeps the
//! same bias bit for bit. The bias changes selection only, never the gates.
//!
//! **Limits.** Top-k is 1 or 2; experts have no biases and no tensor parallelism inside
//! (they are replicated over `Tp`); a [`TransformerBlock`](crate::TransformerBlock) with an
//! MoE MLP cannot be recomputed nor cut into pipeline stages (both are an `Err` at
//! construction).

use crate::data::{DataMode, Ddp, ExpertW, MasterLayout, StreamP};
use crate::init::{Init, ParamInit};
use crate::mlp::Activation;
use crate::params::{join_name, Module, ParamVisitor, StateVisitor, Weight};
use crate::seq::{axis_size, Loss, NoSp, PerMode, SeqMode, Sp, Stream};
use dtensor_core::moe::{aux_loss_global, combine, dispatch, route};
use dtensor_core::{DeviceMesh, Error, Result, RouterConfig, Routing, RoutingStats, Tape, Var};
use dtensor_placement::{AxisKind, Tp};
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// How a GPT's MoE MLPs route and balance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MoeConfig {
    /// Experts per layer `E` (a multiple of the `Ep` size).
    pub experts: usize,
    /// Experts per token: 1 or 2.
    pub top_k: usize,
    /// `Some(c)`: each (source rank, expert) keeps at most `⌈c · tokens · k / E⌉` copies;
    /// `None`: dropless. A dropping run does not match a one-rank run (capacity is per
    /// source rank).
    pub capacity_factor: Option<f64>,
    /// Divide a token's gates by their sum (Mixtral); otherwise the softmax probabilities.
    pub normalize_gates: bool,
    /// Coefficient of the Switch auxiliary loss added to the training loss (0: none).
    pub aux_loss_coef: f64,
    /// Aux-loss-free balancing rate `γ` of the per-expert selection bias (`None`: no bias).
    pub bias_rate: Option<f64>,
    /// The experts' hidden width (`None`: the model's `ffn`).
    pub ffn: Option<usize>,
}

impl MoeConfig {
    /// Dropless top-`k` of `experts`, gates normalized for `k = 2`, aux loss 0.01, no bias.
    pub fn new(experts: usize, top_k: usize) -> Self {
        MoeConfig {
            experts,
            top_k,
            capacity_factor: None,
            normalize_gates: top_k > 1,
            aux_loss_coef: 0.01,
            bias_rate: None,
            ffn: None,
        }
    }

    /// `Err` naming the values unless `experts` divides over `ep` ranks and `top_k` is 1 or
    /// 2 and at most `experts`.
    pub fn validate(&self, ep: usize) -> Result<()> {
        let bad = |detail: String| Error::InvalidUse {
            op: "MoeMlp::new",
            detail,
        };
        let (e, k) = (self.experts, self.top_k);
        if e == 0 || e % ep.max(1) != 0 {
            return Err(bad(format!(
                "{e} experts do not divide over an Ep axis of {ep} ranks (experts must be a \
                 positive multiple of ep)"
            )));
        }
        if k > e {
            return Err(bad(format!(
                "top-k {k} is larger than the number of experts {e}"
            )));
        }
        if !(1..=2).contains(&k) {
            return Err(bad(format!("top-k must be 1 or 2, got {k}")));
        }
        if let Some(c) = self.capacity_factor {
            if c.is_nan() || c <= 0.0 {
                return Err(bad(format!("capacity factor {c} must be > 0")));
            }
        }
        Ok(())
    }
}

/// What a layer's forwards recorded since the last [`MoeMlp::take_stats`] /
/// [`MoeMlp::update_bias`].
#[derive(Default)]
struct MoeState {
    /// The selection bias (`Some` iff a bias rate is set).
    bias: Option<Vec<f64>>,
    /// Tokens per expert, summed over the token-sharding ranks, since the last bias update.
    loads: Vec<u64>,
    /// Each forward's statistics since the last take.
    stats: Vec<RoutingStats>,
}

/// The MoE MLP: `y = Σ_{e ∈ top-k(x)} gate_e(x) · W2[e]·act(W1[e]·x)` per token (SwiGLU:
/// `act(W1[e]·x) ⊙ (Wup[e]·x)`), on the stream laid out [`Stream<M>`].
pub struct MoeMlp<M: SeqMode, D: DataMode = Ddp> {
    /// `[E, hidden]`, dense: replicated over every axis but as a stream parameter on `Tp`.
    pub router: Weight<D, StreamP<M>>,
    /// `[E, ffn, hidden]`, `Shard<0>` over `Ep`.
    pub w1: Weight<D, ExpertW<M>>,
    /// SwiGLU's second up projection, `[E, ffn, hidden]`.
    pub up: Option<Weight<D, ExpertW<M>>>,
    /// `[E, hidden, ffn]`.
    pub w2: Weight<D, ExpertW<M>>,
    /// Experts, top-k, capacity, gate normalisation and load balancing.
    pub config: MoeConfig,
    /// The experts' non-linearity (SwiGLU uses `up`).
    pub activation: Activation,
    state: Arc<Mutex<MoeState>>,
}

/// The same layer (shared parameters and statistics).
impl<M: SeqMode, D: DataMode> Clone for MoeMlp<M, D> {
    fn clone(&self) -> Self {
        MoeMlp {
            router: self.router.clone(),
            w1: self.w1.clone(),
            up: self.up.clone(),
            w2: self.w2.clone(),
            config: self.config,
            activation: self.activation,
            state: self.state.clone(),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<M: SeqMode, D: DataMode> MoeMlp<M, D> {
    /// Parameter ids: router `init.id`, `w1` `+1`, `up` `+2`, `w2` `+3` (drawn with
    /// `out_std`). `Err` (naming the values) if the experts do not divide over `Ep` or
    /// top-k is not 1 or 2 or exceeds the experts.
    pub fn new(
        hidden: usize,
        ffn: usize,
        config: MoeConfig,
        activation: Activation,
        init: ParamInit,
        out_std: f64,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        config.validate(axis_size(mesh, AxisKind::Ep))?;
        let e = config.experts;
        let ffn = config.ffn.unwrap_or(ffn);
        let normal = |std| Init::Normal { std };
        let router = normal(init.std).param::<MasterLayout<D, StreamP<M>>>(
            init.seed,
            init.id,
            &[e, hidden],
            init.dtype,
            mesh,
        )?;
        let expert = |id: u64, shape: [usize; 3], std: f64| -> Result<Weight<D, ExpertW<M>>> {
            let w = normal(std)
                .param::<MasterLayout<D, ExpertW<M>>>(init.seed, id, &shape, init.dtype, mesh)?;
            Weight::new(w, init.precision)
        };
        let w1 = expert(init.id + 1, [e, ffn, hidden], init.std)?;
        let up = match activation {
            Activation::SwiGlu => Some(expert(init.id + 2, [e, ffn, hidden], init.std)?),
            Activation::Gelu => None,
        };
        let w2 = expert(init.id + 3, [e, hidden, ffn], out_std)?;
        let state = MoeState {
            bias: config.bias_rate.map(|_| vec![0.0; e]),
            loads: vec![0; e],
            stats: Vec::new(),
        };
        Ok(MoeMlp {
            router: Weight::new(router, init.precision)?,
            w1,
            up,
            w2,
            config,
            activation,
            state: Arc::new(Mutex::new(state)),
        })
    }

    /// Starts gathering the parameters over `Dp` (FSDP's prefetch; nothing otherwise).
    pub fn prefetch(&self) -> Result<()> {
        self.router.prefetch()?;
        self.w1.prefetch()?;
        if let Some(up) = &self.up {
            up.prefetch()?;
        }
        self.w2.prefetch()
    }

    /// Collective: the layer on `x`, and the Switch auxiliary loss `E · Σ_i f_i · P_i` of
    /// this batch (not yet scaled by [`MoeConfig::aux_loss_coef`]) laid out as a [`Loss`].
    /// Records the batch's routing statistics.
    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
    ) -> Result<(Var<'t, Stream<M>>, Var<'t, Loss>)> {
        M::per_mode::<Forward<D>>((self, tape, x))
    }

    /// The router's configuration for the next forward (with the current selection bias).
    pub fn router_config(&self) -> RouterConfig {
        RouterConfig {
            experts: self.config.experts,
            top_k: self.config.top_k,
            capacity_factor: self.config.capacity_factor,
            normalize_gates: self.config.normalize_gates,
            selection_bias: lock(&self.state).bias.clone(),
        }
    }

    /// The current selection bias (`None` without a bias rate).
    pub fn bias(&self) -> Option<Vec<f64>> {
        lock(&self.state).bias.clone()
    }

    /// The statistics of every forward since the last call, oldest first.
    pub fn take_stats(&self) -> Vec<RoutingStats> {
        std::mem::take(&mut lock(&self.state).stats)
    }

    /// Aux-loss-free balancing, after an optimizer step: `bias_e += γ · sign(mean − load_e)`
    /// with the loads of the forwards since the last update (summed over every
    /// token-sharding rank, so the same on every replica); then the loads restart. Nothing
    /// without a bias rate.
    pub fn update_bias(&self) {
        let mut s = lock(&self.state);
        let loads = std::mem::replace(&mut s.loads, vec![0; self.config.experts]);
        let (Some(g), Some(bias)) = (self.config.bias_rate, s.bias.as_mut()) else {
            return;
        };
        let mean = loads.iter().sum::<u64>() as f64 / loads.len().max(1) as f64;
        for (b, &l) in bias.iter_mut().zip(&loads) {
            let d = mean - l as f64;
            if d != 0.0 {
                *b += g * d.signum();
            }
        }
    }

    fn record(&self, stats: RoutingStats) {
        let mut s = lock(&self.state);
        for (l, &c) in s.loads.iter_mut().zip(&stats.per_expert) {
            *l += c as u64;
        }
        s.stats.push(stats);
    }
}

/// The axes that shard the tokens under mode `M`.
fn token_axes<M: SeqMode>() -> Vec<AxisKind> {
    let mut a = vec![AxisKind::Dp, AxisKind::Ep, AxisKind::Cp];
    if M::SP {
        a.push(AxisKind::Tp);
    }
    a
}

/// The forward, written once and instantiated per sequence mode (whose concrete layouts
/// satisfy every rule): router → route → dispatch → grouped up → activation → grouped
/// down → combine; returns the output and the raw auxiliary loss.
macro_rules! moe_forward_body {
    ($mode:ty, $mlp:expr, $tape:expr, $x:expr) => {{
        let (mlp, tape, x) = ($mlp, $tape, $x);
        let logits = x.matmul_t(&mlp.router.on(tape)?)?;
        let (routing, gates): (Routing<()>, _) = route(&logits, &mlp.router_config())?;
        mlp.record(routing.stats_over(&token_axes::<$mode>())?);
        let aux = aux_loss_global(&logits, &routing)?;
        let rows = dispatch(x, &routing)?;
        let h = rows.grouped_matmul_t(&mlp.w1.on(tape)?)?;
        let a = match &mlp.up {
            Some(up) => {
                let u = rows.grouped_matmul_t(&up.on(tape)?)?;
                h.map_rows(|h| h.swiglu(u.var()))?
            }
            None => h.map_rows(|h| h.gelu())?,
        };
        let y = a.grouped_matmul_t(&mlp.w2.on(tape)?)?;
        (combine(&y, &gates, &routing)?, aux)
    }};
}

/// [`MoeMlp::forward`], its body per sequence mode.
struct Forward<D>(PhantomData<D>);

impl<D: DataMode> PerMode for Forward<D> {
    type In<'a, 't: 'a, M: SeqMode> = (&'a MoeMlp<M, D>, &'t Tape, &'a Var<'t, Stream<M>>);
    type Out<'t, M: SeqMode> = (Var<'t, Stream<M>>, Var<'t, Loss>);
    fn no_sp<'a, 't: 'a>((mlp, tape, x): Self::In<'a, 't, NoSp>) -> Result<Self::Out<'t, NoSp>> {
        forward_nosp(mlp, tape, x)
    }
    fn sp<'a, 't: 'a>((mlp, tape, x): Self::In<'a, 't, Sp>) -> Result<Self::Out<'t, Sp>> {
        forward_sp(mlp, tape, x)
    }
}

/// [`MoeMlp::forward`] without sequence parallelism.
fn forward_nosp<'t, D: DataMode>(
    mlp: &MoeMlp<NoSp, D>,
    tape: &'t Tape,
    x: &Var<'t, Stream<NoSp>>,
) -> Result<(Var<'t, Stream<NoSp>>, Var<'t, Loss>)> {
    Ok(moe_forward_body!(NoSp, mlp, tape, x))
}

/// [`MoeMlp::forward`] with sequence parallelism: the auxiliary loss's terms are also
/// `Partial` over `Tp` (each `Tp` rank routed its own tokens) and are all-reduced there.
fn forward_sp<'t, D: DataMode>(
    mlp: &MoeMlp<Sp, D>,
    tape: &'t Tape,
    x: &Var<'t, Stream<Sp>>,
) -> Result<(Var<'t, Stream<Sp>>, Var<'t, Loss>)> {
    let (y, aux) = moe_forward_body!(Sp, mlp, tape, x);
    Ok((y, aux.all_reduce(Tp)?))
}

impl<M: SeqMode, D: DataMode> Module for MoeMlp<M, D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        v.visit(&join_name(prefix, "router"), &mut self.router)?;
        v.visit(&join_name(prefix, "w1"), &mut self.w1)?;
        if let Some(up) = &mut self.up {
            v.visit(&join_name(prefix, "up"), up)?;
        }
        v.visit(&join_name(prefix, "w2"), &mut self.w2)
    }
    /// The selection bias, `expert_bias` (`[E]`, f64, the same on every rank), with a
    /// bias rate; nothing otherwise.
    fn visit_state<V: StateVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        let mesh = self.router.value().device_mesh().clone();
        let mut s = lock(&self.state);
        match s.bias.as_mut() {
            Some(b) => v.visit(&join_name(prefix, "expert_bias"), &mesh, b),
            None => Ok(()),
        }
    }
}
