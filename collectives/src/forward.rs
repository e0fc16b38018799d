//! [`Forward`]: a communicator that wraps another and changes only some of its calls.

use crate::{Buffer, Communicator, CounterSnapshot, ReduceOp, Request, Result, Slice, SliceMut};
use std::sync::Arc;

#[cfg(feature = "cuda")]
use crate::{DeviceBuffer, DeviceRequest};
#[cfg(feature = "cuda")]
use dtensor_kernels::cuda::{DeviceView, DeviceViewMut};

/// Writes [`Forward`] (each method defaulting to the inner communicator's) and the blanket
/// [`Communicator`] impl (each method calling `Forward`'s) from one list of the
/// communicator's methods.
macro_rules! forwarding {
    ($(
        $(#[cfg($cfg:meta)])?
        fn $name:ident(&self $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)?;
    )*) => {
        /// A communicator that wraps another and overrides only the calls it changes.
        ///
        /// A wrapper (the [`unbuffered`](crate::unbuffered) emulator, for one) implements
        /// `Forward`: [`inner`](Forward::inner) names the wrapped communicator, and the
        /// wrapper overrides the calls it changes.
        /// Every other [`Communicator`] call goes to the inner communicator unchanged,
        /// through the blanket `impl<W: Forward> Communicator for W`; a method added to
        /// [`Communicator`] is added once to the list this trait is written from, and every
        /// wrapper forwards it. A call a wrapper does not override is the inner
        /// communicator's, never the trait's default: an adapter whose other calls must run
        /// the defaults over its own (the NCCL conformance suite's host-to-device staging)
        /// implements [`Communicator`] itself.
        ///
        /// A `Forward` type has each method twice (as `Forward`'s and, through the blanket
        /// impl, as [`Communicator`]'s), so a call on the concrete type needs only one of the
        /// two traits in scope: implement `Forward` by its path, and inside that impl (where
        /// `Forward` is in scope) call the wrapper's own methods as
        /// `Communicator::name(self, …)`.
        ///
        /// ```
        /// use dtensor_collectives::{threads, Communicator, CommunicatorExt, ReduceOp};
        ///
        /// /// Reports another backend name; otherwise the inner communicator.
        /// struct Renamed(std::sync::Arc<dyn Communicator>);
        ///
        /// impl dtensor_collectives::Forward for Renamed {
        ///     fn inner(&self) -> &dyn Communicator {
        ///         &*self.0
        ///     }
        ///     fn backend(&self) -> &'static str {
        ///         "renamed"
        ///     }
        /// }
        ///
        /// let results = threads::launch(2, |world| {
        ///     let comm = Renamed(world);
        ///     let mut v = [comm.rank() as f32 + 1.0];
        ///     comm.all_reduce_in_place(&mut v, ReduceOp::Sum)?;
        ///     Ok::<_, dtensor_collectives::Error>((comm.backend(), v[0]))
        /// });
        /// for r in results {
        ///     assert_eq!(r.unwrap(), ("renamed", 3.0));
        /// }
        /// ```
        pub trait Forward: Send + Sync {
            /// The wrapped communicator, which every call this wrapper does not override
            /// goes to.
            fn inner(&self) -> &dyn Communicator;
            $(
                $(#[cfg($cfg)])?
                #[doc = concat!(
                    "[`Communicator::", stringify!($name),
                    "`]; the inner communicator's unless overridden."
                )]
                fn $name(&self $(, $arg: $ty)*) $(-> $ret)? {
                    self.inner().$name($($arg),*)
                }
            )*
        }

        impl<W: Forward> Communicator for W {
            $(
                $(#[cfg($cfg)])?
                fn $name(&self $(, $arg: $ty)*) $(-> $ret)? {
                    Forward::$name(self $(, $arg)*)
                }
            )*
        }
    };
}

forwarding! {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    fn backend(&self) -> &'static str;
    fn device(&self) -> Option<dtensor_kernels::cuda::Device>;
    fn all_reduce(&self, buf: SliceMut<'_>, op: ReduceOp) -> Result<()>;
    fn all_gather(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()>;
    fn all_gatherv(&self, send: Slice<'_>, recv: SliceMut<'_>, counts: &[usize]) -> Result<()>;
    fn all_gatherv_in_place(&self, buf: SliceMut<'_>, counts: &[usize]) -> Result<()>;
    fn reduce_scatterv_in_place(&self, buf: SliceMut<'_>, counts: &[usize], op: ReduceOp)
        -> Result<()>;
    fn all_gather_cols(&self, send: Slice<'_>, recv: SliceMut<'_>, rows: usize,
        widths: &[usize]) -> Result<()>;
    fn reduce_scatter_cols(&self, send: Slice<'_>, recv: SliceMut<'_>, rows: usize,
        widths: &[usize], op: ReduceOp) -> Result<()>;
    fn all_to_all_cols(&self, send: Slice<'_>, rows: usize, send_widths: &[usize],
        recv: SliceMut<'_>, recv_counts: &[usize]) -> Result<()>;
    fn reduce_scatter(&self, send: Slice<'_>, recv: SliceMut<'_>, op: ReduceOp) -> Result<()>;
    fn reduce_scatterv(&self, send: Slice<'_>, recv: SliceMut<'_>, counts: &[usize],
        op: ReduceOp) -> Result<()>;
    fn all_to_all(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()>;
    fn all_to_allv(&self, send: Slice<'_>, send_counts: &[usize], recv: SliceMut<'_>,
        recv_counts: &[usize]) -> Result<()>;
    fn broadcast(&self, buf: SliceMut<'_>, root: usize) -> Result<()>;
    fn send(&self, buf: Slice<'_>, dst: usize, tag: u32) -> Result<()>;
    fn recv(&self, buf: SliceMut<'_>, src: usize, tag: u32) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>>;
    #[cfg(feature = "cuda")]
    fn all_reduce_device(&self, buf: DeviceViewMut<'_>, op: ReduceOp) -> Result<()>;
    #[cfg(feature = "cuda")]
    fn all_gather_device(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()>;
    #[cfg(feature = "cuda")]
    fn all_gatherv_device(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>,
        counts: &[usize]) -> Result<()>;
    #[cfg(feature = "cuda")]
    fn reduce_scatter_device(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>,
        op: ReduceOp) -> Result<()>;
    #[cfg(feature = "cuda")]
    fn reduce_scatterv_device(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>,
        counts: &[usize], op: ReduceOp) -> Result<()>;
    #[cfg(feature = "cuda")]
    fn all_to_all_device(&self, send: DeviceView<'_>, recv: DeviceViewMut<'_>) -> Result<()>;
    #[cfg(feature = "cuda")]
    fn all_to_allv_device(&self, send: DeviceView<'_>, send_counts: &[usize],
        recv: DeviceViewMut<'_>, recv_counts: &[usize]) -> Result<()>;
    #[cfg(feature = "cuda")]
    fn broadcast_device(&self, buf: DeviceViewMut<'_>, root: usize) -> Result<()>;
    #[cfg(feature = "cuda")]
    fn send_device(&self, buf: DeviceView<'_>, dst: usize, tag: u32) -> Result<()>;
    #[cfg(feature = "cuda")]
    fn recv_device(&self, buf: DeviceViewMut<'_>, src: usize, tag: u32) -> Result<()>;
    fn counters(&self) -> CounterSnapshot;
    fn set_label(&self, label: &'static str);
    fn start_all_reduce(&self, buf: Buffer, op: ReduceOp) -> Request;
    fn start_all_gather(&self, send: Buffer, recv: Buffer) -> Request;
    fn start_all_gatherv(&self, send: Buffer, recv: Buffer, counts: &[usize]) -> Request;
    fn start_reduce_scatter(&self, send: Buffer, recv: Buffer, op: ReduceOp) -> Request;
    fn start_reduce_scatterv(&self, send: Buffer, recv: Buffer, counts: &[usize],
        op: ReduceOp) -> Request;
    #[cfg(feature = "cuda")]
    fn start_all_reduce_device(&self, buf: DeviceBuffer, op: ReduceOp) -> DeviceRequest;
    #[cfg(feature = "cuda")]
    fn start_all_gather_device(&self, send: DeviceBuffer, recv: DeviceBuffer) -> DeviceRequest;
    #[cfg(feature = "cuda")]
    fn start_all_gatherv_device(&self, send: DeviceBuffer, recv: DeviceBuffer,
        counts: &[usize]) -> DeviceRequest;
    #[cfg(feature = "cuda")]
    fn start_reduce_scatter_device(&self, send: DeviceBuffer, recv: DeviceBuffer,
        op: ReduceOp) -> DeviceRequest;
    #[cfg(feature = "cuda")]
    fn start_reduce_scatterv_device(&self, send: DeviceBuffer, recv: DeviceBuffer,
        counts: &[usize], op: ReduceOp) -> DeviceRequest;
}
