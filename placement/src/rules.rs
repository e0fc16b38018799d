//! Compute-op rules: the placement a compute op gives on one mesh axis, as a type-level
//! function of its operands' placements there, lifted over a whole layout.
//!
//! Sharding propagation happens at compile time: `x.matmul(&w)` has the type
//! `DTensor<MatmulOut<Lx, Lw>>`, and a pair of placements with no rule does not compile,
//! with our own message. Nothing redistributes implicitly.
//!
//! | op (one axis) | rule (`A`, `B` → out) | anything else |
//! |---|---|---|
//! | [`MatmulRule`] `A[m,k]·B[k,n]` | R·R→R, I·I→I, S0·R→S0, R·S1→S1, S1·S0→P, P·R→P, R·P→P | no rule |
//! | [`MatmulTRule`] `A[m,k]·W[n,k]ᵀ` | R·R→R, I·I→I, S0·R→S0, R·S0→S1, S1·S1→P, P·R→P, R·P→P | no rule |
//! | [`BatchedMatmulRule`] `A[b,m,k]·B[b,k,n]` | S0·S0→S0, and the matmul rules one dim up | no rule |
//! | [`MulRule`] `a⊙b` | X·X→X for X ∈ {R, I, `S<d>`}; P·R→P; R·P→P | no rule |
//! | [`DivRule`] `a/b` | X/X→X for X ∈ {R, I, `S<d>`}; P/R→P | no rule |
//! | [`AddRowRule`] `x[r,c] + bias[c]` | (S0, R)→S0, (S1, S0)→S1, R+R→R, I+I→I, P+P→P | no rule |
//! | [`MulRowRule`] `x[r,c] · w[c]` | (S0, R)→S0, (S1, S0)→S1, R·R→R, I·I→I, (P, R)→P, (R, P)→P | no rule |
//! | [`SumRule<D>`] / [`MeanRule<D>`] / [`MaxRule<D>`] over dim `D` | `S<D>`→P(sum / avg / max); `S<e>`→`S<e−1>` when e > D; R, I stay; a sum or mean keeps a linear P | max of P: no rule |
//! | [`NotSplitOn<D>`] (softmax, log-softmax over `D`) | R, I, `S<e≠D>` stay | `S<D>`, P: no rule |
//! | [`NormRule<X, D>`] (rms / layer norm over dim `D`, weight `Self`) | (`S<e≠D>`, R)→`S<e>`, (R, R)→R, (I, I)→I | no rule |
//! | [`EmbeddingRule<T>`] (table `T`, ids `Self`) | (S0, R or I)→P (masked lookup), (S1, R or I)→S1, (R, S0)→S0, (R, R)→R, (R, I)→R, (I, I)→I | no rule |
//! | [`CrossEntropyRule<Lg>`] (logits `Lg[t,v]`, targets `Self[t]`) | (S1, R or I)→I (vocab-parallel, reduced inside), (S0, S0)→S0, (R, R)→R, (I, I)→I | no rule |
//! | [`AttentionRule`] (fused causal attention of a `[tokens, heads·3·d]` QKV) | S0 (whole samples; not on a Cp-role axis), S1 (whole heads), R, I stay | P; S0 on a Cp-role axis: no rule |
//! | [`ContextAttentionLayout`] (context-parallel attention over a Cp axis) | S0 on the Cp axis, the attention rule elsewhere | anything else |
//! | [`RopeRule`](../../dtensor_core/compute/rope/trait.RopeRule.html) (in `dtensor_core::compute::rope`, beside its op; rotary embedding of `[tokens, heads·d]` rows at their global positions) | S0 (any role, Cp included), S1 (whole heads), R, I, P(sum / avg) stay | Rg (rows without positions), P(max / min): no rule |
//! | [`TransposeRule`] (2-D) | S0↔S1; R, I, P stay | — |
//! | [`SplitRule<D>`] (dim `D` into two) | `S<D>` stays (even shards), `S<e>`→`S<e+1>` when e > D; R, I, P stay | — |
//! | [`MergeRule<D>`] (dims `D`, `D+1` into one) | `S<D>` stays (even shards), `S<e>`→`S<e−1>` when e > D+1; R, I, P stay | `S<D+1>`: no rule |
//! | `NarrowRule<D>` (narrow, cat along `D`; in `dtensor_core::compute::view`, beside the ops) | R, I, P, `S<e≠D>` stay; Rg when D ≥ 1 | `S<D>`: no rule |
//! | `SwapDimsRule<A, B>` (swap dims A < B; `compute::view`) | `S<A>`↔`S<B>`; other shards, R, I, P stay; Rg when A ≥ 1 | A ≥ B: no rule |
//! | `RepeatRule<D>` (repeat_interleave along `D`; `compute::view`) | every `S<e>` (`S<D>` even shards, checked when it runs), R, I, P stay; Rg when D ≥ 1 | Rg at D = 0 |
//! | `WhereRule<M>` (select / masked_fill, mask `M`; `compute::view`) | (`S<d>`, `S<d>`), (R or I, R or I), (P, R or I), (Rg, Rg) | no rule |
//! | `GatherRule<T>` (rows of a table `T` by global id; `compute::view`) | (R, S0)→S0, (R, R or I)→R, (I, I)→I, (P, R or I)→P, (`S<e≥1>`, R or I)→`S<e>` | no rule |
//! | `Ragged<B>` in the tables above | Rg⊙Rg→Rg, Rg/Rg→Rg, rows Rg with a bias / scale / norm weight R→Rg, sum over dim 0 Rg→P, over dim e ≥ 1 (sum, mean, max, softmax, split/merge) stays Rg | mean / max over rows, transpose, dense matmul: no rule |
//! | [`DispatchRule<B>`] (MoE dispatch of `[tokens, hidden]`) | S0→`Ragged<B>`, R, I, P, S1 stay | no rule |
//! | [`CombineRule<Y>`] (outputs `Y`, gates `Self`) | (Rg, S0)→S0, (R, R)→R, (I, I)→I, (P, R)→P, (S1, R)→S1 | no rule |
//! | [`GroupedMatmulRule`] `x[rows,in]·W[e,out,in]ᵀ` | Rg·S0→Rg (expert axis), Rg·R→Rg (data axis), R·R→R, I·I→I, R·S1→S1, S1·S2→P | no rule |
//!
//! Each rule trait is implemented on the *right* operand, so rustc reads the operand's type
//! and prints our message instead of guessing it from the one impl that fits.
//!
//! **Duality closure.** A reverse-mode tape types every gradient as the dual layout
//! (`R↔P`, `S↔S`, `I↔I`) without computing it. That is sound only if, for every forward
//! rule, the backward products are again rules of the same table and give exactly the
//! duals of the inputs. Every table but cross-entropy's is checked that way here (matmul,
//! `x·Wᵀ`, batched matmul, product, division, bias, row scale, sum, mean, norms, the local-linear ops:
//! activations, softmax, attention; transpose, split/merge, embedding as `onehot · table`;
//! the `Ragged` entries; MoE dispatch, combine and the grouped matmul, whose weight
//! gradient's table [`GroupedWeightGrad`] states the one fact the types take from the
//! dispatch: over the expert axis every row of an expert is on its owner),
//! so a rule that does not close is a build error of this crate. (Cross-entropy's backward
//! multiplies the `Invariant` per-token gradient into vocab-sharded probabilities, a
//! broadcast the product table rightly refuses between differentiable operands; its
//! gradient is checked numerically in the tests instead.) The feature
//! `_check-rule-closure-fails` adds a rule that does not close, on purpose: `S0·I→S0`, whose
//! `Invariant` operand's gradient would come out `Partial`.
//!
//! **A rule used by one op lives beside that op** (its trait, impls, closure check and layout
//! lift, in the op's `dtensor_core::compute` file; RoPE's is the first), and is checked the
//! same way there, with [`GradOf`] and the layout types of this crate. This file keeps the
//! rules several ops share and the machinery.

use crate::axis::roles::{self, RoleMarker};
use crate::axis::MeshAxis;
use crate::layout::{Layout, On, Select};
use crate::placement::{
    Avg, Brand, Invariant, Max, Partial, PlacementType, Ragged, Replicate, Shard, Sum,
};

/// The gradient placement of `P` (its dual).
pub type GradOf<P> = <P as PlacementType>::Grad;

// ---------------------------------------------------------------------------------------
// Per-axis rule traits
// ---------------------------------------------------------------------------------------

/// `C = A·B` on one mesh axis, `A[m,k]`, `B[k,n]`; implemented on `B`'s placement.
#[diagnostic::on_unimplemented(
    message = "no matmul rule for `{A}` · `{Self}` on a mesh axis",
    label = "these placements do not multiply without communication",
    note = "per axis: R·R→R, I·I→I, S0·R→S0, R·S1→S1, S1·S0→P, P·R→P, R·P→P; an `Invariant` operand only meets `Invariant` (to_replicate it first), and two `Partial` factors do not multiply"
)]
pub trait MatmulRule<A: PlacementType>: PlacementType {
    /// The placement of `C` on this axis.
    type Out: PlacementType;
}

/// `C = A·Wᵀ` on one mesh axis, `A[m,k]`, `W[n,k]` (a linear layer's `[out, in]` weight);
/// implemented on `W`'s placement.
#[diagnostic::on_unimplemented(
    message = "no matmul rule for `{A}` · `{Self}`ᵀ on a mesh axis",
    label = "these placements do not multiply without communication",
    note = "per axis (x·Wᵀ, W stored [out, in]): R·R→R, I·I→I, S0·R→S0, R·S0→S1 (column-parallel), S1·S1→P (row-parallel), P·R→P, R·P→P; an `Invariant` operand only meets `Invariant` (to_replicate it first)"
)]
pub trait MatmulTRule<A: PlacementType>: PlacementType {
    /// The placement of `A·Wᵀ` on this axis.
    type Out: PlacementType;
}

/// `C[b] = A[b]·B[b]` on one mesh axis, `A[b,m,k]`, `B[b,k,n]`; implemented on `B`'s
/// placement.
#[diagnostic::on_unimplemented(
    message = "no batched matmul rule for `{A}` · `{Self}` on a mesh axis",
    label = "these placements do not multiply without communication",
    note = "per axis ([b,m,k]·[b,k,n]): S0·S0→S0 (batch), R·R→R, I·I→I, S1·R→S1, R·S2→S2, S2·S1→P, P·R→P, R·P→P"
)]
pub trait BatchedMatmulRule<A: PlacementType>: PlacementType {
    /// The placement of `C[b]` on this axis.
    type Out: PlacementType;
}

/// The placement of a 2-D tensor's transpose on one axis.
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no 2-D transpose rule",
    label = "a 2-D tensor can only be `Shard<0>`, `Shard<1>`, `Replicate`, `Invariant` or `Partial`"
)]
pub trait TransposeRule: PlacementType {
    /// The transpose's placement on this axis (`Shard<0>` and `Shard<1>` swap).
    type T: PlacementType;
}

/// The placement of a 3-D tensor with its last two dims swapped, on one axis.
#[diagnostic::on_unimplemented(
    message = "`{Self}` has no rule for swapping the last two dims of a 3-D tensor",
    label = "a 3-D tensor can only be `Shard<0..3>`, `Replicate`, `Invariant` or `Partial`"
)]
pub trait TransposeLastRule: PlacementType {
    /// The placement on this axis once the last two dims are swapped (`Shard<1>` and
    /// `Shard<2>` swap).
    type T: PlacementType;
}

/// Elementwise `a⊙b` on one axis; implemented on `b`'s placement.
#[diagnostic::on_unimplemented(
    message = "no elementwise-product rule for `{A}` ⊙ `{Self}` on a mesh axis",
    label = "these placements do not multiply elementwise without communication",
    note = "per axis: equal placements (R, I or the same Shard<d>), or one `Partial<Sum>` factor times `Replicate`; two `Partial` factors would multiply sums of terms, and `Invariant` never mixes"
)]
pub trait MulRule<A: PlacementType>: PlacementType {
    /// The product's placement on this axis.
    type Out: PlacementType;
}

/// Elementwise `a/b` on one axis; implemented on the divisor's placement.
#[diagnostic::on_unimplemented(
    message = "no division rule for `{A}` / `{Self}` on a mesh axis",
    label = "these placements do not divide elementwise without communication",
    note = "per axis: equal placements (R, I or the same Shard<d>), or a `Partial<Sum>` numerator over a `Replicate` divisor; a `Partial` divisor is not linear"
)]
pub trait DivRule<A: PlacementType>: PlacementType {
    /// The quotient's placement on this axis.
    type Out: PlacementType;
}

/// `x[r,c] + bias[c]` on one axis (the bias broadcast along the rows); implemented on the
/// bias's placement. The output keeps `x`'s placement.
#[diagnostic::on_unimplemented(
    message = "no bias rule for rows `{X}` + bias `{Self}` on a mesh axis",
    label = "this bias placement does not match the rows' placement",
    note = "per axis: rows S0 take a Replicate bias; rows S1 (columns split) take a bias S0; R+R, I+I, P+P (sum); a Replicate bias added to Partial rows would be counted once per rank"
)]
pub trait AddRowRule<X: PlacementType>: PlacementType {}

/// `x[r,c] · w[c]` on one axis (a per-feature scale broadcast along the rows); implemented
/// on the scale's placement.
#[diagnostic::on_unimplemented(
    message = "no rule for rows `{X}` scaled by a per-column `{Self}` on a mesh axis",
    label = "this scale placement does not match the rows' placement",
    note = "per axis: rows S0 take a Replicate scale; rows S1 (columns split) a scale S0; R·R, I·I; one Partial<Sum> factor with a Replicate one"
)]
pub trait MulRowRule<X: PlacementType>: PlacementType {
    /// The scaled rows' placement on this axis.
    type Out: PlacementType;
}

/// A sum over tensor dim `D` on one axis.
#[diagnostic::on_unimplemented(
    message = "no rule for summing dim {D} of a `{Self}` axis",
    label = "tensors of more than 4 dims are not supported here",
    note = "per axis: Shard<D> gives Partial<Sum>, Shard<e> moves to Shard<e-1> when e > D, R, I and a linear Partial stay"
)]
pub trait SumRule<const D: usize>: PlacementType {
    /// The sum's placement on this axis (dim `D` removed).
    type Out: PlacementType;
}

/// A mean over tensor dim `D` on one axis.
#[diagnostic::on_unimplemented(
    message = "no rule for averaging dim {D} of a `{Self}` axis",
    label = "tensors of more than 4 dims are not supported here",
    note = "per axis: Shard<D> gives Partial<Avg> (shards must be even: checked when it runs), Shard<e> moves to Shard<e-1> when e > D, R, I and a linear Partial stay"
)]
pub trait MeanRule<const D: usize>: PlacementType {
    /// The mean's placement on this axis (dim `D` removed).
    type Out: PlacementType;
}

/// A max over tensor dim `D` on one axis.
#[diagnostic::on_unimplemented(
    message = "no rule for the max over dim {D} of a `{Self}` axis",
    label = "a max of pending partial sums is not the max of their sum: reduce first",
    note = "per axis: Shard<D> gives Partial<Max>, Shard<e> moves to Shard<e-1> when e > D, R and I stay; a `Partial` input has no rule"
)]
pub trait MaxRule<const D: usize>: PlacementType {
    /// The max's placement on this axis (dim `D` removed).
    type Out: PlacementType;
}

/// An axis that holds dim `D` whole and no pending sums: what softmax and log-softmax over
/// `D` read.
#[diagnostic::on_unimplemented(
    message = "`{Self}` splits or holds partial terms of dim {D}, which this op reduces over",
    label = "softmax, log-softmax and a differentiable max need the dim whole on every rank",
    note = "gather the dim first (all_gather), or reduce pending partial sums (all_reduce); R, I and Shard<e> with e ≠ D are fine"
)]
pub trait NotSplitOn<const D: usize>: PlacementType {}

/// rms / layer norm over dim `D` of an input placed `X`, with a weight (and bias) placed
/// `Self`. The output keeps `X`'s placement.
#[diagnostic::on_unimplemented(
    message = "no norm rule for input `{X}` with weight `{Self}` over dim {D} on a mesh axis",
    label = "this weight placement does not match the input's",
    note = "per axis: (Shard<e≠D>, Replicate) — each rank normalizes its own rows, so the weight's gradient is Partial; (Replicate, Replicate); (Invariant, Invariant). An Invariant weight on sharded rows would get a Partial gradient where Invariant needs Invariant"
)]
pub trait NormRule<X: PlacementType, const D: usize>: PlacementType {}

/// `table[ids]` on one axis: table `T` (`[vocab, hidden]`), ids placed `Self` (`[tokens]`).
#[diagnostic::on_unimplemented(
    message = "no embedding rule for table `{T}` with ids `{Self}` on a mesh axis",
    label = "this ids placement does not match the table's",
    note = "per axis: (S0, R or I)→Partial (masked vocab-parallel lookup), (S1, R or I)→S1, (R, S0)→S0, (R, R)→R, (R, I)→R, (I, I)→I"
)]
pub trait EmbeddingRule<T: PlacementType>: PlacementType {
    /// The looked-up rows' placement (`[tokens, hidden]`) on this axis.
    type Out: PlacementType;
}

/// Per-token cross-entropy on one axis: logits `Lg` (`[tokens, vocab]`), targets placed
/// `Self` (`[tokens]`).
#[diagnostic::on_unimplemented(
    message = "no cross-entropy rule for logits `{Lg}` with targets `{Self}` on a mesh axis",
    label = "this target placement does not match the logits'",
    note = "per axis: (S1, R or I)→I (vocab-parallel: max and sums reduced over the axis inside the op), (S0, S0)→S0, (R, R)→R, (I, I)→I; logits must not be Partial"
)]
pub trait CrossEntropyRule<Lg: PlacementType>: PlacementType {
    /// The per-token loss's placement (`[tokens]`) on this axis.
    type Out: PlacementType;
}

/// Splitting tensor dim `D` into two (`D`, `D + 1`) on one axis: `Shard<D>` shards the
/// leading part (even shards only, checked when it runs), a later `Shard<e>` moves up.
#[diagnostic::on_unimplemented(
    message = "no rule for splitting dim {D} of a `{Self}` axis",
    label = "tensors of more than 4 dims are not supported here",
    note = "per axis: Shard<D> stays (the leading part is split), Shard<e> moves to Shard<e+1> when e > D; R, I and Partial stay"
)]
pub trait SplitRule<const D: usize>: PlacementType {
    /// The placement on this axis after the split.
    type Out: PlacementType;
}

/// Merging tensor dims `D` and `D + 1` into one on one axis: `Shard<D>` stays (even shards
/// only, checked when it runs); a shard of the trailing dim `D + 1` has no rule (its rows
/// would interleave); a later `Shard<e>` moves down.
#[diagnostic::on_unimplemented(
    message = "no rule for merging dims {D} and {D}+1 of a `{Self}` axis",
    label = "a shard of the trailing merged dim would interleave with the others: gather it (all_gather) or move it (all_to_all) first",
    note = "per axis: Shard<D> stays, Shard<e> moves to Shard<e-1> when e > D + 1; R, I and Partial stay"
)]
pub trait MergeRule<const D: usize>: PlacementType {
    /// The placement on this axis after the merge.
    type Out: PlacementType;
}

macro_rules! keeps_for_every_dim {
    ($rule:ident: $($p:ty),*) => {$(
        impl<const D: usize> $rule<D> for $p { type Out = $p; }
    )*};
}
keeps_for_every_dim!(SplitRule: R, I, Partial<Sum>, Partial<Avg>, Partial<Max>, Partial<crate::Min>);
keeps_for_every_dim!(MergeRule: R, I, Partial<Sum>, Partial<Avg>, Partial<Max>, Partial<crate::Min>);
macro_rules! dim_moves {
    ($rule:ident: $($d:literal: [$($e:literal => $o:literal),*]);*) => {
        $($(impl $rule<$d> for S<$e> { type Out = S<$o>; })*)*
    };
}
// Split dim D: e ≤ D stays, e > D moves up (at most 4 dims out).
dim_moves!(SplitRule: 0: [0 => 0, 1 => 2, 2 => 3]; 1: [0 => 0, 1 => 1, 2 => 3]; 2: [0 => 0, 1 => 1, 2 => 2]);
// Merge dims D, D+1: e ≤ D stays, e = D + 1 has no rule, e > D + 1 moves down.
dim_moves!(MergeRule: 0: [0 => 0, 2 => 1, 3 => 2]; 1: [0 => 0, 1 => 1, 3 => 2]; 2: [0 => 0, 1 => 1, 2 => 2]);

/// Fused causal attention over a `[tokens, heads·3·d]` QKV on one axis whose role is
/// `Role` (the axis's [`MeshAxis::Role`]): tokens may be split (whole samples per rank,
/// checked when it runs), columns split by whole heads (checked too), or the tensor whole;
/// never pending sums. The output keeps the placement.
///
/// On a `Cp`-role axis `Shard<0>` has no rule: there the token shards are chunks of every
/// sequence (context parallelism), and attending within a chunk would silently drop the
/// other chunks' keys. Such an input goes through `context_attention` (ring or all-to-all
/// over the axis), which [`ContextAttentionLayout`] types.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot feed attention on a mesh axis of role `{Role}`: it needs whole samples and whole heads on every rank, and no pending sums",
    label = "attention reads this axis's QKV as is",
    note = "per axis: Shard<0> (samples; not on a Cp-role axis, whose Shard<0> holds chunks of every sequence: use context_attention over it), Shard<1> (heads), Replicate or Invariant; reduce a Partial first (all_reduce)"
)]
pub trait AttentionRule<Role: RoleMarker>: PlacementType {}
impl<Role: RoleMarker> AttentionRule<Role> for S<1> {}
impl<Role: RoleMarker> AttentionRule<Role> for R {}
impl<Role: RoleMarker> AttentionRule<Role> for I {}
impl AttentionRule<roles::Dp> for S<0> {}
impl AttentionRule<roles::Pp> for S<0> {}
impl AttentionRule<roles::Ep> for S<0> {}
impl AttentionRule<roles::Tp> for S<0> {}

/// The placement context-parallel attention needs on its `Cp` axis: the tokens
/// `Shard<0>` (each rank holds its chunks of every sample, in the CP token order).
#[diagnostic::on_unimplemented(
    message = "context attention needs the tokens `Shard<0>` over its Cp axis, got `{Self}`",
    label = "context attention splits the sequences over this axis",
    note = "shard the tokens (dim 0, in the CP order of `dtensor_core::context`) over the Cp axis; with the sequences whole on every rank use causal_attention"
)]
pub trait SequenceShardRule: PlacementType {}
impl SequenceShardRule for S<0> {}

/// A role context attention may run over: `Cp` only.
#[diagnostic::on_unimplemented(
    message = "context attention runs over a Cp-role mesh axis, not one of role `{Self}`",
    label = "not a context-parallel axis",
    note = "declare the axis with `role = Cp` (or use the built-in `Cp`)"
)]
pub trait ContextRole: RoleMarker {}
impl ContextRole for roles::Cp {}

/// A layout context attention over axis `X` (found at index `I`) accepts: `Shard<0>` on
/// `X` ([`SequenceShardRule`]) and, on every other axis, what plain attention accepts
/// ([`AttentionRule`]: checked by replacing `X`'s placement with `Replicate`). The output
/// keeps the layout.
pub trait ContextAttentionLayout<X, I>: Layout {}
impl<L, X, I> ContextAttentionLayout<X, I> for L
where
    X: MeshAxis,
    X::Role: ContextRole,
    L: Layout + Select<X, I>,
    <L as Select<X, I>>::P: SequenceShardRule,
    <L as Select<X, I>>::With<R>: AttentionLayout,
{
}

/// Every axis `Partial<Sum>` or `Invariant`: a loss whose seed gradient (the dual: ones,
/// `Replicate` or `Invariant`) is exact.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a loss placement: backward() seeds ones, which is exact only for `Partial<Sum>` or `Invariant` axes",
    label = "reduce this axis to `Partial<Sum>` (sum over data) or `Invariant` (all_reduce) first",
    note = "a `Replicate` loss would be counted once per rank, a sharded one is not a scalar"
)]
pub trait LossPlacement: PlacementType {}
impl LossPlacement for Partial<Sum> {}
impl LossPlacement for Invariant {}

// ---------------------------------------------------------------------------------------
// The tables
// ---------------------------------------------------------------------------------------

type R = Replicate;
type I = Invariant;
type P = Partial<Sum>;
type S<const D: usize> = Shard<D>;

/// Declares binary rules `A ∘ B → C` (impl on `B`) and checks each one's duality closure
/// with `$closed` (a trait whose blanket impl states the backward products).
macro_rules! binary_rules {
    ($rule:ident, $closed:ident, $check:ident: $(($a:ty, $b:ty) => $c:ty),* $(,)?) => {
        $(impl $rule<$a> for $b { type Out = $c; })*
        /// Type-checked on every build: each rule's backward products are rules of the
        /// same table and give the duals of its inputs.
        #[allow(dead_code)]
        fn $check() {
            fn closed<A: PlacementType, B: $closed<A>>() {}
            $(closed::<$a, $b>();)*
        }
    };
}

binary_rules!(MatmulRule, MatmulClosed, matmul_rules_close:
    (R, R) => R,
    (I, I) => I,
    (S<0>, R) => S<0>,
    (R, S<1>) => S<1>,
    (S<1>, S<0>) => P,
    (P, R) => P,
    (R, P) => P,
);

// Added only by the feature that shows a bogus rule breaks the build: `S0·I→S0` would give
// the `Invariant` operand a `Partial` gradient (dB = Aᵀ·dC = S1·S0 → P).
#[cfg(feature = "_check-rule-closure-fails")]
binary_rules!(MatmulRule, MatmulClosed, bogus_rule_closes: (S<0>, I) => S<0>);

binary_rules!(MatmulTRule, MatmulTClosed, matmul_t_rules_close:
    (R, R) => R,
    (I, I) => I,
    (S<0>, R) => S<0>,
    (R, S<0>) => S<1>,
    (S<1>, S<1>) => P,
    (P, R) => P,
    (R, P) => P,
);

binary_rules!(BatchedMatmulRule, BatchedMatmulClosed, batched_matmul_rules_close:
    (S<0>, S<0>) => S<0>,
    (R, R) => R,
    (I, I) => I,
    (S<1>, R) => S<1>,
    (R, S<2>) => S<2>,
    (S<2>, S<1>) => P,
    (P, R) => P,
    (R, P) => P,
);

binary_rules!(MulRule, MulClosed, mul_rules_close:
    (R, R) => R,
    (I, I) => I,
    (S<0>, S<0>) => S<0>,
    (S<1>, S<1>) => S<1>,
    (S<2>, S<2>) => S<2>,
    (S<3>, S<3>) => S<3>,
    (P, R) => P,
    (R, P) => P,
);

binary_rules!(DivRule, DivClosed, div_rules_close:
    (R, R) => R,
    (I, I) => I,
    (S<0>, S<0>) => S<0>,
    (S<1>, S<1>) => S<1>,
    (S<2>, S<2>) => S<2>,
    (S<3>, S<3>) => S<3>,
    (P, R) => P,
);

impl TransposeRule for S<0> {
    type T = S<1>;
}
impl TransposeRule for S<1> {
    type T = S<0>;
}
impl TransposeLastRule for S<0> {
    type T = S<0>;
}
impl TransposeLastRule for S<1> {
    type T = S<2>;
}
impl TransposeLastRule for S<2> {
    type T = S<1>;
}
macro_rules! transpose_keeps {
    ($($p:ty),*) => {$(
        impl TransposeRule for $p { type T = $p; }
        impl TransposeLastRule for $p { type T = $p; }
    )*};
}
transpose_keeps!(
    R,
    I,
    Partial<Sum>,
    Partial<Avg>,
    Partial<Max>,
    Partial<crate::Min>
);

/// Closure of `A·B → C`: `dA = dC·Bᵀ` and `dB = Aᵀ·dC` are rules giving `A*` and `B*`.
pub trait MatmulClosed<A: PlacementType>: MatmulRule<A> {}
impl<A, B> MatmulClosed<A> for B
where
    A: TransposeRule,
    B: MatmulRule<A> + TransposeRule,
    <B as TransposeRule>::T: MatmulRule<GradOf<<B as MatmulRule<A>>::Out>, Out = GradOf<A>>,
    GradOf<<B as MatmulRule<A>>::Out>: MatmulRule<<A as TransposeRule>::T, Out = GradOf<B>>,
{
}

/// Closure of `A·Wᵀ → C`: `dA = dC·W` and `dW = dCᵀ·A` are rules giving `A*` and `W*`.
pub trait MatmulTClosed<A: PlacementType>: MatmulTRule<A> {}
impl<A, W> MatmulTClosed<A> for W
where
    A: PlacementType,
    W: MatmulTRule<A> + MatmulRule<GradOf<<W as MatmulTRule<A>>::Out>, Out = GradOf<A>>,
    GradOf<<W as MatmulTRule<A>>::Out>: TransposeRule,
    A: MatmulRule<<GradOf<<W as MatmulTRule<A>>::Out> as TransposeRule>::T, Out = GradOf<W>>,
{
}

/// Closure of `A[b]·B[b] → C`: `dA = dC·Bᵀ` and `dB = Aᵀ·dC` (last two dims swapped).
pub trait BatchedMatmulClosed<A: PlacementType>: BatchedMatmulRule<A> {}
impl<A, B> BatchedMatmulClosed<A> for B
where
    A: TransposeLastRule,
    B: BatchedMatmulRule<A> + TransposeLastRule,
    <B as TransposeLastRule>::T:
        BatchedMatmulRule<GradOf<<B as BatchedMatmulRule<A>>::Out>, Out = GradOf<A>>,
    GradOf<<B as BatchedMatmulRule<A>>::Out>:
        BatchedMatmulRule<<A as TransposeLastRule>::T, Out = GradOf<B>>,
{
}

/// Closure of `a⊙b → c`: `da = dc⊙b` and `db = dc⊙a` are product rules giving `a*`, `b*`.
pub trait MulClosed<A: PlacementType>: MulRule<A> {}
impl<A, B> MulClosed<A> for B
where
    A: PlacementType,
    B: MulRule<A> + MulRule<GradOf<<B as MulRule<A>>::Out>, Out = GradOf<A>>,
    A: MulRule<GradOf<<B as MulRule<A>>::Out>, Out = GradOf<B>>,
{
}

/// Closure of `a/b → c`: `da = dc/b` is a division rule giving `a*`, and
/// `db = −(dc⊙a)/b²` is a product rule (then a division by `b⊙b`, placed as `b`) giving
/// `b*`.
pub trait DivClosed<A: PlacementType>: DivRule<A> {}
impl<A, B> DivClosed<A> for B
where
    A: PlacementType,
    B: DivRule<A> + DivRule<GradOf<<B as DivRule<A>>::Out>, Out = GradOf<A>>,
    A: MulRule<GradOf<<B as DivRule<A>>::Out>>,
    B: DivRule<<A as MulRule<GradOf<<B as DivRule<A>>::Out>>>::Out, Out = GradOf<B>>,
{
}

// x + bias along the rows. The closure, by hand (a bias gradient is a sum over rows, which
// is [`SumRule<0>`] of the output gradient): (S0, R): dy S0 summed over its sharded dim is
// P = R*; (S1, S0): dy S1 summed over dim 0 is S0 = S0*; (R, R): dy P stays P = R*;
// (I, I): I; (P, P): dy R stays R = P*. Checked below with `add_row_rules_close`.
impl AddRowRule<S<0>> for R {}
impl AddRowRule<S<1>> for S<0> {}
impl AddRowRule<R> for R {}
impl AddRowRule<I> for I {}
impl AddRowRule<P> for P {}

/// Closure of `x + bias → x`: the bias gradient, the output gradient summed over rows
/// (dim 0), is placed as the bias's dual.
pub trait AddRowClosed<X: PlacementType>: AddRowRule<X> {}
impl<X, B> AddRowClosed<X> for B
where
    X: PlacementType,
    B: AddRowRule<X>,
    GradOf<X>: SumRule<0, Out = GradOf<B>>,
{
}
#[allow(dead_code)]
fn add_row_rules_close() {
    fn closed<X: PlacementType, B: AddRowClosed<X>>() {}
    closed::<S<0>, R>();
    closed::<S<1>, S<0>>();
    closed::<R, R>();
    closed::<I, I>();
    closed::<P, P>();
}

impl MulRowRule<S<0>> for R {
    type Out = S<0>;
}
impl MulRowRule<S<1>> for S<0> {
    type Out = S<1>;
}
impl MulRowRule<R> for R {
    type Out = R;
}
impl MulRowRule<I> for I {
    type Out = I;
}
impl MulRowRule<P> for R {
    type Out = P;
}
impl MulRowRule<R> for P {
    type Out = P;
}

/// Closure of `x · w` along rows: `dx = dy · w` (the same broadcast) is placed as `x`'s
/// dual, and `dw = Σ_rows dy ⊙ x` (a product, then a sum over dim 0) as `w`'s.
pub trait MulRowClosed<X: PlacementType>: MulRowRule<X> {}
impl<X, W> MulRowClosed<X> for W
where
    X: PlacementType,
    W: MulRowRule<X> + MulRowRule<GradOf<<W as MulRowRule<X>>::Out>, Out = GradOf<X>>,
    GradOf<<W as MulRowRule<X>>::Out>: MulRule<X>,
    <GradOf<<W as MulRowRule<X>>::Out> as MulRule<X>>::Out: SumRule<0, Out = GradOf<W>>,
{
}
#[allow(dead_code)]
fn mul_row_rules_close() {
    fn closed<X: PlacementType, W: MulRowClosed<X>>() {}
    closed::<S<0>, R>();
    closed::<S<1>, S<0>>();
    closed::<R, R>();
    closed::<I, I>();
    closed::<P, R>();
    closed::<R, P>();
}

// Reductions over dim D: Shard<D> becomes the reduction's Partial, Shard<e> with e > D
// moves down one dim (the dim disappears), R and I stay. Dims are capped at 4 (no
// arithmetic on const generics on stable Rust, so the moves are a table).
macro_rules! reduction_rules {
    ($rule:ident, $partial:ty, [$($keep:ty),*]) => {
        impl<const D: usize> $rule<D> for R { type Out = R; }
        impl<const D: usize> $rule<D> for I { type Out = I; }
        $(impl<const D: usize> $rule<D> for $keep { type Out = $keep; })*
        reduction_rules!(@shards $rule, $partial);
    };
    (@shards $rule:ident, $partial:ty) => {
        impl $rule<0> for S<0> { type Out = $partial; }
        impl $rule<0> for S<1> { type Out = S<0>; }
        impl $rule<0> for S<2> { type Out = S<1>; }
        impl $rule<0> for S<3> { type Out = S<2>; }
        impl $rule<1> for S<0> { type Out = S<0>; }
        impl $rule<1> for S<1> { type Out = $partial; }
        impl $rule<1> for S<2> { type Out = S<1>; }
        impl $rule<1> for S<3> { type Out = S<2>; }
        impl $rule<2> for S<0> { type Out = S<0>; }
        impl $rule<2> for S<1> { type Out = S<1>; }
        impl $rule<2> for S<2> { type Out = $partial; }
        impl $rule<2> for S<3> { type Out = S<2>; }
        impl $rule<3> for S<0> { type Out = S<0>; }
        impl $rule<3> for S<1> { type Out = S<1>; }
        impl $rule<3> for S<2> { type Out = S<2>; }
        impl $rule<3> for S<3> { type Out = $partial; }
    };
}
reduction_rules!(SumRule, Partial<Sum>, [Partial<Sum>, Partial<Avg>]);
reduction_rules!(MeanRule, Partial<Avg>, [Partial<Sum>, Partial<Avg>]);
reduction_rules!(MaxRule, Partial<Max>, []);

/// The gradient of a reduction over dim `D` comes back by broadcasting the output's
/// gradient along `D` (a local op): placed `Self`, it can give `Target`. `Replicate`
/// broadcast to a rank's own extent is its chunk, so `R` reaches `Shard<D>` too.
pub trait ExpandTo<const D: usize, Target>: PlacementType {}
impl<const D: usize> ExpandTo<D, R> for R {}
impl<const D: usize> ExpandTo<D, I> for I {}
impl<const D: usize> ExpandTo<D, P> for P {}
macro_rules! expand_table {
    ($($d:literal: [$($e:literal => $o:literal),*]);*) => {
        $($(impl ExpandTo<$d, S<$o>> for S<$e> {})*)*
        $(impl ExpandTo<$d, S<$d>> for R {})*
    };
}
// Inverse of the reductions' moves: Shard<e> of the output is Shard<e + [e ≥ D]> of the input.
expand_table!(0: [0 => 1, 1 => 2, 2 => 3]; 1: [0 => 0, 1 => 2, 2 => 3]; 2: [0 => 0, 1 => 1, 2 => 3]; 3: [0 => 0, 1 => 1, 2 => 2]);

/// Closure of a sum over `D` (`Self` is the input's placement): the output's gradient,
/// broadcast back along `D`, is placed as the input's dual.
pub trait SumClosed<const D: usize>: SumRule<D> {}
impl<const D: usize, X> SumClosed<D> for X
where
    X: SumRule<D>,
    GradOf<<X as SumRule<D>>::Out>: ExpandTo<D, GradOf<X>>,
{
}
/// Closure of a mean over `D`: as the sum's (the gradient is scaled, not moved).
pub trait MeanClosed<const D: usize>: MeanRule<D> {}
impl<const D: usize, X> MeanClosed<D> for X
where
    X: MeanRule<D>,
    GradOf<<X as MeanRule<D>>::Out>: ExpandTo<D, GradOf<X>>,
{
}
#[allow(dead_code)]
fn reduction_rules_close() {
    fn sum<const D: usize, X: SumClosed<D> + MeanClosed<D>>() {}
    macro_rules! every {
        ($($d:literal),*) => {$(
            sum::<$d, R>();
            sum::<$d, I>();
            sum::<$d, P>();
            sum::<$d, Partial<Avg>>();
            sum::<$d, S<0>>();
            sum::<$d, S<1>>();
            sum::<$d, S<2>>();
            sum::<$d, S<3>>();
        )*};
    }
    every!(0, 1, 2, 3);
}

/// Closure of a norm over the last dim of a 2-D input placed `X` with a weight placed
/// `Self`: the input's gradient keeps `X`'s dual (it is elementwise in rows), and the
/// weight's gradient is the sum over rows of `dy ⊙ x̂`, a product rule then a sum over
/// dim 0, placed as the weight's dual.
pub trait NormClosed<X: PlacementType>: NormRule<X, 1> {}
impl<X, W> NormClosed<X> for W
where
    X: PlacementType,
    W: NormRule<X, 1>,
    GradOf<X>: MulRule<X>,
    <GradOf<X> as MulRule<X>>::Out: SumRule<0, Out = GradOf<W>>,
{
}
#[allow(dead_code)]
fn norm_rules_close() {
    fn closed<X: PlacementType, W: NormClosed<X>>() {}
    closed::<S<0>, R>();
    closed::<R, R>();
    closed::<I, I>();
}

/// Closure of an op whose output keeps its input's placement and whose backward multiplies
/// the output's gradient by factors placed like the input (activations, softmax and
/// log-softmax over a whole dim, attention): the product rule gives the input's dual.
pub trait LocalLinearClosed: PlacementType {}
impl<X> LocalLinearClosed for X
where
    X: PlacementType,
    GradOf<X>: MulRule<X, Out = GradOf<X>>,
{
}
#[allow(dead_code)]
fn local_linear_rules_close() {
    fn closed<X: LocalLinearClosed>() {}
    // Everything NotSplitOn, AttentionRule and Pointwise admit.
    closed::<R>();
    closed::<I>();
    closed::<S<0>>();
    closed::<S<1>>();
    closed::<S<2>>();
    closed::<S<3>>();
}

/// Closure of the 2-D transpose: the gradient of the transpose is the transpose of the
/// gradient.
pub trait TransposeClosed: TransposeRule {}
impl<X> TransposeClosed for X
where
    X: TransposeRule,
    GradOf<X>: TransposeRule<T = GradOf<<X as TransposeRule>::T>>,
{
}
#[allow(dead_code)]
fn transpose_rules_close() {
    fn closed<X: TransposeClosed>() {}
    closed::<R>();
    closed::<I>();
    closed::<P>();
    closed::<S<0>>();
    closed::<S<1>>();
}

/// Closure of a split of dim `D`: the gradient is merged back, and merging the output's
/// dual gives the input's dual (and the other way round for a merge).
pub trait SplitClosed<const D: usize>: SplitRule<D> {}
impl<const D: usize, X> SplitClosed<D> for X
where
    X: SplitRule<D>,
    GradOf<<X as SplitRule<D>>::Out>: MergeRule<D, Out = GradOf<X>>,
{
}
#[allow(dead_code)]
fn split_merge_rules_close() {
    fn closed<const D: usize, X: SplitClosed<D>>() {}
    macro_rules! every {
        ($($d:literal: [$($e:literal),*]);*) => {$(
            closed::<$d, R>();
            closed::<$d, I>();
            closed::<$d, P>();
            $(closed::<$d, S<$e>>();)*
        )*};
    }
    every!(0: [0, 1, 2]; 1: [0, 1, 2]; 2: [0, 1, 2]);
}

/// The one-hot matrix `[tokens, vocab]` an embedding lookup multiplies its table by, placed
/// per axis from the ids (`Self`) and the table: the lookup is `onehot · table`, so its
/// closure is the matmul table's.
pub trait OneHotRule<T: PlacementType>: PlacementType {
    /// The one-hot matrix's placement on this axis; its transpose has a rule too, for the
    /// table's gradient `onehotᵀ · dy`.
    type Out: PlacementType + TransposeRule;
}
impl OneHotRule<S<0>> for R {
    type Out = S<1>; // each rank's vocab columns (the masked lookup)
}
impl OneHotRule<S<0>> for I {
    type Out = S<1>;
}
impl OneHotRule<S<1>> for R {
    type Out = R;
}
impl OneHotRule<S<1>> for I {
    type Out = R;
}
impl OneHotRule<R> for S<0> {
    type Out = S<0>;
}
impl OneHotRule<R> for R {
    type Out = R;
}
impl OneHotRule<R> for I {
    type Out = R; // ids carry no gradient: the same on every rank is as good as replicated
}
impl OneHotRule<I> for I {
    type Out = I;
}

/// Closure of `table[ids]` (`Self` is the ids' placement): the lookup's output is
/// `onehot · table` by the matmul rule, and the table's gradient `onehotᵀ · dy` is placed
/// as the table's dual.
pub trait EmbeddingClosed<T: PlacementType>: EmbeddingRule<T> {}
impl<T, Ids> EmbeddingClosed<T> for Ids
where
    T: PlacementType + MatmulRule<<Ids as OneHotRule<T>>::Out>,
    Ids:
        OneHotRule<T> + EmbeddingRule<T, Out = <T as MatmulRule<<Ids as OneHotRule<T>>::Out>>::Out>,
    GradOf<<Ids as EmbeddingRule<T>>::Out>:
        MatmulRule<<<Ids as OneHotRule<T>>::Out as TransposeRule>::T, Out = GradOf<T>>,
{
}
#[allow(dead_code)]
fn embedding_rules_close() {
    fn closed<T: PlacementType, Ids: EmbeddingClosed<T>>() {}
    closed::<S<0>, R>();
    closed::<S<0>, I>();
    closed::<S<1>, R>();
    closed::<S<1>, I>();
    closed::<R, S<0>>();
    closed::<R, R>();
    closed::<R, I>();
    closed::<I, I>();
}

impl<const D: usize> NotSplitOn<D> for R {}
impl<const D: usize> NotSplitOn<D> for I {}
macro_rules! not_split {
    ($($d:literal: [$($e:literal),*]);*) => {
        $($(impl NotSplitOn<$d> for S<$e> {})*)*
        $($(impl NormRule<S<$e>, $d> for R {})*)*
    };
}
not_split!(0: [1, 2, 3]; 1: [0, 2, 3]; 2: [0, 1, 3]; 3: [0, 1, 2]);
impl<const D: usize> NormRule<R, D> for R {}
impl<const D: usize> NormRule<I, D> for I {}

impl EmbeddingRule<S<0>> for R {
    type Out = P;
}
impl EmbeddingRule<S<0>> for I {
    type Out = P;
}
impl EmbeddingRule<S<1>> for R {
    type Out = S<1>;
}
impl EmbeddingRule<S<1>> for I {
    type Out = S<1>;
}
impl EmbeddingRule<R> for S<0> {
    type Out = S<0>;
}
impl EmbeddingRule<R> for R {
    type Out = R;
}
impl EmbeddingRule<R> for I {
    type Out = R;
}
impl EmbeddingRule<I> for I {
    type Out = I;
}

impl CrossEntropyRule<S<1>> for R {
    type Out = I;
}
impl CrossEntropyRule<S<1>> for I {
    type Out = I;
}
impl CrossEntropyRule<S<0>> for S<0> {
    type Out = S<0>;
}
impl CrossEntropyRule<R> for R {
    type Out = R;
}
impl CrossEntropyRule<I> for I {
    type Out = I;
}

// ---------------------------------------------------------------------------------------
// Ragged rows (MoE dispatched tokens) and the MoE ops
// ---------------------------------------------------------------------------------------
//
// A `Ragged<B>` axis holds a data-dependent number of rows per rank; the value is the
// concatenation of the ranks' rows. Row-wise ops keep it (each row is computed alone),
// a product of two ragged operands keeps it (the same rows), a sum over the rows is the
// sum of the ranks' local sums (`Partial<Sum>`); a mean or max over the rows, a transpose
// and anything that mixes rows has no rule.

/// `Ragged<B>` rules of the existing tables, generic over the brand.
macro_rules! ragged_rules {
    () => {
        impl<B: Brand> MulRule<Ragged<B>> for Ragged<B> {
            type Out = Ragged<B>;
        }
        impl<B: Brand> DivRule<Ragged<B>> for Ragged<B> {
            type Out = Ragged<B>;
        }
        impl<B: Brand> AddRowRule<Ragged<B>> for R {}
        impl<B: Brand> MulRowRule<Ragged<B>> for R {
            type Out = Ragged<B>;
        }
        impl<B: Brand> SumRule<0> for Ragged<B> {
            type Out = P;
        }
        impl<B: Brand> ExpandTo<0, Ragged<B>> for R {}
        ragged_rules!(@dims 1, 2, 3);
    };
    (@dims $($d:literal),*) => {$(
        impl<B: Brand> SumRule<$d> for Ragged<B> { type Out = Ragged<B>; }
        impl<B: Brand> MeanRule<$d> for Ragged<B> { type Out = Ragged<B>; }
        impl<B: Brand> MaxRule<$d> for Ragged<B> { type Out = Ragged<B>; }
        impl<B: Brand> ExpandTo<$d, Ragged<B>> for Ragged<B> {}
        impl<B: Brand> NotSplitOn<$d> for Ragged<B> {}
        impl<B: Brand> NormRule<Ragged<B>, $d> for R {}
    )*};
}
ragged_rules!();
impl<B: Brand> SplitRule<1> for Ragged<B> {
    type Out = Ragged<B>;
}
impl<B: Brand> SplitRule<2> for Ragged<B> {
    type Out = Ragged<B>;
}
impl<B: Brand> MergeRule<1> for Ragged<B> {
    type Out = Ragged<B>;
}
impl<B: Brand> MergeRule<2> for Ragged<B> {
    type Out = Ragged<B>;
}

#[allow(dead_code)]
fn ragged_rules_close() {
    type Rg = Ragged<()>;
    fn mul<A: PlacementType, B2: MulClosed<A> + DivClosed<A>>() {}
    fn rows<X: PlacementType, W: MulRowClosed<X> + AddRowClosed<X> + NormClosed<X>>() {}
    fn sums<const D: usize, X: SumClosed<D>>() {}
    fn means<const D: usize, X: MeanClosed<D>>() {}
    fn split<const D: usize, X: SplitClosed<D>>() {}
    fn local<X: LocalLinearClosed>() {}
    mul::<Rg, Rg>();
    rows::<Rg, R>();
    sums::<0, Rg>();
    sums::<1, Rg>();
    means::<1, Rg>();
    split::<1, Rg>();
    local::<Rg>();
}

/// Tokens an MoE dispatch reads on the expert axis: `Shard<0>` (each rank routes its own
/// tokens).
#[diagnostic::on_unimplemented(
    message = "an MoE dispatch takes tokens `Shard<0>` over the expert axis, not `{Self}`",
    label = "each Ep rank must hold its own tokens (rows) here",
    note = "shard the tokens' rows over Ep (Ep doubles as a data axis for the dense layers)"
)]
pub trait ExpertTokens: PlacementType {}
impl ExpertTokens for S<0> {}

/// Dispatched tokens on the expert axis that the routing branded `B` dispatched.
#[diagnostic::on_unimplemented(
    message = "these tokens were not dispatched by this routing: the expert axis is `{Self}`, the routing combines `Ragged<{B}>`",
    label = "a combine that expects the dispatch of another routing",
    note = "combine (and the grouped matmul's counts) must use the routing whose dispatch made these rows: its brand is in the layout"
)]
pub trait DispatchedBy<B: Brand>: PlacementType {}
impl<B: Brand> DispatchedBy<B> for Ragged<B> {}
/// A second impl that no routing uses: with two candidates, rustc takes the brand from the
/// routing argument instead of inferring it from the rows (which would turn a mismatch
/// into a plain type error instead of [`DispatchedBy`]'s message).
impl<B: Brand> DispatchedBy<NotABrand<B>> for Ragged<B> {}

/// See [`DispatchedBy`]; never a routing's brand.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NotABrand<B>(std::marker::PhantomData<B>);

/// An MoE dispatch of tokens `[tokens, hidden]` by a routing branded `B`, on one axis: rows
/// that were `Shard<0>` become data-dependent (`Ragged<B>`: on the expert axis by the
/// all-to-all, on another data axis because each rank's routing keeps its own rows);
/// whole or partial tokens and split hidden columns move as they are.
#[diagnostic::on_unimplemented(
    message = "no MoE dispatch rule for tokens `{Self}` on a mesh axis",
    label = "dispatch moves whole rows: this placement cannot be dispatched",
    note = "per axis: S0→Ragged, R→R, I→I, P→P, S1→S1 (tokens are [tokens, hidden])"
)]
pub trait DispatchRule<B: Brand>: PlacementType {
    /// The dispatched rows' placement on this axis.
    type Out: PlacementType;
}
impl<B: Brand> DispatchRule<B> for S<0> {
    type Out = Ragged<B>;
}
impl<B: Brand> DispatchRule<B> for R {
    type Out = R;
}
impl<B: Brand> DispatchRule<B> for I {
    type Out = I;
}
impl<B: Brand> DispatchRule<B> for P {
    type Out = P;
}
impl<B: Brand> DispatchRule<B> for S<1> {
    type Out = S<1>;
}

/// The inverse move (a combine without gates, a dispatch's backward): rows go home.
#[diagnostic::on_unimplemented(
    message = "no MoE combine rule for expert outputs `{Self}` on a mesh axis",
    label = "combine moves whole rows back: this placement cannot be combined",
    note = "per axis: Ragged→S0, R→R, I→I, P→P, S1→S1"
)]
pub trait UndispatchRule: PlacementType {
    /// The placement of the rows back home on this axis.
    type Out: PlacementType;
}
impl<B: Brand> UndispatchRule for Ragged<B> {
    type Out = S<0>;
}
impl UndispatchRule for R {
    type Out = R;
}
impl UndispatchRule for I {
    type Out = I;
}
impl UndispatchRule for P {
    type Out = P;
}
impl UndispatchRule for S<1> {
    type Out = S<1>;
}

/// An MoE combine on one axis: expert outputs `Y` (`[routed rows, hidden]`) moved home and
/// summed per token weighted by gates placed `Self` (`[tokens, k]`).
#[diagnostic::on_unimplemented(
    message = "no MoE combine rule for expert outputs `{Y}` with gates `{Self}` on a mesh axis",
    label = "the gates' placement does not match the outputs'",
    note = "per axis: (Ragged, S0)→S0, (R, R)→R, (I, I)→I, (P, R)→P (row-parallel experts), (S1, R)→S1"
)]
pub trait CombineRule<Y: PlacementType>: PlacementType {
    /// The combined tokens' placement (`[tokens, hidden]`) on this axis.
    type Out: PlacementType;
}
impl<B: Brand> CombineRule<Ragged<B>> for S<0> {
    type Out = S<0>;
}
impl CombineRule<R> for R {
    type Out = R;
}
impl CombineRule<I> for I {
    type Out = I;
}
impl CombineRule<P> for R {
    type Out = P;
}
impl CombineRule<S<1>> for R {
    type Out = S<1>;
}

/// Closure of a dispatch: its backward is the reverse move of the output's gradient,
/// placed as the input's dual.
pub trait DispatchClosed<B: Brand>: DispatchRule<B> {}
impl<B: Brand, X> DispatchClosed<B> for X
where
    X: DispatchRule<B>,
    GradOf<<X as DispatchRule<B>>::Out>: UndispatchRule<Out = GradOf<X>>,
{
}

/// Closure of a combine (`Self` is the gates' placement): the outputs' gradient is the
/// output gradient, scaled per row by the gates and dispatched again (placed as `Y`'s
/// dual); the gates' gradient is the row-wise dot of the output gradient with the outputs
/// moved home (a product, then a sum over dim 1), placed as the gates' dual.
pub trait CombineClosed<Y: PlacementType, B: Brand>: CombineRule<Y> {}
impl<B: Brand, Y, G> CombineClosed<Y, B> for G
where
    Y: UndispatchRule,
    G: CombineRule<Y>,
    GradOf<<G as CombineRule<Y>>::Out>: DispatchRule<B, Out = GradOf<Y>>,
    GradOf<<G as CombineRule<Y>>::Out>: MulRule<<Y as UndispatchRule>::Out>,
    <GradOf<<G as CombineRule<Y>>::Out> as MulRule<<Y as UndispatchRule>::Out>>::Out:
        SumRule<1, Out = GradOf<G>>,
{
}
#[allow(dead_code)]
fn dispatch_combine_rules_close() {
    type Rg = Ragged<()>;
    fn dispatch<X: DispatchClosed<()>>() {}
    fn combine<Y: PlacementType, G: CombineClosed<Y, ()>>() {}
    dispatch::<S<0>>();
    dispatch::<R>();
    dispatch::<I>();
    dispatch::<P>();
    dispatch::<S<1>>();
    combine::<Rg, S<0>>();
    combine::<R, R>();
    combine::<I, I>();
    combine::<P, R>();
    combine::<S<1>, R>();
}

/// A grouped product on one axis: rows `X` (`[rows, in]`, grouped by local expert) times
/// each group's expert weight transposed, `W[e]ᵀ` (`[experts, out, in]`); implemented on
/// the weight's placement.
#[diagnostic::on_unimplemented(
    message = "no grouped-matmul rule for tokens `{X}` · expert weights `{Self}`ᵀ on a mesh axis",
    label = "these placements do not multiply without communication",
    note = "per axis (x[rows, in]·W[e, out, in]ᵀ): Ragged·S0→Ragged (expert parallel: this rank's experts), Ragged·R→Ragged (a data axis), R·R→R, I·I→I, R·S1→S1 (column-parallel experts), S1·S2→P (row-parallel experts)"
)]
pub trait GroupedMatmulRule<X: PlacementType>: PlacementType {
    /// The product's placement (`[rows, out]`) on this axis.
    type Out: PlacementType;
}
impl<B: Brand> GroupedMatmulRule<Ragged<B>> for S<0> {
    type Out = Ragged<B>;
}
impl<B: Brand> GroupedMatmulRule<Ragged<B>> for R {
    type Out = Ragged<B>;
}
impl GroupedMatmulRule<R> for R {
    type Out = R;
}
impl GroupedMatmulRule<I> for I {
    type Out = I;
}
impl GroupedMatmulRule<R> for S<1> {
    type Out = S<1>;
}
impl GroupedMatmulRule<S<1>> for S<2> {
    type Out = P;
}

/// The input gradient of a grouped product, `dx = dy·W[e]` per group, on one axis
/// (implemented on the weight's placement).
pub trait GroupedMatmulNRule<Dy: PlacementType>: PlacementType {
    /// The input gradient's placement (`[rows, in]`) on this axis.
    type Out: PlacementType;
}
impl<B: Brand> GroupedMatmulNRule<Ragged<B>> for S<0> {
    type Out = Ragged<B>;
}
impl<B: Brand> GroupedMatmulNRule<Ragged<B>> for R {
    type Out = Ragged<B>;
}
impl GroupedMatmulNRule<P> for R {
    type Out = P;
}
impl GroupedMatmulNRule<I> for I {
    type Out = I;
}
impl GroupedMatmulNRule<S<1>> for S<1> {
    type Out = P;
}
impl GroupedMatmulNRule<R> for S<2> {
    type Out = S<1>;
}

/// The weight gradient of a grouped product, `dW[e] = Σ_rows of group e dyᵀ·x`, on one axis
/// (implemented on the weight's placement `Self`, with the output gradient `Dy` and the
/// rows `X`). Ragged rows over an axis where the weight is `Shard<0>` (the expert axis)
/// are *all* the rows of this rank's experts (the dispatch sent every routed copy to its
/// expert's owner), so the gradient is whole: `Shard<0>`. Over an axis where the weight is
/// replicated (a data axis) each rank holds some rows of every expert: `Partial`.
pub trait GroupedWeightGrad<Dy: PlacementType, X: PlacementType>: PlacementType {
    /// The weight gradient's placement (`[experts, out, in]`) on this axis.
    type Out: PlacementType;
}
impl<B: Brand> GroupedWeightGrad<Ragged<B>, Ragged<B>> for S<0> {
    type Out = S<0>;
}
impl<B: Brand> GroupedWeightGrad<Ragged<B>, Ragged<B>> for R {
    type Out = P;
}
impl GroupedWeightGrad<P, R> for R {
    type Out = P;
}
impl GroupedWeightGrad<I, I> for I {
    type Out = I;
}
impl GroupedWeightGrad<S<1>, R> for S<1> {
    type Out = S<1>;
}
impl GroupedWeightGrad<R, S<1>> for S<2> {
    type Out = S<2>;
}

/// Closure of a grouped product: `dx` and `dW` are placed as the duals of `x` and `W`.
pub trait GroupedMatmulClosed<X: PlacementType>: GroupedMatmulRule<X> {}
impl<X, W> GroupedMatmulClosed<X> for W
where
    X: PlacementType,
    W: GroupedMatmulRule<X>
        + GroupedMatmulNRule<GradOf<<W as GroupedMatmulRule<X>>::Out>, Out = GradOf<X>>
        + GroupedWeightGrad<GradOf<<W as GroupedMatmulRule<X>>::Out>, X, Out = GradOf<W>>,
{
}
#[allow(dead_code)]
fn grouped_matmul_rules_close() {
    type Rg = Ragged<()>;
    fn closed<X: PlacementType, W: GroupedMatmulClosed<X>>() {}
    closed::<Rg, S<0>>();
    closed::<Rg, R>();
    closed::<R, R>();
    closed::<I, I>();
    closed::<R, S<1>>();
    closed::<S<1>, S<2>>();
}

// ---------------------------------------------------------------------------------------
// Lifted over layouts
// ---------------------------------------------------------------------------------------

/// Lifts a binary per-axis rule with an output (`Self`: the right operand) over two
/// layouts with the same axes in the same order.
macro_rules! lift_binary {
    ($(#[$m:meta])* $layout:ident, $rule:ident, $alias:ident) => {
        $(#[$m])*
        pub trait $layout<LA: Layout>: Layout {
            /// The result's layout: each axis's placement is the per-axis rule's `Out` for the two
            /// operands' placements on that axis.
            type Out: Layout;
        }
        impl $layout<()> for () {
            type Out = ();
        }
        impl<X: MeshAxis, PA: PlacementType, PB: $rule<PA>, RA: Layout, RB: $layout<RA>>
            $layout<(On<X, PA>, RA)> for (On<X, PB>, RB)
        {
            type Out = (On<X, <PB as $rule<PA>>::Out>, <RB as $layout<RA>>::Out);
        }
        #[doc = concat!("The layout [`", stringify!($layout), "`] gives.")]
        pub type $alias<LA, LB> = <LB as $layout<LA>>::Out;
    };
}

/// Lifts a binary per-axis predicate (the output keeps the left layout).
macro_rules! lift_predicate {
    ($(#[$m:meta])* $layout:ident, $rule:ident $(, const $d:ident)?) => {
        $(#[$m])*
        pub trait $layout<LX: Layout $(, const $d: usize)?>: Layout {}
        impl$(<const $d: usize>)? $layout<() $(, $d)?> for () {}
        impl<X: MeshAxis, PX: PlacementType, PB: $rule<PX $(, $d)?>, RX: Layout, RB: $layout<RX $(, $d)?> $(, const $d: usize)?>
            $layout<(On<X, PX>, RX) $(, $d)?> for (On<X, PB>, RB)
        {
        }
    };
}

/// Lifts a unary per-axis rule over dim `D` with an output.
macro_rules! lift_unary_dim {
    ($(#[$m:meta])* $layout:ident, $rule:ident, $alias:ident) => {
        $(#[$m])*
        pub trait $layout<const D: usize>: Layout {
            /// The result's layout: each axis's placement is the per-axis rule's `Out`.
            type Out: Layout;
        }
        impl<const D: usize> $layout<D> for () {
            type Out = ();
        }
        impl<X: MeshAxis, P: $rule<D>, Rest: $layout<D>, const D: usize> $layout<D> for (On<X, P>, Rest) {
            type Out = (On<X, <P as $rule<D>>::Out>, <Rest as $layout<D>>::Out);
        }
        #[doc = concat!("The layout [`", stringify!($layout), "`] gives.")]
        pub type $alias<L, const D: usize> = <L as $layout<D>>::Out;
    };
}

lift_binary!(
    /// `A·B` over every axis (`Self` is `B`'s layout).
    #[diagnostic::on_unimplemented(
        message = "cannot multiply a DTensor laid out as `{LA}` by one laid out as `{Self}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    MatmulLayout, MatmulRule, MatmulOut
);
lift_binary!(
    /// `A·Wᵀ` over every axis (`Self` is `W`'s layout).
    #[diagnostic::on_unimplemented(
        message = "cannot multiply a DTensor laid out as `{LA}` by the transpose of one laid out as `{Self}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    MatmulTLayout, MatmulTRule, MatmulTOut
);
lift_binary!(
    /// `A[b]·B[b]` over every axis.
    #[diagnostic::on_unimplemented(
        message = "cannot batch-multiply a DTensor laid out as `{LA}` by one laid out as `{Self}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    BatchedMatmulLayout, BatchedMatmulRule, BatchedMatmulOut
);
lift_binary!(
    /// `a⊙b` over every axis.
    #[diagnostic::on_unimplemented(
        message = "cannot multiply elementwise a DTensor laid out as `{LA}` by one laid out as `{Self}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    MulLayout, MulRule, MulOut
);
lift_binary!(
    /// `a/b` over every axis.
    #[diagnostic::on_unimplemented(
        message = "cannot divide a DTensor laid out as `{LA}` by one laid out as `{Self}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    DivLayout, DivRule, DivOut
);
lift_binary!(
    /// `table[ids]` over every axis (`Self` is the ids' layout).
    #[diagnostic::on_unimplemented(
        message = "cannot look up ids laid out as `{Self}` in a table laid out as `{LA}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    EmbeddingLayout, EmbeddingRule, EmbeddingOut
);
lift_binary!(
    /// Per-token cross-entropy over every axis (`Self` is the targets' layout).
    #[diagnostic::on_unimplemented(
        message = "cannot score logits laid out as `{LA}` against targets laid out as `{Self}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    CrossEntropyLayout, CrossEntropyRule, CrossEntropyOut
);
lift_binary!(
    /// `x · w` along the rows over every axis (`Self` is the scale's layout).
    #[diagnostic::on_unimplemented(
        message = "cannot scale rows laid out as `{LA}` by a per-column DTensor laid out as `{Self}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    MulRowLayout, MulRowRule, MulRowOut
);
lift_predicate!(
    /// `x + bias` along the rows over every axis (`Self` is the bias's layout).
    #[diagnostic::on_unimplemented(
        message = "cannot add a bias laid out as `{Self}` to rows laid out as `{LX}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    AddRowLayout, AddRowRule
);
lift_predicate!(
    /// A norm weight (or bias) laid out as `Self` for an input laid out as `LX`, normalized
    /// over dim `D`.
    #[diagnostic::on_unimplemented(
        message = "cannot normalize an input laid out as `{LX}` with a weight laid out as `{Self}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    NormLayout, NormRule, const D
);
lift_unary_dim!(
    /// Dim `D` split in two, every axis.
    SplitLayout, SplitRule, SplitOut
);
lift_unary_dim!(
    /// Dims `D` and `D + 1` merged, every axis.
    MergeLayout, MergeRule, MergeOut
);
lift_unary_dim!(
    /// A sum over dim `D`, every axis.
    SumLayout, SumRule, SumOut
);
lift_unary_dim!(
    /// A mean over dim `D`, every axis.
    MeanLayout, MeanRule, MeanOut
);
lift_unary_dim!(
    /// A max over dim `D`, every axis.
    MaxLayout, MaxRule, MaxOut
);

lift_binary!(
    /// Grouped `x·W[e]ᵀ` over every axis (`Self` is the expert weights' layout).
    #[diagnostic::on_unimplemented(
        message = "cannot multiply tokens laid out as `{LA}` by expert weights laid out as `{Self}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    GroupedMatmulLayout, GroupedMatmulRule, GroupedMatmulOut
);
lift_binary!(
    /// An MoE combine over every axis (`Self` is the gates' layout, `LA` the expert
    /// outputs').
    #[diagnostic::on_unimplemented(
        message = "cannot combine expert outputs laid out as `{LA}` with gates laid out as `{Self}`",
        label = "the layouts are over different mesh axes",
        note = "both operands need the same mesh axes in the same order"
    )]
    CombineLayout, CombineRule, CombineOut
);

/// An MoE dispatch by a routing branded `B`, over every axis.
#[diagnostic::on_unimplemented(
    message = "cannot dispatch tokens laid out as `{Self}`",
    label = "an axis of these tokens has no dispatch rule"
)]
pub trait DispatchLayout<B: Brand>: Layout {
    /// The dispatched rows' layout: each axis as [`DispatchRule`] places it.
    type Out: Layout;
}
impl<B: Brand> DispatchLayout<B> for () {
    type Out = ();
}
impl<B: Brand, X: MeshAxis, P: DispatchRule<B>, Rest: DispatchLayout<B>> DispatchLayout<B>
    for (On<X, P>, Rest)
{
    type Out = (
        On<X, <P as DispatchRule<B>>::Out>,
        <Rest as DispatchLayout<B>>::Out,
    );
}
/// The layout [`DispatchLayout`] gives.
pub type DispatchOut<L, B> = <L as DispatchLayout<B>>::Out;

/// Every axis holds dim `D` whole and no pending sums (softmax, log-softmax over `D`).
pub trait NotSplitLayout<const D: usize>: Layout {}
impl<const D: usize> NotSplitLayout<D> for () {}
impl<X: MeshAxis, P: NotSplitOn<D>, Rest: NotSplitLayout<D>, const D: usize> NotSplitLayout<D>
    for (On<X, P>, Rest)
{
}

/// A 2-D transpose over every axis.
pub trait TransposeLayout: Layout {
    /// The transpose's layout: each axis as [`TransposeRule`] places it.
    type T: Layout;
}
impl TransposeLayout for () {
    type T = ();
}
impl<X: MeshAxis, P: TransposeRule, Rest: TransposeLayout> TransposeLayout for (On<X, P>, Rest) {
    type T = (On<X, P::T>, Rest::T);
}
/// The layout of a 2-D tensor's transpose.
pub type Transposed<L> = <L as TransposeLayout>::T;

/// A 3-D tensor's last two dims swapped, over every axis.
pub trait TransposeLastLayout: Layout {
    /// The layout with the last two dims swapped: each axis as [`TransposeLastRule`] places it.
    type T: Layout;
}
impl TransposeLastLayout for () {
    type T = ();
}
impl<X: MeshAxis, P: TransposeLastRule, Rest: TransposeLastLayout> TransposeLastLayout
    for (On<X, P>, Rest)
{
    type T = (On<X, P::T>, Rest::T);
}

/// Every axis may feed fused attention (see [`AttentionRule`]).
pub trait AttentionLayout: Layout {}
impl AttentionLayout for () {}
impl<X: MeshAxis, P: AttentionRule<X::Role>, Rest: AttentionLayout> AttentionLayout
    for (On<X, P>, Rest)
{
}

/// Every axis `Partial<Sum>` or `Invariant`: a loss `backward()` can seed exactly.
pub trait LossLayout: Layout {}
impl LossLayout for () {}
impl<X: MeshAxis, P: LossPlacement, Rest: LossLayout> LossLayout for (On<X, P>, Rest) {}

/// Two layouts are the same type (an elementwise op whose operands must match exactly,
/// such as swiglu's gate and up).
#[diagnostic::on_unimplemented(
    message = "operand laid out as `{Self}`, but this op needs `{L}` (the other operand's)",
    label = "the layouts differ",
    note = "both operands of this op need the same placement on every mesh axis"
)]
pub trait SameAs<L>: Layout {}
impl<L: Layout> SameAs<L> for L {}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::axis::{Dp, Tp};
    use crate::layout;
    use crate::placement::Placement;
    use crate::PartialOp;

    fn placements<L: Layout>() -> Vec<Placement> {
        L::placements().to_vec()
    }

    #[test]
    fn column_then_row_matmul_t_gives_partial_over_tp() {
        type X = layout![Dp: Shard<0>, Tp: Replicate];
        type Wc = layout![Dp: Replicate, Tp: Shard<0>];
        type Wr = layout![Dp: Replicate, Tp: Shard<1>];
        type H = MatmulTOut<X, Wc>;
        type Y = MatmulTOut<H, Wr>;
        assert_eq!(
            placements::<H>(),
            [Placement::Shard(0), Placement::Shard(1)]
        );
        assert_eq!(
            placements::<Y>(),
            [Placement::Shard(0), Placement::Partial(PartialOp::Sum)]
        );
    }

    #[test]
    fn reductions_move_shard_dims_and_make_partials() {
        type L = layout![Dp: Shard<0>, Tp: Shard<2>];
        assert_eq!(
            placements::<SumOut<L, 0>>(),
            [Placement::Partial(PartialOp::Sum), Placement::Shard(1)]
        );
        assert_eq!(
            placements::<MeanOut<L, 2>>(),
            [Placement::Shard(0), Placement::Partial(PartialOp::Avg)]
        );
        assert_eq!(
            placements::<MaxOut<L, 1>>(),
            [Placement::Shard(0), Placement::Shard(1)]
        );
    }

    #[test]
    fn vocab_parallel_loss_is_invariant_over_tp() {
        type Logits = layout![Dp: Shard<0>, Tp: Shard<1>];
        type Targets = layout![Dp: Shard<0>, Tp: Invariant];
        type Loss = CrossEntropyOut<Logits, Targets>;
        assert_eq!(
            placements::<Loss>(),
            [Placement::Shard(0), Placement::Invariant]
        );
        type Summed = SumOut<Loss, 0>;
        fn is_loss<L: LossLayout>() {}
        is_loss::<Summed>();
    }
}
