//! Parameters and their gradients: the floor below the layers and the optimizer.
//!
//! | item | what it holds |
//! |---|---|
//! | [`Param`] | a trainable tensor: its value, the optimizer's per-element state, and the key the tape binds its leaves to |
//! | [`Weight`] | a layer's parameter under a data mode: the master ([`Param`]), the compute copy, and between a step's reduction and its update the reduced gradient |
//! | [`Module`], [`ParamVisitor`], [`StateVisitor`] | every parameter of a layer or model, visited in a fixed order with its dotted name ([`join_name`]) |
//! | [`GradAccumulator`] | a step's gradients summed over microbatches, one entry per parameter key |
//! | [`reduce_grad`], [`dp_average`] | a typed gradient reduced to its parameter's placement by hand |
//!
//! A gradient's way from the tape to the optimizer: [`GradAccumulator::add`] reads each
//! parameter's gradient from the tape typed ([`Weight::grad`], or reduced over `Dp` for the
//! modes that reduce after every backward) and sums it under the parameter's key, untyped,
//! because one map holds every layout. The optimizer step ([`step`](crate::step)) takes each
//! sum back by the same key, typed again as the weight's layout says, reduces it to the
//! master's placement and leaves it in the weight ([`Weight::step_grad`]) until the global
//! norm is known; the update then reads every weight's own gradient. Nothing is matched by
//! visiting order.

use crate::data::{
    ComputeOf, DataMode, DpGather, DpMaster, DpReducedOf, DpWhole, MasterLayout, ParamKind,
    Precision, ReducedLayout, WorkLayout,
};
use crate::seq::{axis_size, DpLayout, DpPartial, DpReduced, TpParam};
use dtensor_core::{
    AnyDTensor, DTensor, DeviceMesh, Error, Gradients, PendingAllGather, Result, Tape, Var,
};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{AxisKind, Dp, Layout, Linear, Placement, PlacementType};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

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
    /// some, as [`AdamW`](crate::AdamW) does its moments, creates it at its first update)
    /// and a key of its own.
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
    pub(crate) fn set_local(&mut self, local: Tensor) -> Result<()> {
        self.value.update_local(|_| Ok(local))
    }
    /// The value and the optimizer's state, both writable: what an optimizer updates in
    /// place.
    pub(crate) fn value_and_state_mut(&mut self) -> (&mut DTensor<L>, &mut Vec<Tensor>) {
        (&mut self.value, &mut self.state)
    }
}

/// A layer's parameter under data mode `D`: the master ([`Param`], with the optimizer's
/// state) laid out [`MasterLayout<D, K>`], and the compute copy laid out
/// [`WorkLayout<D, K>`] when it is not the master itself (another dtype, or ZeRO's
/// replicated copy of a sharded master).
pub struct Weight<D: DataMode, K: ParamKind> {
    master: Param<MasterLayout<D, K>>,
    work: Option<DTensor<WorkLayout<D, K>>>,
    precision: Precision,
    /// A gather [`prefetch`](Self::prefetch) started, shared with clones (a recomputed
    /// block runs a clone).
    prefetched: Arc<Mutex<Option<Prefetch<D, K>>>>,
    /// This step's gradient, reduced to the master's placement: set when the step reduces
    /// it, taken by the update once the global norm is known.
    step_grad: Option<DTensor<ReducedLayout<D, K>>>,
}

/// A started gather of a weight's stored copy.
type Prefetch<D, K> =
    PendingAllGather<WorkLayout<D, K>, DpWhole<<K as ParamKind>::Tp, <K as ParamKind>::Ep>>;

/// The same parameter (same key, shared tensors, nothing copied): what a recomputed
/// region captures to run its layer again in the backward.
impl<D: DataMode, K: ParamKind> Clone for Weight<D, K> {
    fn clone(&self) -> Self {
        Weight {
            master: self.master.clone(),
            work: self.work.clone(),
            precision: self.precision,
            prefetched: self.prefetched.clone(),
            step_grad: self.step_grad.clone(),
        }
    }
}

impl<D: DataMode, K: ParamKind> Weight<D, K> {
    /// A parameter whose master value is `master`. Collective for ZeRO (it all-gathers the
    /// compute copy).
    pub fn new(master: DTensor<MasterLayout<D, K>>, precision: Precision) -> Result<Self> {
        let work = <D::Master<K> as DpMaster<D::Work<K>>>::refresh(&master, &precision)?;
        Ok(Weight {
            master: Param::new(master),
            work,
            precision,
            prefetched: Arc::default(),
            step_grad: None,
        })
    }

    /// The master: the value the optimizer updates, with its state.
    pub fn master(&self) -> &Param<MasterLayout<D, K>> {
        &self.master
    }

    /// The master's value.
    pub fn value(&self) -> &DTensor<MasterLayout<D, K>> {
        self.master.value()
    }

    /// The compute and reduction dtypes and FSDP flags this parameter was made with.
    pub fn precision(&self) -> &Precision {
        &self.precision
    }

    /// The compute copy as stored, bound on `tape` (a leaf whose gradient `step` reads
    /// back), not yet gathered: under FSDP it is `Shard` over `Dp` and no compute op takes
    /// it with the tokens.
    pub fn stored<'t>(&self, tape: &'t Tape) -> Result<Var<'t, WorkLayout<D, K>>> {
        Ok(tape.param(self.master.key(), self.bound()?))
    }

    fn bound(&self) -> Result<DTensor<WorkLayout<D, K>>> {
        <D::Master<K> as DpMaster<D::Work<K>>>::bound(
            self.master.value(),
            self.work.as_ref(),
            &self.precision,
        )
    }

    /// The whole parameter for compute, on `tape`: the stored copy, all-gathered over
    /// `Dp` under FSDP (its adjoint reduce-scatters the gradient).
    pub fn on<'t>(&self, tape: &'t Tape) -> Result<Var<'t, ComputeOf<K>>> {
        gather_or_finish::<D, K>(&self.stored(tape)?, &self.prefetched, self.compute_dtype())
    }

    /// Starts gathering the stored copy over `Dp` now (FSDP; nothing otherwise), so that
    /// the next [`on`](Self::on) or [`apply`](Self::apply) only waits for it: called for
    /// the next block while this one computes.
    pub fn prefetch(&self) -> Result<()> {
        if !<D::Work<K> as DpGather>::SHARDED {
            return Ok(());
        }
        let pending = <D::Work<K> as DpGather>::start_gather(&self.bound()?)?;
        *lock(&self.prefetched) = pending;
        Ok(())
    }

    /// `f(x, whole parameter)`. Under FSDP with `reshard_after_forward` the gathered
    /// parameter is not kept: `f` runs as a recomputed region whose backward gathers
    /// again (and recomputes `f`, one product for a linear layer).
    pub fn apply<'t, Lx: Layout, Out: Layout>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Lx>,
        f: impl for<'s> Fn(&Var<'s, Lx>, &Var<'s, ComputeOf<K>>) -> Result<Var<'s, Out>> + 'static,
    ) -> Result<Var<'t, Out>> {
        if <D::Work<K> as DpGather>::SHARDED && self.precision.reshard_after_forward {
            let c = self.compute_dtype();
            // The forward may finish a prefetched gather; the backward's recomputation
            // finds none and gathers again.
            let cell = self.prefetched.clone();
            x.checkpoint_with(&self.stored(tape)?, move |_, x, s| {
                f(x, &gather_or_finish::<D, K>(s, &cell, c)?)
            })
        } else {
            f(x, &self.on(tape)?)
        }
    }

    /// The master's local piece.
    pub fn local(&self) -> &dtensor_kernels::Tensor {
        self.master.local()
    }

    /// The raw gradient backward produced for the stored copy (summed over its uses,
    /// zeros if unused), before any reduction: `Partial` over `Dp` for a replicated copy,
    /// already reduce-scattered for an FSDP shard.
    #[allow(clippy::type_complexity)]
    pub fn grad(
        &self,
        grads: &mut Gradients,
    ) -> Result<DTensor<<WorkLayout<D, K> as Layout>::Grad>> {
        grads.of_key(self.master.key(), &self.bound()?)
    }

    /// Whether this parameter's gradient is all-reduced over `Dp` (DDP, or a column bias
    /// in any mode): what [`DdpBuckets`](crate::DdpBuckets) may fuse.
    pub fn is_all_reduced(&self) -> bool {
        <D::Master<K> as DpMaster<D::Work<K>>>::ALL_REDUCE
    }

    /// The dtype compute runs in.
    pub fn compute_dtype(&self) -> DType {
        self.precision.compute_of(self.master.local().dtype())
    }

    /// A raw gradient ([`grad`](Self::grad), or a sum of them over microbatches) reduced
    /// over `Dp` to the master's placement (all-reduce, reduce-scatter, or nothing under
    /// FSDP), in the master's dtype. Collective over `Dp`.
    #[allow(clippy::type_complexity)]
    pub fn dp_reduce(
        &self,
        raw: DTensor<<WorkLayout<D, K> as Layout>::Grad>,
    ) -> Result<DTensor<DpLayout<DpReducedOf<D, K>, <K::Tp as PlacementType>::Grad, K::Ep>>> {
        <D::Master<K> as DpMaster<D::Work<K>>>::reduce(
            raw,
            self.master.local().dtype(),
            &self.precision,
        )
    }

    /// [`grad`](Self::grad) then [`dp_reduce`](Self::dp_reduce).
    #[allow(clippy::type_complexity)]
    pub fn dp_reduced_grad(
        &self,
        grads: &mut Gradients,
    ) -> Result<DTensor<DpLayout<DpReducedOf<D, K>, <K::Tp as PlacementType>::Grad, K::Ep>>> {
        self.dp_reduce(self.grad(grads)?)
    }

    /// [`dp_reduced_grad`](Self::dp_reduced_grad), then reduced over `Tp` where the
    /// parameter is `Replicate` there (sequence-parallel norm weights): what the optimizer
    /// takes.
    pub fn reduced_grad(&self, grads: &mut Gradients) -> Result<DTensor<ReducedLayout<D, K>>> {
        <K::Tp as TpParam>::reduce_over_tp(self.dp_reduced_grad(grads)?)
    }

    /// This step's gradient reduced to the master's placement, between the step's
    /// reduction and its update (`None` outside a step).
    pub fn step_grad(&self) -> Option<&DTensor<ReducedLayout<D, K>>> {
        self.step_grad.as_ref()
    }

    /// Keeps `g`, this step's reduced gradient, for the update.
    pub(crate) fn set_step_grad(&mut self, g: DTensor<ReducedLayout<D, K>>) {
        self.step_grad = Some(g);
    }

    /// Takes this step's reduced gradient out.
    pub(crate) fn take_step_grad(&mut self) -> Option<DTensor<ReducedLayout<D, K>>> {
        self.step_grad.take()
    }

    /// Runs `update` on the master (an optimizer's step) and rebuilds the compute copy
    /// (for ZeRO an all-gather over `Dp` of the updated shard).
    pub(crate) fn update_master(
        &mut self,
        update: impl FnOnce(&mut Param<MasterLayout<D, K>>) -> Result<()>,
    ) -> Result<()> {
        // Drop the compute copy first: it may share the master's buffer, which the
        // in-place update would otherwise copy. A gather still pending holds the old value.
        self.work = None;
        *lock(&self.prefetched) = None;
        update(&mut self.master)?;
        self.work =
            <D::Master<K> as DpMaster<D::Work<K>>>::refresh(self.master.value(), &self.precision)?;
        Ok(())
    }

    /// Replaces the master's value and optimizer state (a checkpoint's) and rebuilds the
    /// compute copy (for ZeRO an all-gather over `Dp`: collective there).
    pub fn restore(
        &mut self,
        value: DTensor<MasterLayout<D, K>>,
        state: Vec<dtensor_kernels::Tensor>,
    ) -> Result<()> {
        self.master.restore(value, state)?;
        self.work = None;
        *lock(&self.prefetched) = None;
        self.work =
            <D::Master<K> as DpMaster<D::Work<K>>>::refresh(self.master.value(), &self.precision)?;
        Ok(())
    }

    /// Bytes of parameter values this rank holds (master, and the compute copy when it is
    /// another tensor).
    pub fn held_bytes(&self) -> usize {
        self.master.local().size_in_bytes()
            + self
                .work
                .as_ref()
                .map_or(0, |w| w.as_local().size_in_bytes())
    }
}

/// The stored copy made whole: a prefetched gather finished, or a gather now.
fn gather_or_finish<'t, D: DataMode, K: ParamKind>(
    stored: &Var<'t, WorkLayout<D, K>>,
    cell: &Mutex<Option<Prefetch<D, K>>>,
    compute: DType,
) -> Result<Var<'t, ComputeOf<K>>> {
    match lock(cell).take() {
        Some(p) => <D::Work<K> as DpGather>::gather_prefetched(stored, p, compute),
        None => <D::Work<K> as DpGather>::gather(stored, compute),
    }
}

/// The lock, even if a panicking rank poisoned it (the value is an `Option` either way).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
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

/// Averages a gradient over `Dp`: `Partial` terms scaled by `1/dp`, then all-reduced (for a
/// loss that is each rank's *own* mean; [`reduce_grad`] sums, for the typed [`Loss`](crate::Loss)).
pub fn dp_average<T: PlacementType + Linear>(
    g: DTensor<DpPartial<T>>,
) -> Result<DTensor<DpReduced<T>>> {
    let dp = axis_size(g.device_mesh(), AxisKind::Dp);
    let g = if dp > 1 { g.scale(1.0 / dp as f64)? } else { g };
    g.all_reduce(Dp)
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
    sums: HashMap<u64, AnyDTensor>,
    /// Gradients already reduced over `Dp` by [`DdpBuckets`](crate::DdpBuckets).
    dp_reduced: HashMap<u64, AnyDTensor>,
    /// Parameters a bucket took in this backward (the plain `add` skips them).
    bucketed: HashSet<u64>,
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

    /// Takes the sum for `w` (named `name`) out by its key, typed as `w`'s raw or
    /// `Dp`-reduced gradient, and reduces it to the master's placement over `Dp` and `Tp`.
    /// Collective over `Dp` and `Tp` where the data mode reduces there.
    pub(crate) fn take_reduced<D: DataMode, K: ParamKind>(
        &mut self,
        name: &str,
        w: &Weight<D, K>,
    ) -> Result<DTensor<ReducedLayout<D, K>>> {
        let key = w.master().key();
        if let Some(any) = self.dp_reduced.remove(&key) {
            return <K::Tp as TpParam>::reduce_over_tp(DTensor::try_from_any(any)?);
        }
        let any = self.sums.remove(&key).ok_or_else(|| Error::InvalidUse {
            op: "optim::step",
            detail: format!(
                "no gradient was accumulated for parameter {name} (no backward added, or \
                 another module's accumulator)"
            ),
        })?;
        let dp = if D::REDUCE_EACH_BACKWARD {
            DTensor::try_from_any(any)?
        } else {
            w.dp_reduce(DTensor::try_from_any(any)?)?
        };
        <K::Tp as TpParam>::reduce_over_tp(dp)
    }
}
