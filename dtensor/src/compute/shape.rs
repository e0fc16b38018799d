//! Shape ops: `split_dim`, `merge_dims` and the 2-D transpose `t`, with their tape twins.
//! No data moves between ranks: a sharded dim keeps its shards through the reshape.

use super::{check_dim, describe, output, shape_err, shard_parts, want_rank};
use crate::any::AnyDTensor;
use crate::error::Result;
use crate::tape::{grad_of, Var};
use crate::typed::DTensor;
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{
    Layout, MergeLayout, MergeOut, SplitLayout, SplitOut, TransposeLayout, Transposed,
};

impl<L: Layout> DTensor<L> {
    /// Dim `D` (extent `n`) split into `(n / inner, inner)`: `[tokens, heads·d]` →
    /// `[tokens, heads, d]`, say. A sharded `D` shards the leading part, which must split
    /// evenly over its ranks (`torch.chunk` of the two shapes differs otherwise): checked.
    pub fn split_dim<const D: usize>(&self, inner: usize) -> Result<DTensor<SplitOut<L, D>>>
    where
        L: SplitLayout<D>,
    {
        const OP: &str = "DTensor::split_dim";
        let a = self.as_any();
        check_dim(OP, a, D)?;
        let n = a.global_shape()[D];
        if inner == 0 || !n.is_multiple_of(inner) {
            return Err(shape_err(
                OP,
                format!(
                    "dim {D} of {} does not split into pieces of {inner}",
                    describe(a)
                ),
            ));
        }
        let outer = n / inner;
        even_over_shards(OP, a, D, outer)?;
        let split = |shape: &[usize], lead: usize| -> Vec<usize> {
            let mut v = shape.to_vec();
            v.splice(D..=D, [lead, inner]);
            v
        };
        let local_lead = a.local_shape()[D] / inner;
        let local = a
            .as_local()
            .clone()
            .reshape(&split(a.local_shape(), local_lead))?;
        output(OP, local, &split(a.global_shape(), outer), a)
    }

    /// Dims `D` and `D + 1` merged into one: `[samples, seq, hidden]` → `[tokens, hidden]`.
    /// A sharded `D` must be split evenly over its ranks (checked); a sharded `D + 1` does
    /// not compile.
    pub fn merge_dims<const D: usize>(&self) -> Result<DTensor<MergeOut<L, D>>>
    where
        L: MergeLayout<D>,
    {
        const OP: &str = "DTensor::merge_dims";
        let a = self.as_any();
        check_dim(OP, a, D + 1)?;
        even_over_shards(OP, a, D, a.global_shape()[D])?;
        let merge = |shape: &[usize]| -> Vec<usize> {
            let mut v = shape.to_vec();
            let m = v[D] * v[D + 1];
            v.splice(D..=D + 1, [m]);
            v
        };
        let local = a.as_local().clone().reshape(&merge(a.local_shape()))?;
        output(OP, local, &merge(a.global_shape()), a)
    }

    /// The transpose of a 2-D tensor: `Shard<0>` and `Shard<1>` swap.
    pub fn t(&self) -> Result<DTensor<Transposed<L>>>
    where
        L: TransposeLayout,
    {
        const OP: &str = "DTensor::t";
        let a = self.as_any();
        want_rank(OP, a, 2, "the tensor")?;
        let local = transpose_local(a.as_local())?;
        let g = a.global_shape();
        output(OP, local, &[g[1], g[0]], a)
    }
}

impl<'t, L: Layout> Var<'t, L> {
    /// [`DTensor::split_dim`]: the gradient is merged back.
    pub fn split_dim<const D: usize>(&self, inner: usize) -> Result<Var<'t, SplitOut<L, D>>>
    where
        L: SplitLayout<D>,
    {
        let y = self.value().split_dim::<D>(inner)?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let g = dy.as_local().clone().reshape(xv.local_shape())?;
            grad_of("Var::split_dim", g, &xv)
        }))
    }

    /// [`DTensor::merge_dims`]: the gradient is split back.
    pub fn merge_dims<const D: usize>(&self) -> Result<Var<'t, MergeOut<L, D>>>
    where
        L: MergeLayout<D>,
    {
        let y = self.value().merge_dims::<D>()?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let g = dy.as_local().clone().reshape(xv.local_shape())?;
            grad_of("Var::merge_dims", g, &xv)
        }))
    }

    /// [`DTensor::t`].
    pub fn t(&self) -> Result<Var<'t, Transposed<L>>>
    where
        L: TransposeLayout,
        Transposed<L>: TransposeLayout,
    {
        let y = self.value().t()?;
        let xv = self.value().as_any().clone();
        Ok(self.unary(y, false, move |dy| {
            let g: DTensor<<Transposed<L> as Layout>::Grad> = dy;
            let r = transpose_local(g.as_local())?;
            grad_of("Var::t", r, &xv)
        }))
    }
}

/// `extent` (of dim `d`, or its leading part) divides evenly over the ranks of every axis
/// that shards `d`, so `torch.chunk` of the reshaped dim gives the same rows.
fn even_over_shards(op: &'static str, a: &AnyDTensor, d: usize, extent: usize) -> Result<()> {
    let parts = shard_parts(a, d);
    if !extent.is_multiple_of(parts) {
        return Err(shape_err(
            op,
            format!("dim {d} of {}: {extent} rows do not split evenly over {parts} ranks, so the reshaped shards would hold other rows", describe(a)),
        ));
    }
    Ok(())
}

/// A `[r, c]` tensor's transpose `[c, r]`, any dtype, bit for bit.
fn transpose_local(t: &Tensor) -> Result<Tensor> {
    let (r, c) = (t.shape()[0], t.shape()[1]);
    if t.is_cuda() {
        // On a device: the columns packed one after another (the `pack` kernel copies, bit
        // for bit) are the rows of the transpose.
        return Ok(t.pack(1, &vec![1; c])?.reshape(&[c, r])?);
    }
    macro_rules! tr {
        ($T:ty) => {{
            let s = t.as_slice::<$T>()?;
            let v: Vec<$T> = (0..r * c).map(|i| s[(i % r) * c + i / r]).collect();
            Tensor::from_vec(v, &[c, r])?
        }};
    }
    Ok(match t.dtype() {
        DType::F32 => tr!(f32),
        DType::F64 => tr!(f64),
        DType::BF16 => tr!(half::bf16),
        DType::F16 => tr!(half::f16),
        DType::I32 => tr!(i32),
        DType::I64 => tr!(i64),
    })
}
