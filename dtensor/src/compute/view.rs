//! View and data ops: `narrow`, `cat`, `swap_dims`, `repeat_interleave`, `select` (where),
//! `masked_fill` and `gather_rows`, with their tape twins and the placement rules they
//! alone use.
//!
//! None of them moves data between ranks, and none redistributes implicitly: an op whose
//! result a rank could not compute from its own piece does not compile (the type shows the
//! dim is sharded), or returns an `Err` when only the sizes show it.
//!
//! | op | per axis (→ out) | refused | backward |
//! |---|---|---|---|
//! | [`narrow::<D>`](DTensor::narrow) (global `start`, `len`) | [`NarrowRule<D>`]: R, I, `P`, `S<e≠D>`, `Rg` (D ≥ 1) stay | `S<D>`: no rule | the gradient zero-padded back |
//! | [`cat::<D>`](DTensor::cat) (parts of one layout) | [`NarrowRule<D>`], as `narrow` | `S<D>`: no rule | the gradient narrowed per part |
//! | [`swap_dims::<A, B>`](DTensor::swap_dims) (A < B) | [`SwapDimsRule<A, B>`]: `S<A>`↔`S<B>`; other shards, R, I, `P`, `Rg` (A ≥ 1) stay | A ≥ B, `Rg` at A = 0 | the gradient's dims swapped back |
//! | [`repeat_interleave::<D>`](DTensor::repeat_interleave) | [`RepeatRule<D>`]: every placement stays (`S<D>` needs even shards: checked) | `Rg` at D = 0 | the sum over the copies |
//! | [`select`](DTensor::select) (torch's `where`), [`masked_fill`](DTensor::masked_fill) (values, mask) | [`WhereRule<M>`]: (`S<d>`, `S<d>`), (R or I, R or I), (`P<Sum>`/`P<Avg>`, R or I; `select` only), (`Rg`, `Rg`) | any other mask, `P` for `masked_fill` | the gradient where the value was taken, zero elsewhere |
//! | [`gather_rows`](DTensor::gather_rows) (table `[n, …]`, ids `[k]`) | [`GatherRule<T>`]: (R, S0)→S0, (R, R or I)→R, (I, I)→I, (P, R or I)→P, (`S<e≥1>`, R or I)→`S<e>` | a table split over its rows | scatter-add of the gradient rows ([`ScatterRule`]) |
//!
//! Why `narrow` and `cat` refuse a sharded dim instead of gathering it (PyTorch's DTensor
//! redistributes there): a rank holds one chunk of the dim, and the rows a narrow keeps, or
//! the boundary a concatenation moves, cut across chunks, so the result's `torch.chunk`
//! pieces are not pieces any rank holds. Gather the dim first (`all_gather`), or move the
//! shard to another dim (`all_to_all`): the cost is then in the program, where it is seen.
//! A repeat of each slice in place (`repeat_interleave`) maps a rank's chunk to its chunk of
//! the result exactly when the dim splits evenly over its ranks: the GQA use (each KV head
//! repeated for the query heads of its group, heads sharded over `Tp`) is that case.
//!
//! Each rule closes under duality, checked when this crate builds (the `…Closed` traits
//! below): the backward of every accepted placement is again an accepted placement and
//! gives the input's dual, so the tape can type every gradient as `L::Grad`.
//!
//! Every op runs where its tensors are, through the kernels' front doors (`Tensor::narrow`,
//! `cat`, `write_at`, `ops::gather_rows`, `scatter_add_rows`, `sum_dim`): bit for bit on the
//! host and on a GPU. Masks and ids are read on the host (a device mask is copied there):
//! they pick rows, which the gathers take as host index lists.

use super::{check_dim, describe, output, same_mesh, shape_err, shard_parts};
use crate::any::AnyDTensor;
use crate::error::{Error, Result};
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::{ops, Tensor};
use dtensor_placement::{
    Brand, GradOf, Invariant, Layout, MeshAxis, On, Partial, PlacementType, PointwiseLayout,
    Ragged, ReduceMarker, Replicate, Shard, Sum,
};

type R = Replicate;
type I = Invariant;
type P = Partial<Sum>;
type PAvg = Partial<dtensor_placement::Avg>;
type S<const D: usize> = Shard<D>;

// ---------------------------------------------------------------------------------------
// narrow and cat: dim D whole on every axis
// ---------------------------------------------------------------------------------------

/// An axis on which every rank holds dim `D` whole, so cutting rows out of it
/// (`narrow`) or joining tensors along it (`cat`) is the same local op on every rank.
/// Pending terms (`Partial`) are fine: both ops are linear and exact per term.
#[diagnostic::on_unimplemented(
    message = "`{Self}` splits dim {D}, which narrow and cat cut or join on every rank alike",
    label = "this axis shards the dim being narrowed or concatenated",
    note = "per axis: Replicate, Invariant, Partial and Shard<e> with e ≠ {D} keep their placement; a shard of dim {D} holds one chunk, and the rows kept (or the joins) cut across chunks: gather the dim first (all_gather) or move the shard to another dim (all_to_all)"
)]
pub trait NarrowRule<const D: usize>: PlacementType {}
impl<const D: usize> NarrowRule<D> for R {}
impl<const D: usize> NarrowRule<D> for I {}
impl<const D: usize, Op: ReduceMarker> NarrowRule<D> for Partial<Op> {}

/// `$rule<d>` for every shard of another dim than `d` (tensors of up to 4 dims), and for
/// ragged rows when `d ≥ 1` (the op leaves dim 0, the ragged one, alone).
macro_rules! other_dims {
    ($rule:ident: $($d:literal: [$($e:literal),*]);*) => {$(
        $(impl $rule<$d> for S<$e> {})*
    )*};
}
other_dims!(NarrowRule: 0: [1, 2, 3]; 1: [0, 2, 3]; 2: [0, 1, 3]; 3: [0, 1, 2]);
impl<B: Brand> NarrowRule<1> for Ragged<B> {}
impl<B: Brand> NarrowRule<2> for Ragged<B> {}
impl<B: Brand> NarrowRule<3> for Ragged<B> {}

/// Every axis holds dim `D` whole (see [`NarrowRule`]); the result keeps the layout.
pub trait NarrowLayout<const D: usize>: Layout {}
impl<const D: usize> NarrowLayout<D> for () {}
impl<X: MeshAxis, Q: NarrowRule<D>, Rest: NarrowLayout<D>, const D: usize> NarrowLayout<D>
    for (On<X, Q>, Rest)
{
}

/// Closure of `narrow` and `cat`: their backwards (zero-padding the gradient back, and
/// narrowing it per part) are again narrows and pads along `D` of the gradient, placed as
/// the input's dual, which must hold `D` whole too.
pub trait NarrowClosed<const D: usize>: NarrowRule<D> {}
impl<const D: usize, X> NarrowClosed<D> for X
where
    X: NarrowRule<D>,
    GradOf<X>: NarrowRule<D>,
{
}
#[allow(dead_code)]
fn narrow_rules_close() {
    type Rg = Ragged<()>;
    fn closed<const D: usize, X: NarrowClosed<D>>() {}
    macro_rules! every {
        ($($d:literal: [$($e:literal),*]);*) => {$(
            closed::<$d, R>();
            closed::<$d, I>();
            closed::<$d, P>();
            closed::<$d, PAvg>();
            closed::<$d, Partial<dtensor_placement::Max>>();
            $(closed::<$d, S<$e>>();)*
        )*};
    }
    every!(0: [1, 2, 3]; 1: [0, 2, 3]; 2: [0, 1, 3]; 3: [0, 1, 2]);
    closed::<1, Rg>();
    closed::<3, Rg>();
}

// ---------------------------------------------------------------------------------------
// swap_dims: Shard indices move with the dims
// ---------------------------------------------------------------------------------------

/// Swapping tensor dims `A < B` on one axis: `Shard<A>` and `Shard<B>` trade places (a
/// rank's chunk moves with its dim), every other placement stays.
#[diagnostic::on_unimplemented(
    message = "no rule for swapping dims {A} and {B} of a `{Self}` axis",
    label = "swap_dims takes two dims A < B of a tensor of at most 4 dims",
    note = "per axis: Shard<{A}> and Shard<{B}> trade places; other shards, Replicate, Invariant and Partial stay; Ragged rows stay when A ≥ 1 (their dim 0 cannot move). Write the smaller dim first"
)]
pub trait SwapDimsRule<const A: usize, const B: usize>: PlacementType {
    /// The placement on this axis once the dims are swapped.
    type Out: PlacementType;
}

macro_rules! swap_table {
    ($(($a:literal, $b:literal): [$($e:literal => $o:literal),*]);*) => {$(
        impl SwapDimsRule<$a, $b> for R { type Out = R; }
        impl SwapDimsRule<$a, $b> for I { type Out = I; }
        impl<Op: ReduceMarker> SwapDimsRule<$a, $b> for Partial<Op> { type Out = Partial<Op>; }
        $(impl SwapDimsRule<$a, $b> for S<$e> { type Out = S<$o>; })*
    )*};
}
swap_table!(
    (0, 1): [0 => 1, 1 => 0, 2 => 2, 3 => 3];
    (0, 2): [0 => 2, 1 => 1, 2 => 0, 3 => 3];
    (0, 3): [0 => 3, 1 => 1, 2 => 2, 3 => 0];
    (1, 2): [0 => 0, 1 => 2, 2 => 1, 3 => 3];
    (1, 3): [0 => 0, 1 => 3, 2 => 2, 3 => 1];
    (2, 3): [0 => 0, 1 => 1, 2 => 3, 3 => 2]
);
macro_rules! swap_ragged {
    ($(($a:literal, $b:literal)),*) => {$(
        impl<Bd: Brand> SwapDimsRule<$a, $b> for Ragged<Bd> { type Out = Ragged<Bd>; }
    )*};
}
swap_ragged!((1, 2), (1, 3), (2, 3));

/// Dims `A < B` swapped, every axis (see [`SwapDimsRule`]).
pub trait SwapDimsLayout<const A: usize, const B: usize>: Layout {
    /// The layout with the dims swapped: each axis as [`SwapDimsRule`] places it.
    type Out: Layout;
}
impl<const A: usize, const B: usize> SwapDimsLayout<A, B> for () {
    type Out = ();
}
impl<
        X: MeshAxis,
        Q: SwapDimsRule<A, B>,
        Rest: SwapDimsLayout<A, B>,
        const A: usize,
        const B: usize,
    > SwapDimsLayout<A, B> for (On<X, Q>, Rest)
{
    type Out = (On<X, Q::Out>, Rest::Out);
}
/// The layout of a tensor with dims `A` and `B` swapped.
pub type SwappedDims<L, const A: usize, const B: usize> = <L as SwapDimsLayout<A, B>>::Out;

/// Closure of `swap_dims`: the backward swaps the gradient's dims back, which takes the
/// output's dual to the input's.
pub trait SwapDimsClosed<const A: usize, const B: usize>: SwapDimsRule<A, B> {}
impl<const A: usize, const B: usize, X> SwapDimsClosed<A, B> for X
where
    X: SwapDimsRule<A, B>,
    GradOf<<X as SwapDimsRule<A, B>>::Out>: SwapDimsRule<A, B, Out = GradOf<X>>,
{
}
#[allow(dead_code)]
fn swap_dims_rules_close() {
    type Rg = Ragged<()>;
    fn closed<const A: usize, const B: usize, X: SwapDimsClosed<A, B>>() {}
    macro_rules! every {
        ($(($a:literal, $b:literal)),*) => {$(
            closed::<$a, $b, R>();
            closed::<$a, $b, I>();
            closed::<$a, $b, P>();
            closed::<$a, $b, PAvg>();
            closed::<$a, $b, S<0>>();
            closed::<$a, $b, S<1>>();
            closed::<$a, $b, S<2>>();
            closed::<$a, $b, S<3>>();
        )*};
    }
    every!((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3));
    closed::<1, 2, Rg>();
    closed::<2, 3, Rg>();
}

// ---------------------------------------------------------------------------------------
// repeat_interleave: every placement, even shards of the repeated dim
// ---------------------------------------------------------------------------------------

/// Repeating every slice of dim `D` in place on one axis. Linear and local: every
/// placement stays, a shard of `D` included when the dim splits evenly over its ranks
/// (each rank's chunk, repeated, is then its chunk of the result: checked when it runs).
#[diagnostic::on_unimplemented(
    message = "no rule for repeating dim {D} of a `{Self}` axis",
    label = "ragged rows (dim 0 of an MoE dispatch) have data-dependent counts per rank",
    note = "per axis: Shard<e> (Shard<{D}> with even shards), Replicate, Invariant and Partial stay; Ragged rows stay when D ≥ 1"
)]
pub trait RepeatRule<const D: usize>: PlacementType {}
impl<const D: usize, const E: usize> RepeatRule<D> for S<E> {}
impl<const D: usize> RepeatRule<D> for R {}
impl<const D: usize> RepeatRule<D> for I {}
impl<const D: usize, Op: ReduceMarker> RepeatRule<D> for Partial<Op> {}
impl<B: Brand> RepeatRule<1> for Ragged<B> {}
impl<B: Brand> RepeatRule<2> for Ragged<B> {}
impl<B: Brand> RepeatRule<3> for Ragged<B> {}

/// Dim `D` may be repeated on every axis (see [`RepeatRule`]); the result keeps the layout.
pub trait RepeatLayout<const D: usize>: Layout {}
impl<const D: usize> RepeatLayout<D> for () {}
impl<X: MeshAxis, Q: RepeatRule<D>, Rest: RepeatLayout<D>, const D: usize> RepeatLayout<D>
    for (On<X, Q>, Rest)
{
}

/// Closure of `repeat_interleave`: the backward sums the gradient over the copies (a
/// local reduction of the repeated dim, back to the input's extent), placed as the input's
/// dual, which must be repeatable too.
pub trait RepeatClosed<const D: usize>: RepeatRule<D> {}
impl<const D: usize, X> RepeatClosed<D> for X
where
    X: RepeatRule<D>,
    GradOf<X>: RepeatRule<D>,
{
}
#[allow(dead_code)]
fn repeat_rules_close() {
    fn closed<const D: usize, X: RepeatClosed<D>>() {}
    macro_rules! every {
        ($($d:literal),*) => {$(
            closed::<$d, R>();
            closed::<$d, I>();
            closed::<$d, P>();
            closed::<$d, PAvg>();
            closed::<$d, S<0>>();
            closed::<$d, S<1>>();
            closed::<$d, S<2>>();
            closed::<$d, S<3>>();
        )*};
    }
    every!(0, 1, 2, 3);
    closed::<1, Ragged<()>>();
}

// ---------------------------------------------------------------------------------------
// select (where) and masked_fill: the mask beside the values
// ---------------------------------------------------------------------------------------

/// Values placed `Self` read element by element beside a mask placed `M`, on one axis:
/// each rank needs the mask elements of its own values. A mask carries no gradient, so
/// `Replicate` and `Invariant` masks are alike. Pending terms (`Partial<Sum>`/`<Avg>`)
/// take a whole mask: `select` picks from each term, which is linear (`masked_fill` writes
/// a value, which is not, and asks for no `Partial` besides).
#[diagnostic::on_unimplemented(
    message = "a mask laid out `{M}` does not match values laid out `{Self}` on a mesh axis",
    label = "select and masked_fill read the mask element by element beside the values",
    note = "per axis: values Shard<d> take a mask Shard<d> (the same elements); whole values (Replicate, Invariant) and linear partial terms take a whole mask (Replicate or Invariant); Ragged rows take a mask ragged by the same routing"
)]
pub trait WhereRule<M: PlacementType>: PlacementType {}
impl<const D: usize> WhereRule<S<D>> for S<D> {}
impl WhereRule<R> for R {}
impl WhereRule<I> for R {}
impl WhereRule<R> for I {}
impl WhereRule<I> for I {}
impl WhereRule<R> for P {}
impl WhereRule<I> for P {}
impl WhereRule<R> for PAvg {}
impl WhereRule<I> for PAvg {}
impl<B: Brand> WhereRule<Ragged<B>> for Ragged<B> {}

/// Values laid out `Self` with a mask laid out `LM`, every axis (see [`WhereRule`]); the
/// result keeps the values' layout.
#[diagnostic::on_unimplemented(
    message = "cannot read a mask laid out as `{LM}` beside values laid out as `{Self}`",
    label = "the layouts are over different mesh axes",
    note = "the mask needs the values' mesh axes in the same order"
)]
pub trait WhereLayout<LM: Layout>: Layout {}
impl WhereLayout<()> for () {}
impl<X: MeshAxis, M: PlacementType, Q: WhereRule<M>, RM: Layout, Rest: WhereLayout<RM>>
    WhereLayout<(On<X, M>, RM)> for (On<X, Q>, Rest)
{
}

/// Closure of `select` and `masked_fill`: each gradient is the output's gradient where
/// its operand was taken and zero elsewhere, the same selection with the same mask, so the
/// dual of every accepted value placement must again take that mask.
pub trait WhereClosed<M: PlacementType>: WhereRule<M> {}
impl<M, X> WhereClosed<M> for X
where
    M: PlacementType,
    X: WhereRule<M>,
    GradOf<X>: WhereRule<M>,
{
}
#[allow(dead_code)]
fn where_rules_close() {
    type Rg = Ragged<()>;
    fn closed<M: PlacementType, X: WhereClosed<M>>() {}
    closed::<S<0>, S<0>>();
    closed::<S<1>, S<1>>();
    closed::<S<3>, S<3>>();
    closed::<R, R>();
    closed::<I, R>();
    closed::<R, I>();
    closed::<I, I>();
    closed::<R, P>();
    closed::<I, P>();
    closed::<R, PAvg>();
    closed::<I, PAvg>();
    closed::<Rg, Rg>();
}

// ---------------------------------------------------------------------------------------
// gather_rows: a lookup by global row ids
// ---------------------------------------------------------------------------------------

/// `table[ids]` on one axis: a table placed `T` (`[n, …]`, rows looked up by global id)
/// and ids placed `Self` (`[k]`). The table's rows must be whole on every rank; its other
/// dims may be split, and its values pending terms (the lookup is linear).
#[diagnostic::on_unimplemented(
    message = "no gather rule for table `{T}` with ids `{Self}` on a mesh axis",
    label = "gather_rows looks rows up by global id: the table's rows must be whole on every rank",
    note = "per axis (table, ids): (R, S0)→S0, (R, R or I)→R, (I, I)→I, (P, R or I)→P, (Shard<e≥1>, R or I)→Shard<e>; a table split over its rows needs the vocab-parallel lookup (`embedding`) or an all_gather first"
)]
pub trait GatherRule<T: PlacementType>: PlacementType {
    /// The looked-up rows' placement (`[k, …]`) on this axis.
    type Out: PlacementType;
}
impl GatherRule<R> for S<0> {
    type Out = S<0>;
}
impl GatherRule<R> for R {
    type Out = R;
}
impl GatherRule<R> for I {
    type Out = R;
}
impl GatherRule<I> for I {
    type Out = I;
}
impl GatherRule<P> for R {
    type Out = P;
}
impl GatherRule<P> for I {
    type Out = P;
}

/// The table gradient of a gather, `Σ` of the output gradient's rows into the rows they
/// were read from, on one axis: the output gradient placed `Self`, the ids `Ids`. Each
/// rank adds the rows it holds: ids split over the axis give pending terms.
pub trait ScatterRule<Ids: PlacementType>: PlacementType {
    /// The table gradient's placement on this axis.
    type Out: PlacementType;
}
impl ScatterRule<S<0>> for S<0> {
    type Out = P;
}
impl ScatterRule<R> for P {
    type Out = P;
}
impl ScatterRule<I> for P {
    type Out = P;
}
impl ScatterRule<I> for I {
    type Out = I;
}
impl ScatterRule<R> for R {
    type Out = R;
}
impl ScatterRule<I> for R {
    type Out = R;
}
macro_rules! gather_columns {
    ($($e:literal),*) => {$(
        impl GatherRule<S<$e>> for R { type Out = S<$e>; }
        impl GatherRule<S<$e>> for I { type Out = S<$e>; }
        impl ScatterRule<R> for S<$e> { type Out = S<$e>; }
        impl ScatterRule<I> for S<$e> { type Out = S<$e>; }
    )*};
}
gather_columns!(1, 2, 3);

/// `table[ids]` over every axis (`Self` is the ids' layout, `LT` the table's).
#[diagnostic::on_unimplemented(
    message = "cannot look up ids laid out as `{Self}` in a table laid out as `{LT}`",
    label = "the layouts are over different mesh axes",
    note = "both operands need the same mesh axes in the same order"
)]
pub trait GatherLayout<LT: Layout>: Layout {
    /// The looked-up rows' layout: each axis as [`GatherRule`] places it.
    type Out: Layout;
}
impl GatherLayout<()> for () {
    type Out = ();
}
impl<X: MeshAxis, T: PlacementType, Q: GatherRule<T>, RT: Layout, Rest: GatherLayout<RT>>
    GatherLayout<(On<X, T>, RT)> for (On<X, Q>, Rest)
{
    type Out = (On<X, Q::Out>, Rest::Out);
}
/// The layout [`GatherLayout`] gives: rows of a table laid out `LT` for ids laid out `LI`.
pub type GatherOut<LT, LI> = <LI as GatherLayout<LT>>::Out;

/// Closure of `gather_rows` (`Self` is the ids' placement): the table's gradient, the
/// output gradient's rows scatter-added ([`ScatterRule`]), is placed as the table's dual.
pub trait GatherClosed<T: PlacementType>: GatherRule<T> {}
impl<T, Ids> GatherClosed<T> for Ids
where
    T: PlacementType,
    Ids: GatherRule<T>,
    GradOf<<Ids as GatherRule<T>>::Out>: ScatterRule<Ids, Out = GradOf<T>>,
{
}
#[allow(dead_code)]
fn gather_rules_close() {
    fn closed<T: PlacementType, Ids: GatherClosed<T>>() {}
    closed::<R, S<0>>();
    closed::<R, R>();
    closed::<R, I>();
    closed::<I, I>();
    closed::<P, R>();
    closed::<P, I>();
    closed::<S<1>, R>();
    closed::<S<1>, I>();
    closed::<S<2>, R>();
    closed::<S<3>, I>();
}

// ---------------------------------------------------------------------------------------
// The ops
// ---------------------------------------------------------------------------------------

/// Rows looked up, and the table rows they came from (what the backward scatters into).
type Gathered<L, LI> = (DTensor<GatherOut<L, LI>>, Vec<usize>);
/// A selection's result, and the mask's flags on this rank (what the backward reads).
type Masked<L> = (DTensor<L>, Vec<bool>);

/// [`DTensor::select`] and the mask's flags on this rank.
fn select_parts<L, LM>(
    mask: &DTensor<LM>,
    on_true: &DTensor<L>,
    on_false: &DTensor<L>,
) -> Result<Masked<L>>
where
    LM: Layout,
    L: WhereLayout<LM>,
{
    const OP: &str = "DTensor::select";
    let (m, a, b) = (mask.as_any(), on_true.as_any(), on_false.as_any());
    let bits = mask_bits(OP, m, a)?;
    check_same(OP, a, b)?;
    let local = select_local(&bits, a.as_local(), b.as_local())?;
    Ok((output(OP, local, a.global_shape(), a)?, bits))
}

impl<L: Layout> DTensor<L> {
    /// Elements `start..start + len` of dim `D` (global indices), every other dim as is
    /// (`torch.narrow`). Dim `D` is whole on every rank ([`NarrowRule`]), so each rank
    /// narrows its own piece.
    pub fn narrow<const D: usize>(&self, start: usize, len: usize) -> Result<DTensor<L>>
    where
        L: NarrowLayout<D>,
    {
        const OP: &str = "DTensor::narrow";
        let a = self.as_any();
        check_dim(OP, a, D)?;
        let n = a.global_shape()[D];
        if start.checked_add(len).is_none_or(|end| end > n) {
            return Err(shape_err(
                OP,
                format!(
                    "rows {start}..{start}+{len} of dim {D} are not inside {}",
                    describe(a)
                ),
            ));
        }
        let local = a.as_local().narrow(D, start, len)?;
        let mut global = a.global_shape().to_vec();
        global[D] = len;
        output(OP, local, &global, a)
    }

    /// `parts` joined along dim `D` in order (`torch.cat`): one layout, the same mesh and
    /// dtype, every other dim equal. Dim `D` is whole on every rank ([`NarrowRule`]).
    pub fn cat<const D: usize>(parts: &[&DTensor<L>]) -> Result<DTensor<L>>
    where
        L: NarrowLayout<D>,
    {
        const OP: &str = "DTensor::cat";
        let anys: Vec<&AnyDTensor> = parts.iter().map(|p| p.as_any()).collect();
        let global = cat_shape(OP, &anys, D)?;
        let locals: Vec<Tensor> = anys.iter().map(|a| a.as_local().clone()).collect();
        output(OP, Tensor::cat(&locals, D)?, &global, anys[0])
    }

    /// Dims `A < B` swapped (`torch.transpose(x, A, B)`; a copy): a shard of either dim
    /// moves with it ([`SwapDimsRule`]). `[tokens, heads, d]` → `[heads, tokens, d]`, say.
    pub fn swap_dims<const A: usize, const B: usize>(&self) -> Result<DTensor<SwappedDims<L, A, B>>>
    where
        L: SwapDimsLayout<A, B>,
    {
        const OP: &str = "DTensor::swap_dims";
        let a = self.as_any();
        check_dim(OP, a, B)?;
        let local = swap_local(a.as_local(), A, B)?;
        let mut global = a.global_shape().to_vec();
        global.swap(A, B);
        output(OP, local, &global, a)
    }

    /// Every slice of dim `D` repeated `times` times in place (`torch.repeat_interleave`):
    /// `[k0, k1]` → `[k0, k0, k1, k1]` along `D`. Repeating the KV heads of grouped-query
    /// attention for the query heads of their group is this op on the heads dim; `expand`
    /// of an extent-1 dim is this op too. A sharded `D` needs even shards (each rank's
    /// chunk, repeated, is then its chunk of the result): checked.
    pub fn repeat_interleave<const D: usize>(&self, times: usize) -> Result<DTensor<L>>
    where
        L: RepeatLayout<D>,
    {
        const OP: &str = "DTensor::repeat_interleave";
        let a = self.as_any();
        check_dim(OP, a, D)?;
        if times == 0 {
            return Err(shape_err(
                OP,
                format!("dim {D} of {} repeated 0 times", describe(a)),
            ));
        }
        let (n, parts) = (a.global_shape()[D], shard_parts(a, D));
        if !n.is_multiple_of(parts) {
            return Err(shape_err(
                OP,
                format!(
                    "dim {D} of {}: {n} slices do not split evenly over the {parts} ranks that shard it, so a rank's repeated chunk would not be its chunk of the result",
                    describe(a)
                ),
            ));
        }
        let local = repeat_local(a.as_local(), D, times)?;
        let mut global = a.global_shape().to_vec();
        global[D] *= times;
        output(OP, local, &global, a)
    }

    /// `on_true` where `mask` is set (non-zero), `on_false` elsewhere (`torch.where`), bit
    /// for bit. The three share one shape (no broadcasting); the mask's layout matches the
    /// values' per axis ([`WhereRule`]).
    pub fn select<LM>(
        mask: &DTensor<LM>,
        on_true: &DTensor<L>,
        on_false: &DTensor<L>,
    ) -> Result<DTensor<L>>
    where
        LM: Layout,
        L: WhereLayout<LM>,
    {
        Ok(select_parts(mask, on_true, on_false)?.0)
    }

    /// `value` where `mask` is set (non-zero), this tensor elsewhere (`torch.masked_fill`),
    /// `value` rounded once into the dtype (`f64::NEG_INFINITY` before a softmax, say).
    /// The mask's layout matches per axis ([`WhereRule`]); no `Partial` axis (every term
    /// would be filled).
    pub fn masked_fill<LM>(&self, mask: &DTensor<LM>, value: f64) -> Result<DTensor<L>>
    where
        LM: Layout,
        L: WhereLayout<LM> + PointwiseLayout,
    {
        Ok(self.masked_fill_parts(mask, value)?.0)
    }

    /// [`masked_fill`](Self::masked_fill) and the mask's flags on this rank, which its
    /// backward reads.
    fn masked_fill_parts<LM>(&self, mask: &DTensor<LM>, value: f64) -> Result<Masked<L>>
    where
        LM: Layout,
        L: WhereLayout<LM> + PointwiseLayout,
    {
        const OP: &str = "DTensor::masked_fill";
        let (m, x) = (mask.as_any(), self.as_any());
        let bits = mask_bits(OP, m, x)?;
        let local = keep_or(x.as_local(), |i| !bits[i], value)?;
        Ok((output(OP, local, x.global_shape(), x)?, bits))
    }

    /// Rows of this table (`[n, …]`) picked by global row ids (`[k]`, an integer tensor):
    /// row `i` of the result (`[k, …]`) is row `ids[i]` of the table, bit for bit. The
    /// table's rows are whole on every rank ([`GatherRule`]); ids out of `0..n` are an
    /// `Err`.
    pub fn gather_rows<LI>(&self, ids: &DTensor<LI>) -> Result<DTensor<GatherOut<L, LI>>>
    where
        LI: GatherLayout<L>,
    {
        Ok(self.gather_rows_parts(ids)?.0)
    }

    /// [`gather_rows`](Self::gather_rows) and the row ids this rank read, which its
    /// backward scatters into.
    fn gather_rows_parts<LI>(&self, ids: &DTensor<LI>) -> Result<Gathered<L, LI>>
    where
        LI: GatherLayout<L>,
    {
        const OP: &str = "DTensor::gather_rows";
        let (t, i) = (self.as_any(), ids.as_any());
        same_mesh(OP, t, i)?;
        check_dim(OP, t, 0)?;
        let rows = row_ids(OP, i, t)?;
        let (local_shape, global_shape) = (t.local_shape(), t.global_shape());
        let width: usize = local_shape[1..].iter().product();
        let flat = t.as_local().clone().reshape(&[local_shape[0], width])?;
        let mut shape = vec![rows.len()];
        shape.extend_from_slice(&local_shape[1..]);
        let local = ops::gather_rows(&flat, &rows)?.reshape(&shape)?;
        let mut global = vec![i.global_shape()[0]];
        global.extend_from_slice(&global_shape[1..]);
        Ok((output(OP, local, &global, t)?, rows))
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::narrow`]: the gradient is zero-padded back to the input's extent.
    pub fn narrow<const D: usize>(&self, start: usize, len: usize) -> Result<Var<'t, L>>
    where
        L: NarrowLayout<D>,
    {
        let y = self.value().narrow::<D>(start, len)?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let dy = dy.as_local();
            let mut g = Tensor::zeros_on(dy.device(), xv.local_shape(), dy.dtype())?;
            g.write_at(D, start, dy)?;
            grad_of("Var::narrow", g, &xv)
        }))
    }

    /// [`DTensor::cat`] of values on one tape: each part's gradient is its rows of the
    /// output's gradient.
    pub fn cat<const D: usize>(parts: &[&Var<'t, L>]) -> Result<Var<'t, L>>
    where
        L: NarrowLayout<D>,
    {
        const OP: &str = "Var::cat";
        let tape = match parts.first() {
            Some(p) => p.tape(),
            None => return Err(shape_err(OP, "no tensors to concatenate".into())),
        };
        if parts.iter().any(|p| !std::ptr::eq(p.tape(), tape)) {
            return Err(Error::InvalidUse {
                op: OP,
                detail: "the parts are on different tapes: record them on one".into(),
            });
        }
        let values: Vec<&DTensor<L>> = parts.iter().map(|p| p.value()).collect();
        let y = DTensor::cat::<D>(&values)?;
        let ids: Vec<usize> = parts.iter().map(|p| p.id()).collect();
        let xs: Vec<AnyDTensor> = parts.iter().map(|p| p.value().as_any().clone()).collect();
        let inputs = ids.clone();
        Ok(tape.record(y, false, &inputs, move |dy, store| {
            let mut start = 0;
            for (&id, x) in ids.iter().zip(&xs) {
                let len = x.local_shape()[D];
                let g = dy.as_local().narrow(D, start, len)?;
                start += len;
                store.accumulate::<L>(id, grad_of("Var::cat", g, x)?)?;
            }
            Ok(())
        }))
    }

    /// [`DTensor::swap_dims`]: the gradient's dims are swapped back.
    pub fn swap_dims<const A: usize, const B: usize>(&self) -> Result<Var<'t, SwappedDims<L, A, B>>>
    where
        L: SwapDimsLayout<A, B>,
    {
        let y = self.value().swap_dims::<A, B>()?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let g = swap_local(dy.as_local(), A, B)?;
            grad_of("Var::swap_dims", g, &xv)
        }))
    }

    /// [`DTensor::repeat_interleave`]: the gradient of a slice is the sum of its copies'.
    pub fn repeat_interleave<const D: usize>(&self, times: usize) -> Result<Var<'t, L>>
    where
        L: RepeatLayout<D>,
    {
        let y = self.value().repeat_interleave::<D>(times)?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let s = xv.local_shape();
            let g = if s.iter().product::<usize>() == 0 {
                Tensor::zeros_on(dy.as_local().device(), s, dy.as_local().dtype())?
            } else {
                let outer: usize = s[..=D].iter().product();
                let inner: usize = s[D + 1..].iter().product();
                let copies = dy.as_local().clone().reshape(&[outer, times, inner])?;
                ops::sum_dim(&copies, 1)?.reshape(s)?
            };
            grad_of("Var::repeat_interleave", g, &xv)
        }))
    }

    /// [`DTensor::select`]: the output's gradient goes to `on_true` where the mask is set
    /// and to `on_false` elsewhere (zero in the other places); the mask gets none.
    pub fn select<LM>(
        mask: &DTensor<LM>,
        on_true: &Var<'t, L>,
        on_false: &Var<'t, L>,
    ) -> Result<Var<'t, L>>
    where
        LM: Layout,
        L: WhereLayout<LM>,
    {
        let (y, bits) = select_parts(mask, on_true.value(), on_false.value())?;
        let (av, bv) = (
            on_true.value().as_any().clone(),
            on_false.value().as_any().clone(),
        );
        Ok(on_true.binary(on_false, y, move |dy, want| {
            let dy = dy.as_local();
            let da = match want[0] {
                true => Some(grad_of("Var::select", keep_or(dy, |i| bits[i], 0.0)?, &av)?),
                false => None,
            };
            let db = match want[1] {
                true => Some(grad_of(
                    "Var::select",
                    keep_or(dy, |i| !bits[i], 0.0)?,
                    &bv,
                )?),
                false => None,
            };
            Ok((da, db))
        }))
    }

    /// [`DTensor::masked_fill`]: the gradient passes where the mask is not set and is zero
    /// where it is.
    pub fn masked_fill<LM>(&self, mask: &DTensor<LM>, value: f64) -> Result<Var<'t, L>>
    where
        LM: Layout,
        L: WhereLayout<LM> + PointwiseLayout,
    {
        let (y, bits) = self.value().masked_fill_parts(mask, value)?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let g = keep_or(dy.as_local(), |i| !bits[i], 0.0)?;
            grad_of("Var::masked_fill", g, &xv)
        }))
    }

    /// [`DTensor::gather_rows`] (`self` is the table; the ids get no gradient): the
    /// table's gradient is the output gradient's rows added into the rows they came from.
    pub fn gather_rows<LI>(&self, ids: &DTensor<LI>) -> Result<Var<'t, GatherOut<L, LI>>>
    where
        LI: GatherLayout<L>,
    {
        let (y, rows) = self.value().gather_rows_parts(ids)?;
        let tv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let s = tv.local_shape();
            let width: usize = s[1..].iter().product();
            let dy = dy.as_local().clone().reshape(&[rows.len(), width])?;
            let g = ops::scatter_add_rows(&dy, &rows, s[0])?.reshape(s)?;
            grad_of("Var::gather_rows", g, &tv)
        }))
    }
}

// ---------------------------------------------------------------------------------------
// Local pieces
// ---------------------------------------------------------------------------------------

/// The global shape of `parts` joined along `d`, after checking they can be: at least
/// one, one mesh and dtype, every other dim equal (globally and on this rank).
fn cat_shape(op: &'static str, parts: &[&AnyDTensor], d: usize) -> Result<Vec<usize>> {
    let first = *parts
        .first()
        .ok_or_else(|| shape_err(op, "no tensors to concatenate".into()))?;
    check_dim(op, first, d)?;
    let mut global = first.global_shape().to_vec();
    for p in &parts[1..] {
        same_mesh(op, first, p)?;
        let others_equal = |a: &[usize], b: &[usize]| {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .enumerate()
                    .all(|(i, (x, y))| i == d || x == y)
        };
        if p.dtype() != first.dtype()
            || !others_equal(p.global_shape(), first.global_shape())
            || !others_equal(p.local_shape(), first.local_shape())
        {
            return Err(shape_err(
                op,
                format!(
                    "{} ({}) and {} ({}) differ in another dim than {d} or in dtype",
                    describe(first),
                    first.dtype(),
                    describe(p),
                    p.dtype()
                ),
            ));
        }
        global[d] += p.global_shape()[d];
    }
    Ok(global)
}

/// Two operands of one shape, mesh and dtype.
fn check_same(op: &'static str, a: &AnyDTensor, b: &AnyDTensor) -> Result<()> {
    same_mesh(op, a, b)?;
    if a.global_shape() != b.global_shape()
        || a.local_shape() != b.local_shape()
        || a.dtype() != b.dtype()
    {
        return Err(shape_err(
            op,
            format!(
                "{} ({}) and {} ({}): shapes or dtypes differ",
                describe(a),
                a.dtype(),
                describe(b),
                b.dtype()
            ),
        ));
    }
    Ok(())
}

/// The mask's elements on this rank as flags (non-zero: set), after checking it has the
/// values' shape here and globally.
fn mask_bits(op: &'static str, mask: &AnyDTensor, values: &AnyDTensor) -> Result<Vec<bool>> {
    same_mesh(op, mask, values)?;
    if mask.global_shape() != values.global_shape() || mask.local_shape() != values.local_shape() {
        return Err(shape_err(
            op,
            format!(
                "mask {} beside values {}: shapes differ",
                describe(mask),
                describe(values)
            ),
        ));
    }
    let host = mask.as_local().to_host()?;
    Ok(host.to_f64_vec().into_iter().map(|v| v != 0.0).collect())
}

/// The global row ids this rank's piece of `ids` holds, each checked to be a row of
/// `table` (`0..n`): a 1-D integer tensor.
fn row_ids(op: &'static str, ids: &AnyDTensor, table: &AnyDTensor) -> Result<Vec<usize>> {
    if ids.global_shape().len() != 1 || ids.dtype().is_float() {
        return Err(shape_err(
            op,
            format!(
                "the ids must be a 1-D integer tensor, got {} ({})",
                describe(ids),
                ids.dtype()
            ),
        ));
    }
    let n = table.global_shape()[0];
    let host = ids.as_local().to_host()?;
    host.to_f64_vec()
        .into_iter()
        .enumerate()
        .map(|(k, v)| {
            if v >= 0.0 && (v as usize) < n {
                Ok(v as usize)
            } else {
                Err(shape_err(
                    op,
                    format!(
                        "id {v} (local entry {k} of {}) is not a row of the table {}",
                        describe(ids),
                        describe(table)
                    ),
                ))
            }
        })
        .collect()
}

/// `t` with dims `a < b` swapped, bit for bit: rows of the trailing dims gathered in the
/// swapped order (one kernel, on the host or the device).
fn swap_local(t: &Tensor, a: usize, b: usize) -> Result<Tensor> {
    let s = t.shape();
    let mut out_shape = s.to_vec();
    out_shape.swap(a, b);
    let (na, nb) = (s[a], s[b]);
    let pre: usize = s[..a].iter().product();
    let mid: usize = s[a + 1..b].iter().product();
    let post: usize = s[b + 1..].iter().product();
    let rows = pre * na * mid * nb;
    if rows == 0 || post == 0 {
        return Ok(Tensor::zeros_on(t.device(), &out_shape, t.dtype())?);
    }
    let mut src = Vec::with_capacity(rows);
    for p in 0..pre {
        for j in 0..nb {
            for m in 0..mid {
                for i in 0..na {
                    src.push(((p * na + i) * mid + m) * nb + j);
                }
            }
        }
    }
    let flat = t.clone().reshape(&[rows, post])?;
    Ok(ops::gather_rows(&flat, &src)?.reshape(&out_shape)?)
}

/// `t` with every slice of dim `d` repeated `times` times in place, bit for bit.
fn repeat_local(t: &Tensor, d: usize, times: usize) -> Result<Tensor> {
    let s = t.shape();
    let mut out_shape = s.to_vec();
    out_shape[d] *= times;
    let (pre, n): (usize, usize) = (s[..d].iter().product(), s[d]);
    let post: usize = s[d + 1..].iter().product();
    if pre * n == 0 || post == 0 {
        return Ok(Tensor::zeros_on(t.device(), &out_shape, t.dtype())?);
    }
    let src: Vec<usize> = (0..pre)
        .flat_map(|p| (0..n * times).map(move |i| p * n + i / times))
        .collect();
    let flat = t.clone().reshape(&[pre * n, post])?;
    Ok(ops::gather_rows(&flat, &src)?.reshape(&out_shape)?)
}

/// Element `i` of `a` where `bits[i]`, else of `b` (same shape and dtype), bit for bit:
/// both stacked as one-element rows and gathered, so a NaN or an infinity in the branch
/// not taken never reaches the result.
fn select_local(bits: &[bool], a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let n = a.numel();
    if n == 0 {
        return Ok(a.clone());
    }
    let both = Tensor::cat(
        &[b.clone().reshape(&[n, 1])?, a.clone().reshape(&[n, 1])?],
        0,
    )?;
    let src: Vec<usize> = (0..n).map(|i| if bits[i] { n + i } else { i }).collect();
    Ok(ops::gather_rows(&both, &src)?.reshape(a.shape())?)
}

/// Element `i` of `x` where `keep(i)`, else `fill` (rounded once into `x`'s dtype), where
/// `x` is.
fn keep_or(x: &Tensor, keep: impl Fn(usize) -> bool, fill: f64) -> Result<Tensor> {
    let n = x.numel();
    if n == 0 {
        return Ok(x.clone());
    }
    let mut one = Tensor::from_f64_vec(vec![fill], &[1, 1], x.dtype())?;
    if let Some(dev) = x.device() {
        one = one.to_device(dev)?;
    }
    let both = Tensor::cat(&[x.clone().reshape(&[n, 1])?, one], 0)?;
    let src: Vec<usize> = (0..n).map(|i| if keep(i) { i } else { n }).collect();
    Ok(ops::gather_rows(&both, &src)?.reshape(x.shape())?)
}
