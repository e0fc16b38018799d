//! Reductions over one dim: `sum_dim`, `mean_dim`, `max_dim`, with their tape twins. A
//! sharded reduced dim gives a `Partial` of the matching reduction.

use super::{check_dim, describe, output, shape_err, shard_parts, without_dim};
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::ops;
use dtensor_kernels::Tensor;
use dtensor_placement::{
    Layout, MaxLayout, MaxOut, MeanLayout, MeanOut, NotSplitLayout, SumLayout, SumOut,
};

impl<L: Layout> DTensor<L> {
    /// The sum over dim `D` (the dim disappears). A sharded `D` gives `Partial<Sum>`.
    pub fn sum_dim<const D: usize>(&self) -> Result<DTensor<SumOut<L, D>>>
    where
        L: SumLayout<D>,
    {
        const OP: &str = "DTensor::sum_dim";
        let a = self.as_any();
        check_dim(OP, a, D)?;
        output(
            OP,
            ops::sum_dim(a.as_local(), D)?,
            &without_dim(a.global_shape(), D),
            a,
        )
    }

    /// The mean over dim `D`. A sharded `D` gives `Partial<Avg>`, exact only when every
    /// rank holds as many rows of `D` as the others: uneven shards are an `Err`.
    pub fn mean_dim<const D: usize>(&self) -> Result<DTensor<MeanOut<L, D>>>
    where
        L: MeanLayout<D>,
    {
        const OP: &str = "DTensor::mean_dim";
        let a = self.as_any();
        check_dim(OP, a, D)?;
        let parts = shard_parts(a, D);
        let (g, l) = (a.global_shape()[D], a.local_shape()[D]);
        if l == 0 || l * parts != g {
            return Err(shape_err(
                OP,
                format!(
                    "dim {D} of {} is not split evenly over {parts} ranks: the average of the ranks' means would be biased",
                    describe(a)
                ),
            ));
        }
        let sum = ops::sum_dim(a.as_local(), D)?;
        output(
            OP,
            sum.scale(1.0 / l as f64),
            &without_dim(a.global_shape(), D),
            a,
        )
    }

    /// The max over dim `D`. A sharded `D` gives `Partial<Max>` (a rank whose shard is empty
    /// contributes `-inf`).
    pub fn max_dim<const D: usize>(&self) -> Result<DTensor<MaxOut<L, D>>>
    where
        L: MaxLayout<D>,
    {
        Ok(self.max_dim_parts::<D>()?.0)
    }

    /// [`max_dim`](Self::max_dim) and where each max was found (`None` for an empty shard,
    /// which has no argmax).
    fn max_dim_parts<const D: usize>(&self) -> Result<(DTensor<MaxOut<L, D>>, Option<Tensor>)>
    where
        L: MaxLayout<D>,
    {
        const OP: &str = "DTensor::max_dim";
        let a = self.as_any();
        check_dim(OP, a, D)?;
        let out_shape = without_dim(a.local_shape(), D);
        let (local, indices) = if a.local_shape()[D] == 0 {
            let empty = Tensor::zeros(&out_shape, a.dtype()).map(|_| f64::NEG_INFINITY);
            (crate::any::to_mesh_place(empty, a.device_mesh())?, None)
        } else {
            let m = ops::max_dim(a.as_local(), D)?;
            (m.values, Some(m.indices))
        };
        let y = output(OP, local, &without_dim(a.global_shape(), D), a)?;
        Ok((y, indices))
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::sum_dim`]: the gradient is broadcast back along `D`.
    pub fn sum_dim<const D: usize>(&self) -> Result<Var<'t, SumOut<L, D>>>
    where
        L: SumLayout<D>,
    {
        let y = self.value().sum_dim::<D>()?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let n = xv.local_shape()[D];
            grad_of(
                "Var::sum_dim",
                ops::sum_dim_backward(dy.as_local(), D, n)?,
                &xv,
            )
        }))
    }

    /// [`DTensor::mean_dim`].
    pub fn mean_dim<const D: usize>(&self) -> Result<Var<'t, MeanOut<L, D>>>
    where
        L: MeanLayout<D>,
    {
        let y = self.value().mean_dim::<D>()?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            // Every element of the global dim weighs 1/extent: a rank's local mean is one
            // of the equal terms a `Partial<Avg>` averages.
            let (n, extent) = (xv.local_shape()[D], xv.global_shape()[D]);
            let g = ops::sum_dim_backward(dy.as_local(), D, n)?.scale(1.0 / extent as f64);
            grad_of("Var::mean_dim", g, &xv)
        }))
    }

    /// The max over dim `D`, on the tape only where `D` is whole on every rank: a max over
    /// a sharded dim is `Partial<Max>`, whose gradient would reach every rank's local
    /// argmax instead of the global one. The gradient goes to the (first) argmax.
    pub fn max_dim<const D: usize>(&self) -> Result<Var<'t, MaxOut<L, D>>>
    where
        L: MaxLayout<D> + NotSplitLayout<D>,
    {
        let (y, indices) = self.value().max_dim_parts::<D>()?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let dx = match indices {
                Some(idx) => {
                    let n = xv.local_shape()[D];
                    ops::max_dim_backward(dy.as_local(), &idx, D, n)?
                }
                // An empty dim: no element, nothing to send a gradient to.
                None => xv.as_local().zeros_like()?,
            };
            grad_of("Var::max_dim", dx, &xv)
        }))
    }
}
