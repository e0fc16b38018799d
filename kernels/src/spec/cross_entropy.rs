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

/// The targets (i64 or i32, in host memory), one per row, checked against `0..vocab`: per
/// row its class, or −1 (the device kernels' mark of an ignored row) where the id equals
/// the ignore index (checked first, so an ignore index inside the vocab ignores that
/// class). Any other id is an [`Error::TargetOutOfRange`] naming its row and value.
pub(crate) fn target_classes(
    op: &'static str,
    ids: &Tensor,
    rows: usize,
    vocab: usize,
    ignore_index: Option<i64>,
) -> Result<Vec<i64>> {
    let raw = raw_ids(op, ids)?;
    if raw.len() != rows {
        return Err(Error::ShapeMismatch {
            op,
            lhs: ids.shape().into(),
            rhs: [rows][..].into(),
        });
    }
    raw.iter()
        .enumerate()
        .map(|(row, &id)| {
            if ignore_index == Some(id) {
                return Ok(-1);
            }
            match usize::try_from(id) {
                Ok(class) if class < vocab => Ok(id),
                _ => Err(Error::TargetOutOfRange {
                    op,
                    row,
                    id,
                    vocab,
                    ignore_index,
                }),
            }
        })
        .collect()
}

/// `Err` unless `z_loss` (the z-loss coefficient) is finite and not negative.
pub(crate) fn check_z_loss(op: &'static str, z_loss: f64) -> Result<()> {
    if z_loss.is_finite() && z_loss >= 0.0 {
        return Ok(());
    }
    Err(Error::Invalid {
        op,
        detail: format!("the z-loss coefficient must be finite and >= 0, got {z_loss}"),
    })
}
