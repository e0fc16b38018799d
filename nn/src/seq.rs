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
//! The column layers enter with [`SeqMode::enter`] (`to_replicate`, Megatron's `f`, or an
//! `all_gather` of the sequence) and the row layers leave with [`SeqMode::exit`]
//! (`all_reduce`, Megatron's `g`, or a `reduce_scatter` of the sequence); the tape records
//! their typed adjoints.

use crate::data::{DataMode, DpLayout};
use crate::moe::MoeMlp;
use crate::optim::TpParam;
use dtensor_core::{HopPlacement, Result, Tape, Var};
use dtensor_placement::{
    layout, AddPlacement, AddRowRule, AxisKind, Cp, Dp, Ep, Invariant, IsWhole, Layout, Linear,
    Mesh, NormRule, ParallelConfig, Partial, PlacementType, Pointwise, Replicate, Shard, Tp,
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

    /// [`MoeMlp::forward`](crate::MoeMlp::forward) in this mode (whose concrete layouts
    /// meet the MoE ops' rules): the output and the raw auxiliary loss.
    #[doc(hidden)]
    #[allow(clippy::type_complexity)]
    fn moe_forward<'t, D: DataMode>(
        mlp: &MoeMlp<Self, D>,
        tape: &'t Tape,
        x: &Var<'t, Stream<Self>>,
    ) -> Result<(Var<'t, Stream<Self>>, Var<'t, Loss>)>;
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

    fn moe_forward<'t, D: DataMode>(
        mlp: &MoeMlp<Self, D>,
        tape: &'t Tape,
        x: &Var<'t, Stream<Self>>,
    ) -> Result<(Var<'t, Stream<Self>>, Var<'t, Loss>)> {
        crate::moe::forward_nosp(mlp, tape, x)
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

    fn moe_forward<'t, D: DataMode>(
        mlp: &MoeMlp<Self, D>,
        tape: &'t Tape,
        x: &Var<'t, Stream<Self>>,
    ) -> Result<(Var<'t, Stream<Self>>, Var<'t, Loss>)> {
        crate::moe::forward_sp(mlp, tape, x)
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
