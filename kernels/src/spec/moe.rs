//! Mixture-of-experts row routing and grouped products: checks and the gradients' shape.

use super::*;

pub(crate) fn rows_of<L: Layout + ?Sized>(op: &'static str, x: &L) -> Result<(usize, usize)> {
    match *x.shape() {
        [n, h] => Ok((n, h)),
        _ => Err(Error::Invalid {
            op,
            detail: format!(
                "expected a 2-D [rows, hidden] tensor, got shape {:?}",
                x.shape()
            ),
        }),
    }
}

/// `src`'s `(rows, hidden)` for a scatter-add of its rows to `rows` of an `n`-row output, or
/// the error for arguments that cannot be scattered: the CPU op and its device twin check
/// alike.
pub(crate) fn check_scatter_add<L: Layout + ?Sized>(
    op: &'static str,
    src: &L,
    rows: &[usize],
    n: usize,
) -> Result<(usize, usize)> {
    let (m, h) = rows_of(op, src)?;
    if m != rows.len() {
        return Err(Error::Invalid {
            op,
            detail: format!("{m} source rows but {} destinations", rows.len()),
        });
    }
    if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
        return Err(Error::Invalid {
            op,
            detail: format!("row {bad} out of range for {n} rows"),
        });
    }
    crate::storage::tensor::checked_len(op, &[n, h], src.dtype())?;
    Ok((m, h))
}

pub(crate) fn check_grouped<L: Layout + ?Sized>(
    op: &'static str,
    x: &L,
    w: &L,
    groups: &[usize],
) -> Result<(usize, usize, usize)> {
    same_dtype(op, x, w)?;
    let (rows, k) = rows_of(op, x)?;
    let &[e, out, k2] = w.shape() else {
        return Err(Error::Invalid {
            op,
            detail: format!(
                "expert weights must be 3-D [experts, out, in], got shape {:?}",
                w.shape()
            ),
        });
    };
    if k != k2 {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x.shape().into(),
            rhs: w.shape().into(),
        });
    }
    let total = crate::shape::checked_sum(groups);
    if groups.len() != e || total != Some(rows) {
        let total = total.map_or("overflows usize".into(), |t| t.to_string());
        return Err(Error::Invalid {
            op,
            detail: format!(
                "{} groups of {groups:?} rows (Σ {total}) for {e} experts and {rows} rows",
                groups.len(),
            ),
        });
    }
    Ok((e, out, k))
}

/// The gradients of [`grouped_matmul_t`](crate::ops::grouped_matmul_t).
pub struct GroupedMatmulGrads {
    /// `[rows, in]`: `dy[group e] · W[e]`.
    pub dx: Tensor,
    /// `[experts, out, in]`: `dy[group e]ᵀ · x[group e]` (zeros for an empty group).
    pub dw: Tensor,
}
