//! Elementwise arithmetic: `add`, `sub`, `mul`, `div`, `scale`, `to_dtype`, `map`, and the
//! row broadcasts `add_row`, `mul_row`, with their tape twins (`map` has none: its
//! derivative is unknown).

use super::{describe, output, same_mesh, same_shape, shape_err, want_rank};
use crate::any::AnyDTensor;
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::ops;
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{
    AddLayout, AddRowLayout, DivLayout, DivOut, Layout, LinearLayout, MulLayout, MulOut,
    MulRowLayout, MulRowOut, PointwiseLayout,
};

impl<L: Layout> DTensor<L> {
    /// Elementwise sum. The layouts must match axis by axis (`Partial` adds only to a
    /// `Partial` of the same linear reduction), else it does not compile.
    pub fn add<M>(&self, other: &DTensor<M>) -> Result<DTensor<L>>
    where
        M: Layout + AddLayout<L>,
    {
        Ok(DTensor::wrap(self.as_any().add(other.as_any())?))
    }

    /// Elementwise difference; the layouts follow the same rule as [`add`](Self::add).
    pub fn sub<M>(&self, other: &DTensor<M>) -> Result<DTensor<L>>
    where
        M: Layout + AddLayout<L>,
    {
        const OP: &str = "DTensor::sub";
        let (a, b) = (self.as_any(), other.as_any());
        same_mesh(OP, a, b)?;
        same_shape(OP, a, b)?;
        output(
            OP,
            ops::sub(a.as_local(), b.as_local())?,
            a.global_shape(),
            a,
        )
    }

    /// Elementwise product; per axis equal placements, or one `Partial<Sum>` factor with a
    /// `Replicate` one.
    pub fn mul<M: MulLayout<L>>(&self, other: &DTensor<M>) -> Result<DTensor<MulOut<L, M>>> {
        const OP: &str = "DTensor::mul";
        let (a, b) = (self.as_any(), other.as_any());
        same_mesh(OP, a, b)?;
        same_shape(OP, a, b)?;
        output(OP, a.as_local().mul(b.as_local())?, a.global_shape(), a)
    }

    /// Elementwise quotient; per axis equal placements, or a `Partial<Sum>` numerator over a
    /// `Replicate` divisor. Computed in f64 and rounded once.
    pub fn div<M: DivLayout<L>>(&self, other: &DTensor<M>) -> Result<DTensor<DivOut<L, M>>> {
        const OP: &str = "DTensor::div";
        let (a, b) = (self.as_any(), other.as_any());
        same_mesh(OP, a, b)?;
        same_shape(OP, a, b)?;
        if a.dtype() != b.dtype() {
            return Err(shape_err(
                OP,
                format!("dtypes {} and {}", a.dtype(), b.dtype()),
            ));
        }
        let den = b.as_local().to_f64_vec();
        let local = via_f64(a.as_local(), a.dtype(), |mut v| {
            v.iter_mut().zip(&den).for_each(|(x, d)| *x /= d);
            v
        })?;
        output(OP, local, a.global_shape(), a)
    }

    /// Every element times `factor` (linear: allowed on sum/avg `Partial` axes).
    pub fn scale(&self, factor: f64) -> Result<DTensor<L>>
    where
        L: LinearLayout,
    {
        Ok(DTensor::wrap(self.as_any().scale(factor)?))
    }

    /// The same tensor with its elements converted to `dtype` (rounded once; a view of the
    /// same elements when the dtype already is `dtype`). Mixed precision casts f32 master
    /// weights to bf16 for compute this way. On a `Partial` axis each term is rounded, so
    /// the pending sum is the sum of rounded terms.
    pub fn to_dtype(&self, dtype: DType) -> Result<DTensor<L>> {
        if self.as_local().dtype() == dtype {
            return Ok(self.clone());
        }
        let local = self.as_local().to_dtype(dtype);
        let any = AnyDTensor::from_local_for(
            "DTensor::to_dtype",
            local,
            self.global_shape(),
            &L::placements(),
            self.device_mesh(),
        )?;
        Ok(DTensor::wrap(any))
    }

    /// A non-linear elementwise function; no axis may be `Partial`.
    pub fn map(&self, f: impl Fn(f64) -> f64) -> Result<DTensor<L>>
    where
        L: PointwiseLayout,
    {
        Ok(DTensor::wrap(self.as_any().map(f)?))
    }

    /// `x[r,c] + bias[c]`, the bias broadcast along the rows: rows sharded take a
    /// `Replicate` bias, columns sharded a bias sharded alike.
    pub fn add_row<LB: AddRowLayout<L>>(&self, bias: &DTensor<LB>) -> Result<DTensor<L>> {
        const OP: &str = "DTensor::add_row";
        let (x, b) = (self.as_any(), bias.as_any());
        same_mesh(OP, x, b)?;
        want_rank(OP, x, 2, "the rows")?;
        want_rank(OP, b, 1, "the bias")?;
        if x.global_shape()[1] != b.global_shape()[0] || x.local_shape()[1] != b.local_shape()[0] {
            return Err(shape_err(
                OP,
                format!("rows {} + bias {}: widths differ", describe(x), describe(b)),
            ));
        }
        output(
            OP,
            ops::add_row(x.as_local(), b.as_local())?,
            x.global_shape(),
            x,
        )
    }

    /// `x[r,c] · w[c]`, a per-feature scale broadcast along the rows: rows sharded take a
    /// `Replicate` scale, columns sharded a scale sharded alike; one `Partial` factor at most.
    pub fn mul_row<LW: MulRowLayout<L>>(
        &self,
        w: &DTensor<LW>,
    ) -> Result<DTensor<MulRowOut<L, LW>>> {
        const OP: &str = "DTensor::mul_row";
        let (x, s) = (self.as_any(), w.as_any());
        same_mesh(OP, x, s)?;
        want_rank(OP, x, 2, "the rows")?;
        want_rank(OP, s, 1, "the scale")?;
        if x.global_shape()[1] != s.global_shape()[0] || x.local_shape()[1] != s.local_shape()[0] {
            return Err(shape_err(
                OP,
                format!(
                    "rows {} · scale {}: widths differ",
                    describe(x),
                    describe(s)
                ),
            ));
        }
        output(
            OP,
            ops::mul_row(x.as_local(), s.as_local())?,
            x.global_shape(),
            x,
        )
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::add`]: the gradient flows to both operands.
    pub fn add<M: Layout + AddLayout<L>>(&self, other: &Var<'t, M>) -> Result<Var<'t, L>> {
        let y = self.value().add(other.value())?;
        let (av, bv) = (
            self.value().as_any().clone(),
            other.value().as_any().clone(),
        );
        Ok(self.binary(other, y, move |dy, _want| {
            let g = dy.as_local().clone();
            Ok((
                Some(grad_of("Var::add", g.clone(), &av)?),
                Some(grad_of("Var::add", g, &bv)?),
            ))
        }))
    }

    /// [`DTensor::sub`].
    pub fn sub<M: Layout + AddLayout<L>>(&self, other: &Var<'t, M>) -> Result<Var<'t, L>> {
        let y = self.value().sub(other.value())?;
        let (av, bv) = (
            self.value().as_any().clone(),
            other.value().as_any().clone(),
        );
        Ok(self.binary(other, y, move |dy, _want| {
            let g = dy.as_local();
            Ok((
                Some(grad_of("Var::sub", g.clone(), &av)?),
                Some(grad_of("Var::sub", g.scale(-1.0), &bv)?),
            ))
        }))
    }

    /// [`DTensor::mul`]: `da = dc⊙b`, `db = dc⊙a`.
    pub fn mul<M: MulLayout<L>>(&self, other: &Var<'t, M>) -> Result<Var<'t, MulOut<L, M>>> {
        let y = self.value().mul(other.value())?;
        let (av, bv) = (
            self.value().as_any().clone(),
            other.value().as_any().clone(),
        );
        Ok(self.binary(other, y, move |dy, _want| {
            let g = dy.as_local();
            let da = g.mul(bv.as_local())?;
            let db = g.mul(av.as_local())?;
            Ok((
                Some(grad_of("Var::mul", da, &av)?),
                Some(grad_of("Var::mul", db, &bv)?),
            ))
        }))
    }

    /// [`DTensor::div`]: `da = dc / b`, `db = −dc·a / b²`.
    pub fn div<M: DivLayout<L>>(&self, other: &Var<'t, M>) -> Result<Var<'t, DivOut<L, M>>> {
        let y = self.value().div(other.value())?;
        let (av, bv) = (
            self.value().as_any().clone(),
            other.value().as_any().clone(),
        );
        Ok(self.binary(other, y, move |dy, _want| {
            let (g, a, b) = (
                dy.as_local().to_f64_vec(),
                av.as_local().to_f64_vec(),
                bv.as_local().to_f64_vec(),
            );
            let da: Vec<f64> = g.iter().zip(&b).map(|(g, b)| g / b).collect();
            let db: Vec<f64> = g
                .iter()
                .zip(&a)
                .zip(&b)
                .map(|((g, a), b)| -g * a / (b * b))
                .collect();
            let t = |v: Vec<f64>, like: &AnyDTensor| -> Result<Tensor> {
                Ok(Tensor::from_f64_vec(v, like.local_shape(), like.dtype())?)
            };
            Ok((
                Some(grad_of("Var::div", t(da, &av)?, &av)?),
                Some(grad_of("Var::div", t(db, &bv)?, &bv)?),
            ))
        }))
    }

    /// [`DTensor::scale`].
    pub fn scale(&self, factor: f64) -> Result<Var<'t, L>>
    where
        L: LinearLayout,
    {
        let y = self.value().scale(factor)?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            grad_of("Var::scale", dy.as_local().scale(factor), &xv)
        }))
    }

    /// [`DTensor::to_dtype`]: the gradient is cast back to this value's dtype.
    pub fn to_dtype(&self, dtype: DType) -> Result<Var<'t, L>> {
        let y = self.value().to_dtype(dtype)?;
        let back = self.value().as_local().dtype();
        Ok(self.unary(y, false, move |dy| dy.to_dtype(back)))
    }

    /// [`DTensor::add_row`]: the bias gradient is the output gradient summed over rows.
    pub fn add_row<LB: AddRowLayout<L>>(&self, bias: &Var<'t, LB>) -> Result<Var<'t, L>> {
        let y = self.value().add_row(bias.value())?;
        let (xv, bv) = (self.value().as_any().clone(), bias.value().as_any().clone());
        Ok(self.binary(bias, y, move |dy, _want| {
            let g = dy.as_local();
            let db = ops::sum_rows(g)?;
            Ok((
                Some(grad_of("Var::add_row", g.clone(), &xv)?),
                Some(grad_of("Var::add_row", db, &bv)?),
            ))
        }))
    }

    /// [`DTensor::mul_row`]: `dx = dy · w` along the rows, `dw = Σ_rows dy ⊙ x`.
    pub fn mul_row<LW: MulRowLayout<L>>(
        &self,
        w: &Var<'t, LW>,
    ) -> Result<Var<'t, MulRowOut<L, LW>>> {
        let y = self.value().mul_row(w.value())?;
        let (xv, wv) = (self.value().as_any().clone(), w.value().as_any().clone());
        Ok(self.binary(w, y, move |dy, _want| {
            let g = dy.as_local();
            let dx = ops::mul_row(g, wv.as_local())?;
            let dw = ops::sum_rows(&g.mul(xv.as_local())?)?;
            Ok((
                Some(grad_of("Var::mul_row", dx, &xv)?),
                Some(grad_of("Var::mul_row", dw, &wv)?),
            ))
        }))
    }
}

/// Runs `f` on the local values as f64 and rounds the result into `dtype` once.
fn via_f64(t: &Tensor, dtype: DType, f: impl FnOnce(Vec<f64>) -> Vec<f64>) -> Result<Tensor> {
    Ok(Tensor::from_f64_vec(f(t.to_f64_vec()), t.shape(), dtype)?)
}
