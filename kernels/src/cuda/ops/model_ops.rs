//! The model's remaining kernels on the device, each mirroring a CPU op (same name, shapes,
//! dtypes and argument errors, with the op named `cuda::…`):
//!
//! | CPU op | here | agreement with the CPU |
//! |---|---|---|
//! | `ops::attention_block` and backward | [`attention_block`], [`attention_block_backward`] | to rounding; key / query blocks bounded by shared memory |
//! | `ops::merge_attention` | [`merge_attention`] | to rounding (CUDA's `exp`/`log`) |
//! | `ops::pack_kv`, `fuse_qkv_grad`, `gather_rows` | [`pack_kv`], [`fuse_qkv_grad`], [`gather_rows`] | bitwise |
//! | `ops::grouped_matmul_t` and backward | [`grouped_matmul_t`], [`grouped_matmul_t_backward`] (cuBLAS) | to rounding (cuBLAS's order) |
//! | `ops::scatter_add_rows` | [`scatter_add_rows`] | bitwise (deterministic, the CPU's order) |
//! | `reduce::combine`, `reduce::reduce_into` | [`combine`], [`reduce_into`] | bitwise, every dtype and `ReduceOp` (but the payload of a NaN that Sum/Avg computes: the GPU's is canonical, Rust leaves it unspecified) |
//!
//! Host-side index lists (positions, rows, groups) are checked on the host and uploaded as
//! `i64`; every launch size comes from the checked shapes.

use super::{
    arg, arg_mut, copy_blocks, func, gemm_ops, grid_for, launch, per_row, rope_tables, same_device,
    same_layout, u, Acc, CudaAttentionOutput, Kernel, SHARED_BUDGET,
};
use crate::cuda::source::{self, Param, Scalar};
use crate::cuda::{CudaBuffer, CudaTensor, Device};
use crate::spec::attention_block::BlockAttention;
use crate::spec::attention_block::{
    check_block, check_fuse_qkv_grad, check_merge, check_pack_kv, Dims,
};
use crate::spec::moe::{check_grouped, check_scatter_add};
use crate::spec::{acc_dtype, check_dst, not_float, same_dtype, want_float, Transpose};
use crate::{DType, Error, ReduceOp, Result, Tensor};
use cudarc::driver::PushKernelArg;

// ---- context-parallel attention pieces ------------------------------------------------

/// Positions as an `i64` device vector (what the kernels compare).
fn positions(op: &'static str, p: &[usize], dev: &Device) -> Result<CudaTensor> {
    let v = p
        .iter()
        .map(|&x| {
            i64::try_from(x).map_err(|_| Error::NotOnCuda {
                op,
                detail: format!(": position {x} exceeds the kernels' i64 positions"),
            })
        })
        .collect::<Result<Vec<i64>>>()?;
    Tensor::from_vec(v, &[p.len()])?.upload(dev)
}

/// `Err` ([`Error::NotOnCuda`]) unless `values` compute-type values fit the shared memory of
/// one block (`what` names the block length that sets it).
fn shared_bound(op: &'static str, values: usize, what: &str, dtype: DType) -> Result<u32> {
    let acc = acc_dtype(dtype).size_in_bytes();
    let bytes = values.saturating_mul(acc);
    if bytes > SHARED_BUDGET {
        return Err(Error::NotOnCuda {
            op,
            detail: format!(
                ": {what} need {bytes} bytes of shared memory per block, over the {SHARED_BUDGET} this kernel uses ({} values of {dtype}'s compute type at most)",
                SHARED_BUDGET / acc
            ),
        });
    }
    Ok(bytes as u32)
}

/// One block call's loaded operands: q `[H, B, nq, d]` (rotated, times `1/√d`), k (rotated)
/// and v `[H, B, nk, d]` in the compute type, the positions, and the RoPE tables.
struct BlockOperands {
    q: CudaTensor,
    k: CudaTensor,
    v: CudaTensor,
    qpos: CudaTensor,
    kpos: CudaTensor,
    cq: CudaTensor,
    sq: CudaTensor,
    ck: CudaTensor,
    sk: CudaTensor,
}

fn block_load(
    op: &'static str,
    qkv: &CudaTensor,
    kv: &CudaTensor,
    g: &Dims,
    cfg: &BlockAttention,
) -> Result<BlockOperands> {
    let (dev, dt) = (qkv.device(), qkv.dtype());
    let ad = acc_dtype(dt);
    let (cq, sq) = rope_tables(cfg.q_pos.iter().copied(), g.d, cfg.rope_base, dt, dev)?;
    let (ck, sk) = rope_tables(cfg.k_pos.iter().copied(), g.d, cfg.rope_base, dt, dev)?;
    let mut q = CudaTensor::uninit(dev, &[g.heads, g.batch, g.nq, g.d], ad)?;
    let mut k = CudaTensor::uninit(dev, &[g.heads, g.batch, g.nk, g.d], ad)?;
    let mut v = CudaTensor::uninit(dev, &[g.heads, g.batch, g.nk, g.d], ad)?;
    let scale = Acc::lit(dt, 1.0 / (g.d as f64).sqrt());
    let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_load_q", dt)?;
    launch_kernel!(op, dev, f, grid_for(g.heads * g.batch * g.nq * g.d / 2);
        src qkv, src &cq, src &sq, dst &mut q, u64 g.batch, u64 g.heads, u64 g.nq, u64 g.d,
        acc scale)?;
    let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_load_kv", dt)?;
    launch_kernel!(op, dev, f, grid_for(g.heads * g.batch * g.nk * g.d / 2);
        src kv, src &ck, src &sk, dst &mut k, dst &mut v, u64 g.batch, u64 g.heads, u64 g.nk,
        u64 g.d)?;
    Ok(BlockOperands {
        q,
        k,
        v,
        qpos: positions(op, cfg.q_pos, dev)?,
        kpos: positions(op, cfg.k_pos, dev)?,
        cq,
        sq,
        ck,
        sk,
    })
}

/// `ops::attention_block` on the device: the normalized partial output `[rows, H·d]` and its
/// lse `[rows, H]`, both in the compute dtype (a query that sees no key of the block gets
/// `out = 0`, `lse = −∞`). The key block's length is bounded by shared memory (an
/// [`Error::NotOnCuda`] above it).
pub fn attention_block(
    qkv: &CudaTensor,
    kv: &CudaTensor,
    cfg: &BlockAttention,
) -> Result<CudaAttentionOutput> {
    const OP: &str = "cuda::ops::attention_block";
    let g = check_block(OP, qkv, kv, cfg)?;
    same_device(OP, &[qkv, kv])?;
    let (dev, dt) = (qkv.device(), qkv.dtype());
    let ad = acc_dtype(dt);
    let rows = g.batch * g.nq;
    let mut out = CudaTensor::uninit(dev, &[rows, g.heads * g.d], ad)?;
    let mut lse = CudaTensor::uninit(dev, &[rows, g.heads], ad)?;
    if rows * g.heads == 0 {
        return Ok(CudaAttentionOutput { out, lse });
    }
    if cfg.fully_masked() {
        let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_masked", dt)?;
        launch_kernel!(OP, dev, f, grid_for(rows * g.heads * g.d);
            dst &mut out, dst &mut lse, u64 rows, u64 g.heads, u64 g.d)?;
        return Ok(CudaAttentionOutput { out, lse });
    }
    let smem = shared_bound(OP, g.nk, &format!("{} keys per sample", g.nk), dt)?;
    let x = block_load(OP, qkv, kv, &g, cfg)?;
    let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_forward", dt)?;
    launch_kernel!(OP, dev, f, per_row(OP, g.heads * rows, smem)?;
        src &x.q, src &x.k, src &x.v, src &x.qpos, src &x.kpos, dst &mut out, dst &mut lse,
        u64 g.batch, u64 g.heads, u64 g.nq, u64 g.nk, u64 g.d)?;
    Ok(CudaAttentionOutput { out, lse })
}

/// `ops::attention_block_backward` on the device: adds this (query block, key block) pair's
/// share of the gradient into `dq` (`[rows_q, H·d]`) and `dkv` (`[rows_k, H·2·d]`), both in
/// the compute dtype, from `dout` and the *final* `out` (qkv's dtype) and `lse` (compute
/// dtype). Bounded by shared memory like [`attention_block`] (keys, and twice the queries).
#[allow(clippy::too_many_arguments)]
pub fn attention_block_backward(
    dout: &CudaTensor,
    qkv: &CudaTensor,
    kv: &CudaTensor,
    out: &CudaTensor,
    lse: &CudaTensor,
    cfg: &BlockAttention,
    dq: &mut CudaTensor,
    dkv: &mut CudaTensor,
) -> Result<()> {
    const OP: &str = "cuda::ops::attention_block_backward";
    let g = check_block(OP, qkv, kv, cfg)?;
    same_dtype(OP, dout, qkv)?;
    same_dtype(OP, out, qkv)?;
    let rq = g.batch * g.nq;
    let (dt, ad) = (qkv.dtype(), acc_dtype(qkv.dtype()));
    for t in [dout, out] {
        if t.shape() != [rq, g.heads * g.d] {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: t.shape().into(),
                rhs: [rq, g.heads * g.d].as_slice().into(),
            });
        }
    }
    check_dst(OP, lse, &[rq, g.heads], ad)?;
    check_dst(OP, dq, &[rq, g.heads * g.d], ad)?;
    check_dst(OP, dkv, &[g.batch * g.nk, g.kvcols()], ad)?;
    same_device(OP, &[qkv, kv, dout, out, lse, &*dq, &*dkv])?;
    if cfg.fully_masked() || rq * g.heads == 0 {
        return Ok(());
    }
    let what = format!("{} keys and 2 × {} queries per sample", g.nk, g.nq);
    let smem = shared_bound(OP, g.nk.max(2 * g.nq), &what, dt)?;
    let dev = qkv.device();
    let x = block_load(OP, qkv, kv, &g, cfg)?;
    let mut dsum = CudaTensor::uninit(dev, &[g.heads, g.batch, g.nq], ad)?;
    let scale = Acc::lit(dt, 1.0 / (g.d as f64).sqrt());
    let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_backward_dq", dt)?;
    launch_kernel!(OP, dev, f, per_row(OP, g.heads * rq, smem)?;
        src &x.q, src &x.k, src &x.v, src dout, src out, src lse, src &x.qpos, src &x.kpos,
        dst &mut dsum, dst dq, src &x.cq, src &x.sq, u64 g.batch, u64 g.heads, u64 g.nq,
        u64 g.nk, u64 g.d, acc scale)?;
    // Same stream: runs after the dq kernel has written every D_i into dsum.
    let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_backward_dkv", dt)?;
    launch_kernel!(OP, dev, f, per_row(OP, g.heads * g.batch * g.nk, smem)?;
        src &x.q, src &x.k, src &x.v, src dout, src lse, src &dsum, src &x.qpos, src &x.kpos,
        dst dkv, src &x.ck, src &x.sk, u64 g.batch, u64 g.heads, u64 g.nq, u64 g.nk, u64 g.d)
}

/// `ops::merge_attention` on the device: merges `part` into `acc` by their lse, row and head
/// at a time (a side with `lse = −∞` contributes nothing). Compute dtypes (f32, f64) only.
pub fn merge_attention(acc: &mut CudaAttentionOutput, part: &CudaAttentionOutput) -> Result<()> {
    const OP: &str = "cuda::ops::merge_attention";
    let (rows, heads, ocols) = check_merge(OP, (&acc.out, &acc.lse), (&part.out, &part.lse))?;
    let dt = acc.lse.dtype();
    same_device(OP, &[&acc.out, &acc.lse, &part.out, &part.lse])?;
    let n = rows * heads;
    if n == 0 {
        return Ok(());
    }
    let d = ocols / heads;
    let dev = acc.lse.device().clone();
    let f = func(&dev, &source::ATTENTION_BLOCK, "merge_attention", dt)?;
    launch_kernel!(OP, dev, f, grid_for(n);
        dst &mut acc.out, dst &mut acc.lse, src &part.out, src &part.lse, u64 n, u64 d)
}

/// `ops::pack_kv` on the device: the k and v columns of a fused `[tokens, H·3·d]` QKV as
/// `[tokens, H·2·d]` (a strided copy, bitwise).
pub fn pack_kv(qkv: &CudaTensor, head_dim: usize) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::pack_kv";
    let d = head_dim;
    let (rows, heads) = check_pack_kv(OP, qkv, d)?;
    want_float(OP, qkv)?;
    let mut kv = CudaTensor::uninit(qkv.device(), &[rows, heads * 2 * d], qkv.dtype())?;
    // Rows of heads are runs of 3·d: copy the last 2·d of each.
    copy_blocks(OP, qkv, &mut kv, rows * heads, 2 * d, 3 * d, d, 2 * d, 0)?;
    Ok(kv)
}

/// `ops::fuse_qkv_grad` on the device: the fused `[tokens, H·3·d]` gradient in `dtype` from
/// `dq` and `dkv` in the compute dtype, rounded once (bitwise the CPU's).
pub fn fuse_qkv_grad(
    dq: &CudaTensor,
    dkv: &CudaTensor,
    head_dim: usize,
    dtype: DType,
) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::fuse_qkv_grad";
    let d = head_dim;
    let (rows, heads) = check_fuse_qkv_grad(OP, dq, dkv, d, dtype)?;
    if !dtype.is_float() {
        return Err(not_float(OP, dtype));
    }
    same_device(OP, &[dq, dkv])?;
    let dev = dq.device();
    let mut out = CudaTensor::uninit(dev, &[rows, heads * 3 * d], dtype)?;
    let n = rows * heads * 3 * d;
    if n == 0 {
        return Ok(out);
    }
    let f = func(dev, &source::ATTENTION_BLOCK, "fuse_qkv_grad", dtype)?;
    launch_kernel!(OP, dev, f, grid_for(n);
        src dq, src dkv, dst &mut out, u64 rows, u64 heads, u64 d)?;
    Ok(out)
}

/// `ops::gather_rows` on the device: row `i` of the result is row `src[i]` of `t` (any
/// dtype, bitwise). The indices are checked on the host.
pub fn gather_rows(t: &CudaTensor, src: &[usize]) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::gather_rows";
    let (rows, cols) = match t.shape() {
        &[r, c] => (r, c),
        s => {
            return Err(Error::Invalid {
                op: OP,
                detail: format!("a 2-D tensor, got shape {s:?}"),
            })
        }
    };
    if let Some(&bad) = src.iter().find(|&&i| i >= rows) {
        return Err(Error::Invalid {
            op: OP,
            detail: format!("row {bad} of a tensor of {rows} rows"),
        });
    }
    let dev = t.device();
    let mut out = CudaTensor::uninit(dev, &[src.len(), cols], t.dtype())?;
    let n = src.len();
    if n * cols == 0 {
        return Ok(out);
    }
    // Each index is below `rows`, a dim of a tensor that exists: it fits i64.
    let idx: Vec<i64> = src.iter().map(|&i| i as i64).collect();
    let idx = Tensor::from_vec(idx, &[n])?.upload(dev)?;
    let f = func(dev, &source::ATTENTION_BLOCK, "gather_rows", t.dtype())?;
    launch_kernel!(OP, dev, f, grid_for(n * cols);
        src t, src &idx, dst &mut out, u64 n, u64 cols)?;
    Ok(out)
}

// ---- mixture of experts -------------------------------------------------------------

/// `ops::scatter_add_rows` on the device: `out[rows[i]] += src[i]`, `out` `[n, h]` (rows no
/// source names stay zero). Deterministic and bitwise the CPU's result: each output element
/// sums its sources in source order in f64, then rounds once (see `moe.cu`).
pub fn scatter_add_rows(src: &CudaTensor, rows: &[usize], n: usize) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::scatter_add_rows";
    let (m, h) = check_scatter_add(OP, src, rows, n)?;
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

/// What [`grouped_matmul_t_backward`] returns (as `ops::GroupedMatmulGrads` on the host).
#[derive(Debug)]
pub struct CudaGroupedMatmulGrads {
    /// `[rows, in]`: `dy[group e] · W[e]`.
    pub dx: CudaTensor,
    /// `[experts, out, in]`: `dy[group e]ᵀ · x[group e]` (zeros for an empty group).
    pub dw: CudaTensor,
}

/// `Err` ([`Error::NotOnCuda`]) unless every size fits cuBLAS's `i32`.
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
/// f32 rounded once, as [`matmul`](super::ops::matmul).
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
    // alpha/beta and `$compute` the compute type.
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

/// `ops::grouped_matmul_t` on the device: `y[rows of group e] = x[rows of group e] · W[e]ᵀ`,
/// `x` `[rows, in]`, `w` `[experts, out, in]`, `groups[e]` rows per expert (Σ = rows).
pub fn grouped_matmul_t(x: &CudaTensor, w: &CudaTensor, groups: &[usize]) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::grouped_matmul_t";
    let (_, out, k) = check_grouped(OP, x, w, groups)?;
    same_device(OP, &[x, w])?;
    let rows = x.shape()[0];
    let dev = x.device();
    if rows > 0 {
        // The CPU's per-group matmul refuses integers (with no group, nothing is multiplied).
        want_float(OP, x)?;
    }
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

/// `ops::grouped_matmul_t_backward` on the device, from the output gradient `dy`
/// (`[rows, out]`): `dx = dy[group e] · W[e]` and `dw[e] = dy[group e]ᵀ · x[group e]` (zeros
/// for an empty group).
pub fn grouped_matmul_t_backward(
    dy: &CudaTensor,
    x: &CudaTensor,
    w: &CudaTensor,
    groups: &[usize],
) -> Result<CudaGroupedMatmulGrads> {
    const OP: &str = "cuda::ops::grouped_matmul_t_backward";
    let (e, out, k) = check_grouped(OP, x, w, groups)?;
    same_dtype(OP, dy, x)?;
    let rows = x.shape()[0];
    if dy.shape() != [rows, out] {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: dy.shape().into(),
            rhs: [rows, out].as_slice().into(),
        });
    }
    same_device(OP, &[dy, x, w])?;
    if rows > 0 {
        want_float(OP, x)?;
    }
    let dev = x.device();
    let mut dw = CudaTensor::zeros(dev, &[e, out, k], x.dtype())?;
    if rows * out * k == 0 {
        // Every product is empty or an empty sum: zeros.
        let dx = CudaTensor::zeros(dev, &[rows, k], x.dtype())?;
        return Ok(CudaGroupedMatmulGrads { dx, dw });
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
    Ok(CudaGroupedMatmulGrads { dx, dw })
}

// ---- the collectives' reductions ----------------------------------------------------

/// The `int op` of `reduce_combine`: Avg sums (its division comes once, at the end).
fn op_code(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
    }
}

/// `acc[i] = acc[i] ⊕ src[i]` on the device (`reduce::combine`; Avg accumulates as Sum, the
/// caller divides once at the end), any dtype, bitwise the CPU's: Max/Min ignore a NaN `src`
/// and keep a NaN `acc`, as `Element::max_of` / `min_of` do.
pub fn combine(acc: &mut CudaTensor, src: &CudaTensor, op: ReduceOp) -> Result<()> {
    combine_as("cuda::reduce::combine", acc, src, op)
}

fn combine_as(
    name: &'static str,
    acc: &mut CudaTensor,
    src: &CudaTensor,
    op: ReduceOp,
) -> Result<()> {
    same_layout(name, acc, src)?;
    let n = acc.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = acc.device().clone();
    let f = func(&dev, &source::REDUCE_EXT, "reduce_combine", acc.dtype())?;
    launch_kernel!(name, dev, f, grid_for(n); dst acc, src src, u64 n, int op_code(op))
}

/// `dst = srcs[0] ⊕ srcs[1] ⊕ … ⊕ srcs[n-1]` combined left to right, then divided by `n` for
/// Avg (`reduce::reduce_into`), on the device, bitwise the CPU's. Every source must have
/// `dst`'s device, dtype and shape (an `Err` otherwise, where the CPU function panics); with
/// no source `dst` is left as it is.
pub fn reduce_into(dst: &mut CudaTensor, srcs: &[&CudaTensor], op: ReduceOp) -> Result<()> {
    const OP: &str = "cuda::reduce::reduce_into";
    for s in srcs {
        same_layout(OP, dst, s)?;
    }
    let Some(first) = srcs.first() else {
        return Ok(());
    };
    let n = dst.numel();
    if n == 0 {
        return Ok(());
    }
    copy_blocks(OP, first, dst, 1, n, n, 0, n, 0)?;
    for s in &srcs[1..] {
        combine_as(OP, dst, s, op)?;
    }
    if op == ReduceOp::Avg {
        let dev = dst.device().clone();
        let f = func(&dev, &source::REDUCE_EXT, "reduce_avg_div", dst.dtype())?;
        launch_kernel!(OP, dev, f, grid_for(n); dst dst, u64 n, u64 srcs.len())?;
    }
    Ok(())
}
