//! Reverse-mode autograd with gradients typed as the dual layout.
//!
//! A [`Tape`] lives on one rank, inside the SPMD closure (nothing global: thread ranks never
//! share one). [`Var<L>`] is a value on the tape: the typed compute ops and the named
//! transitions of [`DTensor`] have `Var` twins that record their backward. The backward of a
//! value laid out `L` receives a gradient laid out `L::Grad` and returns the inputs'
//! gradients laid out as *their* duals; the rule tables close under duality (checked when
//! `dtensor-placement` builds), so these types hold by construction and every wrap is
//! checked against the local shape at run time as well.
//!
//! Ranks run the same program, so they record the same nodes in the same order, and the
//! reverse walk issues the backward collectives in the same order everywhere. A collective
//! node always runs, with zeros when no gradient reached it, so no rank skips one.
//!
//! ```
//! use dtensor_collectives::threads;
//! use dtensor_core::{DTensor, DeviceMesh, Error, Tape};
//! use dtensor_kernels::Tensor;
//! use dtensor_placement::{layout, AxisKind, Invariant, Mesh, Partial, Replicate, Shard, Tp};
//!
//! // loss = Σ (x·Wᵀ) with W split by output rows over Tp (column-parallel).
//! let results = threads::launch(2, |world| -> Result<Vec<f64>, Error> {
//!     let mesh = DeviceMesh::new(world, Mesh::new(&[(AxisKind::Tp, 2)])?)?;
//!     let src = |t: Tensor| Some(t).filter(|_| mesh.rank() == 0);
//!     let x = DTensor::<layout![Tp: Invariant]>::distribute(src(Tensor::from_fn(&[3, 2], |i| i as f64)).as_ref(), 0, &mesh)?;
//!     let w = DTensor::<layout![Tp: Shard<0>]>::distribute(src(Tensor::from_fn(&[4, 2], |i| 1.0 + i as f64)).as_ref(), 0, &mesh)?;
//!     let tape = Tape::new();
//!     let (x, w) = (tape.constant(x), tape.leaf(w));
//!     let y = x.to_replicate(Tp)?.matmul_t(&w)?;             // [3, 4], Tp: Shard<1>
//!     let loss = y.sum_dim::<1>()?.sum_dim::<0>()?;             // Tp: Partial (a scalar)
//!     let mut grads = loss.backward()?;
//!     let dw: DTensor<layout![Tp: Shard<0>]> = grads.take(&w)?; // the dual of Shard<0>
//!     Ok(dw.full_tensor()?.to_f64_vec())
//! });
//! // d loss / d W[o, i] = Σ_rows x[r, i] = [6, 9] for every output row o.
//! for r in results {
//!     assert_eq!(r.unwrap(), vec![6.0, 9.0, 6.0, 9.0, 6.0, 9.0, 6.0, 9.0]);
//! }
//! ```

use crate::any::AnyDTensor;
use crate::compute::output;
use crate::device_mesh::DeviceMesh;
use crate::error::Result;
use crate::typed::DTensor;
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{Layout, LossLayout, Placement};
use smallvec::SmallVec;
use std::cell::RefCell;
use std::sync::Arc;

type Backward = Box<dyn FnOnce(&mut GradStore) -> Result<()>>;
/// Receives a parameter's key and its final gradient during a backward.
/// Returns the gradient back when it does not take it (it then stays in the
/// [`Gradients`]).
type ParamHook<'h> = &'h mut dyn FnMut(u64, AnyDTensor) -> Result<Option<AnyDTensor>>;
/// A backward that computes the gradients of the inputs `want` marks, and can run again
/// for the others (zero-bubble pipelines defer a weight's half of a product).
type HalfBackward = Box<dyn Fn(&mut GradStore, &[bool]) -> Result<()>>;

enum Run {
    Whole(Backward),
    Halves(HalfBackward),
}

struct Node {
    /// The values this node produced (one, but for a [custom op](crate::custom) with
    /// several outputs).
    outs: SmallVec<[usize; 1]>,
    /// The values it was computed from.
    inputs: SmallVec<[usize; 3]>,
    /// Issues a collective in backward: runs even when no gradient reached `out`.
    collective: bool,
    run: Run,
}

impl Node {
    /// Whether a gradient reached any of its outputs.
    fn reached(&self, store: &GradStore) -> bool {
        self.outs.iter().any(|&o| store.slots[o].is_some())
    }

    /// Runs the whole backward (every input's gradient).
    fn run_all(self, store: &mut GradStore) -> Result<()> {
        match self.run {
            Run::Whole(f) => f(store),
            Run::Halves(f) => f(store, &[true; 3][..self.inputs.len()]),
        }
    }
}

#[derive(Default)]
struct TapeInner {
    nodes: Vec<Node>,
    vars: usize,
    /// `(key, value id)` of every [`Tape::param`] leaf.
    params: Vec<(u64, usize)>,
    /// The values of those leaves, in the same order (a recomputed region re-binds its
    /// parameters' gradients to the outer tape through them).
    param_values: Vec<AnyDTensor>,
    /// Computed values whose gradient is kept after backward ([`Var::retain_grad`]).
    retained: Vec<usize>,
}

/// A region of the forward opened by [`Tape::trace_begin`].
pub struct TraceRegion {
    cell: Arc<std::sync::Mutex<Option<(String, std::time::Instant)>>>,
}

/// One rank's record of the forward pass, in program order. Not `Send`: build it inside
/// the SPMD closure.
#[derive(Default)]
pub struct Tape {
    inner: RefCell<TapeInner>,
}

/// What a backward needs to make zeros for a gradient nobody sent.
#[derive(Clone)]
struct Meta {
    local: Vec<usize>,
    global: Vec<usize>,
    dtype: DType,
    mesh: Arc<DeviceMesh>,
}

impl Meta {
    fn of(t: &AnyDTensor) -> Self {
        Meta {
            local: t.local_shape().to_vec(),
            global: t.global_shape().to_vec(),
            dtype: t.dtype(),
            mesh: t.device_mesh().clone(),
        }
    }
}

/// Gradients by value id; slot `i` only ever holds value `i`'s gradient, laid out as the
/// dual of that value's layout.
pub struct GradStore {
    slots: Vec<Option<AnyDTensor>>,
}

impl GradStore {
    /// The gradient of value `id` (laid out `L::Grad`), or zeros when nothing reached it.
    fn grad_or_zeros<L: Layout>(&self, id: usize, meta: &Meta) -> Result<DTensor<L::Grad>> {
        let placements = <L::Grad as Layout>::placements();
        Ok(DTensor::wrap(self.grad_or_zeros_any(
            id,
            meta,
            &placements,
        )?))
    }

    /// [`grad_or_zeros`](Self::grad_or_zeros) with the gradient's placements given.
    fn grad_or_zeros_any(
        &self,
        id: usize,
        meta: &Meta,
        placements: &[Placement],
    ) -> Result<AnyDTensor> {
        match self.slots.get(id).and_then(|s| s.as_ref()) {
            Some(g) => Ok(g.clone()),
            None => {
                let zeros = Tensor::zeros_on(meta.mesh.device(), &meta.local, meta.dtype)?;
                AnyDTensor::from_local_for(
                    "Tape::backward (zero gradient)",
                    zeros,
                    &meta.global,
                    placements,
                    &meta.mesh,
                )
            }
        }
    }

    /// Adds `g` into value `id`'s gradient.
    pub(crate) fn accumulate<L: Layout>(&mut self, id: usize, g: DTensor<L::Grad>) -> Result<()> {
        self.accumulate_any(id, g.into_any())
    }

    /// [`accumulate`](Self::accumulate) for a gradient whose layout the caller took from
    /// the same value's gradient on another tape (a recomputed region's parameters).
    pub(crate) fn accumulate_any(&mut self, id: usize, g: AnyDTensor) -> Result<()> {
        let slot = &mut self.slots[id];
        *slot = Some(match slot.take() {
            None => g,
            Some(old) => {
                let sum = old.as_local().add(g.as_local())?;
                AnyDTensor::from_local_for(
                    "Tape::backward (accumulate)",
                    sum,
                    old.global_shape(),
                    old.placements(),
                    old.device_mesh(),
                )?
            }
        });
        Ok(())
    }
}

/// The gradients a backward pass produced, read back through the values' handles.
pub struct Gradients {
    store: GradStore,
    params: Vec<(u64, usize)>,
    /// Computed values whose gradients backward freed after passing them on.
    freed: Vec<bool>,
}

impl Gradients {
    /// The gradient of `v`, laid out as the dual of `v`'s layout (zeros if `v` did not
    /// reach the value backward started from). For leaves (constants, parameters) and for
    /// computed values marked with [`Var::retain_grad`] before backward; backward frees
    /// the other computed values' gradients, and asking for one is an `Err`.
    pub fn take<L: Layout>(&mut self, v: &Var<'_, L>) -> Result<DTensor<L::Grad>> {
        if self.freed.get(v.id).copied().unwrap_or(false) {
            return Err(crate::Error::InvalidUse {
                op: "Gradients::take",
                detail: "this computed value's gradient was freed during backward; call \
                         retain_grad() on it before backward to keep it"
                    .into(),
            });
        }
        let meta = Meta::of(v.value.as_any());
        let g = self.store.grad_or_zeros::<L>(v.id, &meta)?;
        self.store.slots[v.id] = None;
        Ok(g)
    }

    /// The gradient of the parameter bound to `key` (laid out as the dual of `value`'s
    /// layout): the sum over its leaves, zeros if it was not used.
    pub fn of_key<L: Layout>(&mut self, key: u64, value: &DTensor<L>) -> Result<DTensor<L::Grad>> {
        let meta = Meta::of(value.as_any());
        match self.sum_of_key(key)? {
            Some(g) => Ok(DTensor::wrap(g)),
            None => self.store.grad_or_zeros::<L>(usize::MAX, &meta),
        }
    }

    /// The sum of the gradients of the leaves bound to `key`, if any reached them.
    fn sum_of_key(&mut self, key: u64) -> Result<Option<AnyDTensor>> {
        let ids: Vec<usize> = self
            .params
            .iter()
            .filter(|(k, _)| *k == key)
            .map(|&(_, id)| id)
            .collect();
        let mut total: Option<AnyDTensor> = None;
        for id in ids {
            if let Some(g) = self.store.slots[id].take() {
                total = Some(match total {
                    None => g,
                    Some(t) => {
                        let sum = t.as_local().add(g.as_local())?;
                        AnyDTensor::from_local_for(
                            "Gradients::of_key",
                            sum,
                            t.global_shape(),
                            t.placements(),
                            t.device_mesh(),
                        )?
                    }
                });
            }
        }
        Ok(total)
    }
}

/// A value on a tape, laid out `L`.
pub struct Var<'t, L: Layout> {
    value: DTensor<L>,
    id: usize,
    tape: &'t Tape,
}

impl<L: Layout> Clone for Var<'_, L> {
    fn clone(&self) -> Self {
        Var {
            value: self.value.clone(),
            id: self.id,
            tape: self.tape,
        }
    }
}

impl Tape {
    /// An empty tape: no values, no backward nodes.
    pub fn new() -> Self {
        Tape::default()
    }

    fn new_id(&self) -> usize {
        let mut inner = self.inner.borrow_mut();
        inner.vars += 1;
        inner.vars - 1
    }

    /// A value whose gradient nobody needs (inputs, token ids).
    pub fn constant<L: Layout>(&self, value: DTensor<L>) -> Var<'_, L> {
        Var {
            value,
            id: self.new_id(),
            tape: self,
        }
    }

    /// A value whose gradient is read after backward (a parameter). The same as
    /// [`constant`](Self::constant) on this tape: every value's gradient can be read.
    pub fn leaf<L: Layout>(&self, value: DTensor<L>) -> Var<'_, L> {
        self.constant(value)
    }

    /// A leaf bound to a parameter `key` (any id unique among the parameters): after
    /// backward, [`Gradients::of_key`] sums the gradients of every leaf bound to it (a
    /// parameter used twice, such as tied embeddings, gets both contributions).
    pub fn param<L: Layout>(&self, key: u64, value: DTensor<L>) -> Var<'_, L> {
        let id = self.param_any(key, value.as_any().clone());
        Var {
            value,
            id,
            tape: self,
        }
    }

    fn param_any(&self, key: u64, value: AnyDTensor) -> usize {
        let id = self.new_id();
        let mut inner = self.inner.borrow_mut();
        inner.params.push((key, id));
        inner.param_values.push(value);
        id
    }

    /// The parameters bound on this tape so far, one entry per key (first value seen).
    fn bound_params(&self) -> Vec<(u64, AnyDTensor)> {
        let inner = self.inner.borrow();
        let mut out: Vec<(u64, AnyDTensor)> = Vec::new();
        for ((key, _), v) in inner.params.iter().zip(&inner.param_values) {
            if !out.iter().any(|(k, _)| k == key) {
                out.push((*key, v.clone()));
            }
        }
        out
    }

    /// Binds, on this tape, one leaf per parameter `scratch` bound (a recomputed region's
    /// parameters): `(key, leaf id, value)`.
    fn rebind_params(&self, scratch: &Tape) -> Vec<(u64, usize, AnyDTensor)> {
        scratch
            .bound_params()
            .into_iter()
            .map(|(key, v)| (key, self.param_any(key, v.clone()), v))
            .collect()
    }

    /// Adds a recomputed region's parameter gradients into this tape's leaves for them.
    fn accumulate_params(
        g: &mut Gradients,
        params: &[(u64, usize, AnyDTensor)],
        store: &mut GradStore,
    ) -> Result<()> {
        for (key, id, _) in params {
            if let Some(gk) = g.sum_of_key(*key)? {
                store.accumulate_any(*id, gk)?;
            }
        }
        Ok(())
    }

    /// The start of a named region of the forward (a layer) for the timeline: with
    /// [`trace_end`](Self::trace_end) after it, the backward records a span
    /// `"{name} backward"` from the region's last node to its first. Records nothing when
    /// [`trace`](dtensor_collectives::trace) is off.
    pub fn trace_begin(&self) -> Option<TraceRegion> {
        if !dtensor_collectives::trace::is_enabled() {
            return None;
        }
        let cell: Arc<std::sync::Mutex<Option<(String, std::time::Instant)>>> = Arc::default();
        let begin = cell.clone();
        let id = self.new_id();
        // Runs last in the backward: the region's backward ends here.
        self.push(
            id,
            &[],
            true,
            Run::Whole(Box::new(move |_| {
                let taken = begin.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some((name, start)) = taken {
                    let dur = start.elapsed().as_secs_f64() * 1e6;
                    dtensor_collectives::trace::record(name, "backward", start, dur, Vec::new());
                }
                Ok(())
            })),
        );
        Some(TraceRegion { cell })
    }

    /// The end of a region [`trace_begin`](Self::trace_begin) opened, named `name`.
    pub fn trace_end(&self, region: Option<TraceRegion>, name: impl FnOnce() -> String) {
        let Some(region) = region else { return };
        let cell = region.cell;
        let label = format!("{} backward", name());
        let id = self.new_id();
        // Runs first in the backward: the region's backward starts here.
        self.push(
            id,
            &[],
            true,
            Run::Whole(Box::new(move |_| {
                *cell.lock().unwrap_or_else(|e| e.into_inner()) =
                    Some((label, std::time::Instant::now()));
                Ok(())
            })),
        );
    }

    /// Number of recorded backward nodes.
    pub fn len(&self) -> usize {
        self.inner.borrow().nodes.len()
    }

    /// Whether no backward node has been recorded yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn record<'t, Out: Layout>(
        &'t self,
        value: DTensor<Out>,
        collective: bool,
        inputs: &[usize],
        back: impl FnOnce(DTensor<Out::Grad>, &mut GradStore) -> Result<()> + 'static,
    ) -> Var<'t, Out> {
        let id = self.new_id();
        let meta = Meta::of(value.as_any());
        let run: Backward = Box::new(move |store: &mut GradStore| {
            let dy = store.grad_or_zeros::<Out>(id, &meta)?;
            back(dy, store)
        });
        self.push(id, inputs, collective, Run::Whole(run));
        Var {
            value,
            id,
            tape: self,
        }
    }

    /// [`record`](Self::record) for a node whose backward computes each input's gradient
    /// on demand (`want[i]`), so a split backward can defer some of them.
    pub(crate) fn record_halves<'t, Out: Layout>(
        &'t self,
        value: DTensor<Out>,
        inputs: &[usize],
        back: impl Fn(&DTensor<Out::Grad>, &[bool], &mut GradStore) -> Result<()> + 'static,
    ) -> Var<'t, Out> {
        let id = self.new_id();
        let meta = Meta::of(value.as_any());
        let run: HalfBackward = Box::new(move |store: &mut GradStore, want: &[bool]| {
            let dy = store.grad_or_zeros::<Out>(id, &meta)?;
            back(&dy, want, store)
        });
        self.push(id, inputs, false, Run::Halves(run));
        Var {
            value,
            id,
            tape: self,
        }
    }

    /// [`record`](Self::record) for a node with several outputs (a [custom
    /// op](crate::custom)): `outputs` are the values it produced, `grad_placements` each
    /// one's gradient layout (the dual); `back` gets every output's gradient (zeros where
    /// none arrived) and accumulates its inputs'. Returns the outputs' value ids.
    pub(crate) fn record_many(
        &self,
        outputs: &[AnyDTensor],
        grad_placements: Vec<SmallVec<[Placement; 4]>>,
        inputs: &[usize],
        back: impl FnOnce(Vec<AnyDTensor>, &mut GradStore) -> Result<()> + 'static,
    ) -> SmallVec<[usize; 4]> {
        let ids: SmallVec<[usize; 4]> = outputs.iter().map(|_| self.new_id()).collect();
        let metas: Vec<Meta> = outputs.iter().map(Meta::of).collect();
        let outs = ids.clone();
        let run: Backward = Box::new(move |store: &mut GradStore| {
            let mut dys = Vec::with_capacity(outs.len());
            for ((&id, meta), placements) in outs.iter().zip(&metas).zip(&grad_placements) {
                dys.push(store.grad_or_zeros_any(id, meta, placements)?);
            }
            back(dys, store)
        });
        self.push_outs(&ids, inputs, false, Run::Whole(run));
        ids
    }

    fn push(&self, out: usize, inputs: &[usize], collective: bool, run: Run) {
        self.push_outs(&[out], inputs, collective, run);
    }

    fn push_outs(&self, outs: &[usize], inputs: &[usize], collective: bool, run: Run) {
        self.inner.borrow_mut().nodes.push(Node {
            outs: outs.iter().copied().collect(),
            inputs: inputs.iter().copied().collect(),
            collective,
            run,
        });
    }

    /// Runs every recorded node in reverse from a seeded store. With a `hook`, each
    /// parameter's gradient is handed to it (and leaves the store) as soon as it is final:
    /// when every node that read one of the parameter's leaves has run.
    fn run_backward(
        &self,
        mut store: GradStore,
        mut hook: Option<ParamHook<'_>>,
    ) -> Result<Gradients> {
        let nodes = std::mem::take(&mut self.inner.borrow_mut().nodes);
        let params = std::mem::take(&mut self.inner.borrow_mut().params);
        let retained = std::mem::take(&mut self.inner.borrow_mut().retained);
        let values = std::mem::take(&mut self.inner.borrow_mut().param_values);
        let n = self.inner.borrow().vars;
        store.slots.resize(n, None);
        let mut freed = vec![false; n];
        // Where each parameter's gradient becomes final: after the first node (in forward
        // order) that reads any of its leaves, the last to run backward.
        let mut finals: Vec<SmallVec<[u64; 2]>> = Vec::new();
        let mut unread: Vec<u64> = Vec::new();
        if hook.is_some() {
            let mut last_reader: std::collections::HashMap<u64, usize> = Default::default();
            for &(key, id) in &params {
                let first = nodes.iter().position(|nd| nd.inputs.contains(&id));
                let e = last_reader.entry(key).or_insert(usize::MAX);
                if let Some(i) = first {
                    *e = if *e == usize::MAX { i } else { (*e).min(i) };
                }
            }
            finals = vec![SmallVec::new(); nodes.len()];
            for (key, i) in last_reader {
                match i {
                    usize::MAX => unread.push(key),
                    i => finals[i].push(key),
                }
            }
            unread.sort_unstable();
            for v in &mut finals {
                v.sort_unstable();
            }
        }
        let deliver = |store: &mut GradStore, key: u64, hook: &mut ParamHook<'_>| -> Result<()> {
            let ids: Vec<usize> = params.iter().filter(|p| p.0 == key).map(|p| p.1).collect();
            let mut total: Option<AnyDTensor> = None;
            for &id in &ids {
                if let Some(g) = store.slots[id].take() {
                    total = Some(match total {
                        None => g,
                        Some(t) => t.add(&g)?,
                    });
                }
            }
            let g = match total {
                Some(g) => g,
                None => {
                    // Nothing reached it: zeros laid out as its leaf's dual.
                    let leaf = params.iter().position(|p| p.0 == key).expect("a bound key");
                    let v = &values[leaf];
                    let dual: SmallVec<[dtensor_placement::Placement; 4]> =
                        v.placements().iter().map(|p| p.dual()).collect();
                    AnyDTensor::from_local_for(
                        "Tape::backward (zero gradient)",
                        v.as_local().zeros_like()?,
                        v.global_shape(),
                        &dual,
                        v.device_mesh(),
                    )?
                }
            };
            if let Some(back) = hook(key, g)? {
                let first = params.iter().find(|p| p.0 == key).expect("a bound key").1;
                store.slots[first] = Some(back);
            }
            Ok(())
        };
        if let Some(h) = hook.as_mut() {
            for &key in &unread {
                deliver(&mut store, key, h)?;
            }
        }
        for (i, node) in nodes.into_iter().enumerate().rev() {
            // A compute node nobody sent a gradient to contributes nothing; a collective
            // node runs anyway, so every rank issues the same collectives.
            let outs = node.outs.clone();
            if node.collective || node.reached(&store) {
                node.run_all(&mut store)?;
            }
            // Its outputs' gradients have been passed on: free them (as PyTorch frees
            // non-leaf gradients), so a backward holds the activations' gradients only
            // while they are in flight.
            for out in outs {
                if !retained.contains(&out) {
                    store.slots[out] = None;
                    freed[out] = true;
                }
            }
            if let Some(h) = hook.as_mut() {
                for &key in &finals[i] {
                    deliver(&mut store, key, h)?;
                }
            }
        }
        Ok(Gradients {
            store,
            params,
            freed,
        })
    }
}

impl Tape {
    /// The input-gradient pass of a split backward (a zero-bubble pipeline's `B`): runs the
    /// nodes whose output depends on value `input`, computing only the gradients along that
    /// dependence; a product's weight half (an input that does not depend on `input`) is
    /// deferred with its output gradient, and the nodes that do not depend on `input` at
    /// all (a parameter's gather, its cast) wait too. [`WeightPass::run`] finishes them.
    fn run_input_pass(&self, mut store: GradStore, input: usize) -> Result<WeightPass> {
        let nodes = std::mem::take(&mut self.inner.borrow_mut().nodes);
        let params = std::mem::take(&mut self.inner.borrow_mut().params);
        let retained = std::mem::take(&mut self.inner.borrow_mut().retained);
        self.inner.borrow_mut().param_values.clear();
        let n = self.inner.borrow().vars;
        store.slots.resize(n, None);
        let mut dep = vec![false; n];
        dep[input] = true;
        for node in &nodes {
            if node.inputs.iter().any(|&i| dep[i]) {
                for &o in &node.outs {
                    dep[o] = true;
                }
            }
        }
        let mut freed = vec![false; n];
        let (mut later, mut deferred) = (Vec::new(), Vec::new());
        for node in nodes.into_iter().rev() {
            // A node's outputs depend on `input` together (they share its inputs).
            let outs = node.outs.clone();
            if !dep[outs[0]] {
                later.push(node);
                continue;
            }
            let mut keep = false;
            if node.collective || node.reached(&store) {
                match node.run {
                    Run::Whole(f) => f(&mut store)?,
                    Run::Halves(f) => {
                        let now: SmallVec<[bool; 3]> =
                            node.inputs.iter().map(|&i| dep[i]).collect();
                        f(&mut store, &now)?;
                        if now.iter().any(|w| !w) {
                            let rest = now.iter().map(|w| !w).collect();
                            // A split node has one output (`record_halves`).
                            deferred.push((f, rest, outs[0]));
                            // The weight half needs this output's gradient.
                            keep = true;
                        }
                    }
                }
            }
            if !keep {
                for out in outs {
                    if !retained.contains(&out) {
                        store.slots[out] = None;
                        freed[out] = true;
                    }
                }
            }
        }
        Ok(WeightPass {
            store,
            deferred,
            later,
            params,
            retained,
            freed,
        })
    }
}

/// The weight-gradient pass a split backward left ([`Var::backward_input`]): the
/// deferred halves of the products and the nodes that only parameters flow through.
/// Run it once, on the same rank; it issues the collectives those nodes carry (an FSDP
/// gather's reduce-scatter), so every rank of their groups runs it at the same point of
/// its schedule.
pub struct WeightPass {
    store: GradStore,
    deferred: Vec<(HalfBackward, SmallVec<[bool; 3]>, usize)>,
    later: Vec<Node>,
    params: Vec<(u64, usize)>,
    retained: Vec<usize>,
    freed: Vec<bool>,
}

impl WeightPass {
    /// Computes the remaining gradients: the parameters'.
    pub fn run(mut self) -> Result<Gradients> {
        let store = &mut self.store;
        for (f, rest, out) in std::mem::take(&mut self.deferred) {
            f(store, &rest)?;
            if !self.retained.contains(&out) {
                store.slots[out] = None;
                self.freed[out] = true;
            }
        }
        for node in std::mem::take(&mut self.later) {
            let outs = node.outs.clone();
            if node.collective || node.reached(store) {
                node.run_all(store)?;
            }
            for out in outs {
                if !self.retained.contains(&out) {
                    store.slots[out] = None;
                    self.freed[out] = true;
                }
            }
        }
        Ok(Gradients {
            store: self.store,
            params: self.params,
            freed: self.freed,
        })
    }
}

/// Every axis `Partial<Sum>` or `Invariant`: the seed (ones, laid out as the dual) is exact.
fn ones_like<L: Layout>(v: &DTensor<L>) -> Result<DTensor<L::Grad>> {
    let t = v.as_any();
    // Built on the host (the seed is the loss's few elements) and moved where the loss is.
    let ones = Tensor::zeros(t.local_shape(), t.dtype()).map(|_| 1.0);
    let ones = crate::any::to_mesh_place(ones, t.device_mesh())?;
    output("Var::backward (seed)", ones, t.global_shape(), t)
}

/// Applies a local function to a gradient and wraps it as layout `L` (a dual, by the rule
/// tables' closure), checking the local shape.
pub(crate) fn grad_of<L: Layout>(
    op: &'static str,
    local: Tensor,
    like: &AnyDTensor,
) -> Result<DTensor<L>> {
    output(op, local, like.global_shape(), like)
}

impl<'t, L: Layout> Var<'t, L> {
    /// The forward value.
    pub fn value(&self) -> &DTensor<L> {
        &self.value
    }

    /// A value recorded on `tape` under `id` (by [`Tape::record_many`]).
    pub(crate) fn from_parts(value: DTensor<L>, id: usize, tape: &'t Tape) -> Self {
        Var { value, id, tape }
    }

    /// This value's id on its tape.
    pub(crate) fn id(&self) -> usize {
        self.id
    }

    /// The tape this value is on.
    pub(crate) fn tape(&self) -> &'t Tape {
        self.tape
    }

    /// Keeps this computed value's gradient after backward (for [`Gradients::take`]);
    /// leaves keep theirs anyway.
    pub fn retain_grad(&self) {
        self.tape.inner.borrow_mut().retained.push(self.id);
    }

    /// The value, off the tape: later ops on it are not recorded and get no gradient.
    pub fn into_value(self) -> DTensor<L> {
        self.value
    }

    /// Backward from a loss: seeds ones laid out as the dual (`Replicate` or `Invariant`
    /// ones), exact only for a loss that is `Partial<Sum>` or `Invariant` on every axis.
    pub fn backward(self) -> Result<Gradients>
    where
        L: LossLayout,
    {
        let seed = ones_like(&self.value)?;
        self.backward_with(seed)
    }

    /// Backward from any value given its gradient, laid out as the dual (a pipeline stage
    /// receives its output's gradient from the next stage).
    pub fn backward_with(self, grad: DTensor<L::Grad>) -> Result<Gradients> {
        let n = self.tape.inner.borrow().vars;
        let mut store = GradStore {
            slots: vec![None; n],
        };
        store.slots[self.id] = Some(grad.into_any());
        self.tape.run_backward(store, None)
    }

    /// [`backward_with`](Self::backward_with), handing each parameter's gradient (summed
    /// over its leaves, laid out as the dual of its value) to `hook` as soon as it is final,
    /// in the order they become final: data parallelism starts reducing a bucket while the
    /// backward goes on. A gradient the hook takes (returns `None` for) is no longer in the
    /// returned [`Gradients`]; one it returns stays there.
    pub fn backward_with_hook(
        self,
        grad: DTensor<L::Grad>,
        hook: &mut dyn FnMut(u64, AnyDTensor) -> Result<Option<AnyDTensor>>,
    ) -> Result<Gradients> {
        let n = self.tape.inner.borrow().vars;
        let mut store = GradStore {
            slots: vec![None; n],
        };
        store.slots[self.id] = Some(grad.into_any());
        self.tape.run_backward(store, Some(hook))
    }

    /// [`backward`](Self::backward) with a parameter hook (see
    /// [`backward_with_hook`](Self::backward_with_hook)).
    pub fn backward_hooked(
        self,
        hook: &mut dyn FnMut(u64, AnyDTensor) -> Result<Option<AnyDTensor>>,
    ) -> Result<Gradients>
    where
        L: LossLayout,
    {
        let seed = ones_like(&self.value)?;
        self.backward_with_hook(seed, hook)
    }

    /// A split backward from this value given its gradient: the gradient of `input`
    /// (computed now, along the path from `input` only) and the [`WeightPass`] that
    /// computes every other gradient later. Zero-bubble pipelines send the input gradient
    /// to the previous stage first and fill their idle time with the weight pass. The two
    /// passes together give the same gradients as [`backward_with`](Self::backward_with).
    pub fn backward_input<LI: Layout>(
        self,
        grad: DTensor<L::Grad>,
        input: &Var<'t, LI>,
    ) -> Result<(DTensor<LI::Grad>, WeightPass)> {
        let n = self.tape.inner.borrow().vars;
        let mut store = GradStore {
            slots: vec![None; n],
        };
        store.slots[self.id] = Some(grad.into_any());
        let mut pass = self.tape.run_input_pass(store, input.id)?;
        let meta = Meta::of(input.value.as_any());
        let dx = pass.store.grad_or_zeros::<LI>(input.id, &meta)?;
        pass.store.slots[input.id] = None;
        Ok((dx, pass))
    }

    /// [`backward_input`](Self::backward_input) from a loss (seeded with ones, as
    /// [`backward`](Self::backward)).
    pub fn backward_input_from_loss<LI: Layout>(
        self,
        input: &Var<'t, LI>,
    ) -> Result<(DTensor<LI::Grad>, WeightPass)>
    where
        L: LossLayout,
    {
        let seed = ones_like(&self.value)?;
        self.backward_input(seed, input)
    }

    pub(crate) fn unary<Out: Layout>(
        &self,
        value: DTensor<Out>,
        collective: bool,
        back: impl FnOnce(DTensor<Out::Grad>) -> Result<DTensor<L::Grad>> + 'static,
    ) -> Var<'t, Out> {
        let id = self.id;
        self.tape
            .record(value, collective, &[id], move |dy, store| {
                let dx = back(dy)?;
                store.accumulate::<L>(id, dx)
            })
    }

    /// A two-input op; `back(dy, want)` returns the gradients `want` asks for (the other
    /// may be `None`, or computed anyway where one kernel gives both cheaply: only the
    /// wanted ones are accumulated).
    #[allow(clippy::type_complexity)]
    pub(crate) fn binary<M: Layout, Out: Layout>(
        &self,
        other: &Var<'t, M>,
        value: DTensor<Out>,
        back: impl Fn(
                &DTensor<Out::Grad>,
                [bool; 2],
            ) -> Result<(Option<DTensor<L::Grad>>, Option<DTensor<M::Grad>>)>
            + 'static,
    ) -> Var<'t, Out> {
        let (a, b) = (self.id, other.id);
        self.tape
            .record_halves(value, &[a, b], move |dy, want, store| {
                let (da, db) = back(dy, [want[0], want[1]])?;
                if let (true, Some(da)) = (want[0], da) {
                    store.accumulate::<L>(a, da)?;
                }
                match (want[1], db) {
                    (true, Some(db)) => store.accumulate::<M>(b, db),
                    _ => Ok(()),
                }
            })
    }

    /// Activation recomputation: `f(self)` without keeping its intermediates. The forward
    /// runs `f` on a scratch tape and keeps only the output; the backward runs `f` again
    /// (re-issuing its collectives, in the same order on every rank) and back-propagates
    /// through the fresh record. Parameters `f` binds ([`Tape::param`]) get their
    /// gradients on this tape as if `f` had run here. `f` must compute the same thing both
    /// times (no randomness of its own), and owns what it reads (`'static`: clone the
    /// layer into it; tensors are shared, not copied).
    pub fn checkpoint<Out: Layout>(
        &self,
        f: impl for<'s> Fn(&'s Tape, &Var<'s, L>) -> Result<Var<'s, Out>> + 'static,
    ) -> Result<Var<'t, Out>> {
        let scratch = Tape::new();
        let y = f(&scratch, &scratch.leaf(self.value.clone()))?.into_value();
        let params = self.tape.rebind_params(&scratch);
        drop(scratch);
        let (xv, x_id) = (self.value.clone(), self.id);
        // The node reads the input and, through the region, its parameters' leaves (a
        // backward hook must see it as their reader).
        let inputs: Vec<usize> = std::iter::once(x_id)
            .chain(params.iter().map(|p| p.1))
            .collect();
        Ok(self.tape.record(y, true, &inputs, move |dy, store| {
            let scratch = Tape::new();
            let x = scratch.leaf(xv);
            let mut g = f(&scratch, &x)?.backward_with(dy)?;
            store.accumulate::<L>(x_id, g.take(&x)?)?;
            Tape::accumulate_params(&mut g, &params, store)
        }))
    }

    /// [`checkpoint`](Self::checkpoint) of a function of two values (an input and a
    /// parameter stored sharded, say, so the gathered parameter is dropped after the
    /// forward and gathered again in the backward).
    pub fn checkpoint_with<M: Layout, Out: Layout>(
        &self,
        other: &Var<'t, M>,
        f: impl for<'s> Fn(&'s Tape, &Var<'s, L>, &Var<'s, M>) -> Result<Var<'s, Out>> + 'static,
    ) -> Result<Var<'t, Out>> {
        let scratch = Tape::new();
        let y = f(
            &scratch,
            &scratch.leaf(self.value.clone()),
            &scratch.leaf(other.value.clone()),
        )?
        .into_value();
        let params = self.tape.rebind_params(&scratch);
        drop(scratch);
        let (av, a_id) = (self.value.clone(), self.id);
        let (bv, b_id) = (other.value.clone(), other.id);
        let inputs: Vec<usize> = [a_id, b_id]
            .into_iter()
            .chain(params.iter().map(|p| p.1))
            .collect();
        Ok(self.tape.record(y, true, &inputs, move |dy, store| {
            let scratch = Tape::new();
            let (a, b) = (scratch.leaf(av), scratch.leaf(bv));
            let mut g = f(&scratch, &a, &b)?.backward_with(dy)?;
            store.accumulate::<L>(a_id, g.take(&a)?)?;
            store.accumulate::<M>(b_id, g.take(&b)?)?;
            Tape::accumulate_params(&mut g, &params, store)
        }))
    }
}
