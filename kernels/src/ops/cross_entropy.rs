//! Cross-entropy over a vocab that may be split across ranks, in four pieces with two
//! all-reduces between them (the caller's, over the axes that split the vocab):
//!
//! | step | piece | gives (per row, f64 `[rows]`) | then |
//! |---|---|---|---|
//! | 1 | [`ce_row_max`] | `max` of this rank's logits | all-reduce Max |
//! | 2 | [`ce_sum_target`] | `sum = Σ_c exp(l − max)` and `target = l[t] − max` (0 where column `t` is on another rank) | all-reduce Sum, each |
//! | 3 | [`ce_loss`] | `loss = ln(sum) − target`, in the logits' dtype | |
//! | backward | [`ce_grad`] | `dlogits = (exp(l − max)/sum − onehot(t))·dloss`, this rank's columns | |
//!
//! `logits` is `[rows, cols]`, the local columns `col_start..col_start + cols` of a
//! `vocab`-column whole. The targets ([`CrossEntropyTargets`]) are i64 or i32, one per row,
//! and may stay in host memory when the logits are on a device; each is a class in
//! `0..vocab` or equals the ignore index, if one is given (anything else is an `Err` naming
//! the op and the id). Everything is computed in f64 (rounded once into the logits' dtype
//! where it leaves as such); the host kernels fold and sum in column order, the device
//! kernels in a fixed tree order of their own, so host and device agree to rounding.
//!
//! **Ignored rows** (a target equal to the ignore index, e.g. [`IGNORE_INDEX`], the −100
//! that Hugging Face's causal-LM labels put on padding and masked prompt tokens) score
//! nothing: step 2 leaves their `sum` and `target` at 0 on every rank (so also after the
//! all-reduces), step 3 gives loss 0 for a reduced `sum` of 0, and the backward gives a zero
//! gradient row. A scored row's reduced `sum` is at least 1 (its max column adds
//! `exp(0) = 1`), so the two never mix; scored rows get the same bits as without an ignore
//! index. A mean over the scored tokens divides by their count, not by `rows`: that count
//! is the caller's (summed over the ranks that split the tokens).

use crate::spec::cross_entropy::{check_stat, logits_dims, target_ids};
use crate::spec::{check_dst, not_float};
use crate::{DType, Result, Tensor};

/// The ignore index of PyTorch's `cross_entropy` and of Hugging Face's labels: padding and
/// masked prompt tokens carry it, and score nothing.
pub const IGNORE_INDEX: i64 = -100;

/// The targets of a cross-entropy: one id per row (`ids`, i64 or i32, `[rows]`, on the host
/// or the logits' device), the `vocab` they index, and the id that marks a row to ignore.
#[derive(Clone, Copy, Debug)]
pub struct CrossEntropyTargets<'a> {
    /// One class id per row.
    pub ids: &'a Tensor,
    /// The whole vocab (all ranks' columns): a class id lies in `0..vocab`.
    pub vocab: usize,
    /// Rows whose id equals it are ignored (loss 0, gradient 0); `None` ignores nothing.
    pub ignore_index: Option<i64>,
}

impl<'a> CrossEntropyTargets<'a> {
    /// Every row scored: each id must lie in `0..vocab`.
    pub fn new(ids: &'a Tensor, vocab: usize) -> Self {
        CrossEntropyTargets {
            ids,
            vocab,
            ignore_index: None,
        }
    }

    /// Rows whose id is `ignore_index` are ignored (e.g. [`IGNORE_INDEX`]).
    pub fn ignoring(self, ignore_index: i64) -> Self {
        CrossEntropyTargets {
            ignore_index: Some(ignore_index),
            ..self
        }
    }

    fn check(&self, op: &'static str, rows: usize) -> Result<Vec<Option<usize>>> {
        target_ids(op, self.ids, rows, self.vocab, self.ignore_index)
    }
}

/// Step 1: each row's maximum of this rank's `logits` (`[rows, cols]`), f64 `[rows]` (`−∞`
/// for no column). All-reduce it (Max) over the axes that split the vocab before step 2.
pub fn ce_row_max(logits: &Tensor) -> Result<Tensor> {
    const OP: &str = "ops::ce_row_max";
    let (rows, cols) = logits_dims(OP, logits)?;
    dispatch!(OP, [logits] => device::row_max(&logits, rows, cols));
    crate::cpu::cross_entropy::row_max(logits, rows, cols)
}

/// Step 2: per row, `Σ_c exp(l − max)` and the target's `l − max` (0 where the target's
/// column is not among this rank's), both f64 `[rows]`, from the reduced `max`; both 0 on
/// an ignored row. All-reduce both (Sum) before step 3 and the backward. `col_start` is the
/// first vocab column of the local logits.
pub fn ce_sum_target(
    logits: &Tensor,
    max: &Tensor,
    targets: &CrossEntropyTargets,
    col_start: usize,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "ops::ce_sum_target";
    let (rows, cols) = logits_dims(OP, logits)?;
    check_stat(OP, max, rows)?;
    #[cfg(feature = "cuda")]
    if let Some(ids) = crate::dispatch::host_ids(OP, logits, targets.ids)? {
        crate::dispatch::on_cuda(OP, &[logits, max])?;
        let ids = CrossEntropyTargets {
            ids: &ids,
            ..*targets
        }
        .check(OP, rows)?;
        return device::sum_target(&logits.cuda_tensor()?, &max.cuda_tensor()?, &ids, col_start);
    }
    crate::dispatch::on_cuda(OP, &[logits, max])?;
    let ids = targets.check(OP, rows)?;
    crate::cpu::cross_entropy::sum_target(logits, max, &ids, col_start, (rows, cols))
}

/// Step 3: `ln(sum) − target` per row from the reduced f64 `sum` and `target`, rounded once
/// into `dtype` (the logits' float dtype); 0 where `sum` is 0 (an ignored row).
pub fn ce_loss(sum: &Tensor, target: &Tensor, dtype: DType) -> Result<Tensor> {
    const OP: &str = "ops::ce_loss";
    let rows = sum.numel();
    check_stat(OP, sum, rows)?;
    check_stat(OP, target, rows)?;
    if !dtype.is_float() {
        return Err(not_float(OP, dtype));
    }
    dispatch!(OP, [sum, target] => device::loss(&sum, &target, dtype));
    crate::cpu::cross_entropy::loss(sum, target, dtype)
}

/// The backward: the gradient of this rank's logits, `(exp(l − max)/sum − onehot(t))·dy[row]`,
/// from the reduced `max` and `sum` (f64 `[rows]`) and the loss's gradient `dy` (`[rows]`, the
/// logits' dtype); the logits' shape and dtype, with zero rows where the target is ignored.
pub fn ce_grad(
    logits: &Tensor,
    max: &Tensor,
    sum: &Tensor,
    targets: &CrossEntropyTargets,
    dy: &Tensor,
    col_start: usize,
) -> Result<Tensor> {
    const OP: &str = "ops::ce_grad";
    let (rows, cols) = logits_dims(OP, logits)?;
    check_stat(OP, max, rows)?;
    check_stat(OP, sum, rows)?;
    check_dst(OP, dy, &[rows], logits.dtype())?;
    #[cfg(feature = "cuda")]
    if let Some(ids) = crate::dispatch::host_ids(OP, logits, targets.ids)? {
        crate::dispatch::on_cuda(OP, &[logits, max, sum, dy])?;
        let ids = CrossEntropyTargets {
            ids: &ids,
            ..*targets
        }
        .check(OP, rows)?;
        let [logits, max, sum, dy] = [logits, max, sum, dy].map(Tensor::cuda_tensor);
        return device::grad(&logits?, &max?, &sum?, &ids, &dy?, col_start);
    }
    crate::dispatch::on_cuda(OP, &[logits, max, sum, dy])?;
    let ids = targets.check(OP, rows)?;
    crate::cpu::cross_entropy::grad(logits, max, sum, &ids, dy, col_start, (rows, cols))
}

/// The device launches (`cuda/kernels/cross_entropy.cu`): one block per row, on operands
/// the front door has checked; the targets are uploaded as i64, −1 marking an ignored row.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{func, grid_for, launch_kernel, per_row};
    use crate::cuda::{source, CudaTensor, Device};
    use crate::{DType, Result, Tensor};

    fn upload_ids(ids: &[Option<usize>], dev: &Device) -> Result<CudaTensor> {
        // Each class is below the vocab, a dim of a tensor that exists: it fits i64.
        let v: Vec<i64> = ids.iter().map(|i| i.map_or(-1, |c| c as i64)).collect();
        Tensor::from_vec(v, &[ids.len()])?.upload(dev)
    }

    pub(super) fn row_max(logits: &CudaTensor, rows: usize, cols: usize) -> Result<Tensor> {
        const OP: &str = "ops::ce_row_max";
        let dev = logits.device();
        if cols == 0 {
            return Tensor::from_vec(vec![f64::NEG_INFINITY; rows], &[rows])?.to_device(dev);
        }
        let mut m = CudaTensor::uninit(dev, &[rows], DType::F64)?;
        if rows > 0 {
            let f = func(dev, &source::CROSS_ENTROPY, "ce_row_max", logits.dtype())?;
            launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?; src logits, dst &mut m, u64 cols)?;
        }
        Ok(m.into())
    }

    pub(super) fn sum_target(
        logits: &CudaTensor,
        max: &CudaTensor,
        ids: &[Option<usize>],
        col_start: usize,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "ops::ce_sum_target";
        let (rows, cols) = (logits.shape()[0], logits.shape()[1]);
        let dev = logits.device();
        let ids = upload_ids(ids, dev)?;
        let mut s = CudaTensor::zeros(dev, &[rows], DType::F64)?;
        let mut t = CudaTensor::zeros(dev, &[rows], DType::F64)?;
        if rows * cols > 0 {
            let f = func(dev, &source::CROSS_ENTROPY, "ce_sum_target", logits.dtype())?;
            launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?;
                src logits, src max, src &ids, dst &mut s, dst &mut t, u64 cols,
                u64 col_start)?;
        }
        Ok((s.into(), t.into()))
    }

    pub(super) fn loss(sum: &CudaTensor, target: &CudaTensor, dtype: DType) -> Result<Tensor> {
        const OP: &str = "ops::ce_loss";
        let rows = sum.numel();
        let dev = sum.device();
        let mut loss = CudaTensor::uninit(dev, &[rows], dtype)?;
        if rows > 0 {
            let f = func(dev, &source::CROSS_ENTROPY, "ce_loss", dtype)?;
            launch_kernel!(OP, dev, f, grid_for(rows);
                src sum, src target, dst &mut loss, u64 rows)?;
        }
        Ok(loss.into())
    }

    pub(super) fn grad(
        logits: &CudaTensor,
        max: &CudaTensor,
        sum: &CudaTensor,
        ids: &[Option<usize>],
        dy: &CudaTensor,
        col_start: usize,
    ) -> Result<Tensor> {
        const OP: &str = "ops::ce_grad";
        let (rows, cols) = (logits.shape()[0], logits.shape()[1]);
        let dev = logits.device();
        let ids = upload_ids(ids, dev)?;
        let mut dl = CudaTensor::uninit(dev, logits.shape(), logits.dtype())?;
        if rows * cols > 0 {
            let f = func(dev, &source::CROSS_ENTROPY, "ce_grad", logits.dtype())?;
            launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?;
                dst &mut dl, src logits, src max, src sum, src &ids, src dy, u64 cols,
                u64 col_start)?;
        }
        Ok(dl.into())
    }
}
