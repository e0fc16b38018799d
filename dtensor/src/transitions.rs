//! Named placement transitions, one mesh axis at a time: each is a consuming method of
//! [`DTensor`] that issues the collective it names (or none), a `_vjp` twin returning the
//! result and its [`Adjoint`], and a twin on the tape ([`Var`]) that records that adjoint,
//! which always runs in the backward (every rank issues the same collectives).
//!
//! | method (one axis `X`) | from → to | collective | backward (adjoint) |
//! |---|---|---|---|
//! | [`to_replicate`](DTensor::to_replicate) (Megatron `f`) | `Invariant` → `Replicate` | none | all-reduce `Partial` → `Invariant` |
//! | [`all_reduce`](DTensor::all_reduce) (Megatron `g`) | `Partial` → `Invariant` | all-reduce | none (`Invariant` → `Replicate`) |
//! | [`all_gather`](DTensor::all_gather) | `Shard<D>` → `Replicate` | all-gather | reduce-scatter `Partial` → `Shard<D>` |
//! | [`all_gather_invariant`](DTensor::all_gather_invariant) | `Shard<D>` → `Invariant` | all-gather | local chunk |
//! | [`reduce_scatter`](DTensor::reduce_scatter) | `Partial` → `Shard<D>` | reduce-scatter | all-gather |
//! | [`all_to_all`](DTensor::all_to_all) | `Shard<A>` → `Shard<B>` | all-to-all | all-to-all back |
//! | [`chunk`](DTensor::chunk) | `Invariant` → `Shard<D>` | none (local slice) | all-gather `Shard<D>` → `Invariant` |
//! | [`chunk`](DTensor::chunk) | `Replicate` → `Shard<D>` | none (local slice) | none: `Shard<D>` → `Partial` by zero-padding |
//! | [`pad_to_partial`](DTensor::pad_to_partial) | `Shard<D>` → `Partial` | none (zero padding) | local chunk |
//! | [`replicate_to_partial`](DTensor::replicate_to_partial) | `Replicate` → `Partial` | none (rank 0 keeps, others zero: exact) | the same conversion |
//! | [`to_invariant`](DTensor::to_invariant) | `Replicate` → `Invariant` | none | `Invariant` → `Partial` (rank 0 keeps) |
//! | [`invariant_to_partial`](DTensor::invariant_to_partial) | `Invariant` → `Partial` | none (rank 0 keeps) | `Replicate` → `Invariant` |
//!
//! An [`Adjoint`]'s `backward` only accepts a gradient laid out as the dual of the result
//! and returns one laid out as the dual of the input. Multi-axis moves are a
//! [`TypedPlan`](crate::TypedPlan) ([`DTensor::plan`], [`DTensor::redistribute`]).

use crate::error::Result;
use crate::plan::StepKind;
use crate::tape::Var;
use crate::typed::{check_layout, Adjoint, DTensor, PendingAllGather};
use dtensor_placement::{
    Invariant, IsInvariant, IsPartial, IsReplicate, IsShard, IsWhole, Layout, MeshAxis, Partial,
    Replicate, Select, Shard, Sum,
};

impl<L: Layout> DTensor<L> {
    /// One move on axis `X`: the collective (or local step) `kind` names.
    fn step<X: MeshAxis, Out: Layout>(
        self,
        op: &'static str,
        kind: StepKind,
    ) -> Result<DTensor<Out>> {
        Ok(self.step_vjp::<X, Out>(op, kind)?.0)
    }

    /// [`step`](Self::step) and its adjoint, the plan of that one step reversed.
    fn step_vjp<X: MeshAxis, Out: Layout>(
        self,
        op: &'static str,
        kind: StepKind,
    ) -> Result<(DTensor<Out>, Adjoint<Out, L>)> {
        let axis = self.device_mesh().mesh().index_of(X::KIND).ok_or_else(|| {
            dtensor_placement::Error::AxisNotInMesh {
                op,
                axis: X::KIND,
                mesh: self.device_mesh().mesh().to_string(),
            }
        })?;
        let from = self.placements().to_vec();
        let out = self.into_any().apply(axis, kind)?;
        let plan = out.record_step(&from, axis, kind)?;
        debug_assert!(check_layout::<Out>(op, &out).is_ok());
        Ok((DTensor::wrap(out), Adjoint::new(plan)))
    }
}

/// Generates a named transition and its `_vjp` twin.
macro_rules! transition {
    (
        $(#[$doc:meta])*
        fn $name:ident / $vjp:ident $(<const $D:ident: usize>)? ($axis:ident)
        where P: $bound:path => $to:ty, $kind:expr
    ) => {
        $(#[$doc])*
        pub fn $name<X: MeshAxis, I $(, const $D: usize)?>(
            self,
            $axis: X,
        ) -> Result<DTensor<<L as Select<X, I>>::With<$to>>>
        where
            L: Select<X, I>,
            <L as Select<X, I>>::P: $bound,
        {
            let _ = $axis;
            self.step::<X, _>(stringify!($name), $kind)
        }

        #[doc = concat!("[`", stringify!($name), "`](Self::", stringify!($name), ") and its adjoint.")]
        #[allow(clippy::type_complexity)]
        pub fn $vjp<X: MeshAxis, I $(, const $D: usize)?>(
            self,
            $axis: X,
        ) -> Result<(
            DTensor<<L as Select<X, I>>::With<$to>>,
            Adjoint<<L as Select<X, I>>::With<$to>, L>,
        )>
        where
            L: Select<X, I>,
            <L as Select<X, I>>::P: $bound,
        {
            let _ = $axis;
            self.step_vjp::<X, _>(stringify!($name), $kind)
        }
    };
}

impl<L: Layout> DTensor<L> {
    transition! {
        /// `Shard<D>` → `Replicate` on axis `X`: all-gather. Backward: reduce-scatter.
        fn all_gather / all_gather_vjp (axis) where P: IsShard => Replicate,
        StepKind::AllGather { dim: <<L as Select<X, I>>::P as IsShard>::DIM }
    }
    transition! {
        /// `Shard<D>` → `Invariant` on axis `X`: all-gather. Backward: local chunk.
        fn all_gather_invariant / all_gather_invariant_vjp (axis) where P: IsShard => Invariant,
        StepKind::AllGatherInvariant { dim: <<L as Select<X, I>>::P as IsShard>::DIM }
    }
    transition! {
        /// `Partial` → `Shard<D>` on axis `X`: reduce-scatter along dim `D`. Backward: all-gather.
        fn reduce_scatter / reduce_scatter_vjp <const D: usize> (axis) where P: IsPartial => Shard<D>,
        StepKind::ReduceScatter { dim: D }
    }
    transition! {
        /// `Partial` → `Invariant` on axis `X`: all-reduce (Megatron's `g`). Backward: none
        /// (`Invariant` → `Replicate`).
        fn all_reduce / all_reduce_vjp (axis) where P: IsPartial => Invariant,
        StepKind::AllReduce
    }
    transition! {
        /// `Shard<A>` → `Shard<B>` on axis `X`: all-to-all. Backward: all-to-all back.
        fn all_to_all / all_to_all_vjp <const B: usize> (axis) where P: IsShard => Shard<B>,
        StepKind::AllToAll { from: <<L as Select<X, I>>::P as IsShard>::DIM, to: B }
    }
    transition! {
        /// `Replicate` or `Invariant` → `Shard<D>` on axis `X`: local slice, no collective.
        /// Backward: from `Invariant`, all-gather; from `Replicate`, zero padding to `Partial`.
        fn chunk / chunk_vjp <const D: usize> (axis) where P: IsWhole => Shard<D>,
        StepKind::Chunk { dim: D }
    }
    transition! {
        /// `Shard<D>` → `Partial<Sum>` on axis `X`: zero padding, no collective. Backward: chunk.
        fn pad_to_partial / pad_to_partial_vjp (axis) where P: IsShard => Partial<Sum>,
        StepKind::PadToPartial { dim: <<L as Select<X, I>>::P as IsShard>::DIM }
    }
    transition! {
        /// `Invariant` → `Replicate` on axis `X` (Megatron's `f`): no collective. Backward:
        /// all-reduce of the `Partial` gradient.
        fn to_replicate / to_replicate_vjp (axis) where P: IsInvariant => Replicate,
        StepKind::ToReplicate
    }
    transition! {
        /// `Replicate` → `Invariant` on axis `X`: no collective. Backward: `Invariant` →
        /// `Partial` (coordinate 0 keeps the gradient, the others zero).
        fn to_invariant / to_invariant_vjp (axis) where P: IsReplicate => Invariant,
        StepKind::ToInvariant
    }
    transition! {
        /// `Replicate` → `Partial<Sum>` on axis `X`: coordinate 0 keeps the value, the others
        /// hold zeros (exact for every dtype). Backward: the same conversion.
        fn replicate_to_partial / replicate_to_partial_vjp (axis) where P: IsReplicate => Partial<Sum>,
        StepKind::ToPartial { op: dtensor_placement::PartialOp::Sum }
    }
    transition! {
        /// `Invariant` → `Partial<Sum>` on axis `X`: coordinate 0 keeps the value. Backward:
        /// `Replicate` → `Invariant`.
        fn invariant_to_partial / invariant_to_partial_vjp (axis) where P: IsInvariant => Partial<Sum>,
        StepKind::ToPartial { op: dtensor_placement::PartialOp::Sum }
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`all_gather`](Self::all_gather) whose forward was started earlier from this value
    /// ([`DTensor::start_all_gather`], FSDP's prefetch): waits for it and records the same
    /// adjoint, a reduce-scatter. `Err` if the gather started from another value (another
    /// shape, dtype or placement).
    pub fn all_gather_prefetched<Out: Layout>(
        &self,
        pending: PendingAllGather<L, Out>,
    ) -> Result<Var<'t, Out>> {
        let (src, me) = (pending.source(), self.value().as_any());
        if src.global_shape() != me.global_shape()
            || src.local_shape() != me.local_shape()
            || src.dtype() != me.dtype()
        {
            return Err(crate::Error::InvalidUse {
                op: "Var::all_gather_prefetched",
                detail: format!(
                    "the gather started from a {:?} {} tensor, this value is {:?} {}",
                    src.global_shape(),
                    src.dtype(),
                    me.global_shape(),
                    me.dtype()
                ),
            });
        }
        self.transition(|_| pending.wait_vjp())
    }

    /// Records a move's adjoint as a collective node: it runs in every backward, with
    /// zeros when no gradient reached it, so every rank issues the same collectives.
    fn transition<Out: Layout>(
        &self,
        step: impl FnOnce(DTensor<L>) -> Result<(DTensor<Out>, Adjoint<Out, L>)>,
    ) -> Result<Var<'t, Out>> {
        let (y, adj) = step(self.value().clone())?;
        Ok(self.unary(y, true, move |dy| adj.backward(dy)))
    }
}

macro_rules! var_transition {
    ($(#[$doc:meta])* $name:ident / $vjp:ident $(<const $D:ident: usize>)? where P: $bound:path => $to:ty) => {
        $(#[$doc])*
        #[allow(clippy::type_complexity)]
        pub fn $name<X: MeshAxis, I $(, const $D: usize)?>(
            &self,
            axis: X,
        ) -> Result<Var<'t, <L as Select<X, I>>::With<$to>>>
        where
            L: Select<X, I>,
            <L as Select<X, I>>::P: $bound,
        {
            self.transition(|v| v.$vjp $(::<X, I, $D>)? (axis))
        }
    };
}

impl<'t, L: Layout> Var<'t, L> {
    var_transition! {
        /// [`DTensor::all_gather`]; backward: reduce-scatter.
        all_gather / all_gather_vjp where P: IsShard => Replicate
    }
    var_transition! {
        /// [`DTensor::all_gather_invariant`]; backward: local chunk.
        all_gather_invariant / all_gather_invariant_vjp where P: IsShard => Invariant
    }
    var_transition! {
        /// [`DTensor::reduce_scatter`]; backward: all-gather.
        reduce_scatter / reduce_scatter_vjp <const D: usize> where P: IsPartial => Shard<D>
    }
    var_transition! {
        /// [`DTensor::all_reduce`] (Megatron's `g`); backward: none.
        all_reduce / all_reduce_vjp where P: IsPartial => Invariant
    }
    var_transition! {
        /// [`DTensor::all_to_all`]; backward: all-to-all back.
        all_to_all / all_to_all_vjp <const B: usize> where P: IsShard => Shard<B>
    }
    var_transition! {
        /// [`DTensor::chunk`]; backward: all-gather (from `Invariant`) or zero padding.
        chunk / chunk_vjp <const D: usize> where P: IsWhole => Shard<D>
    }
    var_transition! {
        /// [`DTensor::to_replicate`] (Megatron's `f`); backward: all-reduce.
        to_replicate / to_replicate_vjp where P: IsInvariant => Replicate
    }
    var_transition! {
        /// [`DTensor::to_invariant`].
        to_invariant / to_invariant_vjp where P: IsReplicate => Invariant
    }
    var_transition! {
        /// [`DTensor::replicate_to_partial`].
        replicate_to_partial / replicate_to_partial_vjp where P: IsReplicate => Partial<Sum>
    }
    var_transition! {
        /// [`DTensor::invariant_to_partial`].
        invariant_to_partial / invariant_to_partial_vjp where P: IsInvariant => Partial<Sum>
    }
    var_transition! {
        /// [`DTensor::pad_to_partial`].
        pad_to_partial / pad_to_partial_vjp where P: IsShard => Partial<Sum>
    }
}
