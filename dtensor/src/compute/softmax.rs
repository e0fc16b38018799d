//! `softmax` and `log_softmax` over the last dim, whole on every rank, with their tape
//! twins (whose backward reads the forward's output).

use super::{check_last, output};
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::ops;
use dtensor_placement::{Layout, NotSplitLayout};

impl<L: Layout> DTensor<L> {
    /// Softmax over dim `D`, which must be the last dim, whole on every rank.
    pub fn softmax<const D: usize>(&self) -> Result<DTensor<L>>
    where
        L: NotSplitLayout<D>,
    {
        const OP: &str = "DTensor::softmax";
        let a = self.as_any();
        check_last(OP, a, D)?;
        output(OP, ops::softmax(a.as_local())?, a.global_shape(), a)
    }

    /// Log-softmax over dim `D`, which must be the last dim, whole on every rank.
    pub fn log_softmax<const D: usize>(&self) -> Result<DTensor<L>>
    where
        L: NotSplitLayout<D>,
    {
        const OP: &str = "DTensor::log_softmax";
        let a = self.as_any();
        check_last(OP, a, D)?;
        output(OP, ops::log_softmax(a.as_local())?, a.global_shape(), a)
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::softmax`].
    pub fn softmax<const D: usize>(&self) -> Result<Var<'t, L>>
    where
        L: NotSplitLayout<D>,
    {
        let y = self.value().softmax::<D>()?;
        let (xv, yv) = (self.value().as_any().clone(), y.as_local().clone());
        Ok(self.unary(y, false, move |dy| {
            grad_of(
                "Var::softmax",
                ops::softmax_backward(dy.as_local(), &yv)?,
                &xv,
            )
        }))
    }

    /// [`DTensor::log_softmax`].
    pub fn log_softmax<const D: usize>(&self) -> Result<Var<'t, L>>
    where
        L: NotSplitLayout<D>,
    {
        let y = self.value().log_softmax::<D>()?;
        let (xv, yv) = (self.value().as_any().clone(), y.as_local().clone());
        Ok(self.unary(y, false, move |dy| {
            grad_of(
                "Var::log_softmax",
                ops::log_softmax_backward(dy.as_local(), &yv)?,
                &xv,
            )
        }))
    }
}
