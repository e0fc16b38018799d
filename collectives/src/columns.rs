//! Column blocks of a row-major matrix: the layout of a tensor split along a non-leading
//! dim, seen as `rows × Σ widths` (rows = the extents before the dim, widths = the pieces'
//! extents times the extents after it). The default column-block collectives pack and
//! unpack with these; backends that address peers' memory copy blocks directly instead.

/// The column blocks of `src` (`rows × Σ widths`, row-major) one after another, block `p`
/// as a row-major `rows × widths[p]` matrix.
///
/// # Panics
/// If `src.len() != rows · Σ widths` (an internal invariant: callers validate sizes).
pub fn pack<T: Copy>(src: &[T], rows: usize, widths: &[usize]) -> Vec<T> {
    let total: usize = widths.iter().sum();
    assert_eq!(src.len(), rows * total, "columns::pack: size");
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

/// The inverse of [`pack`]: blocks one after another in `src`, written as columns of `dst`.
///
/// # Panics
/// If the lengths do not match `rows · Σ widths` (an internal invariant).
pub fn unpack<T: Copy>(src: &[T], dst: &mut [T], rows: usize, widths: &[usize]) {
    let total: usize = widths.iter().sum();
    assert!(
        src.len() == rows * total && dst.len() == rows * total,
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
        let mut back = vec![0; 10];
        super::unpack(&p, &mut back, 2, &[2, 0, 3]);
        assert_eq!(back, m);
    }
}
