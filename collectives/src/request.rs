//! Asynchronous collectives: the owned [`Buffer`] they move, the [`Request`] a caller waits
//! on, and the [`Pending`] side a backend implements.
//!
//! A blocking collective borrows its buffers for the length of the call. An asynchronous
//! one outlives the call that starts it, so it must *own* its buffers until it completes:
//! the caller moves them in at start and gets them back from [`Request::wait`]. Owning
//! them is also what makes the drop rule safe: nobody can free or reuse a buffer that a
//! peer (or MPI) may still be reading, because nobody but the request holds it.

use crate::{DType, Element, Error, Result, Slice, SliceMut};
use dtensor_kernels::{CpuStorage, StorageElement};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// An owned, dtype-erased buffer of elements: what an asynchronous collective takes and
/// gives back. A `Vec` of one of the element types, without its type in the signature (the
/// [`Communicator`](crate::Communicator) trait stays object-safe).
///
/// ```
/// use dtensor_collectives::{Buffer, DType};
/// let b = Buffer::from(vec![1.0f32, 2.0]);
/// assert_eq!((b.dtype(), b.len()), (DType::F32, 2));
/// assert_eq!(b.into_vec::<f32>().unwrap(), vec![1.0, 2.0]);
/// ```
#[derive(Clone, Debug, PartialEq)]
pub struct Buffer(CpuStorage);

impl Buffer {
    /// The buffer holding `v`.
    pub fn from_vec<T: StorageElement>(v: Vec<T>) -> Buffer {
        Buffer(T::wrap(v))
    }

    /// `len` zeros of `dtype`.
    pub fn zeros(dtype: DType, len: usize) -> Buffer {
        fn z<T: StorageElement>(len: usize) -> Buffer {
            Buffer::from_vec(vec![<T as Element>::zero(); len])
        }
        use dtensor_kernels::half::{bf16, f16};
        match dtype {
            DType::F32 => z::<f32>(len),
            DType::F64 => z::<f64>(len),
            DType::BF16 => z::<bf16>(len),
            DType::F16 => z::<f16>(len),
            DType::I32 => z::<i32>(len),
            DType::I64 => z::<i64>(len),
        }
    }

    /// The element type of the buffer.
    pub fn dtype(&self) -> DType {
        self.0.dtype()
    }

    /// The number of elements (not bytes).
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True if the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The elements, as the blocking collectives take them.
    pub fn as_slice(&self) -> Slice<'_> {
        match &self.0 {
            CpuStorage::F32(v) => Slice::F32(v),
            CpuStorage::F64(v) => Slice::F64(v),
            CpuStorage::BF16(v) => Slice::BF16(v),
            CpuStorage::F16(v) => Slice::F16(v),
            CpuStorage::I32(v) => Slice::I32(v),
            CpuStorage::I64(v) => Slice::I64(v),
        }
    }

    /// The elements, mutably, as the blocking collectives take them.
    pub fn as_slice_mut(&mut self) -> SliceMut<'_> {
        match &mut self.0 {
            CpuStorage::F32(v) => SliceMut::F32(v),
            CpuStorage::F64(v) => SliceMut::F64(v),
            CpuStorage::BF16(v) => SliceMut::BF16(v),
            CpuStorage::F16(v) => SliceMut::F16(v),
            CpuStorage::I32(v) => SliceMut::I32(v),
            CpuStorage::I64(v) => SliceMut::I64(v),
        }
    }

    /// The elements as a `Vec<T>`, or the buffer back if it does not hold `T`s.
    pub fn into_vec<T: StorageElement>(mut self) -> std::result::Result<Vec<T>, Buffer> {
        match T::view_mut(&mut self.0) {
            Some(v) => Ok(std::mem::take(v)),
            None => Err(self),
        }
    }

    /// The elements as the kernels' storage enum.
    pub fn into_storage(self) -> CpuStorage {
        self.0
    }
}

impl From<CpuStorage> for Buffer {
    fn from(s: CpuStorage) -> Buffer {
        Buffer(s)
    }
}

impl<T: StorageElement> From<Vec<T>> for Buffer {
    fn from(v: Vec<T>) -> Buffer {
        Buffer::from_vec(v)
    }
}

/// A backend's side of a [`Request`]: how to learn whether the collective has completed,
/// and how to wait for it. Implement it only to write a backend; callers use [`Request`].
/// `B` is what the collective hands back: a host [`Buffer`], or a `DeviceBuffer` for the
/// device calls (feature `cuda`).
pub trait Pending<B = Buffer>: Send {
    /// Whether the collective has completed, so that [`wait`](Pending::wait) returns at
    /// once. Never blocks.
    fn test(&mut self) -> bool;
    /// Blocks until the collective has completed and returns its result buffer, or the
    /// error the blocking call would have returned. Must return within the backend's
    /// failure bounds (the timeout), never hang.
    fn wait(self: Box<Self>) -> Result<B>;
}

/// A result known at start (the trait's stand-in implementations, and errors found before
/// anything was queued).
struct Ready<B>(Result<B>);

impl<B: Send> Pending<B> for Ready<B> {
    fn test(&mut self) -> bool {
        true
    }
    fn wait(self: Box<Self>) -> Result<B> {
        self.0
    }
}

/// An asynchronous collective in flight: started by a `start_*` method of
/// [`Communicator`](crate::Communicator) (or of [`CommunicatorExt`](crate::CommunicatorExt),
/// for `Vec`s), completed by [`wait`](Request::wait).
///
/// Rules (the same on every backend):
///
/// - **Results and errors** are the blocking call's, bit for bit: the same reduction order,
///   the same `CollectiveMismatch` on every rank when ranks disagree (from `wait`), the same
///   `RankFailed` / `Timeout` when a peer fails or never arrives. On an error the buffers
///   moved in are dropped.
/// - **Order**: a rank's collectives on one handle form one sequence in the order they are
///   issued (a request when it is started, a blocking call when it is called), and every
///   rank must issue the same sequence; whether each call is blocking or asynchronous is
///   each rank's own choice and not part of the match. Requests complete in start order;
///   they may be waited for in any order.
/// - **Mixing**: a blocking collective first waits until every request started before it
///   on the same handle has completed (their results stay in their requests), then runs.
///   `send` / `recv` are not in the sequence and do not wait.
/// - **Drop**: dropping a request without waiting *waits* for it (within the same bounds
///   as `wait`) and discards its result or error. The collective still takes its place in
///   the sequence, so later calls stay matched, and no buffer of it is in use once the
///   drop returns.
/// - **Counters** count a request once, when it completes successfully (before `wait`
///   returns), as the blocking call does.
///
/// `B` is the buffer the backend hands back (a host [`Buffer`], or for the device calls of
/// feature `cuda` a `DeviceBuffer`: see `DeviceRequest`), `T` what the caller gets from it.
#[must_use = "a request completes its collective; wait for it to get the result (dropping it waits too)"]
pub struct Request<T = Buffer, B = Buffer> {
    op: &'static str,
    /// `None` once waited for.
    pending: Option<Box<dyn Pending<B>>>,
    /// From the backend's buffer to what the caller gets (a typed `Vec` for the
    /// `CommunicatorExt` forms).
    map: fn(B) -> T,
}

impl<B: Send + 'static> Request<B, B> {
    /// A request that `pending` completes; `op` names the collective (`"all_reduce"`).
    pub fn new(op: &'static str, pending: Box<dyn Pending<B>>) -> Request<B, B> {
        Request {
            op,
            pending: Some(pending),
            map: std::convert::identity,
        }
    }

    /// A request that has already completed with `result` (for a backend that ran the
    /// collective at start).
    pub fn ready(op: &'static str, result: Result<B>) -> Request<B, B> {
        Request::new(op, Box::new(Ready(result)))
    }
}

impl Request {
    /// The same request, giving a `Vec<T>` (the buffer moved in holds `T`s, and every
    /// backend hands back buffers of the dtype it was given).
    pub(crate) fn typed<T: StorageElement>(mut self) -> Request<Vec<T>> {
        Request {
            op: self.op,
            pending: self.pending.take(),
            map: into_vec_of::<T>,
        }
    }
}

/// The typed map of [`Request::typed`].
fn into_vec_of<T: StorageElement>(b: Buffer) -> Vec<T> {
    b.into_vec::<T>().unwrap_or_else(|b| {
        panic!(
            "a backend returned a buffer of {} for a request of {}",
            b.dtype(),
            T::DTYPE
        )
    })
}

impl<T, B> Request<T, B> {
    /// The collective this request runs (`"all_reduce"`, …).
    pub fn op(&self) -> &'static str {
        self.op
    }

    /// Whether the collective has completed (so `wait` returns at once). Never blocks:
    /// poll it between pieces of work.
    pub fn test(&mut self) -> bool {
        self.pending.as_mut().is_none_or(|p| p.test())
    }

    /// Waits for the collective and returns its result buffer (for all-reduce the buffer
    /// moved in, reduced; for the gathers and reduce-scatters the `recv` buffer), or the
    /// error the blocking call would have returned.
    pub fn wait(mut self) -> Result<T> {
        let pending = self.pending.take().ok_or_else(|| Error::InvalidArgument {
            op: self.op,
            detail: "request already completed".into(),
        })?;
        pending.wait().map(self.map)
    }
}

impl<T, B> Drop for Request<T, B> {
    /// Waits for the collective and discards its outcome (see the rules above). A panic
    /// the backend re-raises from its wait is discarded too: a drop must not panic, least
    /// of all while the thread is already unwinding.
    fn drop(&mut self) {
        if let Some(pending) = self.pending.take() {
            let _ = catch_unwind(AssertUnwindSafe(move || pending.wait()));
        }
    }
}

impl<T, B> fmt::Debug for Request<T, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Request")
            .field("op", &self.op)
            .field("waited", &self.pending.is_none())
            .finish()
    }
}

#[cfg(feature = "cuda")]
pub use device::{DeviceBuffer, DeviceRequest};

/// Owned device buffers for the asynchronous device calls (feature `cuda`).
#[cfg(feature = "cuda")]
mod device {
    use super::Request;
    use crate::{DType, Error, Result};
    use dtensor_kernels::cuda::{CudaTensor, Device, DeviceView, DeviceViewMut};
    use dtensor_kernels::Tensor;

    /// An owned buffer of device memory: what an asynchronous device collective
    /// (`start_*_device`, feature `cuda`) takes and gives back, the device twin of
    /// [`Buffer`](crate::Buffer). It holds a [`CudaTensor`] (its elements, in row-major
    /// order, are the buffer; its shape comes back unchanged from
    /// [`into_tensor`](DeviceBuffer::into_tensor)).
    ///
    /// Moving the tensor in is what makes the request safe: nothing but the request can
    /// read or write the memory NCCL uses until `wait` hands it back, and an unfinished
    /// request keeps it alive. Making one from a tensor shares its buffer without a copy
    /// (`CudaTensor` buffers are reference counted); a buffer that a collective writes
    /// (all-reduce's, a `recv`) and that another tensor shares is copied first, on the
    /// device, so the write never shows through that other tensor.
    #[derive(Clone, Debug)]
    pub struct DeviceBuffer(CudaTensor);

    /// A [`Request`] of a device collective: `wait` gives back a [`DeviceBuffer`].
    pub type DeviceRequest = Request<DeviceBuffer, DeviceBuffer>;

    impl DeviceBuffer {
        /// `len` zeros of `dtype` on `device` (a flat buffer: shape `[len]`).
        pub fn zeros(device: &Device, dtype: DType, len: usize) -> Result<DeviceBuffer> {
            CudaTensor::zeros(device, &[len], dtype)
                .map(DeviceBuffer)
                .map_err(|e| device_error("DeviceBuffer::zeros", e))
        }

        /// The buffer of a device tensor (O(1): shares its memory); a host tensor is an
        /// `InvalidArgument` (device buffers hold device memory only; nothing is copied
        /// behind the caller's back).
        pub fn from_tensor(t: Tensor) -> Result<DeviceBuffer> {
            t.try_into_cuda()
                .map(DeviceBuffer)
                .map_err(|t| Error::InvalidArgument {
                    op: "DeviceBuffer::from_tensor",
                    detail: format!(
                        "a host tensor ({} x {:?}): a device buffer holds device memory \
                         (move it with Tensor::to_device first)",
                        t.dtype(),
                        t.shape()
                    ),
                })
        }

        /// The element type.
        pub fn dtype(&self) -> DType {
            self.0.dtype()
        }

        /// The number of elements (not bytes).
        pub fn len(&self) -> usize {
            self.0.numel()
        }

        /// True if the buffer holds no elements.
        pub fn is_empty(&self) -> bool {
            self.len() == 0
        }

        /// The shape of the tensor it holds.
        pub fn shape(&self) -> &[usize] {
            self.0.shape()
        }

        /// The GPU whose memory holds the buffer.
        pub fn device(&self) -> &Device {
            self.0.device()
        }

        /// A view of the elements, as the blocking `*_device` calls take them.
        pub fn view(&self) -> Result<DeviceView<'_>> {
            self.0
                .view()
                .map_err(|e| device_error("DeviceBuffer::view", e))
        }

        /// A mutable view of the elements (copied first, on the device, if another tensor
        /// shares the memory).
        pub fn view_mut(&mut self) -> Result<DeviceViewMut<'_>> {
            self.0
                .view_mut()
                .map_err(|e| device_error("DeviceBuffer::view_mut", e))
        }

        /// The tensor the buffer holds.
        pub fn as_cuda_tensor(&self) -> &CudaTensor {
            &self.0
        }

        /// The tensor the buffer holds (O(1)).
        pub fn into_cuda_tensor(self) -> CudaTensor {
            self.0
        }

        /// The elements as a device [`Tensor`] of the shape moved in (O(1)).
        pub fn into_tensor(self) -> Tensor {
            Tensor::from(self.0)
        }
    }

    impl From<CudaTensor> for DeviceBuffer {
        fn from(t: CudaTensor) -> DeviceBuffer {
            DeviceBuffer(t)
        }
    }

    /// A failure of the kernels' device code (an allocation, a copy on write), as this
    /// crate reports a library's error.
    fn device_error(op: &'static str, e: dtensor_kernels::Error) -> Error {
        Error::Library {
            op,
            backend: "cuda",
            detail: e.to_string(),
        }
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;
    use dtensor_kernels::Tensor;

    #[test]
    fn device_buffer_from_host_tensor_invalid_argument_naming_the_fix() {
        let host = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3]).unwrap();
        let e = DeviceBuffer::from_tensor(host).unwrap_err();
        assert_eq!(
            e.to_string(),
            "DeviceBuffer::from_tensor: invalid argument: a host tensor (f32 x [3]): a device \
             buffer holds device memory (move it with Tensor::to_device first)"
        );
    }

    #[test]
    fn ready_device_request_hands_back_its_result() {
        let mut r: DeviceRequest = Request::ready(
            "all_gather",
            Err(Error::InvalidArgument {
                op: "all_gather",
                detail: "x".into(),
            }),
        );
        assert!(r.test());
        assert_eq!(r.op(), "all_gather");
        assert!(matches!(r.wait(), Err(Error::InvalidArgument { .. })));
    }
}
