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
    dispatch!(OP, [a, b] => {
        let gemm = device::GemmPlan::new(&a, ta, &b, tb)?;
        let mut dst = crate::cuda::CudaTensor::uninit(a.device(), &plan.out_shape, a.dtype())?;
        device::matmul(&mut dst, &a, ta, &b, tb, Accum::Replace, &gemm).map(|()| dst)
    });
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
    dispatch!(OP, mut dst, [a, b] => {
        let gemm = device::GemmPlan::new(&a, ta, &b, tb)?;
        device::matmul(dst, &a, ta, &b, tb, accum, &gemm)
    });
    crate::cpu::matmul::matmul_into_with(dst, a, b, accum, par, scratch, plan)
}

/// The device products through cuBLAS: f32 and f64 natively, bf16/f16 inputs and output with
/// f32 compute (cublasGemmEx, rounded once). Row-major products run as the column-major
/// `Cᵀ = op(b)ᵀ·op(a)ᵀ`; batches use the strided-batched call (stride 0 for a shared rhs).
/// cuBLAS's summation order is its own: results agree with the host to rounding.
#[cfg(feature = "cuda")]
pub(crate) mod device {
    use crate::cuda::{CudaBuffer, CudaTensor};
    use crate::spec::{Accum, Transpose};
    use crate::{DType, Error, Result};

    /// The cuBLAS call's sizes for operands the front door's `Plan` accepted: `batch`
    /// products of `[m,k]·[k,n]`, rhs `b_stride` elements apart (0: shared).
    pub(super) struct GemmPlan {
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
        b_stride: usize,
        out: crate::Shape,
    }

    impl GemmPlan {
        /// The sizes, or [`Error::NotOnCuda`] where one exceeds cuBLAS's `i32`: a
        /// device-only limit (the host kernel takes any size the `Plan` accepted).
        pub(super) fn new(
            a: &CudaTensor,
            ta: Transpose,
            b: &CudaTensor,
            tb: Transpose,
        ) -> Result<GemmPlan> {
            let last2 = |s: &[usize], t: Transpose| {
                let (r, c) = (s[s.len() - 2], s[s.len() - 1]);
                if t == Transpose::No {
                    (r, c)
                } else {
                    (c, r)
                }
            };
            let ((m, k), (_, n)) = (last2(a.shape(), ta), last2(b.shape(), tb));
            let (batch, b_stride, out): (usize, usize, crate::Shape) = match (a.rank(), b.rank()) {
                (3, 3) => (a.shape()[0], k * n, [a.shape()[0], m, n][..].into()),
                (3, _) => (a.shape()[0], 0, [a.shape()[0], m, n][..].into()),
                _ => (1, 0, [m, n][..].into()),
            };
            if ![batch, m, n, k]
                .into_iter()
                .all(|v| i32::try_from(v).is_ok())
            {
                return Err(Error::NotOnCuda {
                    op: "ops::matmul",
                    detail: format!(
                        ": a dim of {:?}·{:?} exceeds cuBLAS's i32 sizes",
                        a.shape(),
                        b.shape()
                    ),
                });
            }
            Ok(GemmPlan {
                batch,
                m,
                n,
                k,
                b_stride,
                out,
            })
        }
    }

    /// cuBLAS's operations and leading dimensions for the row-major `C[m, n] = op(A)[m, k] ·
    /// op(B)[k, n]`, computed column-major as `C'[n, m] = op'(B)[n, k] · op'(A)[k, m]`:
    /// `((transa, lda), (transb, ldb))`, cuBLAS's first operand being `B`.
    pub(crate) fn gemm_ops<I: Copy>(
        ta: Transpose,
        tb: Transpose,
        (m, n, k): (I, I, I),
    ) -> (
        (cudarc::cublas::sys::cublasOperation_t, I),
        (cudarc::cublas::sys::cublasOperation_t, I),
    ) {
        use cudarc::cublas::sys::cublasOperation_t as Op;
        let a = match tb {
            Transpose::No => (Op::CUBLAS_OP_N, n),
            Transpose::Yes => (Op::CUBLAS_OP_T, k),
        };
        let b = match ta {
            Transpose::No => (Op::CUBLAS_OP_N, k),
            Transpose::Yes => (Op::CUBLAS_OP_T, m),
        };
        (a, b)
    }

    pub(super) fn matmul(
        dst: &mut CudaTensor,
        a: &CudaTensor,
        ta: Transpose,
        b: &CudaTensor,
        tb: Transpose,
        accum: Accum,
        p: &GemmPlan,
    ) -> Result<()> {
        use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig};
        const OP: &str = "ops::matmul";
        if p.batch * p.m * p.n == 0 {
            return Ok(());
        }
        if p.k == 0 {
            // An empty sum: zeros, or nothing to add.
            if accum == Accum::Replace {
                *dst = CudaTensor::zeros(a.device(), &p.out, a.dtype())?;
            }
            return Ok(());
        }
        let blas = a.device().blas()?.clone();
        let (m, n, k) = (p.m as i32, p.n as i32, p.k as i32);
        // Column-major: C'[n, m] = op'(B)[n, k] · op'(A)[k, m], B' = b, A' = a as stored.
        let ((transa, lda), (transb, ldb)) = gemm_ops(ta, tb, (m, n, k));
        let beta = if accum == Accum::Add { 1.0 } else { 0.0 };
        let (batch, stride_a, stride_b, stride_c) = (
            p.batch as i32,
            p.b_stride as i64,
            (p.m * p.k) as i64,
            (p.m * p.n) as i64,
        );
        let err = |e: cudarc::cublas::result::CublasError| Error::Cuda {
            op: OP,
            detail: e.to_string(),
        };
        // The typed slices of a, b and dst (variant `$v` of each; the plan checked a's and b's
        // dtypes and the callers dst's, so the `Err`s are not reached).
        macro_rules! buffers {
            ($v:ident) => {{
                let (CudaBuffer::$v(sa), CudaBuffer::$v(sb)) = (a.buffer(), b.buffer()) else {
                    return Err(Error::DTypeMismatch {
                        op: OP,
                        lhs: a.dtype(),
                        rhs: b.dtype(),
                    });
                };
                let dt = dst.dtype();
                let CudaBuffer::$v(sc) = dst.buffer_mut()? else {
                    return Err(Error::DTypeMismatch {
                        op: OP,
                        lhs: dt,
                        rhs: a.dtype(),
                    });
                };
                (sa, sb, sc)
            }};
        }
        macro_rules! run {
            ($v:ident, $one:expr, $zero_or_one:expr) => {{
                let (sa, sb, sc) = buffers!($v);
                let cfg = GemmConfig {
                    transa,
                    transb,
                    m: n,
                    n: m,
                    k,
                    alpha: $one,
                    lda,
                    ldb,
                    beta: $zero_or_one,
                    ldc: n,
                };
                // SAFETY: the plan checked the shapes: each buffer holds the batch·rows·cols
                // elements the leading dimensions and strides above address.
                unsafe {
                    if p.batch == 1 {
                        blas.gemm(cfg, sb, sa, sc)
                    } else {
                        blas.gemm_strided_batched(
                            StridedBatchedConfig {
                                gemm: cfg,
                                batch_size: batch,
                                stride_a,
                                stride_b,
                                stride_c,
                            },
                            sb,
                            sa,
                            sc,
                        )
                    }
                }
                .map_err(err)
            }};
        }
        // bf16/f16: cublasGemmEx with 16-bit inputs and output, f32 compute and f32 alpha/beta
        // (rounded once into the output); the buffers hold the bits as u16.
        macro_rules! run16 {
            ($v:ident, $ty:ident) => {{
                use cudarc::cublas::{result, sys};
                use cudarc::driver::{DevicePtr, DevicePtrMut};
                let (sa, sb, sc) = buffers!($v);
                let stream = a.device().stream().clone(); // the stream Device::blas bound cuBLAS to
                let (alpha, beta) = (1.0f32, beta as f32);
                let ty = sys::cudaDataType_t::$ty;
                let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
                let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
                // The guards order the stream after the buffers' last writes/reads and record
                // this use; they live until the call is queued.
                let (pb, _gb) = sb.device_ptr(&stream);
                let (pa, _ga) = sa.device_ptr(&stream);
                let (pc, _gc) = sc.device_ptr_mut(&stream);
                // SAFETY: as for the typed calls above; alpha/beta are host f32 as
                // CUBLAS_COMPUTE_32F requires; the pointers are device buffers of u16 bits.
                unsafe {
                    if p.batch == 1 {
                        result::gemm_ex(
                            *blas.handle(),
                            transa,
                            transb,
                            n,
                            m,
                            k,
                            (&alpha as *const f32).cast(),
                            pb as *const _,
                            ty,
                            lda,
                            pa as *const _,
                            ty,
                            ldb,
                            (&beta as *const f32).cast(),
                            pc as *mut _,
                            ty,
                            n,
                            compute,
                            algo,
                        )
                    } else {
                        result::gemm_strided_batched_ex(
                            *blas.handle(),
                            transa,
                            transb,
                            n,
                            m,
                            k,
                            (&alpha as *const f32).cast(),
                            pb as *const _,
                            ty,
                            lda,
                            stride_a,
                            pa as *const _,
                            ty,
                            ldb,
                            stride_b,
                            (&beta as *const f32).cast(),
                            pc as *mut _,
                            ty,
                            n,
                            stride_c,
                            batch,
                            compute,
                            algo,
                        )
                    }
                }
                .map_err(err)
            }};
        }
        match a.dtype() {
            DType::F32 => run!(F32, 1.0f32, beta as f32),
            DType::F64 => run!(F64, 1.0f64, beta),
            DType::BF16 => run16!(BF16, CUDA_R_16BF),
            DType::F16 => run16!(F16, CUDA_R_16F),
            // The front door's `Plan` refused other dtypes: not reached.
            other => Err(crate::spec::not_float(OP, other)),
        }
    }
}
