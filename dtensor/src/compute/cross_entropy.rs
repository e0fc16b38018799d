//! `cross_entropy`: per-token loss of (possibly vocab-sharded) logits against targets, with
//! its tape twin, which records the reduced row max and `Σ exp` its forward computed. The
//! arithmetic is the kernels' four cross-entropy pieces (`ops::ce_row_max`, …), on the host
//! or the device where the logits are. `cross_entropy_ignoring` takes an ignore index (loss
//! 0 and gradient 0 on those tokens), and `scored_tokens` counts the other targets of the
//! whole tensor, the denominator of a mean over the scored tokens.

use super::{describe, local_range, output, same_mesh, shape_err, want_rank};
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_collectives::ReduceOp;
use dtensor_kernels::ops::CrossEntropyTargets;
use dtensor_kernels::{ops, DType, Tensor};
use dtensor_placement::{CrossEntropyLayout, CrossEntropyOut, Layout, Placement};

impl<L: Layout> DTensor<L> {
    /// Per-token cross-entropy of `[tokens, vocab]` logits against `[tokens]` targets
    /// (`i64`/`i32`). Logits sharded over their vocab on an axis give an `Invariant` loss
    /// there: the row max, the sum of exponentials and the target's logit are all-reduced
    /// over that axis (`[tokens]` each, no logits gather). Computed in f64.
    pub fn cross_entropy<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &DTensor<LT>,
    ) -> Result<DTensor<CrossEntropyOut<L, LT>>> {
        Ok(cross_entropy_parts(self, targets, None)?.0)
    }

    /// [`cross_entropy`](Self::cross_entropy) where a target equal to `ignore_index` (e.g.
    /// [`ops::IGNORE_INDEX`], −100, Hugging Face's label for padding and masked prompt
    /// tokens) scores nothing: its loss is 0 (and, on the tape, its logits' gradient row is
    /// 0); every other target must lie in `0..vocab`. Scored tokens get the same bits as
    /// with [`cross_entropy`](Self::cross_entropy). A mean over the scored tokens divides
    /// the summed losses by [`scored_tokens`](Self::scored_tokens) of the targets (the
    /// whole batch's count), not by the number of tokens; with no token scored, the loss
    /// sum and every gradient are 0.
    pub fn cross_entropy_ignoring<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &DTensor<LT>,
        ignore_index: i64,
    ) -> Result<DTensor<CrossEntropyOut<L, LT>>> {
        Ok(cross_entropy_parts(self, targets, Some(ignore_index))?.0)
    }

    /// Collective over the axes that split dim 0: the number of elements of the whole
    /// (global) integer tensor (targets, i64 or i32) that are not `ignore_index`, the same
    /// on every rank: the denominator of a mean over the scored tokens of a global batch,
    /// whatever the mesh. Each rank counts its local elements, and the counts are summed
    /// over every axis on which the tensor is `Shard<0>` or `Ragged` (tokens on other axes
    /// are copies, counted once). `None` counts every element.
    pub fn scored_tokens(&self, ignore_index: Option<i64>) -> Result<usize> {
        const OP: &str = "DTensor::scored_tokens";
        let t = self.as_any();
        let ids = raw_ids(OP, t.as_local())?;
        let local = ids.iter().filter(|&&i| Some(i) != ignore_index).count();
        // f64 counts exactly below 2^53, and every backend reduces f64.
        let mut count = [local as f64];
        for (a, p) in t.placements().iter().enumerate() {
            if matches!(p, Placement::Shard(0) | Placement::Ragged) {
                let comm = t.device_mesh().axis_comm(a);
                crate::transfer::all_reduce_values(&**comm, &mut count, ReduceOp::Sum)?;
            }
        }
        Ok(count[0] as usize)
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::cross_entropy`] (`self` is the logits; the targets get no gradient):
    /// `dlogits = (softmax − onehot)·dloss`, local (the softmax's max and sum were reduced in
    /// the forward).
    pub fn cross_entropy<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &Var<'t, LT>,
    ) -> Result<Var<'t, CrossEntropyOut<L, LT>>> {
        self.cross_entropy_with(targets, None)
    }

    /// [`DTensor::cross_entropy_ignoring`] on the tape: ignored tokens have loss 0 and give
    /// their logits a zero gradient row.
    pub fn cross_entropy_ignoring<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &Var<'t, LT>,
        ignore_index: i64,
    ) -> Result<Var<'t, CrossEntropyOut<L, LT>>> {
        self.cross_entropy_with(targets, Some(ignore_index))
    }

    fn cross_entropy_with<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &Var<'t, LT>,
        ignore_index: Option<i64>,
    ) -> Result<Var<'t, CrossEntropyOut<L, LT>>> {
        let (y, saved) = cross_entropy_parts(self.value(), targets.value(), ignore_index)?;
        let lv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let CrossEntropySaved {
                max,
                sum,
                ids,
                col_start,
                vocab,
                ignore_index,
            } = saved;
            let targets = CrossEntropyTargets {
                ids: &ids,
                vocab,
                ignore_index,
            };
            let g = ops::ce_grad(
                lv.as_local(),
                &max,
                &sum,
                &targets,
                dy.as_local(),
                col_start,
            )?;
            grad_of("Var::cross_entropy", g, &lv)
        }))
    }
}

/// What cross-entropy's backward needs from its forward: the reduced row max and `Σ exp`
/// (f64 `[rows]`, where the logits are), the targets and their ignore index, and where
/// this rank's vocab columns start. The backward recomputes the probabilities from them
/// (one exp per logit) rather than keeping a `[rows, cols]` f64 copy alive between forward
/// and backward.
struct CrossEntropySaved {
    max: Tensor,
    sum: Tensor,
    ids: Tensor,
    col_start: usize,
    vocab: usize,
    ignore_index: Option<i64>,
}

/// Cross-entropy's forward, with what its backward needs ([`CrossEntropySaved`]): the
/// four-step protocol of [`ops::ce_row_max`]'s module, with the all-reduces over the axes
/// that split the vocab between the steps.
fn cross_entropy_parts<L: Layout, LT: CrossEntropyLayout<L>>(
    logits: &DTensor<L>,
    targets: &DTensor<LT>,
    ignore_index: Option<i64>,
) -> Result<(DTensor<CrossEntropyOut<L, LT>>, CrossEntropySaved)> {
    const OP: &str = "DTensor::cross_entropy";
    let (lg, tg) = (logits.as_any(), targets.as_any());
    same_mesh(OP, lg, tg)?;
    want_rank(OP, lg, 2, "the logits")?;
    want_rank(OP, tg, 1, "the targets")?;
    let vocab = lg.global_shape()[1];
    let rows = lg.local_shape()[0];
    let ids = raw_ids(OP, tg.as_local())?;
    let bad = ids
        .iter()
        .find(|&&i| Some(i) != ignore_index && !matches!(usize::try_from(i), Ok(c) if c < vocab));
    if ids.len() != rows || bad.is_some() {
        let ignoring = ignore_index.map_or(String::new(), |i| format!(" or {i}, ignored"));
        let found = bad.map_or(String::new(), |i| format!(", found target {i}"));
        return Err(shape_err(
            OP,
            format!(
                "{} targets (each < {vocab}{ignoring}) for logits {}{found}",
                ids.len(),
                describe(lg)
            ),
        ));
    }
    // The axes that split the vocab: the max, the sum and the target logit are reduced
    // over them (the same axes on every rank: they come from the type).
    let vocab_axes: Vec<usize> = lg
        .placements()
        .iter()
        .enumerate()
        .filter(|(_, p)| p.shard_dim() == Some(1))
        .map(|(a, _)| a)
        .collect();
    let reduce = |mut t: Tensor, op: ReduceOp| -> Result<Tensor> {
        for &a in &vocab_axes {
            crate::transfer::all_reduce(&**lg.device_mesh().axis_comm(a), &mut t, op)?;
        }
        Ok(t)
    };
    let col_start = local_range(lg, 1)?.start;
    let x = lg.as_local();
    let max = reduce(ops::ce_row_max(x)?, ReduceOp::Max)?;
    let ce_targets = CrossEntropyTargets {
        ids: tg.as_local(),
        vocab,
        ignore_index,
    };
    let (sum, target) = ops::ce_sum_target(x, &max, &ce_targets, col_start)?;
    let sum = reduce(sum, ReduceOp::Sum)?;
    let target = reduce(target, ReduceOp::Sum)?;
    let loss = ops::ce_loss(&sum, &target, lg.dtype())?;
    Ok((
        output(OP, loss, &[lg.global_shape()[0]], lg)?,
        CrossEntropySaved {
            max,
            sum,
            ids: tg.as_local().clone(),
            col_start,
            vocab,
            ignore_index,
        },
    ))
}

/// The ids of an integer tensor (i64 or i32, host memory) as i64.
fn raw_ids(op: &'static str, t: &Tensor) -> Result<Vec<i64>> {
    // Ids are read on the host (a few per row); device ids are copied here.
    let t = &t.to_host()?;
    match t.dtype() {
        DType::I64 => Ok(t.as_slice::<i64>()?.to_vec()),
        DType::I32 => Ok(t.as_slice::<i32>()?.iter().map(|&i| i as i64).collect()),
        d => Err(shape_err(op, format!("ids must be i64 or i32, got {d}"))),
    }
}
