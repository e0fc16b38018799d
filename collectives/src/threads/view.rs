//! The one place where the thread backend turns the addresses its ranks post into memory it
//! reads and writes.
//!
//! A data phase sees the joined posts through a [`View`]. The view hands out typed slices
//! of the posted buffers and checks at run time, once per block (O(1), never per element):
//!
//! - every range lies inside the length the post declared for that buffer;
//! - a range read never overlaps this rank's own receive buffer, the only memory this rank
//!   writes. So a slice from [`View::read`] and one from [`View::write_own`] never alias.
//!   The one exception is the exact in-place source of a reduction, which
//!   [`View::reduce_own`] handles without building two slices over it.
//!
//! What the view cannot check locally is *when* it is used and *what the other ranks do
//! meanwhile*. Those are the protocol's guarantees, stated in the contract of [`View::new`]
//! and kept by `group.rs` and `comm.rs`. The dereferences of posted addresses are the two
//! `unsafe` blocks in [`View::read`] and [`View::write_own`]. Every data phase goes through
//! these two methods.

use crate::call::Call;
use dtensor_kernels::reduce::reduce_sources_with;
use dtensor_kernels::{DType, Element, ReduceOp, Slice, SliceMut};
use smallvec::SmallVec;
use std::marker::PhantomData;

/// One posted buffer: its address, its length in elements and the size of an element.
///
/// The fields are private to this module, and a `RawBuf` is made only from a live slice
/// ([`RawBuf::of`], [`RawBuf::of_mut`]) or a block of another `RawBuf` ([`RawBuf::block`]).
/// So `len` is always the true length of memory the poster borrowed, which is what makes
/// the bounds checks in [`View`] meaningful.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawBuf {
    ptr: *mut u8,
    len: usize,
    elem: usize,
}

// SAFETY: a `RawBuf` is an address and a length, and nothing in it is dereferenced except
// through a `View`, whose contract limits access to the window in which the poster keeps
// the buffer borrowed. Sending the address to another thread (it travels in the group's
// post table) is therefore harmless by itself.
unsafe impl Send for RawBuf {}

impl RawBuf {
    /// No buffer (calls that move no data). Every non-empty range is out of its bounds.
    pub(super) fn null() -> RawBuf {
        RawBuf {
            ptr: std::ptr::null_mut(),
            len: 0,
            elem: 0,
        }
    }

    /// A buffer peers may only read.
    pub(super) fn of(s: &Slice<'_>) -> RawBuf {
        RawBuf {
            // Cast to `*mut` only to share the type with `of_mut`; a `View` writes through
            // nothing but this rank's own receive buffer, which comes from `of_mut`.
            ptr: s.as_bytes_ptr().0 as *mut u8,
            len: s.len(),
            elem: s.dtype().size_in_bytes(),
        }
    }

    /// A buffer its owner writes during the data phase (and peers may read, where the
    /// protocol says so).
    pub(super) fn of_mut(s: &mut SliceMut<'_>) -> RawBuf {
        let len = s.len();
        let elem = s.dtype().size_in_bytes();
        let (ptr, _) = s.as_bytes_mut_ptr();
        RawBuf { ptr, len, elem }
    }

    /// Elements `off .. off + len` of this buffer, as a buffer of its own.
    ///
    /// # Panics
    /// If the range is not inside this buffer.
    pub(super) fn block(self, off: usize, len: usize) -> RawBuf {
        assert!(
            off.checked_add(len).is_some_and(|end| end <= self.len),
            "block {off}+{len} of a buffer of {} elements",
            self.len
        );
        RawBuf {
            // In bounds (asserted above), so this is the same address `add` would give;
            // `wrapping_add` only avoids an `unsafe` that the assertion makes unnecessary.
            ptr: self.ptr.wrapping_add(off * self.elem),
            len,
            elem: self.elem,
        }
    }
}

/// One rank's side of a collective, as its peers see it.
#[derive(Clone, Debug)]
pub(super) struct Post {
    pub(super) call: Call,
    /// `None` for the calls that move no data (barrier, split).
    pub(super) dtype: Option<DType>,
    /// Read-only for everyone (for in-place calls, the same memory as `recv`, or the
    /// rank's own block of it).
    pub(super) send: RawBuf,
    /// Written only by its owner (for an in-place reduce-scatter, only its own block).
    pub(super) recv: RawBuf,
    /// The caller's own arguments were inconsistent: the reason. Posted anyway so that
    /// every rank fails together instead of its peers waiting for it.
    pub(super) invalid: Option<String>,
}

impl Post {
    /// `all_reduce(f32 x 16, sum)`: what the rank called, for mismatch messages.
    pub(super) fn describe(&self) -> String {
        self.call.describe(self.dtype)
    }
}

/// Which of a post's two buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Buf {
    /// Read-only for everyone (for in-place calls, the same memory as `Recv` or part of it).
    Send,
    /// Written only by its owner.
    Recv,
}

/// The joined posts of one collective, as rank `me` sees them during one data phase: typed
/// access to every rank's buffers, with ranges checked against the posts' lengths.
pub(super) struct View<'a, T> {
    posts: &'a [Post],
    me: usize,
    /// This rank's receive buffer as a byte range: the only memory `write_own` reaches and
    /// the memory `read` refuses.
    own: (usize, usize),
    _elem: PhantomData<&'a [T]>,
}

impl<'a, T: Element> View<'a, T> {
    /// The view of `posts` for rank `me` during one data phase.
    ///
    /// # Safety
    /// Every address in `posts` is dereferenced through this view, so the caller promises:
    ///
    /// 1. **Liveness.** The view, and every slice obtained from it, is used only after the
    ///    join that produced `posts` completed and before the barrier that ends the current
    ///    data phase. Each poster stays blocked in the same collective until that barrier,
    ///    with its buffers borrowed, so every posted address is live.
    /// 2. **Agreement.** `posts` passed `call::check` on every rank. So every rank runs this
    ///    same phase of the same call with the same dtype, and the lengths and counts agree.
    ///    (The bounds are also checked here at run time; agreement is what keeps a rank from
    ///    running a different phase while this one reads.)
    /// 3. **Disjoint roles.** During this phase no rank writes a region that this rank
    ///    reads, and no other rank reads or writes a region that this rank writes with
    ///    [`View::write_own`] or [`View::reduce_own`]. This is the reads/writes table in the
    ///    `threads` module docs, which the data-phase functions in `comm.rs` follow.
    /// 4. **Element type.** `T` is the native element type of the posts' dtype (the caller
    ///    picks it with `with_dtype!`, so only the built-in element types reach here).
    ///
    /// # Panics
    /// If a post's dtype is not `T`'s or a buffer's element size is not `T`'s size.
    pub(super) unsafe fn new(posts: &'a [Post], me: usize) -> View<'a, T> {
        let size = std::mem::size_of::<T>();
        for p in posts {
            assert_eq!(p.dtype, Some(T::DTYPE), "a data phase over another dtype");
            for b in [p.send, p.recv] {
                assert!(
                    b.len == 0 || b.elem == size,
                    "element size {} != {size}",
                    b.elem
                );
            }
        }
        let recv = posts[me].recv;
        let start = recv.ptr as usize;
        View {
            posts,
            me,
            own: (start, start + recv.len * size),
            _elem: PhantomData,
        }
    }

    /// The joined posts, for the calls' counts and offsets.
    pub(super) fn posts(&self) -> &'a [Post] {
        self.posts
    }

    /// This rank's index in the group.
    pub(super) fn me(&self) -> usize {
        self.me
    }

    /// Elements `off .. off + len` of rank `p`'s buffer `buf`: its address.
    ///
    /// # Panics
    /// If the range is not inside the length that rank `p` posted for `buf`.
    fn region(&self, p: usize, buf: Buf, off: usize, len: usize) -> *mut T {
        let post = &self.posts[p];
        let b = match buf {
            Buf::Send => post.send,
            Buf::Recv => post.recv,
        };
        assert!(
            off.checked_add(len).is_some_and(|end| end <= b.len),
            "rank {p}'s {buf:?} buffer: range {off}+{len} out of its {} elements",
            b.len
        );
        // In bounds, so the same address `add` would give (see `RawBuf::block`).
        b.ptr.cast::<T>().wrapping_add(off)
    }

    /// Reads elements `off .. off + len` of rank `p`'s buffer `buf`.
    ///
    /// # Panics
    /// If the range is out of bounds, or overlaps this rank's own receive buffer (which
    /// this rank may be writing).
    pub(super) fn read(&self, p: usize, buf: Buf, off: usize, len: usize) -> &'a [T] {
        let ptr = self.region(p, buf, off, len);
        if len == 0 {
            return &[];
        }
        let start = ptr as usize;
        let end = start + len * std::mem::size_of::<T>();
        assert!(
            end <= self.own.0 || start >= self.own.1,
            "rank {}: a read of rank {p}'s {buf:?} buffer overlaps the receive buffer it writes",
            self.me
        );
        // SAFETY: the range is inside the buffer rank `p` posted (checked above), and that
        // buffer is live and properly typed for the whole window the view may be used in
        // (contract 1 and 4 of `View::new`). No rank writes it meanwhile: not this rank,
        // whose only writes go to its own receive buffer, which the range does not overlap
        // (checked above); not another rank, by contract 3.
        unsafe { std::slice::from_raw_parts(ptr, len) }
    }

    /// Elements `off .. off + len` of this rank's own receive buffer, to write.
    ///
    /// # Panics
    /// If the range is out of bounds.
    pub(super) fn write_own(&mut self, off: usize, len: usize) -> &mut [T] {
        let ptr = self.region(self.me, Buf::Recv, off, len);
        if len == 0 {
            return &mut [];
        }
        // SAFETY: the range is inside this rank's own receive buffer (checked above), which
        // the caller of `run` borrowed mutably for the whole collective, so it is live and
        // no code outside the protocol touches it (contract 1 of `View::new`). No other rank
        // reads or writes this range during the phase (contract 3). No slice from `read` is
        // over it (`read` refuses the receive buffer), and `&mut self` keeps two results of
        // this method from coexisting.
        unsafe { std::slice::from_raw_parts_mut(ptr, len) }
    }

    /// Copies elements `src_off .. src_off + len` of rank `p`'s buffer `buf` to elements
    /// `dst_off ..` of this rank's receive buffer. An in-place piece (this rank's own
    /// source already lies exactly there) is left as it is.
    pub(super) fn copy_to_own(
        &mut self,
        dst_off: usize,
        p: usize,
        buf: Buf,
        src_off: usize,
        len: usize,
    ) {
        if p == self.me
            && self.region(p, buf, src_off, len) == self.region(p, Buf::Recv, dst_off, len)
        {
            return;
        }
        let src = self.read(p, buf, src_off, len);
        self.write_own(dst_off, len).copy_from_slice(src);
    }

    /// Copies `rows` rows of `w` elements: row `r` from element `src_off + r * src_stride`
    /// of rank `p`'s buffer `buf` to element `dst_off + r * dst_stride` of this rank's
    /// receive buffer (a column block). Both spans are checked once, not per row, and the
    /// rows are cut from the two slices, so this costs what the bare row copies cost.
    pub(super) fn copy_rows_to_own(
        &mut self,
        (dst_off, dst_stride): (usize, usize),
        p: usize,
        buf: Buf,
        (src_off, src_stride): (usize, usize),
        w: usize,
        rows: usize,
    ) {
        if rows == 0 || w == 0 {
            return;
        }
        // From the first row's start to the last row's end.
        let span = |stride: usize| {
            (rows - 1)
                .checked_mul(stride)
                .and_then(|x| x.checked_add(w))
                .expect("a column block's span overflows usize")
        };
        let src = self.read(p, buf, src_off, span(src_stride));
        let dst = self.write_own(dst_off, span(dst_stride));
        for r in 0..rows {
            dst[r * dst_stride..][..w].copy_from_slice(&src[r * src_stride..][..w]);
        }
    }

    /// Elements `dst_off .. dst_off + len` of this rank's receive buffer = the reduction,
    /// in rank order, of `len` elements of every rank `k`'s buffer at `source(k)` (a
    /// buffer and an offset). This rank's own source may be exactly the destination (an
    /// in-place reduction); any other overlap with the receive buffer panics, as in `read`.
    pub(super) fn reduce_own(
        &mut self,
        dst_off: usize,
        len: usize,
        op: ReduceOp,
        source: impl Fn(usize) -> (Buf, usize),
    ) {
        let me = self.me;
        let dst_addr = self.region(me, Buf::Recv, dst_off, len);
        // `None` marks the in-place source: the destination itself.
        let srcs: SmallVec<[Option<*const T>; 16]> = (0..self.posts.len())
            .map(|k| {
                let (buf, off) = source(k);
                if k == me && self.region(k, buf, off, len) == dst_addr {
                    None
                } else {
                    Some(self.read(k, buf, off, len).as_ptr())
                }
            })
            .collect();
        let dst = self.write_own(dst_off, len);
        if dst.is_empty() {
            return;
        }
        let d = dst.as_mut_ptr();
        // SAFETY: no posted address is dereferenced here that `read` and `write_own` did not
        // already hand out as slices, so this rests only on those slices: every source is
        // a `&[T]` of `len` elements (nobody writes it while it lives), except at most one
        // that is `dst` itself, exactly; `dst` is a `&mut [T]` of `len` elements. Exactly
        // equal or disjoint is the aliasing `reduce_sources_with` allows (it reads every
        // element of every source before writing that element).
        unsafe { reduce_sources_with::<T>(d, len, srcs.len(), op, |k| srcs[k].unwrap_or(d)) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post(call: Call, send: RawBuf, recv: RawBuf) -> Post {
        Post {
            call,
            dtype: Some(dtensor_kernels::DType::F32),
            send,
            recv,
            invalid: None,
        }
    }

    fn bcast(len: usize) -> Call {
        Call::Broadcast { len, root: 0 }
    }

    /// Two "ranks" in one thread: rank 0 posts `a` (send) and `b` (recv), rank 1 posts `c`
    /// as both. Single-threaded and nothing else touches the buffers while `f` runs, so
    /// the contract of `View::new` holds.
    fn with_view(f: impl FnOnce(&mut View<'_, f32>)) -> (Vec<f32>, Vec<f32>) {
        let a = vec![1.0f32, 2.0, 3.0, 4.0];
        let mut b = vec![0.0f32; 4];
        let mut c = vec![10.0f32, 20.0, 30.0, 40.0];
        let send0 = RawBuf::of(&Slice::F32(&a));
        let recv0 = RawBuf::of_mut(&mut SliceMut::F32(&mut b));
        let buf1 = RawBuf::of_mut(&mut SliceMut::F32(&mut c));
        let posts = [post(bcast(4), send0, recv0), post(bcast(4), buf1, buf1)];
        // SAFETY: see the doc comment: the buffers outlive the view, and no other thread
        // exists to read or write them.
        let mut v = unsafe { View::<f32>::new(&posts, 0) };
        f(&mut v);
        (b, c)
    }

    #[test]
    fn copy_and_read_in_bounds() {
        let (b, _) = with_view(|v| {
            assert_eq!(v.read(1, Buf::Recv, 1, 2), &[20.0, 30.0]);
            v.copy_to_own(0, 1, Buf::Send, 2, 2);
            v.copy_to_own(2, 0, Buf::Send, 0, 2);
        });
        assert_eq!(b, [30.0, 40.0, 1.0, 2.0]);
    }

    #[test]
    fn copy_rows_strided_both_sides() {
        // Column 1 of rank 1's 2x2 matrix `c` into column 0 of rank 0's 2x2 `b`, and
        // rank 0's own send `a` (rows of 1) into column 1.
        let (b, _) = with_view(|v| {
            v.copy_rows_to_own((0, 2), 1, Buf::Send, (1, 2), 1, 2);
            v.copy_rows_to_own((1, 2), 0, Buf::Send, (0, 1), 1, 2);
        });
        assert_eq!(b, [20.0, 1.0, 40.0, 2.0]);
    }

    #[test]
    #[should_panic(expected = "out of its 4 elements")]
    fn copy_rows_past_the_last_row_panics() {
        // Three rows of stride 2 end past a 4-element buffer.
        with_view(|v| v.copy_rows_to_own((0, 1), 1, Buf::Send, (0, 2), 1, 3));
    }

    #[test]
    #[should_panic(expected = "out of its 4 elements")]
    fn read_past_declared_length_panics() {
        with_view(|v| {
            v.read(1, Buf::Send, 3, 2);
        });
    }

    #[test]
    #[should_panic(expected = "out of its 4 elements")]
    fn read_with_wrapping_range_panics() {
        with_view(|v| {
            v.read(1, Buf::Send, usize::MAX, 2);
        });
    }

    #[test]
    #[should_panic(expected = "out of its 4 elements")]
    fn write_own_past_declared_length_panics() {
        with_view(|v| {
            v.write_own(1, 4);
        });
    }

    #[test]
    #[should_panic(expected = "overlaps the receive buffer it writes")]
    fn read_of_own_recv_panics() {
        with_view(|v| {
            v.read(0, Buf::Recv, 0, 1);
        });
    }

    #[test]
    fn reduce_own_in_place_at_own_position() {
        // Rank 0's recv holds its own contribution, reduced in place with rank 1's.
        let mut own = vec![1.0f32, 2.0, 3.0];
        let peer = vec![10.0f32, 20.0, 30.0];
        let recv0 = RawBuf::of_mut(&mut SliceMut::F32(&mut own));
        let posts = [
            post(bcast(3), recv0, recv0),
            post(bcast(3), RawBuf::of(&Slice::F32(&peer)), RawBuf::null()),
        ];
        // SAFETY: single-threaded; both buffers outlive the view.
        let mut v = unsafe { View::<f32>::new(&posts, 0) };
        v.reduce_own(1, 2, ReduceOp::Sum, |_| (Buf::Send, 1));
        assert_eq!(own, [1.0, 22.0, 33.0]);
    }

    #[test]
    #[should_panic(expected = "overlaps the receive buffer it writes")]
    fn reduce_own_partly_overlapping_own_source_panics() {
        let mut own = vec![1.0f32, 2.0, 3.0];
        let recv0 = RawBuf::of_mut(&mut SliceMut::F32(&mut own));
        let posts = [post(bcast(3), recv0, recv0)];
        // SAFETY: single-threaded; the buffer outlives the view.
        let mut v = unsafe { View::<f32>::new(&posts, 0) };
        // Destination elements 1..3, own source 0..2: overlapping but not equal.
        v.reduce_own(1, 2, ReduceOp::Sum, |_| (Buf::Send, 0));
    }

    #[test]
    #[should_panic(expected = "block 2+3 of a buffer of 4 elements")]
    fn block_out_of_range_panics() {
        let mut b = vec![0.0f32; 4];
        RawBuf::of_mut(&mut SliceMut::F32(&mut b)).block(2, 3);
    }
}
