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
use crate::{DType, Error, Result, Shape, Tensor};
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

/// One validated product: `batch` gemms of `op(a)[m,k]·op(b)[k,n]` into row-major `[m,n]`
/// blocks of dst. Strides are in elements; a batch stride of 0 means "shared".
///
/// `mk`, `kn` and `mn` are the block sizes, computed once with overflow checks: gemm
/// addresses exactly that many elements from the raw pointers it is given, so a wrapped
/// product would make it read and write far past slices cut with the wrapped length.
#[derive(Debug)]
struct Plan {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    mk: usize,
    kn: usize,
    mn: usize,
    a_batch: usize,
    a_rs: isize,
    a_cs: isize,
    b_batch: usize,
    b_rs: isize,
    b_cs: isize,
    out_shape: Shape,
}

/// `(rows, cols, row stride, col stride)` of `op(x)` for a row-major `[r, c]` matrix.
fn operand(r: usize, c: usize, t: Transpose) -> (usize, usize, isize, isize) {
    match t {
        Transpose::No => (r, c, c as isize, 1),
        Transpose::Yes => (c, r, 1, c as isize),
    }
}

impl Plan {
    fn new(a: &Tensor, ta: Transpose, b: &Tensor, tb: Transpose) -> Result<Plan> {
        super::same_dtype(OP, a, b)?;
        if !a.dtype().is_float() {
            return Err(super::not_float(OP, a.dtype()));
        }
        let mismatch = || Error::ShapeMismatch {
            op: OP,
            lhs: a.shape().into(),
            rhs: b.shape().into(),
        };
        let (sa, sb) = (a.shape(), b.shape());
        let batch = match (sa.len(), sb.len()) {
            (2, 2) => 1,
            (3, 2) => sa[0],
            (3, 3) if sa[0] == sb[0] => sa[0],
            _ => return Err(mismatch()),
        };
        let (ar, ac) = (sa[sa.len() - 2], sa[sa.len() - 1]);
        let (br, bc) = (sb[sb.len() - 2], sb[sb.len() - 1]);
        let (m, k, a_rs, a_cs) = operand(ar, ac, ta);
        let (k2, n, b_rs, b_cs) = operand(br, bc, tb);
        if k != k2 {
            return Err(mismatch());
        }
        let out_shape: Shape = if sa.len() == 3 {
            [batch, m, n].as_slice().into()
        } else {
            [m, n].as_slice().into()
        };
        // The operands' products fit (their tensors exist), but the destination's need not:
        // `[2^33, 0]·[0, 2^33]` is a valid product of two empty tensors with 2^66 elements.
        let overflow = |what: &str| Error::Invalid {
            op: OP,
            detail: format!(
                "{what} of the product of {:?} and {:?} overflows usize",
                a.shape(),
                b.shape()
            ),
        };
        let (Some(mk), Some(kn), Some(mn)) = (m.checked_mul(k), k.checked_mul(n), m.checked_mul(n))
        else {
            return Err(overflow("an m·k, k·n or m·n block"));
        };
        if crate::checked_numel(&out_shape).is_none() {
            return Err(overflow("the destination's element count"));
        }
        let shared_rhs = sb.len() == 2;
        let mut plan = Plan {
            batch,
            m,
            n,
            k,
            mk,
            kn,
            mn,
            a_batch: mk,
            a_rs,
            a_cs,
            b_batch: if shared_rhs { 0 } else { kn },
            b_rs,
            b_cs,
            out_shape,
        };
        if shared_rhs && ta == Transpose::No && batch > 1 {
            // `[b,m,k]` row-major is `[b·m, k]`, and so is the `[b,m,n]` destination.
            let merged = |x: usize| batch.checked_mul(x).ok_or_else(|| overflow("batch·m"));
            plan.m = merged(m)?;
            plan.mk = merged(mk)?;
            plan.mn = merged(mn)?;
            plan.a_batch = plan.mk;
            plan.batch = 1;
        }
        Ok(plan)
    }
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
