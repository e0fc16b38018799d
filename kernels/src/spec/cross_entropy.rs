//! Cross-entropy's pieces: the logits' shape, the per-row statistics and the targets they
//! are checked against, alike for the host and the device.

use super::{check_dst, want_float, Layout};
use crate::spec::embedding::read_ids;
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

/// The targets (i64 or i32, in host memory), one per row, each below `vocab`.
pub(crate) fn target_ids(
    op: &'static str,
    ids: &Tensor,
    rows: usize,
    vocab: usize,
) -> Result<Vec<usize>> {
    let v = read_ids(op, ids, vocab)?;
    if v.len() != rows {
        return Err(Error::Invalid {
            op,
            detail: format!("{} targets for {rows} rows", v.len()),
        });
    }
    Ok(v)
}
