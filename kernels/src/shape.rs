//! Shape arithmetic every floor shares: element counts that cannot overflow, the
//! extents of `torch.chunk`, and the checks of a dim's pieces.

use crate::error::{Error, Result};
use smallvec::SmallVec;

/// Product of the extents (1 for a scalar).
///
/// # Panics
/// If the product of the non-zero extents overflows `usize` (see [`checked_numel`]). Never
/// for the shape of a [`Tensor`](crate::Tensor), whose constructors reject such shapes.
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

/// Sum of piece extents, or `None` if it overflows.
pub(crate) fn checked_sum(sizes: &[usize]) -> Option<usize> {
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
