//! The layouts a transformer layer's tensors have on a `[Dp, Tp]` mesh, and the two
//! sequence modes ([`NoSp`], [`Sp`]) that decide where the residual stream lives on `Tp`.
//!
//! Activations are 2-D `[tokens, features]`, tokens ordered sample by sample; `Dp` shards
//! the tokens (whole samples when the batch divides by `dp`). Parameters are `Replicate`
//! over `Dp`, so their gradients arrive `Partial` over `Dp`.
//!
//! | tensor | layout | its gradient |
//! |---|---|---|
//! | residual stream, [`NoSp`] | `[Dp: Shard<0>, Tp: Invariant]` | the same |
//! | residual stream, [`Sp`] | `[Dp: Shard<0>, Tp: Shard<0>]` (sequence-sharded) | the same |
//! | column input ([`Full`]) | `[Dp: Shard<0>, Tp: Replicate]` | `[Dp: Shard<0>, Tp: Partial]` |
//! | column output / row input ([`ColOut`]) | `[Dp: Shard<0>, Tp: Shard<1>]` | the same |
//! | row output before the reduction ([`RowPartial`]) | `[Dp: Shard<0>, Tp: Partial]` | `[Dp: Shard<0>, Tp: Replicate]` |
//! | column weight / bias ([`ColWeight`]) | `[Dp: Replicate, Tp: Shard<0>]` | `[Dp: Partial, Tp: Shard<0>]` |
//! | row weight ([`RowWeight`]) | `[Dp: Replicate, Tp: Shard<1>]` | `[Dp: Partial, Tp: Shard<1>]` |
//! | norm weight, row bias ([`StreamParam`]), [`NoSp`] | `[Dp: Replicate, Tp: Invariant]` | `[Dp: Partial, Tp: Invariant]` |
//! | norm weight, row bias ([`StreamParam`]), [`Sp`] | `[Dp: Replicate, Tp: Replicate]` | `[Dp: Partial, Tp: Partial]`: must be reduced over `Tp` |
//!
//! The column layers enter with [`SeqMode::enter`] (`to_replicate`, Megatron's `f`, or an
//! `all_gather` of the sequence) and the row layers leave with [`SeqMode::exit`]
//! (`all_reduce`, Megatron's `g`, or a `reduce_scatter` of the sequence); both return the
//! typed adjoint that the layer's backward runs.

use dtensor_core::{Adjoint, DTensor, Result};
use dtensor_placement::{
    layout, AddPlacement, Dp, Invariant, IsWhole, Layout, Linear, Partial, PlacementType,
    Pointwise, Replicate, Shard, Tp,
};

/// The gradient layout of `L` (the dual placement on every axis).
pub type Grad<L> = <L as Layout>::Grad;

/// The residual stream under sequence mode `M`.
pub type Stream<M> = layout![Dp: Shard<0>, Tp: <M as SeqMode>::Tp];
/// Tokens replicated over `Tp`: what a column-parallel layer multiplies.
pub type Full = layout![Dp: Shard<0>, Tp: Replicate];
/// Features sharded over `Tp`: a column layer's output, a row layer's input.
pub type ColOut = layout![Dp: Shard<0>, Tp: Shard<1>];
/// A row layer's product before its reduction over `Tp`.
pub type RowPartial = layout![Dp: Shard<0>, Tp: Partial];
/// Column-parallel weight `[out, in]` (and its bias `[out]`): output features over `Tp`.
pub type ColWeight = layout![Dp: Replicate, Tp: Shard<0>];
/// Row-parallel weight `[out, in]`: input features over `Tp`.
pub type RowWeight = layout![Dp: Replicate, Tp: Shard<1>];
/// A parameter applied to the residual stream (norm weight, row bias) under mode `M`.
pub type StreamParam<M> = layout![Dp: Replicate, Tp: <M as SeqMode>::ParamTp];
/// Token ids `[tokens]`: sharded over `Dp`, the same on every `Tp` rank.
pub type Ids = layout![Dp: Shard<0>, Tp: Invariant];
/// A per-token value (loss, statistics) `[tokens]` after its reduction over `Tp`.
pub type TokenInvariant = layout![Dp: Shard<0>, Tp: Invariant];
/// A column weight's (or embedding table's) gradient averaged over `Dp`.
pub type ColWeightReduced = layout![Dp: Invariant, Tp: Shard<0>];
/// A row weight's gradient averaged over `Dp`.
pub type RowWeightReduced = layout![Dp: Invariant, Tp: Shard<1>];
/// A raw parameter gradient: `Partial` over `Dp`, `T` over `Tp`.
pub type DpPartial<T> = layout![Dp: Partial, Tp: T];
/// A parameter gradient averaged over `Dp`, `T` over `Tp`.
pub type DpReduced<T> = layout![Dp: Invariant, Tp: T];
/// A stream parameter's gradient under mode `M` with its `Dp` axis in state `D`.
pub type ParamGradTp<M, D> = layout![Dp: D, Tp: <<M as SeqMode>::ParamTp as PlacementType>::Grad];
/// A parameter gradient with its `Dp` axis in state `D` and its `Tp` axis reduced.
pub type ReducedTp<D> = layout![Dp: D, Tp: Invariant];

/// Where the residual stream lives on `Tp`, and the named transitions that enter and leave
/// the tensor-parallel region. Implemented by [`NoSp`] and [`Sp`] only.
pub trait SeqMode: Send + Sync + Sized + 'static {
    /// The residual stream's placement on `Tp` (its own dual).
    type Tp: PlacementType<Grad = Self::Tp> + Pointwise + Linear + AddPlacement<Self::Tp>;
    /// The placement on `Tp` of a parameter applied to the stream.
    type ParamTp: PlacementType + IsWhole + Pointwise + Linear;
    /// Whether the sequence is sharded over `Tp`.
    const SP: bool;

    /// Into the tensor-parallel region: `to_replicate` (no SP) or `all_gather` (SP).
    #[allow(clippy::type_complexity)]
    fn enter(x: DTensor<Stream<Self>>) -> Result<(DTensor<Full>, Adjoint<Full, Stream<Self>>)>;

    /// Out of it: `all_reduce` (no SP) or `reduce_scatter` of the tokens (SP).
    #[allow(clippy::type_complexity)]
    fn exit(
        y: DTensor<RowPartial>,
    ) -> Result<(DTensor<Stream<Self>>, Adjoint<Stream<Self>, RowPartial>)>;

    /// Reduces a stream parameter's gradient over `Tp`: nothing to do without SP (each
    /// `Tp` rank saw every token), an `all_reduce` with SP (each saw its own tokens).
    fn reduce_param_grad<D: PlacementType>(
        g: DTensor<ParamGradTp<Self, D>>,
    ) -> Result<DTensor<ReducedTp<D>>>;
}

/// Plain tensor parallelism: the stream is `Invariant` over `Tp`.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoSp;

/// Sequence parallelism: the stream is sharded over `Tp` along its tokens.
#[derive(Clone, Copy, Debug, Default)]
pub struct Sp;

impl SeqMode for NoSp {
    type Tp = Invariant;
    type ParamTp = Invariant;
    const SP: bool = false;

    fn enter(x: DTensor<Stream<Self>>) -> Result<(DTensor<Full>, Adjoint<Full, Stream<Self>>)> {
        x.to_replicate_vjp(Tp)
    }

    fn exit(
        y: DTensor<RowPartial>,
    ) -> Result<(DTensor<Stream<Self>>, Adjoint<Stream<Self>, RowPartial>)> {
        y.all_reduce_vjp(Tp)
    }

    fn reduce_param_grad<D: PlacementType>(
        g: DTensor<layout![Dp: D, Tp: Invariant]>,
    ) -> Result<DTensor<ReducedTp<D>>> {
        Ok(g)
    }
}

impl SeqMode for Sp {
    type Tp = Shard<0>;
    type ParamTp = Replicate;
    const SP: bool = true;

    fn enter(x: DTensor<Stream<Self>>) -> Result<(DTensor<Full>, Adjoint<Full, Stream<Self>>)> {
        x.all_gather_vjp(Tp)
    }

    fn exit(
        y: DTensor<RowPartial>,
    ) -> Result<(DTensor<Stream<Self>>, Adjoint<Stream<Self>, RowPartial>)> {
        y.reduce_scatter_vjp::<_, _, 0>(Tp)
    }

    fn reduce_param_grad<D: PlacementType>(
        g: DTensor<layout![Dp: D, Tp: Partial]>,
    ) -> Result<DTensor<ReducedTp<D>>> {
        g.all_reduce(Tp)
    }
}

/// The size of the mesh axis `kind` (1 when the mesh lacks it).
pub fn axis_size(mesh: &dtensor_core::DeviceMesh, kind: dtensor_placement::AxisKind) -> usize {
    mesh.mesh()
        .index_of(kind)
        .map_or(1, |i| mesh.mesh().size(i))
}

/// This rank's coordinate on the mesh axis `kind` (0 when the mesh lacks it).
pub fn axis_coord(mesh: &dtensor_core::DeviceMesh, kind: dtensor_placement::AxisKind) -> usize {
    mesh.mesh().index_of(kind).map_or(0, |i| mesh.coords()[i])
}

#[allow(dead_code)]
fn _layouts_are_layouts<M: SeqMode>() {
    fn is<L: Layout>() {}
    is::<Stream<M>>();
    is::<StreamParam<M>>();
    is::<Grad<StreamParam<M>>>();
}

/// A stream parameter's raw gradient: `Partial` over `Dp`; over `Tp` the dual of
/// [`SeqMode::ParamTp`] (`Invariant` without SP, `Partial` with SP).
pub type StreamParamGrad<M> =
    layout![Dp: Partial, Tp: <<M as SeqMode>::ParamTp as PlacementType>::Grad];

/// A local kernel applied to a tensor no axis of which is `Partial` (a non-linear op on
/// pending partial sums does not compile); the result keeps the layout.
pub fn pointwise<L: dtensor_placement::PointwiseLayout>(
    x: &DTensor<L>,
    f: impl FnOnce(&dtensor_kernels::Tensor) -> dtensor_kernels::Result<dtensor_kernels::Tensor>,
) -> Result<DTensor<L>> {
    let y = f(x.as_local())?;
    DTensor::from_local(y, x.global_shape(), x.device_mesh())
}
