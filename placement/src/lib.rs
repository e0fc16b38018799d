//! # dtensor-placement
//!
//! Where a distributed tensor lives: the device [`Mesh`] (named axes, rank layout), the
//! axis markers (built-in [`Dp`], [`Tp`], [`Cp`], [`Ep`], [`Pp`], and user-declared ones
//! from [`mesh_axis!`], each with a name and an [`AxisRole`]),
//! [`ParallelConfig`] (`dp=2,tp=2,sp`) inside the [`Composition`] of a run
//! (`dp=2,tp=2,sp,zero1,m=4`), the placements of one axis as types
//! ([`Shard<D>`], [`Replicate`], [`Invariant`], [`Partial<Op>`]) and at run time
//! ([`Placement`]), layouts (one placement per axis, [`layout!`]), and the layout
//! arithmetic that says which slice of the global tensor each rank holds.
//!
//! ```
//! use dtensor_placement::*;
//! type Weight = layout![Dp: Replicate, Tp: Shard<0>];
//! assert_eq!(Weight::placements().as_slice(), &[Placement::Replicate, Placement::Shard(0)]);
//!
//! let mesh = Mesh::new(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)]).unwrap();
//! let coords = mesh.coords(3).unwrap();                       // [dp=1, tp=1]
//! let shape = local_shape(&mesh, &Weight::placements(), &coords, &[10, 4]).unwrap();
//! assert_eq!(shape.as_slice(), &[5, 4]);                      // rows 5..10 of 10
//! ```

#![warn(missing_docs)]

pub mod arith;
pub mod axis;
pub mod composition;
pub mod config;
pub mod error;
pub mod layout;
pub mod mesh;
pub mod placement;
pub mod rules;

pub use arith::{check_placements, chunk_range, global_offset, local_ranges, local_shape};
pub use axis::{roles, AxisDef, AxisKind, AxisRole, Cp, Dp, Ep, MeshAxis, Pp, Tp};
pub use composition::{Composition, CpStrategy, DataKind, MasterDType, ScheduleKind};
pub use config::ParallelConfig;
pub use error::{Error, Result};
pub use layout::{
    AddLayout, Here, Layout, LinearLayout, On, PointwiseLayout, RedistributeLayout, Select, There,
};
pub use mesh::{Mesh, DEFAULT_ORDER};
pub use placement::{
    AddPlacement, Avg, Brand, Invariant, IsInvariant, IsPartial, IsReplicate, IsShard, IsWhole,
    Linear, Max, Min, Partial, PartialOp, Placement, PlacementType, Plannable, Pointwise, Ragged,
    RedistributeTo, ReduceMarker, Replicate, Shard, Sum,
};
pub use rules::*;
