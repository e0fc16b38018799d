//! `DeviceMesh`: a [`Mesh`] seen from one rank, with a communicator per mesh axis.

use crate::error::{Error, Result};
use dtensor_collectives::{Communicator, CounterSnapshot};
use dtensor_kernels::cuda;
use dtensor_placement::{AxisKind, Mesh};
use smallvec::SmallVec;
use std::fmt;
use std::sync::Arc;

/// One rank's handle on the mesh: its coordinates, the world communicator, and one
/// sub-communicator per axis (the ranks sharing all other coordinates, ordered by their
/// coordinate on that axis, so an axis communicator's rank *is* the axis coordinate).
pub struct DeviceMesh {
    mesh: Mesh,
    rank: usize,
    coords: SmallVec<[usize; 4]>,
    world: Arc<dyn Communicator>,
    axes: Vec<Arc<dyn Communicator>>,
    /// The world of the mesh this one was cut from ([`sub_mesh`](Self::sub_mesh)), or
    /// `world` itself: what a global reduction (the gradient norm across pipeline stages)
    /// runs over.
    root: Arc<dyn Communicator>,
    /// Where this rank's tensors live: the world communicator's GPU (NCCL), or `None`
    /// (host memory) for the host backends.
    device: Option<cuda::Device>,
}

impl DeviceMesh {
    /// Collective over `world`: splits it into one communicator per axis of `mesh`.
    /// Every rank must call it with the same mesh.
    pub fn new(world: Arc<dyn Communicator>, mesh: Mesh) -> Result<Arc<DeviceMesh>> {
        if world.size() != mesh.world_size() {
            return Err(Error::Placement(dtensor_placement::Error::InvalidMesh(
                format!(
                    "mesh {mesh} needs {} ranks but the communicator has {}",
                    mesh.world_size(),
                    world.size()
                ),
            )));
        }
        let rank = world.rank();
        let coords = mesh.coords(rank)?;
        // This thread records on this rank's row of a timeline.
        dtensor_collectives::trace::set_row(rank, 0);
        let mut axes = Vec::with_capacity(mesh.ndim());
        for axis in 0..mesh.ndim() {
            // Color: the group's lowest-coordinate member; key: the coordinate on the axis.
            let group = mesh.axis_group(rank, axis)?;
            let comm = world.split(group[0], coords[axis])?;
            debug_assert_eq!(comm.rank(), coords[axis]);
            comm.set_label(mesh.axes()[axis].0.name());
            axes.push(comm);
        }
        Ok(Arc::new(DeviceMesh {
            mesh,
            rank,
            coords,
            root: world.clone(),
            device: world.device(),
            world,
            axes,
        }))
    }

    /// Collective over the world: the mesh without `axis`, as the ranks sharing this
    /// rank's coordinate on it see it (a pipeline stage's `[Dp, Tp]` inside `[Pp, Dp, Tp]`).
    /// Its axis communicators are this mesh's (the same groups); its world is the group of
    /// ranks with this rank's coordinate on `axis`.
    pub fn sub_mesh(&self, axis: AxisKind) -> Result<Arc<DeviceMesh>> {
        let sub = self.mesh.without(axis)?;
        let cut = self.mesh.index_of(axis).expect("checked by without");
        let keep: Vec<usize> = (0..self.mesh.ndim()).filter(|&i| i != cut).collect();
        let coords: SmallVec<[usize; 4]> = keep.iter().map(|&i| self.coords[i]).collect();
        let rank = sub.rank_of(&coords)?;
        let world = self.world.split(self.coords[cut], rank)?;
        debug_assert_eq!(world.rank(), rank);
        Ok(Arc::new(DeviceMesh {
            mesh: sub,
            rank,
            coords,
            world,
            axes: keep.iter().map(|&i| self.axes[i].clone()).collect(),
            root: self.root.clone(),
            device: self.device.clone(),
        }))
    }

    /// The world of the outermost mesh this one was cut from (itself if it was not cut).
    pub fn root_world(&self) -> &Arc<dyn Communicator> {
        &self.root
    }

    /// The mesh: axes, sizes and rank layout.
    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }
    /// This rank's index in the world.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// This rank's coordinate on each axis (layout order).
    pub fn coords(&self) -> &[usize] {
        &self.coords
    }
    /// The GPU holding this rank's tensors (the world communicator's
    /// [`device`](Communicator::device): NCCL's), or `None` for host memory (the threads
    /// and MPI backends). Constructors that make a local piece from host data
    /// (`distribute`, `from_fn`, parameter init) put it here, and every collective on the
    /// mesh moves memory of this place.
    pub fn device(&self) -> Option<&cuda::Device> {
        self.device.as_ref()
    }
    /// The communicator of every rank of this mesh (for a sub-mesh, the ranks sharing this
    /// rank's coordinate on the axis left out).
    pub fn world(&self) -> &Arc<dyn Communicator> {
        &self.world
    }
    /// The communicator of the axis at layout index `axis`.
    pub fn axis_comm(&self, axis: usize) -> &Arc<dyn Communicator> {
        &self.axes[axis]
    }
    /// The communicator of the axis of kind `kind` (looked up by name: built-in or
    /// declared with `mesh_axis!`), if the mesh has it.
    pub fn comm(&self, kind: AxisKind) -> Option<&Arc<dyn Communicator>> {
        self.mesh.index_of(kind).map(|i| &self.axes[i])
    }
    /// Per-axis counters, in layout order.
    pub fn counters(&self) -> Vec<(AxisKind, CounterSnapshot)> {
        self.mesh
            .axes()
            .iter()
            .zip(&self.axes)
            .map(|(&(k, _), c)| (k, c.counters()))
            .collect()
    }
    /// A receipt of what crossed each axis so far, one line per axis.
    pub fn receipt(&self) -> String {
        let mut s = String::new();
        for (k, c) in self.counters() {
            s.push_str(&format!("{}: {}\n", k.name(), c));
        }
        s
    }
}

impl fmt::Debug for DeviceMesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "DeviceMesh {{ mesh: {}, rank: {}, coords: {:?}, backend: {}, place: {} }}",
            self.mesh,
            self.rank,
            self.coords.as_slice(),
            self.world.backend(),
            match &self.device {
                None => "host".to_string(),
                Some(d) => format!("cuda:{}", d.ordinal()),
            }
        )
    }
}
