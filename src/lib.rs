//! # dtensor
//!
//! Distributed tensors whose placement on every mesh axis is checked by the compiler.
//!
//! A [`DTensor<L>`](DTensor) carries one placement per mesh axis in its type `L`
//! (`Shard<D>`, `Replicate`, `Invariant`, `Partial<Op>`). Every change of placement is an
//! explicit, named call that issues its collective (all-gather, reduce-scatter,
//! all-reduce, all-to-all) and has a typed backward. Nothing redistributes implicitly: a
//! non-linear op on a `Partial` axis, `Partial + Replicate`, or an all-gather of an axis
//! that is not sharded does not compile.
//!
//! Mesh axes are zero-sized marker types: the built-in `Dp`, `Tp`, `Cp`, `Ep`, `Pp`, and any
//! a model declares with [`mesh_axis!`] when it needs more, such as HSDP's two
//! data-parallel axes:
//!
//! ```
//! use dtensor::prelude::*;
//!
//! // Each axis has a name and a role (the built-in parallelism it carries), which places
//! // it in the mesh's rank order: dp_shard groups are nearer ranks than dp_replicate ones.
//! dtensor::mesh_axis!(pub DpReplicate, "dp_replicate", role = Dp);
//! dtensor::mesh_axis!(pub DpShard, "dp_shard", role = Dp);
//!
//! type Param = layout![DpReplicate: Replicate, DpShard: Shard<0>, Tp: Shard<1>];
//! let mesh = Mesh::new(&[(DpReplicate::KIND, 2), (DpShard::KIND, 2), (AxisKind::Tp, 2)]).unwrap();
//! assert_eq!(mesh.to_string(), "[dp_replicate=2, dp_shard=2, tp=2]");
//! assert_eq!(mesh.axes_with_role(AxisRole::Dp).as_slice(), &[0, 1]);
//! assert_eq!(Param::axes().as_slice(), &[DpReplicate::KIND, DpShard::KIND, AxisKind::Tp]);
//! ```
//!
//! Ranks run as threads in one process by default ([`threads::launch`]); the same model
//! code will run over MPI and NCCL backends.
//!
//! ```
//! use dtensor::prelude::*;
//!
//! // A 2×2 mesh: data parallel × tensor parallel, four ranks as threads.
//! type Sharded = layout![Dp: Shard<0>, Tp: Shard<1>];
//! type Rows = layout![Dp: Shard<0>, Tp: Replicate];
//!
//! let results = threads::launch(4, |world| -> Result<(), Error> {
//!     let mesh = DeviceMesh::new(world, Mesh::new(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)])?)?;
//!     // Rank 0 holds a 4×6 tensor; every rank receives its 2×3 block.
//!     let full = Tensor::from_fn(&[4, 6], |i| i as f32);
//!     let x = DTensor::<Sharded>::distribute(Some(&full).filter(|_| mesh.rank() == 0), 0, &mesh)?;
//!     assert_eq!(x.local_shape(), &[2, 3]);
//!
//!     // Gather the Tp axis: one all-gather over the two Tp ranks.
//!     let rows: DTensor<Rows> = x.all_gather(Tp)?;
//!     assert_eq!(rows.local_shape(), &[2, 6]);
//!
//!     // Multi-axis moves are plans you can inspect before they run.
//!     let plan = rows.plan::<layout![Dp: Replicate, Tp: Shard<0>]>()?;
//!     assert_eq!(plan.plan().collectives(), 1);
//!     let y = plan.run(rows)?;
//!
//!     assert_eq!(y.full_tensor()?, full);
//!     Ok(())
//! });
//! assert!(results.into_iter().all(|r| r.is_ok()));
//! ```

#![warn(missing_docs)]

pub mod cli;
pub mod hf;

pub use dtensor_checkpoint as checkpoint;
pub use dtensor_collectives as collectives;
pub use dtensor_core as core;
pub use dtensor_datasets as datasets;
pub use dtensor_kernels as kernels;
pub use dtensor_nn as nn;
pub use dtensor_placement as placement;
pub use dtensor_planner as planner;

pub use dtensor_collectives::threads;
pub use dtensor_core::{AnyDTensor, DTensor, DeviceMesh, Error, Plan, Result};
pub use dtensor_placement::mesh_axis;

/// What a model file imports: `use dtensor::prelude::*;`.
pub mod prelude {
    pub use dtensor_collectives::{
        threads, CollectiveKind, Communicator, CommunicatorExt, CounterSnapshot, ReduceOp,
    };
    pub use dtensor_core::{
        Adjoint, AnyDTensor, ContextAttention, CpLayout, CpStrategy, DTensor, DeviceMesh,
        Dispatched, Error, Gradients, Plan, Result, RouterConfig, Routing, RoutingStats, Step,
        StepKind, Tape, TypedPlan, Var,
    };
    pub use dtensor_kernels::{DType, Tensor};
    pub use dtensor_placement::{
        layout, mesh_axis, Avg, AxisKind, AxisRole, Composition, Cp, Dp, Ep, Invariant, Layout,
        Max, Mesh, MeshAxis, Min, ParallelConfig, Partial, PartialOp, Placement, Pp, Ragged,
        Replicate, Shard, Sum, Tp,
    };
}

/// README.md's code compiles and runs as a doc test, so the README stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

/// The user's guide in `docs/`: every Rust block there compiles and runs as a doc test
/// (`cargo test --doc -p dtensor`), so the guide stays true.
#[cfg(doctest)]
pub mod guide_doctests {
    #[doc = include_str!("../docs/README.md")]
    pub struct Index;
    #[doc = include_str!("../docs/architecture.md")]
    pub struct Architecture;
    #[doc = include_str!("../docs/placement-algebra.md")]
    pub struct PlacementAlgebra;
    #[doc = include_str!("../docs/writing-a-model.md")]
    pub struct WritingAModel;
    #[doc = include_str!("../docs/adding-an-op.md")]
    pub struct AddingAnOp;
    #[doc = include_str!("../docs/mpi.md")]
    pub struct Mpi;
    #[doc = include_str!("../docs/gpus.md")]
    pub struct Gpus;
    #[doc = include_str!("../docs/checkpoints.md")]
    pub struct Checkpoints;
    #[doc = include_str!("../docs/planner.md")]
    pub struct Planner;
    #[doc = include_str!("../docs/errors.md")]
    pub struct Errors;
    #[doc = include_str!("../docs/data.md")]
    pub struct Data;
    #[doc = include_str!("../docs/models.md")]
    pub struct Models;
}
