//! Products: the plan of one call (operand strides and the output shape), with the checks
//! that make it.

use super::Transpose;
use crate::{Error, Result, Shape, Tensor};

const OP: &str = "ops::matmul";

/// One validated product: `batch` gemms of `op(a)[m,k]·op(b)[k,n]` into row-major `[m,n]`
/// blocks of dst. Strides are in elements; a batch stride of 0 means "shared".
///
/// `mk`, `kn` and `mn` are the block sizes, computed once with overflow checks: gemm
/// addresses exactly that many elements from the raw pointers it is given, so a wrapped
/// product would make it read and write far past slices cut with the wrapped length.
#[derive(Debug)]
pub(crate) struct Plan {
    pub(crate) batch: usize,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) mk: usize,
    pub(crate) kn: usize,
    pub(crate) mn: usize,
    pub(crate) a_batch: usize,
    pub(crate) a_rs: isize,
    pub(crate) a_cs: isize,
    pub(crate) b_batch: usize,
    pub(crate) b_rs: isize,
    pub(crate) b_cs: isize,
    pub(crate) out_shape: Shape,
}

/// `(rows, cols, row stride, col stride)` of `op(x)` for a row-major `[r, c]` matrix.
pub(crate) fn operand(r: usize, c: usize, t: Transpose) -> (usize, usize, isize, isize) {
    match t {
        Transpose::No => (r, c, c as isize, 1),
        Transpose::Yes => (c, r, 1, c as isize),
    }
}

impl Plan {
    pub(crate) fn new(a: &Tensor, ta: Transpose, b: &Tensor, tb: Transpose) -> Result<Plan> {
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
