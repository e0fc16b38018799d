//! Transitional: the cross-entropy pieces on [`CudaTensor`]s, for the two `dtensor` call
//! sites that still take them (`cross_entropy_parts` and the cross-entropy backward). Each
//! is the front door [`crate::ops::ce_row_max`], [`ce_sum_target`](crate::ops::ce_sum_target),
//! [`ce_loss`](crate::ops::ce_loss) or [`ce_grad`](crate::ops::ce_grad) on the same
//! buffers (no copy); this file goes when those call sites call the front door.

use crate::cuda::CudaTensor;
use crate::{DType, Result, Tensor};

fn host(t: &CudaTensor) -> Tensor {
    Tensor::from(t.clone())
}

/// [`crate::ops::ce_row_max`] on a device tensor.
pub fn ce_row_max(logits: &CudaTensor) -> Result<CudaTensor> {
    crate::ops::ce_row_max(&host(logits))?.cuda_tensor()
}

/// [`crate::ops::ce_sum_target`] on device tensors (`ids` in host memory).
pub fn ce_sum_target(
    logits: &CudaTensor,
    max: &CudaTensor,
    ids: &Tensor,
    col_start: usize,
    vocab: usize,
) -> Result<(CudaTensor, CudaTensor)> {
    let (s, t) = crate::ops::ce_sum_target(&host(logits), &host(max), ids, col_start, vocab)?;
    Ok((s.cuda_tensor()?, t.cuda_tensor()?))
}

/// [`crate::ops::ce_loss`] on device tensors.
pub fn ce_loss(sum: &CudaTensor, target: &CudaTensor, dtype: DType) -> Result<CudaTensor> {
    crate::ops::ce_loss(&host(sum), &host(target), dtype)?.cuda_tensor()
}

/// [`crate::ops::ce_grad`] on device tensors (`ids` in host memory).
pub fn ce_grad(
    logits: &CudaTensor,
    max: &CudaTensor,
    sum: &CudaTensor,
    ids: &Tensor,
    dy: &CudaTensor,
    col_start: usize,
    vocab: usize,
) -> Result<CudaTensor> {
    let (l, m, s, d) = (host(logits), host(max), host(sum), host(dy));
    crate::ops::ce_grad(&l, &m, &s, ids, &d, col_start, vocab)?.cuda_tensor()
}
