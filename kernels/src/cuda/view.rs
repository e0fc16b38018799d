//! Dtype-erased views of device memory ([`DeviceView`], [`DeviceViewMut`]): what a device
//! collective (the NCCL backend of `dtensor-collectives`) reads and writes, the device
//! counterpart of [`Slice`](crate::Slice) / [`SliceMut`](crate::SliceMut).
//!
//! A view borrows a range of a [`CudaBuffer`] (or the elements of a [`CudaTensor`]), so the
//! buffer can neither be freed nor resized while a collective holds it. `bf16` and `f16`
//! elements are viewed as their 16 bits, as [`CudaBuffer`] stores them.

use super::{CudaBuffer, CudaTensor};
use crate::{DType, Error, Result};
use cudarc::driver::{CudaView, CudaViewMut};
use std::ops::Range;

/// A shared view of device memory holding elements of one [`DType`].
#[derive(Debug)]
pub enum DeviceView<'a> {
    /// [`DType::F32`] elements.
    F32(CudaView<'a, f32>),
    /// [`DType::F64`] elements.
    F64(CudaView<'a, f64>),
    /// [`DType::BF16`] elements, as their bits.
    BF16(CudaView<'a, u16>),
    /// [`DType::F16`] elements, as their bits.
    F16(CudaView<'a, u16>),
    /// [`DType::I32`] elements.
    I32(CudaView<'a, i32>),
    /// [`DType::I64`] elements.
    I64(CudaView<'a, i64>),
}

/// A mutable view of device memory holding elements of one [`DType`].
#[derive(Debug)]
pub enum DeviceViewMut<'a> {
    /// [`DType::F32`] elements.
    F32(CudaViewMut<'a, f32>),
    /// [`DType::F64`] elements.
    F64(CudaViewMut<'a, f64>),
    /// [`DType::BF16`] elements, as their bits.
    BF16(CudaViewMut<'a, u16>),
    /// [`DType::F16`] elements, as their bits.
    F16(CudaViewMut<'a, u16>),
    /// [`DType::I32`] elements.
    I32(CudaViewMut<'a, i32>),
    /// [`DType::I64`] elements.
    I64(CudaViewMut<'a, i64>),
}

/// Runs `$body` with `$v` bound to the typed cudarc view inside a [`DeviceView`] or
/// [`DeviceViewMut`] (by value or by reference, as `$value` is).
#[macro_export]
macro_rules! with_device_view {
    ($enum:ident, $value:expr, |$v:ident| $body:expr) => {
        match $value {
            $crate::cuda::$enum::F32($v) => $body,
            $crate::cuda::$enum::F64($v) => $body,
            $crate::cuda::$enum::BF16($v) => $body,
            $crate::cuda::$enum::F16($v) => $body,
            $crate::cuda::$enum::I32($v) => $body,
            $crate::cuda::$enum::I64($v) => $body,
        }
    };
}

fn out_of_range(op: &'static str, range: &Range<usize>, len: usize) -> Error {
    Error::Invalid {
        op,
        detail: format!("range {range:?} out of bounds for a device buffer of {len} elements"),
    }
}

impl DeviceView<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            DeviceView::F32(_) => DType::F32,
            DeviceView::F64(_) => DType::F64,
            DeviceView::BF16(_) => DType::BF16,
            DeviceView::F16(_) => DType::F16,
            DeviceView::I32(_) => DType::I32,
            DeviceView::I64(_) => DType::I64,
        }
    }
    /// The number of elements (not bytes).
    pub fn len(&self) -> usize {
        with_device_view!(DeviceView, self, |v| v.len())
    }
    /// True if the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl DeviceViewMut<'_> {
    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            DeviceViewMut::F32(_) => DType::F32,
            DeviceViewMut::F64(_) => DType::F64,
            DeviceViewMut::BF16(_) => DType::BF16,
            DeviceViewMut::F16(_) => DType::F16,
            DeviceViewMut::I32(_) => DType::I32,
            DeviceViewMut::I64(_) => DType::I64,
        }
    }
    /// The number of elements (not bytes).
    pub fn len(&self) -> usize {
        with_device_view!(DeviceViewMut, self, |v| v.len())
    }
    /// True if the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl CudaBuffer {
    /// A shared view of elements `range`; `Err` (never a panic) if it is out of bounds.
    pub fn view(&self, range: Range<usize>) -> Result<DeviceView<'_>> {
        const OP: &str = "CudaBuffer::view";
        let len = self.len();
        let bad = || out_of_range(OP, &range, len);
        if range.start > range.end || range.end > len {
            return Err(bad());
        }
        let r = range.clone();
        Ok(match self {
            CudaBuffer::F32(s) => DeviceView::F32(s.try_slice(r).ok_or_else(bad)?),
            CudaBuffer::F64(s) => DeviceView::F64(s.try_slice(r).ok_or_else(bad)?),
            CudaBuffer::BF16(s) => DeviceView::BF16(s.try_slice(r).ok_or_else(bad)?),
            CudaBuffer::F16(s) => DeviceView::F16(s.try_slice(r).ok_or_else(bad)?),
            CudaBuffer::I32(s) => DeviceView::I32(s.try_slice(r).ok_or_else(bad)?),
            CudaBuffer::I64(s) => DeviceView::I64(s.try_slice(r).ok_or_else(bad)?),
        })
    }

    /// A mutable view of elements `range`; `Err` (never a panic) if it is out of bounds.
    pub fn view_mut(&mut self, range: Range<usize>) -> Result<DeviceViewMut<'_>> {
        const OP: &str = "CudaBuffer::view_mut";
        let len = self.len();
        let bad = || out_of_range(OP, &range, len);
        if range.start > range.end || range.end > len {
            return Err(bad());
        }
        let r = range.clone();
        Ok(match self {
            CudaBuffer::F32(s) => DeviceViewMut::F32(s.try_slice_mut(r).ok_or_else(bad)?),
            CudaBuffer::F64(s) => DeviceViewMut::F64(s.try_slice_mut(r).ok_or_else(bad)?),
            CudaBuffer::BF16(s) => DeviceViewMut::BF16(s.try_slice_mut(r).ok_or_else(bad)?),
            CudaBuffer::F16(s) => DeviceViewMut::F16(s.try_slice_mut(r).ok_or_else(bad)?),
            CudaBuffer::I32(s) => DeviceViewMut::I32(s.try_slice_mut(r).ok_or_else(bad)?),
            CudaBuffer::I64(s) => DeviceViewMut::I64(s.try_slice_mut(r).ok_or_else(bad)?),
        })
    }
}

impl CudaTensor {
    /// A shared view of the tensor's [`numel`](CudaTensor::numel) elements (not the padding
    /// element of an empty tensor's buffer).
    pub fn view(&self) -> Result<DeviceView<'_>> {
        self.buffer().view(0..self.numel())
    }

    /// A mutable view of the tensor's elements, for a collective to write in place. The
    /// buffer itself cannot be replaced through it, so the tensor's invariant (its buffer
    /// holds at least `numel` elements) holds. A buffer shared with another tensor is
    /// copied first (copy on write), so the write does not show through the other tensor.
    pub fn view_mut(&mut self) -> Result<DeviceViewMut<'_>> {
        let n = self.numel();
        self.buffer_mut()?.view_mut(0..n)
    }
}
