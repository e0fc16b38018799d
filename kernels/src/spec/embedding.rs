//! Embedding lookups: the vocab shard a table holds, and the checks of tables, ids and
//! output gradients.

use super::*;
use crate::Shape;

/// Which rows of the full embedding table one rank holds: rows `start..start + len` of a
/// table with `vocab` rows (Megatron's `vocab_start_index` / `vocab_end_index`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct VocabShard {
    /// The global id of this rank's first row.
    pub start: usize,
    /// The number of rows this rank holds (the local table's first extent; 0 is allowed).
    pub len: usize,
    /// The number of rows of the full table; every id must lie in `0..vocab`.
    pub vocab: usize,
}

impl VocabShard {
    /// The whole table: rows `0..vocab`.
    pub fn full(vocab: usize) -> Self {
        VocabShard {
            start: 0,
            len: vocab,
            vocab,
        }
    }

    pub(crate) fn check(&self, op: &'static str) -> Result<()> {
        if self
            .start
            .checked_add(self.len)
            .is_none_or(|end| end > self.vocab)
        {
            return Err(Error::Invalid {
                op,
                detail: format!(
                    "vocab shard rows {}..{}+{} exceed vocab {}",
                    self.start, self.start, self.len, self.vocab
                ),
            });
        }
        Ok(())
    }

    /// The local row of a valid global id, or `None` if another rank holds it.
    #[inline]
    pub(crate) fn local(&self, id: usize) -> Option<usize> {
        id.checked_sub(self.start).filter(|&r| r < self.len)
    }
}

/// The ids (i64 or i32, in host memory) as i64, unchecked.
pub(crate) fn raw_ids(op: &'static str, ids: &Tensor) -> Result<Vec<i64>> {
    match ids.dtype() {
        DType::I64 => Ok(ids.as_slice::<i64>()?.to_vec()),
        DType::I32 => Ok(ids.as_slice::<i32>()?.iter().map(|&i| i as i64).collect()),
        other => Err(Error::Invalid {
            op,
            detail: format!("ids must be i64 or i32, got {other}"),
        }),
    }
}

/// The ids as `usize`, each checked against `0..vocab`.
pub(crate) fn read_ids(op: &'static str, ids: &Tensor, vocab: usize) -> Result<Vec<usize>> {
    let raw = raw_ids(op, ids)?;
    raw.iter()
        .enumerate()
        .map(|(pos, &id)| {
            usize::try_from(id)
                .ok()
                .filter(|&i| i < vocab)
                .ok_or_else(|| Error::Invalid {
                    op,
                    detail: format!(
                        "id {id} at flat position {pos} of ids {:?} is out of range for vocab {vocab}",
                        ids.shape()
                    ),
                })
        })
        .collect()
}

/// `[rows, hidden]` of a 2-D table.
pub(crate) fn table_dims<L: Layout + ?Sized>(
    op: &'static str,
    table: &L,
    rows: usize,
) -> Result<usize> {
    match table.shape() {
        &[r, h] if r == rows => Ok(h),
        _ => Err(Error::Invalid {
            op,
            detail: format!(
                "table must be [{rows}, hidden] (its rows of the vocab), got {:?}",
                table.shape()
            ),
        }),
    }
}

/// `ids.shape ++ [hidden]`.
pub(crate) fn out_shape(ids: &Tensor, hidden: usize) -> Shape {
    let mut s: Shape = ids.shape().into();
    s.push(hidden);
    s
}

/// `hidden`, after checking `dy` is `ids.shape ++ [hidden]`.
pub(crate) fn dy_hidden<L: Layout + ?Sized>(
    op: &'static str,
    dy: &L,
    ids: &Tensor,
) -> Result<usize> {
    match dy.shape().split_last() {
        Some((&h, lead)) if lead == ids.shape() => Ok(h),
        _ => Err(Error::ShapeMismatch {
            op,
            lhs: dy.shape().into(),
            rhs: ids.shape().into(),
        }),
    }
}
