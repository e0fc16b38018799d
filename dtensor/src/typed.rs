//! `DTensor<L>`: a distributed tensor whose layout `L` (one placement per mesh axis) is part
//! of its type. Every placement change is a named, consuming method whose bounds say which
//! placement it takes; the result's type says which placement it gives: the one-axis moves
//! and their table are in [`transitions`](crate::transitions), the compute ops in
//! [`compute`](crate::compute).
//!
//! Each move has a `_vjp` twin returning the result and its [`Adjoint`], whose
//! `backward` only accepts a gradient laid out as the dual of the result and returns one
//! laid out as the dual of the input. Multi-axis moves are a [`TypedPlan`]: printable and
//! assertable before it runs.

use crate::any::AnyDTensor;
use crate::device_mesh::DeviceMesh;
use crate::error::{Error, Result};
use crate::plan::Plan;
use dtensor_kernels::Tensor;
use dtensor_placement::{
    IsShard, Layout, MeshAxis, Placement, RedistributeLayout, Replicate, Select,
};
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

/// A distributed tensor laid out as `L` (see [`dtensor_placement::layout!`]).
///
/// Invariant: the inner tensor's placements and mesh axes are exactly `L`'s.
pub struct DTensor<L: Layout> {
    inner: AnyDTensor,
    _layout: PhantomData<L>,
}

impl<L: Layout> Clone for DTensor<L> {
    fn clone(&self) -> Self {
        DTensor {
            inner: self.inner.clone(),
            _layout: PhantomData,
        }
    }
}

impl<L: Layout> fmt::Debug for DTensor<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.fmt(f)
    }
}

/// Both layouts are the same type. Used where a gradient must be laid out exactly as the
/// dual of a forward value.
#[diagnostic::on_unimplemented(
    message = "gradient laid out as `{Self}`, but this backward needs `{L}`",
    label = "wrong gradient layout",
    note = "a gradient's placement is the dual of its value's: Replicate <-> Partial, Shard and Invariant stay"
)]
pub trait SameLayout<L> {}
impl<L> SameLayout<L> for L {}

pub(crate) fn check_layout<L: Layout>(op: &'static str, t: &AnyDTensor) -> Result<()> {
    let want = L::entries();
    let axes = t.device_mesh().mesh().axis_kinds();
    let got_axes_ok = want.len() == axes.len() && want.iter().zip(&axes).all(|((a, _), b)| a == b);
    if !got_axes_ok
        || want
            .iter()
            .map(|&(_, p)| p)
            .ne(t.placements().iter().copied())
    {
        let fmt_entries = |e: Vec<String>| format!("[{}]", e.join(", "));
        return Err(Error::LayoutMismatch {
            op,
            expected: fmt_entries(want.iter().map(|(a, p)| format!("{a}: {p}")).collect()),
            got: fmt_entries(
                axes.iter()
                    .zip(t.placements())
                    .map(|(a, p)| format!("{a}: {p}"))
                    .collect(),
            ),
        });
    }
    Ok(())
}

impl<L: Layout> DTensor<L> {
    /// Collective over the world: rank `src` holds the full tensor (`Some`), every rank gets
    /// its piece under `L`. A `Partial<Sum>` axis puts the value on coordinate 0 and zeros
    /// elsewhere; other partial reductions put it on every coordinate.
    pub fn distribute(full: Option<&Tensor>, src: usize, mesh: &Arc<DeviceMesh>) -> Result<Self> {
        check_mesh_axes::<L>("DTensor::distribute", mesh)?;
        let t = AnyDTensor::distribute(full, src, &L::placements(), mesh)?;
        Ok(Self::wrap(t))
    }

    /// This rank's piece of `global` (the whole tensor, the same on every rank) laid out as
    /// `L`, sliced locally: no communication ([`AnyDTensor::from_global`]).
    pub fn from_global(global: &Tensor, mesh: &Arc<DeviceMesh>) -> Result<Self> {
        check_mesh_axes::<L>("DTensor::from_global", mesh)?;
        Ok(Self::wrap(AnyDTensor::from_global(
            global,
            &L::placements(),
            mesh,
        )?))
    }

    /// Wraps this rank's piece; `Err` unless its shape is the one `L` gives this rank.
    pub fn from_local(
        local: Tensor,
        global_shape: &[usize],
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        check_mesh_axes::<L>("DTensor::from_local", mesh)?;
        Ok(Self::wrap(AnyDTensor::from_local(
            local,
            global_shape,
            &L::placements(),
            mesh,
        )?))
    }

    /// Builds every rank's piece from a function of the *global* flat index (row-major), so
    /// nothing is communicated and the layout is computed, not claimed: a parameter built at
    /// `tp = k` is exactly the slice of the one built at `tp = 1`. `L` may have no
    /// `Partial` axis (a value given whole on every rank would be counted once per rank).
    pub fn from_global_fn(
        global_shape: &[usize],
        dtype: dtensor_kernels::DType,
        mesh: &Arc<DeviceMesh>,
        f: impl Fn(usize) -> f64,
    ) -> Result<Self> {
        const OP: &str = "DTensor::from_global_fn";
        check_mesh_axes::<L>(OP, mesh)?;
        let placements = L::placements();
        if let Some(a) = placements.iter().position(|p| p.is_partial()) {
            return Err(Error::PlacementMismatch {
                op: OP,
                axis: L::axes()[a],
                placements,
                detail: "a value given whole on every rank would be counted once per rank on a Partial axis".into(),
            });
        }
        let ranges =
            dtensor_placement::local_ranges(mesh.mesh(), &placements, mesh.coords(), global_shape)?;
        let local_shape: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
        let n: usize = local_shape.iter().product();
        let mut vals = Vec::with_capacity(n);
        let mut idx = vec![0usize; local_shape.len()];
        for _ in 0..n {
            let flat = idx
                .iter()
                .zip(&ranges)
                .zip(global_shape)
                .fold(0usize, |acc, ((&i, r), &e)| acc * e + r.start + i);
            vals.push(f(flat));
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < local_shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        let t = Tensor::from_f64_vec(vals, &local_shape, dtype)?;
        let t = crate::any::to_mesh_place(t, mesh)?;
        Ok(Self::wrap(AnyDTensor::from_local_for(
            OP,
            t,
            global_shape,
            &placements,
            mesh,
        )?))
    }

    /// Replaces this rank's piece by `f(piece)`, which must keep its shape and dtype: an
    /// elementwise update that keeps the layout (an optimizer's write path).
    pub fn update_local(&mut self, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<()> {
        const OP: &str = "DTensor::update_local";
        let new = f(self.as_local())?;
        if new.shape() != self.local_shape() || new.dtype() != self.as_local().dtype() {
            return Err(Error::ShapeMismatch {
                op: OP,
                detail: format!(
                    "the update gives {:?} {} for a local piece {:?} {}",
                    new.shape(),
                    new.dtype(),
                    self.local_shape(),
                    self.as_local().dtype()
                ),
            });
        }
        let global: Vec<usize> = self.global_shape().to_vec();
        let mesh = self.device_mesh().clone();
        self.inner = AnyDTensor::from_local_for(OP, new, &global, &L::placements(), &mesh)?;
        Ok(())
    }

    /// Updates this rank's piece in place (an optimizer step): `f` may change values, not
    /// the shape or dtype (an `Err` if it did). The storage is copied first only if a clone
    /// elsewhere still shares it.
    pub fn update_local_in_place(
        &mut self,
        f: impl FnOnce(&mut Tensor) -> Result<()>,
    ) -> Result<()> {
        let (shape, dtype) = (self.local_shape().to_vec(), self.as_local().dtype());
        f(self.inner.local_mut())?;
        let t = self.as_local();
        if t.shape() != shape.as_slice() || t.dtype() != dtype {
            return Err(Error::ShapeMismatch {
                op: "DTensor::update_local_in_place",
                detail: format!(
                    "the update changed the local piece from {shape:?} {dtype} to {:?} {}",
                    t.shape(),
                    t.dtype()
                ),
            });
        }
        Ok(())
    }

    /// Checks a run-time-placed tensor against `L`.
    pub fn try_from_any(t: AnyDTensor) -> Result<Self> {
        check_layout::<L>("DTensor::try_from_any", &t)?;
        Ok(Self::wrap(t))
    }

    pub(crate) fn wrap(inner: AnyDTensor) -> Self {
        DTensor {
            inner,
            _layout: PhantomData,
        }
    }

    /// The run-time twin (forgets the layout type).
    pub fn into_any(self) -> AnyDTensor {
        self.inner
    }
    /// The run-time twin, borrowed.
    pub fn as_any(&self) -> &AnyDTensor {
        &self.inner
    }
    /// This rank's piece of the tensor (its chunk on `Shard` axes, its term on `Partial` ones).
    pub fn as_local(&self) -> &Tensor {
        self.inner.as_local()
    }
    /// This rank's piece, taken out of the distributed tensor (no copy).
    pub fn into_local(self) -> Tensor {
        self.inner.into_local()
    }
    /// Shape of the whole tensor, in elements per dim.
    pub fn global_shape(&self) -> &[usize] {
        self.inner.global_shape()
    }
    /// Shape of this rank's piece: the global shape cut by the `Shard` axes.
    pub fn local_shape(&self) -> &[usize] {
        self.inner.local_shape()
    }
    /// The placements of `L` at run time, one per mesh axis in layout order.
    pub fn placements(&self) -> &[Placement] {
        self.inner.placements()
    }
    /// The mesh this tensor is distributed over, as this rank sees it.
    pub fn device_mesh(&self) -> &Arc<DeviceMesh> {
        self.inner.device_mesh()
    }
    /// Collective: the whole global tensor on every rank.
    pub fn full_tensor(&self) -> Result<Tensor> {
        self.inner.full_tensor()
    }
}

impl<L: Layout> DTensor<L> {
    /// [`all_gather`](Self::all_gather) started now and finished by
    /// [`PendingAllGather::wait`]: the collective moves data while the caller computes
    /// (FSDP gathers the next layer's parameters during this layer's forward).
    #[allow(clippy::type_complexity)]
    pub fn start_all_gather<X: MeshAxis, I>(
        self,
        axis: X,
    ) -> Result<PendingAllGather<L, <L as Select<X, I>>::With<Replicate>>>
    where
        L: Select<X, I>,
        <L as Select<X, I>>::P: IsShard,
    {
        let _ = axis;
        let a = self.device_mesh().mesh().index_of(X::KIND).ok_or_else(|| {
            dtensor_placement::Error::AxisNotInMesh {
                op: "start_all_gather",
                axis: X::KIND,
                mesh: self.device_mesh().mesh().to_string(),
            }
        })?;
        Ok(PendingAllGather {
            inner: self.inner.start_all_gather(a)?,
            _layouts: PhantomData,
        })
    }
}

/// An all-gather started from a value laid out `In`, to be received laid out `Out`.
pub struct PendingAllGather<In: Layout, Out: Layout> {
    inner: crate::any::PendingGather,
    _layouts: PhantomData<fn() -> (In, Out)>,
}

impl<In: Layout, Out: Layout> PendingAllGather<In, Out> {
    /// The value the gather started from.
    pub fn source(&self) -> &AnyDTensor {
        self.inner.source()
    }

    /// Waits for the gathered value.
    pub fn wait(self) -> Result<DTensor<Out>> {
        Ok(self.wait_vjp()?.0)
    }

    /// Waits for the gathered value and its adjoint (a reduce-scatter).
    pub fn wait_vjp(self) -> Result<(DTensor<Out>, Adjoint<Out, In>)> {
        let (out, plan) = self.inner.wait()?;
        check_layout::<Out>("PendingAllGather::wait", &out)?;
        Ok((DTensor::wrap(out), Adjoint::new(plan)))
    }
}

fn check_mesh_axes<L: Layout>(op: &'static str, mesh: &DeviceMesh) -> Result<()> {
    let want = L::axes();
    let got = mesh.mesh().axis_kinds();
    if want != got {
        return Err(Error::LayoutMismatch {
            op,
            expected: format!("a mesh with axes {:?}", want.as_slice()),
            got: format!("the mesh {}", mesh.mesh()),
        });
    }
    Ok(())
}

impl<L: Layout> DTensor<L> {
    /// The plan taking this tensor to layout `M` (any number of axes), without running it.
    pub fn plan<M: Layout>(&self) -> Result<TypedPlan<L, M>>
    where
        L: RedistributeLayout<M>,
    {
        Ok(TypedPlan {
            plan: self.inner.plan(&M::placements())?,
            _layouts: PhantomData,
        })
    }

    /// Collective: plans and runs the redistribution to `M`.
    pub fn redistribute<M: Layout>(self) -> Result<DTensor<M>>
    where
        L: RedistributeLayout<M>,
    {
        let plan = self.plan::<M>()?;
        plan.run(self)
    }

    /// [`redistribute`](Self::redistribute) and its adjoint.
    pub fn redistribute_vjp<M: Layout>(self) -> Result<(DTensor<M>, Adjoint<M, L>)>
    where
        L: RedistributeLayout<M>,
    {
        let plan = self.plan::<M>()?;
        let out = plan.run(self)?;
        Ok((out, Adjoint::new(plan.plan)))
    }
}

/// A redistribution plan from layout `L` to `M`, made for one tensor on one rank.
pub struct TypedPlan<L: Layout, M: Layout> {
    plan: Plan,
    _layouts: PhantomData<(L, M)>,
}

impl<L: Layout, M: Layout> TypedPlan<L, M> {
    /// The run-time plan: steps, collectives, bytes.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }
    /// Runs the plan on `x` (which must have the global shape it was made for).
    pub fn run(&self, x: DTensor<L>) -> Result<DTensor<M>> {
        Ok(DTensor::wrap(x.inner.run_plan(&self.plan)?))
    }
}

impl<L: Layout, M: Layout> fmt::Display for TypedPlan<L, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.plan.fmt(f)
    }
}

/// The backward of a forward move from layout `In` to `Out`: it takes the gradient of the
/// output (laid out as `Out::Grad`) and returns the gradient of the input (`In::Grad`).
pub struct Adjoint<Out: Layout, In: Layout> {
    plan: Plan,
    _layouts: PhantomData<(Out, In)>,
}

impl<Out: Layout, In: Layout> Adjoint<Out, In> {
    pub(crate) fn new(plan: Plan) -> Self {
        Adjoint {
            plan,
            _layouts: PhantomData,
        }
    }

    /// The forward plan this adjoint reverses.
    pub fn forward_plan(&self) -> &Plan {
        &self.plan
    }

    /// Collective: the gradient of the input from the gradient of the output.
    pub fn backward<G>(&self, grad: DTensor<G>) -> Result<DTensor<In::Grad>>
    where
        G: Layout + SameLayout<Out::Grad>,
    {
        let g = grad.inner.run_adjoint(&self.plan)?;
        debug_assert!(check_layout::<In::Grad>("Adjoint::backward", &g).is_ok());
        Ok(DTensor::wrap(g))
    }
}
