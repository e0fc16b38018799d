//! `embedding`: rows of a (possibly vocab-sharded) table for token ids, with its tape twin.

use super::{local_range, output, same_mesh, want_rank};
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::ops::{self, VocabShard};
use dtensor_placement::{EmbeddingLayout, EmbeddingOut, Layout};

impl<L: Layout> DTensor<L> {
    /// `self[ids]`: rows of a `[vocab, hidden]` table for `[tokens]` ids. A table sharded
    /// over its vocab gives `Partial` (each rank looks up the ids it holds, zeros for the
    /// rest: Megatron's masked lookup).
    pub fn embedding<LI: EmbeddingLayout<L>>(
        &self,
        ids: &DTensor<LI>,
    ) -> Result<DTensor<EmbeddingOut<L, LI>>> {
        Ok(self.embedding_parts(ids)?.0)
    }

    /// [`embedding`](Self::embedding) and the vocab rows this rank looked up, which its
    /// backward scatters into.
    fn embedding_parts<LI: EmbeddingLayout<L>>(
        &self,
        ids: &DTensor<LI>,
    ) -> Result<(DTensor<EmbeddingOut<L, LI>>, VocabShard)> {
        const OP: &str = "DTensor::embedding";
        let (t, i) = (self.as_any(), ids.as_any());
        same_mesh(OP, t, i)?;
        want_rank(OP, t, 2, "the table")?;
        want_rank(OP, i, 1, "the ids")?;
        let vocab = t.global_shape()[0];
        let rows = local_range(t, 0)?;
        let shard = VocabShard {
            start: rows.start,
            len: rows.len(),
            vocab,
        };
        let local = ops::embedding_masked(t.as_local(), i.as_local(), shard)?;
        let y = output(OP, local, &[i.global_shape()[0], t.global_shape()[1]], t)?;
        Ok((y, shard))
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::embedding`] (`self` is the table; the ids get no gradient).
    pub fn embedding<LI: EmbeddingLayout<L>>(
        &self,
        ids: &Var<'t, LI>,
    ) -> Result<Var<'t, EmbeddingOut<L, LI>>> {
        let (y, shard) = self.value().embedding_parts(ids.value())?;
        let (tv, iv) = (self.value().as_any().clone(), ids.value().as_any().clone());
        Ok(self.unary(y, false, move |dy| {
            let dt = ops::embedding_masked_backward(dy.as_local(), iv.as_local(), shard)?;
            grad_of("Var::embedding", dt, &tv)
        }))
    }
}
