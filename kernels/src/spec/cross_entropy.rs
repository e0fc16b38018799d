//! Cross-entropy's pieces: the logits' shape, the per-row statistics and the targets they
//! are checked against, alike for the host and the device.

use super::{check_dst, want_float, Layout};
use crate::spec::embedding::raw_ids;
use crate::{DType, Error, Result, Tensor};

/// `(rows, cols)` of float logits `[rows, cols]` (the local vocab columns).
pub(crate) fn logits_dims<L: Layout + ?Sized>(
    op: &'static str,
    logits: &L,
) -> Result<(usize, usize)> {
    want_float(op, logits)?;
    match *logits.shape() {
        [r, c] => Ok((r, c)),
        _ => Err(Error::Invalid {
            op,
            detail: format!("logits must be [rows, cols], got {:?}", logits.shape()),
        }),
    }
}

/// `Err` unless `t` is a per-row statistic: f64 `[rows]`.
pub(crate) fn check_stat<L: Layout + ?Sized>(op: &'static str, t: &L, rows: usize) -> Result<()> {
    check_dst(op, t, &[rows], DType::F64)
}

/// The targets (i64 or i32, in host memory), one per row: `Some(class)` for an id in
/// `0..vocab`, `None` for an id equal to the ignore index (checked first, so an ignore index
/// inside the vocab ignores that class); any other id is an `Err` naming it.
pub(crate) fn target_ids(
    op: &'static str,
    ids: &Tensor,
    rows: usize,
    vocab: usize,
    ignore_index: Option<i64>,
) -> Result<Vec<Option<usize>>> {
    let raw = raw_ids(op, ids)?;
    if raw.len() != rows {
        return Err(Error::Invalid {
            op,
            detail: format!("{} targets for {rows} rows", raw.len()),
        });
    }
    raw.iter()
        .enumerate()
        .map(|(row, &id)| {
            if ignore_index == Some(id) {
                return Ok(None);
            }
            match usize::try_from(id) {
                Ok(class) if class < vocab => Ok(Some(class)),
                _ => Err(Error::Invalid {
                    op,
                    detail: format!(
                        "target {id} of row {row} is out of range for vocab {vocab}{}",
                        match ignore_index {
                            Some(i) => format!(" and is not the ignore index {i}"),
                            None => " (no ignore index)".into(),
                        }
                    ),
                }),
            }
        })
        .collect()
}
