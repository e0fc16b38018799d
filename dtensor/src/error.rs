//! The crate's [`Error`] and [`Result`]: what a distributed op rejects at run time, and the
//! kernel, collective and placement errors it passes on.

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
        /// The operation refused (`all_gather`, `plan`, …).
        op: &'static str,
        /// The mesh axis whose placement is wrong.
        axis: AxisKind,
        /// The tensor's placements on every axis, in layout order.
        placements: Placements,
        /// What the op needed there.
        detail: String,
    },
    /// A runtime-placed tensor does not have the layout a typed one needs.
    #[error("{op}: tensor is laid out as {got}, expected {expected}")]
    LayoutMismatch {
        /// The conversion that checked the layout.
        op: &'static str,
        /// The typed layout asked for, as displayed.
        expected: String,
        /// The tensor's actual layout, as displayed.
        got: String,
    },
    /// Shapes that do not fit the op: operands that disagree, a local piece whose shape
    /// is not its chunk of the global shape, a dim that must divide evenly and does not.
    #[error("{op}: shape mismatch: {detail}")]
    ShapeMismatch {
        /// The operation refused.
        op: &'static str,
        /// The shapes involved and what is wrong with them.
        detail: String,
    },
    /// Targets that a kernel's check rejected (a cross-entropy target neither in the vocab
    /// nor the ignore index, ids that are not i64/i32, one id too few or many): the
    /// kernel's error names the row (of this rank's targets) and the id, this one adds the
    /// operands' shapes and placements.
    #[error("{op}: {source} (this rank's targets: {targets}; logits {logits})")]
    BadTargets {
        /// The operation refused.
        op: &'static str,
        /// The targets' shapes and placements, as displayed.
        targets: String,
        /// The logits' shapes and placements, as displayed.
        logits: String,
        /// The kernel's error (for a bad id: [`dtensor_kernels::Error::TargetOutOfRange`],
        /// with the row and the id), boxed: it is large, and rare.
        source: Box<dtensor_kernels::Error>,
    },
    /// Operands live on different meshes (or different rank groups).
    #[error("{op}: operands are on different meshes ({lhs} vs {rhs})")]
    MeshMismatch {
        /// The operation refused.
        op: &'static str,
        /// The left operand's mesh, as displayed.
        lhs: String,
        /// The right operand's mesh, as displayed.
        rhs: String,
    },
    /// The adjoint of a non-linear reduction (max / min / avg partial) is not provided.
    #[error("{op}: no linear adjoint for {detail}")]
    NotDifferentiable {
        /// The operation whose backward was asked for.
        op: &'static str,
        /// The placement or reduction that has no linear adjoint.
        detail: String,
    },
    /// An API called out of order (a gradient read that backward did not keep, …).
    #[error("{op}: {detail}")]
    InvalidUse {
        /// The call made out of order.
        op: &'static str,
        /// What is wrong and what the caller must do first.
        detail: String,
    },
    /// A pipeline schedule that cannot run as written: a generator given impossible sizes,
    /// or per-rank action lists that `dtensor_nn::pipeline::Schedule::validate` rejects.
    /// The detail names the rank, the action index and the offending action.
    #[error("invalid pipeline schedule: {detail}")]
    InvalidSchedule {
        /// The rank, action index and action at fault, or the impossible sizes.
        detail: String,
    },
    /// Training produced a non-finite loss or gradient norm (a diverged run).
    #[error("step {step}: {detail}")]
    NonFinite {
        /// The training step that diverged, as the training loop counts them.
        step: usize,
        /// Which value was not finite (loss, gradient norm) and its value.
        detail: String,
    },
    /// A local kernel refused its operands (shape or dtype mismatch, a dim out of range, a
    /// buffer that does not fill its shape).
    #[error(transparent)]
    Kernel(#[from] dtensor_kernels::Error),
    /// A collective failed: mismatched calls across ranks, a peer that failed or
    /// panicked, a backend that is not compiled in.
    #[error(transparent)]
    Collective(#[from] dtensor_collectives::Error),
    /// A mesh, parallel-config or layout mistake found by `dtensor-placement`.
    #[error(transparent)]
    Placement(#[from] dtensor_placement::Error),
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
