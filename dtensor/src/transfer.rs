//! Collectives on [`Tensor`]s: the one place that hands a communicator a tensor's elements,
//! as host slices ([`Slice`](dtensor_collectives::Slice)) or, for a tensor in GPU memory,
//! device views (the `*_device` calls, feature `cuda`). Every data-moving call site of this
//! crate goes through here, so the same redistribution code runs on the threads and MPI
//! backends (host memory) and on NCCL (device memory), and no path stages device memory
//! through the host.
//!
//! | call | host tensors | device tensors |
//! |---|---|---|
//! | [`all_reduce`], [`broadcast`], [`all_to_all`], [`all_to_allv`], [`send`], [`recv`] | the host call | its `*_device` twin |
//! | [`all_gatherv`] | in place around the own piece when it already sits in a buffer of the full size (as before) | `all_gatherv_device` into a new buffer |
//! | [`reduce_scatterv`] | `reduce_scatterv` into a new buffer of the block's size (pooled) | `reduce_scatterv_device` into a new buffer |
//! | [`all_gather_cols`], [`reduce_scatter_cols`], [`all_to_all_cols`] | the backend's column call | the contiguous device call, the column blocks packed / unpacked by the device `pack` / `unpack` kernels |
//! | [`start_all_gatherv`], [`start_all_reduce`] | the backend's asynchronous call | the backend's asynchronous device call (`start_*_device`: on NCCL, queued on its stream and completed by an event) |
//! | [`shift`] (a ring hop) | odd ranks receive first, even ranks send first (as on the device, although host sends are buffered) | the same (NCCL sends wait for their receiver) |
//! | [`all_reduce_values`], [`broadcast_values`], [`all_to_all_values`], [`all_gather_values`], [`all_gatherv_values`] (headers, loss pieces, a norm, MoE counts, checkpoint agreements and shard records: a few host values) | the host call | up to the device, the device call, back |
//!
//! Operands in different places (host and device, or two GPUs) are an
//! [`Error::Kernel`](crate::Error::Kernel)`(DeviceMismatch)`; a device tensor handed to a
//! host-memory backend (or a host tensor to NCCL) gets the backend's own refusal.

use crate::error::Result;
use dtensor_collectives::{Buffer, Communicator, ReduceOp, Request};
use dtensor_kernels::{StorageElement, Tensor};

/// Where a tensor's elements are, as errors name it.
fn place(t: &Tensor) -> String {
    match t.device() {
        None => "host".into(),
        Some(d) => format!("cuda:{}", d.ordinal()),
    }
}

/// `DeviceMismatch` unless every operand is in the same place.
fn common_device(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    let first = ts.first().and_then(|t| t.device());
    if let Some(other) = ts.iter().find(|t| t.device() != first) {
        return Err(dtensor_kernels::Error::DeviceMismatch {
            op,
            lhs: place(ts[0]),
            rhs: place(other),
        }
        .into());
    }
    Ok(())
}

/// `buf` reduced across the group, in place (copied first only if another tensor shares
/// its buffer).
pub fn all_reduce(comm: &dyn Communicator, buf: &mut Tensor, op: ReduceOp) -> Result<()> {
    #[cfg(feature = "cuda")]
    if buf.is_cuda() {
        return Ok(comm.all_reduce_device(buf.device_view_mut()?, op)?);
    }
    Ok(comm.all_reduce(buf.try_as_dyn_slice_mut()?, op)?)
}

/// `root`'s `buf` copied into every other rank's `buf`.
pub fn broadcast(comm: &dyn Communicator, buf: &mut Tensor, root: usize) -> Result<()> {
    #[cfg(feature = "cuda")]
    if buf.is_cuda() {
        return Ok(comm.broadcast_device(buf.device_view_mut()?, root)?);
    }
    Ok(comm.broadcast(buf.try_as_dyn_slice_mut()?, root)?)
}

/// Equal-block all-to-all from `send` into `recv` (same element count).
pub fn all_to_all(comm: &dyn Communicator, send: &Tensor, recv: &mut Tensor) -> Result<()> {
    common_device("all_to_all", &[send, recv])?;
    #[cfg(feature = "cuda")]
    if send.is_cuda() {
        return Ok(comm.all_to_all_device(send.device_view()?, recv.device_view_mut()?)?);
    }
    Ok(comm.all_to_all(send.try_as_dyn_slice()?, recv.try_as_dyn_slice_mut()?)?)
}

/// Uneven all-to-all of flat blocks (see
/// [`Communicator::all_to_allv`]).
pub fn all_to_allv(
    comm: &dyn Communicator,
    send: &Tensor,
    send_counts: &[usize],
    recv: &mut Tensor,
    recv_counts: &[usize],
) -> Result<()> {
    common_device("all_to_allv", &[send, recv])?;
    #[cfg(feature = "cuda")]
    if send.is_cuda() {
        return Ok(comm.all_to_allv_device(
            send.device_view()?,
            send_counts,
            recv.device_view_mut()?,
            recv_counts,
        )?);
    }
    Ok(comm.all_to_allv(
        send.try_as_dyn_slice()?,
        send_counts,
        recv.try_as_dyn_slice_mut()?,
        recv_counts,
    )?)
}

/// Sends `t` to rank `dst` with `tag` (a device send may wait for its receiver; see the
/// NCCL backend).
pub fn send(comm: &dyn Communicator, t: &Tensor, dst: usize, tag: u32) -> Result<()> {
    #[cfg(feature = "cuda")]
    if t.is_cuda() {
        return Ok(comm.send_device(t.device_view()?, dst, tag)?);
    }
    Ok(comm.send(t.try_as_dyn_slice()?, dst, tag)?)
}

/// Receives into `t` what rank `src` sent with `tag`.
pub fn recv(comm: &dyn Communicator, t: &mut Tensor, src: usize, tag: u32) -> Result<()> {
    #[cfg(feature = "cuda")]
    if t.is_cuda() {
        return Ok(comm.recv_device(t.device_view_mut()?, src, tag)?);
    }
    Ok(comm.recv(t.try_as_dyn_slice_mut()?, src, tag)?)
}

/// A tensor of `like`'s shape and dtype, where `like` is, received from rank `src`.
pub fn recv_like(comm: &dyn Communicator, like: &Tensor, src: usize, tag: u32) -> Result<Tensor> {
    let mut t = match like.device() {
        None => Tensor::try_for_overwrite(like.shape(), like.dtype())?,
        Some(d) => Tensor::zeros_on(Some(d), like.shape(), like.dtype())?,
    };
    recv(comm, &mut t, src, tag)?;
    Ok(t)
}

/// Sends `t` to rank `dst` and returns what rank `src` sent with `tag` (a tensor like `t`,
/// where `t` is): one hop of a ring. A device send waits for its receiver (NCCL has no
/// buffering), so the odd ranks receive first and the even ones send first, which leaves
/// no cycle of waiting senders in a ring of two or more (odd sizes too: the last, even
/// rank's send meets rank 0's receive, which follows rank 0's send to the odd rank 1).
/// The host does the same although its backends buffer, so that the host tests run the
/// order the GPU path runs: over the unbuffered emulator
/// (`dtensor_collectives::unbuffered`) a ring attention completes only in this order.
pub fn shift(
    comm: &dyn Communicator,
    t: &Tensor,
    dst: usize,
    src: usize,
    tag: u32,
) -> Result<Tensor> {
    if comm.rank() % 2 == 1 {
        let got = recv_like(comm, t, src, tag)?;
        send(comm, t, dst, tag)?;
        return Ok(got);
    }
    send(comm, t, dst, tag)?;
    recv_like(comm, t, src, tag)
}

/// Uneven all-gather of flat pieces: this rank's `local` (`counts[rank]` elements) and the
/// peers' pieces, one after another in rank order, as a flat tensor of `Σ counts` elements
/// where `local` is.
///
/// On the host, if `local` is a view at its own place in an unshared buffer of the full
/// size (it came from `chunk`), the peers' pieces are gathered around it: its bytes never
/// move. On a device the pieces land in a new buffer.
pub fn all_gatherv(comm: &dyn Communicator, local: Tensor, counts: &[usize]) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if local.is_cuda() {
        return device::all_gatherv(comm, &local, counts);
    }
    let total: usize = counts.iter().sum();
    let me = comm.rank();
    let my_offset: usize = counts[..me.min(counts.len())].iter().sum();
    let mine = counts.get(me).copied().unwrap_or(0);
    let mut out = match local.try_into_buffer() {
        Ok((buf, off)) if buf.numel() == total && off == my_offset => buf,
        Ok((buf, off)) => buf.narrow(0, off, mine)?.reshape(&[mine])?,
        Err(local) => {
            let n = local.numel();
            local.reshape(&[n])?
        }
    };
    if out.numel() == total {
        comm.all_gatherv_in_place(out.try_as_dyn_slice_mut()?, counts)?;
        return Ok(out);
    }
    let mut gathered = Tensor::try_for_overwrite(&[total], out.dtype())?;
    comm.all_gatherv(
        out.try_as_dyn_slice()?,
        gathered.try_as_dyn_slice_mut()?,
        counts,
    )?;
    Ok(gathered)
}

/// Uneven reduce-scatter of flat blocks: `send` holds blocks of `counts[0], counts[1], …`;
/// returns this rank's block reduced over the group, flat, where `send` is.
///
/// The result lands in a buffer of the block's size from the rank's pool, never in
/// `send`'s: a view of `send` would keep the whole buffer alive (n times a shard's
/// memory, which FSDP and ZeRO gradients must not hold), and reducing into `send` first
/// costs a second pass, the copy of the block out. The reduction order is the backend's
/// one (rank order on the host backends), as in place.
pub fn reduce_scatterv(
    comm: &dyn Communicator,
    send: Tensor,
    counts: &[usize],
    op: ReduceOp,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if send.is_cuda() {
        return device::reduce_scatterv(comm, &send, counts, op);
    }
    let mine = counts.get(comm.rank()).copied().unwrap_or(0);
    let mut block = Tensor::try_for_overwrite(&[mine], send.dtype())?;
    comm.reduce_scatterv(
        send.try_as_dyn_slice()?,
        block.try_as_dyn_slice_mut()?,
        counts,
        op,
    )?;
    Ok(block)
}

/// Column-block all-gather: `local` is a row-major `rows × widths[rank]` matrix; returns
/// the `rows × Σ widths` matrix (shaped `shape`) with rank `p`'s columns at offset
/// `widths[..p]`.
pub fn all_gather_cols(
    comm: &dyn Communicator,
    local: &Tensor,
    shape: &[usize],
    rows: usize,
    widths: &[usize],
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if local.is_cuda() {
        let counts: Vec<usize> = widths.iter().map(|w| rows * w).collect();
        let flat = device::all_gatherv(comm, local, &counts)?;
        let cols = Tensor::unpack(&flat, &[rows, widths.iter().sum()], 1, widths)?;
        return Ok(cols.reshape(shape)?);
    }
    let mut out = Tensor::try_for_overwrite(shape, local.dtype())?;
    comm.all_gather_cols(
        local.try_as_dyn_slice()?,
        out.try_as_dyn_slice_mut()?,
        rows,
        widths,
    )?;
    Ok(out)
}

/// Column-block reduce-scatter: `send` is a row-major `rows × Σ widths` matrix; returns this
/// rank's `rows × widths[rank]` columns (shaped `shape`) reduced over the group.
pub fn reduce_scatter_cols(
    comm: &dyn Communicator,
    send: &Tensor,
    shape: &[usize],
    rows: usize,
    widths: &[usize],
    op: ReduceOp,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if send.is_cuda() {
        let counts: Vec<usize> = widths.iter().map(|w| rows * w).collect();
        let packed = pack_cols(send, rows, widths)?;
        let out = device::reduce_scatterv(comm, &packed, &counts, op)?;
        return Ok(out.reshape(shape)?);
    }
    let mut out = Tensor::try_for_overwrite(shape, send.dtype())?;
    comm.reduce_scatter_cols(
        send.try_as_dyn_slice()?,
        out.try_as_dyn_slice_mut()?,
        rows,
        widths,
        op,
    )?;
    Ok(out)
}

/// Column-block all-to-all: `send` is this rank's row-major `rows × Σ send_widths` matrix
/// whose columns `send_widths[..p]..` go to rank `p`; returns the blocks received from
/// ranks `0, 1, …` one after another (`recv_counts[p]` elements each), flat.
pub fn all_to_all_cols(
    comm: &dyn Communicator,
    send: &Tensor,
    rows: usize,
    send_widths: &[usize],
    recv_counts: &[usize],
) -> Result<Tensor> {
    let total: usize = recv_counts.iter().sum();
    #[cfg(feature = "cuda")]
    if send.is_cuda() {
        let send_counts: Vec<usize> = send_widths.iter().map(|w| rows * w).collect();
        let packed = pack_cols(send, rows, send_widths)?;
        let mut recv = Tensor::zeros_on(send.device(), &[total], send.dtype())?;
        all_to_allv(comm, &packed, &send_counts, &mut recv, recv_counts)?;
        return Ok(recv);
    }
    let mut recv = Tensor::try_for_overwrite(&[total], send.dtype())?;
    comm.all_to_all_cols(
        send.try_as_dyn_slice()?,
        rows,
        send_widths,
        recv.try_as_dyn_slice_mut()?,
        recv_counts,
    )?;
    Ok(recv)
}

/// The column blocks of `t` seen as a row-major `rows × Σ widths` matrix, one after
/// another (block `p` is `rows × widths[p]`, row-major): flat, where `t` is. One row (or
/// none) is already in that order.
#[cfg(feature = "cuda")]
fn pack_cols(t: &Tensor, rows: usize, widths: &[usize]) -> Result<Tensor> {
    let n = t.numel();
    let flat = t.clone().reshape(&[n])?;
    if rows <= 1 {
        return Ok(flat);
    }
    let cols: usize = widths.iter().sum();
    Ok(flat.reshape(&[rows, cols])?.pack(1, widths)?)
}

/// A collective started by [`start_all_gatherv`] or [`start_all_reduce`];
/// [`wait`](PendingTensor::wait) gives its flat result.
pub enum PendingTensor {
    /// A host collective in flight on the backend.
    Host(Request),
    /// A device collective in flight on the backend (feature `cuda`).
    #[cfg(feature = "cuda")]
    Device(dtensor_collectives::DeviceRequest),
}

impl PendingTensor {
    /// Waits for the collective: its result as a flat tensor, where the operands were.
    pub fn wait(self) -> Result<Tensor> {
        match self {
            PendingTensor::Host(r) => {
                let buf = r.wait()?;
                let len = buf.len();
                Ok(Tensor::from_cpu_storage(&[len], buf.into_storage())?)
            }
            #[cfg(feature = "cuda")]
            PendingTensor::Device(r) => {
                let t = r.wait()?.into_tensor();
                let n = t.numel();
                Ok(t.reshape(&[n])?)
            }
        }
    }
}

/// Starts [`all_gatherv`] of `local` (flattened) into a new flat buffer where `local` is;
/// the backend moves the data while the caller computes (the host backends on a progress
/// thread, NCCL on its stream).
pub fn start_all_gatherv(
    comm: &dyn Communicator,
    local: &Tensor,
    counts: &[usize],
) -> Result<PendingTensor> {
    #[cfg(feature = "cuda")]
    if let Some(dev) = local.device() {
        use dtensor_collectives::DeviceBuffer;
        let n = local.numel();
        let send = DeviceBuffer::from_tensor(local.clone().reshape(&[n])?)?;
        let recv = DeviceBuffer::zeros(dev, local.dtype(), counts.iter().sum())?;
        return Ok(PendingTensor::Device(
            comm.start_all_gatherv_device(send, recv, counts),
        ));
    }
    let total: usize = counts.iter().sum();
    let send = Buffer::from(local.to_storage()?);
    let recv = Buffer::from(Tensor::try_for_overwrite(&[total], local.dtype())?.to_storage()?);
    Ok(PendingTensor::Host(
        comm.start_all_gatherv(send, recv, counts),
    ))
}

/// Starts the all-reduce of the flat tensor `flat` (in place on its buffer, copied first
/// if another tensor shares it); the backend reduces while the caller computes.
pub fn start_all_reduce(
    comm: &dyn Communicator,
    flat: Tensor,
    op: ReduceOp,
) -> Result<PendingTensor> {
    #[cfg(feature = "cuda")]
    if flat.is_cuda() {
        let buf = dtensor_collectives::DeviceBuffer::from_tensor(flat)?;
        return Ok(PendingTensor::Device(comm.start_all_reduce_device(buf, op)));
    }
    Ok(PendingTensor::Host(
        comm.start_all_reduce(Buffer::from(flat.to_storage()?), op),
    ))
}

/// The device halves of the calls above: contiguous device collectives into new buffers.
#[cfg(feature = "cuda")]
mod device {
    use super::*;

    /// `all_gatherv_device` of `local` (flat) into a new buffer of `Σ counts` elements.
    pub(super) fn all_gatherv(
        comm: &dyn Communicator,
        local: &Tensor,
        counts: &[usize],
    ) -> Result<Tensor> {
        let total: usize = counts.iter().sum();
        let mut out = Tensor::zeros_on(local.device(), &[total], local.dtype())?;
        comm.all_gatherv_device(local.device_view()?, out.device_view_mut()?, counts)?;
        Ok(out)
    }

    /// `reduce_scatterv_device` of `send` (flat) into a new buffer of this rank's count.
    pub(super) fn reduce_scatterv(
        comm: &dyn Communicator,
        send: &Tensor,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<Tensor> {
        let mine = counts.get(comm.rank()).copied().unwrap_or(0);
        let mut out = Tensor::zeros_on(send.device(), &[mine], send.dtype())?;
        comm.reduce_scatterv_device(send.device_view()?, out.device_view_mut()?, counts, op)?;
        Ok(out)
    }
}

/// [`all_reduce`] of a few host values (a header, per-row loss pieces, a norm): in place on
/// the host backends; on a device backend (whose collectives take device memory only)
/// through a device buffer of `v.len()` elements, copied up and back.
pub fn all_reduce_values<T: StorageElement>(
    comm: &dyn Communicator,
    v: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    match comm.device() {
        None => Ok(comm.all_reduce(T::slice_mut(v), op)?),
        Some(dev) => {
            let mut t = Tensor::from_vec(v.to_vec(), &[v.len()])?.to_device(&dev)?;
            all_reduce(comm, &mut t, op)?;
            v.copy_from_slice(t.to_host()?.as_slice::<T>()?);
            Ok(())
        }
    }
}

/// [`broadcast`] of a few host values from `root`, as [`all_reduce_values`] moves them.
pub fn broadcast_values<T: StorageElement>(
    comm: &dyn Communicator,
    v: &mut [T],
    root: usize,
) -> Result<()> {
    match comm.device() {
        None => Ok(comm.broadcast(T::slice_mut(v), root)?),
        Some(dev) => {
            let mut t = Tensor::from_vec(v.to_vec(), &[v.len()])?.to_device(&dev)?;
            broadcast(comm, &mut t, root)?;
            v.copy_from_slice(t.to_host()?.as_slice::<T>()?);
            Ok(())
        }
    }
}

/// [`all_to_all`] of a few host values (the MoE count exchange), moved as
/// [`all_reduce_values`] moves them.
pub fn all_to_all_values<T: StorageElement>(
    comm: &dyn Communicator,
    send: &[T],
    recv: &mut [T],
) -> Result<()> {
    match comm.device() {
        None => Ok(comm.all_to_all(T::slice(send), T::slice_mut(recv))?),
        Some(dev) => {
            let s = Tensor::from_vec(send.to_vec(), &[send.len()])?.to_device(&dev)?;
            let mut r = Tensor::zeros_on(Some(&dev), &[recv.len()], T::DTYPE)?;
            all_to_all(comm, &s, &mut r)?;
            recv.copy_from_slice(r.to_host()?.as_slice::<T>()?);
            Ok(())
        }
    }
}

/// All-gather of a few host values (a checkpoint's agreement, its error lengths): rank
/// `r`'s `send` at `r · send.len()` of the result, moved as [`all_reduce_values`] moves
/// them. On a host backend exactly its `all_gather` into a new vector.
pub fn all_gather_values<T: StorageElement>(comm: &dyn Communicator, send: &[T]) -> Result<Vec<T>> {
    let mut out = vec![T::zero(); send.len() * comm.size()];
    match comm.device() {
        None => comm.all_gather(T::slice(send), T::slice_mut(&mut out))?,
        Some(dev) => {
            let s = Tensor::from_vec(send.to_vec(), &[send.len()])?.to_device(&dev)?;
            let mut r = Tensor::zeros_on(Some(&dev), &[out.len()], T::DTYPE)?;
            all_gather_into(comm, &s, &mut r)?;
            out.copy_from_slice(r.to_host()?.as_slice::<T>()?);
        }
    }
    Ok(out)
}

/// Uneven all-gather of a few host values (a checkpoint's error messages and shard
/// records, packed into words): rank `r` contributes `counts[r]` values, placed one after
/// another in rank order in `recv` (`Σ counts` values), moved as [`all_reduce_values`]
/// moves them. On a host backend exactly its `all_gatherv`; on a device the backend checks
/// the lengths as its host call does.
pub fn all_gatherv_values<T: StorageElement>(
    comm: &dyn Communicator,
    send: &[T],
    recv: &mut [T],
    counts: &[usize],
) -> Result<()> {
    match comm.device() {
        None => Ok(comm.all_gatherv(T::slice(send), T::slice_mut(recv), counts)?),
        Some(dev) => {
            let s = Tensor::from_vec(send.to_vec(), &[send.len()])?.to_device(&dev)?;
            let mut r = Tensor::zeros_on(Some(&dev), &[recv.len()], T::DTYPE)?;
            all_gatherv_into(comm, &s, &mut r, counts)?;
            recv.copy_from_slice(r.to_host()?.as_slice::<T>()?);
            Ok(())
        }
    }
}

/// Equal-piece all-gather of `send` into `recv` (`size ×` its elements), where both are.
fn all_gather_into(comm: &dyn Communicator, send: &Tensor, recv: &mut Tensor) -> Result<()> {
    common_device("all_gather", &[send, recv])?;
    #[cfg(feature = "cuda")]
    if send.is_cuda() {
        return Ok(comm.all_gather_device(send.device_view()?, recv.device_view_mut()?)?);
    }
    Ok(comm.all_gather(send.try_as_dyn_slice()?, recv.try_as_dyn_slice_mut()?)?)
}

/// Uneven all-gather of `send` (`counts[rank]` elements) into `recv` (`Σ counts`), where
/// both are; the backend checks the lengths.
fn all_gatherv_into(
    comm: &dyn Communicator,
    send: &Tensor,
    recv: &mut Tensor,
    counts: &[usize],
) -> Result<()> {
    common_device("all_gatherv", &[send, recv])?;
    #[cfg(feature = "cuda")]
    if send.is_cuda() {
        return Ok(comm.all_gatherv_device(
            send.device_view()?,
            recv.device_view_mut()?,
            counts,
        )?);
    }
    Ok(comm.all_gatherv(
        send.try_as_dyn_slice()?,
        recv.try_as_dyn_slice_mut()?,
        counts,
    )?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dtensor_collectives::threads;
    use dtensor_kernels::memory::live_bytes;
    use dtensor_kernels::DType;

    /// Rank `rank`'s elements: small integers, exact in every dtype, different per rank.
    fn send_of(rank: usize, len: usize, dtype: DType) -> Tensor {
        Tensor::from_fn(&[len], |i| ((rank * 31 + i * 7) % 97) as f64 - 48.0).to_dtype(dtype)
    }

    fn bits(t: &Tensor) -> Result<Vec<u64>> {
        let wide = t.to_dtype(DType::F64);
        Ok(wide
            .as_slice::<f64>()?
            .iter()
            .map(|v| v.to_bits())
            .collect())
    }

    /// Uneven and empty blocks, every dtype and reduce op: the block equals, bit for bit,
    /// the one the backend's in-place reduce-scatter leaves in the buffer (the reduction
    /// order is the same), and for sums the rank-order sum of the ranks' blocks.
    #[test]
    fn reduce_scatterv_uneven_every_dtype_and_op_matches_in_place_bitwise() {
        for counts in [vec![4, 0, 3], vec![5, 5, 5], vec![0, 0, 7]] {
            let total: usize = counts.iter().sum();
            let results = threads::launch(counts.len(), |comm| -> Result<()> {
                let me = comm.rank();
                let off: usize = counts[..me].iter().sum();
                for dtype in DType::ALL {
                    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                        let mut in_place = send_of(me, total, dtype);
                        comm.reduce_scatterv_in_place(
                            in_place.try_as_dyn_slice_mut()?,
                            &counts,
                            op,
                        )?;
                        let want = in_place.narrow(0, off, counts[me])?;
                        let got = reduce_scatterv(&*comm, send_of(me, total, dtype), &counts, op)?;
                        assert_eq!(got.shape(), &[counts[me]], "{dtype} {op:?} {counts:?}");
                        assert_eq!(bits(&got)?, bits(&want)?, "{dtype} {op:?} {counts:?}");
                        if op == ReduceOp::Sum {
                            let sum: Vec<u64> = (0..counts[me])
                                .map(|i| {
                                    let v = |r| ((r * 31 + (off + i) * 7) % 97) as f64 - 48.0;
                                    (0..counts.len()).map(v).sum::<f64>().to_bits()
                                })
                                .collect();
                            assert_eq!(bits(&got)?, sum, "{dtype} sum {counts:?}");
                        }
                    }
                }
                Ok(())
            });
            for r in results {
                r.unwrap();
            }
        }
    }

    /// The result holds its block's bytes and nothing of the input, which is freed by the
    /// time the call returns (a view of the input would keep all of it alive).
    #[test]
    fn reduce_scatterv_result_does_not_keep_the_input_alive() {
        let counts = [1000, 600];
        let results = threads::launch(2, |comm| -> Result<()> {
            let before = live_bytes();
            let send = send_of(comm.rank(), 1600, DType::F32);
            let got = reduce_scatterv(&*comm, send, &counts, ReduceOp::Sum)?;
            assert_eq!(live_bytes() - before, counts[comm.rank()] * 4);
            drop(got);
            assert_eq!(live_bytes(), before);
            Ok(())
        });
        for r in results {
            r.unwrap();
        }
    }
}
