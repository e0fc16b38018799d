//! Placements: how a tensor lives on one mesh axis. Type-level markers (`Shard<D>`,
//! `Replicate`, `Invariant`, `Partial<Op>`) and their run-time mirror [`Placement`].
//!
//! | placement | meaning on that axis | gradient placement (dual) |
//! |---|---|---|
//! | `Shard<D>` | each rank holds one chunk of tensor dim `D` | `Shard<D>` |
//! | `Replicate` | same value everywhere; consumers differ per rank | `Partial` |
//! | `Invariant` | same value everywhere; consumed identically on every rank | `Invariant` |
//! | `Partial<Op>` | each rank holds a term; the value is their reduction | `Replicate` |
//! | `Ragged<B>` | each rank holds a data-dependent number of rows of dim 0 (MoE tokens dispatched by routing `B`); the value is the concatenation of the ranks' rows | `Ragged<B>` |
//!
//! `Ragged` is the one placement whose local extent is *data, not type*: how many rows a
//! rank holds comes from a routing (the counts its all-to-all exchanged), not from the
//! global shape. A ragged tensor records this rank's row count as its global extent of
//! dim 0 (nothing else may shard dim 0 then), it has no redistribution plan (it leaves the
//! ragged world only through the op that made it: an MoE combine), and its brand `B` ties
//! it to the routing that dispatched it, so a combine by another routing does not compile.

use std::fmt;
use std::marker::PhantomData;

/// How the terms of a `Partial` axis combine, at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PartialOp {
    /// The value is the sum of the ranks' terms.
    Sum,
    /// The value is the mean of the ranks' terms (their sum divided by the axis size).
    Avg,
    /// The value is the element-wise largest of the ranks' terms.
    Max,
    /// The value is the element-wise smallest of the ranks' terms.
    Min,
}

impl PartialOp {
    /// Lower-case name, as printed in `P(sum)`: `"sum"`, `"avg"`, `"max"` or `"min"`.
    pub fn name(self) -> &'static str {
        match self {
            PartialOp::Sum => "sum",
            PartialOp::Avg => "avg",
            PartialOp::Max => "max",
            PartialOp::Min => "min",
        }
    }
    /// Sum and Avg are linear: adding or scaling partial terms is exact algebra.
    pub fn is_linear(self) -> bool {
        matches!(self, PartialOp::Sum | PartialOp::Avg)
    }
}

/// A placement on one mesh axis, at run time. Prints as `S(1)`, `R`, `I`, `P(sum)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Each rank holds one `torch.chunk` piece of this tensor dim (see [`Shard`]).
    Shard(usize),
    /// Same value on every rank; consumers differ per rank, so its gradient is `Partial`.
    Replicate,
    /// Same value on every rank, consumed identically everywhere; its gradient is
    /// `Invariant` too.
    Invariant,
    /// Each rank holds a term; the value is their reduction by this op.
    Partial(PartialOp),
    /// Dim 0 holds a data-dependent number of rows on each rank (see the module docs).
    Ragged,
}

impl Placement {
    /// Whether this is `Shard` of some dim.
    pub fn is_shard(self) -> bool {
        matches!(self, Placement::Shard(_))
    }
    /// Whether this is `Partial` with any reduction op.
    pub fn is_partial(self) -> bool {
        matches!(self, Placement::Partial(_))
    }
    /// The tensor dim this placement shards, if any.
    pub fn shard_dim(self) -> Option<usize> {
        match self {
            Placement::Shard(d) => Some(d),
            _ => None,
        }
    }
    /// The gradient's placement (see the module table).
    pub fn dual(self) -> Placement {
        match self {
            Placement::Shard(d) => Placement::Shard(d),
            Placement::Replicate => Placement::Partial(PartialOp::Sum),
            Placement::Invariant => Placement::Invariant,
            Placement::Partial(_) => Placement::Replicate,
            Placement::Ragged => Placement::Ragged,
        }
    }
    /// Whether dim 0's local extent is data (an MoE dispatch's rows), not layout arithmetic.
    pub fn is_ragged(self) -> bool {
        matches!(self, Placement::Ragged)
    }
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "S({d})"),
            Placement::Replicate => f.write_str("R"),
            Placement::Invariant => f.write_str("I"),
            Placement::Partial(op) => write!(f, "P({})", op.name()),
            Placement::Ragged => f.write_str("Rg"),
        }
    }
}

/// Each rank holds chunk `rank` of tensor dim `D` (`torch.chunk` semantics when uneven).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Shard<const D: usize>;
/// The same value on every rank of the axis, consumed differently per rank; its gradient
/// arrives `Partial` and must be reduced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Replicate;
/// The same value on every rank of the axis, consumed identically everywhere; its gradient
/// is `Invariant` too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Invariant;
/// Each rank holds a term; the tensor is the reduction (`Op`) of the terms.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Partial<Op = Sum>(PhantomData<Op>);
impl<Op> Clone for Partial<Op> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<Op> Copy for Partial<Op> {}

/// A routing brand: any zero-sized marker type (`struct Moe0;`) that names which routing
/// dispatched a [`Ragged`] tensor. `()` is the default brand.
pub trait Brand: Copy + Default + fmt::Debug + Send + Sync + 'static {}
impl<B: Copy + Default + fmt::Debug + Send + Sync + 'static> Brand for B {}

/// Each rank holds a data-dependent number of rows of dim 0: tokens an MoE dispatch sent
/// to this rank's experts, grouped by local expert, by the routing branded `B`. The value
/// is the concatenation of every rank's rows; the counts live in the routing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ragged<B: Brand = ()>(PhantomData<B>);

/// `Partial` terms add up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sum;
/// `Partial` terms average.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Avg;
/// The largest `Partial` term wins.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Max;
/// The smallest `Partial` term wins.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Min;

/// A reduction marker for `Partial<Op>`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a reduction for `Partial`",
    label = "use `Sum`, `Avg`, `Max` or `Min`"
)]
pub trait ReduceMarker: Copy + Default + fmt::Debug + Send + Sync + 'static {
    /// The reduction at run time.
    const OP: PartialOp;
}
impl ReduceMarker for Sum {
    const OP: PartialOp = PartialOp::Sum;
}
impl ReduceMarker for Avg {
    const OP: PartialOp = PartialOp::Avg;
}
impl ReduceMarker for Max {
    const OP: PartialOp = PartialOp::Max;
}
impl ReduceMarker for Min {
    const OP: PartialOp = PartialOp::Min;
}

/// A type-level placement on one mesh axis.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a placement",
    label = "expected `Shard<D>`, `Replicate`, `Invariant` or `Partial<Op>`"
)]
pub trait PlacementType: Copy + Default + fmt::Debug + Send + Sync + 'static {
    /// This placement at run time.
    const PLACEMENT: Placement;
    /// The gradient's placement (dual).
    type Grad: PlacementType;
}
impl<const D: usize> PlacementType for Shard<D> {
    const PLACEMENT: Placement = Placement::Shard(D);
    type Grad = Shard<D>;
}
impl PlacementType for Replicate {
    const PLACEMENT: Placement = Placement::Replicate;
    type Grad = Partial<Sum>;
}
impl PlacementType for Invariant {
    const PLACEMENT: Placement = Placement::Invariant;
    type Grad = Invariant;
}
impl<Op: ReduceMarker> PlacementType for Partial<Op> {
    const PLACEMENT: Placement = Placement::Partial(Op::OP);
    type Grad = Replicate;
}
impl<B: Brand> PlacementType for Ragged<B> {
    const PLACEMENT: Placement = Placement::Ragged;
    /// The gradient of a row is a row of the same rank: ragged by the same routing.
    type Grad = Ragged<B>;
}

// ---- capability traits: one per precondition, each with its own compile error ----

/// An axis that is sharded: what `all_gather`, `all_gather_invariant` and `all_to_all` take.
#[diagnostic::on_unimplemented(
    message = "this mesh axis is `{Self}`, not `Shard<D>`: all_gather / all_to_all need a sharded axis",
    label = "the axis must be `Shard<D>` here",
    note = "a `Replicate` or `Invariant` axis already holds the whole tensor; a `Partial` axis must be reduced (all_reduce / reduce_scatter)"
)]
pub trait IsShard: PlacementType {
    /// The tensor dim that is sharded (`D` of `Shard<D>`).
    const DIM: usize;
}
impl<const D: usize> IsShard for Shard<D> {
    const DIM: usize = D;
}

/// An axis holding pending partial terms: what `all_reduce` and `reduce_scatter` take.
#[diagnostic::on_unimplemented(
    message = "this mesh axis is `{Self}`, not `Partial`: all_reduce / reduce_scatter reduce pending partial terms",
    label = "the axis must be `Partial<Op>` here",
    note = "only a `Partial` axis holds terms to reduce; a `Shard` axis moves with all_gather or all_to_all (an MoE expert weight's gradient is `Shard<0>` over Ep and already whole on the expert's owner: reduce it over the data axes only)"
)]
pub trait IsPartial: PlacementType {
    /// How the pending terms combine (`Sum`, `Avg`, `Max`, `Min`).
    type Op: ReduceMarker;
}
impl<Op: ReduceMarker> IsPartial for Partial<Op> {
    type Op = Op;
}

/// An `Invariant` axis: what `to_replicate` (Megatron's `f`) takes.
#[diagnostic::on_unimplemented(
    message = "this mesh axis is `{Self}`, not `Invariant`: to_replicate / invariant_to_partial start from `Invariant`",
    label = "the axis must be `Invariant` here"
)]
pub trait IsInvariant: PlacementType {}
impl IsInvariant for Invariant {}

/// A `Replicate` axis: what `to_invariant` and `replicate_to_partial` take.
#[diagnostic::on_unimplemented(
    message = "this mesh axis is `{Self}`, not `Replicate`: to_invariant / replicate_to_partial start from `Replicate`",
    label = "the axis must be `Replicate` here"
)]
pub trait IsReplicate: PlacementType {}
impl IsReplicate for Replicate {}

/// An axis holding the whole tensor (`Replicate` or `Invariant`): what `chunk` slices.
#[diagnostic::on_unimplemented(
    message = "this mesh axis is `{Self}`: chunk slices a `Replicate` or `Invariant` axis, which holds the whole tensor",
    label = "the axis must be `Replicate` or `Invariant` here",
    note = "a `Shard` axis changes dim with all_to_all; a `Partial` axis reaches `Shard` with reduce_scatter"
)]
pub trait IsWhole: PlacementType {}
impl IsWhole for Replicate {}
impl IsWhole for Invariant {}

/// An axis a non-linear op (gelu, softmax, norm, elementwise product) may read.
#[diagnostic::on_unimplemented(
    message = "`{Self}` holds pending partial sums; reduce it (all_reduce / reduce_scatter) before a non-linear op",
    label = "this axis is still `Partial`",
    note = "f(a) + f(b) is not f(a + b): a non-linear op on partial terms computes the wrong value"
)]
pub trait Pointwise: PlacementType {}
impl<const D: usize> Pointwise for Shard<D> {}
impl Pointwise for Replicate {}
impl Pointwise for Invariant {}
impl<B: Brand> Pointwise for Ragged<B> {}

/// An axis a linear op (scale, negate) may read: anything but `Partial<Max>`/`Partial<Min>`.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is a max/min partial: scaling its terms does not scale the reduced value; reduce it first",
    label = "this axis is `Partial<Max>` or `Partial<Min>`"
)]
pub trait Linear: PlacementType {}
impl<const D: usize> Linear for Shard<D> {}
impl Linear for Replicate {}
impl Linear for Invariant {}
impl Linear for Partial<Sum> {}
impl Linear for Partial<Avg> {}
impl<B: Brand> Linear for Ragged<B> {}

/// The right operand's placement `Self` added to a left operand's `Lhs` on one mesh axis:
/// the placements must be equal, and a `Partial` must be a linear one. (Implemented on the
/// right operand so the compiler reads the operand's type instead of guessing it from the
/// one impl that fits.)
#[diagnostic::on_unimplemented(
    message = "cannot add a `{Self}` operand to a `{Lhs}` operand on the same mesh axis",
    label = "placements differ on a mesh axis",
    note = "operands must have the same placement on every axis; `Partial` adds only to `Partial` (adding a `Replicate` value to partial terms counts it once per rank): reduce the partial, or convert the other side with replicate_to_partial"
)]
pub trait AddPlacement<Lhs>: PlacementType {}
impl<const D: usize> AddPlacement<Shard<D>> for Shard<D> {}
impl AddPlacement<Replicate> for Replicate {}
impl AddPlacement<Invariant> for Invariant {}
impl AddPlacement<Partial<Sum>> for Partial<Sum> {}
impl AddPlacement<Partial<Avg>> for Partial<Avg> {}
impl<B: Brand> AddPlacement<Ragged<B>> for Ragged<B> {}

/// A placement a redistribution plan can start from: every one but [`Ragged`] (whose row
/// counts are data: it leaves the ragged world only through an MoE combine).
pub trait Plannable: PlacementType {}
impl<const D: usize> Plannable for Shard<D> {}
impl Plannable for Replicate {}
impl Plannable for Invariant {}
impl<Op: ReduceMarker> Plannable for Partial<Op> {}

/// A placement `redistribute` can reach from `Self` in one plan (any target but a
/// `Partial` of another reduction).
#[diagnostic::on_unimplemented(
    message = "no redistribution turns `{Self}` into `{Target}` on a mesh axis",
    label = "unreachable placement change",
    note = "a `Partial` keeps its reduction op; reduce it (all_reduce / reduce_scatter) to leave `Partial`; a `Ragged` axis has no plan (combine it back with the routing that dispatched it)"
)]
pub trait RedistributeTo<Target>: PlacementType {}
impl<P: Plannable, const D: usize> RedistributeTo<Shard<D>> for P {}
impl<P: Plannable> RedistributeTo<Replicate> for P {}
impl<P: Plannable> RedistributeTo<Invariant> for P {}
impl<Op: ReduceMarker> RedistributeTo<Partial<Op>> for Partial<Op> {}
impl<Op: ReduceMarker> RedistributeTo<Partial<Op>> for Replicate {}
impl<Op: ReduceMarker> RedistributeTo<Partial<Op>> for Invariant {}
impl<Op: ReduceMarker, const D: usize> RedistributeTo<Partial<Op>> for Shard<D> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runtime_mirror_prints_short_forms() {
        assert_eq!(Shard::<1>::PLACEMENT.to_string(), "S(1)");
        assert_eq!(Replicate::PLACEMENT.to_string(), "R");
        assert_eq!(Invariant::PLACEMENT.to_string(), "I");
        assert_eq!(Partial::<Sum>::PLACEMENT.to_string(), "P(sum)");
        assert_eq!(Partial::<Max>::PLACEMENT.to_string(), "P(max)");
    }

    #[test]
    fn duals_match_the_table() {
        fn dual<P: PlacementType>() -> Placement {
            <P::Grad as PlacementType>::PLACEMENT
        }
        assert_eq!(dual::<Shard<2>>(), Placement::Shard(2));
        assert_eq!(dual::<Replicate>(), Placement::Partial(PartialOp::Sum));
        assert_eq!(dual::<Invariant>(), Placement::Invariant);
        assert_eq!(dual::<Partial>(), Placement::Replicate);
        for p in [
            Placement::Shard(0),
            Placement::Replicate,
            Placement::Invariant,
            Placement::Partial(PartialOp::Sum),
        ] {
            assert_eq!(p.dual().dual(), p);
        }
    }
}
