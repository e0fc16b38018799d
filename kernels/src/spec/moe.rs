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
/// the error for arguments that cannot be scattered.
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

/// `(experts, out, in)` of a grouped product of `x` `[rows, in]` with `w`
/// `[experts, out, in]` over `groups` (one per expert, summing to `rows`), or the error.
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
    // The product refuses integers; with no rows nothing is multiplied (zeros of any dtype).
    if rows > 0 {
        want_float(op, x)?;
    }
    Ok((e, out, k))
}

/// [`check_grouped`], and `dy` `[rows, out]` of `x`'s dtype: the backward's arguments.
pub(crate) fn check_grouped_backward<L: Layout + ?Sized>(
    op: &'static str,
    dy: &L,
    x: &L,
    w: &L,
    groups: &[usize],
) -> Result<(usize, usize, usize)> {
    let (e, out, k) = check_grouped(op, x, w, groups)?;
    same_dtype(op, dy, x)?;
    let rows = x.shape()[0];
    if dy.shape() != [rows, out] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: dy.shape().into(),
            rhs: [rows, out].as_slice().into(),
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
