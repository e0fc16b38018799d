//! The local dense tensor a rank holds: a shape, a dtype and contiguous row-major storage.

use crate::dtype::{DType, Element, Slice, SliceMut};
use crate::error::{Error, Result};
use crate::{cuda, with_slice, Shape};
use half::{bf16, f16};
use smallvec::SmallVec;
use std::sync::Arc;

/// Contiguous row-major elements of one dtype, in host memory.
#[derive(Clone, Debug, PartialEq)]
pub enum CpuStorage {
    /// Elements of [`DType::F32`].
    F32(Vec<f32>),
    /// Elements of [`DType::F64`].
    F64(Vec<f64>),
    /// Elements of [`DType::BF16`].
    BF16(Vec<bf16>),
    /// Elements of [`DType::F16`].
    F16(Vec<f16>),
    /// Elements of [`DType::I32`].
    I32(Vec<i32>),
    /// Elements of [`DType::I64`].
    I64(Vec<i64>),
}

/// A host buffer shared by the tensors that view it. When the last view drops it, the
/// buffer goes back to the thread's pool (see [`crate::pool`]).
#[derive(Debug)]
pub struct CpuBuffer {
    data: CpuStorage,
}

impl CpuBuffer {
    /// The whole buffer's elements; a tensor viewing it may use only a run of them (from
    /// its offset, `numel` long).
    pub fn data(&self) -> &CpuStorage {
        &self.data
    }
}

impl CpuBuffer {
    fn new(data: CpuStorage) -> Self {
        let size = data.dtype().size_in_bytes();
        crate::memory::on_alloc(data.len() * size, data.capacity() * size);
        CpuBuffer { data }
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        let data = std::mem::replace(&mut self.data, CpuStorage::F32(Vec::new()));
        let size = data.dtype().size_in_bytes();
        crate::memory::on_free(data.len() * size, data.capacity() * size);
        crate::pool::recycle(data);
    }
}

/// Where a tensor's elements live: host memory, or (feature `cuda`) one GPU's memory.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub enum Storage {
    /// Host memory, shared by reference count among the tensors that view it.
    Cpu(Arc<CpuBuffer>),
    /// Device memory of one GPU, shared by reference count like `Cpu`; a device tensor
    /// starts at element 0 of its buffer.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::CudaStorage),
}

/// Maps an element type to its `CpuStorage` variant and back.
pub trait StorageElement: Element {
    /// Wraps the elements as the [`CpuStorage`] variant of this type (no copy).
    fn wrap(v: Vec<Self>) -> CpuStorage;
    /// The elements, if `s` holds this type; `None` for any other variant.
    fn view(s: &CpuStorage) -> Option<&[Self]>;
    /// The vector itself (so its length can change), if `s` holds this type; `None` for
    /// any other variant.
    fn view_mut(s: &mut CpuStorage) -> Option<&mut Vec<Self>>;
}

macro_rules! storage_element {
    ($t:ty, $v:ident) => {
        impl StorageElement for $t {
            fn wrap(v: Vec<Self>) -> CpuStorage {
                CpuStorage::$v(v)
            }
            fn view(s: &CpuStorage) -> Option<&[Self]> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
            fn view_mut(s: &mut CpuStorage) -> Option<&mut Vec<Self>> {
                match s {
                    CpuStorage::$v(v) => Some(v),
                    _ => None,
                }
            }
        }
    };
}
storage_element!(f32, F32);
storage_element!(f64, F64);
storage_element!(bf16, BF16);
storage_element!(f16, F16);
storage_element!(i32, I32);
storage_element!(i64, I64);

impl CpuStorage {
    /// The element type (which variant this is).
    pub fn dtype(&self) -> DType {
        self.slice().dtype()
    }
    /// The number of elements stored (not bytes, not the capacity).
    pub fn len(&self) -> usize {
        self.slice().len()
    }
    /// True if no elements are stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Elements the buffer can hold without reallocating (what it occupies).
    pub fn capacity(&self) -> usize {
        match self {
            CpuStorage::F32(v) => v.capacity(),
            CpuStorage::F64(v) => v.capacity(),
            CpuStorage::BF16(v) => v.capacity(),
            CpuStorage::F16(v) => v.capacity(),
            CpuStorage::I32(v) => v.capacity(),
            CpuStorage::I64(v) => v.capacity(),
        }
    }
    /// Truncates to `n` elements, or grows to `n` with zeros (within the capacity when it
    /// suffices, as for a pooled buffer).
    pub(crate) fn set_len(&mut self, n: usize) {
        match self {
            CpuStorage::F32(v) => v.resize(n, 0.0),
            CpuStorage::F64(v) => v.resize(n, 0.0),
            CpuStorage::BF16(v) => v.resize(n, bf16::ZERO),
            CpuStorage::F16(v) => v.resize(n, f16::ZERO),
            CpuStorage::I32(v) => v.resize(n, 0),
            CpuStorage::I64(v) => v.resize(n, 0),
        }
    }
    /// Frees the buffer after shrinking it in place to one element.
    ///
    /// For glibc: freeing a large buffer the allocator had `mmap`ped raises its `mmap`
    /// threshold (up to 32 MiB) to that size for good, and from then on buffers of that
    /// size come from the thread's arena, whose freed pages it keeps resident. Shrunk
    /// first, the buffer's pages go back to the system with `mremap` and the one page left
    /// is freed below the threshold, which stays where it was. For a buffer in an arena it
    /// costs a split of the chunk. The pool frees the buffers it lets go this way.
    pub(crate) fn free_shrunk(self) {
        fn shrink<T>(mut v: Vec<T>) {
            v.clear();
            v.shrink_to(1);
        }
        match self {
            CpuStorage::F32(v) => shrink(v),
            CpuStorage::F64(v) => shrink(v),
            CpuStorage::BF16(v) => shrink(v),
            CpuStorage::F16(v) => shrink(v),
            CpuStorage::I32(v) => shrink(v),
            CpuStorage::I64(v) => shrink(v),
        }
    }
    pub(crate) fn zeros(dtype: DType, n: usize) -> Self {
        match dtype {
            DType::F32 => CpuStorage::F32(vec![0.0; n]),
            DType::F64 => CpuStorage::F64(vec![0.0; n]),
            DType::BF16 => CpuStorage::BF16(vec![bf16::ZERO; n]),
            DType::F16 => CpuStorage::F16(vec![f16::ZERO; n]),
            DType::I32 => CpuStorage::I32(vec![0; n]),
            DType::I64 => CpuStorage::I64(vec![0; n]),
        }
    }
    fn slice(&self) -> Slice<'_> {
        match self {
            CpuStorage::F32(v) => Slice::F32(v),
            CpuStorage::F64(v) => Slice::F64(v),
            CpuStorage::BF16(v) => Slice::BF16(v),
            CpuStorage::F16(v) => Slice::F16(v),
            CpuStorage::I32(v) => Slice::I32(v),
            CpuStorage::I64(v) => Slice::I64(v),
        }
    }
    fn slice_mut(&mut self) -> SliceMut<'_> {
        match self {
            CpuStorage::F32(v) => SliceMut::F32(v),
            CpuStorage::F64(v) => SliceMut::F64(v),
            CpuStorage::BF16(v) => SliceMut::BF16(v),
            CpuStorage::F16(v) => SliceMut::F16(v),
            CpuStorage::I32(v) => SliceMut::I32(v),
            CpuStorage::I64(v) => SliceMut::I64(v),
        }
    }
}

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
    shape: Shape,
    storage: Storage,
    offset: usize,
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

/// Product of the extents (1 for a scalar).
///
/// # Panics
/// If the product of the non-zero extents overflows `usize` (see [`checked_numel`]). Never
/// for the shape of a [`Tensor`], whose constructors reject such shapes.
pub fn numel(shape: &[usize]) -> usize {
    checked_numel(shape)
        .unwrap_or_else(|| panic!("numel: shape {shape:?} has more elements than usize holds"))
}

/// Product of the extents (1 for a scalar), or `None` if the product of the non-zero
/// extents overflows `usize`.
///
/// Stricter than the plain product on purpose: `[2^40, 2^40, 0]` has 0 elements, but the
/// kernels multiply subsets of extents (rows × cols, `m·k`, outer × inner), and those must
/// not overflow either. Every shape accepted here has every such sub-product in range.
pub fn checked_numel(shape: &[usize]) -> Option<usize> {
    let nonzero = shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))?;
    Some(if shape.contains(&0) { 0 } else { nonzero })
}

/// The element count of a new tensor of `shape` and `dtype`, or `Err` if it overflows
/// ([`checked_numel`]) or its bytes exceed `isize::MAX` (the most any allocation can hold,
/// so that a later `Vec` allocation cannot hit its own "capacity overflow" panic).
fn checked_len(op: &'static str, shape: &[usize], dtype: DType) -> Result<usize> {
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
fn or_panic(r: Result<Tensor>) -> Tensor {
    r.unwrap_or_else(|e| panic!("{e}"))
}

/// Sum of piece extents, or `None` if it overflows.
fn checked_sum(sizes: &[usize]) -> Option<usize> {
    sizes.iter().try_fold(0usize, |a, &s| a.checked_add(s))
}

/// `Err` unless `dim` is a dim of `shape` and the piece extents `sizes` add up to its extent
/// (the pieces of [`Tensor::pack`] and [`Tensor::split`]).
pub(crate) fn check_pieces(
    op: &'static str,
    shape: &[usize],
    dim: usize,
    sizes: &[usize],
) -> Result<()> {
    if dim >= shape.len() {
        return Err(Error::DimOutOfRange {
            op,
            dim,
            shape: shape.into(),
        });
    }
    // Checked: wrapped sizes could add up to the extent and make runs past the buffer.
    if checked_sum(sizes) != Some(shape[dim]) {
        return Err(Error::Invalid {
            op,
            detail: format!(
                "sizes {sizes:?} do not add up to extent {} of dim {dim} in shape {shape:?}",
                shape[dim]
            ),
        });
    }
    Ok(())
}

/// The elements of a buffer whose dtype the caller checked to be `T`'s.
///
/// # Panics
/// If it is not (an internal invariant).
fn typed_as<T: Element>(s: Slice<'_>) -> &[T] {
    s.typed()
        .expect("dtype checked by the caller to be the destination's")
}

impl Tensor {
    fn from_storage(shape: &[usize], data: CpuStorage) -> Tensor {
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

    fn for_overwrite_checked(op: &'static str, shape: &[usize], dtype: DType) -> Result<Self> {
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

    /// `values` (row-major, `shape`) rounded once into `dtype` (no copy for `F64`): what a
    /// kernel that computes in f64 returns.
    pub fn from_f64_vec(values: Vec<f64>, shape: &[usize], dtype: DType) -> Result<Tensor> {
        let t = Tensor::from_vec(values, shape)?;
        Ok(if dtype == DType::F64 {
            t
        } else {
            t.to_dtype(dtype)
        })
    }

    /// A copy with every element converted to `dtype` (through `f64`), on the same device.
    ///
    /// # Panics
    /// For a device tensor, if the kernel fails (a CUDA error); [`Tensor::try_to_dtype`]
    /// returns `Err` instead.
    pub fn to_dtype(&self, dtype: DType) -> Tensor {
        or_panic(self.try_to_dtype(dtype))
    }

    /// [`Tensor::to_dtype`], or `Err` if a device kernel fails. Never panics.
    pub fn try_to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let x = self;
        dispatch!("Tensor::to_dtype", [x] => cuda::ops::to_dtype(&x, dtype));
        Ok(self.host_to_dtype(dtype))
    }

    fn host_to_dtype(&self, dtype: DType) -> Tensor {
        let vals = self.to_f64_vec();
        let mut out = Tensor::for_overwrite(&self.shape, dtype);
        with_slice!(SliceMut, out.as_dyn_slice_mut(), |s: T| {
            for (d, v) in s.iter_mut().zip(&vals) {
                *d = <T as Element>::from_f64(*v);
            }
        });
        out
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

    fn check_dim(&self, op: &'static str, dim: usize) -> Result<()> {
        if dim >= self.rank() {
            return Err(Error::DimOutOfRange {
                op,
                dim,
                shape: self.shape.clone(),
            });
        }
        Ok(())
    }

    /// `(outer, extent, inner)`: the tensor seen as `[outer, shape[dim], inner]`.
    fn split_at_dim(&self, dim: usize) -> (usize, usize, usize) {
        let outer = numel(&self.shape[..dim]);
        let inner = numel(&self.shape[dim + 1..]);
        (outer, self.shape[dim], inner)
    }

    /// Elements `start..start + len` along `dim`, copied into a new tensor.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        self.check_dim("Tensor::narrow", dim)?;
        // Checked: a wrapping `start + len` would pass and make a view outside this one.
        if start
            .checked_add(len)
            .is_none_or(|end| end > self.shape[dim])
        {
            return Err(Error::Invalid {
                op: "Tensor::narrow",
                detail: format!(
                    "range {start}..{start}+{len} exceeds extent {} of dim {dim} in shape {:?}",
                    self.shape[dim], self.shape
                ),
            });
        }
        let x = self;
        // A device tensor starts at its buffer's start, so every narrow of it copies.
        dispatch!("Tensor::narrow", [x] => cuda::ops::narrow(&x, dim, start, len));
        let (outer, extent, inner) = self.split_at_dim(dim);
        let mut shape = self.shape.clone();
        shape[dim] = len;
        if outer == 1 {
            // The range is contiguous: a view, no copy.
            return Ok(Tensor {
                shape,
                storage: self.storage.clone(),
                offset: self.offset + start * inner,
            });
        }
        let mut out = Tensor::for_overwrite(&shape, self.dtype());
        copy_blocks(
            self.as_dyn_slice(),
            out.as_dyn_slice_mut(),
            outer,
            len * inner,
            extent * inner,
            start * inner,
            len * inner,
            0,
        );
        Ok(out)
    }

    /// Splits `dim` into pieces of the given extents (which must add up to the extent),
    /// in one pass, returning one tensor per piece.
    pub fn split(&self, dim: usize, sizes: &[usize]) -> Result<Vec<Tensor>> {
        self.check_pieces("Tensor::split", dim, sizes)?;
        let mut start = 0;
        sizes
            .iter()
            .map(|&len| {
                let t = self.narrow(dim, start, len);
                start += len;
                t
            })
            .collect()
    }

    /// `torch.chunk` along `dim` into `parts` pieces, all of them returned (trailing ones
    /// short or empty): chunk `i` covers `[min(i·c, n), min((i+1)·c, n))` with `c = ⌈n/parts⌉`.
    pub fn chunk(&self, dim: usize, parts: usize) -> Result<Vec<Tensor>> {
        self.check_dim("Tensor::chunk", dim)?;
        if parts == 0 {
            return Err(Error::Invalid {
                op: "Tensor::chunk",
                detail: "cannot chunk into 0 parts".into(),
            });
        }
        let sizes = chunk_sizes(self.shape[dim], parts);
        self.split(dim, &sizes)
    }

    /// Concatenates tensors along `dim`. All must share dtype, every other extent and the
    /// place (host, or one GPU).
    pub fn cat(tensors: &[Tensor], dim: usize) -> Result<Tensor> {
        const OP: &str = "Tensor::cat";
        let first = tensors.first().ok_or(Error::Invalid {
            op: "Tensor::cat",
            detail: "no tensors to concatenate".into(),
        })?;
        let refs: SmallVec<[&Tensor; 8]> = tensors.iter().collect();
        if crate::dispatch::on_cuda(OP, &refs)? {
            return Self::cat_cuda(tensors, dim);
        }
        first.check_dim("Tensor::cat", dim)?;
        for t in tensors {
            if t.dtype() != first.dtype() {
                return Err(Error::DTypeMismatch {
                    op: "Tensor::cat",
                    lhs: first.dtype(),
                    rhs: t.dtype(),
                });
            }
            let same_rest = t.rank() == first.rank()
                && (0..t.rank()).all(|d| d == dim || t.shape[d] == first.shape[d]);
            if !same_rest {
                return Err(Error::ShapeMismatch {
                    op: "Tensor::cat",
                    lhs: first.shape.clone(),
                    rhs: t.shape.clone(),
                });
            }
        }
        let mut shape = first.shape.clone();
        let extents: SmallVec<[usize; 8]> = tensors.iter().map(|t| t.shape[dim]).collect();
        shape[dim] = checked_sum(&extents).ok_or_else(|| Error::Invalid {
            op: "Tensor::cat",
            detail: format!("extents {extents:?} of dim {dim} overflow usize when added"),
        })?;
        let mut out = Tensor::for_overwrite_checked("Tensor::cat", &shape, first.dtype())?;
        let (outer, total, inner) = out.split_at_dim(dim);
        let mut offset = 0;
        for t in tensors {
            let len = t.shape[dim];
            copy_blocks(
                t.as_dyn_slice(),
                out.as_dyn_slice_mut(),
                outer,
                len * inner,
                len * inner,
                0,
                total * inner,
                offset * inner,
            );
            offset += len;
        }
        Ok(out)
    }

    #[cfg(feature = "cuda")]
    fn cat_cuda(tensors: &[Tensor], dim: usize) -> Result<Tensor> {
        let cs = tensors
            .iter()
            .map(Tensor::cuda_tensor)
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&cuda::CudaTensor> = cs.iter().collect();
        cuda::ops::cat(&refs, dim).map(Tensor::from)
    }

    #[cfg(not(feature = "cuda"))]
    fn cat_cuda(tensors: &[Tensor], _dim: usize) -> Result<Tensor> {
        unreachable!("{} host tensors reported as device tensors", tensors.len())
    }

    /// Packs the pieces of `dim` (extents `sizes`) one after another into a flat buffer of the
    /// same element count, piece 0 first: the send layout of an all-to-all or
    /// reduce-scatter along `dim`. One pass over memory.
    pub fn pack(&self, dim: usize, sizes: &[usize]) -> Result<Tensor> {
        self.check_pieces("Tensor::pack", dim, sizes)?;
        let x = self;
        dispatch!("Tensor::pack", [x] => cuda::ops::pack(&x, dim, sizes));
        let (outer, extent, inner) = self.split_at_dim(dim);
        let mut out = Tensor::for_overwrite(&[self.numel()], self.dtype());
        let src = self.as_dyn_slice();
        with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| {
            let s: &[T] = typed_as(src);
            piece_runs(outer, extent, inner, sizes, |t, p, run| {
                d[p..p + run].copy_from_slice(&s[t..t + run])
            });
        });
        Ok(out)
    }

    /// The inverse of [`Tensor::pack`]: `flat` holds pieces one after another, piece `i` of
    /// shape `shape` with extent `sizes[i]` on `dim`; returns them concatenated along `dim`.
    /// One pass over memory.
    pub fn unpack(flat: &Tensor, shape: &[usize], dim: usize, sizes: &[usize]) -> Result<Tensor> {
        if dim >= shape.len()
            || checked_numel(shape) != Some(flat.numel())
            || checked_sum(sizes) != Some(shape[dim])
        {
            return Err(Error::Invalid {
                op: "Tensor::unpack",
                detail: format!(
                    "{} packed elements with piece sizes {sizes:?} do not fill shape {shape:?} on dim {dim}",
                    flat.numel()
                ),
            });
        }
        dispatch!("Tensor::unpack", [flat] => cuda::ops::unpack(&flat, shape, dim, sizes));
        let inner: usize = numel(&shape[dim + 1..]);
        let outer: usize = numel(&shape[..dim]);
        let extent = shape[dim];
        let mut out = Tensor::for_overwrite(shape, flat.dtype());
        let src = flat.as_dyn_slice();
        with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| {
            let s: &[T] = typed_as(src);
            piece_runs(outer, extent, inner, sizes, |t, p, run| {
                d[t..t + run].copy_from_slice(&s[p..p + run])
            });
        });
        Ok(out)
    }

    fn check_pieces(&self, op: &'static str, dim: usize, sizes: &[usize]) -> Result<()> {
        check_pieces(op, &self.shape, dim, sizes)
    }

    fn check_same(&self, op: &'static str, other: &Tensor) -> Result<()> {
        if self.dtype() != other.dtype() {
            return Err(Error::DTypeMismatch {
                op,
                lhs: self.dtype(),
                rhs: other.dtype(),
            });
        }
        if self.shape != other.shape {
            return Err(Error::ShapeMismatch {
                op,
                lhs: self.shape.clone(),
                rhs: other.shape.clone(),
            });
        }
        Ok(())
    }

    /// Elementwise `self + other`.
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        self.check_same("Tensor::add", other)?;
        let a = self;
        dispatch!("Tensor::add", [a, other] => cuda::ops::add(&a, &other));
        let mut out = self.clone();
        out.add_assign(other)?;
        Ok(out)
    }

    /// Elementwise `self += other`. On a device the sum is a new buffer that replaces this
    /// tensor's (other tensors sharing the old one keep their values, as with copy on
    /// write).
    pub fn add_assign(&mut self, other: &Tensor) -> Result<()> {
        self.check_same("Tensor::add", other)?;
        let dst = self;
        dispatch!("Tensor::add", mut dst, [other] => {
            let sum = cuda::ops::add(dst, &other)?;
            *dst = sum;
            Ok(())
        });
        let src = other.as_dyn_slice();
        with_slice!(SliceMut, dst.as_dyn_slice_mut(), |d: T| {
            let s: &[T] = typed_as(src);
            for (a, &b) in d.iter_mut().zip(s) {
                *a = a.add(b);
            }
        });
        Ok(())
    }

    /// Every element multiplied by `factor` (rounded once into the dtype).
    ///
    /// # Panics
    /// For a device tensor, if the kernel fails (a CUDA error); [`Tensor::try_scale`]
    /// returns `Err` instead.
    pub fn scale(&self, factor: f64) -> Tensor {
        or_panic(self.try_scale(factor))
    }

    /// [`Tensor::scale`], or `Err` if a device kernel fails. Never panics.
    pub fn try_scale(&self, factor: f64) -> Result<Tensor> {
        let x = self;
        dispatch!("Tensor::scale", [x] => cuda::ops::scale(&x, factor));
        let mut out = self.clone();
        with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| {
            let f = <T as Element>::from_f64(factor);
            for a in d.iter_mut() {
                *a = a.mul(f);
            }
        });
        Ok(out)
    }

    /// Every element mapped through `f` (evaluated in `f64`, rounded once into the dtype).
    ///
    /// # Panics
    /// On a device tensor (a host closure cannot run there); [`Tensor::try_map`] returns
    /// [`Error::NotOnCuda`] instead.
    pub fn map(&self, f: impl Fn(f64) -> f64) -> Tensor {
        or_panic(self.try_map(f))
    }

    /// [`Tensor::map`], or [`Error::NotOnCuda`] for a device tensor. Never panics (unless
    /// `f` does).
    pub fn try_map(&self, f: impl Fn(f64) -> f64) -> Result<Tensor> {
        crate::dispatch::host_only("Tensor::map", &[self])?;
        let mut out = self.clone();
        with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| {
            for a in d.iter_mut() {
                *a = <T as Element>::from_f64(f(a.to_f64()));
            }
        });
        Ok(out)
    }

    /// Elementwise `self * other`.
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        self.check_same("Tensor::mul", other)?;
        let a = self;
        dispatch!("Tensor::mul", [a, other] => cuda::ops::mul(&a, &other));
        let mut out = self.clone();
        let src = other.as_dyn_slice();
        with_slice!(SliceMut, out.as_dyn_slice_mut(), |d: T| {
            let s: &[T] = typed_as(src);
            for (a, &b) in d.iter_mut().zip(s) {
                *a = a.mul(b);
            }
        });
        Ok(out)
    }

    /// Writes `src` into `self` at offset `start` along `dim` (the other extents must match).
    pub fn write_at(&mut self, dim: usize, start: usize, src: &Tensor) -> Result<()> {
        self.check_dim("Tensor::write_at", dim)?;
        let fits = src.rank() == self.rank()
            && src.dtype() == self.dtype()
            && start
                .checked_add(src.shape[dim])
                .is_some_and(|end| end <= self.shape[dim])
            && (0..self.rank()).all(|d| d == dim || src.shape[d] == self.shape[d]);
        if !fits {
            return Err(Error::ShapeMismatch {
                op: "Tensor::write_at",
                lhs: self.shape.clone(),
                rhs: src.shape.clone(),
            });
        }
        let dst = self;
        dispatch!("Tensor::write_at", mut dst, [src] => cuda::ops::write_at(dst, dim, start, &src));
        let (outer, extent, inner) = dst.split_at_dim(dim);
        let len = src.shape[dim];
        copy_blocks(
            src.as_dyn_slice(),
            dst.as_dyn_slice_mut(),
            outer,
            len * inner,
            len * inner,
            0,
            extent * inner,
            start * inner,
        );
        Ok(())
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

/// The contiguous runs of the pieces of a dim (extents `sizes`) in a tensor seen as
/// `[outer, extent, inner]`, piece by piece: `f(offset in the tensor, offset in the packed
/// buffer, length)`. Pack copies tensor → buffer along these runs, unpack the reverse.
fn piece_runs(
    outer: usize,
    extent: usize,
    inner: usize,
    sizes: &[usize],
    mut f: impl FnMut(usize, usize, usize),
) {
    let (mut piece_base, mut start) = (0, 0);
    for &len in sizes {
        let run = len * inner;
        for o in 0..outer {
            f((o * extent + start) * inner, piece_base + o * run, run);
        }
        piece_base += outer * run;
        start += len;
    }
}

/// Sizes of `torch.chunk(n, parts)`, padded with zeros to `parts` entries.
pub fn chunk_sizes(n: usize, parts: usize) -> SmallVec<[usize; 8]> {
    let c = n.div_ceil(parts.max(1));
    // Saturating: `c · parts` may pass `usize::MAX` for `n` near it, and is clamped to `n`.
    (0..parts)
        .map(|i| {
            c.saturating_mul(i + 1)
                .min(n)
                .saturating_sub(c.saturating_mul(i).min(n))
        })
        .collect()
}

/// Copies `blocks` runs of `run` elements from `src` (stride `src_stride`, start
/// `src_off`) to `dst` (stride `dst_stride`, start `dst_off`). Both must share a dtype.
#[allow(clippy::too_many_arguments)]
fn copy_blocks(
    src: Slice<'_>,
    dst: SliceMut<'_>,
    blocks: usize,
    run: usize,
    src_stride: usize,
    src_off: usize,
    dst_stride: usize,
    dst_off: usize,
) {
    if run == 0 {
        return;
    }
    with_slice!(SliceMut, dst, |d: T| {
        let s: &[T] = typed_as(src);
        for b in 0..blocks {
            let so = src_off + b * src_stride;
            let d_o = dst_off + b * dst_stride;
            d[d_o..d_o + run].copy_from_slice(&s[so..so + run]);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iota(shape: &[usize]) -> Tensor {
        Tensor::from_fn(shape, |i| i as f32)
    }

    #[test]
    fn chunk_sizes_follow_torch_chunk() {
        assert_eq!(chunk_sizes(10, 4).as_slice(), &[3, 3, 3, 1]);
        assert_eq!(chunk_sizes(9, 4).as_slice(), &[3, 3, 3, 0]);
        assert_eq!(chunk_sizes(5, 4).as_slice(), &[2, 2, 1, 0]);
        assert_eq!(chunk_sizes(2, 4).as_slice(), &[1, 1, 0, 0]);
        assert_eq!(chunk_sizes(8, 4).as_slice(), &[2, 2, 2, 2]);
        assert_eq!(chunk_sizes(0, 3).as_slice(), &[0, 0, 0]);
    }

    #[test]
    fn chunk_then_cat_round_trips_on_every_dim() {
        let t = iota(&[3, 5, 7]);
        for dim in 0..3 {
            for parts in 1..6 {
                let pieces = t.chunk(dim, parts).unwrap();
                assert_eq!(pieces.len(), parts);
                assert_eq!(Tensor::cat(&pieces, dim).unwrap(), t);
            }
        }
    }

    #[test]
    fn narrow_middle_dim_picks_the_right_elements() {
        let t = iota(&[2, 3, 2]);
        let n = t.narrow(1, 1, 2).unwrap();
        assert_eq!(n.shape(), &[2, 2, 2]);
        assert_eq!(
            n.as_slice::<f32>().unwrap(),
            &[2.0, 3.0, 4.0, 5.0, 8.0, 9.0, 10.0, 11.0]
        );
    }

    #[test]
    fn pack_unpack_round_trips() {
        let t = iota(&[4, 5, 3]);
        let sizes = [2, 2, 1, 0];
        let flat = t.pack(1, &sizes).unwrap();
        assert_eq!(flat.shape(), &[60]);
        // piece 0 = columns 0..2 of every row, contiguous
        assert_eq!(
            &flat.as_slice::<f32>().unwrap()[..6],
            &[0., 1., 2., 3., 4., 5.]
        );
        let back = Tensor::unpack(&flat, t.shape(), 1, &sizes).unwrap();
        assert_eq!(back, t);
    }

    #[test]
    fn add_rejects_mismatched_shapes_and_dtypes() {
        let a = iota(&[2, 2]);
        let b = iota(&[4]);
        assert!(matches!(
            a.add(&b),
            Err(Error::ShapeMismatch {
                op: "Tensor::add",
                ..
            })
        ));
        let c = a.to_dtype(DType::F64);
        assert!(matches!(
            a.add(&c),
            Err(Error::DTypeMismatch {
                op: "Tensor::add",
                ..
            })
        ));
    }

    #[test]
    fn add_and_scale_compute_elementwise() {
        let a = iota(&[3]);
        let b = a.add(&a).unwrap().scale(0.5);
        assert_eq!(b, a);
        let h = a.to_dtype(DType::BF16).scale(2.0);
        assert_eq!(h.to_f64_vec(), vec![0.0, 2.0, 4.0]);
    }

    #[test]
    fn narrow_of_leading_dim_is_a_view_and_writes_copy() {
        let t = iota(&[4, 3]);
        let mut v = t.narrow(0, 1, 2).unwrap();
        assert!(v.shares_storage_with(&t));
        assert_eq!(v.as_slice::<f32>().unwrap(), &[3., 4., 5., 6., 7., 8.]);
        // Writing through the view copies it first: `t` keeps its values.
        v.as_mut_slice::<f32>().unwrap()[0] = 100.0;
        assert!(!v.shares_storage_with(&t));
        assert_eq!(t.as_slice::<f32>().unwrap()[3], 3.0);
        assert_eq!(v.as_slice::<f32>().unwrap()[..2], [100.0, 4.0]);
        // A middle-dim narrow is not contiguous, so it copies.
        let m = t.narrow(1, 1, 1).unwrap();
        assert!(!m.shares_storage_with(&t));
        assert_eq!(m.as_slice::<f32>().unwrap(), &[1., 4., 7., 10.]);
    }

    #[test]
    fn try_into_buffer_gives_the_whole_buffer_only_when_unshared() {
        let t = iota(&[4, 3]);
        let v = t.narrow(0, 2, 1).unwrap();
        let v = v.try_into_buffer().unwrap_err(); // `t` still shares it
        drop(t);
        let (buf, off) = v.try_into_buffer().unwrap();
        assert_eq!((buf.shape(), off), (&[12][..], 6));
        assert_eq!(buf.as_slice::<f32>().unwrap()[11], 11.0);
    }

    #[test]
    fn dropped_large_buffers_are_reused_on_the_same_thread() {
        std::thread::spawn(|| {
            // 4 MiB of f32; 4 KiB under Miri (which pools from 1 KiB on), where 4 MiB takes
            // longer than a test run should.
            let n = if cfg!(miri) { 1 << 10 } else { 1 << 20 };
            let a = Tensor::from_fn(&[n], |i| i as f32);
            drop(a);
            assert_eq!(crate::pool::cached_bytes(), n * 4);
            let b = Tensor::for_overwrite(&[n], DType::F32);
            assert_eq!(
                crate::pool::cached_bytes(),
                0,
                "the cached buffer was handed out"
            );
            assert_eq!(b.numel(), n);
            let z = {
                drop(b);
                Tensor::zeros(&[n], DType::F32)
            };
            assert!(
                z.as_slice::<f32>().unwrap().iter().all(|&x| x == 0.0),
                "zeros clears a reused buffer"
            );
            // A much smaller request does not take a big buffer.
            drop(z);
            let small = Tensor::for_overwrite(&[n / 4], DType::F32);
            assert_eq!(crate::pool::cached_bytes(), n * 4);
            drop(small);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn errors_name_the_op() {
        let t = iota(&[2, 3]);
        let e = t.narrow(2, 0, 1).unwrap_err();
        assert!(e.to_string().contains("Tensor::narrow"), "{e}");
        let e = Tensor::from_vec(vec![1.0f32; 5], &[2, 3]).unwrap_err();
        assert!(e.to_string().contains("Tensor::from_vec"), "{e}");
        assert!(t.chunk(0, 0).is_err());
        assert!(t.split(1, &[1, 1]).is_err());
    }

    // Shape arithmetic (the audit's P2 and P5). The test profile has overflow checks on, so
    // an unchecked product or sum would panic with "attempt to ... with overflow" instead
    // of returning the `Err` these tests expect: they pass only through the checked path.

    /// 2^33 · 2^33 = 2^66; in release an unchecked product wrapped to 0.
    const HUGE: [usize; 2] = [1 << 33, 1 << 33];

    fn is_overflow_err(r: Result<Tensor>, op: &str) -> bool {
        matches!(&r, Err(Error::Invalid { op: o, detail }) if *o == op && detail.contains("capacity overflow"))
    }

    #[test]
    fn checked_numel_overflowing_shapes_are_none() {
        assert_eq!(checked_numel(&[2, 3]), Some(6));
        assert_eq!(checked_numel(&[]), Some(1));
        assert_eq!(checked_numel(&[5, 0]), Some(0));
        assert_eq!(checked_numel(&HUGE), None);
        // Zero elements, but rows × cols of it would overflow: rejected wherever the 0 is.
        assert_eq!(checked_numel(&[1 << 40, 1 << 40, 0]), None);
        assert_eq!(checked_numel(&[0, 1 << 40, 1 << 40]), None);
        assert_eq!(checked_numel(&[1 << 63, 0]), Some(0));
    }

    #[test]
    #[should_panic(expected = "has more elements than usize holds")]
    fn numel_overflowing_shape_panics() {
        numel(&HUGE);
    }

    #[test]
    fn try_zeros_overflowing_shape_errs() {
        assert!(is_overflow_err(
            Tensor::try_zeros(&HUGE, DType::F32),
            "Tensor::try_zeros"
        ));
        assert!(is_overflow_err(
            Tensor::try_zeros(&[1 << 40, 1 << 40, 0], DType::F32),
            "Tensor::try_zeros"
        ));
        // The count fits but its bytes do not: what `Vec` itself would panic on.
        assert!(is_overflow_err(
            Tensor::try_zeros(&[1 << 62], DType::F32),
            "Tensor::try_zeros"
        ));
        assert_eq!(Tensor::try_zeros(&[2, 0], DType::F32).unwrap().numel(), 0);
    }

    #[test]
    #[should_panic(
        expected = "Tensor::zeros: shape [8589934592, 8589934592] of f32 has more elements than memory can hold: capacity overflow"
    )]
    fn zeros_overflowing_shape_panics_with_capacity_overflow() {
        Tensor::zeros(&HUGE, DType::F32);
    }

    #[test]
    fn try_for_overwrite_overflowing_shape_errs() {
        assert!(is_overflow_err(
            Tensor::try_for_overwrite(&HUGE, DType::BF16),
            "Tensor::try_for_overwrite"
        ));
    }

    #[test]
    #[should_panic(expected = "capacity overflow")]
    fn for_overwrite_overflowing_shape_panics_with_capacity_overflow() {
        Tensor::for_overwrite(&HUGE, DType::F64);
    }

    #[test]
    fn try_from_fn_overflowing_shape_errs_without_calling_f() {
        let r = Tensor::try_from_fn(&HUGE, |_| -> f32 { panic!("f called") });
        assert!(is_overflow_err(r, "Tensor::try_from_fn"));
    }

    #[test]
    #[should_panic(expected = "capacity overflow")]
    fn from_fn_overflowing_shape_panics_with_capacity_overflow() {
        Tensor::from_fn(&HUGE, |i| i as f32);
    }

    #[test]
    fn from_vec_empty_for_wrapping_shape_errs() {
        // The audit's P2 destination: [2^33, 2^31] has 2^64 elements, 0 when wrapped, so an
        // empty Vec used to be accepted as its storage.
        let r = Tensor::from_vec(Vec::<f32>::new(), &[1 << 33, 1 << 31]);
        assert!(is_overflow_err(r, "Tensor::from_vec"));
    }

    #[test]
    fn reshape_empty_to_wrapping_shape_errs() {
        // 2^32 · 2^32 wraps to 0 = the element count of an empty tensor.
        let e = Tensor::zeros(&[0], DType::F32);
        let r = e.reshape(&[1 << 32, 1 << 32]);
        assert!(matches!(
            r,
            Err(Error::ShapeMismatch {
                op: "Tensor::reshape",
                ..
            })
        ));
    }

    #[test]
    fn narrow_view_start_wrapping_usize_errs() {
        // The audit's P5: start + len wraps to 1, which passed the range check, and the
        // view's offset wrapped back into the parent's row 0.
        let full = iota(&[4, 2]);
        let rows12 = full.narrow(0, 1, 2).unwrap();
        assert!(rows12.shares_storage_with(&full));
        for (start, len) in [(usize::MAX, 2), (1, usize::MAX), (usize::MAX, usize::MAX)] {
            let r = rows12.narrow(0, start, len);
            assert!(
                matches!(
                    &r,
                    Err(Error::Invalid {
                        op: "Tensor::narrow",
                        ..
                    })
                ),
                "narrow(0, {start}, {len}) = {r:?}"
            );
        }
        // Middle dims too (the copying path).
        assert!(iota(&[2, 3, 2]).narrow(1, usize::MAX, 2).is_err());
    }

    #[test]
    fn write_at_start_wrapping_usize_errs() {
        let mut dst = iota(&[4, 2]);
        let src = iota(&[2, 2]);
        let r = dst.write_at(0, usize::MAX, &src);
        assert!(matches!(
            r,
            Err(Error::ShapeMismatch {
                op: "Tensor::write_at",
                ..
            })
        ));
        assert_eq!(dst, iota(&[4, 2]), "nothing was written");
    }

    #[test]
    fn split_pack_unpack_sizes_wrapping_to_extent_err() {
        // usize::MAX + 5 wraps to 4, the extent.
        let t = iota(&[4, 2]);
        let sizes = [usize::MAX, 5];
        assert!(t.split(0, &sizes).is_err());
        assert!(t.pack(0, &sizes).is_err());
        assert!(Tensor::unpack(&t.reshape(&[8]).unwrap(), &[4, 2], 0, &sizes).is_err());
    }

    #[test]
    fn unpack_wrapping_shape_errs() {
        let flat = Tensor::zeros(&[0], DType::F32);
        assert!(Tensor::unpack(&flat, &[1 << 32, 1 << 32], 0, &[1 << 32]).is_err());
    }

    #[test]
    fn cat_extents_overflowing_usize_errs() {
        // Valid empty tensors (0 elements) whose extents along dim 0 add up past usize.
        let a = Tensor::zeros(&[1 << 63, 0], DType::F32);
        let r = Tensor::cat(&[a.clone(), a], 0);
        assert!(
            matches!(
                r,
                Err(Error::Invalid {
                    op: "Tensor::cat",
                    ..
                })
            ),
            "{r:?}"
        );
    }

    #[test]
    fn chunk_sizes_near_usize_max_add_up() {
        let s = chunk_sizes(usize::MAX, 2);
        assert_eq!(s.as_slice(), &[1 << 63, (1 << 63) - 1]);
        assert_eq!(
            chunk_sizes(usize::MAX - 1, 3).iter().sum::<usize>(),
            usize::MAX - 1
        );
    }

    #[test]
    fn eq_compares_dtype_and_values() {
        let a = iota(&[3]);
        assert_eq!(a, a.deep_clone());
        assert_ne!(a, a.to_dtype(DType::F64));
        assert_ne!(a, a.scale(2.0));
    }
}
