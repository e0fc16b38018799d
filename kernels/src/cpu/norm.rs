//! Host kernels of [`crate::ops::norm`](mod@crate::ops::norm), on host tensors. Each says
//! what it relies on and which check of the front door ensures it.

use super::{acc_dtype, AccFloat, Float};
use crate::spec::norm::*;
use crate::{Result, Tensor};
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

/// Host kernel of [`crate::ops::layer_norm`]: relies on `x` being float of rank ≥ 1 with a
/// nonempty last dim `n`, and `weight`, `bias` `[n]` of its dtype, as
/// `spec::norm::check_input` in the front door ensures.
pub(crate) fn layer_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
    n: usize,
) -> Result<LayerNormOutput> {
    const OP: &str = "ops::layer_norm";
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

/// Host kernel of [`crate::ops::layer_norm_backward`]: relies on `x`, `weight` and `n` as
/// [`layer_norm`] does (`spec::norm::check_input`), `dy` having `x`'s shape and dtype
/// (`spec::same_layout`), and `mean`, `rstd` having `x`'s leading shape and compute dtype
/// (`spec::norm::check_stat`), as the front door ensures.
pub(crate) fn layer_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    mean: &Tensor,
    rstd: &Tensor,
    n: usize,
) -> Result<LayerNormGrads> {
    const OP: &str = "ops::layer_norm_backward";
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

/// Host kernel of [`crate::ops::rms_norm`]: relies on `x` being float of rank ≥ 1 with a
/// nonempty last dim `n`, and `weight` `[n]` of its dtype, as `spec::norm::check_input` in
/// the front door ensures.
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, n: usize) -> Result<RmsNormOutput> {
    const OP: &str = "ops::rms_norm";
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

/// Host kernel of [`crate::ops::rms_norm_backward`]: relies on `x`, `weight` and `n` as
/// [`rms_norm`] does (`spec::norm::check_input`), `dy` having `x`'s shape and dtype
/// (`spec::same_layout`), and `rstd` having `x`'s leading shape and compute dtype
/// (`spec::norm::check_stat`), as the front door ensures.
pub(crate) fn rms_norm_backward(
    dy: &Tensor,
    x: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
    n: usize,
) -> Result<RmsNormGrads> {
    const OP: &str = "ops::rms_norm_backward";
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
