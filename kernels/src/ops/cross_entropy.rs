//! Cross-entropy over a vocab that may be split across ranks: the targets checked once,
//! then four pieces with two all-reduces between them (the caller's, over the axes that
//! split the vocab):
//!
//! | step | piece | gives (per row, f64 `[rows]`) | then |
//! |---|---|---|---|
//! | 0 | [`ce_targets`] | the targets checked against the vocab, where the logits are ([`CheckedTargets`]) | kept for steps 2 and 4 |
//! | 1 | [`ce_row_max`] | `max` of this rank's logits | all-reduce Max |
//! | 2 | [`ce_sum_target`] | `sum = Σ_c exp(l − max)` and `target = l[t] − max` (0 where column `t` is on another rank) | all-reduce Sum, each |
//! | 3 | [`ce_loss`] | `loss = ln(sum) − target` (`+ z·lse²` with a z-loss), in the logits' dtype | |
//! | backward | [`ce_grad`] | `dlogits = (exp(l − max)/sum·(1 + 2z·lse) − onehot(t))·dloss`, this rank's columns | |
//!
//! `logits` is `[rows, cols]`, the local columns `col_start..col_start + cols` of a
//! `vocab`-column whole. The targets ([`CrossEntropyTargets`]) are i64 or i32, one per row,
//! and may stay in host memory when the logits are on a device; each is a class in
//! `0..vocab` or equals the ignore index, if one is given (anything else is an
//! [`Error::TargetOutOfRange`] naming the row and the id).
//! Step 0 is the one place that reads and checks them: it reads device ids to the host once
//! and uploads the checked classes once, and steps 2 and 4 take its [`CheckedTargets`]
//! (the forward checks, the backward reuses). Everything is computed in f64 (rounded once
//! into the logits' dtype where it leaves as such); the host kernels fold and sum in column
//! order, the device kernels in a fixed tree order of their own, so host and device agree
//! to rounding.
//!
//! **Ignored rows** (a target equal to the ignore index, e.g. [`IGNORE_INDEX`], the −100
//! that Hugging Face's causal-LM labels put on padding and masked prompt tokens) score
//! nothing: step 2 leaves their `sum` and `target` at 0 on every rank (so also after the
//! all-reduces), step 3 gives loss 0 for a reduced `sum` of 0, and the backward gives a zero
//! gradient row. A scored row's reduced `sum` is at least 1 (its max column adds
//! `exp(0) = 1`), so the two never mix; scored rows get the same bits as without an ignore
//! index. A mean over the scored tokens divides by their count, not by `rows`: that count
//! is the caller's (summed over the ranks that split the tokens).
//!
//! **z-loss** (PaLM's auxiliary loss, which keeps the softmax normaliser near 1): with a
//! coefficient `z > 0`, each scored row adds `z · lse²`, `lse = max + ln(sum)` the log of the
//! normaliser over the *whole* vocab (the reduced `max` and `sum`, so every rank's columns
//! count), and its gradient scales the softmax by `1 + 2z·lse`. Ignored rows add nothing.
//! With `z = 0` neither piece computes a z term at all: the bits are those without z-loss.

use crate::spec::cross_entropy::{check_stat, check_z_loss, logits_dims, target_classes};
use crate::spec::{check_dst, not_float};
use crate::{DType, Error, Result, Tensor};

/// The ignore index of PyTorch's `cross_entropy` and of Hugging Face's labels: padding and
/// masked prompt tokens carry it, and score nothing.
pub const IGNORE_INDEX: i64 = -100;

/// The targets of a cross-entropy: one id per row (`ids`, i64 or i32, `[rows]`, on the host
/// or the logits' device), the `vocab` they index, and the id that marks a row to ignore.
/// [`ce_targets`] checks them into [`CheckedTargets`], which the pieces take.
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
}

/// Targets that [`ce_targets`] checked: per row its class in `0..vocab`, or the mark of an
/// ignored row, held where the logits they were checked for are (uploaded once on a
/// device). Only [`ce_targets`] makes one, so the pieces that take it ([`ce_sum_target`],
/// [`ce_grad`]) never read or check an id again; cloning shares the buffer.
#[derive(Clone, Debug)]
pub struct CheckedTargets {
    /// i64 `[rows]`: the class, or −1 for an ignored row (the device kernels' mark).
    classes: Tensor,
    vocab: usize,
    scored: usize,
}

impl CheckedTargets {
    /// The number of rows (targets).
    pub fn rows(&self) -> usize {
        self.classes.numel()
    }

    /// The vocab the classes were checked against.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The rows that are scored (not ignored), on this rank: a local count, not the
    /// denominator of a mean over a batch split across ranks.
    pub fn scored(&self) -> usize {
        self.scored
    }

    /// `Err` unless these targets fit logits of `rows` rows whose columns
    /// `col_start..col_start + cols` lie inside the vocab they were checked against.
    fn fit(&self, op: &'static str, rows: usize, cols: usize, col_start: usize) -> Result<()> {
        if self.rows() != rows {
            return Err(Error::ShapeMismatch {
                op,
                lhs: [rows][..].into(),
                rhs: self.classes.shape().into(),
            });
        }
        if col_start
            .checked_add(cols)
            .is_none_or(|end| end > self.vocab)
        {
            return Err(Error::Invalid {
                op,
                detail: format!(
                    "logit columns {col_start}..{col_start}+{cols} exceed the vocab {} the \
                     targets were checked against",
                    self.vocab
                ),
            });
        }
        Ok(())
    }
}

/// Step 0: the targets checked for `logits` (`[rows, cols]`, any float dtype, on the host or
/// a device): one id per row, each in `0..vocab` or the ignore index, else an `Err` naming
/// the first bad row and its id ([`Error::TargetOutOfRange`]). Device ids are read to the
/// host once; the checked classes are uploaded once to the logits' device. Check once per
/// forward and keep the result for the backward.
pub fn ce_targets(logits: &Tensor, targets: &CrossEntropyTargets) -> Result<CheckedTargets> {
    const OP: &str = "ops::ce_targets";
    let (rows, _) = logits_dims(OP, logits)?;
    #[cfg(feature = "cuda")]
    let copied = crate::dispatch::host_ids(OP, logits, targets.ids)?;
    #[cfg(feature = "cuda")]
    let ids = copied.as_ref().unwrap_or(targets.ids);
    #[cfg(not(feature = "cuda"))]
    let ids = targets.ids;
    let classes = target_classes(OP, ids, rows, targets.vocab, targets.ignore_index)?;
    let scored = classes.iter().filter(|&&c| c >= 0).count();
    let mut classes = Tensor::from_vec(classes, &[rows])?;
    if let Some(dev) = logits.device() {
        classes = classes.to_device(dev)?;
    }
    Ok(CheckedTargets {
        classes,
        vocab: targets.vocab,
        scored,
    })
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
    targets: &CheckedTargets,
    col_start: usize,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "ops::ce_sum_target";
    let (rows, cols) = logits_dims(OP, logits)?;
    check_stat(OP, max, rows)?;
    targets.fit(OP, rows, cols, col_start)?;
    let classes = &targets.classes;
    dispatch!(OP, [logits, max, classes] =>
        device::sum_target(&logits, &max, &classes, col_start));
    let classes = classes.as_slice::<i64>()?;
    crate::cpu::cross_entropy::sum_target(logits, max, classes, col_start, (rows, cols))
}

/// Step 3: `ln(sum) − target` per row from the reduced f64 `max`, `sum` and `target`, plus
/// `z_loss · lse²` (`lse = max + ln(sum)`) where `z_loss` (finite, ≥ 0) is not 0, rounded
/// once into `dtype` (the logits' float dtype); 0 where `sum` is 0 (an ignored row). With
/// `z_loss` 0, `max` is not read and the bits are those of plain cross-entropy.
pub fn ce_loss(
    max: &Tensor,
    sum: &Tensor,
    target: &Tensor,
    z_loss: f64,
    dtype: DType,
) -> Result<Tensor> {
    const OP: &str = "ops::ce_loss";
    let rows = sum.numel();
    check_stat(OP, max, rows)?;
    check_stat(OP, sum, rows)?;
    check_stat(OP, target, rows)?;
    check_z_loss(OP, z_loss)?;
    if !dtype.is_float() {
        return Err(not_float(OP, dtype));
    }
    dispatch!(OP, [max, sum, target] => device::loss(&max, &sum, &target, z_loss, dtype));
    crate::cpu::cross_entropy::loss(max, sum, target, z_loss, dtype)
}

/// The backward: the gradient of this rank's logits,
/// `(exp(l − max)/sum · (1 + 2·z_loss·lse) − onehot(t))·dy[row]` (`lse = max + ln(sum)`;
/// the factor is left out when `z_loss` is 0), from the reduced `max` and `sum` (f64
/// `[rows]`), the targets the forward checked and the loss's gradient `dy` (`[rows]`, the
/// logits' dtype); the logits' shape and dtype, with zero rows where the target is ignored.
pub fn ce_grad(
    logits: &Tensor,
    max: &Tensor,
    sum: &Tensor,
    targets: &CheckedTargets,
    dy: &Tensor,
    col_start: usize,
    z_loss: f64,
) -> Result<Tensor> {
    const OP: &str = "ops::ce_grad";
    let (rows, cols) = logits_dims(OP, logits)?;
    check_stat(OP, max, rows)?;
    check_stat(OP, sum, rows)?;
    check_dst(OP, dy, &[rows], logits.dtype())?;
    check_z_loss(OP, z_loss)?;
    targets.fit(OP, rows, cols, col_start)?;
    let classes = &targets.classes;
    dispatch!(OP, [logits, max, sum, classes, dy] =>
        device::grad(&logits, &max, &sum, &classes, &dy, col_start, z_loss));
    let classes = classes.as_slice::<i64>()?;
    crate::cpu::cross_entropy::grad(
        logits,
        max,
        sum,
        classes,
        dy,
        col_start,
        z_loss,
        (rows, cols),
    )
}

/// The device launches (`cuda/kernels/cross_entropy.cu`): one block per row, on operands
/// the front door has checked; the classes are i64 on the device, −1 marking an ignored row.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{func, grid_for, launch_kernel, per_row};
    use crate::cuda::{source, CudaTensor};
    use crate::{DType, Result, Tensor};

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
        classes: &CudaTensor,
        col_start: usize,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "ops::ce_sum_target";
        let (rows, cols) = (logits.shape()[0], logits.shape()[1]);
        let dev = logits.device();
        let mut s = CudaTensor::zeros(dev, &[rows], DType::F64)?;
        let mut t = CudaTensor::zeros(dev, &[rows], DType::F64)?;
        if rows * cols > 0 {
            let f = func(dev, &source::CROSS_ENTROPY, "ce_sum_target", logits.dtype())?;
            launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?;
                src logits, src max, src classes, dst &mut s, dst &mut t, u64 cols,
                u64 col_start)?;
        }
        Ok((s.into(), t.into()))
    }

    pub(super) fn loss(
        max: &CudaTensor,
        sum: &CudaTensor,
        target: &CudaTensor,
        z_loss: f64,
        dtype: DType,
    ) -> Result<Tensor> {
        const OP: &str = "ops::ce_loss";
        let rows = sum.numel();
        let dev = sum.device();
        let mut loss = CudaTensor::uninit(dev, &[rows], dtype)?;
        if rows > 0 {
            let f = func(dev, &source::CROSS_ENTROPY, "ce_loss", dtype)?;
            launch_kernel!(OP, dev, f, grid_for(rows);
                src max, src sum, src target, dst &mut loss, f64 z_loss, u64 rows)?;
        }
        Ok(loss.into())
    }

    pub(super) fn grad(
        logits: &CudaTensor,
        max: &CudaTensor,
        sum: &CudaTensor,
        classes: &CudaTensor,
        dy: &CudaTensor,
        col_start: usize,
        z_loss: f64,
    ) -> Result<Tensor> {
        const OP: &str = "ops::ce_grad";
        let (rows, cols) = (logits.shape()[0], logits.shape()[1]);
        let dev = logits.device();
        let mut dl = CudaTensor::uninit(dev, logits.shape(), logits.dtype())?;
        if rows * cols > 0 {
            let f = func(dev, &source::CROSS_ENTROPY, "ce_grad", logits.dtype())?;
            launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?;
                dst &mut dl, src logits, src max, src sum, src classes, src dy, u64 cols,
                u64 col_start, f64 z_loss)?;
        }
        Ok(dl.into())
    }
}
