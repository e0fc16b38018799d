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

pub use dtensor_collectives as collectives;
pub use dtensor_core as core;
pub use dtensor_kernels as kernels;
pub use dtensor_nn as nn;
pub use dtensor_placement as placement;

pub use dtensor_collectives::threads;
pub use dtensor_core::{AnyDTensor, DTensor, DeviceMesh, Error, Plan, Result};

/// What a model file imports: `use dtensor::prelude::*;`.
pub mod prelude {
    pub use dtensor_collectives::{
        threads, CollectiveKind, Communicator, CommunicatorExt, CounterSnapshot, ReduceOp,
    };
    pub use dtensor_core::{
        Adjoint, AnyDTensor, DTensor, DeviceMesh, Error, Gradients, Plan, Result, Step, StepKind,
        Tape, TypedPlan, Var,
    };
    pub use dtensor_kernels::{DType, Tensor};
    pub use dtensor_placement::{
        layout, Avg, AxisKind, Cp, Dp, Ep, Invariant, Layout, Max, Mesh, Min, ParallelConfig,
        Partial, PartialOp, Placement, Pp, Replicate, Shard, Sum, Tp,
    };
}

/// README.md's code compiles and runs as a doc test, so the README stays true.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
