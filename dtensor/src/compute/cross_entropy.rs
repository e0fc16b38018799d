//! `cross_entropy`: per-token loss of (possibly vocab-sharded) logits against targets, with
//! its tape twin, which records the reduced row max and `Σ exp` its forward computed. The
//! arithmetic is the kernels' four cross-entropy pieces (`ops::ce_row_max`, …), on the host
//! or the device where the logits are.

use super::{describe, local_range, output, same_mesh, shape_err, want_rank};
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_collectives::ReduceOp;
use dtensor_kernels::{ops, DType, Tensor};
use dtensor_placement::{CrossEntropyLayout, CrossEntropyOut, Layout};

impl<L: Layout> DTensor<L> {
    /// Per-token cross-entropy of `[tokens, vocab]` logits against `[tokens]` targets
    /// (`i64`/`i32`). Logits sharded over their vocab on an axis give an `Invariant` loss
    /// there: the row max, the sum of exponentials and the target's logit are all-reduced
    /// over that axis (`[tokens]` each, no logits gather). Computed in f64.
    pub fn cross_entropy<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &DTensor<LT>,
    ) -> Result<DTensor<CrossEntropyOut<L, LT>>> {
        Ok(cross_entropy_parts(self, targets)?.0)
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
        let (y, saved) = cross_entropy_parts(self.value(), targets.value())?;
        let lv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let CrossEntropySaved {
                max,
                sum,
                ids,
                col_start,
                vocab,
            } = saved;
            let g = ops::ce_grad(
                lv.as_local(),
                &max,
                &sum,
                &ids,
                dy.as_local(),
                col_start,
                vocab,
            )?;
            grad_of("Var::cross_entropy", g, &lv)
        }))
    }
}

/// What cross-entropy's backward needs from its forward: the reduced row max and `Σ exp`
/// (f64 `[rows]`, where the logits are), the targets, and where this rank's vocab columns
/// start. The backward recomputes the probabilities from them (one exp per logit) rather
/// than keeping a `[rows, cols]` f64 copy alive between forward and backward.
struct CrossEntropySaved {
    max: Tensor,
    sum: Tensor,
    ids: Tensor,
    col_start: usize,
    vocab: usize,
}

/// Cross-entropy's forward, with what its backward needs ([`CrossEntropySaved`]): the
/// four-step protocol of [`ops::ce_row_max`]'s module, with the all-reduces over the axes
/// that split the vocab between the steps.
fn cross_entropy_parts<L: Layout, LT: CrossEntropyLayout<L>>(
    logits: &DTensor<L>,
    targets: &DTensor<LT>,
) -> Result<(DTensor<CrossEntropyOut<L, LT>>, CrossEntropySaved)> {
    const OP: &str = "DTensor::cross_entropy";
    let (lg, tg) = (logits.as_any(), targets.as_any());
    same_mesh(OP, lg, tg)?;
    want_rank(OP, lg, 2, "the logits")?;
    want_rank(OP, tg, 1, "the targets")?;
    let vocab = lg.global_shape()[1];
    let rows = lg.local_shape()[0];
    let ids = ids_of(OP, tg.as_local())?;
    if ids.len() != rows || ids.iter().any(|&i| i >= vocab) {
        return Err(shape_err(
            OP,
            format!(
                "{} targets (each < {vocab}) for logits {}",
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
    let (sum, target) = ops::ce_sum_target(x, &max, tg.as_local(), col_start, vocab)?;
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
        },
    ))
}

fn ids_of(op: &'static str, t: &Tensor) -> Result<Vec<usize>> {
    // Ids are read on the host (a few per row); device ids are copied here.
    let t = &t.to_host()?;
    let v: Vec<i64> = match t.dtype() {
        DType::I64 => t.as_slice::<i64>()?.to_vec(),
        DType::I32 => t.as_slice::<i32>()?.iter().map(|&i| i as i64).collect(),
        d => return Err(shape_err(op, format!("ids must be i64 or i32, got {d}"))),
    };
    // A negative id becomes out of range, which the callers reject.
    Ok(v.into_iter()
        .map(|i| usize::try_from(i).unwrap_or(usize::MAX))
        .collect())
}
