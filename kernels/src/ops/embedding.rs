//! Embedding lookup (a row gather) and its backward (a row scatter-add), plain and
//! vocab-parallel.
//!
//! | op | forward | backward |
//! |---|---|---|
//! | [`embedding`] | `out[.., :] = table[id, :]`: `[vocab, h]` × ids `[..]` → `[.., h]` | `dtable[id] += dy[pos]` for every position holding `id`; other rows 0 |
//! | [`embedding_masked`] | the table holds rows `start..start+len` of a `vocab`-row table ([`VocabShard`]); ids outside give zero rows | the same, ids outside skipped |
//!
//! Ids are an `i64` or `i32` tensor of any shape (a scalar gives `[h]`). An id outside
//! `0..vocab` is an `Err` naming the id, its position and the vocab, also in the masked
//! variant (an id no rank owns is a bug, not a mask). The vocab-parallel embedding sums the
//! masked outputs of all ranks (a `Partial` → all-reduce); the backward needs no
//! communication.
//!
//! On a device (feature `cuda`) the table, `dy` and `dtable` are device tensors; the ids may
//! stay in host memory (the device op checks them there and uploads them) or be on the same
//! device (they are copied to the host for the check).
//!
//! The backward is deterministic and rounds once per row: positions are grouped by id (a
//! stable sort, so each group keeps position order), each group is summed in the compute type,
//! and the sum is written (or added, [`Accum::Add`]) once.

use super::{check_dst, want_float, Accum};
use crate::spec::embedding::{dy_hidden, read_ids, table_dims, VocabShard};
use crate::{Result, Tensor};

fn gather(op: &'static str, table: &Tensor, ids: &Tensor, shard: VocabShard) -> Result<Tensor> {
    shard.check(op)?;
    let hidden = table_dims(op, table, shard.len)?;
    let device_ids = device_ids(op, table, ids)?;
    let ids_v = read_ids(op, device_ids.as_ref().unwrap_or(ids), shard.vocab)?;
    want_float(op, table)?;
    #[cfg(feature = "cuda")]
    if let Some(ids) = device_ids {
        return device::gather(op, &table.cuda_tensor()?, &ids, shard, hidden).map(Tensor::from);
    }
    crate::cpu::embedding::gather(op, table, ids, &ids_v, shard, hidden)
}

fn scatter(
    op: &'static str,
    dtable: &mut Tensor,
    dy: &Tensor,
    ids: &Tensor,
    shard: VocabShard,
    accum: Accum,
) -> Result<()> {
    shard.check(op)?;
    let hidden = dy_hidden(op, dy, ids)?;
    check_dst(op, dtable, &[shard.len, hidden], dy.dtype())?;
    crate::dispatch::on_cuda(op, &[&*dtable, dy])?;
    let device_ids = device_ids(op, dy, ids)?;
    let ids_v = read_ids(op, device_ids.as_ref().unwrap_or(ids), shard.vocab)?;
    want_float(op, dy)?;
    if device_ids.is_some() {
        return scatter_cuda(op, dtable, dy, &ids_v, shard, accum, hidden);
    }
    crate::cpu::embedding::scatter(op, dtable, dy, &ids_v, shard, accum, hidden)
}

/// The ids in host memory when `t` (the table, or `dy`) is on a device, as the device
/// launch takes them (see `dispatch::host_ids`); `None` when everything is in host memory.
#[cfg(feature = "cuda")]
fn device_ids(op: &'static str, t: &Tensor, ids: &Tensor) -> Result<Option<Tensor>> {
    crate::dispatch::host_ids(op, t, ids)
}

#[cfg(not(feature = "cuda"))]
fn device_ids(_: &'static str, _: &Tensor, _: &Tensor) -> Result<Option<Tensor>> {
    Ok(None)
}

#[cfg(feature = "cuda")]
fn scatter_cuda(
    op: &'static str,
    dtable: &mut Tensor,
    dy: &Tensor,
    ids: &[usize],
    shard: VocabShard,
    accum: Accum,
    hidden: usize,
) -> Result<()> {
    let dy = dy.cuda_tensor()?;
    crate::dispatch::with_cuda_mut(dtable, |d| {
        device::scatter(op, d, &dy, ids, shard, accum, hidden)
    })
}

#[cfg(not(feature = "cuda"))]
fn scatter_cuda(
    _: &'static str,
    _: &mut Tensor,
    _: &Tensor,
    _: &[usize],
    _: VocabShard,
    _: Accum,
    _: usize,
) -> Result<()> {
    unreachable!("no device tensor exists without the `cuda` feature")
}

/// Rows of `table` (`[vocab, hidden]`) at `ids` (any shape): `[..ids, hidden]`.
pub fn embedding(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let vocab = table.shape().first().copied().unwrap_or(0);
    gather("ops::embedding", table, ids, VocabShard::full(vocab))
}

/// The vocab-parallel lookup: `table` holds rows `shard.start..shard.start + shard.len`
/// (`[shard.len, hidden]`); ids in that range give their row, other valid ids give zeros.
pub fn embedding_masked(table: &Tensor, ids: &Tensor, shard: VocabShard) -> Result<Tensor> {
    gather("ops::embedding_masked", table, ids, shard)
}

/// The table gradient of [`embedding`]: `[vocab, hidden]`, zero except at looked-up rows.
pub fn embedding_backward(dy: &Tensor, ids: &Tensor, vocab: usize) -> Result<Tensor> {
    embedding_masked_backward_op("ops::embedding_backward", dy, ids, VocabShard::full(vocab))
}

/// [`embedding_backward`] into `dtable` (`[vocab, hidden]`, vocab from its shape), replacing
/// it or adding to it (gradient accumulation across micro-batches).
pub fn embedding_backward_into(
    dtable: &mut Tensor,
    dy: &Tensor,
    ids: &Tensor,
    accum: Accum,
) -> Result<()> {
    let vocab = dtable.shape().first().copied().unwrap_or(0);
    scatter(
        "ops::embedding_backward",
        dtable,
        dy,
        ids,
        VocabShard::full(vocab),
        accum,
    )
}

/// The local table gradient of [`embedding_masked`]: `[shard.len, hidden]`; ids outside the
/// shard contribute nothing.
pub fn embedding_masked_backward(dy: &Tensor, ids: &Tensor, shard: VocabShard) -> Result<Tensor> {
    embedding_masked_backward_op("ops::embedding_masked_backward", dy, ids, shard)
}

/// [`embedding_masked_backward`] into `dtable` (`[shard.len, hidden]`), replacing or adding.
pub fn embedding_masked_backward_into(
    dtable: &mut Tensor,
    dy: &Tensor,
    ids: &Tensor,
    shard: VocabShard,
    accum: Accum,
) -> Result<()> {
    scatter(
        "ops::embedding_masked_backward",
        dtable,
        dy,
        ids,
        shard,
        accum,
    )
}

fn embedding_masked_backward_op(
    op: &'static str,
    dy: &Tensor,
    ids: &Tensor,
    shard: VocabShard,
) -> Result<Tensor> {
    let hidden = dy_hidden(op, dy, ids)?;
    shard.check(op)?;
    let mut dtable = match dy.device() {
        None => Tensor::zeros_checked(op, &[shard.len, hidden], dy.dtype())?,
        Some(dev) => Tensor::zeros_on(Some(dev), &[shard.len, hidden], dy.dtype())?,
    };
    scatter(op, &mut dtable, dy, ids, shard, Accum::Replace)?;
    Ok(dtable)
}

/// The device launches (`cuda/kernels/embedding.cu`), on operands the front door has
/// checked. The ids stay on the host, where they are checked against the vocab (as the host
/// kernels check them) and turned into what the kernels read.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{func, grid_for, launch_kernel, per_row};
    use crate::cuda::{source, CudaTensor};
    use crate::ops::accum_flag;
    use crate::spec::embedding::{out_shape, VocabShard};
    use crate::spec::Accum;
    use crate::{DType, Result, Tensor};

    /// Rows of `table` (`[shard.len, hidden]`) for the ids in the shard, zeros for the
    /// others; the ids (i64 or i32, in host memory, checked against the vocab by the front
    /// door) are copied to the device as they are.
    pub(super) fn gather(
        op: &'static str,
        table: &CudaTensor,
        ids: &Tensor,
        shard: VocabShard,
        hidden: usize,
    ) -> Result<CudaTensor> {
        let dev = table.device();
        let mut out = CudaTensor::uninit(dev, &out_shape(ids, hidden), table.dtype())?;
        let tokens = ids.numel();
        if tokens * hidden == 0 {
            return Ok(out);
        }
        let ids_dev = CudaTensor::from_host(dev, ids)?;
        let root = if ids.dtype() == DType::I64 {
            "embedding_i64"
        } else {
            "embedding_i32"
        };
        let f = func(dev, &source::EMBEDDING, root, table.dtype())?;
        launch_kernel!(op, dev, f, grid_for(tokens * hidden);
            src table, src &ids_dev, dst &mut out, u64 tokens, u64 hidden, u64 shard.start,
            u64 shard.len)?;
        Ok(out)
    }

    /// `dtable[r] (=|+=) Σ dy[p]` over the positions `p` whose id is row `r` of the shard,
    /// summed in position order (deterministic, the host's order; no atomics): one block per
    /// table row, reading its positions from a CSR built here.
    pub(super) fn scatter(
        op: &'static str,
        dtable: &mut CudaTensor,
        dy: &CudaTensor,
        ids_v: &[usize],
        shard: VocabShard,
        accum: Accum,
        hidden: usize,
    ) -> Result<()> {
        if shard.len * hidden == 0 {
            return Ok(());
        }
        // CSR of the hits: positions grouped by local row, in position order within a row.
        let mut starts = vec![0i64; shard.len + 1];
        for &id in ids_v {
            if let Some(r) = shard.local(id) {
                starts[r + 1] += 1;
            }
        }
        for r in 0..shard.len {
            starts[r + 1] += starts[r];
        }
        let mut fill: Vec<i64> = starts[..shard.len].to_vec();
        let mut positions = vec![0i64; (starts[shard.len] as usize).max(1)];
        for (pos, &id) in ids_v.iter().enumerate() {
            if let Some(r) = shard.local(id) {
                positions[fill[r] as usize] = pos as i64;
                fill[r] += 1;
            }
        }
        let dev = dy.device().clone();
        let starts_dev = Tensor::from_vec(starts, &[shard.len + 1])?.upload(&dev)?;
        let n_pos = positions.len();
        let pos_dev = Tensor::from_vec(positions, &[n_pos])?.upload(&dev)?;
        let f = func(&dev, &source::EMBEDDING, "embedding_backward", dy.dtype())?;
        launch_kernel!(op, dev, f, per_row(op, shard.len, 0)?;
            dst dtable, src dy, src &starts_dev, src &pos_dev, u64 hidden, int accum_flag(accum))
    }
}
