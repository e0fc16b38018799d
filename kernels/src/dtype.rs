//! Element types a tensor or a collective buffer can hold, and the dtype-erased views
//! that let a `dyn Communicator` move any of them.

use half::{bf16, f16};
use std::fmt;

/// The element type of a tensor or buffer, known at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// IEEE 754 single precision, 4 bytes (`f32`).
    F32,
    /// IEEE 754 double precision, 8 bytes (`f64`).
    F64,
    /// bfloat16, 2 bytes ([`half::bf16`]): f32's exponent range, 8 bits of mantissa.
    BF16,
    /// IEEE 754 half precision, 2 bytes ([`half::f16`]).
    F16,
    /// Signed 32-bit integer, 4 bytes (`i32`), e.g. token ids.
    I32,
    /// Signed 64-bit integer, 8 bytes (`i64`).
    I64,
}

impl DType {
    /// Every dtype, the float ones first (the order the CUDA kernels are instantiated in).
    pub const ALL: [DType; 6] = [
        DType::F32,
        DType::F64,
        DType::BF16,
        DType::F16,
        DType::I32,
        DType::I64,
    ];

    /// The float dtypes: the first four of [`DType::ALL`].
    pub const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::BF16, DType::F16];

    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::BF16 | DType::F16 => 2,
        }
    }

    /// True for the floating-point types (the ones a gradient can have).
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32 | DType::I64)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
            DType::I64 => "i64",
        })
    }
}

/// How a pending partial value is combined across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Elementwise sum, in rank order `0, 1, …, n-1` (the reduction a `Partial<Sum>`
    /// placement holds pending).
    Sum,
    /// Sum, then divide by the number of contributions.
    Avg,
    /// Elementwise maximum ([`Element::max_of`]).
    Max,
    /// Elementwise minimum ([`Element::min_of`]).
    Min,
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Avg => "avg",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
        })
    }
}

/// Keeps [`Element`] closed to the six types below. Code in this workspace turns a
/// dtype-erased buffer back into `&[T]` trusting `T::DTYPE`, and hands `T` buffers to MPI
/// and gemm as raw memory of `T::DTYPE`; an outside type claiming a `DTYPE` it does not
/// have (another size, alignment, or bit validity) would make that undefined behaviour.
mod sealed {
    use super::{Slice, SliceMut};

    #[diagnostic::on_unimplemented(
        message = "`{Self}` is not a dtensor element type: the element types are f32, f64, bf16, f16, i32 and i64",
        label = "not a dtensor element type",
        note = "`Element` is sealed: dtype-erased buffers are viewed as `&[T]` trusting it, so only dtensor-kernels implements it"
    )]
    pub trait Sealed: Sized {
        /// The buffer, if it holds `Self`s: a match on the enum variant, no cast.
        fn typed_view(s: Slice<'_>) -> Option<&[Self]>;
        /// As [`Sealed::typed_view`], mutably.
        fn typed_view_mut(s: SliceMut<'_>) -> Option<&mut [Self]>;
        /// The 8-byte words as elements (`8 / size_of::<Self>()` per word), for scratch
        /// space reused across dtypes.
        fn typed_words_mut(words: &mut [u64]) -> &mut [Self];
    }
}

/// A scalar a tensor can hold. Arithmetic goes through these methods so that `bf16` and
/// `f16` round exactly once per operation, the same way on every rank.
///
/// Sealed: implemented for `f32`, `f64`, `bf16`, `f16`, `i32` and `i64` only.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a dtensor element type: the element types are f32, f64, bf16, f16, i32 and i64",
    label = "not a dtensor element type"
)]
pub trait Element:
    sealed::Sealed + Copy + Default + PartialEq + PartialOrd + Send + Sync + fmt::Debug + 'static
{
    /// The run-time [`DType`] tag of this type; dtype-erased buffers are viewed as `&[Self]`
    /// by matching on it.
    const DTYPE: DType;
    /// The additive identity (`0`).
    fn zero() -> Self;
    /// The multiplicative identity (`1`).
    fn one() -> Self;
    /// `self + other`; for `bf16` and `f16` computed in `f32` and rounded back once.
    fn add(self, other: Self) -> Self;
    /// `self * other`; for `bf16` and `f16` computed in `f32` and rounded back once.
    fn mul(self, other: Self) -> Self;
    /// `self / n`, used by `ReduceOp::Avg`.
    fn div_count(self, n: usize) -> Self;
    /// Converts from `f64`: rounded to nearest for the float types, an `as` cast
    /// (truncating toward zero, saturating, NaN to 0) for the integers.
    fn from_f64(v: f64) -> Self;
    /// Converts to `f64` (exact for every type but `i64` beyond 2⁵³).
    fn to_f64(self) -> f64;
    /// The larger of the two; `self` if they are unordered (a NaN `other` is ignored).
    fn max_of(self, other: Self) -> Self {
        if other > self {
            other
        } else {
            self
        }
    }
    /// The smaller of the two; `self` if they are unordered (a NaN `other` is ignored).
    fn min_of(self, other: Self) -> Self {
        if other < self {
            other
        } else {
            self
        }
    }
    /// Wraps a typed slice as the dtype-erased [`Slice`] a `dyn Communicator` takes.
    fn slice(s: &[Self]) -> Slice<'_>;
    /// Wraps a typed mutable slice as the dtype-erased [`SliceMut`].
    fn slice_mut(s: &mut [Self]) -> SliceMut<'_>;
}

macro_rules! sealed_element {
    ($t:ty, $variant:ident) => {
        impl sealed::Sealed for $t {
            fn typed_view(s: Slice<'_>) -> Option<&[Self]> {
                match s {
                    Slice::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn typed_view_mut(s: SliceMut<'_>) -> Option<&mut [Self]> {
                match s {
                    SliceMut::$variant(v) => Some(v),
                    _ => None,
                }
            }
            fn typed_words_mut(words: &mut [u64]) -> &mut [Self] {
                // Checked by bytemuck (size and alignment divide 8, and any bits are a
                // valid value), so this cannot fail for our six types.
                bytemuck::cast_slice_mut(words)
            }
        }
    };
}

macro_rules! native_element {
    ($t:ty, $variant:ident, $zero:expr, $one:expr) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            #[inline(always)]
            fn zero() -> Self {
                $zero
            }
            #[inline(always)]
            fn one() -> Self {
                $one
            }
            #[inline(always)]
            fn add(self, other: Self) -> Self {
                self + other
            }
            #[inline(always)]
            fn mul(self, other: Self) -> Self {
                self * other
            }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                self / (n as $t)
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            fn slice(s: &[Self]) -> Slice<'_> {
                Slice::$variant(s)
            }
            fn slice_mut(s: &mut [Self]) -> SliceMut<'_> {
                SliceMut::$variant(s)
            }
        }
        sealed_element!($t, $variant);
    };
}

native_element!(f32, F32, 0.0, 1.0);
native_element!(f64, F64, 0.0, 1.0);
native_element!(i32, I32, 0, 1);
native_element!(i64, I64, 0, 1);

macro_rules! half_element {
    ($t:ty, $variant:ident) => {
        impl Element for $t {
            const DTYPE: DType = DType::$variant;
            #[inline(always)]
            fn zero() -> Self {
                <$t>::ZERO
            }
            #[inline(always)]
            fn one() -> Self {
                <$t>::ONE
            }
            #[inline(always)]
            fn add(self, other: Self) -> Self {
                <$t>::from_f32(self.to_f32() + other.to_f32())
            }
            #[inline(always)]
            fn mul(self, other: Self) -> Self {
                <$t>::from_f32(self.to_f32() * other.to_f32())
            }
            #[inline(always)]
            fn div_count(self, n: usize) -> Self {
                <$t>::from_f32(self.to_f32() / n as f32)
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                <$t>::from_f64(v)
            }
            #[inline(always)]
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            fn slice(s: &[Self]) -> Slice<'_> {
                Slice::$variant(s)
            }
            fn slice_mut(s: &mut [Self]) -> SliceMut<'_> {
                SliceMut::$variant(s)
            }
        }
        sealed_element!($t, $variant);
    };
}

half_element!(bf16, BF16);
half_element!(f16, F16);

/// A borrowed buffer of any element type.
#[derive(Clone, Copy, Debug)]
pub enum Slice<'a> {
    /// A buffer of [`DType::F32`] elements.
    F32(&'a [f32]),
    /// A buffer of [`DType::F64`] elements.
    F64(&'a [f64]),
    /// A buffer of [`DType::BF16`] elements.
    BF16(&'a [bf16]),
    /// A buffer of [`DType::F16`] elements.
    F16(&'a [f16]),
    /// A buffer of [`DType::I32`] elements.
    I32(&'a [i32]),
    /// A buffer of [`DType::I64`] elements.
    I64(&'a [i64]),
}

/// A mutably borrowed buffer of any element type.
#[derive(Debug)]
pub enum SliceMut<'a> {
    /// A buffer of [`DType::F32`] elements.
    F32(&'a mut [f32]),
    /// A buffer of [`DType::F64`] elements.
    F64(&'a mut [f64]),
    /// A buffer of [`DType::BF16`] elements.
    BF16(&'a mut [bf16]),
    /// A buffer of [`DType::F16`] elements.
    F16(&'a mut [f16]),
    /// A buffer of [`DType::I32`] elements.
    I32(&'a mut [i32]),
    /// A buffer of [`DType::I64`] elements.
    I64(&'a mut [i64]),
}

/// Runs `$body` with `$s` bound to the typed slice inside a [`Slice`] or [`SliceMut`],
/// and `$T` to its element type.
#[macro_export]
macro_rules! with_slice {
    ($enum:ident, $value:expr, |$s:ident : $T:ident| $body:expr) => {
        match $value {
            $crate::$enum::F32($s) => {
                #[allow(dead_code)]
                type $T = f32;
                $body
            }
            $crate::$enum::F64($s) => {
                #[allow(dead_code)]
                type $T = f64;
                $body
            }
            $crate::$enum::BF16($s) => {
                #[allow(dead_code)]
                type $T = $crate::half::bf16;
                $body
            }
            $crate::$enum::F16($s) => {
                #[allow(dead_code)]
                type $T = $crate::half::f16;
                $body
            }
            $crate::$enum::I32($s) => {
                #[allow(dead_code)]
                type $T = i32;
                $body
            }
            $crate::$enum::I64($s) => {
                #[allow(dead_code)]
                type $T = i64;
                $body
            }
        }
    };
}

impl<'a> Slice<'a> {
    /// The elements as `&[T]`, or `None` if the buffer does not hold `T`s.
    ///
    /// ```
    /// use dtensor_kernels::Slice;
    /// let v = [1.0f32, 2.0];
    /// assert_eq!(Slice::F32(&v).typed::<f32>(), Some(&v[..]));
    /// assert_eq!(Slice::F32(&v).typed::<f64>(), None);
    /// ```
    pub fn typed<T: Element>(self) -> Option<&'a [T]> {
        T::typed_view(self)
    }
    /// The element type of the buffer (which variant this is).
    pub fn dtype(&self) -> DType {
        with_slice!(Slice, self, |_s: T| <T as Element>::DTYPE)
    }
    /// The number of elements (not bytes).
    pub fn len(&self) -> usize {
        with_slice!(Slice, self, |s: T| s.len())
    }
    /// True if the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Start address and length in bytes, for backends that move raw memory.
    pub fn as_bytes_ptr(&self) -> (*const u8, usize) {
        with_slice!(Slice, self, |s: T| (
            s.as_ptr() as *const u8,
            std::mem::size_of_val(*s)
        ))
    }
}

impl<'a> SliceMut<'a> {
    /// The elements as `&mut [T]`, or `None` if the buffer does not hold `T`s.
    pub fn typed_mut<T: Element>(self) -> Option<&'a mut [T]> {
        T::typed_view_mut(self)
    }
    /// The element type of the buffer (which variant this is).
    pub fn dtype(&self) -> DType {
        with_slice!(SliceMut, self, |_s: T| <T as Element>::DTYPE)
    }
    /// The number of elements (not bytes).
    pub fn len(&self) -> usize {
        with_slice!(SliceMut, self, |s: T| s.len())
    }
    /// True if the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Start address and length in bytes, for backends that move raw memory.
    pub fn as_bytes_mut_ptr(&mut self) -> (*mut u8, usize) {
        with_slice!(SliceMut, self, |s: T| (
            s.as_mut_ptr() as *mut u8,
            std::mem::size_of_val(*s)
        ))
    }
    /// A shared view of the same buffer.
    pub fn as_slice(&self) -> Slice<'_> {
        with_slice!(SliceMut, self, |s: T| <T as Element>::slice(s))
    }
}

/// `words` seen as elements of `T` (`8 / size_of::<T>()` per word): scratch space that one
/// buffer of `u64`s provides for every dtype in turn. Safe: every element type is plain
/// data whose size and alignment divide 8.
///
/// ```
/// let mut words = vec![0u64; 2];
/// let f: &mut [f32] = dtensor_kernels::dtype::words_as_mut(&mut words);
/// assert_eq!(f.len(), 4);
/// ```
pub fn words_as_mut<T: Element>(words: &mut [u64]) -> &mut [T] {
    T::typed_words_mut(words)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floats_are_the_float_dtypes_first_in_all() {
        assert_eq!(DType::FLOATS[..], DType::ALL[..4]);
        for d in DType::ALL {
            assert_eq!(d.is_float(), DType::FLOATS.contains(&d), "{d}");
        }
    }

    #[test]
    fn slice_typed_other_dtype_is_none() {
        let v = [1.0f32, 2.0];
        let s = Slice::F32(&v);
        assert_eq!(s.typed::<f32>().map(<[f32]>::as_ptr), Some(v.as_ptr()));
        assert_eq!(s.typed::<f64>(), None);
        assert_eq!(s.typed::<i32>(), None);
        assert_eq!(s.typed::<bf16>(), None);
        let mut w = [1i64, 2];
        assert!(SliceMut::I64(&mut w).typed_mut::<f64>().is_none());
        SliceMut::I64(&mut w).typed_mut::<i64>().unwrap()[1] = 5;
        assert_eq!(w, [1, 5]);
    }

    #[test]
    fn words_as_mut_gives_eight_bytes_of_elements_per_word() {
        let mut words = vec![0u64; 3];
        assert_eq!(words_as_mut::<f64>(&mut words).len(), 3);
        assert_eq!(words_as_mut::<i32>(&mut words).len(), 6);
        assert_eq!(words_as_mut::<f16>(&mut words).len(), 12);
        words_as_mut::<f32>(&mut words)[5] = 1.5;
        assert_eq!(words_as_mut::<f32>(&mut words)[5], 1.5);
    }
}
