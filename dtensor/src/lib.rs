//! # dtensor-core
//!
//! [`DTensor<L>`]: a distributed tensor whose placement on every mesh axis is part of its
//! type, with named, consuming placement changes that issue their collective and have a
//! typed adjoint; [`AnyDTensor`], its run-time twin; [`DeviceMesh`], one rank's view of the
//! mesh with a communicator per axis; and redistribution [`Plan`]s.
//!
//! The same code runs on host memory (the threads and MPI backends) and on GPUs (NCCL): a
//! mesh keeps its tensors where its communicator moves memory ([`DeviceMesh::device`]), and
//! every collective goes through [`transfer`], which hands the backend host slices or device
//! views accordingly (feature `cuda`).
//!
//! ```
//! use dtensor_collectives::threads;
//! use dtensor_core::{DTensor, DeviceMesh, Error};
//! use dtensor_kernels::Tensor;
//! use dtensor_placement::{layout, AxisKind, Mesh, Partial, Tp, Invariant};
//!
//! // Two ranks each hold a partial term; all_reduce (Megatron's `g`) sums them.
//! let results = threads::launch(2, |world| -> Result<Vec<f64>, Error> {
//!     let mesh = DeviceMesh::new(world, Mesh::new(&[(AxisKind::Tp, 2)])?)?;
//!     let term = Tensor::from_fn(&[3], |i| (mesh.rank() * 10 + i) as f64);
//!     let p = DTensor::<layout![Tp: Partial]>::from_local(term, &[3], &mesh)?;
//!     let s: DTensor<layout![Tp: Invariant]> = p.all_reduce(Tp)?;
//!     Ok(s.as_local().to_f64_vec())
//! });
//! for r in results {
//!     assert_eq!(r.unwrap(), vec![10.0, 12.0, 14.0]);
//! }
//! ```

#![warn(missing_docs)]

pub mod any;
pub mod compute;
pub mod context;
pub mod custom;
pub mod device_mesh;
pub mod error;
pub mod fused;
pub mod hop;
pub mod moe;
pub mod plan;

pub mod tape;
pub mod transfer;
pub mod transitions;
pub mod typed;

pub use any::AnyDTensor;
pub use compute::rope::RopePositions;
pub use compute::CrossEntropy;
pub use context::{ContextAttention, CpLayout, CpStrategy};
pub use custom::{custom_op, CustomInputs, CustomOutputs, Piece};
pub use device_mesh::DeviceMesh;
pub use error::{Error, Result};
pub use fused::FusedAllReduce;
pub use hop::{HopPlacement, HopTo, StageHop};
pub use moe::{Dispatched, RouterConfig, Routing, RoutingStats};
pub use plan::{Plan, Step, StepKind};
pub use tape::{Gradients, Tape, Var, WeightPass};
pub use typed::{Adjoint, DTensor, PendingAllGather, SameLayout, TypedPlan};
