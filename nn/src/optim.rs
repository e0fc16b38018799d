//! Parameters, gradient reduction over data parallelism, optimizers and global
//! gradient-norm clipping.
//!
//! An optimizer's [`update`](Optimizer::update) takes a parameter laid out as `L` and a
//! gradient laid out as `G` only if `G: ReducedGrad<L>`: on every mesh axis the gradient is
//! *reduced to the parameter's placement* (`Shard<D>` for `Shard<D>`, `Invariant` for
//! `Replicate` or `Invariant`). A gradient still `Partial` anywhere (not yet averaged over
//! `Dp`, or a sequence-parallel norm weight not yet reduced over `Tp`) does not compile.
//!
//! | parameter axis | raw gradient (dual) | reduce with | reduced |
//! |---|---|---|---|
//! | `Replicate` over `Dp` (DDP) | `Partial` | `all_reduce` over `Dp` ([`reduce_grad`]) | `Invariant` |
//! | `Shard<F>` over `Dp`, compute copy `Replicate` (ZeRO) | `Partial` | `reduce_scatter` over `Dp` | `Shard<F>` |
//! | `Shard<F>` over `Dp`, gathered for use (FSDP) | `Shard<F>` (the gather's adjoint reduce-scattered it) | nothing | `Shard<F>` |
//! | `Shard<D>` over `Tp` | `Shard<D>` | nothing | `Shard<D>` |
//! | `Invariant` over `Tp` (no SP) | `Invariant` | nothing | `Invariant` |
//! | `Replicate` over `Tp` (SP) | `Partial` | [`TpParam::reduce_over_tp`] (`all_reduce` over `Tp`) | `Invariant` |
//!
//! Every parameter of the layers is a [`Weight`]: its master laid out as the data mode
//! says, computed with as [`ParamLayout<T>`](crate::ParamLayout) (`Replicate` over `Dp`, `T`
//! over `Tp`), enumerable through [`Module::visit_params`] (name, layout, value). [`step`]
//! is one optimizer step over a module: reduce every gradient, clip by the global norm,
//! update; [`GradAccumulator`] and [`step_accumulated`] do the same over microbatches.

use crate::data::{DataMode, DpLayout, EpParam, ParamKind, ReducedLayout, Weight};
use crate::seq::{axis_size, DpPartial, DpReduced};
use dtensor_collectives::ReduceOp;
use dtensor_core::{AnyDTensor, DTensor, DeviceMesh, Error, Gradients, Result, Tape, Var};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{
    AxisKind, Dp, Invariant, Layout, Linear, MeshAxis, On, Placement, PlacementType, Replicate,
    Shard, Tp,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// A gradient placement (`Self`) that is reduced to a parameter placement `P` on one axis.
#[diagnostic::on_unimplemented(
    message = "a `{Self}` gradient is not reduced to the parameter's `{P}` placement",
    label = "this gradient axis still needs its reduction",
    note = "a `Partial` gradient holds pending sums: average it over Dp (dp_average) and, for sequence-parallel norm weights and biases, reduce it over Tp (SeqMode::reduce_param_grad) before the optimizer step"
)]
pub trait ReducedPlacement<P>: PlacementType {}
impl<const D: usize> ReducedPlacement<Shard<D>> for Shard<D> {}
// Spelled out per whole placement (not `impl<P: IsWhole>`), so a gradient reduced to the
// wrong placement reports this trait's message, not `IsWhole`'s.
impl ReducedPlacement<Replicate> for Invariant {}
impl ReducedPlacement<Invariant> for Invariant {}

/// A gradient layout (`Self`) reduced to the placement of a parameter laid out as `P` on
/// every axis: what [`Optimizer::update`] accepts.
#[diagnostic::on_unimplemented(
    message = "the optimizer step needs a gradient reduced to the parameter's placement, got `{Self}` for a parameter laid out as `{P}`",
    label = "unreduced gradient",
    note = "a `Partial` gradient axis holds pending sums: average it over Dp (dp_average) and, for sequence-parallel norm weights and biases, reduce it over Tp (SeqMode::reduce_param_grad) first"
)]
pub trait ReducedGrad<P: Layout>: Layout {}
impl ReducedGrad<()> for () {}
impl<X: MeshAxis, P, Q, R, S> ReducedGrad<(On<X, P>, R)> for (On<X, Q>, S)
where
    P: PlacementType,
    Q: ReducedPlacement<P>,
    R: Layout,
    S: ReducedGrad<R>,
{
}

/// A trainable tensor: its value and the optimizer's per-element state (Adam's moments).
pub struct Param<L: Layout> {
    value: DTensor<L>,
    state: Vec<Tensor>,
    key: u64,
}

/// The same parameter: same key and shared tensors (copied only if one side is written).
impl<L: Layout> Clone for Param<L> {
    fn clone(&self) -> Self {
        Param {
            value: self.value.clone(),
            state: self.state.clone(),
            key: self.key,
        }
    }
}

/// Unique per parameter (the tape binds a parameter's leaves to it).
static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

impl<L: Layout> Param<L> {
    /// A parameter holding `value`, with no optimizer state yet (an optimizer that keeps
    /// some, as [`AdamW`] does its moments, creates it at its first update) and a key of
    /// its own.
    pub fn new(value: DTensor<L>) -> Self {
        Param {
            value,
            state: Vec::new(),
            key: NEXT_KEY.fetch_add(1, Ordering::Relaxed),
        }
    }
    /// The parameter's current value, laid out `L`.
    pub fn value(&self) -> &DTensor<L> {
        &self.value
    }
    /// The local piece of the value.
    pub fn local(&self) -> &Tensor {
        self.value.as_local()
    }
    /// The parameter on `tape`: a leaf whose gradient [`grad`](Self::grad) reads back.
    pub fn on<'t>(&self, tape: &'t Tape) -> Var<'t, L> {
        tape.param(self.key, self.value.clone())
    }
    /// The key the tape binds this parameter's leaves to.
    pub fn key(&self) -> u64 {
        self.key
    }
    /// The optimizer's per-element state (AdamW's two moments; empty before the first
    /// update).
    pub fn state(&self) -> &[Tensor] {
        &self.state
    }
    /// The gradient backward produced for this parameter (summed over its uses on the
    /// tape; zeros if unused), laid out as the dual.
    pub fn grad(&self, grads: &mut Gradients) -> Result<DTensor<L::Grad>> {
        grads.of_key(self.key, &self.value)
    }
    /// Replaces the optimizer's state (a checkpoint's AdamW moments): each tensor must have
    /// the local shape of the value and live where it does (host or the same GPU; AdamW
    /// would otherwise start the moments again from zero). An empty `state` clears it.
    pub fn set_state(&mut self, state: Vec<Tensor>) -> Result<()> {
        if let Some(t) = state.iter().find(|t| t.shape() != self.local().shape()) {
            return Err(Error::ShapeMismatch {
                op: "Param::set_state",
                detail: format!(
                    "state of local shape {:?} for a value of local shape {:?}",
                    t.shape(),
                    self.local().shape()
                ),
            });
        }
        if let Some(t) = state.iter().find(|t| t.device() != self.local().device()) {
            let place = |t: &Tensor| {
                t.device()
                    .map_or("host".to_string(), |d| format!("cuda:{}", d.ordinal()))
            };
            return Err(dtensor_kernels::Error::DeviceMismatch {
                op: "Param::set_state",
                lhs: place(self.local()),
                rhs: place(t),
            }
            .into());
        }
        self.state = state;
        Ok(())
    }
    /// Replaces the value (same layout and global shape) and the optimizer's state,
    /// keeping the key: what restoring a checkpoint does.
    pub fn restore(&mut self, value: DTensor<L>, state: Vec<Tensor>) -> Result<()> {
        if value.global_shape() != self.value.global_shape() {
            return Err(Error::ShapeMismatch {
                op: "Param::restore",
                detail: format!(
                    "value of global shape {:?} for a parameter of {:?}",
                    value.global_shape(),
                    self.value.global_shape()
                ),
            });
        }
        let old = std::mem::replace(&mut self.value, value);
        if let Err(e) = self.set_state(state) {
            self.value = old;
            return Err(e);
        }
        Ok(())
    }
    /// Replaces the local piece (same shape): the optimizers' write path.
    fn set_local(&mut self, local: Tensor) -> Result<()> {
        self.value.update_local(|_| Ok(local))
    }
}

/// A parameter's placement over `Tp`, and how its gradient is reduced there: nothing for a
/// `Shard<D>` or `Invariant` weight, an all-reduce for a `Replicate` one (a sequence-parallel
/// norm weight or row bias, each `Tp` rank having seen other tokens).
pub trait TpParam: PlacementType<Grad: Linear> + Linear {
    /// The gradient's placement over `Tp` once reduced there.
    type Reduced: ReducedPlacement<Self> + Linear;
    /// Collective over `Tp` where needed (whatever the gradient's placement `Q` over `Dp`:
    /// `Invariant` after DDP's all-reduce, `Shard` after ZeRO's or FSDP's reduce-scatter).
    fn reduce_over_tp<Q: PlacementType, E: EpParam>(
        g: DTensor<DpLayout<Q, Self::Grad, E>>,
    ) -> Result<DTensor<DpLayout<Q, Self::Reduced, E>>>;
}

impl<const D: usize> TpParam for Shard<D> {
    type Reduced = Shard<D>;
    fn reduce_over_tp<Q: PlacementType, E: EpParam>(
        g: DTensor<DpLayout<Q, Shard<D>, E>>,
    ) -> Result<DTensor<DpLayout<Q, Shard<D>, E>>> {
        Ok(g)
    }
}

impl TpParam for Invariant {
    type Reduced = Invariant;
    fn reduce_over_tp<Q: PlacementType, E: EpParam>(
        g: DTensor<DpLayout<Q, Invariant, E>>,
    ) -> Result<DTensor<DpLayout<Q, Invariant, E>>> {
        Ok(g)
    }
}

impl TpParam for Replicate {
    type Reduced = Invariant;
    fn reduce_over_tp<Q: PlacementType, E: EpParam>(
        g: DTensor<DpLayout<Q, dtensor_placement::Partial, E>>,
    ) -> Result<DTensor<DpLayout<Q, Invariant, E>>> {
        g.all_reduce(Tp)
    }
}

/// A parameter gradient reduced to its parameter's placement: summed over `Dp` (the DDP
/// all-reduce: the loss is `Partial` over `Dp`, each rank's term already divided by the
/// *global* token count, so the sum is the gradient of the mean), then reduced over `Tp`
/// where the parameter is `Replicate` there.
pub fn reduce_grad<T: TpParam>(
    g: DTensor<DpPartial<T::Grad>>,
) -> Result<DTensor<DpReduced<T::Reduced>>> {
    T::reduce_over_tp(g.all_reduce(Dp)?)
}

/// Visits parameters one by one with their names (see [`Module::visit_params`]).
pub trait ParamVisitor {
    /// Called once per parameter with its dotted name (`blocks.0.attn.qkv.weight`) and
    /// the parameter, which the visitor may read or update in place. An `Err` stops the
    /// walk and is returned by [`Module::visit_params`].
    fn visit<D: DataMode, K: ParamKind>(&mut self, name: &str, w: &mut Weight<D, K>) -> Result<()>;
}

/// Visits a module's non-parameter state ([`Module::visit_state`]).
pub trait StateVisitor {
    /// `value`: one piece of layer state, the same on every rank of `mesh` (replicated),
    /// that training changes and a resumed run needs; the visitor may read or replace its
    /// elements (keeping its length).
    fn visit(&mut self, name: &str, mesh: &Arc<DeviceMesh>, value: &mut [f64]) -> Result<()>;
}

/// Something with parameters: a layer or a model.
pub trait Module {
    /// Calls `v` on every parameter, in a fixed order, names prefixed with `prefix`.
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()>;

    /// Calls `v` on every piece of state that is not a parameter but that training updates
    /// (an MoE layer's expert selection bias), in a fixed order, names prefixed with
    /// `prefix`; checkpoints save and load it with the parameters. None by default.
    fn visit_state<V: StateVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        let _ = (prefix, v);
        Ok(())
    }
}

/// `prefix.name`, or `name` at the top.
pub fn join_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// One described parameter: name, the master's placements (`[Dp, Tp]`) and the whole
/// value.
#[derive(Clone, Debug)]
pub struct NamedParam {
    /// The dotted name ([`join_name`] of the module path).
    pub name: String,
    /// The master's placements, one per mesh axis in layout order.
    pub placements: Vec<Placement>,
    /// The whole (global) value, gathered on every rank.
    pub value: Tensor,
}

/// Collective: every parameter of `m` as a whole tensor, with its name and layout.
pub fn named_params(m: &mut impl Module) -> Result<Vec<NamedParam>> {
    struct Collect(Vec<NamedParam>);
    impl ParamVisitor for Collect {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            name: &str,
            w: &mut Weight<D, K>,
        ) -> Result<()> {
            self.0.push(NamedParam {
                name: name.to_string(),
                placements: w.value().placements().to_vec(),
                value: w.value().full_tensor()?,
            });
            Ok(())
        }
    }
    let mut c = Collect(Vec::new());
    m.visit_params("", &mut c)?;
    Ok(c.0)
}

/// Parameter gradients summed over the microbatches of one step, each in the form its
/// data mode keeps between backwards: ZeRO-2 and FSDP reduce over `Dp` after every
/// backward and keep only their shard; DDP and ZeRO-1 keep the raw, unreduced gradient
/// (summed in the master's dtype) and reduce it once, at the step.
#[derive(Default)]
pub struct GradAccumulator {
    sums: std::collections::HashMap<u64, AnyDTensor>,
    /// Gradients already reduced over `Dp` by [`DdpBuckets`](crate::DdpBuckets).
    dp_reduced: std::collections::HashMap<u64, AnyDTensor>,
    /// Parameters a bucket took in this backward (the plain `add` skips them).
    bucketed: std::collections::HashSet<u64>,
    backwards: usize,
}

impl GradAccumulator {
    /// An empty accumulator: no gradients, no backwards added.
    pub fn new() -> Self {
        Self::default()
    }

    /// Backwards added so far.
    pub fn backwards(&self) -> usize {
        self.backwards
    }

    /// Collective over `Dp` for the modes that reduce after every backward: takes every
    /// parameter's gradient of one backward out of `grads` into the sums.
    pub fn add(&mut self, m: &mut impl Module, grads: &mut Gradients) -> Result<()> {
        struct Add<'a> {
            acc: &'a mut GradAccumulator,
            grads: &'a mut Gradients,
        }
        impl ParamVisitor for Add<'_> {
            fn visit<D: DataMode, K: ParamKind>(
                &mut self,
                _: &str,
                w: &mut Weight<D, K>,
            ) -> Result<()> {
                if self.acc.bucketed.contains(&w.master().key()) {
                    return Ok(());
                }
                let g = if D::REDUCE_EACH_BACKWARD {
                    w.dp_reduced_grad(self.grads)?.into_any()
                } else {
                    w.grad(self.grads)?.to_dtype(w.local().dtype())?.into_any()
                };
                self.acc.sum_into(w.master().key(), g)
            }
        }
        m.visit_params("", &mut Add { acc: self, grads })?;
        self.bucketed.clear();
        self.backwards += 1;
        Ok(())
    }

    /// The raw sum accumulated for `key` so far, taken out (a bucket adds it to the last
    /// backward's gradient before reducing).
    pub(crate) fn take_raw(&mut self, key: u64) -> Option<AnyDTensor> {
        self.sums.remove(&key)
    }

    /// A bucket took `key`'s gradient in this backward.
    pub(crate) fn mark_bucketed(&mut self, key: u64) {
        self.bucketed.insert(key);
    }

    /// A bucket's reduced gradient for `key`.
    pub(crate) fn put_dp_reduced(&mut self, key: u64, g: AnyDTensor) {
        self.dp_reduced.insert(key, g);
    }

    fn sum_into(&mut self, key: u64, g: AnyDTensor) -> Result<()> {
        match self.sums.remove(&key) {
            None => {
                self.sums.insert(key, g);
            }
            Some(old) => {
                self.sums.insert(key, old.add(&g)?);
            }
        }
        Ok(())
    }

    /// The sum for `w`, reduced to its master's placement over `Dp` and `Tp`.
    fn reduced<D: DataMode, K: ParamKind>(
        &mut self,
        w: &Weight<D, K>,
    ) -> Result<DTensor<ReducedLayout<D, K>>> {
        if let Some(any) = self.dp_reduced.remove(&w.master().key()) {
            return <K::Tp as TpParam>::reduce_over_tp(DTensor::try_from_any(any)?);
        }
        let any = self
            .sums
            .remove(&w.master().key())
            .ok_or_else(|| Error::InvalidUse {
                op: "optim::step",
                detail: "no gradient was accumulated for a parameter (no backward added, or \
                         another module's accumulator)"
                    .into(),
            })?;
        let dp = if D::REDUCE_EACH_BACKWARD {
            DTensor::try_from_any(any)?
        } else {
            w.dp_reduce(DTensor::try_from_any(any)?)?
        };
        <K::Tp as TpParam>::reduce_over_tp(dp)
    }
}

/// Collective: one optimizer step over every parameter of `m` from one backward's
/// gradients: [`step_accumulated`] of a [`GradAccumulator`] holding just them.
pub fn step<O: Optimizer>(
    m: &mut impl Module,
    grads: &mut Gradients,
    opt: &mut O,
    max_norm: f64,
) -> Result<f64> {
    let mut acc = GradAccumulator::new();
    acc.add(m, grads)?;
    step_accumulated(m, acc, opt, max_norm)
}

/// Collective: one optimizer step over every parameter of `m`. Reduces each accumulated
/// gradient to its master's placement (over `Dp` as the data mode says, over `Tp` for
/// sequence-parallel parameters), clips them all to a global norm of `max_norm` (across
/// pipeline stages too), begins the optimizer's step and updates (rebuilding the compute
/// copies). Returns the global norm before clipping. A non-finite norm (an inf or NaN in
/// any gradient) skips the update: no parameter, moment or step count changes, the same
/// on every rank (the norm is reduced over all of them).
pub fn step_accumulated<O: Optimizer>(
    m: &mut impl Module,
    mut acc: GradAccumulator,
    opt: &mut O,
    max_norm: f64,
) -> Result<f64> {
    let _span = dtensor_collectives::trace::span("optimizer step", "optimizer");
    struct Reduce<'g> {
        acc: &'g mut GradAccumulator,
        norm: GradNorm,
        reduced: Vec<AnyDTensor>,
        mesh: Option<std::sync::Arc<dtensor_core::DeviceMesh>>,
    }
    impl ParamVisitor for Reduce<'_> {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            _: &str,
            w: &mut Weight<D, K>,
        ) -> Result<()> {
            let g = self.acc.reduced(w)?;
            self.norm.add(&g)?;
            self.mesh.get_or_insert_with(|| g.device_mesh().clone());
            self.reduced.push(g.into_any());
            Ok(())
        }
    }
    struct Update<'o, O> {
        opt: &'o O,
        scale: f64,
        reduced: std::vec::IntoIter<AnyDTensor>,
    }
    impl<O: Optimizer> ParamVisitor for Update<'_, O> {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            _: &str,
            w: &mut Weight<D, K>,
        ) -> Result<()> {
            let any = self.reduced.next().ok_or_else(|| Error::ShapeMismatch {
                op: "optim::step",
                detail: "the module visited more parameters in its second pass".into(),
            })?;
            let g = DTensor::<ReducedLayout<D, K>>::try_from_any(any)?;
            let g = if self.scale < 1.0 {
                g.scale(self.scale)?
            } else {
                g
            };
            w.update(self.opt, &g)
        }
    }
    let mut r = Reduce {
        acc: &mut acc,
        norm: GradNorm::new(),
        reduced: Vec::new(),
        mesh: None,
    };
    m.visit_params("", &mut r)?;
    let norm = match &r.mesh {
        Some(mesh) => r.norm.finish(mesh)?,
        None => 0.0,
    };
    if !norm.is_finite() {
        // An inf or NaN anywhere: skip the update (as Megatron-LM does) so the parameters
        // and optimizer state stay as they were; the caller sees it in the norm.
        return Ok(norm);
    }
    let scale = clip_coefficient(norm, max_norm);
    opt.begin_step();
    let mut u = Update {
        opt,
        scale,
        reduced: r.reduced.into_iter(),
    };
    m.visit_params("", &mut u)?;
    Ok(norm)
}

/// Averages a gradient over `Dp`: `Partial` terms scaled by `1/dp`, then all-reduced (for a
/// loss that is each rank's *own* mean; [`reduce_grad`] sums, for the typed [`Loss`](crate::Loss)).
pub fn dp_average<T: PlacementType + Linear>(
    g: DTensor<DpPartial<T>>,
) -> Result<DTensor<DpReduced<T>>> {
    let dp = axis_size(g.device_mesh(), AxisKind::Dp);
    let g = if dp > 1 { g.scale(1.0 / dp as f64)? } else { g };
    g.all_reduce(Dp)
}

/// Something that updates a parameter from its reduced gradient.
pub trait Optimizer {
    /// Call once per training step, before the updates of that step.
    fn begin_step(&mut self);
    /// Updates `p` from `g`, which must be reduced to `p`'s placement.
    fn update<L, G>(&self, p: &mut Param<L>, g: &DTensor<G>) -> Result<()>
    where
        L: Layout,
        G: Layout + ReducedGrad<L>;
}

fn check_grad<L: Layout, G: Layout>(op: &'static str, p: &Param<L>, g: &DTensor<G>) -> Result<()> {
    if p.local().shape() != g.local_shape() || p.local().dtype() != g.as_local().dtype() {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!(
                "parameter local {:?} {} but gradient local {:?} {}",
                p.local().shape(),
                p.local().dtype(),
                g.local_shape(),
                g.as_local().dtype()
            ),
        });
    }
    Ok(())
}

/// Plain SGD: `p -= lr·g`.
#[derive(Clone, Debug)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
}

impl Optimizer for Sgd {
    fn begin_step(&mut self) {}

    fn update<L, G>(&self, p: &mut Param<L>, g: &DTensor<G>) -> Result<()>
    where
        L: Layout,
        G: Layout + ReducedGrad<L>,
    {
        check_grad("Sgd::update", p, g)?;
        if p.local().is_cuda() {
            // On a device: `w + (−lr·g)`, each rounded in the dtype (the host rounds once
            // from f64).
            let t = p.local().add(&g.as_local().try_scale(-self.lr)?)?;
            return p.set_local(t);
        }
        let gv = g.as_local().to_f64_vec();
        let v: Vec<f64> = p
            .local()
            .to_f64_vec()
            .iter()
            .zip(&gv)
            .map(|(w, d)| w - self.lr * d)
            .collect();
        let t = Tensor::from_f64_vec(v, p.local().shape(), p.local().dtype())?;
        p.set_local(t)
    }
}

/// AdamW (decoupled weight decay, bias-corrected moments). The moments live in the
/// parameter, laid out like it, so a sharded parameter has sharded state.
#[derive(Clone, Debug)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// Decay rate of the first moment (the gradients' running mean).
    pub beta1: f64,
    /// Decay rate of the second moment (the squared gradients' running mean).
    pub beta2: f64,
    /// Added to the bias-corrected second moment's square root before dividing.
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices (weights, embedding tables) only.
    pub weight_decay: f64,
    /// Decay vectors too (biases, norm weights). Off by default, as in nanoGPT and
    /// Megatron's parameter groups.
    pub decay_vectors: bool,
    step: u64,
}

impl AdamW {
    /// AdamW at learning rate `lr` with `beta1 = 0.9`, `beta2 = 0.95`, `eps = 1e-8`, weight
    /// decay 0.01 on matrices only, no steps taken.
    pub fn new(lr: f64) -> Self {
        AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            decay_vectors: false,
            step: 0,
        }
    }
    /// Steps begun so far.
    pub fn steps(&self) -> u64 {
        self.step
    }
    /// Sets the steps begun so far (resuming from a checkpoint: the bias corrections
    /// continue from there).
    pub fn set_steps(&mut self, steps: u64) {
        self.step = steps;
    }
}

impl Optimizer for AdamW {
    fn begin_step(&mut self) {
        self.step += 1;
    }

    fn update<L, G>(&self, p: &mut Param<L>, g: &DTensor<G>) -> Result<()>
    where
        L: Layout,
        G: Layout + ReducedGrad<L>,
    {
        check_grad("AdamW::update", p, g)?;
        let t = self.step.max(1) as i32;
        let decay = if p.value().global_shape().len() >= 2 || self.decay_vectors {
            self.weight_decay
        } else {
            0.0
        };
        let h = AdamHyper {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            decay,
            c1: 1.0 - self.beta1.powi(t),
            c2: 1.0 - self.beta2.powi(t),
        };
        // The moments live in the parameter's dtype for f32 and f64 (as PyTorch keeps them),
        // in f64 for the 16-bit dtypes.
        let state_dtype = match p.local().dtype() {
            DType::F32 => DType::F32,
            _ => DType::F64,
        };
        let place = p.local().device().cloned();
        if p.state.len() != 2
            || p.state[0].dtype() != state_dtype
            || p.state[0].device() != place.as_ref()
        {
            let shape = p.local().shape().to_vec();
            p.state = vec![
                Tensor::zeros_on(place.as_ref(), &shape, state_dtype)?,
                Tensor::zeros_on(place.as_ref(), &shape, state_dtype)?,
            ];
        }
        let [m, v] = &mut p.state[..] else {
            unreachable!("two moments set above")
        };
        if place.is_some() {
            return adamw_device(&mut p.value, g.as_local(), m, v, &h);
        }
        match p.value.as_local().dtype() {
            DType::F32 => {
                let (m, v) = (m.as_mut_slice::<f32>()?, v.as_mut_slice::<f32>()?);
                let g = g.as_local().as_slice::<f32>()?;
                p.value.update_local_in_place(|w| {
                    adamw_step(w.as_mut_slice::<f32>()?, g, m, v, &h);
                    Ok(())
                })
            }
            DType::F64 => {
                let (m, v) = (m.as_mut_slice::<f64>()?, v.as_mut_slice::<f64>()?);
                let g = g.as_local().as_slice::<f64>()?;
                p.value.update_local_in_place(|w| {
                    adamw_step(w.as_mut_slice::<f64>()?, g, m, v, &h);
                    Ok(())
                })
            }
            dtype => {
                // 16-bit values: step in f64, round once.
                let (m, v) = (m.as_mut_slice::<f64>()?, v.as_mut_slice::<f64>()?);
                let g = g.as_local().to_f64_vec();
                let mut w = p.value.as_local().to_f64_vec();
                adamw_step(&mut w, &g, m, v, &h);
                let t = Tensor::from_f64_vec(w, p.value.local_shape(), dtype)?;
                p.value.update_local(|_| Ok(t))
            }
        }
    }
}

/// AdamW on a parameter in device memory: the device kernel (`cuda::ops::adamw_step`, the
/// formula and order of [`adamw_step`]), in place on the parameter and its moments.
#[cfg(feature = "cuda")]
fn adamw_device<L: Layout>(
    w: &mut DTensor<L>,
    g: &Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    h: &AdamHyper,
) -> Result<()> {
    use dtensor_kernels::cuda::{ops, CudaTensor};
    let step = ops::AdamWStep {
        lr: h.lr,
        beta1: h.beta1,
        beta2: h.beta2,
        eps: h.eps,
        decay: h.decay,
        c1: h.c1,
        c2: h.c2,
    };
    // Moved out of their tensors and back, so the kernel writes the only reference to each
    // buffer (no copy on write).
    let take = |t: &mut Tensor| -> Result<CudaTensor> {
        let dtype = t.dtype();
        std::mem::replace(t, Tensor::zeros(&[0], dtype))
            .try_into_cuda()
            .map_err(|_| {
                dtensor_kernels::Error::NotOnDevice {
                    op: "AdamW::update",
                }
                .into()
            })
    };
    let g = g.cuda_tensor()?;
    let (mut mc, mut vc) = (take(m)?, take(v)?);
    let r = w.update_local_in_place(|wl| {
        let mut wc = take(wl)?;
        let r = ops::adamw_step(&mut wc, &g, &mut mc, &mut vc, &step);
        *wl = Tensor::from(wc);
        Ok(r?)
    });
    *m = Tensor::from(mc);
    *v = Tensor::from(vc);
    r
}

/// Without the `cuda` feature no tensor is in device memory.
#[cfg(not(feature = "cuda"))]
fn adamw_device<L: Layout>(
    _w: &mut DTensor<L>,
    _g: &Tensor,
    _m: &mut Tensor,
    _v: &mut Tensor,
    _h: &AdamHyper,
) -> Result<()> {
    unreachable!("a parameter in device memory in a build without `cuda`")
}

/// One AdamW step's constants (`c1`, `c2`: the bias corrections).
struct AdamHyper {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    decay: f64,
    c1: f64,
    c2: f64,
}

/// `m ← β1·m + (1−β1)·g`, `v ← β2·v + (1−β2)·g²`,
/// `w ← w − lr·((m/c1)/(√(v/c2) + eps) + decay·w)`, in place, in `T`'s arithmetic.
fn adamw_step<T: num_traits::Float>(w: &mut [T], g: &[T], m: &mut [T], v: &mut [T], h: &AdamHyper) {
    let c = |x: f64| T::from(x).unwrap_or_else(T::nan);
    let (b1, b2, one) = (c(h.beta1), c(h.beta2), T::one());
    let (c1, c2, eps, lr, decay) = (c(h.c1), c(h.c2), c(h.eps), c(h.lr), c(h.decay));
    for i in 0..w.len() {
        m[i] = b1 * m[i] + (one - b1) * g[i];
        v[i] = b2 * v[i] + (one - b2) * g[i] * g[i];
        let upd = (m[i] / c1) / ((v[i] / c2).sqrt() + eps);
        w[i] = w[i] - lr * (upd + decay * w[i]);
    }
}

/// The squared global norm of a set of gradients, each element counted once: a rank adds
/// its local sum of squares only if it is coordinate 0 on every axis where the gradient is
/// not sharded (the other coordinates hold copies), and the sum is then reduced over every
/// axis.
#[derive(Clone, Debug, Default)]
pub struct GradNorm {
    sum_sq: f64,
}

impl GradNorm {
    /// An empty sum: norm 0 until gradients are added.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one reduced gradient (no `Partial` axis).
    pub fn add<G: Layout>(&mut self, g: &DTensor<G>) -> Result<()> {
        let mesh = g.device_mesh();
        let mut counted = true;
        for (a, p) in G::placements().iter().enumerate() {
            match p {
                Placement::Shard(_) => {}
                Placement::Partial(_) => {
                    return Err(Error::PlacementMismatch {
                        op: "GradNorm::add",
                        axis: mesh.mesh().axes()[a].0,
                        placements: G::placements(),
                        detail: "reduce the gradient before taking its norm".into(),
                    })
                }
                _ => counted &= mesh.coords()[a] == 0,
            }
        }
        if counted {
            self.sum_sq += sum_of_squares(g.as_local())?;
        }
        Ok(())
    }

    /// Collective over every rank of `mesh`'s root world (a pipeline stage's sub-mesh sums
    /// over the other stages too, whose parameters are their own): the global norm.
    pub fn finish(&self, mesh: &dtensor_core::DeviceMesh) -> Result<f64> {
        let mut s = [self.sum_sq];
        dtensor_core::transfer::all_reduce_values(&**mesh.root_world(), &mut s, ReduceOp::Sum)?;
        Ok(s[0].sqrt())
    }
}

/// `Σ x²` over a gradient's local piece: in f64 on the host; on a device, squared and
/// summed there (in the dtype's accumulator) and only the scalar copied back.
fn sum_of_squares(t: &Tensor) -> Result<f64> {
    if t.is_cuda() {
        // `sum_rows` gives a thread to each column: `cols` partial sums (each over n/cols
        // rows, in the dtype's accumulator) come back and are added in f64.
        let n = t.numel();
        let cols = [1024, 256, 64, 16, 4, 1]
            .into_iter()
            .find(|c| n % c == 0)
            .unwrap_or(1);
        let sq = t.mul(t)?.reshape(&[n / cols, cols])?;
        let s = dtensor_kernels::ops::sum_rows(&sq)?;
        return Ok(s.to_host()?.to_f64_vec().iter().sum());
    }
    Ok(t.to_f64_vec().iter().map(|x| x * x).sum::<f64>())
}

/// The factor clipping scales gradients by so that their global norm is at most `max_norm`
/// (1 when it already is).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}
