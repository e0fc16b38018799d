//! LayerNorm and RMSNorm over the last dim, with the statistics backward needs.
//!
//! Per row of `n` features (`x̂` the normalized input, `g = dy·w`, means over the row):
//!
//! | op | forward | saved | backward |
//! |---|---|---|---|
//! | [`layer_norm`] | `μ = mean x`, `σ² = mean (x − μ)²` (biased), `rstd = 1/√(σ² + eps)`, `x̂ = (x − μ)·rstd`, `y = x̂·w + b` | `mean`, `rstd` | `dx = rstd·(g − mean g − x̂·mean(g·x̂))`, `dw = Σ_rows dy·x̂`, `db = Σ_rows dy` |
//! | [`rms_norm`] | `rstd = 1/√(mean x² + eps)`, `x̂ = x·rstd`, `y = x̂·w` | `rstd` | `dx = rstd·(g − x̂·mean(g·x̂))`, `dw = Σ_rows dy·x̂` |
//!
//! `x` is `[.., n]`; `w` and `b` are `[n]` of `x`'s dtype. The saved statistics have `x`'s
//! leading shape (`[]` for a 1-D `x`) and the compute dtype ([`acc_dtype`]:
//! `f32` for `f32`/`bf16`/`f16`, `f64` for `f64`), so a half-precision backward sees
//! unrounded statistics. The variance is two-pass (no `E[x²] − E[x]²` cancellation). The
//! weight and bias gradients are summed over rows in row order in the compute type and
//! rounded once. Under sequence parallelism they are partial sums: reduce them across ranks.

use super::{
    acc_dtype, check_dst, check_row_param, rows_last, same_layout, want_float, AccFloat, Float,
    Layout,
};
use crate::spec::norm::*;
use crate::{Error, Result, Tensor};
use num_traits::Float as _;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Layer,
    Rms,
}

#[allow(clippy::too_many_arguments)]
fn forward_rows<T: Float>(
    kind: Kind,
    y: &mut [T],
    mean: &mut [T::Acc],
    rstd: &mut [T::Acc],
    x: &[T],
    w: &[T],
    b: &[T],
    n: usize,
    eps: T::Acc,
) {
    let nn = T::Acc::lit(n as f64);
    for (r, (y, x)) in y.chunks_exact_mut(n).zip(x.chunks_exact(n)).enumerate() {
        let mut mu = T::Acc::ZERO;
        if kind == Kind::Layer {
            for &v in x {
                mu += v.to_acc();
            }
            mu = mu / nn;
        }
        let mut var = T::Acc::ZERO;
        for &v in x {
            let c = v.to_acc() - mu;
            var += c * c;
        }
        let rs = T::Acc::ONE / (var / nn + eps).sqrt();
        rstd[r] = rs;
        if kind == Kind::Layer {
            mean[r] = mu;
            for (((d, &v), &w), &b) in y.iter_mut().zip(x).zip(w).zip(b) {
                *d = T::from_acc((v.to_acc() - mu) * rs * w.to_acc() + b.to_acc());
            }
        } else {
            for ((d, &v), &w) in y.iter_mut().zip(x).zip(w) {
                *d = T::from_acc(v.to_acc() * rs * w.to_acc());
            }
        }
    }
}

/// Row-wise backward; `db` is `None` for RMSNorm. `dw`/`db` accumulate in the compute type.
#[allow(clippy::too_many_arguments)]
fn backward_rows<T: Float>(
    kind: Kind,
    dx: &mut [T],
    dw: &mut [T::Acc],
    mut db: Option<&mut [T::Acc]>,
    dy: &[T],
    x: &[T],
    w: &[T],
    mean: &[T::Acc],
    rstd: &[T::Acc],
    n: usize,
) {
    let nn = T::Acc::lit(n as f64);
    let mut xhat = vec![T::Acc::ZERO; n];
    let mut g = vec![T::Acc::ZERO; n];
    let rows = dx
        .chunks_exact_mut(n)
        .zip(dy.chunks_exact(n))
        .zip(x.chunks_exact(n));
    for (r, ((dx, dy), x)) in rows.enumerate() {
        let mu = if kind == Kind::Layer {
            mean[r]
        } else {
            T::Acc::ZERO
        };
        let rs = rstd[r];
        let (mut sum_g, mut sum_gx) = (T::Acc::ZERO, T::Acc::ZERO);
        for j in 0..n {
            let d = dy[j].to_acc();
            xhat[j] = (x[j].to_acc() - mu) * rs;
            g[j] = d * w[j].to_acc();
            sum_g += g[j];
            sum_gx += g[j] * xhat[j];
            dw[j] += d * xhat[j];
            if let Some(db) = db.as_deref_mut() {
                db[j] += d;
            }
        }
        let c0 = if kind == Kind::Layer {
            sum_g / nn
        } else {
            T::Acc::ZERO
        };
        let c1 = sum_gx / nn;
        for j in 0..n {
            dx[j] = T::from_acc(rs * (g[j] - c0 - xhat[j] * c1));
        }
    }
}

fn narrow_into<T: Float>(dst: &mut [T], src: &[T::Acc]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = T::from_acc(s);
    }
}

/// LayerNorm over the last dim: `y = (x − mean)·rstd·weight + bias`.
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<LayerNormOutput> {
    const OP: &str = "ops::layer_norm";
    let n = check_input(OP, x, &[weight, bias])?;
    dispatch!(OP, [x, weight, bias] => crate::cuda::ops::layer_norm(&x, &weight, &bias, eps)
        .map(crate::cuda::ops::NormOutput::into_layer));
    let lead = &x.shape()[..x.rank() - 1];
    let mut y = Tensor::zeros(x.shape(), x.dtype());
    let mut mean = Tensor::zeros(lead, acc_dtype(x.dtype()));
    let mut rstd = Tensor::zeros(lead, acc_dtype(x.dtype()));
    dispatch_float!(OP, x.dtype(), |T| {
        forward_rows::<T>(
            Kind::Layer,
            y.as_mut_slice()?,
            mean.as_mut_slice()?,
            rstd.as_mut_slice()?,
            x.as_slice()?,
            weight.as_slice()?,
            bias.as_slice()?,
            n,
            <T as Float>::Acc::lit(eps),
        );
        Ok(())
    })?;
    Ok(LayerNormOutput { y, mean, rstd })
}

/// The gradients of [`layer_norm`] from the output gradient `dy`, the input `x`, the weight
/// and the saved `mean` / `rstd`.
pub fn layer_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
) -> Result<LayerNormGrads> {
    const OP: &str = "ops::layer_norm_backward";
    let n = check_input(OP, x, &[weight])?;
    same_layout(OP, x, dy)?;
    check_stat(OP, x, mean)?;
    check_stat(OP, x, rstd)?;
    dispatch!(OP, [dy, x, weight, mean, rstd] =>
        crate::cuda::ops::layer_norm_backward(&dy, &x, &weight, &mean, &rstd)
            .map(crate::cuda::ops::NormGrads::into_layer));
    let mut dx = Tensor::zeros(x.shape(), x.dtype());
    let mut dweight = Tensor::zeros(&[n], x.dtype());
    let mut dbias = Tensor::zeros(&[n], x.dtype());
    dispatch_float!(OP, x.dtype(), |T| {
        let mut dw = vec![<T as Float>::Acc::ZERO; n];
        let mut db = vec![<T as Float>::Acc::ZERO; n];
        backward_rows::<T>(
            Kind::Layer,
            dx.as_mut_slice()?,
            &mut dw,
            Some(&mut db),
            dy.as_slice()?,
            x.as_slice()?,
            weight.as_slice()?,
            mean.as_slice()?,
            rstd.as_slice()?,
            n,
        );
        narrow_into::<T>(dweight.as_mut_slice()?, &dw);
        narrow_into::<T>(dbias.as_mut_slice()?, &db);
        Ok(())
    })?;
    Ok(LayerNormGrads { dx, dweight, dbias })
}

/// RMSNorm over the last dim: `y = x·rstd·weight`, `rstd = 1/√(mean x² + eps)`.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<RmsNormOutput> {
    const OP: &str = "ops::rms_norm";
    let n = check_input(OP, x, &[weight])?;
    dispatch!(OP, [x, weight] => crate::cuda::ops::rms_norm(&x, &weight, eps)
        .map(crate::cuda::ops::NormOutput::into_rms));
    let lead = &x.shape()[..x.rank() - 1];
    let mut y = Tensor::zeros(x.shape(), x.dtype());
    let mut rstd = Tensor::zeros(lead, acc_dtype(x.dtype()));
    dispatch_float!(OP, x.dtype(), |T| {
        forward_rows::<T>(
            Kind::Rms,
            y.as_mut_slice()?,
            &mut [],
            rstd.as_mut_slice()?,
            x.as_slice()?,
            weight.as_slice()?,
            &[],
            n,
            <T as Float>::Acc::lit(eps),
        );
        Ok(())
    })?;
    Ok(RmsNormOutput { y, rstd })
}

/// The gradients of [`rms_norm`] from the output gradient `dy`, the input `x`, the weight
/// and the saved `rstd`.
pub fn rms_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
) -> Result<RmsNormGrads> {
    const OP: &str = "ops::rms_norm_backward";
    let n = check_input(OP, x, &[weight])?;
    same_layout(OP, x, dy)?;
    check_stat(OP, x, rstd)?;
    dispatch!(OP, [dy, x, weight, rstd] =>
        crate::cuda::ops::rms_norm_backward(&dy, &x, &weight, &rstd)
            .map(crate::cuda::ops::NormGrads::into_rms));
    let mut dx = Tensor::zeros(x.shape(), x.dtype());
    let mut dweight = Tensor::zeros(&[n], x.dtype());
    dispatch_float!(OP, x.dtype(), |T| {
        let mut dw = vec![<T as Float>::Acc::ZERO; n];
        backward_rows::<T>(
            Kind::Rms,
            dx.as_mut_slice()?,
            &mut dw,
            None,
            dy.as_slice()?,
            x.as_slice()?,
            weight.as_slice()?,
            &[],
            rstd.as_slice()?,
            n,
        );
        narrow_into::<T>(dweight.as_mut_slice()?, &dw);
        Ok(())
    })?;
    Ok(RmsNormGrads { dx, dweight })
}
