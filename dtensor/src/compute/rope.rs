//! Rotary position embedding on a distributed `[tokens, heads·head_dim]` tensor (q, k, or
//! the q and k heads of a fused QKV through [`Rope::heads`]):
//! [`DTensor::rope`] and its twin `Var::rope`, the kernel
//! [`ops::rope`](mod@dtensor_kernels::ops::rope) (its docs have the formulas) run on every
//! rank's piece with that piece's rows at their *global* positions.
//!
//! # Where a row's position comes from
//!
//! A rank finds each local row's global row index from the layout (the rows it holds of dim
//! 0, `Shard<0>` over any axes, nested in mesh order), and [`RopePositions`] maps a global
//! row to its position:
//!
//! | [`RopePositions`] | global row `g` of `T` is at | for |
//! |---|---|---|
//! | [`Sequential`](RopePositions::Sequential) `{ seq_len, offset }` | `offset + g mod seq_len` | samples one after another (a pipeline microbatch is whole samples: the same rule) |
//! | [`ContextParallel`](RopePositions::ContextParallel) `{ layout, blocks, offset }` | `offset +` the position in its sample of the token at CP-order index `g` ([`CpLayout`]: zigzag or contiguous chunks, `blocks` data blocks) | a tensor in CP token order, `Shard<0>` over `Cp` (and data axes left of it) |
//! | [`Explicit`](RopePositions::Explicit) | `ids[g]` | packed documents whose positions restart ([`RopePositions::documents`]), or any other order: ids in the tensor's own row order |
//!
//! # Placements
//!
//! Per axis ([`RopeRule`], defined below): `Shard<0>` (tokens),
//! `Shard<1>` (whole heads, whole runs of [`RotatedHeads::group`](ops::RotatedHeads) of
//! them: a rank's columns must start and end on a group boundary, checked when it runs),
//! `Replicate`, `Invariant`, and `Partial<Sum>` / `Partial<Avg>` (RoPE is
//! linear: rotating every term rotates their sum). The output keeps the layout; no
//! communication, forward or backward (the backward is the transposed rotation,
//! [`ops::rope_backward`], on the local gradient).
//! Every rank computes its rows exactly as one rank would compute them in the whole
//! tensor, so the result is bitwise one rank's.

// ---------------------------------------------------------------------------------------
// RoPE's placement rule. It lives beside its op (no other op uses it); the rules several
// ops share, and the types it is built from, are in `dtensor_placement::rules`. Paths are
// written out so this block does not touch the file's imports below.
// ---------------------------------------------------------------------------------------

/// Rotary position embedding of `[tokens, heads·head_dim]` rows on one axis: the op is
/// linear in its input and mixes columns only inside a head, and each row turns by its own
/// position, read from the row's global index. So the tokens may be split (`Shard<0>`,
/// whatever the axis's role: under `Cp` the positions follow the CP token order), the columns
/// split by whole heads (`Shard<1>`, checked when it runs), the tensor whole, or pending
/// sums (`Partial<Sum>`, `Partial<Avg>`: rotating each term rotates the sum). The output
/// keeps the placement.
///
/// A `Ragged` axis has no rule: its rows were routed to experts and their global index (so
/// their position) is gone. Nor has a max/min `Partial`, which does not rotate linearly.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot feed RoPE: it rotates each row by its position, read from the row's global index, and needs terms that add linearly",
    label = "RoPE reads this axis's rows at their global positions",
    note = "per axis: Shard<0> (tokens), Shard<1> (whole heads), Replicate, Invariant, Partial<Sum> or Partial<Avg>; a Ragged axis (rows routed to experts) has lost its positions, and a max/min Partial must be reduced first"
)]
pub trait RopeRule: dtensor_placement::PlacementType {}
impl<const D: usize> RopeRule for dtensor_placement::Shard<D> {}
impl RopeRule for dtensor_placement::Replicate {}
impl RopeRule for dtensor_placement::Invariant {}
impl RopeRule for dtensor_placement::Partial<dtensor_placement::Sum> {}
impl RopeRule for dtensor_placement::Partial<dtensor_placement::Avg> {}

/// Closure of RoPE under duality: the output keeps the input's placement and the backward
/// is the transposed rotation of the output's gradient, so that gradient's placement (the
/// dual) must again be one RoPE takes, and gives itself back. `Var::rope` types its input's
/// gradient as the dual on that ground.
pub trait RopeClosed: RopeRule {}
impl<X> RopeClosed for X
where
    X: RopeRule,
    dtensor_placement::GradOf<X>: RopeRule,
{
}

/// Every placement [`RopeRule`] admits is [`RopeClosed`]: a rule that did not close would
/// make this crate fail to build, as the shared tables' checks do in `dtensor_placement`.
#[allow(dead_code)]
fn rope_rules_close() {
    use dtensor_placement::{Avg, Invariant, Partial, Replicate, Shard, Sum};
    fn closed<X: RopeClosed>() {}
    closed::<Replicate>();
    closed::<Invariant>();
    closed::<Partial<Sum>>();
    closed::<Partial<Avg>>();
    closed::<Shard<0>>();
    closed::<Shard<1>>();
}

/// Every axis of the layout may feed RoPE (see [`RopeRule`]).
pub trait RopeLayout: dtensor_placement::Layout {}
impl RopeLayout for () {}
impl<X, P, Rest> RopeLayout for (dtensor_placement::On<X, P>, Rest)
where
    X: dtensor_placement::MeshAxis,
    P: RopeRule,
    Rest: RopeLayout,
{
}

// ---------------------------------------------------------------------------------------

use super::{local_range, output};
use crate::any::AnyDTensor;
use crate::context::CpLayout;
use crate::error::{Error, Result};
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::ops::{self, Rope, RopeTables};
use dtensor_placement::Layout;
use std::ops::Range;
use std::sync::Arc;

const OP: &str = "DTensor::rope";
const OP_BACK: &str = "Var::rope (backward)";

/// Where each global row of a RoPE input sits in its sequence (see the
/// [module docs](self)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RopePositions {
    /// Rows are samples of `seq_len` tokens one after another: global row `g` is at
    /// `offset + g mod seq_len`.
    Sequential {
        /// Tokens per sample.
        seq_len: usize,
        /// Added to every position (a continuation's start, say).
        offset: usize,
    },
    /// Rows in the CP token order of `layout` over `blocks` data blocks (as
    /// [`CpLayout::to_cp_order`] arranges them): global row `g` is at `offset` plus the
    /// position in its sample of the natural-order token that CP index `g` holds.
    ContextParallel {
        /// The chunking of each sample over the `Cp` ranks.
        layout: CpLayout,
        /// The data blocks the tokens were ordered in (the product of the sizes of the
        /// axes that shard the tokens outside `Cp`; 1 without data parallelism).
        blocks: usize,
        /// Added to every position.
        offset: usize,
    },
    /// One position per global row, in the tensor's row order.
    Explicit(Arc<[usize]>),
}

impl RopePositions {
    /// Samples of `seq_len` tokens from position 0.
    pub fn sequential(seq_len: usize) -> RopePositions {
        RopePositions::Sequential { seq_len, offset: 0 }
    }

    /// The positions of packed documents of the given lengths, one after another, each
    /// restarting at 0 (`[3, 2]` gives `0, 1, 2, 0, 1`).
    pub fn documents(lengths: &[usize]) -> RopePositions {
        RopePositions::Explicit(lengths.iter().flat_map(|&n| 0..n).collect())
    }

    /// The positions of global rows `rows` of a tensor with `tokens` global rows. `Err`
    /// (naming `op`) unless the rule covers `tokens` rows: whole samples for `Sequential`
    /// (`seq_len > 0`), `blocks` equal blocks of whole samples for `ContextParallel`, one
    /// id per row for `Explicit`.
    pub fn of_rows(&self, rows: Range<usize>, tokens: usize) -> Result<Vec<usize>> {
        self.rows_for(OP, rows, tokens)
    }

    fn rows_for(&self, op: &'static str, rows: Range<usize>, tokens: usize) -> Result<Vec<usize>> {
        let bad = |detail: String| Err(Error::ShapeMismatch { op, detail });
        match self {
            RopePositions::Sequential { seq_len, offset } => {
                if *seq_len == 0 {
                    return bad("RopePositions::Sequential needs seq_len > 0".into());
                }
                Ok(rows.map(|g| offset + g % seq_len).collect())
            }
            RopePositions::ContextParallel {
                layout,
                blocks,
                offset,
            } => {
                let s = layout.seq_len();
                if *blocks == 0
                    || !tokens.is_multiple_of(*blocks)
                    || !(tokens / blocks).is_multiple_of(s)
                {
                    return bad(format!(
                        "{tokens} tokens are not {blocks} equal blocks of whole samples of {s} tokens (the CP order of RopePositions::ContextParallel)"
                    ));
                }
                let block = tokens / blocks;
                let per = layout.tokens_per_rank();
                let run = (block / s) * per; // one CP rank's tokens of a block
                let n = layout.chunk_len();
                Ok(rows
                    .map(|g| {
                        let k = g % block;
                        let (c, j) = (k / run, k % per);
                        // `CpLayout::positions(c)[j]`, without building the list.
                        let chunk = match (layout.zigzag(), j < n) {
                            (false, _) | (true, true) => c,
                            (true, false) => 2 * layout.cp() - 1 - c,
                        };
                        offset + chunk * n + j % n
                    })
                    .collect())
            }
            RopePositions::Explicit(ids) => {
                if ids.len() != tokens {
                    return bad(format!(
                        "{} explicit positions for a tensor of {tokens} rows (one per global row)",
                        ids.len()
                    ));
                }
                Ok(ids[rows].to_vec())
            }
        }
    }
}

fn describe(t: &AnyDTensor) -> String {
    let p: Vec<String> = t.placements().iter().map(|p| p.to_string()).collect();
    format!(
        "global {:?} (local {:?}) laid out as [{}]",
        t.global_shape(),
        t.local_shape(),
        p.join(", ")
    )
}

/// This rank's rows' positions, after checking that its piece is whole heads of 2-D rows.
fn local_positions(a: &AnyDTensor, cfg: &Rope, positions: &RopePositions) -> Result<Vec<usize>> {
    let bad = |detail: String| Err(Error::ShapeMismatch { op: OP, detail });
    if a.global_shape().len() != 2 {
        return bad(format!(
            "x must be 2-D [tokens, heads·head_dim], got {}",
            describe(a)
        ));
    }
    // The rotated heads repeat every group: a rank's columns must be whole groups for its
    // local heads to fall where the kernel's pattern says.
    let (d, group) = (cfg.head_dim, cfg.heads.group);
    let run = d.saturating_mul(group);
    let cols = local_range(a, 1)?;
    let whole = |n: usize| n.is_multiple_of(run);
    if run == 0 || !whole(a.global_shape()[1]) || !whole(cols.start) || !whole(cols.len()) {
        return bad(format!(
            "this rank holds columns {cols:?} of {}: not whole runs of {group} head(s) of head_dim {d} (shard the columns at group boundaries: groups divisible by the ranks)",
            describe(a)
        ));
    }
    positions.rows_for(OP, local_range(a, 0)?, a.global_shape()[0])
}

impl<L: Layout> DTensor<L> {
    /// Rotary position embedding of `[tokens, heads·head_dim]` rows (q or k), each row at
    /// its global position as `positions` says, laid out as the input (see the
    /// [module docs](crate::compute::rope)). `Err` (naming the op, shapes and placements) unless the
    /// tensor is 2-D, every rank holds whole heads, the positions cover the global rows, and
    /// `cfg` is valid.
    pub fn rope(&self, cfg: &Rope, positions: &RopePositions) -> Result<DTensor<L>>
    where
        L: RopeLayout,
    {
        Ok(forward(self, cfg, positions)?.0)
    }
}

/// The forward, with the cos/sin tables of this rank's rows (which the backward reuses).
fn forward<L: Layout>(
    x: &DTensor<L>,
    cfg: &Rope,
    positions: &RopePositions,
) -> Result<(DTensor<L>, RopeTables)> {
    let a = x.as_any();
    let pos = local_positions(a, cfg, positions)?;
    let tables = RopeTables::new(cfg, &pos, a.as_local())?;
    let y = output(
        OP,
        ops::rope_with(a.as_local(), &tables, cfg)?,
        a.global_shape(),
        a,
    )?;
    Ok((y, tables))
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::rope`]; the backward rotates the output's gradient back (the transposed
    /// rotation by the forward's own cos/sin tables), with no communication.
    pub fn rope(&self, cfg: &Rope, positions: &RopePositions) -> Result<Var<'t, L>>
    where
        L: RopeLayout,
    {
        let (y, tables) = forward(self.value(), cfg, positions)?;
        let cfg = *cfg;
        // The backward needs the tables only: the input is not kept (the gradient has its
        // shape, so it describes the result).
        Ok(self.unary(y, false, move |dy| {
            let dx = ops::rope_backward_with(dy.as_local(), &tables, &cfg)?;
            grad_of(OP_BACK, dx, dy.as_any())
        }))
    }
}
