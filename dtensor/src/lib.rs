//! # dtensor-core
//!
//! [`DTensor<L>`]: a distributed tensor whose placement on every mesh axis is part of its
//! type, with named, consuming placement changes that issue their collective and have a
//! typed adjoint; [`AnyDTensor`], its run-time twin; [`DeviceMesh`], one rank's view of the
//! mesh with a communicator per axis; and redistribution [`Plan`]s.

pub mod any;
pub mod device_mesh;
pub mod error;
pub mod plan;
pub mod typed;

pub use any::AnyDTensor;
pub use device_mesh::DeviceMesh;
pub use error::{Error, Result};
pub use plan::{Plan, Step, StepKind};
pub use typed::{Adjoint, DTensor, SameLayout, TypedPlan};
