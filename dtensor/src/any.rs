//! `AnyDTensor`: the run-time-placed distributed tensor. It is the engine under the typed
//! [`DTensor`](crate::DTensor) (which only adds the layout to the type) and the twin that
//! generic code, checkpoint loading and planners use. Every method checks placements at
//! run time and returns `Err` where the typed API would not have compiled.

use crate::device_mesh::DeviceMesh;
use crate::error::{Error, Placements, Result};
use crate::plan::{self, nesting_blocker, Plan, Step, StepKind};
use crate::transfer;
use dtensor_collectives::ReduceOp;
use dtensor_kernels::{chunk_sizes, numel, DType, Shape, Tensor};
use dtensor_placement::{chunk_range, local_ranges, local_shape, PartialOp, Placement};
use std::fmt;
use std::sync::Arc;

/// A distributed tensor with run-time placements, one per mesh axis.
///
/// Invariants: `placements.len() == mesh.ndim()`; every `Shard(d)` has `d < rank`;
/// `local.shape() == local_shape(mesh, placements, coords, global_shape)`; on a `Partial`
/// axis the global tensor is the reduction of the ranks' local terms.
#[derive(Clone)]
pub struct AnyDTensor {
    local: Tensor,
    global_shape: Shape,
    placements: Placements,
    mesh: Arc<DeviceMesh>,
}

pub(crate) fn reduce_op(op: PartialOp) -> ReduceOp {
    match op {
        PartialOp::Sum => ReduceOp::Sum,
        PartialOp::Avg => ReduceOp::Avg,
        PartialOp::Max => ReduceOp::Max,
        PartialOp::Min => ReduceOp::Min,
    }
}

/// Dtype codes for the `distribute` header: a dtype's position in [`DType::ALL`] (the same
/// list on every rank of one build).
const DTYPES: [DType; 6] = DType::ALL;

impl AnyDTensor {
    /// This rank's piece of `global` (the whole tensor, the same on every rank: a batch of
    /// token ids every rank read) laid out as `placements`, sliced locally: no
    /// communication. `Err` for a `Partial` axis, where a whole value on every coordinate
    /// would be counted once per rank.
    pub fn from_global(
        global: &Tensor,
        placements: &[Placement],
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        const OP: &str = "DTensor::from_global";
        if let Some(a) = placements.iter().position(|p| p.is_partial()) {
            return Err(Error::PlacementMismatch {
                op: OP,
                axis: mesh.mesh().axis_kinds()[a],
                placements: placements.into(),
                detail: "a value given whole on every rank would be counted once per rank on a Partial axis".into(),
            });
        }
        let ranges = local_ranges(mesh.mesh(), placements, mesh.coords(), global.shape())?;
        let mut local = global.clone();
        for (d, r) in ranges.iter().enumerate() {
            local = local.narrow(d, r.start, r.len())?;
        }
        Self::from_local(local, global.shape(), placements, mesh)
    }

    /// Wraps this rank's local piece. `Err` if the placements do not fit the mesh or the
    /// local shape is not the one the layout gives this rank. On a mesh whose tensors live
    /// on a GPU ([`DeviceMesh::device`]) a host piece is copied there first.
    pub fn from_local(
        local: Tensor,
        global_shape: &[usize],
        placements: &[Placement],
        mesh: &Arc<DeviceMesh>,
    ) -> Result<AnyDTensor> {
        let local = to_mesh_place(local, mesh)?;
        Self::from_local_for("DTensor::from_local", local, global_shape, placements, mesh)
    }

    /// [`from_local`](Self::from_local) for a compute op: the op's name goes in the error.
    pub(crate) fn from_local_for(
        op: &'static str,
        local: Tensor,
        global_shape: &[usize],
        placements: &[Placement],
        mesh: &Arc<DeviceMesh>,
    ) -> Result<AnyDTensor> {
        dtensor_placement::check_placements(op, mesh.mesh(), placements, global_shape.len())?;
        // Every piece lives where the mesh keeps its tensors: an op that computed its
        // output in host memory on a device mesh has no device path yet, and says so
        // instead of handing a host tensor to the next device kernel.
        if local.device() != mesh.device() {
            return Err(Error::InvalidUse {
                op,
                detail: format!(
                    "the result is in {} memory but the mesh keeps its tensors on {}: this op has no device path yet",
                    place_name(local.device()),
                    place_name(mesh.device())
                ),
            });
        }
        let want = local_shape(mesh.mesh(), placements, mesh.coords(), global_shape)?;
        if local.shape() != want.as_slice() {
            return Err(Error::ShapeMismatch {
                op,
                detail: format!(
                    "local shape {:?} on rank {} (coords {:?}) but global shape {:?} laid out as {} gives {:?}",
                    local.shape(),
                    mesh.rank(),
                    mesh.coords(),
                    global_shape,
                    fmt_placements(placements),
                    want.as_slice()
                ),
            });
        }
        Ok(AnyDTensor {
            local,
            global_shape: global_shape.into(),
            placements: placements.into(),
            mesh: mesh.clone(),
        })
    }

    /// Collective over the world: rank `src` holds the full tensor (`Some`), the others pass
    /// `None`; every rank gets its piece. On a `Partial(sum)` axis coordinate 0 holds the
    /// value and the others zeros; on avg/max/min partial axes every rank holds the value.
    pub fn distribute(
        full: Option<&Tensor>,
        src: usize,
        placements: &[Placement],
        mesh: &Arc<DeviceMesh>,
    ) -> Result<AnyDTensor> {
        let op = "DTensor::distribute";
        let world = mesh.world();
        if src >= world.size() {
            return Err(Error::ShapeMismatch {
                op,
                detail: format!("source rank {src} outside a world of {}", world.size()),
            });
        }
        // Header: [ndim or -1 for "source has no tensor", dtype code, extents...(4 max)].
        let mut header = [0i64; 6];
        let me = world.rank();
        if me == src {
            match full {
                Some(t) if t.rank() <= 4 => {
                    header[0] = t.rank() as i64;
                    header[1] = DTYPES.iter().position(|&d| d == t.dtype()).unwrap() as i64;
                    for (i, &e) in t.shape().iter().enumerate() {
                        header[2 + i] = e as i64;
                    }
                }
                Some(t) => {
                    header[0] = -2;
                    header[1] = t.rank() as i64;
                }
                None => header[0] = -1,
            }
        }
        transfer::broadcast_values(&**world, &mut header, src)?;
        if header[0] < 0 {
            return Err(Error::ShapeMismatch {
                op,
                detail: if header[0] == -1 {
                    format!("source rank {src} passed no tensor (None)")
                } else {
                    format!(
                        "tensors of rank {} exceed the 4 dims distribute supports",
                        header[1]
                    )
                },
            });
        }
        let ndim = header[0] as usize;
        let shape: Shape = header[2..2 + ndim].iter().map(|&e| e as usize).collect();
        let dtype = DTYPES[header[1] as usize];
        // Validate placements on every rank before moving data, so all fail together.
        dtensor_placement::check_placements(op, mesh.mesh(), placements, ndim)?;
        // The data moves where the mesh keeps its tensors (its GPU on NCCL).
        let mut data = match (me == src, full, mesh.device()) {
            (true, Some(t), None) => t.clone(),
            (true, Some(t), Some(dev)) => t.to_device(dev)?,
            _ => Tensor::zeros_on(mesh.device(), &shape, dtype)?,
        };
        transfer::broadcast(&**world, &mut data, src)?;
        let ranges = local_ranges(mesh.mesh(), placements, mesh.coords(), &shape)?;
        let mut local = data;
        for (d, r) in ranges.iter().enumerate() {
            if r.len() != shape[d] {
                local = local.narrow(d, r.start, r.len())?;
            }
        }
        let zero_here = placements
            .iter()
            .enumerate()
            .any(|(a, p)| *p == Placement::Partial(PartialOp::Sum) && mesh.coords()[a] != 0);
        if zero_here {
            local = local.zeros_like()?;
        }
        AnyDTensor::from_local(local, &shape, placements, mesh)
    }

    /// This rank's piece of the tensor (its chunk on `Shard` axes, its term on `Partial` ones).
    pub fn as_local(&self) -> &Tensor {
        &self.local
    }
    /// This rank's piece, mutable: for in-place updates that keep the shape and dtype (the
    /// typed wrapper checks that they did).
    pub(crate) fn local_mut(&mut self) -> &mut Tensor {
        &mut self.local
    }
    /// This rank's piece, taken out of the distributed tensor (no copy).
    pub fn into_local(self) -> Tensor {
        self.local
    }
    /// Shape of the whole tensor, in elements per dim (for a `Ragged` axis, dim 0 is this
    /// rank's row count).
    pub fn global_shape(&self) -> &[usize] {
        &self.global_shape
    }
    /// Shape of this rank's piece: the global shape cut by the `Shard` axes.
    pub fn local_shape(&self) -> &[usize] {
        self.local.shape()
    }
    /// The placement on every mesh axis, in the mesh's layout order.
    pub fn placements(&self) -> &[Placement] {
        &self.placements
    }
    /// Element type of the local piece (the same on every rank).
    pub fn dtype(&self) -> DType {
        self.local.dtype()
    }
    /// The mesh this tensor is distributed over, as this rank sees it.
    pub fn device_mesh(&self) -> &Arc<DeviceMesh> {
        &self.mesh
    }

    /// Collective: the whole global tensor on every rank (gathers shards, reduces partials).
    pub fn full_tensor(&self) -> Result<Tensor> {
        let target: Placements = self
            .placements
            .iter()
            .map(|_| Placement::Invariant)
            .collect();
        Ok(self.clone().redistribute(&target)?.local)
    }

    /// The plan that takes this tensor to `target`, without running it.
    pub fn plan(&self, target: &[Placement]) -> Result<Plan> {
        plan::plan(self.plan_target(), &self.placements, target)
    }

    /// This tensor, seen from this rank, as a planner sees it.
    fn plan_target(&self) -> plan::PlanTarget<'_> {
        plan::PlanTarget {
            mesh: self.mesh.mesh(),
            coords: self.mesh.coords(),
            global_shape: &self.global_shape,
            elem_size: self.dtype().size_in_bytes(),
        }
    }

    /// The one-step plan of a step that took `before` placements to this tensor's, with the
    /// bytes it moved on this rank: what an adjoint replays in reverse.
    pub(crate) fn record_step(
        &self,
        before: &[Placement],
        axis: usize,
        kind: StepKind,
    ) -> Result<Plan> {
        let bytes_received =
            plan::step_bytes(self.plan_target(), axis, kind, before, &self.placements)?;
        Ok(Plan {
            from: before.into(),
            to: self.placements.clone(),
            global_shape: self.global_shape.clone(),
            steps: vec![Step {
                axis,
                axis_kind: self.mesh.mesh().axes()[axis].0,
                from: before[axis],
                to: self.placements[axis],
                kind,
                bytes_received,
            }],
        })
    }

    /// Collective: plans and runs the redistribution to `target`.
    pub fn redistribute(self, target: &[Placement]) -> Result<AnyDTensor> {
        let p = self.plan(target)?;
        self.run_plan(&p)
    }

    /// Runs a plan made for this tensor's layout and global shape.
    pub fn run_plan(self, plan: &Plan) -> Result<AnyDTensor> {
        if plan.from.as_slice() != self.placements.as_slice()
            || plan.global_shape.as_slice() != self.global_shape.as_slice()
        {
            return Err(Error::LayoutMismatch {
                op: "Plan::run",
                expected: format!(
                    "{} with global shape {:?}",
                    fmt_placements(&plan.from),
                    plan.global_shape.as_slice()
                ),
                got: format!(
                    "{} with global shape {:?}",
                    fmt_placements(&self.placements),
                    self.global_shape.as_slice()
                ),
            });
        }
        plan.steps
            .iter()
            .try_fold(self, |t, s| t.apply(s.axis, s.kind))
    }

    /// The adjoint of a plan: the adjoint steps in reverse order, run on a gradient laid
    /// out as the dual of the plan's target.
    pub fn run_adjoint(self, plan: &Plan) -> Result<AnyDTensor> {
        let want: Placements = plan.to.iter().map(|p| p.dual()).collect();
        if self.placements != want || self.global_shape.as_slice() != plan.global_shape.as_slice() {
            return Err(Error::LayoutMismatch {
                op: "Adjoint::backward",
                expected: format!(
                    "{} with global shape {:?}",
                    fmt_placements(&want),
                    plan.global_shape.as_slice()
                ),
                got: format!(
                    "{} with global shape {:?}",
                    fmt_placements(&self.placements),
                    self.global_shape.as_slice()
                ),
            });
        }
        plan.steps.iter().rev().try_fold(self, |g, s: &Step| {
            let kind = s.kind.adjoint(s.from)?;
            g.apply(s.axis, kind)
        })
    }

    /// What [`apply`](Self::apply) checks before it moves data: the axis is in the mesh,
    /// the step starts from its placement, its dims are in the tensor, and no axis to the
    /// right shards those dims (the nesting rule). Returns the placements before and after.
    fn check_step(&self, axis: usize, kind: StepKind) -> Result<(Placement, Placement)> {
        let op = kind.name();
        if axis >= self.placements.len() {
            return Err(Error::Placement(dtensor_placement::Error::InvalidMesh(
                format!(
                    "{op}: axis index {axis} outside the mesh {}",
                    self.mesh.mesh()
                ),
            )));
        }
        let axis_kind = self.mesh.mesh().axes()[axis].0;
        let mismatch = |detail: String| Error::PlacementMismatch {
            op,
            axis: axis_kind,
            placements: self.placements.clone(),
            detail,
        };
        let from = self.placements[axis];
        let to = kind.target(from).map_err(&mismatch)?;
        for &d in &kind.dims() {
            if d >= self.global_shape.len() {
                return Err(mismatch(format!(
                    "dim {d} is outside a tensor of global shape {:?}",
                    self.global_shape.as_slice()
                )));
            }
        }
        if let Some(b) = nesting_blocker(&self.placements, axis, &kind.dims()) {
            return Err(mismatch(format!(
                "axis {} (right of {axis_kind}) also shards dim {} and nests inside it; move axis {} first",
                self.mesh.mesh().axes()[b].0,
                self.placements[b].shard_dim().unwrap_or(0),
                self.mesh.mesh().axes()[b].0,
            )));
        }
        Ok((from, to))
    }

    /// Runs one step on the axis at layout index `axis`. This is every named transition.
    pub fn apply(mut self, axis: usize, kind: StepKind) -> Result<AnyDTensor> {
        let (from, to) = self.check_step(axis, kind)?;
        // Take the local piece out so the data path can consume it (a gather or
        // reduce-scatter may reuse its buffer); `self` keeps the metadata.
        let dtype = self.dtype();
        let local = std::mem::replace(&mut self.local, Tensor::zeros(&[0], dtype));
        let local = match kind {
            StepKind::AllGather { dim } | StepKind::AllGatherInvariant { dim } => {
                self.gather_dim(local, axis, dim)?
            }
            StepKind::ReduceScatter { dim } => self.reduce_scatter_dim(local, axis, dim, from)?,
            StepKind::AllReduce => {
                let Placement::Partial(p) = from else {
                    unreachable!("checked by target")
                };
                // In place on the buffer this call owns (copied first only if a clone
                // elsewhere still shares it).
                let mut buf = local;
                transfer::all_reduce(&**self.mesh.axis_comm(axis), &mut buf, reduce_op(p))?;
                buf
            }
            StepKind::AllToAll { from: a, to: b } => self.all_to_all_dims(&local, axis, a, b)?,
            StepKind::Chunk { dim } => {
                let n = self.mesh.mesh().size(axis);
                let r = chunk_range(local.shape()[dim], n, self.mesh.coords()[axis]);
                local.narrow(dim, r.start, r.len())?
            }
            StepKind::PadToPartial { dim } => {
                let n = self.mesh.mesh().size(axis);
                let parent = self.parent_extent(axis, dim)?;
                let r = chunk_range(parent, n, self.mesh.coords()[axis]);
                let mut shape: Shape = local.shape().into();
                shape[dim] = parent;
                let mut out = Tensor::zeros_on(local.device(), &shape, dtype)?;
                out.write_at(dim, r.start, &local)?;
                out
            }
            StepKind::ToReplicate | StepKind::ToInvariant => local,
            StepKind::ToPartial { op } => {
                if op == PartialOp::Sum && self.mesh.coords()[axis] != 0 {
                    local.zeros_like()?
                } else {
                    local
                }
            }
        };
        let mut placements = self.placements.clone();
        placements[axis] = to;
        debug_assert_eq!(
            local.shape(),
            local_shape(
                self.mesh.mesh(),
                &placements,
                self.mesh.coords(),
                &self.global_shape
            )
            .unwrap()
            .as_slice()
        );
        Ok(AnyDTensor {
            local,
            global_shape: self.global_shape,
            placements,
            mesh: self.mesh,
        })
    }

    /// Starts the all-gather of `Shard<d>` on the axis at layout index `axis` (to
    /// `Replicate`) and returns at once; [`PendingGather::wait`] gives the result, bitwise
    /// what [`apply`](Self::apply) with an all-gather step gives, and the plan its adjoint
    /// reverses. FSDP prefetches the next layer's parameters this way.
    pub fn start_all_gather(self, axis: usize) -> Result<PendingGather> {
        let dim = self
            .placements
            .get(axis)
            .and_then(|p| p.shard_dim())
            .unwrap_or(0);
        self.check_step(axis, StepKind::AllGather { dim })?;
        let comm = self.mesh.axis_comm(axis).clone();
        let (_, sizes, counts) = self.gather_counts(self.local.shape(), axis, dim)?;
        let request = transfer::start_all_gatherv(&*comm, &self.local, &counts)?;
        Ok(PendingGather {
            src: self,
            axis,
            dim,
            sizes: sizes.to_vec(),
            request,
        })
    }

    /// Extent of `dim` as sharded by the axes left of `axis` only: what `axis`'s group
    /// collectively covers.
    fn parent_extent(&self, axis: usize, dim: usize) -> Result<usize> {
        let mut outer = self.placements.clone();
        for p in outer.iter_mut().skip(axis) {
            *p = Placement::Replicate;
        }
        let r = local_ranges(
            self.mesh.mesh(),
            &outer,
            self.mesh.coords(),
            &self.global_shape,
        )?;
        Ok(r[dim].len())
    }

    /// Elements of the local tensor per unit of extent on `dim` (product of the other extents).
    fn rest(shape: &[usize], dims: &[usize]) -> usize {
        shape
            .iter()
            .enumerate()
            .filter(|(i, _)| !dims.contains(i))
            .map(|(_, &e)| e)
            .product()
    }

    /// An all-gather of dim `dim` over the axis at `axis`: the extent the group covers, the
    /// ranks' chunks of it (`torch.chunk`), and their element counts for a local piece
    /// shaped `local`.
    #[allow(clippy::type_complexity)]
    fn gather_counts(
        &self,
        local: &[usize],
        axis: usize,
        dim: usize,
    ) -> Result<(usize, smallvec::SmallVec<[usize; 8]>, Vec<usize>)> {
        let parent = self.parent_extent(axis, dim)?;
        let sizes = chunk_sizes(parent, self.mesh.mesh().size(axis));
        let rest = Self::rest(local, &[dim]);
        let counts = sizes.iter().map(|s| s * rest).collect();
        Ok((parent, sizes, counts))
    }

    fn gather_dim(&self, local: Tensor, axis: usize, dim: usize) -> Result<Tensor> {
        let comm = self.mesh.axis_comm(axis).clone();
        let (parent, sizes, counts) = self.gather_counts(local.shape(), axis, dim)?;
        let mut shape: Shape = local.shape().into();
        shape[dim] = parent;
        if numel(&shape[..dim]) == 1 {
            // Pieces arrive one after another, which is already the row-major result (on
            // the host gathered around the own piece when it sits at its place already).
            let gathered = transfer::all_gatherv(&*comm, local, &counts)?;
            return Ok(gathered.reshape(&shape)?);
        }
        // Otherwise the pieces are column blocks of the result seen as rows × columns
        // (rows: the extents before `dim`): the backend writes each row in place.
        let rows = numel(&shape[..dim]);
        let widths: Vec<usize> = sizes.iter().map(|s| s * numel(&shape[dim + 1..])).collect();
        transfer::all_gather_cols(&*comm, &local, &shape, rows, &widths)
    }

    fn reduce_scatter_dim(
        &self,
        local: Tensor,
        axis: usize,
        dim: usize,
        from: Placement,
    ) -> Result<Tensor> {
        let Placement::Partial(p) = from else {
            unreachable!("checked by target")
        };
        let comm = self.mesh.axis_comm(axis).clone();
        let me = comm.rank();
        let extent = local.shape()[dim];
        let sizes = chunk_sizes(extent, comm.size());
        let rest = Self::rest(local.shape(), &[dim]);
        let counts: Vec<usize> = sizes.iter().map(|s| s * rest).collect();
        let mut out_shape: Shape = local.shape().into();
        out_shape[dim] = sizes[me];
        if numel(&local.shape()[..dim]) > 1 {
            // Column blocks of the rows × columns view: reduced row by row, no packing.
            let rows = numel(&local.shape()[..dim]);
            let widths: Vec<usize> = sizes
                .iter()
                .map(|s| s * numel(&local.shape()[dim + 1..]))
                .collect();
            return transfer::reduce_scatter_cols(
                &*comm,
                &local,
                &out_shape,
                rows,
                &widths,
                reduce_op(p),
            );
        }
        // Along the leading dim the blocks are contiguous: reduced straight into a buffer
        // of the shard's size, which holds nothing of `local` alive (FSDP and ZeRO
        // gradients must not keep n times a shard's memory).
        let block = transfer::reduce_scatterv(&*comm, local, &counts, reduce_op(p))?;
        Ok(block.reshape(&out_shape)?)
    }

    fn all_to_all_dims(
        &self,
        local: &Tensor,
        axis: usize,
        from: usize,
        to: usize,
    ) -> Result<Tensor> {
        let comm = self.mesh.axis_comm(axis);
        let (n, me) = (comm.size(), comm.rank());
        let shape = local.shape();
        let to_pieces = chunk_sizes(shape[to], n);
        let from_lens = chunk_sizes(self.parent_extent(axis, from)?, n);
        let other = Self::rest(shape, &[from, to]);
        let send_counts: Vec<usize> = to_pieces.iter().map(|s| s * other * shape[from]).collect();
        let recv_counts: Vec<usize> = from_lens
            .iter()
            .map(|l| l * other * to_pieces[me])
            .collect();
        let mut new_shape: Shape = shape.into();
        new_shape[from] = from_lens.iter().sum();
        new_shape[to] = to_pieces[me];
        // The blocks for the peers are column blocks of the rows × columns view (rows: the
        // extents before `to`); contiguous when nothing lies before `to`.
        let rows = numel(&shape[..to]);
        let send_widths: Vec<usize> = send_counts.iter().map(|c| c / rows.max(1)).collect();
        let recv = transfer::all_to_all_cols(&**comm, local, rows, &send_widths, &recv_counts)?;
        if numel(&new_shape[..from]) == 1 {
            Ok(recv.reshape(&new_shape)?)
        } else {
            Ok(Tensor::unpack(&recv, &new_shape, from, &from_lens)?)
        }
    }

    fn check_same_mesh(&self, op: &'static str, other: &AnyDTensor) -> Result<()> {
        if !Arc::ptr_eq(&self.mesh, &other.mesh) {
            return Err(Error::MeshMismatch {
                op,
                lhs: format!("{:?}", self.mesh),
                rhs: format!("{:?}", other.mesh),
            });
        }
        if self.global_shape != other.global_shape {
            return Err(Error::ShapeMismatch {
                op,
                detail: format!(
                    "global shapes {:?} and {:?} differ",
                    self.global_shape.as_slice(),
                    other.global_shape.as_slice()
                ),
            });
        }
        Ok(())
    }

    fn with_local(&self, local: Tensor) -> AnyDTensor {
        AnyDTensor {
            local,
            global_shape: self.global_shape.clone(),
            placements: self.placements.clone(),
            mesh: self.mesh.clone(),
        }
    }

    fn check_placements_where(
        &self,
        op: &'static str,
        ok: impl Fn(Placement) -> bool,
        why: &str,
    ) -> Result<()> {
        for (a, &p) in self.placements.iter().enumerate() {
            if !ok(p) {
                return Err(Error::PlacementMismatch {
                    op,
                    axis: self.mesh.mesh().axes()[a].0,
                    placements: self.placements.clone(),
                    detail: format!("{p} {why}"),
                });
            }
        }
        Ok(())
    }

    /// The same tensor with its elements converted to `dtype` (rounded once; a cheap view
    /// when it already is `dtype`).
    pub fn to_dtype(&self, dtype: dtensor_kernels::DType) -> Result<AnyDTensor> {
        if self.dtype() == dtype {
            return Ok(self.clone());
        }
        AnyDTensor::from_local_for(
            "AnyDTensor::to_dtype",
            self.as_local().to_dtype(dtype),
            self.global_shape(),
            self.placements(),
            self.device_mesh(),
        )
    }

    /// Elementwise sum. Both operands need the same mesh, global shape and placements, and
    /// no max/min partial axis.
    pub fn add(&self, other: &AnyDTensor) -> Result<AnyDTensor> {
        let op = "DTensor::add";
        self.check_same_mesh(op, other)?;
        if self.placements != other.placements {
            return Err(Error::LayoutMismatch {
                op,
                expected: fmt_placements(&self.placements),
                got: fmt_placements(&other.placements),
            });
        }
        self.check_placements_where(
            op,
            |p| !matches!(p, Placement::Partial(o) if !o.is_linear()),
            "partial terms do not add linearly",
        )?;
        Ok(self.with_local(self.local.add(&other.local)?))
    }

    /// Every element times `factor`. No max/min partial axis.
    pub fn scale(&self, factor: f64) -> Result<AnyDTensor> {
        self.check_placements_where(
            "DTensor::scale",
            |p| !matches!(p, Placement::Partial(o) if !o.is_linear()),
            "partial terms do not scale linearly",
        )?;
        Ok(self.with_local(self.local.scale(factor)))
    }

    /// A non-linear elementwise function (evaluated in f64). No partial axis.
    pub fn map(&self, f: impl Fn(f64) -> f64) -> Result<AnyDTensor> {
        self.check_placements_where(
            "DTensor::map",
            |p| !p.is_partial(),
            "holds pending partial sums; reduce it before a non-linear op",
        )?;
        Ok(self.with_local(self.local.map(f)))
    }

    /// Elementwise product of two tensors with the same layout and no partial axis.
    pub fn mul(&self, other: &AnyDTensor) -> Result<AnyDTensor> {
        let op = "DTensor::mul";
        self.check_same_mesh(op, other)?;
        if self.placements != other.placements {
            return Err(Error::LayoutMismatch {
                op,
                expected: fmt_placements(&self.placements),
                got: fmt_placements(&other.placements),
            });
        }
        self.check_placements_where(
            op,
            |p| !p.is_partial(),
            "holds pending partial sums; reduce it before a non-linear op",
        )?;
        Ok(self.with_local(self.local.mul(&other.local)?))
    }
}

pub(crate) fn fmt_placements(p: &[Placement]) -> String {
    let v: Vec<String> = p.iter().map(|p| p.to_string()).collect();
    format!("[{}]", v.join(", "))
}

impl fmt::Debug for AnyDTensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DTensor {} global {:?} local {:?} {} on rank {} of {}",
            fmt_placements(&self.placements),
            self.global_shape.as_slice(),
            self.local.shape(),
            self.dtype(),
            self.mesh.rank(),
            self.mesh.mesh()
        )
    }
}

/// `"host"` or `"cuda:N"`.
fn place_name(dev: Option<&dtensor_kernels::cuda::Device>) -> String {
    match dev {
        None => "host".into(),
        Some(d) => format!("cuda:{}", d.ordinal()),
    }
}

/// `t` where `mesh` keeps its tensors: copied to its GPU if it is a host tensor on a device
/// mesh (what constructors from host data do); `t` itself otherwise.
pub(crate) fn to_mesh_place(t: Tensor, mesh: &DeviceMesh) -> Result<Tensor> {
    match mesh.device() {
        Some(dev) if t.device() != Some(dev) => Ok(t.to_device(dev)?),
        _ => Ok(t),
    }
}

/// An all-gather started by [`AnyDTensor::start_all_gather`].
pub struct PendingGather {
    src: AnyDTensor,
    axis: usize,
    dim: usize,
    sizes: Vec<usize>,
    request: transfer::PendingTensor,
}

impl PendingGather {
    /// The tensor the gather started from.
    pub fn source(&self) -> &AnyDTensor {
        &self.src
    }

    /// Waits for the gather: the tensor `Replicate` on the axis, and the plan of the step
    /// (what its adjoint, a reduce-scatter, reverses).
    pub fn wait(self) -> Result<(AnyDTensor, Plan)> {
        let flat = self.request.wait()?;
        let mut pieces = Vec::with_capacity(self.sizes.len());
        let mut offset = 0;
        for &s in &self.sizes {
            let mut shape: Shape = self.src.local.shape().into();
            shape[self.dim] = s;
            let n = numel(&shape);
            pieces.push(flat.narrow(0, offset, n)?.reshape(&shape)?);
            offset += n;
        }
        let local = Tensor::cat(&pieces, self.dim)?;
        let mut placements = self.src.placements.clone();
        let from = placements.clone();
        placements[self.axis] = Placement::Replicate;
        let out = AnyDTensor::from_local_for(
            "all_gather (started)",
            local,
            &self.src.global_shape,
            &placements,
            &self.src.mesh,
        )?;
        let plan = out.record_step(&from, self.axis, StepKind::AllGather { dim: self.dim })?;
        Ok((out, plan))
    }
}
