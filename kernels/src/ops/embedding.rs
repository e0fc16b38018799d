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

use super::{check_dst, store, Accum, Float, Layout};
use crate::spec::embedding::*;
use crate::{DType, Error, Result, Shape, Tensor};

fn gather(op: &'static str, table: &Tensor, ids: &Tensor, shard: VocabShard) -> Result<Tensor> {
    shard.check(op)?;
    let hidden = table_dims(op, table, shard.len)?;
    #[cfg(feature = "cuda")]
    if let Some(ids) = crate::dispatch::host_ids(op, table, ids)? {
        return crate::cuda::ops::embedding(&table.cuda_tensor()?, &ids, shard).map(Tensor::from);
    }
    let ids_v = read_ids(op, ids, shard.vocab)?;
    let mut out = Tensor::zeros_checked(op, &out_shape(ids, hidden), table.dtype())?;
    dispatch_float!(op, table.dtype(), |T| {
        let t = table.as_slice::<T>()?;
        let o = out.as_mut_slice::<T>()?;
        for (pos, &id) in ids_v.iter().enumerate() {
            if let Some(r) = shard.local(id) {
                o[pos * hidden..(pos + 1) * hidden]
                    .copy_from_slice(&t[r * hidden..(r + 1) * hidden]);
            }
        }
        Ok(())
    })?;
    Ok(out)
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
    #[cfg(feature = "cuda")]
    if crate::dispatch::on_cuda(op, &[&*dtable, dy])?
        | crate::dispatch::host_ids(op, dy, ids)?.is_some()
    {
        let ids = crate::dispatch::host_ids(op, dy, ids)?.expect("dy is on a device");
        let dy = dy.cuda_tensor()?;
        return crate::dispatch::with_cuda_mut(dtable, |d| {
            crate::cuda::ops::embedding_backward_into(d, &dy, &ids, shard, accum)
        });
    }
    let ids_v = read_ids(op, ids, shard.vocab)?;
    let mut hits: Vec<(usize, usize)> = ids_v
        .iter()
        .enumerate()
        .filter_map(|(pos, &id)| shard.local(id).map(|r| (r, pos)))
        .collect();
    // Stable: positions stay in order within a row, so the sum order is fixed.
    hits.sort_by_key(|&(r, _)| r);
    dispatch_float!(op, dy.dtype(), |T| {
        let g = dy.as_slice::<T>()?;
        let d = dtable.as_mut_slice::<T>()?;
        if accum == Accum::Replace {
            d.fill(T::from_acc(Default::default()));
        }
        let mut acc = vec![<T as Float>::Acc::default(); hidden];
        for group in hits.chunk_by(|a, b| a.0 == b.0) {
            acc.fill(Default::default());
            for &(_, pos) in group {
                for (a, &v) in acc.iter_mut().zip(&g[pos * hidden..(pos + 1) * hidden]) {
                    *a += v.to_acc();
                }
            }
            let r = group[0].0;
            for (d, &a) in d[r * hidden..(r + 1) * hidden].iter_mut().zip(&acc) {
                store(d, a, accum);
            }
        }
        Ok(())
    })
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
