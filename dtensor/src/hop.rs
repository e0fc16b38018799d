//! Typed pipeline-stage hops: activations forward and their gradients backward between
//! two stages, over the `Pp` communicator, with the same layout on both sides.
//!
//! A stage's tensors live on the sub-mesh without `Pp` ([`DeviceMesh::sub_mesh`]); the rank
//! at the same coordinates of the next stage holds the same piece of the next stage's
//! input, so a hop is one point-to-point message per rank, of the local piece only: no
//! layout changes on the way. The layout is the hop's type parameter, and a receiver that
//! asks for another layout does not compile ([`HopTo`]).

use crate::any::AnyDTensor;
use crate::device_mesh::DeviceMesh;
use crate::error::{Error, Result};
use crate::transfer;
use crate::typed::DTensor;
use dtensor_collectives::Communicator;
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{
    local_shape, Invariant, Layout, MeshAxis, On, Partial, PlacementType, ReduceMarker, Replicate,
    Shard,
};
use std::marker::PhantomData;
use std::sync::Arc;

/// A hop that carries values laid out as `Self` may be received as `Recv`: only the same
/// layout (the same axes, the same placement on each).
#[diagnostic::on_unimplemented(
    message = "a stage hop carries tensors laid out as `{Self}`, but the receiving stage expects `{Recv}`",
    label = "the receiver's layout differs from the sender's",
    note = "both ends of a pipeline hop hold the same layout (the hop moves local pieces, never redistributes); change the layout inside a stage, with a named transition"
)]
pub trait HopTo<Recv: Layout>: Layout {}
impl HopTo<()> for () {}
impl<X: MeshAxis, P, Q, R, S> HopTo<(On<X, Q>, S)> for (On<X, P>, R)
where
    P: HopPlacement<Q>,
    Q: PlacementType,
    R: HopTo<S>,
    S: Layout,
{
}

/// One axis of [`HopTo`]: the same placement on both ends. Spelled out per placement (not
/// `impl<P> HopPlacement<P> for P`), so a mismatch reports this message instead of a bare
/// type mismatch.
#[diagnostic::on_unimplemented(
    message = "a stage hop carries tensors laid out as `{Self}` on a mesh axis where the receiving stage expects `{Q}`",
    label = "the receiver's placement differs from the sender's",
    note = "both ends of a pipeline hop hold the same layout; change it inside a stage, with a named transition"
)]
pub trait HopPlacement<Q>: PlacementType {}
impl HopPlacement<Replicate> for Replicate {}
impl HopPlacement<Invariant> for Invariant {}
impl<const D: usize> HopPlacement<Shard<D>> for Shard<D> {}
impl<O: ReduceMarker> HopPlacement<Partial<O>> for Partial<O> {}

/// The boundary between two pipeline stages for values laid out `L` of a fixed global
/// shape and dtype (a microbatch's activation), over `pp`, the `Pp` axis communicator;
/// `mesh` is the stage's sub-mesh.
pub struct StageHop<L: Layout> {
    pp: Arc<dyn Communicator>,
    mesh: Arc<DeviceMesh>,
    global: Vec<usize>,
    dtype: DType,
    _layout: PhantomData<fn() -> L>,
}

impl<L: Layout> StageHop<L> {
    /// A hop for values of `global_shape` and `dtype` laid out `L` on the stage mesh.
    pub fn new(
        pp: Arc<dyn Communicator>,
        mesh: Arc<DeviceMesh>,
        global_shape: &[usize],
        dtype: DType,
    ) -> Self {
        StageHop {
            pp,
            mesh,
            global: global_shape.to_vec(),
            dtype,
            _layout: PhantomData,
        }
    }

    /// The `Pp` communicator the hop sends over.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.pp
    }

    fn check(&self, op: &'static str, t: &AnyDTensor) -> Result<()> {
        if t.global_shape() != self.global.as_slice() || t.dtype() != self.dtype {
            return Err(Error::ShapeMismatch {
                op,
                detail: format!(
                    "the hop carries {:?} {} but got {:?} {}",
                    self.global,
                    self.dtype,
                    t.global_shape(),
                    t.dtype()
                ),
            });
        }
        if !Arc::ptr_eq(t.device_mesh(), &self.mesh) && t.device_mesh().mesh() != self.mesh.mesh() {
            return Err(Error::MeshMismatch {
                op,
                lhs: t.device_mesh().mesh().to_string(),
                rhs: self.mesh.mesh().to_string(),
            });
        }
        Ok(())
    }

    fn send_any(&self, op: &'static str, t: &AnyDTensor, peer: usize, tag: u32) -> Result<()> {
        self.check(op, t)?;
        transfer::send(&*self.pp, t.as_local(), peer, tag)
    }

    fn recv_any<R: Layout>(&self, op: &'static str, peer: usize, tag: u32) -> Result<AnyDTensor> {
        let placements = R::placements();
        let shape = local_shape(
            self.mesh.mesh(),
            &placements,
            self.mesh.coords(),
            &self.global,
        )?;
        let mut local = Tensor::zeros_on(self.mesh.device(), &shape, self.dtype)?;
        transfer::recv(&*self.pp, &mut local, peer, tag)?;
        AnyDTensor::from_local_for(op, local, &self.global, &placements, &self.mesh)
    }

    /// Sends this rank's piece of `x` to rank `peer` of the `Pp` group.
    pub fn send(&self, x: &DTensor<L>, peer: usize, tag: u32) -> Result<()> {
        self.send_any("StageHop::send", x.as_any(), peer, tag)
    }

    /// Receives from rank `peer` this rank's piece of a value laid out `R`, which must be
    /// the hop's layout.
    pub fn recv<R: Layout>(&self, peer: usize, tag: u32) -> Result<DTensor<R>>
    where
        L: HopTo<R>,
    {
        Ok(DTensor::wrap(self.recv_any::<R>(
            "StageHop::recv",
            peer,
            tag,
        )?))
    }

    /// Sends the gradient of a received value back to the stage it came from.
    pub fn send_grad(&self, g: &DTensor<L::Grad>, peer: usize, tag: u32) -> Result<()> {
        self.send_any("StageHop::send_grad", g.as_any(), peer, tag)
    }

    /// Receives the gradient of a value this stage sent, laid out as its dual.
    pub fn recv_grad<R: Layout>(&self, peer: usize, tag: u32) -> Result<DTensor<R::Grad>>
    where
        L: HopTo<R>,
    {
        Ok(DTensor::wrap(self.recv_any::<R::Grad>(
            "StageHop::recv_grad",
            peer,
            tag,
        )?))
    }
}
