//! The [`Tensor`] handle: a shape over (a view of) a storage, its constructors and
//! accessors, and moves between host and device memory. What a tensor computes is in
//! `crate::tensor`, one floor up.

use super::{CpuBuffer, CpuStorage, Storage, StorageElement};
use crate::dtype::{DType, Element, Slice, SliceMut};
use crate::error::{Error, Result};
use crate::shape::{checked_numel, numel};
use crate::{cuda, with_slice, Shape};
use std::sync::Arc;
#[cfg(feature = "cuda")]
use {
    crate::cuda::{driver_err, CudaBuffer, CudaTensor, Device},
    half::{bf16, f16},
};

/// A dense tensor on one rank.
///
/// Invariants: the elements are the `numel(shape)` consecutive elements of the storage
/// starting at `offset`, row-major. A tensor of rank 0 (shape `[]`) holds one element.
///
/// Storage is shared: `clone` and a [`narrow`](Tensor::narrow) of the leading dim are
/// views that copy nothing; writing through a shared view first copies its elements
/// (copy on write), so values never change behind another tensor's back.
///
/// The storage is in host memory or (feature `cuda`) on one GPU ([`Tensor::device`]). The
/// ops run where their operands are: a device tensor's ops launch CUDA kernels on its
/// device, operands in different places are an [`Error::DeviceMismatch`], and an op without
/// a kernel answers [`Error::NotOnCuda`]. A device tensor's offset is always 0 (a `narrow`
/// of it copies), so it converts to and from a [`CudaTensor`](crate::cuda::CudaTensor)
/// without a copy. Accessors that hand out host memory ([`Tensor::as_slice`],
/// [`Tensor::try_as_dyn_slice`], [`Tensor::to_storage`], …) return [`Error::NotOnHost`]
/// for a device tensor rather than copying behind the caller's back; [`Tensor::to_host`]
/// copies.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub(crate) shape: Shape,
    pub(crate) storage: Storage,
    pub(crate) offset: usize,
}

impl PartialEq for Tensor {
    /// Same shape, dtype and elements (wherever they are stored: device tensors are copied
    /// to the host to compare, which is for tests and metrics, not for a hot loop).
    ///
    /// # Panics
    /// If copying a device tensor to the host fails (a CUDA error).
    fn eq(&self, other: &Tensor) -> bool {
        self.shape == other.shape && self.dtype() == other.dtype() && {
            let (a, b) = (host_copy(self), host_copy(other));
            let (a, b) = (a.as_dyn_slice(), b.as_dyn_slice());
            with_slice!(Slice, a, |x: T| b.typed::<T>() == Some(x))
        }
    }
}

/// `t` itself on the host (a cheap clone), or its elements copied from the device.
///
/// # Panics
/// If the copy fails (a CUDA error); for [`PartialEq`] and [`Tensor::to_f64_vec`], which
/// have no `Result`.
fn host_copy(t: &Tensor) -> Tensor {
    t.to_host()
        .unwrap_or_else(|e| panic!("copying a device tensor to the host failed: {e}"))
}

/// The element count of a new tensor of `shape` and `dtype`, or `Err` if it overflows
/// ([`checked_numel`]) or its bytes exceed `isize::MAX` (the most any allocation can hold,
/// so that a later `Vec` allocation cannot hit its own "capacity overflow" panic).
pub(crate) fn checked_len(op: &'static str, shape: &[usize], dtype: DType) -> Result<usize> {
    checked_numel(shape)
        .filter(|n| {
            n.checked_mul(dtype.size_in_bytes())
                .is_some_and(|b| b <= isize::MAX as usize)
        })
        .ok_or_else(|| Error::Invalid {
            op,
            detail: format!(
                "shape {shape:?} of {dtype} has more elements than memory can hold: capacity overflow"
            ),
        })
}

/// `Ok` value or the panic a constructor without `Result` documents.
pub(crate) fn or_panic(r: Result<Tensor>) -> Tensor {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// The elements of a buffer whose dtype the caller checked to be `T`'s.
///
/// # Panics
/// If it is not (an internal invariant).
pub(crate) fn typed_as<T: Element>(s: Slice<'_>) -> &[T] {
    s.typed()
        .expect("dtype checked by the caller to be the destination's")
}

impl Tensor {
    pub(crate) fn from_storage(shape: &[usize], data: CpuStorage) -> Tensor {
        debug_assert_eq!(data.len(), numel(shape));
        Tensor {
            shape: shape.into(),
            storage: Storage::Cpu(Arc::new(CpuBuffer::new(data))),
            offset: 0,
        }
    }

    /// A tensor of `shape` filled with zeros.
    ///
    /// # Panics
    /// With "capacity overflow" if the shape has more elements than memory can hold
    /// ([`checked_numel`]); [`Tensor::try_zeros`] returns `Err` instead.
    pub fn zeros(shape: &[usize], dtype: DType) -> Self {
        or_panic(Self::zeros_checked("Tensor::zeros", shape, dtype))
    }

    /// [`Tensor::zeros`], or `Err` if the shape has more elements than memory can hold.
    /// Never panics (allocation failure still aborts, as for any `Vec`).
    pub fn try_zeros(shape: &[usize], dtype: DType) -> Result<Self> {
        Self::zeros_checked("Tensor::try_zeros", shape, dtype)
    }

    pub(crate) fn zeros_checked(op: &'static str, shape: &[usize], dtype: DType) -> Result<Self> {
        let n = checked_len(op, shape, dtype)?;
        Ok(match crate::pool::take(dtype, n) {
            Some(mut data) => {
                with_slice!(SliceMut, data.slice_mut(), |d: T| d
                    .fill(<T as Element>::zero()));
                Tensor::from_storage(shape, data)
            }
            None => Tensor::from_storage(shape, crate::pool::alloc_zeroed(dtype, n)),
        })
    }

    /// A tensor of `shape` whose elements are unspecified (but initialized) values, for a
    /// destination that is about to be overwritten in full: reuses a pooled buffer
    /// without clearing it.
    ///
    /// # Panics
    /// With "capacity overflow" if the shape has more elements than memory can hold;
    /// [`Tensor::try_for_overwrite`] returns `Err` instead.
    pub fn for_overwrite(shape: &[usize], dtype: DType) -> Self {
        or_panic(Self::for_overwrite_checked(
            "Tensor::for_overwrite",
            shape,
            dtype,
        ))
    }

    /// [`Tensor::for_overwrite`], or `Err` if the shape has more elements than memory can
    /// hold. Never panics.
    pub fn try_for_overwrite(shape: &[usize], dtype: DType) -> Result<Self> {
        Self::for_overwrite_checked("Tensor::try_for_overwrite", shape, dtype)
    }

    pub(crate) fn for_overwrite_checked(
        op: &'static str,
        shape: &[usize],
        dtype: DType,
    ) -> Result<Self> {
        let n = checked_len(op, shape, dtype)?;
        let data =
            crate::pool::take(dtype, n).unwrap_or_else(|| crate::pool::alloc_zeroed(dtype, n));
        Ok(Tensor::from_storage(shape, data))
    }

    /// Wraps `data` (row-major) as a tensor of `shape`; `Err` if `data` does not hold
    /// exactly the shape's element count (or that count overflows).
    pub fn from_vec<T: StorageElement>(data: Vec<T>, shape: &[usize]) -> Result<Self> {
        const OP: &str = "Tensor::from_vec";
        // Checked before comparing: a wrapped count could match a short (even empty) `data`.
        let expected = checked_len(OP, shape, T::DTYPE)?;
        if data.len() != expected {
            return Err(Error::LengthMismatch {
                op: OP,
                len: data.len(),
                expected,
                shape: shape.into(),
            });
        }
        Ok(Tensor::from_storage(shape, T::wrap(data)))
    }

    /// A tensor whose element at flat index `i` is `f(i)` (handy for tests and examples).
    ///
    /// # Panics
    /// With "capacity overflow" if the shape has more elements than memory can hold;
    /// [`Tensor::try_from_fn`] returns `Err` instead (and panics only if `f` does).
    pub fn from_fn<T: StorageElement>(shape: &[usize], f: impl FnMut(usize) -> T) -> Self {
        or_panic(Self::from_fn_checked("Tensor::from_fn", shape, f))
    }

    /// [`Tensor::from_fn`], or `Err` (before calling `f`) if the shape has more elements
    /// than memory can hold.
    pub fn try_from_fn<T: StorageElement>(
        shape: &[usize],
        f: impl FnMut(usize) -> T,
    ) -> Result<Self> {
        Self::from_fn_checked("Tensor::try_from_fn", shape, f)
    }

    fn from_fn_checked<T: StorageElement>(
        op: &'static str,
        shape: &[usize],
        mut f: impl FnMut(usize) -> T,
    ) -> Result<Self> {
        let n = checked_len(op, shape, T::DTYPE)?;
        // Into a pooled buffer when one is cached (every element is written, so its old
        // values do not matter), else into a fresh one with room for its size class (so
        // that, once dropped, it serves the next request of that class).
        let mut data = match crate::pool::take(T::DTYPE, n) {
            Some(d) => d,
            None if n * T::DTYPE.size_in_bytes() < crate::pool::MIN_POOLED_BYTES => {
                return Ok(Tensor::from_storage(
                    shape,
                    T::wrap((0..n).map(f).collect()),
                ));
            }
            None => crate::pool::alloc_zeroed(T::DTYPE, n),
        };
        let v = T::view_mut(&mut data).expect("a buffer of T's dtype");
        v.iter_mut().enumerate().for_each(|(i, x)| *x = f(i));
        Ok(Tensor::from_storage(shape, data))
    }

    /// The extents, outermost first (`[]` for a scalar).
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// The number of dimensions, `shape().len()` (the tensor's rank, not a process rank).
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    /// The number of elements, the product of the extents (1 for a scalar).
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        match &self.storage {
            Storage::Cpu(b) => b.data.dtype(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.buffer().dtype(),
        }
    }
    /// The bytes this tensor's elements occupy, `numel · dtype size`; a view of a larger
    /// shared buffer counts only its own elements.
    pub fn size_in_bytes(&self) -> usize {
        self.numel() * self.dtype().size_in_bytes()
    }
    /// The storage this tensor views, which other tensors may share and which may hold
    /// more elements than this tensor uses.
    pub fn storage(&self) -> &Storage {
        &self.storage
    }
    /// The host buffer, or [`Error::NotOnHost`] naming `op` for a device tensor.
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn host_buffer(&self, op: &'static str) -> Result<&CpuBuffer> {
        match &self.storage {
            Storage::Cpu(b) => Ok(b),
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Err(not_on_host(op, s.device())),
        }
    }
    /// Whether both tensors view the same buffer (no copy was made between them).
    pub fn shares_storage_with(&self, other: &Tensor) -> bool {
        match (&self.storage, &other.storage) {
            (Storage::Cpu(a), Storage::Cpu(b)) => Arc::ptr_eq(a, b),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(a), Storage::Cuda(b)) => a.same_buffer(b),
            #[cfg(feature = "cuda")]
            _ => false,
        }
    }

    /// The whole buffer behind this tensor, as a 1-D tensor, and where this tensor's
    /// elements start in it, if no other tensor shares the buffer (else `self` back).
    /// In-place collectives use it: a shard that is a view into a full-size buffer is
    /// already where an all-gather wants it. Host buffers only: a device tensor comes back
    /// as it is (it is its whole buffer already).
    pub fn try_into_buffer(self) -> std::result::Result<(Tensor, usize), Tensor> {
        let len = match &self.storage {
            Storage::Cpu(b) if Arc::strong_count(b) == 1 => b.data.len(),
            _ => return Err(self),
        };
        let offset = self.offset;
        Ok((
            Tensor {
                shape: smallvec::smallvec![len],
                storage: self.storage,
                offset: 0,
            },
            offset,
        ))
    }

    /// The elements, copied into an owned host storage (what an asynchronous collective
    /// takes: it must own its buffer while the caller goes on). [`Error::NotOnHost`] for a
    /// device tensor.
    pub fn to_storage(&self) -> Result<CpuStorage> {
        Ok(match self.try_dyn_slice("Tensor::to_storage")? {
            Slice::F32(s) => CpuStorage::F32(s.to_vec()),
            Slice::F64(s) => CpuStorage::F64(s.to_vec()),
            Slice::BF16(s) => CpuStorage::BF16(s.to_vec()),
            Slice::F16(s) => CpuStorage::F16(s.to_vec()),
            Slice::I32(s) => CpuStorage::I32(s.to_vec()),
            Slice::I64(s) => CpuStorage::I64(s.to_vec()),
        })
    }

    /// A tensor of `shape` over `data` (no copy); `Err` unless the element counts agree.
    pub fn from_cpu_storage(shape: &[usize], data: CpuStorage) -> Result<Tensor> {
        if checked_numel(shape) != Some(data.len()) {
            return Err(Error::ShapeMismatch {
                op: "Tensor::from_cpu_storage",
                lhs: shape.into(),
                rhs: smallvec::smallvec![data.len()],
            });
        }
        Ok(Tensor::from_storage(shape, data))
    }

    /// A copy that owns its elements (no storage shared with `self`), on the same device.
    ///
    /// # Panics
    /// For a device tensor, if the device copy fails (a CUDA error: out of memory, a lost
    /// device); [`Tensor::try_deep_clone`] returns `Err` instead.
    pub fn deep_clone(&self) -> Tensor {
        or_panic(self.try_deep_clone())
    }

    /// [`Tensor::deep_clone`], or `Err` if a device copy fails. Never panics.
    pub fn try_deep_clone(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Storage::Cuda(_) = &self.storage {
            let mut c = self.cuda_tensor()?;
            c.make_unique()?;
            return Ok(Tensor::from(c));
        }
        Ok(self.host_deep_clone())
    }

    fn host_deep_clone(&self) -> Tensor {
        let mut out = Tensor::for_overwrite(&self.shape, self.dtype());
        let src = self.as_dyn_slice();
        with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| d
            .copy_from_slice(typed_as::<T>(src)));
        out
    }

    /// Makes the storage exclusively this tensor's (copying the visible elements if it is
    /// shared), so it can be written.
    ///
    /// # Panics
    /// On a device tensor (callers check the storage first).
    fn make_unique(&mut self) {
        let shared = match &mut self.storage {
            Storage::Cpu(b) => Arc::get_mut(b).is_none(),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => panic!("Tensor::make_unique: a host tensor was expected"),
        };
        if shared {
            *self = self.host_deep_clone();
        }
    }

    /// The host buffer, made exclusively this tensor's (copied if shared), with the range
    /// of this tensor's elements in it (read after the copy, which moves them to offset 0),
    /// or [`Error::NotOnHost`] naming `op` for a device tensor.
    fn host_buffer_mut(
        &mut self,
        op: &'static str,
    ) -> Result<(&mut CpuBuffer, std::ops::Range<usize>)> {
        self.host_buffer(op)?;
        self.make_unique();
        let range = self.offset..self.offset + self.numel();
        match &mut self.storage {
            Storage::Cpu(b) => Ok((Arc::get_mut(b).expect("made unique above"), range)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(_) => unreachable!("checked above to be host storage"),
        }
    }

    /// The elements as `&[T]`; `Err` if the dtype is not `T`, or [`Error::NotOnHost`] if
    /// the tensor is on a device (copy it with [`Tensor::to_host`] first).
    pub fn as_slice<T: StorageElement>(&self) -> Result<&[T]> {
        let all =
            T::view(&self.host_buffer("Tensor::as_slice")?.data).ok_or(Error::DTypeMismatch {
                op: "Tensor::as_slice",
                lhs: self.dtype(),
                rhs: T::DTYPE,
            })?;
        Ok(&all[self.offset..self.offset + self.numel()])
    }

    /// The elements as `&mut [T]`; `Err` if the dtype is not `T`, or [`Error::NotOnHost`]
    /// if the tensor is on a device. Copies first if the storage is shared with another
    /// tensor.
    pub fn as_mut_slice<T: StorageElement>(&mut self) -> Result<&mut [T]> {
        self.host_buffer("Tensor::as_mut_slice")?;
        let dtype = self.dtype();
        if dtype != T::DTYPE {
            return Err(Error::DTypeMismatch {
                op: "Tensor::as_mut_slice",
                lhs: dtype,
                rhs: T::DTYPE,
            });
        }
        let (buf, range) = self.host_buffer_mut("Tensor::as_mut_slice")?;
        let v = T::view_mut(&mut buf.data).expect("dtype checked above");
        Ok(&mut v[range])
    }

    /// The elements, converted to `f64` (for tests and reports). A device tensor is copied
    /// to the host first.
    ///
    /// # Panics
    /// If copying a device tensor to the host fails (a CUDA error).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        let host = host_copy(self);
        with_slice!(Slice, host.as_dyn_slice(), |s: T| s
            .iter()
            .map(|x| x.to_f64())
            .collect())
    }

    /// The elements as a dtype-erased host slice (what a host `Communicator` takes).
    ///
    /// # Panics
    /// Only on a device tensor (its elements are not in host memory); code that may hold
    /// one calls [`Tensor::try_as_dyn_slice`].
    pub fn as_dyn_slice(&self) -> Slice<'_> {
        self.try_dyn_slice("Tensor::as_dyn_slice")
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The elements as a dtype-erased host slice, or [`Error::NotOnHost`] for a device
    /// tensor ([`Tensor::device_view`] is its device twin).
    pub fn try_as_dyn_slice(&self) -> Result<Slice<'_>> {
        self.try_dyn_slice("Tensor::try_as_dyn_slice")
    }

    fn try_dyn_slice(&self, op: &'static str) -> Result<Slice<'_>> {
        let (o, n) = (self.offset, self.numel());
        let all = self.host_buffer(op)?.data.slice();
        Ok(with_slice!(Slice, all, |s: T| <T as Element>::slice(
            &s[o..o + n]
        )))
    }

    /// The elements as a mutable dtype-erased host slice. Copies first if the storage is
    /// shared.
    ///
    /// # Panics
    /// Only on a device tensor; code that may hold one calls
    /// [`Tensor::try_as_dyn_slice_mut`].
    pub fn as_dyn_slice_mut(&mut self) -> SliceMut<'_> {
        self.try_dyn_slice_mut("Tensor::as_dyn_slice_mut")
            .unwrap_or_else(|e| panic!("{e}"))
    }

    /// The elements as a mutable dtype-erased host slice (copied first if the storage is
    /// shared), or [`Error::NotOnHost`] for a device tensor ([`Tensor::device_view_mut`] is
    /// its device twin).
    pub fn try_as_dyn_slice_mut(&mut self) -> Result<SliceMut<'_>> {
        self.try_dyn_slice_mut("Tensor::try_as_dyn_slice_mut")
    }

    fn try_dyn_slice_mut(&mut self, op: &'static str) -> Result<SliceMut<'_>> {
        let (buf, range) = self.host_buffer_mut(op)?;
        Ok(with_slice!(SliceMut, buf.data.slice_mut(), |s: T| {
            <T as Element>::slice_mut(&mut s[range])
        }))
    }

    /// The same elements under another shape with the same element count.
    pub fn reshape(self, shape: &[usize]) -> Result<Tensor> {
        if checked_numel(shape) != Some(self.numel()) {
            return Err(Error::ShapeMismatch {
                op: "Tensor::reshape",
                lhs: self.shape,
                rhs: shape.into(),
            });
        }
        Ok(Tensor {
            shape: shape.into(),
            storage: self.storage,
            offset: self.offset,
        })
    }
}

/// Placement: which memory holds the elements, and moving them between host and device.
///
/// | call | host tensor | device tensor |
/// |---|---|---|
/// | [`device`](Tensor::device) / [`is_cuda`](Tensor::is_cuda) | `None` / false | `Some(dev)` / true |
/// | [`to_device`](Tensor::to_device)`(dev)` | copy to `dev` | same device: a clone (no copy); another: a copy |
/// | [`to_host`](Tensor::to_host) | a clone (no copy) | copy to the host (waits for queued work) |
/// | [`zeros_on`](Tensor::zeros_on)`(place, ..)`, [`zeros_like`](Tensor::zeros_like) | host zeros | zeros on the device |
/// | [`device_view`](Tensor::device_view) / [`device_view_mut`](Tensor::device_view_mut) | [`Error::NotOnDevice`] | views for the device collectives |
/// | [`cuda_tensor`](Tensor::cuda_tensor) / [`try_into_cuda`](Tensor::try_into_cuda) | `Err` / `Err(self)` | the `CudaTensor`, O(1) |
/// | `as_slice`, `as_mut_slice`, `try_as_dyn_slice(_mut)`, `to_storage` | the elements | [`Error::NotOnHost`] |
///
/// Without the `cuda` feature no [`cuda::Device`] can exist, so every tensor is on the host.
impl Tensor {
    /// The GPU holding the elements; `None` for host memory (always, without `cuda`).
    pub fn device(&self) -> Option<&cuda::Device> {
        match &self.storage {
            Storage::Cpu(_) => None,
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Some(s.device()),
        }
    }

    /// Whether the elements are in device memory.
    pub fn is_cuda(&self) -> bool {
        self.device().is_some()
    }

    /// Where the elements are, as errors name it: `"host"` or `"cuda:N"`.
    pub(crate) fn place(&self) -> String {
        match self.device() {
            None => "host".into(),
            Some(d) => format!("cuda:{}", d.ordinal()),
        }
    }

    /// The tensor in `dev`'s memory: a copy of a host tensor (queued on `dev`'s stream), the
    /// tensor itself (a clone, no copy) if it is on `dev` already, or a copy through the
    /// host if it is on another GPU. `Err` (never a panic) if a CUDA call fails.
    pub fn to_device(&self, dev: &cuda::Device) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        {
            match self.device() {
                None => Ok(Tensor::from(cuda::CudaTensor::from_host(dev, self)?)),
                Some(d) if d == dev => Ok(self.clone()),
                Some(_) => self.to_host()?.to_device(dev),
            }
        }
        #[cfg(not(feature = "cuda"))]
        dev.unreachable()
    }

    /// The tensor in host memory: itself (a clone, no copy) if it is there, else its
    /// elements copied from the device (waiting for the work queued before).
    pub fn to_host(&self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if self.is_cuda() {
            return self.cuda_tensor()?.to_host();
        }
        Ok(self.clone())
    }

    /// A tensor of zeros on `dev` (`Some`: that GPU's memory; `None`: host memory, as
    /// [`Tensor::try_zeros`]). `Err` if the shape has more elements than memory can hold or
    /// the device allocation fails; never a panic.
    pub fn zeros_on(dev: Option<&cuda::Device>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        const OP: &str = "Tensor::zeros_on";
        let Some(dev) = dev else {
            return Self::zeros_checked(OP, shape, dtype);
        };
        checked_len(OP, shape, dtype)?;
        #[cfg(feature = "cuda")]
        {
            cuda::CudaTensor::zeros(dev, shape, dtype).map(Tensor::from)
        }
        #[cfg(not(feature = "cuda"))]
        dev.unreachable()
    }

    /// Zeros of this tensor's shape and dtype, where this tensor is.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros_on(self.device(), &self.shape, self.dtype())
    }

    /// A view of the elements in device memory (what the `*_device` collectives take);
    /// [`Error::NotOnDevice`] for a host tensor.
    pub fn device_view(&self) -> Result<cuda::DeviceView<'_>> {
        const OP: &str = "Tensor::device_view";
        match &self.storage {
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => s.buffer().view(0..self.numel()),
            _ => Err(Error::NotOnDevice { op: OP }),
        }
    }

    /// A mutable view of the elements in device memory, for a collective to write in place;
    /// the buffer is copied first (on the device) if another tensor shares it, so the write
    /// does not show through that tensor. [`Error::NotOnDevice`] for a host tensor.
    pub fn device_view_mut(&mut self) -> Result<cuda::DeviceViewMut<'_>> {
        const OP: &str = "Tensor::device_view_mut";
        match &mut self.storage {
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => {
                let n = numel(&self.shape);
                s.buffer_mut()?.view_mut(0..n)
            }
            _ => Err(Error::NotOnDevice { op: OP }),
        }
    }

    /// The [`CudaTensor`](cuda::CudaTensor) of a device tensor, sharing its buffer (O(1), no
    /// copy; writes through either copy the buffer first). [`Error::NotOnDevice`] for a host
    /// tensor.
    pub fn cuda_tensor(&self) -> Result<cuda::CudaTensor> {
        const OP: &str = "Tensor::cuda_tensor";
        match &self.storage {
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => {
                debug_assert_eq!(
                    self.offset, 0,
                    "a device tensor starts at its buffer's start"
                );
                Ok(cuda::CudaTensor::from_parts(self.shape.clone(), s.clone()))
            }
            _ => Err(Error::NotOnDevice { op: OP }),
        }
    }

    /// The [`CudaTensor`](cuda::CudaTensor) a device tensor is (O(1)); a host tensor comes
    /// back as `Err(self)`.
    pub fn try_into_cuda(self) -> std::result::Result<cuda::CudaTensor, Tensor> {
        match self.storage {
            #[cfg(feature = "cuda")]
            Storage::Cuda(s) => Ok(cuda::CudaTensor::from_parts(self.shape, s)),
            _ => Err(self),
        }
    }

    /// A host tensor of no elements that allocates nothing: what an out-parameter holds
    /// while its device tensor is moved out (see `dispatch::with_cuda_mut`).
    #[cfg(feature = "cuda")]
    pub(crate) fn placeholder() -> Tensor {
        static EMPTY: std::sync::OnceLock<Arc<CpuBuffer>> = std::sync::OnceLock::new();
        let buf = EMPTY.get_or_init(|| {
            Arc::new(CpuBuffer {
                data: CpuStorage::F32(Vec::new()),
            })
        });
        Tensor {
            shape: smallvec::smallvec![0],
            storage: Storage::Cpu(buf.clone()),
            offset: 0,
        }
    }
}

/// A device [`Tensor`] over the same buffer (O(1), no copy).
impl From<cuda::CudaTensor> for Tensor {
    fn from(c: cuda::CudaTensor) -> Tensor {
        #[cfg(feature = "cuda")]
        {
            let (shape, storage) = c.into_parts();
            Tensor {
                shape,
                storage: Storage::Cuda(storage),
                offset: 0,
            }
        }
        #[cfg(not(feature = "cuda"))]
        c.unreachable()
    }
}

/// [`Error::NotOnHost`] for `op` on a tensor on `dev`.
#[cfg(feature = "cuda")]
fn not_on_host(op: &'static str, dev: &cuda::Device) -> Error {
    Error::NotOnHost {
        op,
        device: format!("cuda:{}", dev.ordinal()),
    }
}

/// Moves between host and device memory: the one place where a host [`Tensor`] and a
/// [`CudaTensor`](cuda::CudaTensor) meet, so that the device storage needs no host tensor.
#[cfg(feature = "cuda")]
impl cuda::CudaTensor {
    /// Copies a host tensor to the device (`Tensor::to_device`).
    pub fn from_host(dev: &Device, t: &Tensor) -> Result<CudaTensor> {
        const OP: &str = "Tensor::to_device";
        let st = dev.stream();
        macro_rules! up {
            ($s:expr, $v:ident) => {{
                let s = $s;
                if s.is_empty() {
                    st.alloc_zeros(1).map(CudaBuffer::$v)
                } else {
                    st.clone_htod(s).map(CudaBuffer::$v)
                }
            }};
        }
        let buf = match t.dtype() {
            DType::F32 => up!(t.as_slice::<f32>()?, F32),
            DType::F64 => up!(t.as_slice::<f64>()?, F64),
            DType::BF16 => up!(bytemuck::cast_slice::<bf16, u16>(t.as_slice()?), BF16),
            DType::F16 => up!(bytemuck::cast_slice::<f16, u16>(t.as_slice()?), F16),
            DType::I32 => up!(t.as_slice::<i32>()?, I32),
            DType::I64 => up!(t.as_slice::<i64>()?, I64),
        }
        .map_err(|e| driver_err(OP, e))?;
        Ok(CudaTensor {
            shape: t.shape().into(),
            buf: Arc::new(buf),
            dev: dev.clone(),
        })
    }

    /// Copies the tensor back to the host (waits for the ops queued before it).
    pub fn to_host(&self) -> Result<Tensor> {
        const OP: &str = "CudaTensor::to_host";
        let n = self.numel();
        let st = self.dev.stream();
        macro_rules! down {
            ($s:expr) => {{
                let mut v = st.clone_dtoh($s).map_err(|e| driver_err(OP, e))?;
                v.truncate(n);
                Tensor::from_vec(v, &self.shape)
            }};
        }
        macro_rules! down16 {
            ($s:expr, $t:ty) => {{
                let mut v = st.clone_dtoh($s).map_err(|e| driver_err(OP, e))?;
                v.truncate(n);
                let v: Vec<$t> = v.into_iter().map(<$t>::from_bits).collect();
                Tensor::from_vec(v, &self.shape)
            }};
        }
        match &*self.buf {
            CudaBuffer::F32(s) => down!(s),
            CudaBuffer::F64(s) => down!(s),
            CudaBuffer::BF16(s) => down16!(s, bf16),
            CudaBuffer::F16(s) => down16!(s, f16),
            CudaBuffer::I32(s) => down!(s),
            CudaBuffer::I64(s) => down!(s),
        }
    }
}

#[cfg(feature = "cuda")]
impl Tensor {
    /// This host tensor copied into a new buffer on `dev` (what [`Tensor::to_device`] does
    /// for a host tensor), as a [`CudaTensor`].
    pub(crate) fn upload(&self, dev: &Device) -> Result<CudaTensor> {
        CudaTensor::from_host(dev, self)
    }
}
