use crate::dtype::DType;
use crate::Shape;

/// Everything a local kernel can reject. Each variant names the op and what it was given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error("{op}: shape mismatch: {lhs:?} vs {rhs:?}")]
    ShapeMismatch {
        op: &'static str,
        lhs: Shape,
        rhs: Shape,
    },
    #[error("{op}: dtype mismatch: {lhs} vs {rhs}")]
    DTypeMismatch {
        op: &'static str,
        lhs: DType,
        rhs: DType,
    },
    #[error("{op}: dim {dim} out of range for a tensor of shape {shape:?}")]
    DimOutOfRange {
        op: &'static str,
        dim: usize,
        shape: Shape,
    },
    #[error("{op}: {len} elements do not fill shape {shape:?} ({expected} elements)")]
    LengthMismatch {
        op: &'static str,
        len: usize,
        expected: usize,
        shape: Shape,
    },
    #[error("{op}: {detail}")]
    Invalid { op: &'static str, detail: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
