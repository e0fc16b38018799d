//! Device tensors: a shape, a dtype and a contiguous row-major device buffer on one [`Device`].

use super::{driver_err, Device};
use crate::shape::checked_numel;
use crate::{DType, Error, Result, Shape};
use cudarc::driver::CudaSlice;
use std::sync::Arc;

/// A device buffer of one of the six element types. `bf16` and `f16` are held as their bits
/// (`u16`): the kernels and cuBLAS read them as 16-bit floats, and the host copies go through
/// `bytemuck` (no dependency of cudarc on `half`).
#[derive(Debug)]
pub enum CudaBuffer {
    /// [`DType::F32`] elements.
    F32(CudaSlice<f32>),
    /// [`DType::F64`] elements.
    F64(CudaSlice<f64>),
    /// [`DType::BF16`] elements, each stored as its 16 bits (`bf16::to_bits`).
    BF16(CudaSlice<u16>),
    /// [`DType::F16`] elements, each stored as its 16 bits (`f16::to_bits`).
    F16(CudaSlice<u16>),
    /// [`DType::I32`] elements.
    I32(CudaSlice<i32>),
    /// [`DType::I64`] elements.
    I64(CudaSlice<i64>),
}

/// Runs `$body` with `$s` bound to the typed `CudaSlice` of a `CudaBuffer` (or `&mut`).
macro_rules! with_buffer {
    ($buf:expr, |$s:ident| $body:expr) => {
        match $buf {
            CudaBuffer::F32($s) => $body,
            CudaBuffer::F64($s) => $body,
            CudaBuffer::BF16($s) => $body,
            CudaBuffer::F16($s) => $body,
            CudaBuffer::I32($s) => $body,
            CudaBuffer::I64($s) => $body,
        }
    };
}
pub(crate) use with_buffer;

impl CudaBuffer {
    /// The element type the variant holds ([`DType::BF16`] / [`DType::F16`] for the two
    /// `u16` variants, not an integer type).
    pub fn dtype(&self) -> DType {
        match self {
            CudaBuffer::F32(_) => DType::F32,
            CudaBuffer::F64(_) => DType::F64,
            CudaBuffer::BF16(_) => DType::BF16,
            CudaBuffer::F16(_) => DType::F16,
            CudaBuffer::I32(_) => DType::I32,
            CudaBuffer::I64(_) => DType::I64,
        }
    }

    /// Elements allocated (at least 1: an empty tensor holds a 1-element buffer).
    pub fn len(&self) -> usize {
        with_buffer!(self, |s| s.len())
    }

    /// Whether the buffer holds no elements; false for every buffer a [`CudaTensor`]
    /// allocates, even for a tensor of zero elements (see [`CudaBuffer::len`]).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A tensor in device memory: contiguous, row-major, on one [`Device`].
///
/// Invariant: the buffer holds at least `max(numel, 1)` elements of `dtype`; kernels are
/// launched with element counts derived from `shape`, which is what keeps them in bounds.
///
/// The buffer is shared by reference count (`clone` copies nothing), as the buffer of a host
/// [`Tensor`](crate::Tensor) is: a kernel that writes into a tensor whose buffer is shared first copies it
/// on the device (copy on write), so values never change behind another tensor's back. A
/// `CudaTensor` and a device [`Tensor`](crate::Tensor) convert into each other without a copy
/// ([`Tensor::from`](crate::Tensor::from), [`Tensor::cuda_tensor`](crate::Tensor::cuda_tensor)).
#[derive(Clone, Debug)]
pub struct CudaTensor {
    pub(crate) shape: Shape,
    pub(crate) buf: Arc<CudaBuffer>,
    pub(crate) dev: Device,
}

/// The device half of [`crate::Storage`]: a shared device buffer and the GPU it is on.
/// A device [`Tensor`](crate::Tensor) always starts at element 0 of its buffer (its offset is 0).
#[derive(Clone, Debug)]
pub struct CudaStorage {
    buf: Arc<CudaBuffer>,
    dev: Device,
}

impl CudaStorage {
    /// The device buffer (at least `max(numel, 1)` elements of the tensor that holds it).
    pub fn buffer(&self) -> &CudaBuffer {
        &self.buf
    }

    /// The GPU whose memory holds the buffer.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Whether both storages are the same buffer (no copy was made between them).
    pub fn same_buffer(&self, other: &CudaStorage) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }
}

impl CudaTensor {
    /// The tensor's storage, for a [`Tensor`](crate::Tensor) (O(1): shares the buffer).
    pub(crate) fn into_parts(self) -> (Shape, CudaStorage) {
        (
            self.shape,
            CudaStorage {
                buf: self.buf,
                dev: self.dev,
            },
        )
    }

    /// A tensor of `shape` over `storage` (O(1)); the caller checked that the buffer holds
    /// at least `max(numel, 1)` elements (it came from a tensor of that element count).
    pub(crate) fn from_parts(shape: Shape, storage: CudaStorage) -> CudaTensor {
        debug_assert!(storage.buf.len() >= len_of("", &shape).unwrap_or(0).max(1));
        CudaTensor {
            shape,
            buf: storage.buf,
            dev: storage.dev,
        }
    }

    /// Whether both tensors view the same device buffer (no copy was made between them).
    pub fn shares_buffer_with(&self, other: &CudaTensor) -> bool {
        Arc::ptr_eq(&self.buf, &other.buf)
    }

    /// Makes the buffer exclusively this tensor's, copying it on the device (on the
    /// device's stream) if another tensor shares it, so that it can be written.
    pub(crate) fn make_unique(&mut self) -> Result<()> {
        unique_buffer(&mut self.buf, &self.dev).map(|_| ())
    }
}

impl CudaStorage {
    /// The buffer, for writing: copied first (on the device) if another tensor shares it.
    pub(crate) fn buffer_mut(&mut self) -> Result<&mut CudaBuffer> {
        unique_buffer(&mut self.buf, &self.dev)
    }
}

/// `buf` made exclusively its holder's (copy on write: a device-to-device copy on `dev`'s
/// stream if another tensor shares it), for writing.
fn unique_buffer<'a>(buf: &'a mut Arc<CudaBuffer>, dev: &Device) -> Result<&'a mut CudaBuffer> {
    const OP: &str = "cuda: copy on write";
    if Arc::get_mut(buf).is_none() {
        let st = dev.stream();
        let copy = match &**buf {
            CudaBuffer::F32(s) => st.clone_dtod(s).map(CudaBuffer::F32),
            CudaBuffer::F64(s) => st.clone_dtod(s).map(CudaBuffer::F64),
            CudaBuffer::BF16(s) => st.clone_dtod(s).map(CudaBuffer::BF16),
            CudaBuffer::F16(s) => st.clone_dtod(s).map(CudaBuffer::F16),
            CudaBuffer::I32(s) => st.clone_dtod(s).map(CudaBuffer::I32),
            CudaBuffer::I64(s) => st.clone_dtod(s).map(CudaBuffer::I64),
        }
        .map_err(|e| driver_err(OP, e))?;
        *buf = Arc::new(copy);
    }
    Ok(Arc::get_mut(buf).expect("unique: just checked or just made"))
}

fn len_of(op: &'static str, shape: &[usize]) -> Result<usize> {
    checked_numel(shape).ok_or_else(|| Error::Invalid {
        op,
        detail: format!("shape {shape:?} has more elements than fit in usize"),
    })
}

impl CudaTensor {
    /// A tensor whose contents are not initialized: for kernels that write every element.
    pub(crate) fn uninit(dev: &Device, shape: &[usize], dtype: DType) -> Result<CudaTensor> {
        const OP: &str = "CudaTensor::uninit";
        let n = len_of(OP, shape)?.max(1);
        let st = dev.stream();
        // SAFETY: callers launch a kernel that writes every element before anything reads it
        // (and bits of any value are valid for all six types).
        let buf = unsafe {
            match dtype {
                DType::F32 => st.alloc::<f32>(n).map(CudaBuffer::F32),
                DType::F64 => st.alloc::<f64>(n).map(CudaBuffer::F64),
                DType::BF16 => st.alloc::<u16>(n).map(CudaBuffer::BF16),
                DType::F16 => st.alloc::<u16>(n).map(CudaBuffer::F16),
                DType::I32 => st.alloc::<i32>(n).map(CudaBuffer::I32),
                DType::I64 => st.alloc::<i64>(n).map(CudaBuffer::I64),
            }
        }
        .map_err(|e| driver_err(OP, e))?;
        Ok(CudaTensor {
            shape: shape.into(),
            buf: Arc::new(buf),
            dev: dev.clone(),
        })
    }

    /// A tensor of zeros.
    pub fn zeros(dev: &Device, shape: &[usize], dtype: DType) -> Result<CudaTensor> {
        const OP: &str = "CudaTensor::zeros";
        let n = len_of(OP, shape)?.max(1);
        let st = dev.stream();
        let buf = match dtype {
            DType::F32 => st.alloc_zeros::<f32>(n).map(CudaBuffer::F32),
            DType::F64 => st.alloc_zeros::<f64>(n).map(CudaBuffer::F64),
            DType::BF16 => st.alloc_zeros::<u16>(n).map(CudaBuffer::BF16),
            DType::F16 => st.alloc_zeros::<u16>(n).map(CudaBuffer::F16),
            DType::I32 => st.alloc_zeros::<i32>(n).map(CudaBuffer::I32),
            DType::I64 => st.alloc_zeros::<i64>(n).map(CudaBuffer::I64),
        }
        .map_err(|e| driver_err(OP, e))?;
        Ok(CudaTensor {
            shape: shape.into(),
            buf: Arc::new(buf),
            dev: dev.clone(),
        })
    }

    /// The dimensions, outermost first (row-major).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The number of dimensions (0 for a scalar).
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The number of elements, the product of the shape: 1 for a scalar, 0 when a
    /// dimension is 0 (the buffer still holds one element then).
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.buf.dtype()
    }

    /// The GPU whose memory holds the tensor; ops on it are queued on that device's stream.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// The device buffer, for passing to a kernel or cuBLAS. It holds at least
    /// `max(numel, 1)` elements (a tensor of zero elements still has a one-element buffer);
    /// only the first [`CudaTensor::numel`] are the tensor's.
    pub fn buffer(&self) -> &CudaBuffer {
        &self.buf
    }

    /// The buffer, for a kernel to write: copied first (on the device) if another tensor
    /// shares it.
    pub(crate) fn buffer_mut(&mut self) -> Result<&mut CudaBuffer> {
        unique_buffer(&mut self.buf, &self.dev)
    }

    /// The same elements under another shape of the same element count (no copy).
    pub fn reshape(self, shape: &[usize]) -> Result<CudaTensor> {
        if checked_numel(shape) != Some(self.numel()) {
            return Err(Error::LengthMismatch {
                op: "CudaTensor::reshape",
                len: self.numel(),
                expected: checked_numel(shape).unwrap_or(usize::MAX),
                shape: shape.into(),
            });
        }
        Ok(CudaTensor {
            shape: shape.into(),
            ..self
        })
    }
}
