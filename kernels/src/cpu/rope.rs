//! Host kernel of [`crate::ops::rope`](mod@crate::ops::rope): rotates the pairs of every
//! head of checked host rows.

use super::{AccFloat, Float};
use crate::spec::rope::{Rope, Rotation};
use crate::{Result, Tensor};

/// `y = R(±θ)·x` per pair (the sign of [`Rotation`]), the tail columns and unrotated heads
/// copied; relies on the front door's `check_rope`: `heads` as it computed them, `cos` and
/// `sin` `[tokens, r/2]` host tables in `x`'s compute dtype.
pub(crate) fn rope(
    op: &'static str,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    cfg: &Rope,
    heads: usize,
    rotation: Rotation,
) -> Result<Tensor> {
    let mut y = Tensor::for_overwrite(x.shape(), x.dtype());
    dispatch_float!(op, x.dtype(), |T| {
        let cos = cos.as_slice::<<T as Float>::Acc>()?;
        let sign = <T as Float>::Acc::lit(rotation.sign());
        // Times ±1: exact, so both directions use the forward's table.
        let sin: Vec<_> = sin
            .as_slice::<<T as Float>::Acc>()?
            .iter()
            .map(|&s| sign * s)
            .collect();
        rotate_rows::<T>(y.as_mut_slice()?, x.as_slice()?, cos, &sin, cfg, heads);
        Ok(())
    })?;
    Ok(y)
}

fn rotate_rows<T: Float>(
    y: &mut [T],
    x: &[T],
    cos: &[T::Acc],
    sin: &[T::Acc],
    cfg: &Rope,
    heads: usize,
) {
    let (d, r) = (cfg.head_dim, cfg.rotary_dim);
    let (half, width) = (r / 2, heads * d);
    if width == 0 {
        return;
    }
    let rows = y.chunks_exact_mut(width).zip(x.chunks_exact(width));
    for (t, (y, x)) in rows.enumerate() {
        let (c, s) = (
            &cos[t * half..(t + 1) * half],
            &sin[t * half..(t + 1) * half],
        );
        for (h, (y, x)) in y.chunks_exact_mut(d).zip(x.chunks_exact(d)).enumerate() {
            if !cfg.heads.rotates(h) {
                y.copy_from_slice(x);
                continue;
            }
            for i in 0..half {
                let (j0, j1) = cfg.pair(i);
                let (a, b) = (x[j0].to_acc(), x[j1].to_acc());
                y[j0] = T::from_acc(a * c[i] - b * s[i]);
                y[j1] = T::from_acc(a * s[i] + b * c[i]);
            }
            y[r..].copy_from_slice(&x[r..]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // The half-split pairs of a rotary dim below the head dim stay inside the rotary part.
    #[test]
    fn pairs_cover_the_rotary_columns_once() {
        for style in [
            crate::spec::rope::RopeStyle::Interleaved,
            crate::spec::rope::RopeStyle::HalfSplit,
        ] {
            let cfg = Rope {
                rotary_dim: 6,
                ..Rope::new(10, 10_000.0, style)
            };
            let mut seen: Vec<usize> = (0..3)
                .flat_map(|i| <[usize; 2]>::from(cfg.pair(i)))
                .collect();
            seen.sort();
            assert_eq!(seen, (0..6).collect::<Vec<_>>());
        }
    }
}
