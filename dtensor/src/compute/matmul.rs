//! Products: `matmul`, `matmul_t` (a linear layer's `[out, in]` weight) and `bmm`, with
//! their tape twins.

use super::{describe, output, same_mesh, shape_err, want_rank};
use crate::any::AnyDTensor;
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::ops::{self, Transpose};
use dtensor_kernels::Tensor;
use dtensor_placement::{
    BatchedMatmulLayout, BatchedMatmulOut, Layout, MatmulLayout, MatmulOut, MatmulTLayout,
    MatmulTOut,
};

impl<L: Layout> DTensor<L> {
    /// `A[m,k]·B[k,n]`; the output layout follows [`MatmulRule`](dtensor_placement::MatmulRule)
    /// on every axis (a contraction sharded on both sides gives `Partial`).
    pub fn matmul<LB: MatmulLayout<L>>(
        &self,
        b: &DTensor<LB>,
    ) -> Result<DTensor<MatmulOut<L, LB>>> {
        self.product("DTensor::matmul", b.as_any(), Transpose::No)
    }

    /// `A[m,k]·W[n,k]ᵀ` (a linear layer's `[out, in]` weight, no copy of `W`); the output
    /// layout follows [`MatmulTRule`](dtensor_placement::MatmulTRule).
    pub fn matmul_t<LW: MatmulTLayout<L>>(
        &self,
        w: &DTensor<LW>,
    ) -> Result<DTensor<MatmulTOut<L, LW>>> {
        self.product("DTensor::matmul_t", w.as_any(), Transpose::Yes)
    }

    /// `A[b,m,k]·B[b,k,n]`, batch by batch; the output layout follows
    /// [`BatchedMatmulRule`](dtensor_placement::BatchedMatmulRule).
    pub fn bmm<LB: BatchedMatmulLayout<L>>(
        &self,
        b: &DTensor<LB>,
    ) -> Result<DTensor<BatchedMatmulOut<L, LB>>> {
        const OP: &str = "DTensor::bmm";
        let (a, bb) = (self.as_any(), b.as_any());
        same_mesh(OP, a, bb)?;
        want_rank(OP, a, 3, "the left operand")?;
        want_rank(OP, bb, 3, "the right operand")?;
        let (ga, gb) = (a.global_shape(), bb.global_shape());
        if ga[0] != gb[0] || ga[2] != gb[1] || a.local_shape()[2] != bb.local_shape()[1] {
            return Err(shape_err(
                OP,
                format!(
                    "{} · {}: batch or contraction dims differ",
                    describe(a),
                    describe(bb)
                ),
            ));
        }
        let local = ops::matmul(a.as_local(), Transpose::No, bb.as_local(), Transpose::No)?;
        output(OP, local, &[ga[0], ga[1], gb[2]], a)
    }

    fn product<Out: Layout>(
        &self,
        op: &'static str,
        b: &AnyDTensor,
        tb: Transpose,
    ) -> Result<DTensor<Out>> {
        let a = self.as_any();
        same_mesh(op, a, b)?;
        want_rank(op, a, 2, "the left operand")?;
        want_rank(op, b, 2, "the right operand")?;
        let (ga, gb) = (a.global_shape(), b.global_shape());
        let (kb_dim, n_dim) = match tb {
            Transpose::No => (0, 1),
            Transpose::Yes => (1, 0),
        };
        if ga[1] != gb[kb_dim] || a.local_shape()[1] != b.local_shape()[kb_dim] {
            return Err(shape_err(
                op,
                format!(
                    "{} · {}{}: the contracted dims differ",
                    describe(a),
                    describe(b),
                    if tb == Transpose::Yes { "ᵀ" } else { "" }
                ),
            ));
        }
        let local = ops::matmul(a.as_local(), Transpose::No, b.as_local(), tb)?;
        output(op, local, &[ga[0], gb[n_dim]], a)
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::matmul`]: `dA = dC·Bᵀ`, `dB = Aᵀ·dC`.
    pub fn matmul<LB: MatmulLayout<L>>(
        &self,
        b: &Var<'t, LB>,
    ) -> Result<Var<'t, MatmulOut<L, LB>>> {
        let y = self.value().matmul(b.value())?;
        let (av, bv) = (self.value().as_any().clone(), b.value().as_any().clone());
        Ok(self.binary(b, y, move |dy, want| {
            product_grads("Var::matmul", dy.as_local(), want, &av, &bv)
        }))
    }

    /// [`DTensor::matmul_t`]: `dA = dC·W`, `dW = dCᵀ·A`.
    pub fn matmul_t<LW: MatmulTLayout<L>>(
        &self,
        w: &Var<'t, LW>,
    ) -> Result<Var<'t, MatmulTOut<L, LW>>> {
        let y = self.value().matmul_t(w.value())?;
        let (av, wv) = (self.value().as_any().clone(), w.value().as_any().clone());
        Ok(self.binary(w, y, move |dy, want| {
            let g = dy.as_local();
            Ok((
                grad_if(want[0], "Var::matmul_t", &av, || {
                    ops::matmul(g, Transpose::No, wv.as_local(), Transpose::No)
                })?,
                grad_if(want[1], "Var::matmul_t", &wv, || {
                    ops::matmul(g, Transpose::Yes, av.as_local(), Transpose::No)
                })?,
            ))
        }))
    }

    /// [`DTensor::bmm`]: `dA = dC·Bᵀ`, `dB = Aᵀ·dC`, batch by batch.
    pub fn bmm<LB: BatchedMatmulLayout<L>>(
        &self,
        b: &Var<'t, LB>,
    ) -> Result<Var<'t, BatchedMatmulOut<L, LB>>> {
        let y = self.value().bmm(b.value())?;
        let (av, bv) = (self.value().as_any().clone(), b.value().as_any().clone());
        Ok(self.binary(b, y, move |dy, want| {
            product_grads("Var::bmm", dy.as_local(), want, &av, &bv)
        }))
    }
}

/// `grad_of(f())` if `want` (a split backward asks for one operand's gradient at a time).
fn grad_if<L: Layout>(
    want: bool,
    op: &'static str,
    like: &AnyDTensor,
    f: impl FnOnce() -> dtensor_kernels::Result<Tensor>,
) -> Result<Option<DTensor<L>>> {
    want.then(|| grad_of(op, f()?, like)).transpose()
}

/// The gradients of `C = A·B` (batched or not) that `want` asks for: `dA = dC·Bᵀ`,
/// `dB = Aᵀ·dC`.
#[allow(clippy::type_complexity)]
fn product_grads<LA: Layout, LB: Layout>(
    op: &'static str,
    g: &Tensor,
    want: [bool; 2],
    a: &AnyDTensor,
    b: &AnyDTensor,
) -> Result<(Option<DTensor<LA>>, Option<DTensor<LB>>)> {
    Ok((
        grad_if(want[0], op, a, || {
            ops::matmul(g, Transpose::No, b.as_local(), Transpose::Yes)
        })?,
        grad_if(want[1], op, b, || {
            ops::matmul(a.as_local(), Transpose::Yes, g, Transpose::No)
        })?,
    ))
}
