//! `cross_entropy`: per-token loss of (possibly vocab-sharded) logits against targets, with
//! its tape twin, which records the probabilities (or, on a device, the reduced row max
//! and `Σ exp`) its forward computed.

use super::{describe, local_range, output, same_mesh, shape_err, want_rank};
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_collectives::ReduceOp;
use dtensor_kernels::{DType, Tensor};
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
            let (probs, target_col) = match saved {
                CrossEntropySaved::Host { probs, target_col } => (probs, target_col),
                #[cfg(feature = "cuda")]
                CrossEntropySaved::Device {
                    max,
                    sum,
                    ids,
                    col_start,
                    vocab,
                } => {
                    let (x, d) = (lv.as_local().cuda_tensor()?, dy.as_local().cuda_tensor()?);
                    let g = dtensor_kernels::cuda::ops::ce_grad(
                        &x, &max, &sum, &ids, &d, col_start, vocab,
                    )?;
                    return grad_of("Var::cross_entropy", Tensor::from(g), &lv);
                }
            };
            let d = dy.as_local().to_f64_vec();
            let (rows, cols) = (lv.local_shape()[0], lv.local_shape()[1]);
            let mut g = probs;
            for r in 0..rows {
                if let Some(c) = target_col[r] {
                    g[r * cols + c] -= 1.0;
                }
                g[r * cols..(r + 1) * cols]
                    .iter_mut()
                    .for_each(|v| *v *= d[r]);
            }
            let t = Tensor::from_f64_vec(g, &[rows, cols], lv.dtype())?;
            grad_of("Var::cross_entropy", t, &lv)
        }))
    }
}

/// What cross-entropy's backward needs from its forward.
enum CrossEntropySaved {
    /// Host logits: the probabilities of this rank's logits (normalized by the global max
    /// and sum) and each row's target column, if this rank holds it.
    Host {
        probs: Vec<f64>,
        target_col: Vec<Option<usize>>,
    },
    /// Device logits: the reduced row max and `Σ exp` (f64 `[rows]`, on the device), the
    /// targets (host), and where this rank's vocab columns start; the device kernel
    /// recomputes the probabilities from them.
    #[cfg(feature = "cuda")]
    Device {
        max: dtensor_kernels::cuda::CudaTensor,
        sum: dtensor_kernels::cuda::CudaTensor,
        ids: Tensor,
        col_start: usize,
        vocab: usize,
    },
}

/// Cross-entropy's forward, with what its backward needs ([`CrossEntropySaved`]).
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
    let (rows, cols) = (lg.local_shape()[0], lg.local_shape()[1]);
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
    let all_reduce = |v: &mut Vec<f64>, op: ReduceOp| -> Result<()> {
        for &a in &vocab_axes {
            crate::transfer::all_reduce_values(&**lg.device_mesh().axis_comm(a), v, op)?;
        }
        Ok(())
    };
    let cols_here = local_range(lg, 1)?;
    #[cfg(feature = "cuda")]
    if lg.as_local().is_cuda() {
        // The device kernels in the host's order: row max, all-reduce (Max); Σ exp and the
        // target's logit, all-reduce (Sum) each; the loss. Only the ids are read on the host.
        use dtensor_kernels::cuda::{ops as cu, CudaTensor};
        let reduce = |t: CudaTensor, op: ReduceOp| -> Result<CudaTensor> {
            let mut t = Tensor::from(t);
            for &a in &vocab_axes {
                crate::transfer::all_reduce(&**lg.device_mesh().axis_comm(a), &mut t, op)?;
            }
            Ok(t.cuda_tensor()?)
        };
        let ids = tg.as_local().to_host()?;
        let x = lg.as_local().cuda_tensor()?;
        let max = reduce(cu::ce_row_max(&x)?, ReduceOp::Max)?;
        let (sum, target) = cu::ce_sum_target(&x, &max, &ids, cols_here.start, vocab)?;
        let sum = reduce(sum, ReduceOp::Sum)?;
        let target = reduce(target, ReduceOp::Sum)?;
        let loss = Tensor::from(cu::ce_loss(&sum, &target, lg.dtype())?);
        return Ok((
            output(OP, loss, &[lg.global_shape()[0]], lg)?,
            CrossEntropySaved::Device {
                max,
                sum,
                ids,
                col_start: cols_here.start,
                vocab,
            },
        ));
    }
    let l = lg.as_local().to_f64_vec();
    let mut max: Vec<f64> = (0..rows)
        .map(|r| {
            l[r * cols..(r + 1) * cols]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &x| m.max(x))
        })
        .collect();
    all_reduce(&mut max, ReduceOp::Max)?;
    let mut probs = vec![0.0; rows * cols];
    let mut sum = vec![0.0; rows];
    let mut target = vec![0.0; rows];
    let mut target_col = vec![None; rows];
    for r in 0..rows {
        for c in 0..cols {
            let e = (l[r * cols + c] - max[r]).exp();
            probs[r * cols + c] = e;
            sum[r] += e;
        }
        if cols_here.contains(&ids[r]) {
            let c = ids[r] - cols_here.start;
            target_col[r] = Some(c);
            target[r] = l[r * cols + c] - max[r];
        }
    }
    all_reduce(&mut sum, ReduceOp::Sum)?;
    all_reduce(&mut target, ReduceOp::Sum)?;
    for r in 0..rows {
        probs[r * cols..(r + 1) * cols]
            .iter_mut()
            .for_each(|p| *p /= sum[r]);
    }
    let loss: Vec<f64> = (0..rows).map(|r| sum[r].ln() - target[r]).collect();
    let local = Tensor::from_f64_vec(loss, &[rows], lg.dtype())?;
    Ok((
        output(OP, local, &[lg.global_shape()[0]], lg)?,
        CrossEntropySaved::Host { probs, target_col },
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
