//! Host kernels of [`crate::ops::softmax`](mod@crate::ops::softmax), on host tensors. Each says
//! what it relies on and which check of the front door ensures it.

use super::{store, AccFloat, Accum, Float};
use crate::{Result, Tensor};
use num_traits::Float as _;

#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Softmax,
    LogSoftmax,
}

fn forward_rows<T: Float>(dst: &mut [T], x: &[T], n: usize, kind: Kind) {
    if n == 0 {
        return;
    }
    let mut e = vec![T::Acc::default(); n];
    for (d, x) in dst.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        let mut m = T::Acc::neg_infinity();
        let mut nan = false;
        for &v in x {
            let v = v.to_acc();
            nan |= v.is_nan();
            if v > m {
                m = v;
            }
        }
        if nan {
            m = T::Acc::nan();
        }
        let mut s = T::Acc::ZERO;
        for (e, &v) in e.iter_mut().zip(x) {
            *e = (v.to_acc() - m).exp();
            s += *e;
        }
        match kind {
            Kind::Softmax => {
                for (d, &e) in d.iter_mut().zip(&e) {
                    *d = T::from_acc(e / s);
                }
            }
            Kind::LogSoftmax => {
                let shift = m + s.ln();
                for (d, &v) in d.iter_mut().zip(x) {
                    *d = T::from_acc(v.to_acc() - shift);
                }
            }
        }
    }
}

fn backward_rows<T: Float>(dx: &mut [T], dy: &[T], y: &[T], n: usize, kind: Kind, accum: Accum) {
    if n == 0 {
        return;
    }
    let rows = dx
        .chunks_exact_mut(n)
        .zip(dy.chunks_exact(n))
        .zip(y.chunks_exact(n));
    for ((dx, dy), y) in rows {
        match kind {
            Kind::Softmax => {
                let mut dot = T::Acc::ZERO;
                for (&g, &p) in dy.iter().zip(y) {
                    dot += g.to_acc() * p.to_acc();
                }
                for ((d, &g), &p) in dx.iter_mut().zip(dy).zip(y) {
                    store(d, p.to_acc() * (g.to_acc() - dot), accum);
                }
            }
            Kind::LogSoftmax => {
                let mut sum = T::Acc::ZERO;
                for &g in dy {
                    sum += g.to_acc();
                }
                for ((d, &g), &l) in dx.iter_mut().zip(dy).zip(y) {
                    store(d, g.to_acc() - l.to_acc().exp() * sum, accum);
                }
            }
        }
    }
}

/// The host half of `ops::softmax` / `log_softmax` and their `_into`: relies on `n` being
/// `x`'s last dim (`spec::rows_last`) and `dst` having `x`'s shape and dtype
/// (`spec::check_dst`), as the front door's `forward_into` ensures.
pub(crate) fn forward_into(
    op: &'static str,
    dst: &mut Tensor,
    x: &Tensor,
    kind: Kind,
    n: usize,
) -> Result<()> {
    dispatch_float!(op, x.dtype(), |T| {
        forward_rows::<T>(dst.as_mut_slice()?, x.as_slice()?, n, kind);
        Ok(())
    })
}

/// The host half of the softmax backward ops: relies on `n` being `y`'s last dim
/// (`spec::rows_last`), `dy` having `y`'s shape and dtype (`spec::same_layout`) and `dx` too
/// (`spec::check_dst`), as the front door's `backward_into` ensures.
pub(crate) fn backward_into(
    op: &'static str,
    dx: &mut Tensor,
    dy: &Tensor,
    y: &Tensor,
    kind: Kind,
    accum: Accum,
    n: usize,
) -> Result<()> {
    dispatch_float!(op, y.dtype(), |T| {
        backward_rows::<T>(
            dx.as_mut_slice()?,
            dy.as_slice()?,
            y.as_slice()?,
            n,
            kind,
            accum,
        );
        Ok(())
    })
}
