//! Host storage: a contiguous run of one element type in host memory, and the element types
//! a tensor can hold. The lowest floor of storage: the pool recycles these.

use crate::dtype::{DType, Element, Slice, SliceMut};
use half::{bf16, f16};

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
    pub(crate) fn slice(&self) -> Slice<'_> {
        match self {
            CpuStorage::F32(v) => Slice::F32(v),
            CpuStorage::F64(v) => Slice::F64(v),
            CpuStorage::BF16(v) => Slice::BF16(v),
            CpuStorage::F16(v) => Slice::F16(v),
            CpuStorage::I32(v) => Slice::I32(v),
            CpuStorage::I64(v) => Slice::I64(v),
        }
    }
    pub(crate) fn slice_mut(&mut self) -> SliceMut<'_> {
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
