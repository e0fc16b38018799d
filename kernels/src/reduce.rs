//! Reductions across buffers in one fixed order, so every rank that computes the same
//! reduction gets the same bits.

use crate::dtype::{Element, ReduceOp};

/// Elements combined per block: small enough that the running accumulator stays in L1
/// while each source streams through once.
const BLOCK: usize = 2048;

/// `dst[i] = srcs[0][i] ⊕ srcs[1][i] ⊕ … ⊕ srcs[n-1][i]`, combined left to right (then
/// divided by `n` for `Avg`). `dst` may not alias any source; use
/// [`reduce_sources_with`] with a source position for the in-place case.
///
/// # Panics
/// If a source's length differs from `dst`'s (an internal invariant: callers validate sizes).
pub fn reduce_into<T: Element>(dst: &mut [T], srcs: &[&[T]], op: ReduceOp) {
    let n = dst.len();
    assert!(
        srcs.iter().all(|s| s.len() == n),
        "reduce_into: source lengths differ"
    );
    if srcs.is_empty() {
        return;
    }
    let mut start = 0;
    while start < n {
        let end = (start + BLOCK).min(n);
        let acc = &mut dst[start..end];
        acc.copy_from_slice(&srcs[0][start..end]);
        for s in &srcs[1..] {
            combine(acc, &s[start..end], op);
        }
        if op == ReduceOp::Avg {
            for a in acc.iter_mut() {
                *a = a.div_count(srcs.len());
            }
        }
        start = end;
    }
}

/// The reduction of `count` sources, `source(k)` for `k = 0..count` in that order, written
/// to `dst` (`len` elements each). `dst` may be one of the sources (in-place all-reduce):
/// every element is read from all sources before it is written, and nothing else is.
///
/// One pass over memory: with two sources each element is combined straight into `dst`;
/// with more, a block of the running result stays in an L1-sized scratch and only the last
/// source's combination is written out.
///
/// # Safety
/// Every pointer returned by `source` must be valid for reads of `len` elements, and `dst`
/// for writes of `len` elements. Nobody else may write any of them during the call.
/// `source` must return the same pointer each time it is called with the same `k`.
///
/// # Panics
/// Unless `dst` is exactly one source pointer or disjoint from every source: at most one
/// `source(k)` equals `dst`, and the `len` elements of every other source do not overlap
/// `dst`'s. The kernel makes `&mut [T]` over `dst` and `&[T]` over the sources, so a
/// partial overlap (or `dst` passed as two sources) would be undefined behaviour; it is
/// checked, in O(count), before any memory is touched.
pub unsafe fn reduce_sources_with<T: Element>(
    dst: *mut T,
    len: usize,
    count: usize,
    op: ReduceOp,
    source: impl Fn(usize) -> *const T,
) {
    if count == 0 || len == 0 {
        return;
    }
    assert_dst_exact_or_disjoint(dst, len, count, &source);
    let mut scratch = [T::zero(); BLOCK];
    let mut start = 0;
    while start < len {
        let n = (start + BLOCK).min(len) - start;
        let out = dst.add(start);
        // SAFETY (whole block): pointers valid for `len` elements (caller); element `i` of
        // `out` is written only after element `i` of every source was read.
        unsafe {
            match count {
                1 => {
                    let s = source(0).add(start);
                    if !std::ptr::eq(s, out) {
                        std::ptr::copy(s, out, n);
                    }
                }
                2 => combine_raw(out, source(0).add(start), source(1).add(start), n, op),
                _ => {
                    let acc = scratch.as_mut_ptr();
                    combine_raw(acc, source(0).add(start), source(1).add(start), n, op);
                    for k in 2..count - 1 {
                        combine_raw(acc, acc, source(k).add(start), n, op);
                    }
                    combine_raw(out, acc, source(count - 1).add(start), n, op);
                }
            }
            if op == ReduceOp::Avg {
                for i in 0..n {
                    out.add(i).write(out.add(i).read().div_count(count));
                }
            }
        }
        start += n;
    }
}

/// Panics unless `dst` equals at most one source exactly and is disjoint from all others
/// (compared as addresses; the element ranges are `len` long, `len > 0`).
fn assert_dst_exact_or_disjoint<T>(
    dst: *mut T,
    len: usize,
    count: usize,
    source: &impl Fn(usize) -> *const T,
) {
    // Both ranges are inside live allocations (the caller's contract), so their byte
    // lengths fit `isize` and the ends cannot overflow.
    let bytes = len * std::mem::size_of::<T>();
    let d = dst.addr();
    let mut exact = 0;
    for k in 0..count {
        let s = source(k).addr();
        if s == d {
            exact += 1;
        } else {
            assert!(
                s + bytes <= d || d + bytes <= s,
                "reduce_sources_with: dst partly overlaps source {k}"
            );
        }
    }
    assert!(
        exact <= 1,
        "reduce_sources_with: dst is {exact} of the sources (at most one may be dst)"
    );
}

/// `dst[i] = a[i] ⊕ b[i]` for `i < n` (Avg combines as Sum). `dst` may be `a` or `b` (an
/// in-place reduction); each case gets non-overlapping slices, so the loop vectorizes
/// (through raw pointers the compiler would have to assume partial overlap and fall back
/// to scalar code). The operands stay in the order `a ⊕ b` in every case, so the bits do
/// not depend on which buffer is written.
///
/// # Safety
/// All three valid for `n` elements; `dst` equals `a` or `b` exactly or overlaps neither;
/// nobody else writes them during the call.
#[inline(always)]
unsafe fn combine_raw<T: Element>(dst: *mut T, a: *const T, b: *const T, n: usize, op: ReduceOp) {
    // One loop per op, so no branch runs per element.
    // SAFETY: the caller's contract, passed on.
    unsafe {
        match op {
            ReduceOp::Sum | ReduceOp::Avg => combine_raw_with(dst, a, b, n, |x: T, y: T| x.add(y)),
            ReduceOp::Max => combine_raw_with(dst, a, b, n, |x: T, y: T| x.max_of(y)),
            ReduceOp::Min => combine_raw_with(dst, a, b, n, |x: T, y: T| x.min_of(y)),
        }
    }
}

/// [`combine_raw`] for one operation `f`.
///
/// # Safety
/// As [`combine_raw`].
#[inline(always)]
unsafe fn combine_raw_with<T: Element>(
    dst: *mut T,
    a: *const T,
    b: *const T,
    n: usize,
    f: impl Fn(T, T) -> T,
) {
    // SAFETY: the caller's contract; the slices made in each branch do not overlap.
    unsafe {
        if std::ptr::eq(dst, a) {
            let d = std::slice::from_raw_parts_mut(dst, n);
            combine_each(d, std::slice::from_raw_parts(b, n), &f);
        } else if std::ptr::eq(dst, b) {
            let d = std::slice::from_raw_parts_mut(dst, n);
            combine_each(d, std::slice::from_raw_parts(a, n), |x, y| f(y, x));
        } else {
            let d = std::slice::from_raw_parts_mut(dst, n);
            let (a, b) = (
                std::slice::from_raw_parts(a, n),
                std::slice::from_raw_parts(b, n),
            );
            for ((d, &x), &y) in d.iter_mut().zip(a).zip(b) {
                *d = f(x, y);
            }
        }
    }
}

/// `d[i] = g(d[i], s[i])`.
#[inline(always)]
fn combine_each<T: Element>(d: &mut [T], s: &[T], g: impl Fn(T, T) -> T) {
    for (d, &y) in d.iter_mut().zip(s) {
        *d = g(*d, y);
    }
}

/// `acc[i] = acc[i] ⊕ src[i]` (Avg accumulates as Sum; the caller divides once at the end).
#[inline]
pub fn combine<T: Element>(acc: &mut [T], src: &[T], op: ReduceOp) {
    match op {
        ReduceOp::Sum | ReduceOp::Avg => {
            for (a, &s) in acc.iter_mut().zip(src) {
                *a = a.add(s);
            }
        }
        ReduceOp::Max => {
            for (a, &s) in acc.iter_mut().zip(src) {
                *a = a.max_of(s);
            }
        }
        ReduceOp::Min => {
            for (a, &s) in acc.iter_mut().zip(src) {
                *a = a.min_of(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_into_sum_is_left_to_right() {
        let a = [1.0e16f64, 1.0];
        let b = [1.0, 2.0];
        let c = [-1.0e16, 3.0];
        let mut d = [0.0; 2];
        reduce_into(&mut d, &[&a, &b, &c], ReduceOp::Sum);
        // ((1e16 + 1) - 1e16) loses the 1 in f64: proves the order is fixed left to right.
        assert_eq!(d, [(1.0e16 + 1.0) - 1.0e16, 6.0]);
    }

    #[test]
    fn reduce_into_avg_max_min() {
        let a = [1.0f32, 5.0];
        let b = [3.0f32, -1.0];
        let mut d = [0.0; 2];
        reduce_into(&mut d, &[&a, &b], ReduceOp::Avg);
        assert_eq!(d, [2.0, 2.0]);
        reduce_into(&mut d, &[&a, &b], ReduceOp::Max);
        assert_eq!(d, [3.0, 5.0]);
        reduce_into(&mut d, &[&a, &b], ReduceOp::Min);
        assert_eq!(d, [1.0, -1.0]);
    }

    #[test]
    fn reduce_sources_in_place_at_any_source_matches_out_of_place() {
        // dst aliasing source 0, a middle source, or the last: same bits as out of place,
        // for every op, with two and with three sources (the scratch path).
        let n = 5000;
        let src: Vec<Vec<f32>> = (0..3)
            .map(|k| {
                (0..n)
                    .map(|i| ((i * 7 + k * 13) % 23) as f32 * 0.37 - 4.0)
                    .collect()
            })
            .collect();
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            for count in [2, 3] {
                let refs: Vec<&[f32]> = src[..count].iter().map(|v| v.as_slice()).collect();
                let mut expect = vec![0.0; n];
                reduce_into(&mut expect, &refs, op);
                for at in 0..count {
                    let mut bufs = src.clone();
                    let ptrs: Vec<*const f32> = bufs.iter().map(|v| v.as_ptr()).collect();
                    let dst = bufs[at].as_mut_ptr();
                    unsafe { reduce_sources_with(dst, n, count, op, |k| ptrs[k]) };
                    assert_eq!(
                        bufs[at], expect,
                        "{op:?}, {count} sources, in place at {at}"
                    );
                }
            }
        }
    }

    #[test]
    fn reduce_sources_in_place_matches_out_of_place() {
        let n = 5000;
        let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5).collect();
        let mut b: Vec<f32> = (0..n).map(|i| 1.0 / (1.0 + i as f32)).collect();
        let mut expect = vec![0.0; n];
        reduce_into(&mut expect, &[&a, &b], ReduceOp::Sum);
        let srcs = [a.as_ptr(), b.as_ptr()];
        let dst = b.as_mut_ptr();
        unsafe { reduce_sources_with(dst, n, 2, ReduceOp::Sum, |k| srcs[k]) };
        assert_eq!(b, expect);
    }

    #[test]
    #[should_panic(expected = "reduce_sources_with: dst partly overlaps source 0")]
    fn reduce_sources_with_dst_partly_overlapping_source_panics() {
        // The audit's reproducer: within the old documented contract (sources readable and
        // dst writable for 4 elements, no other thread), but dst starts one element into
        // source 0, which made overlapping `&mut` and `&` slices (UB under Miri).
        let mut a = [1.0f32, 2.0, 3.0, 4.0, 5.0];
        let b = [10.0f32; 4];
        let base = a.as_mut_ptr();
        let srcs = [base as *const f32, b.as_ptr()];
        unsafe { reduce_sources_with(base.add(1), 4, 2, ReduceOp::Sum, |k| srcs[k]) };
    }

    #[test]
    #[should_panic(expected = "dst is 2 of the sources")]
    fn reduce_sources_with_dst_twice_a_source_panics() {
        // dst equal to two sources would alias `&mut dst` with `&source`.
        let mut a = [1.0f32; 4];
        let p = a.as_mut_ptr();
        unsafe { reduce_sources_with(p, 4, 2, ReduceOp::Sum, |_| p as *const f32) };
    }

    #[test]
    fn reduce_sources_with_adjacent_buffers_are_disjoint() {
        // Touching but not overlapping ranges (one buffer cut in three) are accepted.
        let mut buf = [1.0f32, 2.0, 10.0, 20.0, 0.0, 0.0];
        let p = buf.as_mut_ptr();
        unsafe {
            let srcs = [p as *const f32, p.add(2) as *const f32];
            reduce_sources_with(p.add(4), 2, 2, ReduceOp::Sum, |k| srcs[k]);
        }
        assert_eq!(buf[4..], [11.0, 22.0]);
    }
}
