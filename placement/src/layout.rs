//! Layouts: one placement per mesh axis, as a type-level list
//! `(On<Dp, Replicate>, (On<Tp, Shard<0>>, ()))`, written with [`layout!`](crate::layout!).
//!
//! A method that changes one axis finds it with [`Select`]: the axis is named by a value
//! (`x.all_gather(Tp)`) and its position is *inferred* through the `Here` / `There<I>`
//! index, so the same impls serve every mesh, whatever its number of axes, without overlapping.

use crate::axis::{AxisKind, MeshAxis};
use crate::placement::{AddPlacement, Linear, Placement, PlacementType, Pointwise, RedistributeTo};
use smallvec::SmallVec;
use std::marker::PhantomData;

/// Placement `P` on mesh axis `X`: one entry of a layout.
pub struct On<X, P>(PhantomData<(X, P)>);

/// Index: the axis is the head of the list.
pub struct Here;
/// Index: the axis is in the tail, at `I`.
pub struct There<I>(PhantomData<I>);

/// The placements of a tensor on each mesh axis, in mesh (layout) order.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a layout",
    label = "expected a layout such as `layout![Dp: Replicate, Tp: Shard<0>]`"
)]
pub trait Layout: Send + Sync + 'static {
    /// Number of mesh axes.
    const NDIM: usize;
    /// The gradient's layout: the dual placement on every axis.
    type Grad: Layout;
    /// Axis kinds and placements in order.
    fn entries() -> SmallVec<[(AxisKind, Placement); 4]>;
    /// Just the placements, in order.
    fn placements() -> SmallVec<[Placement; 4]> {
        Self::entries().into_iter().map(|(_, p)| p).collect()
    }
    /// Just the axes, in order.
    fn axes() -> SmallVec<[AxisKind; 4]> {
        Self::entries().into_iter().map(|(a, _)| a).collect()
    }
}

impl Layout for () {
    const NDIM: usize = 0;
    type Grad = ();
    fn entries() -> SmallVec<[(AxisKind, Placement); 4]> {
        SmallVec::new()
    }
}

impl<X: MeshAxis, P: PlacementType, R: Layout> Layout for (On<X, P>, R) {
    const NDIM: usize = 1 + R::NDIM;
    type Grad = (On<X, P::Grad>, R::Grad);
    fn entries() -> SmallVec<[(AxisKind, Placement); 4]> {
        let mut v = SmallVec::new();
        v.push((X::KIND, P::PLACEMENT));
        v.extend(R::entries());
        v
    }
}

/// Axis `X` of a layout, found at index `I` (inferred): its placement `P`, and the layout
/// with that placement replaced by `Q`.
#[diagnostic::on_unimplemented(
    message = "this DTensor's layout has no mesh axis `{X}`",
    label = "axis `{X}` is not in the layout",
    note = "the layout is `{Self}`; name an axis it has (a method changes one axis of the tensor's own mesh)"
)]
pub trait Select<X, I> {
    /// The placement on axis `X`.
    type P: PlacementType;
    /// This layout with the placement on axis `X` replaced by `Q`, every other axis as is:
    /// the output layout of a one-axis transition.
    type With<Q: PlacementType>: Layout;
}

impl<X: MeshAxis, P: PlacementType, R: Layout> Select<X, Here> for (On<X, P>, R) {
    type P = P;
    type With<Q: PlacementType> = (On<X, Q>, R);
}

impl<X, Y: MeshAxis, H: PlacementType, R, I> Select<X, There<I>> for (On<Y, H>, R)
where
    R: Select<X, I> + Layout,
{
    type P = R::P;
    type With<Q: PlacementType> = (On<Y, H>, R::With<Q>);
}

/// Every axis may feed a non-linear op (no `Partial`).
#[diagnostic::on_unimplemented(
    message = "layout `{Self}` has a `Partial` axis: reduce it before a non-linear op",
    label = "pending partial sums reach a non-linear op"
)]
pub trait PointwiseLayout: Layout {}
impl PointwiseLayout for () {}
impl<X: MeshAxis, P: Pointwise, R: PointwiseLayout> PointwiseLayout for (On<X, P>, R) {}

/// Every axis may feed a linear op (no max/min `Partial`).
#[diagnostic::on_unimplemented(
    message = "layout `{Self}` has a max/min `Partial` axis: reduce it before scaling",
    label = "max/min partial terms do not scale linearly"
)]
pub trait LinearLayout: Layout {}
impl LinearLayout for () {}
impl<X: MeshAxis, P: Linear, R: LinearLayout> LinearLayout for (On<X, P>, R) {}

/// A right operand laid out as `Self` that may be added to a left operand laid out as
/// `Lhs`: same axes in the same order, and on each axis placements that add (see
/// [`AddPlacement`]).
#[diagnostic::on_unimplemented(
    message = "cannot add a DTensor laid out as `{Self}` to one laid out as `{Lhs}`",
    label = "the layouts differ",
    note = "both operands need the same mesh axes in the same order and the same placement on each; redistribute one of them explicitly"
)]
pub trait AddLayout<Lhs>: Layout {}
impl AddLayout<()> for () {}
impl<X: MeshAxis, P, Q, R, S> AddLayout<(On<X, P>, R)> for (On<X, Q>, S)
where
    Q: AddPlacement<P>,
    P: PlacementType,
    S: AddLayout<R>,
    R: Layout,
{
}

/// Layouts over the same mesh axes, in the same order, with every axis reachable by a
/// redistribution plan (see [`RedistributeTo`]).
#[diagnostic::on_unimplemented(
    message = "cannot redistribute a DTensor laid out as `{Self}` into `{Target}`",
    label = "layouts over different mesh axes, or an unreachable placement",
    note = "a redistribution keeps the mesh axes and their order; it changes placements only"
)]
pub trait RedistributeLayout<Target>: Layout {}
impl RedistributeLayout<()> for () {}
impl<X: MeshAxis, P, Q, R, S> RedistributeLayout<(On<X, Q>, S)> for (On<X, P>, R)
where
    P: RedistributeTo<Q>,
    Q: PlacementType,
    R: RedistributeLayout<S>,
    S: Layout,
{
}

/// Builds a layout type: `layout![Dp: Replicate, Tp: Shard<0>]`.
#[macro_export]
macro_rules! layout {
    () => { () };
    ($axis:ty : $p:ty $(, $raxis:ty : $rp:ty)* $(,)?) => {
        ($crate::On<$axis, $p>, $crate::layout![$($raxis : $rp),*])
    };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::axis::{Dp, Tp};
    use crate::placement::{Partial, Replicate, Shard};

    type L = layout![Dp: Replicate, Tp: Shard<1>];

    fn placement_of<Lay: Select<X, I>, X, I>(_: X) -> Placement {
        <Lay::P as PlacementType>::PLACEMENT
    }

    #[test]
    fn entries_list_axes_in_order() {
        assert_eq!(L::NDIM, 2);
        assert_eq!(
            L::entries().as_slice(),
            &[
                (AxisKind::Dp, Placement::Replicate),
                (AxisKind::Tp, Placement::Shard(1))
            ]
        );
        assert_eq!(
            <L as Layout>::Grad::placements().as_slice(),
            &[
                Placement::Partial(crate::PartialOp::Sum),
                Placement::Shard(1)
            ]
        );
    }

    #[test]
    fn select_finds_an_axis_by_name() {
        assert_eq!(placement_of::<L, _, _>(Tp), Placement::Shard(1));
        assert_eq!(placement_of::<L, _, _>(Dp), Placement::Replicate);
        type W = <L as Select<Tp, There<Here>>>::With<Partial>;
        assert_eq!(
            W::placements().as_slice(),
            &[
                Placement::Replicate,
                Placement::Partial(crate::PartialOp::Sum)
            ]
        );
    }
}
