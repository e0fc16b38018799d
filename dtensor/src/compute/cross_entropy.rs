//! `cross_entropy`: per-token loss of (possibly vocab-sharded) logits against targets, with
//! its tape twin, which records the reduced row max and `Σ exp` its forward computed and the
//! targets its forward checked. The arithmetic is the kernels' cross-entropy pieces
//! (`ops::ce_targets`, `ops::ce_row_max`, …), on the host or the device where the logits
//! are. The options ([`CrossEntropy`]) add an ignore index (loss 0 and gradient 0 on those
//! tokens) and a z-loss; `scored_tokens` counts the targets that are not ignored over the
//! whole tensor, the denominator of a mean over the scored tokens.
//!
//! The targets are read and checked once per forward, by the kernels' `ops::ce_targets`
//! (which names the bad row and id); this file adds the shapes and placements to its error
//! ([`Error::BadTargets`]) and hands the checked targets to the backward.

use super::{describe, local_range, output, same_mesh, shape_err, want_rank};
use crate::error::{Error, Result};
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_collectives::ReduceOp;
use dtensor_kernels::ops::{CheckedTargets, CrossEntropyTargets};
use dtensor_kernels::{ops, DType, Tensor};
use dtensor_placement::{CrossEntropyLayout, CrossEntropyOut, Layout, Placement};

/// What a cross-entropy computes beyond `−log softmax[target]`: which target marks a token
/// to leave out, and PaLM's z-loss. The default is plain cross-entropy (every target
/// scored, no z-loss), bit for bit.
///
/// ```
/// use dtensor_core::CrossEntropy;
/// use dtensor_kernels::ops::IGNORE_INDEX;
/// let opts = CrossEntropy::default().ignoring(IGNORE_INDEX).with_z_loss(1e-4);
/// assert_eq!(opts.ignore_index, Some(-100));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CrossEntropy {
    /// A target equal to it (e.g. [`ops::IGNORE_INDEX`], −100, Hugging Face's label for
    /// padding and masked prompt tokens) scores nothing: loss 0, a zero gradient row, no
    /// z-loss. `None`: every target must be a class.
    pub ignore_index: Option<i64>,
    /// The z-loss coefficient `z` (finite, ≥ 0; 0 is off): each scored token's loss gains
    /// `z · lse²`, `lse` the log of the softmax normaliser over the whole vocab (every
    /// rank's columns), and its logits' gradient is `softmax·(1 + 2z·lse) − onehot`. It
    /// keeps the normaliser near 1 (PaLM uses `z = 1e-4`).
    pub z_loss: f64,
}

impl CrossEntropy {
    /// Targets equal to `ignore_index` score nothing.
    pub fn ignoring(self, ignore_index: i64) -> Self {
        CrossEntropy {
            ignore_index: Some(ignore_index),
            ..self
        }
    }

    /// A z-loss of coefficient `z_loss` (0: none).
    pub fn with_z_loss(self, z_loss: f64) -> Self {
        CrossEntropy { z_loss, ..self }
    }
}

impl<L: Layout> DTensor<L> {
    /// Per-token cross-entropy of `[tokens, vocab]` logits against `[tokens]` targets
    /// (`i64`/`i32`). Logits sharded over their vocab on an axis give an `Invariant` loss
    /// there: the row max, the sum of exponentials and the target's logit are all-reduced
    /// over that axis (`[tokens]` each, no logits gather). Computed in f64.
    pub fn cross_entropy<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &DTensor<LT>,
    ) -> Result<DTensor<CrossEntropyOut<L, LT>>> {
        self.cross_entropy_with(targets, CrossEntropy::default())
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
        self.cross_entropy_with(targets, CrossEntropy::default().ignoring(ignore_index))
    }

    /// [`cross_entropy`](Self::cross_entropy) with options: an ignore index (as
    /// [`cross_entropy_ignoring`](Self::cross_entropy_ignoring)) and a z-loss
    /// ([`CrossEntropy::z_loss`], whose `lse` uses the max and the sum reduced over the
    /// vocab axes: no extra communication). The default options give
    /// [`cross_entropy`](Self::cross_entropy)'s bits.
    pub fn cross_entropy_with<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &DTensor<LT>,
        options: CrossEntropy,
    ) -> Result<DTensor<CrossEntropyOut<L, LT>>> {
        Ok(cross_entropy_parts(self, targets, options)?.0)
    }

    /// Collective over the axes that split dim 0: the number of elements of the whole
    /// (global) integer tensor (targets, i64 or i32) that are not `ignore_index`, the same
    /// on every rank: the denominator of a mean over the scored tokens of a global batch,
    /// whatever the mesh. Each rank counts its local elements, and the counts are summed
    /// over every axis on which the tensor is `Shard<0>` or `Ragged` (tokens on other axes
    /// are copies, counted once). `None` counts every element.
    pub fn scored_tokens(&self, ignore_index: Option<i64>) -> Result<usize> {
        Self::scored_tokens_of(std::slice::from_ref(self), ignore_index)
    }

    /// [`scored_tokens`](Self::scored_tokens) of several tensors together (the targets of a
    /// batch's microbatches): their local counts are added first, so the whole batch costs
    /// one all-reduce of one value per axis, not one per tensor. Every rank passes the same
    /// number of tensors, on one mesh; none counts 0 (no communication).
    pub fn scored_tokens_of(tensors: &[Self], ignore_index: Option<i64>) -> Result<usize> {
        const OP: &str = "DTensor::scored_tokens";
        let Some(first) = tensors.first() else {
            return Ok(0);
        };
        let t = first.as_any();
        let mut local = 0;
        for x in tensors {
            same_mesh(OP, t, x.as_any())?;
            let ids = raw_ids(OP, x.as_any().as_local())?;
            local += ids.iter().filter(|&&i| Some(i) != ignore_index).count();
        }
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
        self.cross_entropy_with(targets, CrossEntropy::default())
    }

    /// [`DTensor::cross_entropy_ignoring`] on the tape: ignored tokens have loss 0 and give
    /// their logits a zero gradient row.
    pub fn cross_entropy_ignoring<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &Var<'t, LT>,
        ignore_index: i64,
    ) -> Result<Var<'t, CrossEntropyOut<L, LT>>> {
        self.cross_entropy_with(targets, CrossEntropy::default().ignoring(ignore_index))
    }

    /// [`DTensor::cross_entropy_with`] on the tape: `dlogits = (softmax·(1 + 2z·lse) −
    /// onehot)·dloss` on scored tokens (`z` the z-loss coefficient), a zero row on ignored
    /// ones; local, from the max and sum its forward reduced and the targets its forward
    /// checked (the backward reads no id).
    pub fn cross_entropy_with<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &Var<'t, LT>,
        options: CrossEntropy,
    ) -> Result<Var<'t, CrossEntropyOut<L, LT>>> {
        let (y, saved) = cross_entropy_parts(self.value(), targets.value(), options)?;
        let lv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let CrossEntropySaved {
                max,
                sum,
                targets,
                col_start,
                z_loss,
            } = saved;
            let g = ops::ce_grad(
                lv.as_local(),
                &max,
                &sum,
                &targets,
                dy.as_local(),
                col_start,
                z_loss,
            )?;
            grad_of("Var::cross_entropy", g, &lv)
        }))
    }
}

/// What cross-entropy's backward needs from its forward: the reduced row max and `Σ exp`
/// (f64 `[rows]`, where the logits are), the targets as the forward checked them, where
/// this rank's vocab columns start, and the z-loss coefficient. The backward recomputes the
/// probabilities from them (one exp per logit) rather than keeping a `[rows, cols]` f64
/// copy alive between forward and backward.
struct CrossEntropySaved {
    max: Tensor,
    sum: Tensor,
    targets: CheckedTargets,
    col_start: usize,
    z_loss: f64,
}

/// Cross-entropy's forward, with what its backward needs ([`CrossEntropySaved`]): the
/// protocol of [`ops::ce_row_max`]'s module (targets checked once, then four steps), with
/// the all-reduces over the axes that split the vocab between the steps.
fn cross_entropy_parts<L: Layout, LT: CrossEntropyLayout<L>>(
    logits: &DTensor<L>,
    targets: &DTensor<LT>,
    options: CrossEntropy,
) -> Result<(DTensor<CrossEntropyOut<L, LT>>, CrossEntropySaved)> {
    const OP: &str = "DTensor::cross_entropy";
    let (lg, tg) = (logits.as_any(), targets.as_any());
    same_mesh(OP, lg, tg)?;
    want_rank(OP, lg, 2, "the logits")?;
    want_rank(OP, tg, 1, "the targets")?;
    // Shapes only (no id is read here): every rank sees the same global shapes, so a
    // mismatch fails everywhere alike, before any collective.
    if tg.global_shape()[0] != lg.global_shape()[0] {
        return Err(shape_err(
            OP,
            format!(
                "targets {} for logits {}: one target per row",
                describe(tg),
                describe(lg)
            ),
        ));
    }
    let vocab = lg.global_shape()[1];
    let x = lg.as_local();
    let checked = ops::ce_targets(
        x,
        &CrossEntropyTargets {
            ids: tg.as_local(),
            vocab,
            ignore_index: options.ignore_index,
        },
    )
    .map_err(|source| Error::BadTargets {
        op: OP,
        targets: describe(tg),
        logits: describe(lg),
        source: Box::new(source),
    })?;
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
    let max = reduce(ops::ce_row_max(x)?, ReduceOp::Max)?;
    let (sum, target) = ops::ce_sum_target(x, &max, &checked, col_start)?;
    let sum = reduce(sum, ReduceOp::Sum)?;
    let target = reduce(target, ReduceOp::Sum)?;
    let loss = ops::ce_loss(&max, &sum, &target, options.z_loss, lg.dtype())?;
    Ok((
        output(OP, loss, &[lg.global_shape()[0]], lg)?,
        CrossEntropySaved {
            max,
            sum,
            targets: checked,
            col_start,
            z_loss: options.z_loss,
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
