//! Matrix products through the `gemm` crate (no hand-written product loops).
//!
//! Shapes (after applying each operand's [`Transpose`] to its last two dims):
//!
//! | lhs | rhs | dst | how |
//! |---|---|---|---|
//! | `[m,k]` | `[k,n]` | `[m,n]` | one gemm |
//! | `[b,m,k]` | `[b,k,n]` | `[b,m,n]` | one gemm per batch entry |
//! | `[b,m,k]` | `[k,n]` | `[b,m,n]` | rhs shared by every batch entry (a linear layer on `[batch, seq, hidden]`); with lhs `Transpose::No` this is one gemm of `m = b·m` |
//!
//! A transpose is a stride swap: nothing is copied. `f32` and `f64` go to gemm as they are.
//! `bf16` and `f16` are widened to `f32` (lhs, rhs and, for [`Accum::Add`], dst), multiplied in
//! `f32` and rounded once into dst. gemm does have a native `f16` kernel, but it does not
//! round once: measured on x86-64, it is off by ~0.9 ulp on a `[1,7]·[7,2]` product and by
//! ~1 ulp at `k = 4096` (it rounds its `f32` accumulator to `f16` between `kc`-deep blocks),
//! and on aarch64 with `fp16` it accumulates in `f16` itself. Widening keeps "round once" and
//! the same bits on every architecture, at the cost of one conversion pass. The widened copies
//! live in a [`MatmulScratch`] the caller may keep between calls.
//!
//! Summation order inside one product is gemm's (blocked, FMA), fixed for a given machine,
//! shape and [`Parallelism`].

use super::{Accum, Parallelism, Transpose};
pub use crate::cpu::matmul::MatmulScratch;
use crate::spec::matmul::Plan;
use crate::{Result, Tensor};

const OP: &str = "ops::matmul";

/// `op(a) · op(b)` into a new tensor (`op` = the given [`Transpose`]), single-threaded.
///
/// ```
/// use dtensor_kernels::{ops::{matmul, Transpose}, Tensor};
/// let a = Tensor::from_vec(vec![1.0f64, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
/// let c = matmul(&a, Transpose::Yes, &a, Transpose::No).unwrap(); // aᵀ·a
/// assert_eq!(c.as_slice::<f64>().unwrap(), &[10.0, 14.0, 14.0, 20.0]);
/// ```
pub fn matmul(a: &Tensor, ta: Transpose, b: &Tensor, tb: Transpose) -> Result<Tensor> {
    let plan = Plan::new(a, ta, b, tb)?;
    dispatch!(OP, [a, b] => crate::cuda::ops::matmul(&a, ta, &b, tb));
    let mut dst = Tensor::zeros_checked(OP, &plan.out_shape, a.dtype())?;
    matmul_into(&mut dst, a, ta, b, tb, Accum::Replace, Parallelism::None)?;
    Ok(dst)
}

/// `dst = op(a)·op(b)` ([`Accum::Replace`]) or `dst += op(a)·op(b)` ([`Accum::Add`]).
/// `dst` must already have the product's shape and the operands' dtype. Half types allocate
/// a temporary [`MatmulScratch`]; use [`matmul_into_with`] to reuse one.
pub fn matmul_into(
    dst: &mut Tensor,
    a: &Tensor,
    ta: Transpose,
    b: &Tensor,
    tb: Transpose,
    accum: Accum,
    par: Parallelism,
) -> Result<()> {
    matmul_into_with(dst, a, ta, b, tb, accum, par, &mut MatmulScratch::default())
}

/// [`matmul_into`] with caller-provided scratch for the `bf16`/`f16` widening.
#[allow(clippy::too_many_arguments)]
pub fn matmul_into_with(
    dst: &mut Tensor,
    a: &Tensor,
    ta: Transpose,
    b: &Tensor,
    tb: Transpose,
    accum: Accum,
    par: Parallelism,
    scratch: &mut MatmulScratch,
) -> Result<()> {
    let plan = Plan::new(a, ta, b, tb)?;
    super::check_dst(OP, dst, &plan.out_shape, a.dtype())?;
    // cuBLAS on the device: `par` and `scratch` are for the host kernels.
    dispatch!(OP, mut dst, [a, b] => crate::cuda::ops::matmul_into(dst, &a, ta, &b, tb, accum));
    crate::cpu::matmul::matmul_into_with(dst, a, b, accum, par, scratch, plan)
}
