//! Blockwise causal attention: the pieces context parallelism (ring attention) is built
//! from. One call attends a block of queries to a block of keys and values that may come
//! from another rank, with each side's true positions in the sample; partial results
//! merge by their log-sum-exp (the online softmax one level up); the backward gives one
//! (query block, key block) pair's share of the gradient from the *final* output and lse.
//!
//! Layouts (`K` KV heads of dim `d`, each shared by `g` query heads, `H = K·g`; a block's
//! rows are samples one after another, each of `q_pos.len()` (queries) or `k_pos.len()`
//! (keys) rows, the same positions for every sample):
//!
//! | tensor | shape | dtype |
//! |---|---|---|
//! | `qkv` (queries are read from it) | `[samples·nq, K·(g+2)·d]`, the grouped fused layout of [`causal_attention`](super::causal_attention) (q and k already rotated) | `T` |
//! | `kv` ([`pack_kv`]) | `[samples·nk, K·2·d]`, KV head `j`: k at `j·2d ..`, v at `j·2d + d ..` | `T` |
//! | partial `out`, `lse` ([`attention_block`]) | `[samples·nq, H·d]`, `[samples·nq, H]` | compute ([`acc_dtype`](super::acc_dtype)) |
//! | `dq`, `dkv` accumulators ([`attention_block_backward`]) | as `out`, as `kv` (a KV head's `dk`, `dv` summed over its query heads) | compute |
//!
//! Position embeddings are the caller's (RoPE each row at its true position before packing:
//! [`rope`](fn@super::rope)); the positions here are the mask's, which keeps key `j` for
//! query `i` when `k_pos[j] ≤ q_pos[i]`, and with an [`AttentionMask`](super::AttentionMask)
//! ([`BlockAttention::mask`]) also when `k_pos[j]` lies in the query's document and window:
//! the document ids are those of the block's whole samples, looked up at the positions,
//! so a query's document may start in a chunk another rank holds. A block no query sees
//! ([`BlockAttention::fully_masked`]) is not computed. A query that sees no key of a block gets `out = 0` and
//! `lse = −∞` there, which [`merge_attention`] treats as "no contribution". Positions must
//! be strictly increasing within a sample (checked): then the keys a query sees in a key
//! tile are a contiguous run of it, as in the full kernel, and tiles no query of a query
//! tile sees are skipped ([`key_tile_masked`](super::key_tile_masked)). The per-sample work is the full kernel's own code
//! ([`causal_attention`](super::causal_attention) is this with `q_pos = k_pos = 0..s`).
//!
//! Single-threaded; `f32`/`bf16`/`f16` compute in `f32`, `f64` in `f64`.

use crate::spec::attention::CausalAttentionOutput;
use crate::spec::attention_block::{
    check_block, check_block_backward, check_fuse_qkv_grad, check_gather_rows, check_merge,
    check_pack_kv, BlockAttention, OP, OP_BACK, OP_FUSE, OP_MERGE, OP_PACK, OP_ROWS,
};
use crate::spec::want_float;
use crate::{DType, Result, Tensor};

/// The k and v columns of a grouped fused `[tokens, K·(g+2)·d]` QKV (`g = q_per_kv`),
/// packed as `[tokens, K·2·d]`: what travels around a ring, the KV heads only (`2/(g+2)` of
/// the fused tensor).
pub fn pack_kv(qkv: &Tensor, head_dim: usize, q_per_kv: usize) -> Result<Tensor> {
    let sizes = check_pack_kv(OP_PACK, qkv, head_dim, q_per_kv)?;
    want_float(OP_PACK, qkv)?;
    dispatch!(OP_PACK, [qkv] => device::pack_kv(&qkv, head_dim, q_per_kv, sizes));
    crate::cpu::attention_block::pack_kv(qkv, head_dim, q_per_kv, sizes)
}

/// Attention of `qkv`'s queries (at `cfg.q_pos`) to `kv`'s keys and values (at
/// `cfg.k_pos`), sample by sample: the normalized partial output and its lse, in the
/// compute dtype (merge several with [`merge_attention`], round once at the end).
pub fn attention_block(
    qkv: &Tensor,
    kv: &Tensor,
    cfg: &BlockAttention,
) -> Result<CausalAttentionOutput> {
    let g = check_block(OP, qkv, kv, cfg)?;
    let first = cfg.first_keys(OP, g.batch)?;
    dispatch!(OP, [qkv, kv] => device::attention_block(&qkv, &kv, cfg, &g, &first));
    crate::cpu::attention_block::attention_block(qkv, kv, cfg, g, &first)
}

/// Merges a partial attention result into a running one, row and head at a time:
/// `lse = log(e^lse_a + e^lse_b)`, `out = e^(lse_a − lse)·out_a + e^(lse_b − lse)·out_b`
/// (a side with `lse = −∞` contributes nothing). Both in the compute dtype, shaped alike.
pub fn merge_attention(
    acc: &mut CausalAttentionOutput,
    part: &CausalAttentionOutput,
) -> Result<()> {
    let (rows, heads, ocols) = check_merge(OP_MERGE, (&acc.out, &acc.lse), (&part.out, &part.lse))?;
    if crate::dispatch::on_cuda(OP_MERGE, &[&acc.out, &acc.lse, &part.out, &part.lse])? {
        return merge_attention_cuda(acc, part, rows * heads, ocols / heads.max(1));
    }
    crate::cpu::attention_block::merge_attention(acc, part, heads, ocols)
}

/// One (query block, key block) pair's share of the gradient: from the output gradient
/// `dout` and the *final* `out` and `lse` of the queries (every key block merged; `dout`,
/// `out` in `qkv`'s dtype, `lse` in the compute dtype), adds `∂/∂q` into `dq` (`[rows_q,
/// H·d]`) and `∂/∂k`, `∂/∂v` into `dkv` (`[rows_k, H·2·d]`, packed as `kv`), both in the
/// compute dtype. Summed over the key blocks,
/// `dq` and every block's `dkv` are the full attention's gradient.
#[allow(clippy::too_many_arguments)]
pub fn attention_block_backward(
    dout: &Tensor,
    qkv: &Tensor,
    kv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    cfg: &BlockAttention,
    dq: &mut Tensor,
    dkv: &mut Tensor,
) -> Result<()> {
    let g = check_block_backward(OP_BACK, dout, qkv, kv, out, lse, cfg, dq, dkv)?;
    let first = cfg.first_keys(OP_BACK, g.batch)?;
    if crate::dispatch::on_cuda(OP_BACK, &[dout, qkv, kv, out, lse, &*dq, &*dkv])? {
        return attention_block_backward_cuda([dout, qkv, kv, out, lse], cfg, dq, dkv, &g, &first);
    }
    crate::cpu::attention_block::attention_block_backward(
        dout, qkv, kv, out, lse, cfg, dq, dkv, g, &first,
    )
}

/// The grouped fused `[tokens, K·(g+2)·d]` gradient of a QKV from its parts: `dq`
/// (`[tokens, K·g·d]`) and `dkv` (`[tokens, K·2·d]`, packed as [`pack_kv`]), both in the
/// compute dtype, rounded once into `dtype`.
pub fn fuse_qkv_grad(
    dq: &Tensor,
    dkv: &Tensor,
    head_dim: usize,
    q_per_kv: usize,
    dtype: DType,
) -> Result<Tensor> {
    let sizes = check_fuse_qkv_grad(OP_FUSE, dq, dkv, head_dim, q_per_kv, dtype)?;
    dispatch!(OP_FUSE, [dq, dkv] =>
        device::fuse_qkv_grad(&dq, &dkv, head_dim, q_per_kv, dtype, sizes));
    crate::cpu::attention_block::fuse_qkv_grad(dq, dkv, head_dim, q_per_kv, dtype, sizes)
}

/// Rows of a 2-D tensor picked by index: row `i` of the result is row `src[i]` of `t`
/// (any dtype, bit for bit). Context parallelism's token reorderings go through it.
pub fn gather_rows(t: &Tensor, src: &[usize]) -> Result<Tensor> {
    let cols = check_gather_rows(OP_ROWS, t, src)?;
    dispatch!(OP_ROWS, [t] => device::gather_rows(&t, src, cols));
    crate::cpu::attention_block::gather_rows(t, src, cols)
}

/// [`merge_attention`] on the device (every tensor there, as the caller checked): `acc`'s
/// tensors are moved out for the kernel and back, whatever it returns.
#[cfg(feature = "cuda")]
fn merge_attention_cuda(
    acc: &mut CausalAttentionOutput,
    part: &CausalAttentionOutput,
    n: usize,
    d: usize,
) -> Result<()> {
    let (part_out, part_lse) = (part.out.cuda_tensor()?, part.lse.cuda_tensor()?);
    let mut out = crate::dispatch::take_cuda(&mut acc.out);
    let mut lse = crate::dispatch::take_cuda(&mut acc.lse);
    let r = device::merge_attention(&mut out, &mut lse, &part_out, &part_lse, n, d);
    acc.out = out.into();
    acc.lse = lse.into();
    r
}

#[cfg(not(feature = "cuda"))]
fn merge_attention_cuda(
    _: &mut CausalAttentionOutput,
    _: &CausalAttentionOutput,
    _: usize,
    _: usize,
) -> Result<()> {
    unreachable!("no device tensor exists without the `cuda` feature")
}

/// [`attention_block_backward`] on the device (every tensor there, as the caller checked):
/// `[dout, qkv, kv, out, lse]`, both out-parameters moved out for the kernel.
#[cfg(feature = "cuda")]
fn attention_block_backward_cuda(
    ins: [&Tensor; 5],
    cfg: &BlockAttention,
    dq: &mut Tensor,
    dkv: &mut Tensor,
    g: &crate::spec::attention_block::Dims,
    first: &[usize],
) -> Result<()> {
    let [dout, qkv, kv, out, lse] = ins.map(Tensor::cuda_tensor);
    let (dout, qkv, kv, out, lse) = (dout?, qkv?, kv?, out?, lse?);
    crate::dispatch::with_cuda_mut(dq, |dq| {
        crate::dispatch::with_cuda_mut(dkv, |dkv| {
            device::attention_block_backward(&dout, &qkv, &kv, &out, &lse, cfg, dq, dkv, g, first)
        })
    })
}

#[cfg(not(feature = "cuda"))]
fn attention_block_backward_cuda(
    _: [&Tensor; 5],
    _: &BlockAttention,
    _: &mut Tensor,
    _: &mut Tensor,
    _: &crate::spec::attention_block::Dims,
    _: &[usize],
) -> Result<()> {
    unreachable!("no device tensor exists without the `cuda` feature")
}

/// The device launches (`cuda/kernels/attention_block.cu`), on operands the front door
/// checked (its `spec` sizes passed in); position and row lists are uploaded as `i64`, and
/// every launch size comes from the checked shapes.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{
        copy_blocks, func, grid_for, launch_kernel, per_row, Acc, SHARED_BUDGET,
    };
    use crate::cuda::{source, CudaTensor, Device};
    use crate::spec::acc_dtype;
    use crate::spec::attention::CausalAttentionOutput;
    use crate::spec::attention_block::{BlockAttention, Dims};
    use crate::spec::not_float;
    use crate::{DType, Error, Result, Tensor};

    fn output(out: CudaTensor, lse: CudaTensor) -> CausalAttentionOutput {
        CausalAttentionOutput {
            out: out.into(),
            lse: lse.into(),
        }
    }

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

    /// One block call's loaded operands: q `[H, B, nq, d]` (times the score scale), k and v
    /// `[K, B, nk, d]` in the compute type, the positions, and each query row's first
    /// visible key position (`[B, nq]`).
    struct BlockOperands {
        q: CudaTensor,
        k: CudaTensor,
        v: CudaTensor,
        qpos: CudaTensor,
        kpos: CudaTensor,
        qfirst: CudaTensor,
    }

    fn block_load(
        op: &'static str,
        qkv: &CudaTensor,
        kv: &CudaTensor,
        g: &Dims,
        cfg: &BlockAttention,
        first: &[usize],
    ) -> Result<BlockOperands> {
        let (dev, dt) = (qkv.device(), qkv.dtype());
        let ad = acc_dtype(dt);
        let mut q = CudaTensor::uninit(dev, &[g.heads, g.batch, g.nq, g.d], ad)?;
        let mut k = CudaTensor::uninit(dev, &[g.kv_heads, g.batch, g.nk, g.d], ad)?;
        let mut v = CudaTensor::uninit(dev, &[g.kv_heads, g.batch, g.nk, g.d], ad)?;
        let scale = Acc::lit(dt, g.scale);
        let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_load_q", dt)?;
        launch_kernel!(op, dev, f, grid_for(g.heads * g.batch * g.nq * g.d);
            src qkv, dst &mut q, u64 g.batch, u64 g.kv_heads, u64 g.g, u64 g.nq, u64 g.d,
            acc scale)?;
        let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_load_kv", dt)?;
        launch_kernel!(op, dev, f, grid_for(g.kv_heads * g.batch * g.nk * g.d);
            src kv, dst &mut k, dst &mut v, u64 g.batch, u64 g.kv_heads, u64 g.nk, u64 g.d)?;
        Ok(BlockOperands {
            q,
            k,
            v,
            qpos: positions(op, cfg.q_pos, dev)?,
            kpos: positions(op, cfg.k_pos, dev)?,
            qfirst: positions(op, first, dev)?,
        })
    }

    /// The normalized partial output `[rows, H·d]` and its
    /// lse `[rows, H]`, both in the compute dtype (a query that sees no key of the block gets
    /// `out = 0`, `lse = −∞`). The key block's length is bounded by shared memory (an
    /// [`Error::NotOnCuda`] above it).
    pub(super) fn attention_block(
        qkv: &CudaTensor,
        kv: &CudaTensor,
        cfg: &BlockAttention,
        g: &Dims,
        first: &[usize],
    ) -> Result<CausalAttentionOutput> {
        const OP: &str = "ops::attention_block";
        let (dev, dt) = (qkv.device(), qkv.dtype());
        let ad = acc_dtype(dt);
        let rows = g.batch * g.nq;
        let mut out = CudaTensor::uninit(dev, &[rows, g.heads * g.d], ad)?;
        let mut lse = CudaTensor::uninit(dev, &[rows, g.heads], ad)?;
        if rows * g.heads == 0 {
            return Ok(output(out, lse));
        }
        if cfg.fully_masked(g.batch) {
            let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_masked", dt)?;
            launch_kernel!(OP, dev, f, grid_for(rows * g.heads * g.d);
                dst &mut out, dst &mut lse, u64 rows, u64 g.heads, u64 g.d)?;
            return Ok(output(out, lse));
        }
        let smem = shared_bound(OP, g.nk, &format!("{} keys per sample", g.nk), dt)?;
        let x = block_load(OP, qkv, kv, g, cfg, first)?;
        let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_forward", dt)?;
        launch_kernel!(OP, dev, f, per_row(OP, g.heads * rows, smem)?;
            src &x.q, src &x.k, src &x.v, src &x.qpos, src &x.kpos, src &x.qfirst, dst &mut out,
            dst &mut lse, u64 g.batch, u64 g.heads, u64 g.g, u64 g.nq, u64 g.nk, u64 g.d)?;
        Ok(output(out, lse))
    }

    /// Adds this (query block, key block) pair's
    /// share of the gradient into `dq` (`[rows_q, H·d]`) and `dkv` (`[rows_k, H·2·d]`), both in
    /// the compute dtype, from `dout` and the *final* `out` (qkv's dtype) and `lse` (compute
    /// dtype). Bounded by shared memory like [`attention_block`] (keys, and twice the queries).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_block_backward(
        dout: &CudaTensor,
        qkv: &CudaTensor,
        kv: &CudaTensor,
        out: &CudaTensor,
        lse: &CudaTensor,
        cfg: &BlockAttention,
        dq: &mut CudaTensor,
        dkv: &mut CudaTensor,
        g: &Dims,
        first: &[usize],
    ) -> Result<()> {
        const OP: &str = "ops::attention_block_backward";
        let rq = g.batch * g.nq;
        let (dt, ad) = (qkv.dtype(), acc_dtype(qkv.dtype()));
        if cfg.fully_masked(g.batch) || rq * g.heads == 0 {
            return Ok(());
        }
        let what = format!("{} keys and 2 × {} queries per sample", g.nk, g.nq);
        let smem = shared_bound(OP, g.nk.max(2 * g.nq), &what, dt)?;
        let dev = qkv.device();
        let x = block_load(OP, qkv, kv, g, cfg, first)?;
        let mut dsum = CudaTensor::uninit(dev, &[g.heads, g.batch, g.nq], ad)?;
        let scale = Acc::lit(dt, g.scale);
        let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_backward_dq", dt)?;
        launch_kernel!(OP, dev, f, per_row(OP, g.heads * rq, smem)?;
            src &x.q, src &x.k, src &x.v, src dout, src out, src lse, src &x.qpos, src &x.kpos,
            src &x.qfirst, dst &mut dsum, dst dq, u64 g.batch, u64 g.heads, u64 g.g, u64 g.nq, u64 g.nk,
            u64 g.d, acc scale)?;
        // Same stream: runs after the dq kernel has written every D_i into dsum. Each query
        // head's share of dk, dv apart (`[H, B, nk, d]`), then a group's shares added in.
        let shape = [g.heads, g.batch, g.nk, g.d];
        let mut dk = CudaTensor::uninit(dev, &shape, ad)?;
        let mut dv = CudaTensor::uninit(dev, &shape, ad)?;
        let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_backward_dkv", dt)?;
        launch_kernel!(OP, dev, f, per_row(OP, g.heads * g.batch * g.nk, smem)?;
            src &x.q, src &x.k, src &x.v, src dout, src lse, src &dsum, src &x.qpos, src &x.kpos,
            src &x.qfirst, dst &mut dk, dst &mut dv, u64 g.batch, u64 g.heads, u64 g.g, u64 g.nq, u64 g.nk,
            u64 g.d)?;
        let f = func(dev, &source::ATTENTION_BLOCK, "attn_block_kv_add", dt)?;
        launch_kernel!(OP, dev, f, grid_for(g.kv_heads * g.batch * g.nk * g.d);
            src &dk, src &dv, dst dkv, u64 g.batch, u64 g.kv_heads, u64 g.g, u64 g.nk, u64 g.d)
    }

    /// Merges `part` into `acc` by their lse, `n` (row, head) pairs of `d` columns at a time
    /// (a side with `lse = −∞` contributes nothing). Compute dtypes (f32, f64) only.
    pub(super) fn merge_attention(
        acc_out: &mut CudaTensor,
        acc_lse: &mut CudaTensor,
        part_out: &CudaTensor,
        part_lse: &CudaTensor,
        n: usize,
        d: usize,
    ) -> Result<()> {
        const OP: &str = "ops::merge_attention";
        if n == 0 {
            return Ok(());
        }
        let dev = acc_lse.device().clone();
        let f = func(
            &dev,
            &source::ATTENTION_BLOCK,
            "merge_attention",
            acc_lse.dtype(),
        )?;
        launch_kernel!(OP, dev, f, grid_for(n);
            dst acc_out, dst acc_lse, src part_out, src part_lse, u64 n, u64 d)
    }

    /// The k and v columns of a grouped fused `[tokens, K·(g+2)·d]` QKV as `[tokens, K·2·d]`
    /// (a strided copy, bitwise).
    pub(super) fn pack_kv(
        qkv: &CudaTensor,
        d: usize,
        g: usize,
        (rows, kv_heads): (usize, usize),
    ) -> Result<CudaTensor> {
        const OP: &str = "ops::pack_kv";
        let mut kv = CudaTensor::uninit(qkv.device(), &[rows, kv_heads * 2 * d], qkv.dtype())?;
        // Rows of KV groups are runs of (g+2)·d: copy the last 2·d of each.
        copy_blocks(
            OP,
            qkv,
            &mut kv,
            rows * kv_heads,
            2 * d,
            (g + 2) * d,
            g * d,
            2 * d,
            0,
        )?;
        Ok(kv)
    }

    /// The grouped fused `[tokens, K·(g+2)·d]` gradient in `dtype` from `dq` and `dkv` in
    /// the compute dtype, rounded once (bitwise the CPU's).
    pub(super) fn fuse_qkv_grad(
        dq: &CudaTensor,
        dkv: &CudaTensor,
        d: usize,
        g: usize,
        dtype: DType,
        (rows, kv_heads): (usize, usize),
    ) -> Result<CudaTensor> {
        const OP: &str = "ops::fuse_qkv_grad";
        if !dtype.is_float() {
            return Err(not_float(OP, dtype));
        }
        let dev = dq.device();
        let mut out = CudaTensor::uninit(dev, &[rows, kv_heads * (g + 2) * d], dtype)?;
        let n = rows * kv_heads * (g + 2) * d;
        if n == 0 {
            return Ok(out);
        }
        let f = func(dev, &source::ATTENTION_BLOCK, "fuse_qkv_grad", dtype)?;
        launch_kernel!(OP, dev, f, grid_for(n);
            src dq, src dkv, dst &mut out, u64 rows, u64 kv_heads, u64 g, u64 d)?;
        Ok(out)
    }

    /// Row `i` of the result is row `src[i]` of `t` (any dtype, bitwise); the indices were
    /// checked on the host.
    pub(super) fn gather_rows(t: &CudaTensor, src: &[usize], cols: usize) -> Result<CudaTensor> {
        const OP: &str = "ops::gather_rows";
        let dev = t.device();
        let mut out = CudaTensor::uninit(dev, &[src.len(), cols], t.dtype())?;
        let n = src.len();
        if n * cols == 0 {
            return Ok(out);
        }
        // Each index is below the rows of a tensor that exists: it fits i64.
        let idx: Vec<i64> = src.iter().map(|&i| i as i64).collect();
        let idx = Tensor::from_vec(idx, &[n])?.upload(dev)?;
        let f = func(dev, &source::ATTENTION_BLOCK, "gather_rows", t.dtype())?;
        launch_kernel!(OP, dev, f, grid_for(n * cols);
            src t, src &idx, dst &mut out, u64 n, u64 cols)?;
        Ok(out)
    }
}
