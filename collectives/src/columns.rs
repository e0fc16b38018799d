//! Column blocks of a row-major matrix: the layout of a tensor split along a non-leading
//! dim, seen as `rows × Σ widths` (rows = the extents before the dim, widths = the pieces'
//! extents times the extents after it). The default column-block collectives pack and
//! unpack with these; backends that address peers' memory copy blocks directly instead.

/// The element counts `rows · widths[p]` of the blocks, or `None` if one of them, or
/// `rows · Σ widths`, overflows `usize`. Checked: a wrapped count could pass the length
/// checks and describe blocks that are not where the columns are.
pub fn counts(rows: usize, widths: &[usize]) -> Option<Vec<usize>> {
    total(rows, widths)?;
    widths.iter().map(|w| w.checked_mul(rows)).collect()
}

/// `(Σ widths, rows · Σ widths)`, or `None` if either overflows.
fn total(rows: usize, widths: &[usize]) -> Option<(usize, usize)> {
    let cols = widths.iter().try_fold(0usize, |a, &w| a.checked_add(w))?;
    Some((cols, cols.checked_mul(rows)?))
}

/// The column blocks of `src` (`rows × Σ widths`, row-major) one after another, block `p`
/// as a row-major `rows × widths[p]` matrix.
///
/// # Panics
/// If `src.len() != rows · Σ widths` (an internal invariant: callers validate sizes).
pub fn pack<T: Copy>(src: &[T], rows: usize, widths: &[usize]) -> Vec<T> {
    let (total, len) = total(rows, widths).expect("columns::pack: size overflows");
    assert_eq!(src.len(), len, "columns::pack: size");
    let mut out = Vec::with_capacity(src.len());
    let mut col = 0;
    for &w in widths {
        for r in 0..rows {
            out.extend_from_slice(&src[r * total + col..r * total + col + w]);
        }
        col += w;
    }
    out
}

/// [`pack`] into `dst` (as long as `src`), for callers that reuse the space.
///
/// # Panics
/// If the lengths do not match `rows · Σ widths` (an internal invariant).
pub fn pack_into<T: Copy>(src: &[T], dst: &mut [T], rows: usize, widths: &[usize]) {
    let (total, len) = total(rows, widths).expect("columns::pack_into: size overflows");
    assert!(
        src.len() == len && dst.len() == len,
        "columns::pack_into: size"
    );
    let (mut col, mut base) = (0, 0);
    for &w in widths {
        for r in 0..rows {
            dst[base + r * w..base + (r + 1) * w]
                .copy_from_slice(&src[r * total + col..r * total + col + w]);
        }
        col += w;
        base += rows * w;
    }
}

/// The inverse of [`pack`]: blocks one after another in `src`, written as columns of `dst`.
///
/// # Panics
/// If the lengths do not match `rows · Σ widths` (an internal invariant).
pub fn unpack<T: Copy>(src: &[T], dst: &mut [T], rows: usize, widths: &[usize]) {
    let (total, len) = total(rows, widths).expect("columns::unpack: size overflows");
    assert!(
        src.len() == len && dst.len() == len,
        "columns::unpack: size"
    );
    let (mut col, mut base) = (0, 0);
    for &w in widths {
        for r in 0..rows {
            dst[r * total + col..r * total + col + w]
                .copy_from_slice(&src[base + r * w..base + (r + 1) * w]);
        }
        col += w;
        base += rows * w;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn pack_then_unpack_round_trips() {
        // 2 rows x (2 + 0 + 3) columns
        let m: Vec<i32> = (0..10).collect();
        let p = super::pack(&m, 2, &[2, 0, 3]);
        assert_eq!(p, vec![0, 1, 5, 6, 2, 3, 4, 7, 8, 9]);
        let mut q = vec![-1; 10];
        super::pack_into(&m, &mut q, 2, &[2, 0, 3]);
        assert_eq!(q, p);
        let mut back = vec![0; 10];
        super::unpack(&p, &mut back, 2, &[2, 0, 3]);
        assert_eq!(back, m);
    }

    #[test]
    fn counts_overflowing_widths_are_none() {
        assert_eq!(super::counts(2, &[2, 0, 3]), Some(vec![4, 0, 6]));
        // 2^33 · 2^31 = 2^64 wraps to 0 unchecked.
        assert_eq!(super::counts(1 << 33, &[1 << 31]), None);
        // Each block fits, the whole matrix does not.
        assert_eq!(super::counts(2, &[1 << 62, 1 << 62]), None);
        assert_eq!(super::counts(1, &[usize::MAX, 1]), None);
    }
}
