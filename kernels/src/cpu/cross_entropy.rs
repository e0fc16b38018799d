//! Host kernels of [`crate::ops::cross_entropy`](mod@crate::ops::cross_entropy): the pieces
//! of a vocab-parallel cross-entropy in f64, on host tensors whose arguments the front door
//! has checked. Each is the arithmetic of the distributed cross-entropy's host path (in
//! `dtensor`), operation for operation and in its order, so a caller that switches to them
//! gets the same bits.

use crate::{DType, Result, Tensor};

/// Each row's maximum of `logits` (`[rows, cols]`), folded from `−∞` in column order: f64
/// `[rows]` (`−∞` for no column).
pub(crate) fn row_max(logits: &Tensor, rows: usize, cols: usize) -> Result<Tensor> {
    let l = logits.to_f64_vec();
    let max: Vec<f64> = (0..rows)
        .map(|r| {
            l[r * cols..(r + 1) * cols]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &x| m.max(x))
        })
        .collect();
    Tensor::from_vec(max, &[rows])
}

/// Per row, `Σ_c exp(l − max)` summed in column order from 0, and the target's `l − max`
/// (0 where the target column is not among this piece's `col_start..col_start + cols`):
/// both f64 `[rows]`. An ignored row (class −1) leaves both at 0.
pub(crate) fn sum_target(
    logits: &Tensor,
    max: &Tensor,
    classes: &[i64],
    col_start: usize,
    (rows, cols): (usize, usize),
) -> Result<(Tensor, Tensor)> {
    let l = logits.to_f64_vec();
    let max = max.as_slice::<f64>()?;
    let here = col_start..col_start + cols;
    let mut sum = vec![0.0; rows];
    let mut target = vec![0.0; rows];
    for r in 0..rows {
        let Some(id) = class(classes[r]) else {
            continue;
        };
        for c in 0..cols {
            sum[r] += (l[r * cols + c] - max[r]).exp();
        }
        if here.contains(&id) {
            target[r] = l[r * cols + id - col_start] - max[r];
        }
    }
    Ok((
        Tensor::from_vec(sum, &[rows])?,
        Tensor::from_vec(target, &[rows])?,
    ))
}

/// A checked class, `None` for the ignored-row mark −1.
fn class(c: i64) -> Option<usize> {
    usize::try_from(c).ok()
}

/// `ln(sum) − target` per row, plus `z_loss · lse²` (`lse = max + ln(sum)`, the log of the
/// softmax normaliser) where `z_loss` is not 0, rounded once into `dtype`; 0 for an ignored
/// row (sum 0). With `z_loss` 0 the z term is not computed at all (no `+ 0` either).
pub(crate) fn loss(
    max: &Tensor,
    sum: &Tensor,
    target: &Tensor,
    z_loss: f64,
    dtype: DType,
) -> Result<Tensor> {
    let (max, sum, target) = (
        max.as_slice::<f64>()?,
        sum.as_slice::<f64>()?,
        target.as_slice::<f64>()?,
    );
    let loss: Vec<f64> = (0..sum.len())
        .map(|r| {
            let (s, t) = (sum[r], target[r]);
            if s == 0.0 {
                return 0.0;
            }
            let ln = s.ln();
            if z_loss == 0.0 {
                return ln - t;
            }
            let lse = max[r] + ln;
            ln - t + z_loss * lse * lse
        })
        .collect();
    Tensor::from_f64_vec(loss, &[sum.len()], dtype)
}

/// The logits' gradient `(exp(l − max) / sum · k − [c is the target])·dy[row]`, in f64 and
/// in that order, with `k = 1 + 2·z_loss·lse` (the z-loss's share; the factor is skipped
/// when `z_loss` is 0), rounded once into the logits' dtype; 0 on an ignored row.
#[allow(clippy::too_many_arguments)]
pub(crate) fn grad(
    logits: &Tensor,
    max: &Tensor,
    sum: &Tensor,
    classes: &[i64],
    dy: &Tensor,
    col_start: usize,
    z_loss: f64,
    (rows, cols): (usize, usize),
) -> Result<Tensor> {
    let l = logits.to_f64_vec();
    let (max, sum) = (max.as_slice::<f64>()?, sum.as_slice::<f64>()?);
    let d = dy.to_f64_vec();
    let here = col_start..col_start + cols;
    let mut g = vec![0.0; rows * cols];
    for r in 0..rows {
        let Some(id) = class(classes[r]) else {
            continue;
        };
        let z_factor = (z_loss != 0.0).then(|| 1.0 + 2.0 * z_loss * (max[r] + sum[r].ln()));
        let row = &mut g[r * cols..(r + 1) * cols];
        for (c, p) in row.iter_mut().enumerate() {
            *p = (l[r * cols + c] - max[r]).exp();
            *p /= sum[r];
            if let Some(k) = z_factor {
                *p *= k;
            }
        }
        if here.contains(&id) {
            row[id - col_start] -= 1.0;
        }
        row.iter_mut().for_each(|v| *v *= d[r]);
    }
    Tensor::from_f64_vec(g, &[rows, cols], logits.dtype())
}
