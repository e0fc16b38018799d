//! Data parallelism as a parameter's placement over `Dp`: DDP, ZeRO-1, ZeRO-2 and FSDP
//! (ZeRO-3), chosen by a type ([`DataMode`]) on the layers.
//!
//! Every parameter has a *master* copy (the value the optimizer updates, with its state)
//! and a *compute* copy (what the forward reads, in the compute dtype). Their placements
//! over `Dp` are the data mode:
//!
//! | mode | compute copy over `Dp` | master (and optimizer state) over `Dp` | gradient path over `Dp` | `Dp` bytes per step (bus convention) |
//! |---|---|---|---|---|
//! | [`Ddp`] | `Replicate` | `Replicate` | `all_reduce` → `Invariant` | 2·(dp−1)/dp·P |
//! | [`Zero1`], [`Zero2`] | `Replicate` | `Shard<F>` | `reduce_scatter` → `Shard<F>`, then the updated shard is all-gathered | 2·(dp−1)/dp·P |
//! | [`Fsdp`] | `Shard<F>`, all-gathered in the forward (`Shard → Replicate`) | `Shard<F>` | the gather's typed adjoint, a `reduce_scatter`: the gradient arrives `Shard<F>` | 3·(dp−1)/dp·P with reshard after forward (gather, re-gather in backward, reduce-scatter), 2·(dp−1)/dp·P without |
//!
//! This file holds the type-level rules; the parameter that follows them,
//! [`Weight`](crate::Weight), lives one floor up in [`params`](crate::params).
//!
//! ZeRO-1 and ZeRO-2 differ in when they reduce ([`DataMode::REDUCE_EACH_BACKWARD`]): over
//! the microbatches of a step ZeRO-1 accumulates the full gradient and reduce-scatters it
//! once, ZeRO-2 reduce-scatters after every backward and keeps only its shard (as FSDP).
//!
//! Nothing here is a flag the optimizer could ignore: the optimizer takes a gradient only
//! if it is reduced to the master's placement ([`ReducedGrad`](crate::ReducedGrad)), so an
//! FSDP gradient all-reduced instead of reduce-scattered (`Invariant` for a `Shard<F>`
//! master) does not compile, and an FSDP parameter used in the forward without its gather
//! (`Shard<F>` over `Dp` meeting tokens that are `Shard<0>` over `Dp`) has no matmul rule.
//!
//! ## How `Dp` and `Tp` shard one parameter
//!
//! `F` is the dim tensor parallelism leaves whole ([`ParamKind`]): a column weight
//! `[out, in]` is `Shard<0>` over `Tp` and `Shard<1>` over `Dp`; a row weight the other
//! way round; a norm weight or row bias `Shard<0>` over `Dp`. Sharding *another* dim needs
//! no strided shard (PyTorch's `_StridedShard`): every rank's piece is one rectangular
//! block of the global tensor, the all-gather over `Dp` is a plain gather, and a checkpoint
//! reads the same blocks. The other order — `Dp` cutting the dim `Tp` already cut — is a
//! layout such as `[Dp: Shard<0>, Tp: Shard<0>]`, whose axes nest left to right (`Dp`
//! outer): gathering it over `Dp` would interleave pieces, so `all_gather(Dp)` returns
//! `Err` naming the inner axis. A parameter with no whole dim (the column-parallel bias,
//! 1-D and sharded over `Tp`) stays `Replicate` over `Dp` in every mode and is
//! all-reduced: it holds `out/tp` elements.
//!
//! ## Expert parameters (`Ep`)
//!
//! A parameter kind also names its placement over `Ep` ([`ParamKind::Ep`], an
//! [`EpParam`]): `Invariant` for every dense parameter (its compute copy is `Replicate`
//! there and its gradient all-reduced over `Ep`, a data axis for it), `Shard<0>` for MoE
//! expert weights `[experts, out, in]` ([`ExpertW`]): each `Ep` rank holds its experts
//! whole, computes with them as they are, and its gradient is *not* reduced over `Ep`. The
//! data modes treat experts as any other kind, sharding dim 1 (`out`, whole on every `Ep`
//! and `Tp` rank) over `Dp` under ZeRO and FSDP: `[Dp: Shard<1>, Ep: Shard<0>, …]` cuts two
//! different dims, so every piece is one block and the gathers are plain.
//!
//! ## Precision
//!
//! [`Precision`] sets the compute dtype (bf16 parameters and activations with f32 masters:
//! mixed precision) and the dtype gradients are reduced in. With FSDP and an f32 reduction
//! of bf16 compute, the gather runs in f32 and casts after it, so its adjoint
//! reduce-scatters in f32 (twice the gather bytes; FSDP2's `reduce_dtype` gathers in bf16
//! and casts the gradient up inside its hook).
//!
//! ## Reshard after forward
//!
//! With [`Precision::reshard_after_forward`] (FSDP2's default) a gathered parameter is not
//! kept for the backward: the op that uses it is a recomputed region
//! ([`Var::checkpoint_with`]) whose backward gathers the shard again and recomputes the op
//! before differentiating it (for a linear layer, one extra product). Our tape keeps the
//! values an op's backward reads, so re-gathering alone, as FSDP2 does, would need values
//! the tape can drop and rebuild; the recomputed op is the price. LayerNorm's weight and
//! bias, two parameters of one op, stay gathered until the backward.
//!
//! ## Prefetch
//!
//! With [`Precision::prefetch`] the GPT starts each block's gathers (asynchronous
//! collectives, [`DTensor::start_all_gather`]) one block ahead, so they move while the
//! previous block computes; [`Weight::on`](crate::Weight::on) then only waits for them,
//! recording the same adjoint ([`Var::all_gather_prefetched`]). The training is bitwise
//! the same.
//!
//! ## Reduction over `Dp` × `Cp`
//!
//! A parameter is `Replicate` over `Dp`, `Ep` and `Cp` for compute, so its gradient is
//! `Partial` over all three. We reduce it *per axis*: the `Cp` (and `Ep`) all-reduce runs
//! per parameter in the backward, as the typed adjoint of [`to_compute`]'s
//! `to_replicate`, and the `Dp` reduction is the data mode's (DDP's all-reduce, ZeRO's
//! reduce-scatter, FSDP's gather adjoint). That composes with every data mode: FSDP's
//! reduce-scatter stays over `Dp` alone, where its shards live. The alternative, one
//! all-reduce over the flattened `Dp × Cp` group, is one call with fewer latency terms and
//! moves less per rank (2·(n−1)/n·P over n = dp·cp ranks against 2·(dp−1)/dp·P +
//! 2·(cp−1)/cp·P), but needs a communicator per axis pair (`DeviceMesh` has none:
//! `split` one from the world) and does not compose with sharding over `Dp` alone
//! (a reduce-scatter over the flattened group would shard over `Cp` too).
//!
//! `benches/grad_reduce.rs` measures both on 4 thread ranks as `[Dp=2, Cp=2]` with f32
//! gradients (per rank, per-axis sends 2·P bytes in 2 calls, flattened 1.5·P in 1, as the
//! counters show). On a shared 2-core machine (load ≈ 7; absolute figures moved up to 2×
//! between three runs, the ratio less) the flattened all-reduce took 0.6–0.8 of the
//! per-axis time: 256 KiB 70–90 µs vs 94–120 µs (4.4–5.7 vs 3.3–4.2 GB/s bus), 4 MiB
//! 0.95–2.6 ms vs 1.2–3.4 ms (2.4–6.6 vs 1.9–5.2 GB/s bus), 32 MiB 33 ms vs 40–56 ms
//! (1.5 vs 0.9–1.25 GB/s bus); a lone 2-rank all-reduce took 0.4–0.5 of per-axis. All stay
//! far below one thread's memcpy (algbw ≤ 0.17 of it). The gain is a constant factor, about
//! what the saved bytes and latency term predict, not a change of scale, so we keep
//! per-axis reduction for its composability with the data modes; a flattened group is the
//! step to take if a profile on real interconnects shows the `Cp` all-reduce to matter.

use crate::seq::{DpLayout, ParamLayout, ReducedPlacement, SeqMode, TpParam};
use dtensor_core::{DTensor, PendingAllGather, Result, Var};
use dtensor_kernels::DType;
use dtensor_placement::{
    layout, Cp, Dp, Ep, Invariant, Layout, Linear, Partial, PlacementType, Replicate, Shard, Tp,
};
use std::marker::PhantomData;

/// A parameter whole over `Dp` (gathered, or never sharded) but still `Invariant` over
/// `Cp` (and `E` over `Ep`): one step before [`ComputeLayout`].
pub type DpWhole<T, E = Invariant> = DpLayout<Replicate, T, E>;
/// A parameter as compute ops take it: [`ParamLayout<T>`] for a dense one (`E` =
/// `Invariant`), `[Dp: Replicate, Ep: Shard<0>, Cp: Replicate, Tp: T]` for expert weights.
pub type ComputeLayout<T, E = Invariant> =
    layout![Dp: Replicate, Ep: <E as EpParam>::Compute, Cp: Replicate, Tp: T];
/// The compute layout of a parameter of kind `K`.
pub type ComputeOf<K> = ComputeLayout<<K as ParamKind>::Tp, <K as ParamKind>::Ep>;

/// A parameter's placement over `Ep`, and how a whole (over `Dp`) parameter is made ready
/// for compute there and over `Cp`.
///
/// | `Ep` placement | compute copy over `Ep` | gradient over `Ep` |
/// |---|---|---|
/// | `Invariant` (dense) | `Replicate` (`to_replicate`) | the adjoint all-reduces it: `Invariant` |
/// | `Shard<0>` (experts) | `Shard<0>`: this rank's experts | `Shard<0>`: each rank's own experts, never reduced over `Ep` |
///
/// Over `Cp` both are `to_replicate`d (the adjoint all-reduces the gradient there).
pub trait EpParam: PlacementType<Grad = Self> + Linear + ReducedPlacement<Self> {
    /// The compute copy's placement over `Ep`.
    type Compute: PlacementType;
    /// `Invariant` → `Replicate` over `Cp` (and over `Ep` for a dense parameter).
    fn to_compute<'t, T: PlacementType>(
        w: &Var<'t, DpWhole<T, Self>>,
    ) -> Result<Var<'t, ComputeLayout<T, Self>>>;
}

impl EpParam for Invariant {
    type Compute = Replicate;
    fn to_compute<'t, T: PlacementType>(
        w: &Var<'t, DpWhole<T, Self>>,
    ) -> Result<Var<'t, ComputeLayout<T, Self>>> {
        to_compute(w)
    }
}

impl EpParam for Shard<0> {
    type Compute = Shard<0>;
    fn to_compute<'t, T: PlacementType>(
        w: &Var<'t, DpWhole<T, Self>>,
    ) -> Result<Var<'t, ComputeLayout<T, Self>>> {
        w.to_replicate(Cp)
    }
}

/// `Invariant` → `Replicate` over `Ep` and `Cp`: a whole parameter made ready for compute
/// with tokens sharded there; the adjoint all-reduces its gradient over both axes.
pub fn to_compute<'t, T: PlacementType>(
    w: &Var<'t, DpWhole<T>>,
) -> Result<Var<'t, ParamLayout<T>>> {
    w.to_replicate(Ep)?.to_replicate(Cp)
}

/// The compute copy's layout of a parameter of kind `K` under data mode `D`.
pub type WorkLayout<D, K> =
    DpLayout<<D as DataMode>::Work<K>, <K as ParamKind>::Tp, <K as ParamKind>::Ep>;
/// The master's layout (the optimizer's view) of a parameter of kind `K` under mode `D`.
pub type MasterLayout<D, K> =
    DpLayout<<D as DataMode>::Master<K>, <K as ParamKind>::Tp, <K as ParamKind>::Ep>;

/// What kind of parameter this is for data parallelism: its placement over `Tp`, and the
/// placement over `Dp` a sharding data mode gives it (the dim `Tp` leaves whole).
pub trait ParamKind: Send + Sync + 'static {
    /// Placement over `Tp`.
    type Tp: TpParam;
    /// Placement over `Dp` when the mode shards parameters: `Shard<F>` of a dim `Tp`
    /// (and `Ep`) leaves whole, `Replicate` when there is none.
    type DpShard: DpShardPlacement;
    /// Placement over `Ep`: `Invariant` for a dense parameter, `Shard<0>` for expert
    /// weights ([`ExpertW`]).
    type Ep: EpParam;
}

/// A column-parallel weight `[out, in]` (and the vocabulary-parallel embedding table
/// `[vocab, hidden]`): `Shard<0>` over `Tp`, `Shard<1>` over a sharding `Dp`.
pub struct ColW;
/// A row-parallel weight `[out, in]`: `Shard<1>` over `Tp`, `Shard<0>` over a sharding `Dp`.
pub struct RowW;
/// A column-parallel bias `[out]`: `Shard<0>` over `Tp`, no whole dim left, so
/// `Replicate` over `Dp` in every mode.
pub struct ColB;
/// A parameter applied to the residual stream (norm weight, row bias) `[hidden]` under
/// sequence mode `M`: `M::ParamTp` over `Tp`, `Shard<0>` over a sharding `Dp`.
pub struct StreamP<M>(PhantomData<M>);
/// MoE expert weights `[experts, out, in]` under sequence mode `M`: `Shard<0>` over `Ep`
/// (whole experts per rank), replicated over `Tp` like a stream parameter
/// (`M::ParamTp`: `Invariant` without SP, `Replicate` with SP, whose gradient is then
/// all-reduced over `Tp`), `Shard<1>` over a sharding `Dp` (dim 1, `out`, is whole on every
/// `Ep` and `Tp` rank). No tensor parallelism inside an expert.
pub struct ExpertW<M>(PhantomData<M>);

/// A parameter every `Tp` rank holds whole and applies to its own heads (the KV
/// projection when `tp` exceeds the KV heads, the q/k norm weights): `Replicate` over
/// `Tp`, so its gradient arrives `Partial` there and is all-reduced over `Tp` before the
/// optimizer takes it, which keeps the replicas bitwise identical; `Shard<0>` over a
/// sharding `Dp`.
pub struct TpSharedW;

impl ParamKind for TpSharedW {
    type Tp = Replicate;
    type DpShard = Shard<0>;
    type Ep = Invariant;
}
impl ParamKind for ColW {
    type Tp = Shard<0>;
    type DpShard = Shard<1>;
    type Ep = Invariant;
}
impl ParamKind for RowW {
    type Tp = Shard<1>;
    type DpShard = Shard<0>;
    type Ep = Invariant;
}
impl ParamKind for ColB {
    type Tp = Shard<0>;
    type DpShard = Replicate;
    type Ep = Invariant;
}
impl<M: SeqMode> ParamKind for StreamP<M> {
    type Tp = M::ParamTp;
    type DpShard = Shard<0>;
    type Ep = Invariant;
}
impl<M: SeqMode> ParamKind for ExpertW<M> {
    type Tp = M::ParamTp;
    type DpShard = Shard<1>;
    type Ep = Shard<0>;
}

/// Dtypes and the reshard flag of a model's parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Precision {
    /// The compute copy's dtype (`None`: the master's). bf16 with f32 masters is mixed
    /// precision.
    pub compute: Option<DType>,
    /// The dtype gradients are reduced over `Dp` in (`None`: the compute dtype).
    pub reduce: Option<DType>,
    /// FSDP: drop gathered matrices after the forward and gather them again in the
    /// backward (FSDP2's `reshard_after_forward`). Ignored by the other modes.
    pub reshard_after_forward: bool,
    /// FSDP: start gathering the next block's parameters before this block's forward, so
    /// the all-gather overlaps compute (FSDP2's forward prefetch). Ignored by the other
    /// modes.
    pub prefetch: bool,
}

impl Precision {
    /// Mixed precision: compute in `compute`, reduce gradients in `reduce`.
    pub fn mixed(compute: DType, reduce: DType) -> Self {
        Precision {
            compute: Some(compute),
            reduce: Some(reduce),
            reshard_after_forward: false,
            prefetch: false,
        }
    }
    /// The same, with `prefetch` set.
    pub fn prefetched(self, on: bool) -> Self {
        Precision {
            prefetch: on,
            ..self
        }
    }
    /// The same, with `reshard_after_forward` set.
    pub fn resharded(self, on: bool) -> Self {
        Precision {
            reshard_after_forward: on,
            ..self
        }
    }
    /// The compute dtype for masters of dtype `master`.
    pub fn compute_of(&self, master: DType) -> DType {
        self.compute.unwrap_or(master)
    }
    /// The dtype gradients of masters of dtype `master` are reduced in.
    pub fn reduce_of(&self, master: DType) -> DType {
        self.reduce.unwrap_or(self.compute_of(master))
    }
    /// Gradients are reduced in a wider dtype than compute (f32 for bf16): an FSDP shard is
    /// then gathered from the master and cast after the gather, so the gather's adjoint
    /// reduce-scatters in the wide dtype, and it keeps no compute copy.
    fn reduces_wider(&self, master: DType) -> bool {
        self.reduce_of(master).size_in_bytes() > self.compute_of(master).size_in_bytes()
    }
}

/// A compute copy's placement over `Dp` and how the forward makes it whole
/// (`Replicate`): nothing, or an all-gather whose adjoint is the reduce-scatter.
pub trait DpGather: PlacementType {
    /// Whether the compute copy is sharded (FSDP), so the forward gathers it.
    const SHARDED: bool;
    /// The whole parameter in `compute` dtype from the stored compute copy (or, for an
    /// f32-reduced FSDP shard, the f32 master: gathered, then cast).
    fn gather<'t, T: PlacementType, E: EpParam>(
        stored: &Var<'t, DpLayout<Self, T, E>>,
        compute: DType,
    ) -> Result<Var<'t, ComputeLayout<T, E>>>;

    /// Starts gathering `stored` now (FSDP's prefetch); `None` where nothing is gathered.
    #[allow(clippy::type_complexity)]
    fn start_gather<T: PlacementType, E: EpParam>(
        stored: &DTensor<DpLayout<Self, T, E>>,
    ) -> Result<Option<PendingAllGather<DpLayout<Self, T, E>, DpWhole<T, E>>>>;

    /// [`gather`](Self::gather) finishing a gather [`start_gather`](Self::start_gather)
    /// started from the same value.
    fn gather_prefetched<'t, T: PlacementType, E: EpParam>(
        stored: &Var<'t, DpLayout<Self, T, E>>,
        pending: PendingAllGather<DpLayout<Self, T, E>, DpWhole<T, E>>,
        compute: DType,
    ) -> Result<Var<'t, ComputeLayout<T, E>>>;
}

impl DpGather for Replicate {
    const SHARDED: bool = false;
    fn gather<'t, T: PlacementType, E: EpParam>(
        stored: &Var<'t, DpLayout<Self, T, E>>,
        compute: DType,
    ) -> Result<Var<'t, ComputeLayout<T, E>>> {
        E::to_compute(&stored.to_dtype(compute)?)
    }
    fn start_gather<T: PlacementType, E: EpParam>(
        _: &DTensor<DpLayout<Self, T, E>>,
    ) -> Result<Option<PendingAllGather<DpLayout<Self, T, E>, DpWhole<T, E>>>> {
        Ok(None)
    }
    fn gather_prefetched<'t, T: PlacementType, E: EpParam>(
        stored: &Var<'t, DpLayout<Self, T, E>>,
        _: PendingAllGather<DpLayout<Self, T, E>, DpWhole<T, E>>,
        compute: DType,
    ) -> Result<Var<'t, ComputeLayout<T, E>>> {
        Self::gather(stored, compute)
    }
}

impl<const F: usize> DpGather for Shard<F> {
    const SHARDED: bool = true;
    fn gather<'t, T: PlacementType, E: EpParam>(
        stored: &Var<'t, DpLayout<Self, T, E>>,
        compute: DType,
    ) -> Result<Var<'t, ComputeLayout<T, E>>> {
        E::to_compute(&stored.all_gather(Dp)?.to_dtype(compute)?)
    }
    fn start_gather<T: PlacementType, E: EpParam>(
        stored: &DTensor<DpLayout<Self, T, E>>,
    ) -> Result<Option<PendingAllGather<DpLayout<Self, T, E>, DpWhole<T, E>>>> {
        Ok(Some(stored.clone().start_all_gather(Dp)?))
    }
    fn gather_prefetched<'t, T: PlacementType, E: EpParam>(
        stored: &Var<'t, DpLayout<Self, T, E>>,
        pending: PendingAllGather<DpLayout<Self, T, E>, DpWhole<T, E>>,
        compute: DType,
    ) -> Result<Var<'t, ComputeLayout<T, E>>> {
        E::to_compute(&stored.all_gather_prefetched(pending)?.to_dtype(compute)?)
    }
}

/// A master's placement over `Dp` (`Self`) paired with its compute copy's (`W`): which
/// value the tape binds, how its gradient is reduced to the master's placement, and how
/// the compute copy is rebuilt after an update.
pub trait DpMaster<W: DpGather>: PlacementType {
    /// The gradient's placement over `Dp` once reduced (what the optimizer takes).
    type Reduced: ReducedPlacement<Self> + Linear;
    /// The reduction over `Dp` is an all-reduce of the whole raw gradient (DDP), which
    /// data parallelism may fuse with other parameters' into one bucket.
    const ALL_REDUCE: bool = false;

    /// The value the tape binds for the parameter: the compute copy, or the master where
    /// it serves as one (same placement and dtype, or an FSDP shard gathered in f32 and
    /// cast after).
    fn bound<T: PlacementType, E: EpParam>(
        master: &DTensor<DpLayout<Self, T, E>>,
        work: Option<&DTensor<DpLayout<W, T, E>>>,
        p: &Precision,
    ) -> Result<DTensor<DpLayout<W, T, E>>>;

    /// A raw gradient of the bound value (summed over microbatches, say) reduced over `Dp`
    /// to `Reduced`, in `master`'s dtype: an all-reduce, a reduce-scatter, or nothing.
    fn reduce<G: PlacementType, E: EpParam>(
        raw: DTensor<DpLayout<W::Grad, G, E>>,
        master: DType,
        p: &Precision,
    ) -> Result<DTensor<DpLayout<Self::Reduced, G, E>>>;

    /// The compute copy after the master changed; `None` when the master serves as it.
    fn refresh<T: PlacementType, E: EpParam>(
        master: &DTensor<DpLayout<Self, T, E>>,
        p: &Precision,
    ) -> Result<Option<DTensor<DpLayout<W, T, E>>>>;
}

/// Casts `g` to `dtype` unless it already is.
fn cast<L: Layout>(g: DTensor<L>, dtype: DType) -> Result<DTensor<L>> {
    if g.as_local().dtype() == dtype {
        Ok(g)
    } else {
        g.to_dtype(dtype)
    }
}

/// DDP (and a column bias in any mode): replicated master and compute copy; the gradient
/// is all-reduced.
impl DpMaster<Replicate> for Replicate {
    type Reduced = Invariant;
    const ALL_REDUCE: bool = true;

    fn bound<T: PlacementType, E: EpParam>(
        master: &DTensor<DpLayout<Self, T, E>>,
        work: Option<&DTensor<DpLayout<Replicate, T, E>>>,
        _: &Precision,
    ) -> Result<DTensor<DpLayout<Replicate, T, E>>> {
        Ok(work.unwrap_or(master).clone())
    }

    fn reduce<G: PlacementType, E: EpParam>(
        raw: DTensor<DpLayout<Partial, G, E>>,
        master: DType,
        p: &Precision,
    ) -> Result<DTensor<DpLayout<Invariant, G, E>>> {
        cast(cast(raw, p.reduce_of(master))?.all_reduce(Dp)?, master)
    }

    fn refresh<T: PlacementType, E: EpParam>(
        master: &DTensor<DpLayout<Self, T, E>>,
        p: &Precision,
    ) -> Result<Option<DTensor<DpLayout<Replicate, T, E>>>> {
        let c = p.compute_of(master.as_local().dtype());
        (c != master.as_local().dtype())
            .then(|| master.to_dtype(c))
            .transpose()
    }
}

/// ZeRO-1/2: a replicated compute copy, a master (and optimizer state) sharded over `Dp`;
/// the gradient is reduce-scattered and the updated shard all-gathered.
impl<const F: usize> DpMaster<Replicate> for Shard<F> {
    type Reduced = Shard<F>;

    fn bound<T: PlacementType, E: EpParam>(
        master: &DTensor<DpLayout<Self, T, E>>,
        work: Option<&DTensor<DpLayout<Replicate, T, E>>>,
        p: &Precision,
    ) -> Result<DTensor<DpLayout<Replicate, T, E>>> {
        match work {
            Some(w) => Ok(w.clone()),
            // Only between a release and a refresh: rebuild it.
            None => cast(master.clone(), p.compute_of(master.as_local().dtype()))?.all_gather(Dp),
        }
    }

    fn reduce<G: PlacementType, E: EpParam>(
        raw: DTensor<DpLayout<Partial, G, E>>,
        master: DType,
        p: &Precision,
    ) -> Result<DTensor<DpLayout<Shard<F>, G, E>>> {
        cast(
            cast(raw, p.reduce_of(master))?.reduce_scatter::<_, _, F>(Dp)?,
            master,
        )
    }

    fn refresh<T: PlacementType, E: EpParam>(
        master: &DTensor<DpLayout<Self, T, E>>,
        p: &Precision,
    ) -> Result<Option<DTensor<DpLayout<Replicate, T, E>>>> {
        let c = p.compute_of(master.as_local().dtype());
        Ok(Some(cast(master.clone(), c)?.all_gather(Dp)?))
    }
}

/// FSDP: master and compute copy sharded over `Dp`; the forward gathers, and the gather's
/// adjoint reduce-scatters the gradient into the master's placement.
impl<const F: usize> DpMaster<Shard<F>> for Shard<F> {
    type Reduced = Shard<F>;

    fn bound<T: PlacementType, E: EpParam>(
        master: &DTensor<DpLayout<Self, T, E>>,
        work: Option<&DTensor<DpLayout<Shard<F>, T, E>>>,
        p: &Precision,
    ) -> Result<DTensor<DpLayout<Shard<F>, T, E>>> {
        // Reducing wider than computing: bind the master, gather it, cast after.
        Ok(if p.reduces_wider(master.as_local().dtype()) {
            master.clone()
        } else {
            work.unwrap_or(master).clone()
        })
    }

    fn reduce<G: PlacementType, E: EpParam>(
        raw: DTensor<DpLayout<Shard<F>, G, E>>,
        master: DType,
        _: &Precision,
    ) -> Result<DTensor<DpLayout<Shard<F>, G, E>>> {
        cast(raw, master)
    }

    fn refresh<T: PlacementType, E: EpParam>(
        master: &DTensor<DpLayout<Self, T, E>>,
        p: &Precision,
    ) -> Result<Option<DTensor<DpLayout<Shard<F>, T, E>>>> {
        let (m, c) = (
            master.as_local().dtype(),
            p.compute_of(master.as_local().dtype()),
        );
        if c == m || p.reduces_wider(m) {
            Ok(None)
        } else {
            Ok(Some(master.to_dtype(c)?))
        }
    }
}

/// A placement over `Dp` a sharding mode may give a parameter kind: usable as the master
/// of a replicated compute copy (ZeRO) and of a compute copy laid out like itself (FSDP).
pub trait DpShardPlacement: DpGather + DpMaster<Replicate> + DpMaster<Self> {}
impl DpShardPlacement for Replicate {}
impl<const F: usize> DpShardPlacement for Shard<F> {}

/// How a model's parameters are held over `Dp` (see the module docs' table).
pub trait DataMode: Clone + Send + Sync + Sized + 'static {
    /// The compute copy's placement over `Dp`.
    type Work<K: ParamKind>: DpGather;
    /// The master's placement over `Dp`.
    type Master<K: ParamKind>: DpMaster<Self::Work<K>>;
    /// Name for receipts and errors.
    const NAME: &'static str;
    /// Gradients are reduced after every backward (ZeRO-2, FSDP: only the shard is kept
    /// across microbatches) rather than once per step (DDP, ZeRO-1: the full gradient is
    /// accumulated).
    const REDUCE_EACH_BACKWARD: bool;
}

/// Data parallelism with replicated parameters and optimizer state (PyTorch DDP).
#[derive(Clone, Copy, Debug, Default)]
pub struct Ddp;
/// ZeRO stage 1: optimizer state (and the f32 master) sharded over `Dp`; full gradients
/// accumulated, reduce-scattered once per step.
#[derive(Clone, Copy, Debug, Default)]
pub struct Zero1;
/// ZeRO stage 2: as ZeRO-1, and gradients reduce-scattered after every backward, so only
/// their shard is kept.
#[derive(Clone, Copy, Debug, Default)]
pub struct Zero2;
/// FSDP (ZeRO stage 3): parameters sharded over `Dp` too, gathered for use.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fsdp;

impl DataMode for Ddp {
    type Work<K: ParamKind> = Replicate;
    type Master<K: ParamKind> = Replicate;
    const NAME: &'static str = "ddp";
    const REDUCE_EACH_BACKWARD: bool = false;
}
impl DataMode for Zero1 {
    type Work<K: ParamKind> = Replicate;
    type Master<K: ParamKind> = K::DpShard;
    const NAME: &'static str = "zero1";
    const REDUCE_EACH_BACKWARD: bool = false;
}
impl DataMode for Zero2 {
    type Work<K: ParamKind> = Replicate;
    type Master<K: ParamKind> = K::DpShard;
    const NAME: &'static str = "zero2";
    const REDUCE_EACH_BACKWARD: bool = true;
}
impl DataMode for Fsdp {
    type Work<K: ParamKind> = K::DpShard;
    type Master<K: ParamKind> = K::DpShard;
    const NAME: &'static str = "fsdp";
    const REDUCE_EACH_BACKWARD: bool = true;
}

/// The `Dp` placement of a reduced gradient of kind `K` under mode `D`.
pub type DpReducedOf<D, K> =
    <<D as DataMode>::Master<K> as DpMaster<<D as DataMode>::Work<K>>>::Reduced;
/// A gradient of kind `K` under mode `D` reduced over `Dp` and `Tp`: what the optimizer
/// takes for the master.
pub type ReducedLayout<D, K> =
    DpLayout<DpReducedOf<D, K>, <<K as ParamKind>::Tp as TpParam>::Reduced, <K as ParamKind>::Ep>;
