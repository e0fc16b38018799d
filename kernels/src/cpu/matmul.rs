//! Host kernels of [`crate::ops::matmul`](mod@crate::ops::matmul), on host tensors. Each says
//! what it relies on and which check of the front door ensures it.

use super::{Accum, Parallelism, Transpose};
use crate::spec::matmul::Plan;
use crate::{DType, Result, Shape, Tensor};
use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

const OP: &str = "ops::matmul";

/// Reusable `f32` buffers for `bf16`/`f16` products (unused for `f32`/`f64`). Holding one per
/// layer avoids a fresh allocation, and its page faults, per call.
#[derive(Debug, Default, Clone)]
pub struct MatmulScratch {
    lhs: Vec<f32>,
    rhs: Vec<f32>,
    dst: Vec<f32>,
}

/// `op(a)·op(b)` of host tensors into a new tensor, checked as [`crate::ops::matmul`](fn@crate::ops::matmul) checks
/// it: what the front door runs for host operands, for host kernels built on products.
pub(crate) fn matmul(a: &Tensor, ta: Transpose, b: &Tensor, tb: Transpose) -> Result<Tensor> {
    let plan = Plan::new(a, ta, b, tb)?;
    let mut dst = Tensor::zeros_checked(OP, &plan.out_shape, a.dtype())?;
    let scratch = &mut MatmulScratch::default();
    matmul_into_with(
        &mut dst,
        a,
        b,
        Accum::Replace,
        Parallelism::None,
        scratch,
        plan,
    )?;
    Ok(dst)
}

/// Host kernel of [`crate::ops::matmul_into_with`]: relies on `plan` being
/// `spec::matmul::Plan::new` of these operands (one float dtype, agreeing shapes, block sizes
/// that fit a `usize`) and `dst` having `plan.out_shape` and `a`'s dtype (`spec::check_dst`),
/// as the front door ensures; gemm's slices are asserted against the plan before the call.
pub(crate) fn matmul_into_with(
    dst: &mut Tensor,
    a: &Tensor,
    b: &Tensor,
    accum: Accum,
    par: Parallelism,
    scratch: &mut MatmulScratch,
    plan: Plan,
) -> Result<()> {
    match a.dtype() {
        DType::F32 => run_native::<f32>(
            dst.as_mut_slice()?,
            a.as_slice()?,
            b.as_slice()?,
            &plan,
            accum,
            par,
        ),
        DType::F64 => run_native::<f64>(
            dst.as_mut_slice()?,
            a.as_slice()?,
            b.as_slice()?,
            &plan,
            accum,
            par,
        ),
        DType::BF16 => run_widened::<bf16>(
            dst.as_mut_slice()?,
            a.as_slice()?,
            b.as_slice()?,
            &plan,
            accum,
            par,
            scratch,
        ),
        DType::F16 => run_widened::<f16>(
            dst.as_mut_slice()?,
            a.as_slice()?,
            b.as_slice()?,
            &plan,
            accum,
            par,
            scratch,
        ),
        other => return Err(super::not_float(OP, other)),
    }
    Ok(())
}

fn run_native<T: 'static + Copy + num_traits::Zero + num_traits::One>(
    dst: &mut [T],
    a: &[T],
    b: &[T],
    p: &Plan,
    accum: Accum,
    par: Parallelism,
) {
    if p.m == 0 || p.n == 0 {
        return;
    }
    if p.k == 0 {
        if accum == Accum::Replace {
            dst.fill(T::zero());
        }
        return;
    }
    let (read_dst, alpha) = match accum {
        Accum::Replace => (false, T::zero()),
        Accum::Add => (true, T::one()),
    };
    for i in 0..p.batch {
        // In bounds: `i < batch`, and the tensors hold `batch` blocks (checked shapes).
        let d = &mut dst[i * p.mn..][..p.mn];
        let a = &a[i * p.a_batch..][..p.mk];
        let b = &b[i * p.b_batch..][..p.kn];
        // What the SAFETY argument below rests on, checked in O(1) right here so that no
        // change to the plan above can hand gemm short slices.
        assert!(
            d.len() == p.mn
                && a.len() == p.mk
                && b.len() == p.kn
                && p.m.checked_mul(p.n) == Some(p.mn)
                && p.m.checked_mul(p.k) == Some(p.mk)
                && p.k.checked_mul(p.n) == Some(p.kn),
            "matmul: slices do not match the gemm dimensions"
        );
        // SAFETY: `d`, `a`, `b` are exactly the `m·n`, `m·k`, `k·n` elements the strides
        // address (row-major blocks, possibly read transposed; asserted above); `d` is a
        // unique borrow and cannot alias the shared `a` and `b`. gemm computes
        // `d = alpha·d + 1·a·b`.
        unsafe {
            gemm::gemm(
                p.m,
                p.n,
                p.k,
                d.as_mut_ptr(),
                1,
                p.n as isize,
                read_dst,
                a.as_ptr(),
                p.a_cs,
                p.a_rs,
                b.as_ptr(),
                p.b_cs,
                p.b_rs,
                alpha,
                T::one(),
                false,
                false,
                false,
                par,
            );
        }
    }
}

/// A 16-bit float that multiplies by widening to `f32`.
trait Widen: Copy {
    fn widen(src: &[Self], dst: &mut [f32]);
    fn narrow(dst: &mut [Self], src: &[f32]);
}

impl Widen for bf16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(dst: &mut [Self], src: &[f32]) {
        dst.convert_from_f32_slice(src);
    }
}

impl Widen for f16 {
    fn widen(src: &[Self], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst);
    }
    fn narrow(dst: &mut [Self], src: &[f32]) {
        dst.convert_from_f32_slice(src);
    }
}

fn run_widened<H: Widen + num_traits::Zero>(
    dst: &mut [H],
    a: &[H],
    b: &[H],
    p: &Plan,
    accum: Accum,
    par: Parallelism,
    s: &mut MatmulScratch,
) {
    if p.m == 0 || p.n == 0 {
        return;
    }
    if p.k == 0 {
        if accum == Accum::Replace {
            dst.fill(H::zero());
        }
        return;
    }
    let (a_len, b_len, d_len) = (p.mk, p.kn, p.mn);
    s.lhs.resize(a_len, 0.0);
    s.rhs.resize(b_len, 0.0);
    s.dst.resize(d_len, 0.0);
    let one_plan = Plan {
        batch: 1,
        a_batch: 0,
        b_batch: 0,
        out_shape: Shape::new(),
        ..*p
    };
    for i in 0..p.batch {
        H::widen(&a[i * p.a_batch..][..a_len], &mut s.lhs);
        if i == 0 || p.b_batch != 0 {
            H::widen(&b[i * p.b_batch..][..b_len], &mut s.rhs);
        }
        let d = &mut dst[i * d_len..][..d_len];
        if accum == Accum::Add {
            H::widen(d, &mut s.dst);
        }
        run_native::<f32>(&mut s.dst, &s.lhs, &s.rhs, &one_plan, accum, par);
        H::narrow(d, &s.dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    // The front door: these check what callers see.
    use crate::ops::{matmul, matmul_into};
    use crate::Error;

    // The audit's P2 operands ([2^33, 2^33]) cannot be built any more (see the tensor
    // tests); empty operands can, and their product may still not fit. The test profile
    // has overflow checks on, so an unchecked `m·n` would panic here instead of erring.

    #[test]
    fn matmul_empty_operands_overflowing_product_errs() {
        let a = Tensor::zeros(&[1 << 33, 0], DType::F32);
        let b = Tensor::zeros(&[0, 1 << 33], DType::F32);
        let r = matmul(&a, Transpose::No, &b, Transpose::No);
        assert!(
            matches!(&r, Err(Error::Invalid { op: OP, detail }) if detail.contains("overflows")),
            "{r:?}"
        );
        // Transposed operands read the same extents the other way round.
        let at = Tensor::zeros(&[0, 1 << 33], DType::F32);
        assert!(matmul(&at, Transpose::Yes, &b, Transpose::No).is_err());
    }

    #[test]
    fn matmul_batched_overflowing_product_errs() {
        // m·n = 2^63 fits; batch · m·n = 3 · 2^63 does not (merged and per-batch plans).
        let a = Tensor::zeros(&[3, 1 << 31, 0], DType::F32);
        let b = Tensor::zeros(&[0, 1 << 32], DType::F32);
        assert!(matmul(&a, Transpose::No, &b, Transpose::No).is_err());
        let b3 = Tensor::zeros(&[3, 0, 1 << 32], DType::F32);
        assert!(matmul(&a, Transpose::No, &b3, Transpose::No).is_err());
    }

    #[test]
    fn matmul_into_overflowing_product_errs_before_touching_dst() {
        let a = Tensor::zeros(&[1 << 33, 0], DType::BF16);
        let b = Tensor::zeros(&[0, 1 << 33], DType::BF16);
        let mut dst = Tensor::zeros(&[0], DType::BF16);
        let r = matmul_into(
            &mut dst,
            &a,
            Transpose::No,
            &b,
            Transpose::No,
            Accum::Replace,
            Parallelism::None,
        );
        assert!(matches!(r, Err(Error::Invalid { op: OP, .. })), "{r:?}");
    }
}
