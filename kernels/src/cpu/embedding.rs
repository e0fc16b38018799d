//! Host kernels of [`crate::ops::embedding`](mod@crate::ops::embedding), on host tensors. Each says
//! what it relies on and which check of the front door ensures it.

use super::{store, Accum, Float};
use crate::spec::embedding::*;
use crate::{Result, Tensor};

/// The host half of `ops::embedding` / `embedding_masked`: relies on `shard` being valid
/// (`VocabShard::check`) and `table` being `[shard.len, hidden]`
/// (`spec::embedding::table_dims`), `ids_v` being `ids` read and each below `shard.vocab`
/// (`spec::embedding::read_ids`), as the front door's `gather` ensures.
pub(crate) fn gather(
    op: &'static str,
    table: &Tensor,
    ids: &Tensor,
    ids_v: &[usize],
    shard: VocabShard,
    hidden: usize,
) -> Result<Tensor> {
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

/// The host half of the `ops::embedding_*backward*` ops: relies on `shard` being valid
/// (`VocabShard::check`), `dy` being `ids.shape ++ [hidden]`
/// (`spec::embedding::dy_hidden`), `dtable` `[shard.len, hidden]` of `dy`'s dtype (`spec::check_dst`) and `ids_v` being
/// the ids read, each below `shard.vocab` (`spec::embedding::read_ids`), as the front door's
/// `scatter` ensures.
pub(crate) fn scatter(
    op: &'static str,
    dtable: &mut Tensor,
    dy: &Tensor,
    ids_v: &[usize],
    shard: VocabShard,
    accum: Accum,
    hidden: usize,
) -> Result<()> {
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
