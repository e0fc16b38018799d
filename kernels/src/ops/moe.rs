//! Mixture-of-experts kernels: row gathers and scatters (a dispatch's permutation) and the
//! grouped product `y[rows of group e] = x[rows of group e] · W[e]ᵀ`, forward and backward.
//!
//! Rows are grouped contiguously: group `e` holds `groups[e]` rows, after the rows of the
//! groups before it (a group may be empty). Gathers copy elements exactly; scatter-adds
//! and the products follow the module conventions (f64 in f64, others rounded once).

use crate::spec::moe::*;
use crate::{Result, Tensor};

/// The adjoint of [`gather_rows`](super::gather_rows): `out[rows[i]] += src[i]`, `out` is `[n, h]` (rows no
/// source row names stay zero).
pub fn scatter_add_rows(src: &Tensor, rows: &[usize], n: usize) -> Result<Tensor> {
    const OP: &str = "ops::scatter_add_rows";
    let (_, h) = check_scatter_add(OP, src, rows, n)?;
    dispatch!(OP, [src] => device::scatter_add_rows(&src, rows, n, h));
    crate::cpu::moe::scatter_add_rows(src, rows, n, h)
}

/// `y[rows of group e] = x[rows of group e] · W[e]ᵀ`: `x` is `[rows, in]`, `w` is
/// `[experts, out, in]` (each expert stored as a linear layer's `[out, in]`), `groups[e]`
/// the rows of expert `e` (Σ = rows). Returns `[rows, out]`.
pub fn grouped_matmul_t(x: &Tensor, w: &Tensor, groups: &[usize]) -> Result<Tensor> {
    const OP: &str = "ops::grouped_matmul_t";
    let (_, out, k) = check_grouped(OP, x, w, groups)?;
    dispatch!(OP, [x, w] => device::grouped_matmul_t(&x, &w, groups, out, k));
    crate::cpu::moe::grouped_matmul_t(x, w, groups, out, k)
}

/// The backward of [`grouped_matmul_t`] from the output gradient `dy` (`[rows, out]`).
pub fn grouped_matmul_t_backward(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    groups: &[usize],
) -> Result<GroupedMatmulGrads> {
    const OP: &str = "ops::grouped_matmul_t_backward";
    let dims = check_grouped_backward(OP, dy, x, w, groups)?;
    dispatch!(OP, [dy, x, w] => device::grouped_matmul_t_backward(&dy, &x, &w, groups, dims));
    crate::cpu::moe::grouped_matmul_t_backward(dy, x, w, groups, dims)
}

/// The device launches: the scatter-add as a kernel (`cuda/kernels/moe.cu`), the grouped
/// products through cuBLAS, on arguments the front door has checked.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{func, grid_for, launch_kernel};
    use crate::cuda::{source, CudaBuffer, CudaTensor};
    use crate::ops::matmul::device::gemm_ops;
    use crate::spec::moe::GroupedMatmulGrads;
    use crate::spec::{not_float, Transpose};
    use crate::{DType, Error, Result, Tensor};

    /// `out[rows[i]] += src[i]`, `out` `[n, h]` (rows no
    /// source names stay zero). Deterministic and bitwise the CPU's result: each output element
    /// sums its sources in source order in f64, then rounds once (see `moe.cu`).
    pub(super) fn scatter_add_rows(
        src: &CudaTensor,
        rows: &[usize],
        n: usize,
        h: usize,
    ) -> Result<CudaTensor> {
        const OP: &str = "ops::scatter_add_rows";
        let m = rows.len();
        let dev = src.device();
        let mut out = CudaTensor::uninit(dev, &[n, h], src.dtype())?;
        if n * h == 0 {
            return Ok(out);
        }
        // CSR of the sources by destination row, in source order within a row.
        let mut starts = vec![0i64; n + 1];
        for &r in rows {
            starts[r + 1] += 1;
        }
        for r in 0..n {
            starts[r + 1] += starts[r];
        }
        let mut fill: Vec<i64> = starts[..n].to_vec();
        let mut sources = vec![0i64; m.max(1)];
        for (i, &r) in rows.iter().enumerate() {
            sources[fill[r] as usize] = i as i64;
            fill[r] += 1;
        }
        let starts = Tensor::from_vec(starts, &[n + 1])?.upload(dev)?;
        let sources = Tensor::from_vec(sources, &[m.max(1)])?.upload(dev)?;
        let f = func(dev, &source::MOE, "scatter_add_rows", src.dtype())?;
        launch_kernel!(OP, dev, f, grid_for(n * h);
            src src, src &starts, src &sources, dst &mut out, u64 n, u64 h)?;
        Ok(out)
    }

    /// `Err` ([`Error::NotOnCuda`]) unless every size fits cuBLAS's `i32`: a device-only
    /// limit (the host kernels take any `usize`).
    fn gemm_sizes(op: &'static str, sizes: &[usize]) -> Result<()> {
        if sizes.iter().all(|&v| i32::try_from(v).is_ok()) {
            Ok(())
        } else {
            Err(Error::NotOnCuda {
                op,
                detail: format!(": a size of {sizes:?} exceeds cuBLAS's i32 sizes"),
            })
        }
    }

    /// One row-major product into a row range of a buffer: `c[c_off ..]` (`[m, n]`, rows of `n`)
    /// `= op(a)·op(b)`, where `a` holds `[m, k]` (or `[k, m]` transposed) from element `a_off`
    /// and `b` holds `[k, n]` (or `[n, k]`) from `b_off`, each contiguous. Run as the column-major
    /// `cᵀ = op(b)ᵀ·op(a)ᵀ` through `cublasGemmEx` on offset device pointers (no copies): f32 and
    /// f64 in their own precision (no TF32: the handle keeps the default math mode), bf16/f16 in
    /// f32 rounded once, as [`matmul`](crate::ops::matmul).
    #[allow(clippy::too_many_arguments)]
    fn gemm_rows(
        op: &'static str,
        a: &CudaTensor,
        a_off: usize,
        ta: Transpose,
        b: &CudaTensor,
        b_off: usize,
        tb: Transpose,
        c: &mut CudaTensor,
        c_off: usize,
        (m, n, k): (usize, usize, usize),
    ) -> Result<()> {
        use cudarc::cublas::result;
        use cudarc::cublas::sys;
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        debug_assert!(a_off + m * k <= a.numel() && b_off + k * n <= b.numel());
        debug_assert!(c_off + m * n <= c.numel());
        gemm_sizes(op, &[m, n, k])?;
        let dev = a.device().clone();
        let blas = dev.blas()?.clone();
        let stream = dev.stream().clone(); // the stream Device::blas bound cuBLAS to
        let ((transa, lda), (transb, ldb)) = gemm_ops(ta, tb, (m, n, k));
        let err = |e: result::CublasError| Error::Cuda {
            op,
            detail: e.to_string(),
        };
        // `$v` the buffer variant, `$e` its element, `$ty` the cuBLAS data type, `$s` the type of
        // alpha/beta and `$compute` the compute type. The front door checked that a, b and c
        // share a float dtype, so the `Err`s below are not reached.
        macro_rules! run {
            ($v:ident, $e:ty, $ty:ident, $s:ty, $compute:ident) => {{
                let (CudaBuffer::$v(sa), CudaBuffer::$v(sb)) = (a.buffer(), b.buffer()) else {
                    return Err(Error::DTypeMismatch {
                        op,
                        lhs: a.dtype(),
                        rhs: b.dtype(),
                    });
                };
                let cd = c.dtype();
                let CudaBuffer::$v(sc) = c.buffer_mut()? else {
                    return Err(Error::DTypeMismatch {
                        op,
                        lhs: cd,
                        rhs: a.dtype(),
                    });
                };
                let bytes = std::mem::size_of::<$e>() as u64;
                let (alpha, beta): ($s, $s) = (1.0, 0.0);
                let ty = sys::cudaDataType_t::$ty;
                // The guards order the stream after the buffers' last uses and record this one;
                // they live until the call is queued.
                let (pb, _gb) = sb.device_ptr(&stream);
                let (pa, _ga) = sa.device_ptr(&stream);
                let (pc, _gc) = sc.device_ptr_mut(&stream);
                // SAFETY: the caller's shapes: from the offsets, a, b and c hold the m·k, k·n and
                // m·n elements the leading dimensions address (checked above in debug builds);
                // alpha/beta are host values of the compute type's precision.
                unsafe {
                    result::gemm_ex(
                        *blas.handle(),
                        transa,
                        transb,
                        n as i32,
                        m as i32,
                        k as i32,
                        (&alpha as *const $s).cast(),
                        (pb + b_off as u64 * bytes) as *const _,
                        ty,
                        lda as i32,
                        (pa + a_off as u64 * bytes) as *const _,
                        ty,
                        ldb as i32,
                        (&beta as *const $s).cast(),
                        (pc + c_off as u64 * bytes) as *mut _,
                        ty,
                        n as i32,
                        sys::cublasComputeType_t::$compute,
                        sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(err)
            }};
        }
        match a.dtype() {
            DType::F32 => run!(F32, f32, CUDA_R_32F, f32, CUBLAS_COMPUTE_32F),
            DType::F64 => run!(F64, f64, CUDA_R_64F, f64, CUBLAS_COMPUTE_64F),
            DType::BF16 => run!(BF16, u16, CUDA_R_16BF, f32, CUBLAS_COMPUTE_32F),
            DType::F16 => run!(F16, u16, CUDA_R_16F, f32, CUBLAS_COMPUTE_32F),
            other => Err(not_float(op, other)),
        }
    }

    // The grouped products are one cuBLAS GEMM per non-empty group, on pointers offset into the
    // shared x / y / w buffers (no gathers, no copies). A group is one expert's tokens: few groups
    // (the experts of a rank), each a full-size GEMM, so cuBLAS's tuned kernels do the work and
    // the per-group launch costs microseconds; a single hand-written kernel over all groups would
    // only win for many tiny groups, and would give up cuBLAS's tensor-core paths for bf16/f16.

    /// `y[rows of group e] = x[rows of group e] · W[e]ᵀ`,
    /// `x` `[rows, in]`, `w` `[experts, out, in]`, `groups[e]` rows per expert (Σ = rows).
    pub(super) fn grouped_matmul_t(
        x: &CudaTensor,
        w: &CudaTensor,
        groups: &[usize],
        out: usize,
        k: usize,
    ) -> Result<CudaTensor> {
        const OP: &str = "ops::grouped_matmul_t";
        let rows = x.shape()[0];
        let dev = x.device();
        if rows * out == 0 || k == 0 {
            return CudaTensor::zeros(dev, &[rows, out], x.dtype());
        }
        gemm_sizes(OP, &[rows, out, k])?;
        let mut y = CudaTensor::uninit(dev, &[rows, out], x.dtype())?;
        let mut start = 0;
        for (e, &n) in groups.iter().enumerate() {
            if n > 0 {
                gemm_rows(
                    OP,
                    x,
                    start * k,
                    Transpose::No,
                    w,
                    e * out * k,
                    Transpose::Yes,
                    &mut y,
                    start * out,
                    (n, out, k),
                )?;
            }
            start += n;
        }
        Ok(y)
    }

    /// The backward from the output gradient `dy`
    /// (`[rows, out]`): `dx = dy[group e] · W[e]` and `dw[e] = dy[group e]ᵀ · x[group e]` (zeros
    /// for an empty group).
    pub(super) fn grouped_matmul_t_backward(
        dy: &CudaTensor,
        x: &CudaTensor,
        w: &CudaTensor,
        groups: &[usize],
        (e, out, k): (usize, usize, usize),
    ) -> Result<GroupedMatmulGrads> {
        const OP: &str = "ops::grouped_matmul_t_backward";
        let rows = x.shape()[0];
        let dev = x.device();
        let mut dw = CudaTensor::zeros(dev, &[e, out, k], x.dtype())?;
        if rows * out * k == 0 {
            // Every product is empty or an empty sum: zeros.
            let dx = CudaTensor::zeros(dev, &[rows, k], x.dtype())?;
            return Ok(GroupedMatmulGrads {
                dx: dx.into(),
                dw: dw.into(),
            });
        }
        gemm_sizes(OP, &[rows, out, k])?;
        let mut dx = CudaTensor::uninit(dev, &[rows, k], x.dtype())?;
        let mut start = 0;
        for (g, &n) in groups.iter().enumerate() {
            if n == 0 {
                continue;
            }
            gemm_rows(
                OP,
                dy,
                start * out,
                Transpose::No,
                w,
                g * out * k,
                Transpose::No,
                &mut dx,
                start * k,
                (n, k, out),
            )?;
            gemm_rows(
                OP,
                dy,
                start * out,
                Transpose::Yes,
                x,
                start * k,
                Transpose::No,
                &mut dw,
                g * out * k,
                (out, k, n),
            )?;
            start += n;
        }
        Ok(GroupedMatmulGrads {
            dx: dx.into(),
            dw: dw.into(),
        })
    }
}
