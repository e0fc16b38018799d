//! The collectives' reductions on whole tensors, on the host or on a device: [`combine`]
//! folds one tensor into another, [`reduce_into`] reduces a list of tensors into a third, in
//! the fixed order of [`crate::reduce`] (left to right; `Avg` sums, then divides once), so
//! every rank that reduces the same tensors gets the same bits.
//!
//! Every dtype and [`ReduceOp`]; the host runs [`crate::reduce`]'s slice kernels, the device
//! `reduce_ext.cu`, bit for bit the host's result (but the payload of a NaN that Sum/Avg
//! computes: the GPU's is canonical, Rust leaves it unspecified). `Max`/`Min` ignore a NaN
//! source and keep a NaN accumulator, as `Element::max_of` / `min_of` do.

use super::same_layout;
use crate::{ReduceOp, Result, Tensor};

/// `acc[i] = acc[i] ⊕ src[i]`, `src` laid out as `acc` (`Avg` accumulates as `Sum`: the
/// caller divides once at the end).
pub fn combine(acc: &mut Tensor, src: &Tensor, op: ReduceOp) -> Result<()> {
    const OP: &str = "ops::combine";
    same_layout(OP, acc, src)?;
    dispatch!(OP, mut acc, [src] => device::combine(OP, acc, &src, op));
    crate::with_slice!(SliceMut, acc.try_as_dyn_slice_mut()?, |a: T| {
        crate::reduce::combine(a, src.as_slice::<T>()?, op);
        Ok(())
    })
}

/// `dst = srcs[0] ⊕ srcs[1] ⊕ … ⊕ srcs[n-1]`, combined left to right, then divided by `n`
/// for `Avg`. Every source is laid out as `dst`; with no source `dst` is left as it is.
pub fn reduce_into(dst: &mut Tensor, srcs: &[&Tensor], op: ReduceOp) -> Result<()> {
    const OP: &str = "ops::reduce_into";
    for s in srcs {
        same_layout(OP, &*dst, s)?;
    }
    let mut all: Vec<&Tensor> = vec![&*dst];
    all.extend(srcs);
    if crate::dispatch::on_cuda(OP, &all)? {
        return reduce_into_cuda(dst, srcs, op);
    }
    crate::with_slice!(SliceMut, dst.try_as_dyn_slice_mut()?, |d: T| {
        let srcs = srcs
            .iter()
            .map(|s| s.as_slice::<T>())
            .collect::<Result<Vec<&[T]>>>()?;
        crate::reduce::reduce_into(d, &srcs, op);
        Ok(())
    })
}

/// [`reduce_into`] on the device (every tensor there, as the caller checked).
#[cfg(feature = "cuda")]
fn reduce_into_cuda(dst: &mut Tensor, srcs: &[&Tensor], op: ReduceOp) -> Result<()> {
    let srcs = srcs
        .iter()
        .map(|s| s.cuda_tensor())
        .collect::<Result<Vec<_>>>()?;
    crate::dispatch::with_cuda_mut(dst, |d| device::reduce_into(d, &srcs, op))
}

#[cfg(not(feature = "cuda"))]
fn reduce_into_cuda(_: &mut Tensor, _: &[&Tensor], _: ReduceOp) -> Result<()> {
    unreachable!("no device tensor exists without the `cuda` feature")
}

/// The device launches (`cuda/kernels/reduce_ext.cu`), one thread per element, on tensors
/// the front door has checked.
#[cfg(feature = "cuda")]
mod device {
    use crate::cuda::launch::{copy_blocks, func, grid_for, launch_kernel};
    use crate::cuda::{source, CudaTensor};
    use crate::{ReduceOp, Result};

    /// The `int op` of `reduce_combine`: Avg sums (its division comes once, at the end).
    fn op_code(op: ReduceOp) -> i32 {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => 0,
            ReduceOp::Max => 1,
            ReduceOp::Min => 2,
        }
    }

    pub(super) fn combine(
        name: &'static str,
        acc: &mut CudaTensor,
        src: &CudaTensor,
        op: ReduceOp,
    ) -> Result<()> {
        let n = acc.numel();
        if n == 0 {
            return Ok(());
        }
        let dev = acc.device().clone();
        let f = func(&dev, &source::REDUCE_EXT, "reduce_combine", acc.dtype())?;
        launch_kernel!(name, dev, f, grid_for(n); dst acc, src src, u64 n, int op_code(op))
    }

    pub(super) fn reduce_into(
        dst: &mut CudaTensor,
        srcs: &[CudaTensor],
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "ops::reduce_into";
        let Some(first) = srcs.first() else {
            return Ok(());
        };
        let n = dst.numel();
        if n == 0 {
            return Ok(());
        }
        copy_blocks(OP, first, dst, 1, n, n, 0, n, 0)?;
        for s in &srcs[1..] {
            combine(OP, dst, s, op)?;
        }
        if op == ReduceOp::Avg {
            let dev = dst.device().clone();
            let f = func(&dev, &source::REDUCE_EXT, "reduce_avg_div", dst.dtype())?;
            launch_kernel!(OP, dev, f, grid_for(n); dst dst, u64 n, u64 srcs.len())?;
        }
        Ok(())
    }
}
