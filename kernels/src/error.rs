//! [`Error`], what the local kernels return when their arguments do not fit, and the
//! crate's [`Result`] alias.

use crate::dtype::DType;
use crate::Shape;

/// Everything a local kernel can reject. Each variant names the op and what it was given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Shapes the op cannot combine: two operands, an operand and its destination, or a
    /// tensor and the shape it was asked to take.
    #[error("{op}: shape mismatch: {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        /// The op that refused, e.g. `"Tensor::cat"`.
        op: &'static str,
        /// The shape of the tensor operated on (the left operand).
        lhs: Shape,
        /// The other operand's shape, or the shape asked for.
        rhs: Shape,
    },
    /// Two operands (or an operand and an output) of different element types; kernels
    /// never convert implicitly.
    #[error("{op}: dtype mismatch: {lhs} vs {rhs}")]
    DTypeMismatch {
        /// The op that refused.
        op: &'static str,
        /// The dtype of the tensor operated on (the left operand).
        lhs: DType,
        /// The other operand's dtype, or the dtype the op expected.
        rhs: DType,
    },
    /// A tensor dimension index not below the tensor's rank.
    #[error("{op}: dim {dim} out of range for a tensor of shape {shape:?}")]
    DimOutOfRange {
        /// The op that refused.
        op: &'static str,
        /// The dimension index asked for.
        dim: usize,
        /// The shape of the tensor it was asked of.
        shape: Shape,
    },
    /// A buffer whose element count is not the product of the shape it is given.
    #[error("{op}: {len} elements do not fill shape {shape:?} ({expected} elements)")]
    LengthMismatch {
        /// The op that refused.
        op: &'static str,
        /// The number of elements the buffer holds.
        len: usize,
        /// The number of elements `shape` needs.
        expected: usize,
        /// The shape the buffer was given.
        shape: Shape,
    },
    /// Any other bad argument (an out-of-range index or id, a zero chunk count, a size that
    /// overflows `usize`, an empty list), described in `detail`.
    #[error("{op}: {detail}")]
    Invalid {
        /// The op that refused.
        op: &'static str,
        /// What was wrong with the arguments, in words.
        detail: String,
    },
}

/// `std::result::Result` with this crate's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
