//! What an op is, apart from where it runs: its configuration, its output, the shapes and
//! dtypes it accepts and the errors it gives for the rest. No backend code: an op's front
//! door (`crate::ops`) runs these checks once, before it dispatches, so the host kernel
//! (`crate::cpu`) and the device launch take already-checked sizes and both devices give
//! the same messages.
//!
//! The floor above storage: it imports the storage floor (for [`Tensor`] as a type) and
//! nothing above.

#[macro_use]
pub(crate) mod float;
pub(crate) mod activation;
pub(crate) mod attention;
pub(crate) mod attention_block;
pub(crate) mod cross_entropy;
pub(crate) mod embedding;
pub(crate) mod matmul;
pub(crate) mod moe;
pub(crate) mod norm;
pub(crate) mod optim;
pub(crate) mod reduction;
pub(crate) mod rope;
pub(crate) mod tensor;

use crate::{DType, Error, Result, Tensor};

/// What a kernel does with the destination's old contents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Accum {
    /// `dst = result` (the old contents are never read, so they may be garbage or NaN).
    #[default]
    Replace,
    /// `dst = dst + result`, rounded once per element.
    Add,
}

/// Whether an operand enters a product as stored or transposed (read through strides; no
/// copy is made).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Transpose {
    /// The operand as stored (its last two dims used as they are).
    #[default]
    No,
    /// The operand's last two dims swapped (`Aᵀ`), read through strides.
    Yes,
}

/// The dtype a kernel computes in for `dtype` (and that saved norm statistics have).
pub fn acc_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        _ => DType::F32,
    }
}

pub(crate) fn not_float(op: &'static str, dtype: DType) -> Error {
    Error::Invalid {
        op,
        detail: format!("dtype {dtype} is not a float type (expected f32, f64, bf16 or f16)"),
    }
}

/// What the argument checks read of a tensor: its dtype and shape. [`Tensor`] has it and so
/// does the CUDA ops' `CudaTensor`, so the CPU and GPU paths check their arguments with the
/// same code and the same messages.
pub(crate) trait Layout {
    fn dtype(&self) -> DType;
    fn shape(&self) -> &[usize];
    fn rank(&self) -> usize {
        self.shape().len()
    }
}

impl Layout for Tensor {
    fn dtype(&self) -> DType {
        Tensor::dtype(self)
    }
    fn shape(&self) -> &[usize] {
        Tensor::shape(self)
    }
}

/// `Err` unless `t` has a float dtype.
pub(crate) fn want_float<L: Layout + ?Sized>(op: &'static str, t: &L) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(not_float(op, t.dtype()))
    }
}

/// `Err` unless `b` has `a`'s dtype.
pub(crate) fn same_dtype<L: Layout + ?Sized>(op: &'static str, a: &L, b: &L) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    Ok(())
}

/// `Err` unless `b` has `a`'s dtype and shape.
pub(crate) fn same_layout<L: Layout + ?Sized>(op: &'static str, a: &L, b: &L) -> Result<()> {
    same_dtype(op, a, b)?;
    if a.shape() != b.shape() {
        return Err(Error::ShapeMismatch {
            op,
            lhs: a.shape().into(),
            rhs: b.shape().into(),
        });
    }
    Ok(())
}

/// `Err` unless `dst` has exactly `shape` and `dtype` (destination checks of `_into` ops).
pub(crate) fn check_dst<L: Layout + ?Sized>(
    op: &'static str,
    dst: &L,
    shape: &[usize],
    dtype: DType,
) -> Result<()> {
    if dst.dtype() != dtype {
        return Err(Error::DTypeMismatch {
            op,
            lhs: dst.dtype(),
            rhs: dtype,
        });
    }
    if dst.shape() != shape {
        return Err(Error::ShapeMismatch {
            op,
            lhs: dst.shape().into(),
            rhs: shape.into(),
        });
    }
    Ok(())
}

/// The tensor seen as `[rows, n]` over its last dim; `Err` for a scalar.
pub(crate) fn rows_last<L: Layout + ?Sized>(op: &'static str, t: &L) -> Result<(usize, usize)> {
    let Some(&n) = t.shape().last() else {
        return Err(Error::Invalid {
            op,
            detail: "needs a tensor of rank >= 1 (it works along the last dim), got shape []"
                .into(),
        });
    };
    let rows = t.shape()[..t.rank() - 1].iter().product();
    Ok((rows, n))
}

/// `Err` unless `p` is `[n]` of `x`'s dtype: a per-feature parameter (bias, weight) of an op
/// over the last dim `n` of `x`.
pub(crate) fn check_row_param<L: Layout + ?Sized>(
    op: &'static str,
    x: &L,
    p: &L,
    n: usize,
) -> Result<()> {
    same_dtype(op, x, p)?;
    if p.shape() != [n] {
        return Err(Error::ShapeMismatch {
            op,
            lhs: x.shape().into(),
            rhs: p.shape().into(),
        });
    }
    Ok(())
}

/// The argument checks read a `CudaTensor` as they read a [`Tensor`].
#[cfg(feature = "cuda")]
impl Layout for crate::cuda::CudaTensor {
    fn dtype(&self) -> DType {
        crate::cuda::CudaTensor::dtype(self)
    }
    fn shape(&self) -> &[usize] {
        crate::cuda::CudaTensor::shape(self)
    }
}
