//! What a [`Tensor`] computes on its own: views and copies along a dim (narrow, split,
//! chunk, cat, pack, unpack, write_at), elementwise arithmetic and dtype conversion. The
//! handle itself (constructors, accessors, host and device moves) is one floor down, in
//! `crate::storage`.

use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::chunk_sizes;
use crate::storage::tensor::or_panic;
use crate::Tensor;

impl Tensor {
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
        crate::ops::tensor::try_to_dtype(self, dtype)
    }

    /// Elements `start..start + len` along `dim`, copied into a new tensor.
    pub fn narrow(&self, dim: usize, start: usize, len: usize) -> Result<Tensor> {
        crate::ops::tensor::narrow(self, dim, start, len)
    }

    /// Splits `dim` into pieces of the given extents (which must add up to the extent),
    /// in one pass, returning one tensor per piece.
    pub fn split(&self, dim: usize, sizes: &[usize]) -> Result<Vec<Tensor>> {
        crate::spec::tensor::check_tensor_pieces(self, "Tensor::split", dim, sizes)?;
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
        crate::spec::tensor::check_dim(self, "Tensor::chunk", dim)?;
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
        crate::ops::tensor::cat(tensors, dim)
    }

    /// Packs the pieces of `dim` (extents `sizes`) one after another into a flat buffer of the
    /// same element count, piece 0 first: the send layout of an all-to-all or
    /// reduce-scatter along `dim`. One pass over memory.
    pub fn pack(&self, dim: usize, sizes: &[usize]) -> Result<Tensor> {
        crate::ops::tensor::pack(self, dim, sizes)
    }

    /// The inverse of [`Tensor::pack`]: `flat` holds pieces one after another, piece `i` of
    /// shape `shape` with extent `sizes[i]` on `dim`; returns them concatenated along `dim`.
    /// One pass over memory.
    pub fn unpack(flat: &Tensor, shape: &[usize], dim: usize, sizes: &[usize]) -> Result<Tensor> {
        crate::ops::tensor::unpack(flat, shape, dim, sizes)
    }

    /// Elementwise `self + other`.
    pub fn add(&self, other: &Tensor) -> Result<Tensor> {
        crate::ops::tensor::add(self, other)
    }

    /// Elementwise `self += other`. On a device the sum is a new buffer that replaces this
    /// tensor's (other tensors sharing the old one keep their values, as with copy on
    /// write).
    pub fn add_assign(&mut self, other: &Tensor) -> Result<()> {
        crate::ops::tensor::add_assign(self, other)
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
        crate::ops::tensor::try_scale(self, factor)
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
        crate::ops::tensor::try_map(self, f)
    }

    /// Elementwise `self * other`.
    pub fn mul(&self, other: &Tensor) -> Result<Tensor> {
        crate::ops::tensor::mul(self, other)
    }

    /// Writes `src` into `self` at offset `start` along `dim` (the other extents must match).
    pub fn write_at(&mut self, dim: usize, start: usize, src: &Tensor) -> Result<()> {
        crate::ops::tensor::write_at(self, dim, start, src)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shape::{checked_numel, numel};

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
