//! Host kernels of [`crate::ops::moe`](mod@crate::ops::moe), on host tensors. Each says
//! what it relies on and which check of the front door ensures it.

use super::matmul::matmul;
use super::Transpose;
use crate::spec::moe::*;
use crate::{Result, Tensor};

/// Host kernel of [`crate::ops::scatter_add_rows`]: relies on `src` being `[rows.len(), h]`,
/// every destination below `n` and `[n, h]` within a `usize`, as
/// `spec::moe::check_scatter_add` in the front door ensures.
pub(crate) fn scatter_add_rows(src: &Tensor, rows: &[usize], n: usize, h: usize) -> Result<Tensor> {
    let v = src.to_f64_vec();
    let mut out = vec![0.0; n * h];
    for (i, &r) in rows.iter().enumerate() {
        for (o, s) in out[r * h..(r + 1) * h]
            .iter_mut()
            .zip(&v[i * h..(i + 1) * h])
        {
            *o += s;
        }
    }
    Tensor::from_f64_vec(out, &[n, h], src.dtype())
}

/// Expert `g`'s weight `[out, in]` (a view).
fn expert(w: &Tensor, g: usize, out: usize, k: usize) -> Result<Tensor> {
    w.narrow(0, g, 1)?.reshape(&[out, k])
}

/// Host kernel of [`crate::ops::grouped_matmul_t`]: relies on one float dtype (when there are
/// rows), `x` `[rows, k]`, `w` `[experts, out, k]` and one group per expert summing to `rows`,
/// as `spec::moe::check_grouped` in the front door ensures.
pub(crate) fn grouped_matmul_t(
    x: &Tensor,
    w: &Tensor,
    groups: &[usize],
    out: usize,
    k: usize,
) -> Result<Tensor> {
    let mut pieces = Vec::with_capacity(groups.len());
    let mut start = 0;
    for (g, &n) in groups.iter().enumerate() {
        if n > 0 {
            let xg = x.narrow(0, start, n)?;
            pieces.push(matmul(
                &xg,
                Transpose::No,
                &expert(w, g, out, k)?,
                Transpose::Yes,
            )?);
        }
        start += n;
    }
    if pieces.is_empty() {
        return Ok(Tensor::zeros(&[0, out], x.dtype()));
    }
    Tensor::cat(&pieces, 0)
}

/// Host kernel of [`crate::ops::grouped_matmul_t_backward`]: relies on what
/// [`grouped_matmul_t`] does and `dy` `[rows, out]` of `x`'s dtype, as
/// `spec::moe::check_grouped_backward` in the front door ensures.
pub(crate) fn grouped_matmul_t_backward(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    groups: &[usize],
    (e, out, k): (usize, usize, usize),
) -> Result<GroupedMatmulGrads> {
    let mut dxs = Vec::with_capacity(e);
    let mut dws = Vec::with_capacity(e);
    let mut start = 0;
    for (g, &n) in groups.iter().enumerate() {
        if n == 0 {
            dws.push(Tensor::zeros(&[1, out, k], w.dtype()));
            continue;
        }
        let (dyg, xg) = (dy.narrow(0, start, n)?, x.narrow(0, start, n)?);
        let wg = expert(w, g, out, k)?;
        dxs.push(matmul(&dyg, Transpose::No, &wg, Transpose::No)?);
        dws.push(matmul(&dyg, Transpose::Yes, &xg, Transpose::No)?.reshape(&[1, out, k])?);
        start += n;
    }
    let dx = if dxs.is_empty() {
        Tensor::zeros(&[0, k], x.dtype())
    } else {
        Tensor::cat(&dxs, 0)?
    };
    Ok(GroupedMatmulGrads {
        dx,
        dw: Tensor::cat(&dws, 0)?,
    })
}

#[cfg(test)]
mod tests {
    use crate::ops::{gather_rows, grouped_matmul_t, grouped_matmul_t_backward, scatter_add_rows};
    use crate::Tensor;

    #[test]
    fn grouped_product_matches_per_row_products() {
        let x = Tensor::from_fn(&[5, 3], |i| (i as f64 * 0.37).sin());
        let w = Tensor::from_fn(&[3, 2, 3], |i| (i as f64 * 0.11).cos());
        let groups = [2, 0, 3];
        let y = grouped_matmul_t(&x, &w, &groups).unwrap();
        let (xv, wv, yv) = (x.to_f64_vec(), w.to_f64_vec(), y.to_f64_vec());
        let expert_of = [0, 0, 2, 2, 2];
        for r in 0..5 {
            for o in 0..2 {
                let e = expert_of[r];
                let want: f64 = (0..3)
                    .map(|i| xv[r * 3 + i] * wv[(e * 2 + o) * 3 + i])
                    .sum();
                assert!((yv[r * 2 + o] - want).abs() < 1e-14);
            }
        }
        let dy = Tensor::from_fn(&[5, 2], |i| 1.0 + i as f64);
        let g = grouped_matmul_t_backward(&dy, &x, &w, &groups).unwrap();
        assert_eq!(g.dx.shape(), &[5, 3]);
        assert_eq!(g.dw.shape(), &[3, 2, 3]);
        assert!(g.dw.to_f64_vec()[6..12].iter().all(|&v| v == 0.0));
        assert!(grouped_matmul_t(&x, &w, &[2, 2]).is_err());
    }

    #[test]
    fn scatter_add_is_the_adjoint_of_gather() {
        let x = Tensor::from_fn(&[3, 2], |i| i as f64);
        let g = gather_rows(&x, &[2, 0, 2]).unwrap();
        assert_eq!(g.to_f64_vec(), vec![4.0, 5.0, 0.0, 1.0, 4.0, 5.0]);
        let s = scatter_add_rows(&g, &[2, 0, 2], 3).unwrap();
        assert_eq!(s.to_f64_vec(), vec![0.0, 1.0, 0.0, 0.0, 8.0, 10.0]);
    }
}
