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
//! | per-token loss ([`TokenInvariant`]) | `[Dp: Shard<0>, Tp: Invariant]` | the same |
//! | training loss ([`Loss`]), summed over tokens | `[Dp: Partial, Tp: Invariant]` | `[Dp: Replicate, Tp: Invariant]` (the seed: ones) |
//!
//! A stored parameter is laid out [`DpLayout`] (its placement over `Dp` is the data mode's).
//! The optimizer takes a gradient only once it is reduced to its parameter's placement on
//! every axis ([`ReducedPlacement`], [`ReducedGrad`]); [`TpParam`] says how a parameter's
//! gradient is reduced over `Tp` (nothing, or the all-reduce a sequence-parallel norm
//! weight needs).
//!
//! The column layers enter with [`SeqMode::enter`] (`to_replicate`, Megatron's `f`, or an
//! `all_gather` of the sequence) and the row layers leave with [`SeqMode::exit`]
//! (`all_reduce`, Megatron's `g`, or a `reduce_scatter` of the sequence); the tape records
//! their typed adjoints.

use dtensor_core::{DTensor, HopPlacement, Result, Var};
use dtensor_placement::{
    layout, AddPlacement, AddRowRule, AxisKind, Cp, Dp, Ep, Invariant, IsWhole, Layout, Linear,
    Mesh, MeshAxis, NormRule, On, ParallelConfig, Partial, PlacementType, Pointwise, Replicate,
    Shard, Tp,
};

/// The gradient layout of `L` (the dual placement on every axis).
pub type Grad<L> = <L as Layout>::Grad;

/// The residual stream under sequence mode `M`.
pub type Stream<M> = layout![Dp: Shard<0>, Ep: Shard<0>, Cp: Shard<0>, Tp: <M as SeqMode>::Tp];
/// Tokens replicated over `Tp`: what a column-parallel layer multiplies.
pub type Full = layout![Dp: Shard<0>, Ep: Shard<0>, Cp: Shard<0>, Tp: Replicate];
/// Features sharded over `Tp`: a column layer's output, a row layer's input.
pub type ColOut = layout![Dp: Shard<0>, Ep: Shard<0>, Cp: Shard<0>, Tp: Shard<1>];
/// A row layer's product before its reduction over `Tp`.
pub type RowPartial = layout![Dp: Shard<0>, Ep: Shard<0>, Cp: Shard<0>, Tp: Partial];
/// A stored parameter's layout (master, compute copy, reduced gradient): placement `P`
/// over `Dp`, `Invariant` over `Ep` and `Cp`, `T` over `Tp`.
///
/// `Ep` and `Cp` shard the tokens as `Dp` does, but no data mode shards a parameter over
/// them: the stored value is the same on their ranks (`Invariant`) and becomes `Replicate`
/// for compute by [`to_replicate`](Var::to_replicate) (Megatron's `f`), whose adjoint
/// all-reduces the gradient there. A gradient of a stored parameter therefore arrives
/// reduced over `Ep` and `Cp` and is `DpLayout<_, _>` again: one all-reduce per axis
/// (size-1 axes cost nothing), recorded by the tape like any other.
///
/// `E` is the placement over `Ep` ([`ParamKind::Ep`](crate::ParamKind::Ep)): `Invariant` for every dense
/// parameter (the default), `Shard<0>` for MoE expert weights `[experts, out, in]`, each
/// `Ep` rank holding its own experts whole ([`ExpertW`](crate::ExpertW)).
pub type DpLayout<P, T, E = Invariant> = layout![Dp: P, Ep: E, Cp: Invariant, Tp: T];
/// A column-parallel weight `[out, in]` (and its bias `[out]`) as stored under DDP:
/// output features over `Tp`.
pub type ColWeight = DpLayout<Replicate, Shard<0>>;
/// A row-parallel weight `[out, in]` as stored under DDP: input features over `Tp`.
pub type RowWeight = DpLayout<Replicate, Shard<1>>;
/// A parameter applied to the residual stream (norm weight, row bias) under mode `M`, as
/// stored under DDP.
pub type StreamParam<M> = DpLayout<Replicate, <M as SeqMode>::ParamTp>;
/// Token ids `[tokens]`: sharded over the data axes and `Cp`, the same on every `Tp` rank.
pub type Ids = layout![Dp: Shard<0>, Ep: Shard<0>, Cp: Shard<0>, Tp: Invariant];
/// A per-token value (loss, statistics) `[tokens]` after its reduction over `Tp`.
pub type TokenInvariant = Ids;
/// A raw gradient of a stored parameter: `Partial` over `Dp`, already reduced over `Ep`
/// and `Cp` (`Invariant`, by the adjoint of [`to_replicate`](Var::to_replicate)), `T`
/// over `Tp`.
pub type DpPartial<T> = DpLayout<Partial, T>;
/// A parameter gradient reduced over every token-sharding axis, `T` over `Tp`.
pub type DpReduced<T> = DpLayout<Invariant, T>;
/// A parameter as compute ops take it: `Replicate` over the token-sharding axes (`Dp`,
/// `Ep`, `Cp`), `T` over `Tp`. Its gradient is `Partial` over all three.
pub type ParamLayout<T> = layout![Dp: Replicate, Ep: Replicate, Cp: Replicate, Tp: T];
/// A training loss: the sum over this rank's tokens (`Partial` over `Dp`, `Ep` and `Cp`),
/// the same on every `Tp` rank. `backward()` seeds it exactly.
pub type Loss = layout![Dp: Partial, Ep: Partial, Cp: Partial, Tp: Invariant];

/// Where the residual stream lives on `Tp`, and the named transitions that enter and leave
/// the tensor-parallel region. Implemented by [`NoSp`] and [`Sp`] only.
///
/// The associated types carry the rules generic layer code needs (a bound on an associated
/// type is implied wherever `M: SeqMode` is), so a layer written once for both modes needs
/// no where clause: the stream adds to itself, and a stream parameter may be a row bias or
/// a norm weight for it.
pub trait SeqMode: Clone + Send + Sync + Sized + 'static {
    /// The residual stream's placement on `Tp` (its own dual).
    type Tp: PlacementType<Grad = Self::Tp>
        + Pointwise
        + Linear
        + AddPlacement<Self::Tp>
        + HopPlacement<Self::Tp>;
    /// The placement on `Tp` of a parameter applied to the stream.
    type ParamTp: TpParam + IsWhole + AddRowRule<Self::Tp> + NormRule<Self::Tp, 1>;
    /// Whether the sequence is sharded over `Tp`.
    const SP: bool;

    /// Into the tensor-parallel region: `to_replicate` (no SP) or `all_gather` (SP). The
    /// tape records its adjoint: `all_reduce` or `reduce_scatter` of the input gradient.
    fn enter<'t>(x: &Var<'t, Stream<Self>>) -> Result<Var<'t, Full>>;

    /// Out of it: `all_reduce` (no SP) or `reduce_scatter` of the tokens (SP).
    fn exit<'t>(y: &Var<'t, RowPartial>) -> Result<Var<'t, Stream<Self>>>;

    /// Runs `O`'s body for this mode: code whose ops have rules for each concrete mode's
    /// layouts but not for a generic `M` (the MoE forward) is written per mode and
    /// called through here, so generic layer code needs no extra bounds.
    fn per_mode<'a, 't: 'a, O: PerMode>(input: O::In<'a, 't, Self>) -> Result<O::Out<'t, Self>>;
}

/// A computation written once per sequence mode and chosen by [`SeqMode::per_mode`]: its
/// input and output are families over the mode, and each body sees concrete layouts.
pub trait PerMode {
    /// What the computation borrows under mode `M` (for `'a`, recording on a tape that
    /// lives for `'t`).
    type In<'a, 't: 'a, M: SeqMode>;
    /// What it returns under mode `M`.
    type Out<'t, M: SeqMode>;
    /// The body without sequence parallelism.
    fn no_sp<'a, 't: 'a>(input: Self::In<'a, 't, NoSp>) -> Result<Self::Out<'t, NoSp>>;
    /// The body with sequence parallelism.
    fn sp<'a, 't: 'a>(input: Self::In<'a, 't, Sp>) -> Result<Self::Out<'t, Sp>>;
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

    fn enter<'t>(x: &Var<'t, Stream<Self>>) -> Result<Var<'t, Full>> {
        x.to_replicate(Tp)
    }

    fn exit<'t>(y: &Var<'t, RowPartial>) -> Result<Var<'t, Stream<Self>>> {
        y.all_reduce(Tp)
    }

    fn per_mode<'a, 't: 'a, O: PerMode>(input: O::In<'a, 't, Self>) -> Result<O::Out<'t, Self>> {
        O::no_sp(input)
    }
}

impl SeqMode for Sp {
    type Tp = Shard<0>;
    type ParamTp = Replicate;
    const SP: bool = true;

    fn enter<'t>(x: &Var<'t, Stream<Self>>) -> Result<Var<'t, Full>> {
        x.all_gather(Tp)
    }

    fn exit<'t>(y: &Var<'t, RowPartial>) -> Result<Var<'t, Stream<Self>>> {
        y.reduce_scatter::<_, _, 0>(Tp)
    }

    fn per_mode<'a, 't: 'a, O: PerMode>(input: O::In<'a, 't, Self>) -> Result<O::Out<'t, Self>> {
        O::sp(input)
    }
}

/// The axes every layout of these layers names, in layout order: a model's stage mesh has
/// exactly these (size 1 where a parallelism is unused).
pub const MODEL_AXES: [AxisKind; 4] = [AxisKind::Dp, AxisKind::Ep, AxisKind::Cp, AxisKind::Tp];

/// The mesh a model with `config`'s degrees runs on: [`MODEL_AXES`], behind `Pp` when
/// `config.pp > 1` (pipeline stages then live on the mesh without `Pp`).
pub fn model_mesh(config: &ParallelConfig) -> Result<Mesh> {
    let mut axes = Vec::with_capacity(5);
    if config.pp > 1 {
        axes.push(AxisKind::Pp);
    }
    axes.extend(MODEL_AXES);
    Ok(config.mesh(&axes)?)
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
/// every axis: what [`Optimizer::update`](crate::Optimizer::update) accepts.
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

/// A parameter's placement over `Tp`, and how its gradient is reduced there: nothing for a
/// `Shard<D>` or `Invariant` weight, an all-reduce for a `Replicate` one (a sequence-parallel
/// norm weight or row bias, each `Tp` rank having seen other tokens).
pub trait TpParam: PlacementType<Grad: Linear> + Linear {
    /// The gradient's placement over `Tp` once reduced there.
    type Reduced: ReducedPlacement<Self> + Linear;
    /// Collective over `Tp` where needed (whatever the gradient's placement `Q` over `Dp`:
    /// `Invariant` after DDP's all-reduce, `Shard` after ZeRO's or FSDP's reduce-scatter).
    fn reduce_over_tp<Q: PlacementType, E: PlacementType>(
        g: DTensor<DpLayout<Q, Self::Grad, E>>,
    ) -> Result<DTensor<DpLayout<Q, Self::Reduced, E>>>;
}

impl<const D: usize> TpParam for Shard<D> {
    type Reduced = Shard<D>;
    fn reduce_over_tp<Q: PlacementType, E: PlacementType>(
        g: DTensor<DpLayout<Q, Shard<D>, E>>,
    ) -> Result<DTensor<DpLayout<Q, Shard<D>, E>>> {
        Ok(g)
    }
}

impl TpParam for Invariant {
    type Reduced = Invariant;
    fn reduce_over_tp<Q: PlacementType, E: PlacementType>(
        g: DTensor<DpLayout<Q, Invariant, E>>,
    ) -> Result<DTensor<DpLayout<Q, Invariant, E>>> {
        Ok(g)
    }
}

impl TpParam for Replicate {
    type Reduced = Invariant;
    fn reduce_over_tp<Q: PlacementType, E: PlacementType>(
        g: DTensor<DpLayout<Q, Partial, E>>,
    ) -> Result<DTensor<DpLayout<Q, Invariant, E>>> {
        g.all_reduce(Tp)
    }
}
