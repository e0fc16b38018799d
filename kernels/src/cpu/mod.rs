//! The host kernels: each op's arithmetic on host tensors, in the fixed order that keeps
//! replicas bitwise identical. Called only by the front door ([`crate::ops`]), after it has
//! checked the arguments (with the [`crate::spec`] checks) and found the tensors in host
//! memory; a few kernels run their `spec` check themselves. Each kernel's doc names what it
//! relies on and the check that ensures it. Imports the spec and storage floors only.

pub(crate) mod activation;
pub(crate) mod attention;
pub(crate) mod attention_block;
pub(crate) mod cross_entropy;
pub(crate) mod elementwise;
pub(crate) mod embedding;
pub(crate) mod matmul;
pub(crate) mod moe;
pub(crate) mod norm;
pub(crate) mod optim;
pub(crate) mod reduction;
pub(crate) mod rope;
pub(crate) mod softmax;
pub(crate) mod tensor;

pub(crate) use crate::spec::float::{exp_f32, AccFloat, Float};
pub(crate) use crate::spec::{acc_dtype, not_float, Accum, Transpose};
pub(crate) use gemm::Parallelism;

/// Writes `v` into `d` according to `accum`, rounding once.
#[inline(always)]
pub(crate) fn store<T: Float>(d: &mut T, v: T::Acc, accum: Accum) {
    *d = match accum {
        Accum::Replace => T::from_acc(v),
        Accum::Add => T::from_acc(d.to_acc() + v),
    };
}
