use dtensor_placement::{AxisKind, Placement};
use smallvec::SmallVec;

/// Placements of a whole tensor, for messages: `[S(0), R]`.
pub type Placements = SmallVec<[Placement; 4]>;

/// Everything the distributed layer can reject. Messages name the op, the shapes and the
/// placements involved.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The placement on an axis does not allow this op (runtime twin, or a nesting rule the
    /// types cannot see).
    #[error("{op} on axis {axis}: placements {placements:?}: {detail}")]
    PlacementMismatch {
        op: &'static str,
        axis: AxisKind,
        placements: Placements,
        detail: String,
    },
    /// A runtime-placed tensor does not have the layout a typed one needs.
    #[error("{op}: tensor is laid out as {got}, expected {expected}")]
    LayoutMismatch {
        op: &'static str,
        expected: String,
        got: String,
    },
    #[error("{op}: shape mismatch: {detail}")]
    ShapeMismatch { op: &'static str, detail: String },
    /// Operands live on different meshes (or different rank groups).
    #[error("{op}: operands are on different meshes ({lhs} vs {rhs})")]
    MeshMismatch {
        op: &'static str,
        lhs: String,
        rhs: String,
    },
    /// The adjoint of a non-linear reduction (max / min / avg partial) is not provided.
    #[error("{op}: no linear adjoint for {detail}")]
    NotDifferentiable { op: &'static str, detail: String },
    /// An API called out of order (a gradient read that backward did not keep, …).
    #[error("{op}: {detail}")]
    InvalidUse { op: &'static str, detail: String },
    /// A pipeline schedule that cannot run as written: a generator given impossible sizes,
    /// or per-rank action lists that `dtensor_nn::pipeline::Schedule::validate` rejects.
    /// The detail names the rank, the action index and the offending action.
    #[error("invalid pipeline schedule: {detail}")]
    InvalidSchedule { detail: String },
    /// Training produced a non-finite loss or gradient norm (a diverged run).
    #[error("step {step}: {detail}")]
    NonFinite { step: usize, detail: String },
    #[error(transparent)]
    Kernel(#[from] dtensor_kernels::Error),
    #[error(transparent)]
    Collective(#[from] dtensor_collectives::Error),
    #[error(transparent)]
    Placement(#[from] dtensor_placement::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
