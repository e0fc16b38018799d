//! **Test harness only: the conformance suite on NCCL, through host staging.**
//!
//! The suite's cases move host memory ([`Slice`], [`SliceMut`]); the NCCL backend moves
//! device memory only and refuses host buffers. [`Staging`] wraps an [`NcclComm`] and
//! implements the host methods by copying every buffer to a fresh device buffer, calling
//! the backend's `*_device` method, and copying the result back (synchronizing the stream
//! after each copy). It exists so that the one conformance suite runs on NCCL too
//! (`tests/nccl_conformance.rs`); it is never a way to use the backend:
//!
//! - **The GPU path never stages through the host.** Model code passes device buffers to
//!   the `*_device` methods; `NcclComm`'s own host methods keep refusing host buffers.
//! - It is slow by design (two host↔device copies and allocations per buffer per call)
//!   and its timings mean nothing.
//! - What it adds itself is only glue: the in-place calls copy the rank's own block into a
//!   separate device send buffer (NCCL has no in-place variants of the uneven calls), the
//!   column-block calls are the trait's defaults over the staged calls, and the
//!   asynchronous `start_*` calls copy their buffers in at start, hand them to the
//!   backend's `start_*_device`, and copy the result out in `wait`. Everything the
//!   suite checks about agreement, mismatches, counters and data comes from NCCL and
//!   `NcclComm`.
//!
//! [`UNSUPPORTED`] is what the NCCL backend declares; each entry says why.

use super::Need;
use crate::nccl::NcclComm;
use crate::{
    Buffer, Communicator, CounterSnapshot, DeviceBuffer, DeviceRequest, Error, Pending, ReduceOp,
    Request, Result, Slice, SliceMut,
};
use cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use dtensor_kernels::cuda::{CudaBuffer, DeviceView, DeviceViewMut};
use dtensor_kernels::Tensor;
use half::{bf16, f16};
use std::sync::Arc;

/// The capabilities the NCCL backend lacks, with the reason a case that needs one is
/// reported `unsupported`.
pub const UNSUPPORTED: &[(Need, &str)] = &[
    (
        Need::Overlap,
        "requests progress on the rank's NCCL worker, and send/recv queue on that same \
         worker behind them: the case's send that lets the peers start would wait for the \
         request it is meant to unblock",
    ),
    (
        Need::SharedHandle,
        "a rank's calls serialize on its one worker thread, so a second thread's call waits \
         instead of being refused",
    ),
    (
        Need::ColumnRowAgreement,
        "no device column-block calls: the trait's defaults agree on element counts only",
    ),
    (
        Need::RankOrderedReduction,
        "NCCL chooses the reduction order (ring/tree); replicas are bitwise equal to each \
         other, not to the left-to-right sum",
    ),
    (
        Need::BufferedSend,
        "NCCL sends wait for the matching receive (no buffering)",
    ),
    (
        Need::TagMatching,
        "NCCL has no tags: messages between a pair arrive in call order, the tag is only checked",
    ),
];

const BACKEND: &str = "nccl";

/// An [`NcclComm`] whose host methods stage through device buffers (see the module docs:
/// conformance runs only).
pub struct Staging {
    comm: Arc<NcclComm>,
}

impl Staging {
    /// Wraps one rank's NCCL communicator.
    pub fn new(comm: Arc<NcclComm>) -> Staging {
        Staging { comm }
    }

    fn stream(&self) -> &Arc<CudaStream> {
        self.comm.device().stream()
    }

    /// A device copy of `host` (at least one element allocated: CUDA refuses empty
    /// allocations; views cover `host.len()` elements).
    fn upload(&self, op: &'static str, host: Slice<'_>) -> Result<Staged> {
        let st = self.stream();
        let len = host.len();
        let buf = match host {
            Slice::F32(h) => put(st, h).map(CudaBuffer::F32),
            Slice::F64(h) => put(st, h).map(CudaBuffer::F64),
            Slice::BF16(h) => {
                put(st, &h.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).map(CudaBuffer::BF16)
            }
            Slice::F16(h) => {
                put(st, &h.iter().map(|x| x.to_bits()).collect::<Vec<_>>()).map(CudaBuffer::F16)
            }
            Slice::I32(h) => put(st, h).map(CudaBuffer::I32),
            Slice::I64(h) => put(st, h).map(CudaBuffer::I64),
        }
        .map_err(|e| staging_error(op, "host-to-device copy", e))?;
        st.synchronize()
            .map_err(|e| staging_error(op, "host-to-device copy", e))?;
        Ok(Staged { buf, len })
    }

    /// Copies the device buffer back into `host` (same dtype and length by construction).
    fn download(&self, op: &'static str, staged: &Staged, host: SliceMut<'_>) -> Result<()> {
        let st = self.stream();
        let err = |e| staging_error(op, "device-to-host copy", e);
        if host.len() != staged.len || host.dtype() != staged.buf.dtype() {
            return Err(Error::InvalidArgument {
                op,
                detail: format!(
                    "staging: a {} buffer of {} elements came back for a {} buffer of {}",
                    staged.buf.dtype(),
                    staged.len,
                    host.dtype(),
                    host.len()
                ),
            });
        }
        if staged.len == 0 {
            return Ok(());
        }
        match (&staged.buf, host) {
            (CudaBuffer::F32(d), SliceMut::F32(h)) => get(st, d, h).map_err(err)?,
            (CudaBuffer::F64(d), SliceMut::F64(h)) => get(st, d, h).map_err(err)?,
            (CudaBuffer::I32(d), SliceMut::I32(h)) => get(st, d, h).map_err(err)?,
            (CudaBuffer::I64(d), SliceMut::I64(h)) => get(st, d, h).map_err(err)?,
            (CudaBuffer::BF16(d), SliceMut::BF16(h)) => {
                let mut bits = vec![0u16; h.len()];
                get(st, d, &mut bits).map_err(err)?;
                for (x, b) in h.iter_mut().zip(bits) {
                    *x = bf16::from_bits(b);
                }
            }
            (CudaBuffer::F16(d), SliceMut::F16(h)) => {
                let mut bits = vec![0u16; h.len()];
                get(st, d, &mut bits).map_err(err)?;
                for (x, b) in h.iter_mut().zip(bits) {
                    *x = f16::from_bits(b);
                }
            }
            _ => unreachable!("dtype checked above"),
        }
        st.synchronize().map_err(err)
    }

    /// Stages `send` in, calls `device` with the two device views, stages `recv` back.
    fn send_recv(
        &self,
        op: &'static str,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        device: impl FnOnce(DeviceView<'_>, DeviceViewMut<'_>) -> Result<()>,
    ) -> Result<()> {
        let s = self.upload(op, send)?;
        let mut r = self.upload(op, recv.as_slice())?;
        {
            let sv = s.view(op)?;
            let rv = r.view_mut(op)?;
            device(sv, rv)?;
        }
        self.download(op, &r, recv)
    }

    /// Stages `buf` in, calls `device` on its device view, stages it back.
    fn in_out(
        &self,
        op: &'static str,
        buf: SliceMut<'_>,
        device: impl FnOnce(DeviceViewMut<'_>) -> Result<()>,
    ) -> Result<()> {
        let mut d = self.upload(op, buf.as_slice())?;
        device(d.view_mut(op)?)?;
        self.download(op, &d, buf)
    }

    /// The in-place calls' own check, with the wording of the threads and MPI backends.
    fn in_place_fits(&self, buf: &SliceMut<'_>, counts: &[usize]) -> Option<String> {
        let total = counts.iter().try_fold(0usize, |a, &c| a.checked_add(c));
        match total {
            _ if counts.len() != self.size() => Some(format!(
                "counts: {} counts for {} ranks",
                counts.len(),
                self.size()
            )),
            None => Some(format!("counts {counts:?} overflow usize")),
            Some(t) if t != buf.len() => Some(format!(
                "buffer has {} elements but counts sum to {t}",
                buf.len()
            )),
            Some(_) => None,
        }
    }

    /// This rank's block of `counts`, `(offset, len)`, saturating: the counts may be
    /// invalid (`in_place_fits` says why).
    fn own_block(&self, counts: &[usize]) -> (usize, usize) {
        let me = self.rank();
        let off = counts
            .iter()
            .take(me)
            .fold(0usize, |a, &c| a.saturating_add(c));
        (off, counts.get(me).copied().unwrap_or(0))
    }
}

/// An in-place call's result: an invalid-argument error from the call it staged through is
/// named for the in-place `op`, with the reason `in_place_fits` found.
fn in_place_result(op: &'static str, result: Result<()>, invalid: Option<String>) -> Result<()> {
    match (result, invalid) {
        (Err(Error::InvalidArgument { .. }), Some(detail)) => {
            Err(Error::InvalidArgument { op, detail })
        }
        (r, _) => r,
    }
}

impl Staging {
    /// A device copy of a request's host buffer, as the backend's `start_*_device` takes it.
    fn upload_owned(&self, op: &'static str, host: Buffer) -> Result<DeviceBuffer> {
        let err = |e| staging_error(op, "host-to-device copy", e);
        let len = host.len();
        let t = Tensor::from_cpu_storage(&[len], host.into_storage()).map_err(err)?;
        let d = t.to_device(self.comm.device()).map_err(err)?;
        self.stream()
            .synchronize()
            .map_err(|e| staging_error(op, "host-to-device copy", e))?;
        DeviceBuffer::from_tensor(d)
    }

    /// Stages a request's buffer in and starts the device call with it; the request
    /// stages its result back when waited for.
    fn start_staged(
        &self,
        op: &'static str,
        buf: Buffer,
        start: impl FnOnce(&NcclComm, DeviceBuffer) -> DeviceRequest,
    ) -> Request {
        match self.upload_owned(op, buf) {
            Ok(d) => Request::new(op, Box::new(Unstage(start(&self.comm, d)))),
            Err(e) => Request::ready(op, Err(e)),
        }
    }

    /// [`start_staged`](Self::start_staged) of a call with a send and a recv buffer.
    fn start_staged2(
        &self,
        op: &'static str,
        send: Buffer,
        recv: Buffer,
        start: impl FnOnce(&NcclComm, DeviceBuffer, DeviceBuffer) -> DeviceRequest,
    ) -> Request {
        match self.upload_owned(op, send) {
            Ok(s) => self.start_staged(op, recv, |c, r| start(c, s, r)),
            Err(e) => Request::ready(op, Err(e)),
        }
    }
}

/// A staged request: the backend's device request, its result copied back to the host
/// when waited for.
struct Unstage(DeviceRequest);

impl Pending for Unstage {
    fn test(&mut self) -> bool {
        self.0.test()
    }
    fn wait(self: Box<Self>) -> Result<Buffer> {
        let op = self.0.op();
        let err = |e| staging_error(op, "device-to-host copy", e);
        let host = self.0.wait()?.into_tensor().to_host().map_err(err)?;
        Ok(Buffer::from(host.to_storage().map_err(err)?))
    }
}

/// A staged device buffer: `len` elements in use of `buf` (which holds at least one).
struct Staged {
    buf: CudaBuffer,
    len: usize,
}

impl Staged {
    fn view(&self, op: &'static str) -> Result<DeviceView<'_>> {
        self.buf
            .view(0..self.len)
            .map_err(|e| Error::InvalidArgument {
                op,
                detail: format!("staging: {e}"),
            })
    }
    fn view_mut(&mut self, op: &'static str) -> Result<DeviceViewMut<'_>> {
        let len = self.len;
        self.buf
            .view_mut(0..len)
            .map_err(|e| Error::InvalidArgument {
                op,
                detail: format!("staging: {e}"),
            })
    }
}

fn put<T: DeviceRepr + ValidAsZeroBits>(
    st: &Arc<CudaStream>,
    host: &[T],
) -> std::result::Result<CudaSlice<T>, cudarc::driver::DriverError> {
    let mut d = st.alloc_zeros::<T>(host.len().max(1))?;
    if !host.is_empty() {
        st.memcpy_htod(host, &mut d)?;
    }
    Ok(d)
}

/// Copies the first `host.len()` elements of `d` (which holds at least that many) to `host`.
fn get<T: DeviceRepr>(
    st: &Arc<CudaStream>,
    d: &CudaSlice<T>,
    host: &mut [T],
) -> std::result::Result<(), cudarc::driver::DriverError> {
    match d.try_slice(0..host.len()) {
        Some(v) => st.memcpy_dtoh(&v, host),
        None => Err(cudarc::driver::DriverError(
            cudarc::driver::sys::cudaError_enum::CUDA_ERROR_INVALID_VALUE,
        )),
    }
}

fn staging_error(op: &'static str, what: &str, e: impl std::fmt::Display) -> Error {
    Error::Library {
        op,
        backend: BACKEND,
        detail: format!("staging ({what}, conformance harness): {e}"),
    }
}

// Not a `Forward`: the column-block calls it does not stage must run the trait's defaults
// over its staged calls, where the backend's own host calls would refuse host buffers.
impl Communicator for Staging {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn size(&self) -> usize {
        self.comm.size()
    }
    fn backend(&self) -> &'static str {
        self.comm.backend()
    }

    fn all_reduce(&self, buf: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        self.in_out("all_reduce", buf, |d| self.comm.all_reduce_device(d, op))
    }
    fn all_gather(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()> {
        self.send_recv("all_gather", send, recv, |s, r| {
            self.comm.all_gather_device(s, r)
        })
    }
    fn all_gatherv(&self, send: Slice<'_>, recv: SliceMut<'_>, counts: &[usize]) -> Result<()> {
        self.send_recv("all_gatherv", send, recv, |s, r| {
            self.comm.all_gatherv_device(s, r, counts)
        })
    }
    fn all_gatherv_in_place(&self, buf: SliceMut<'_>, counts: &[usize]) -> Result<()> {
        const OP: &str = "all_gatherv_in_place";
        let invalid = self.in_place_fits(&buf, counts);
        let (off, len) = self.own_block(counts);
        // The own block as a separate send buffer (NCCL's uneven all-gather is grouped
        // sends and receives between distinct buffers); invalid arguments still join
        // the agreement, with a send that cannot fit, so the peers learn of them.
        let result = dtensor_kernels::with_slice!(SliceMut, buf, |b: T| {
            let send: Vec<T> = if invalid.is_none() {
                b[off..off + len].to_vec()
            } else {
                Vec::new()
            };
            self.all_gatherv(
                <T as crate::Element>::slice(&send),
                <T as crate::Element>::slice_mut(b),
                counts,
            )
        });
        in_place_result(OP, result, invalid)
    }
    fn reduce_scatterv_in_place(
        &self,
        buf: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        const OP: &str = "reduce_scatterv_in_place";
        let invalid = self.in_place_fits(&buf, counts);
        let (off, len) = self.own_block(counts);
        let result = dtensor_kernels::with_slice!(SliceMut, buf, |b: T| {
            let mut out: Vec<T> = vec![<T as crate::Element>::zero(); len];
            self.reduce_scatterv(
                <T as crate::Element>::slice(b),
                <T as crate::Element>::slice_mut(&mut out),
                counts,
                op,
            )?;
            b[off..off + len].copy_from_slice(&out);
            Ok(())
        });
        in_place_result(OP, result, invalid)
    }
    fn reduce_scatter(&self, send: Slice<'_>, recv: SliceMut<'_>, op: ReduceOp) -> Result<()> {
        self.send_recv("reduce_scatter", send, recv, |s, r| {
            self.comm.reduce_scatter_device(s, r, op)
        })
    }
    fn reduce_scatterv(
        &self,
        send: Slice<'_>,
        recv: SliceMut<'_>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<()> {
        self.send_recv("reduce_scatterv", send, recv, |s, r| {
            self.comm.reduce_scatterv_device(s, r, counts, op)
        })
    }
    fn all_to_all(&self, send: Slice<'_>, recv: SliceMut<'_>) -> Result<()> {
        self.send_recv("all_to_all", send, recv, |s, r| {
            self.comm.all_to_all_device(s, r)
        })
    }
    fn all_to_allv(
        &self,
        send: Slice<'_>,
        send_counts: &[usize],
        recv: SliceMut<'_>,
        recv_counts: &[usize],
    ) -> Result<()> {
        self.send_recv("all_to_allv", send, recv, |s, r| {
            self.comm.all_to_allv_device(s, send_counts, r, recv_counts)
        })
    }
    fn broadcast(&self, buf: SliceMut<'_>, root: usize) -> Result<()> {
        self.in_out("broadcast", buf, |d| self.comm.broadcast_device(d, root))
    }
    fn send(&self, buf: Slice<'_>, dst: usize, tag: u32) -> Result<()> {
        let d = self.upload("send", buf)?;
        self.comm.send_device(d.view("send")?, dst, tag)
    }
    fn recv(&self, buf: SliceMut<'_>, src: usize, tag: u32) -> Result<()> {
        self.in_out("recv", buf, |d| self.comm.recv_device(d, src, tag))
    }
    fn barrier(&self) -> Result<()> {
        self.comm.barrier()
    }
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        let sub = self.comm.split_nccl(color, key)?;
        Ok(Arc::new(Staging::new(Arc::new(sub))))
    }
    fn counters(&self) -> CounterSnapshot {
        self.comm.counters()
    }
    fn set_label(&self, label: &'static str) {
        self.comm.set_label(label);
    }

    // The asynchronous calls stage their buffers in at start and out at `wait`; in between
    // the request is the backend's own (`start_*_device`), so the async cases check its
    // ordering, drop, mixing, counters and errors.
    fn start_all_reduce(&self, buf: Buffer, op: ReduceOp) -> Request {
        self.start_staged("all_reduce", buf, |c, b| c.start_all_reduce_device(b, op))
    }
    fn start_all_gather(&self, send: Buffer, recv: Buffer) -> Request {
        self.start_staged2("all_gather", send, recv, |c, s, r| {
            c.start_all_gather_device(s, r)
        })
    }
    fn start_all_gatherv(&self, send: Buffer, recv: Buffer, counts: &[usize]) -> Request {
        self.start_staged2("all_gatherv", send, recv, |c, s, r| {
            c.start_all_gatherv_device(s, r, counts)
        })
    }
    fn start_reduce_scatter(&self, send: Buffer, recv: Buffer, op: ReduceOp) -> Request {
        self.start_staged2("reduce_scatter", send, recv, |c, s, r| {
            c.start_reduce_scatter_device(s, r, op)
        })
    }
    fn start_reduce_scatterv(
        &self,
        send: Buffer,
        recv: Buffer,
        counts: &[usize],
        op: ReduceOp,
    ) -> Request {
        self.start_staged2("reduce_scatterv", send, recv, |c, s, r| {
            c.start_reduce_scatterv_device(s, r, counts, op)
        })
    }
}
