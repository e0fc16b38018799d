//! Norms over the last dim: `rms_norm` and `layer_norm`, with their tape twins. Rows may
//! be sharded (the weight is then `Replicate`), or both whole. The twins record the
//! statistics their forward computed (`rstd`, and `mean` for LayerNorm); nothing runs twice.

use super::{check_last, describe, output, same_mesh, shape_err};
use crate::any::AnyDTensor;
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::ops;
use dtensor_kernels::Tensor;
use dtensor_placement::{Layout, NormLayout};

impl<L: Layout> DTensor<L> {
    /// RMSNorm over dim `D` (the last), times `weight[D]`. Rows may be sharded (the weight
    /// is then `Replicate`: each rank normalizes its own rows), or both whole.
    pub fn rms_norm<const D: usize, LW: NormLayout<L, D>>(
        &self,
        weight: &DTensor<LW>,
        eps: f64,
    ) -> Result<DTensor<L>> {
        Ok(self.rms_norm_parts::<D, LW>(weight, eps)?.0)
    }

    /// [`rms_norm`](Self::rms_norm) and the per-row `1/rms` its backward needs.
    fn rms_norm_parts<const D: usize, LW: NormLayout<L, D>>(
        &self,
        weight: &DTensor<LW>,
        eps: f64,
    ) -> Result<(DTensor<L>, Tensor)> {
        const OP: &str = "DTensor::rms_norm";
        let (x, w) = (self.as_any(), weight.as_any());
        check_norm(OP, x, w, D)?;
        let out = ops::rms_norm(x.as_local(), w.as_local(), eps)?;
        Ok((output(OP, out.y, x.global_shape(), x)?, out.rstd))
    }

    /// LayerNorm over dim `D` (the last), with `weight[D]` and `bias[D]` laid out alike.
    pub fn layer_norm<const D: usize, LW: NormLayout<L, D>>(
        &self,
        weight: &DTensor<LW>,
        bias: &DTensor<LW>,
        eps: f64,
    ) -> Result<DTensor<L>> {
        Ok(self.layer_norm_parts::<D, LW>(weight, bias, eps)?.0)
    }

    /// [`layer_norm`](Self::layer_norm) and the per-row mean and `1/std` its backward needs.
    fn layer_norm_parts<const D: usize, LW: NormLayout<L, D>>(
        &self,
        weight: &DTensor<LW>,
        bias: &DTensor<LW>,
        eps: f64,
    ) -> Result<(DTensor<L>, Tensor, Tensor)> {
        const OP: &str = "DTensor::layer_norm";
        let (x, w, b) = (self.as_any(), weight.as_any(), bias.as_any());
        check_norm(OP, x, w, D)?;
        check_norm(OP, x, b, D)?;
        let out = ops::layer_norm(x.as_local(), w.as_local(), b.as_local(), eps)?;
        let y = output(OP, out.y, x.global_shape(), x)?;
        Ok((y, out.mean, out.rstd))
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::rms_norm`]: the weight's gradient sums over this rank's rows (so it is
    /// `Partial` where the rows are sharded).
    pub fn rms_norm<const D: usize, LW: NormLayout<L, D>>(
        &self,
        weight: &Var<'t, LW>,
        eps: f64,
    ) -> Result<Var<'t, L>> {
        let (y, rstd) = self.value().rms_norm_parts::<D, LW>(weight.value(), eps)?;
        let (xv, wv) = (
            self.value().as_any().clone(),
            weight.value().as_any().clone(),
        );
        Ok(self.binary(weight, y, move |dy, _want| {
            let g = ops::rms_norm_backward(dy.as_local(), xv.as_local(), wv.as_local(), &rstd)?;
            Ok((
                Some(grad_of("Var::rms_norm", g.dx, &xv)?),
                Some(grad_of("Var::rms_norm", g.dweight, &wv)?),
            ))
        }))
    }

    /// [`DTensor::layer_norm`]: weight and bias gradients sum over this rank's rows.
    pub fn layer_norm<const D: usize, LW: NormLayout<L, D>>(
        &self,
        weight: &Var<'t, LW>,
        bias: &Var<'t, LW>,
        eps: f64,
    ) -> Result<Var<'t, L>> {
        let (y, mean, rstd) =
            self.value()
                .layer_norm_parts::<D, LW>(weight.value(), bias.value(), eps)?;
        let (xv, wv) = (
            self.value().as_any().clone(),
            weight.value().as_any().clone(),
        );
        let bv = bias.value().as_any().clone();
        let (x_id, w_id, b_id) = (self.id(), weight.id(), bias.id());
        Ok(self
            .tape()
            .record_halves(y, &[x_id, w_id, b_id], move |dy, want, store| {
                let g = ops::layer_norm_backward(
                    dy.as_local(),
                    xv.as_local(),
                    wv.as_local(),
                    &mean,
                    &rstd,
                )?;
                if want[0] {
                    store.accumulate::<L>(x_id, grad_of("Var::layer_norm", g.dx, &xv)?)?;
                }
                if want[1] {
                    store.accumulate::<LW>(w_id, grad_of("Var::layer_norm", g.dweight, &wv)?)?;
                }
                if want[2] {
                    store.accumulate::<LW>(b_id, grad_of("Var::layer_norm", g.dbias, &bv)?)?;
                }
                Ok(())
            }))
    }
}

/// `w` is a norm weight (or bias) for `x` normalized over its last dim `d`.
fn check_norm(op: &'static str, x: &AnyDTensor, w: &AnyDTensor, d: usize) -> Result<()> {
    same_mesh(op, x, w)?;
    check_last(op, x, d)?;
    if w.global_shape() != [x.global_shape()[d]] || w.local_shape() != [x.local_shape()[d]] {
        return Err(shape_err(
            op,
            format!("weight {} for input {}", describe(w), describe(x)),
        ));
    }
    Ok(())
}
