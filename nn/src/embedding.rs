//! Vocab-parallel embedding and the vocab-parallel cross-entropy.
//!
//! The table `[vocab, hidden]` is `Shard<0>` over `Tp`: each rank looks up the ids it
//! holds and writes zeros for the others, so the lookup is `Partial` over `Tp` and leaves
//! through [`SeqMode::exit`] (`all_reduce`, or `reduce_scatter` of the tokens under SP).
//!
//! The loss reads logits `[tokens, vocab]` sharded over `Tp` along the vocab (a column
//! layer's output) and never gathers them: the row max is a `Partial<Max>` all-reduced over
//! `Tp`, the sum of exponentials and the target's logit are `Partial<Sum>`s all-reduced over
//! `Tp` (three all-reduces of one value per token). Its backward, `softmax − one-hot` on the
//! local vocab shard, needs no communication.

use crate::init::Init;
use crate::linear::ParamInit;
use crate::optim::{dp_average, GradNorm, Optimizer, Param};
use crate::seq::{
    axis_coord, axis_size, ColOut, ColWeight, ColWeightReduced, Full, Grad, Ids, RowPartial,
    SeqMode, Stream, TokenInvariant,
};
use dtensor_core::{Adjoint, DTensor, DeviceMesh, Error, Result};
use dtensor_kernels::ops::{self, VocabShard};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{chunk_range, layout, AxisKind, Dp, Invariant, Max, Partial, Shard, Tp};
use std::sync::Arc;

/// This rank's rows of a `vocab`-row table sharded over `Tp`.
pub fn vocab_shard(mesh: &DeviceMesh, vocab: usize) -> VocabShard {
    let r = chunk_range(
        vocab,
        axis_size(mesh, AxisKind::Tp),
        axis_coord(mesh, AxisKind::Tp),
    );
    VocabShard {
        start: r.start,
        len: r.len(),
        vocab,
    }
}

/// An embedding table `[vocab, hidden]` with its rows sharded over `Tp`.
pub struct VocabParallelEmbedding {
    pub weight: Param<ColWeight>,
}

/// What [`VocabParallelEmbedding::forward`] keeps for its backward.
pub struct EmbeddingCtx<M: SeqMode> {
    ids: Tensor,
    exit: Adjoint<Stream<M>, RowPartial>,
}

/// The table's gradient, `Partial` over `Dp`, sharded like the table over `Tp`.
pub struct EmbeddingGrads {
    pub weight: DTensor<Grad<ColWeight>>,
}

/// The table's gradient averaged over `Dp`.
pub struct EmbeddingGradsReduced {
    pub weight: DTensor<ColWeightReduced>,
}

impl EmbeddingGrads {
    pub fn reduce(self) -> Result<EmbeddingGradsReduced> {
        Ok(EmbeddingGradsReduced {
            weight: dp_average(self.weight)?,
        })
    }
}

impl EmbeddingGradsReduced {
    pub fn norm(&self, n: &mut GradNorm) -> Result<()> {
        n.add(&self.weight)
    }
    pub fn scale(&self, f: f64) -> Result<Self> {
        Ok(EmbeddingGradsReduced {
            weight: self.weight.scale(f)?,
        })
    }
}

impl VocabParallelEmbedding {
    /// Table drawn `Normal(0, init.std)`, parameter id `init.id`.
    pub fn new(
        vocab: usize,
        hidden: usize,
        init: ParamInit,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let w = Init::Normal { std: init.std }.param::<ColWeight>(
            init.seed,
            init.id,
            &[vocab, hidden],
            init.dtype,
            mesh,
        )?;
        Ok(VocabParallelEmbedding {
            weight: Param::new(w),
        })
    }

    pub fn vocab(&self) -> usize {
        self.weight.value().global_shape()[0]
    }

    /// Masked lookup (`Partial` over `Tp`), then the stream's exit.
    pub fn forward<M: SeqMode>(
        &self,
        ids: &DTensor<Ids>,
    ) -> Result<(DTensor<Stream<M>>, EmbeddingCtx<M>)> {
        let mesh = ids.device_mesh();
        let shard = vocab_shard(mesh, self.vocab());
        let local = ops::embedding_masked(self.weight.local(), ids.as_local(), shard)?;
        let hidden = self.weight.value().global_shape()[1];
        let partial =
            DTensor::<RowPartial>::from_local(local, &[ids.global_shape()[0], hidden], mesh)?;
        let (y, exit) = M::exit(partial)?;
        Ok((
            y,
            EmbeddingCtx {
                ids: ids.as_local().clone(),
                exit,
            },
        ))
    }

    /// The exit's adjoint (an `all_gather` under SP), then the masked scatter-add.
    pub fn backward<M: SeqMode>(
        &self,
        ctx: EmbeddingCtx<M>,
        dy: &DTensor<Stream<M>>,
    ) -> Result<EmbeddingGrads> {
        let mesh = dy.device_mesh().clone();
        let dfull: DTensor<Full> = ctx.exit.backward(dy.clone())?;
        let shard = vocab_shard(&mesh, self.vocab());
        let dw = ops::embedding_masked_backward(dfull.as_local(), &ctx.ids, shard)?;
        Ok(EmbeddingGrads {
            weight: DTensor::from_local(dw, self.weight.value().global_shape(), &mesh)?,
        })
    }

    pub fn apply(&mut self, g: &EmbeddingGradsReduced, opt: &impl Optimizer) -> Result<()> {
        opt.update(&mut self.weight, &g.weight)
    }
}

/// What [`vocab_parallel_cross_entropy`] keeps for its backward.
pub struct CrossEntropyCtx {
    /// `softmax` of the local vocab shard's logits, `[tokens, vocab shard]`, in f64.
    probs: Vec<f64>,
    /// The local column of each token's target, if this rank holds it.
    target_col: Vec<Option<usize>>,
    global: [usize; 2],
    dtype: DType,
}

fn ids_of(t: &Tensor) -> Result<Vec<usize>> {
    let v: Vec<i64> = match t.dtype() {
        DType::I64 => t.as_slice::<i64>()?.to_vec(),
        DType::I32 => t.as_slice::<i32>()?.iter().map(|&i| i as i64).collect(),
        d => {
            return Err(Error::ShapeMismatch {
                op: "vocab_parallel_cross_entropy",
                detail: format!("targets must be i64 or i32, got {d}"),
            })
        }
    };
    // A negative id becomes out of range, which the caller rejects.
    Ok(v.into_iter()
        .map(|i| usize::try_from(i).unwrap_or(usize::MAX))
        .collect())
}

/// Per-token cross-entropy `ln Σ_v exp(l_v) − l_target` of logits sharded over the vocab,
/// without gathering them. Collective over `Tp` (three all-reduces of `[tokens]`).
pub fn vocab_parallel_cross_entropy(
    logits: &DTensor<ColOut>,
    targets: &DTensor<Ids>,
) -> Result<(DTensor<TokenInvariant>, CrossEntropyCtx)> {
    let mesh = logits.device_mesh();
    let [tokens, vocab] = [logits.global_shape()[0], logits.global_shape()[1]];
    let shard = vocab_shard(mesh, vocab);
    let local = logits.as_local();
    let (rows, cols) = (local.shape()[0], local.shape()[1]);
    let ids = ids_of(targets.as_local())?;
    if ids.len() != rows || ids.iter().any(|&i| i >= vocab) {
        return Err(Error::ShapeMismatch {
            op: "vocab_parallel_cross_entropy",
            detail: format!(
                "{} targets (all < {vocab} expected) for {rows} local logit rows",
                ids.len()
            ),
        });
    }
    let l = local.to_f64_vec();
    let f64s = |v: Vec<f64>| Tensor::from_vec(v, &[rows]);
    // The global row max: a Partial<Max> over Tp, reduced.
    let lmax: Vec<f64> = (0..rows)
        .map(|r| {
            l[r * cols..(r + 1) * cols]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &x| m.max(x))
        })
        .collect();
    let gmax = DTensor::<layout![Dp: Shard<0>, Tp: Partial<Max>]>::from_local(
        f64s(lmax)?,
        &[tokens],
        mesh,
    )?
    .all_reduce(Tp)?
    .into_local()
    .to_f64_vec();
    let mut probs = vec![0.0; rows * cols];
    let mut sum = vec![0.0; rows];
    let mut tgt = vec![0.0; rows];
    let mut target_col = vec![None; rows];
    for r in 0..rows {
        for c in 0..cols {
            let e = (l[r * cols + c] - gmax[r]).exp();
            probs[r * cols + c] = e;
            sum[r] += e;
        }
        if let Some(c) = ids[r].checked_sub(shard.start).filter(|&c| c < shard.len) {
            target_col[r] = Some(c);
            tgt[r] = l[r * cols + c] - gmax[r];
        }
    }
    type TokPartial = layout![Dp: Shard<0>, Tp: Partial];
    let sum = DTensor::<TokPartial>::from_local(f64s(sum)?, &[tokens], mesh)?
        .all_reduce(Tp)?
        .into_local()
        .to_f64_vec();
    let tgt = DTensor::<TokPartial>::from_local(f64s(tgt)?, &[tokens], mesh)?
        .all_reduce(Tp)?
        .into_local()
        .to_f64_vec();
    for r in 0..rows {
        for p in &mut probs[r * cols..(r + 1) * cols] {
            *p /= sum[r];
        }
    }
    let loss: Vec<f64> = (0..rows).map(|r| sum[r].ln() - tgt[r]).collect();
    let dtype = local.dtype();
    let loss = f64s(loss)?;
    let loss = if dtype == DType::F64 {
        loss
    } else {
        loss.to_dtype(dtype)
    };
    Ok((
        DTensor::from_local(loss, &[tokens], mesh)?,
        CrossEntropyCtx {
            probs,
            target_col,
            global: [tokens, vocab],
            dtype,
        },
    ))
}

/// `dlogits = (softmax − one-hot)·dloss` on the local vocab shard: no communication.
pub fn vocab_parallel_cross_entropy_backward(
    ctx: CrossEntropyCtx,
    dloss: &DTensor<TokenInvariant>,
) -> Result<DTensor<ColOut>> {
    let d = dloss.as_local().to_f64_vec();
    let rows = d.len();
    let cols = ctx.probs.len().checked_div(rows).unwrap_or(0);
    let mut g = ctx.probs;
    for r in 0..rows {
        if let Some(c) = ctx.target_col[r] {
            g[r * cols + c] -= 1.0;
        }
        for v in &mut g[r * cols..(r + 1) * cols] {
            *v *= d[r];
        }
    }
    let t = Tensor::from_vec(g, &[rows, cols])?;
    let t = if ctx.dtype == DType::F64 {
        t
    } else {
        t.to_dtype(ctx.dtype)
    };
    DTensor::from_local(t, &ctx.global, dloss.device_mesh())
}

/// Collective: the mean of per-token losses over every token of the global batch, the same
/// value on every rank.
pub fn mean_loss(losses: &DTensor<TokenInvariant>) -> Result<f64> {
    let total = losses.global_shape()[0].max(1) as f64;
    let s: f64 = losses.as_local().to_f64_vec().iter().sum();
    let t = Tensor::from_vec(vec![s / total], &[1])?;
    let v =
        DTensor::<layout![Dp: Partial, Tp: Invariant]>::from_local(t, &[1], losses.device_mesh())?
            .all_reduce(Dp)?;
    Ok(v.as_local().to_f64_vec()[0])
}
