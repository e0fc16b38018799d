//! The crate's [`Error`]: mesh, parallel-config and layout mistakes found at run time.

use crate::axis::AxisKind;

/// Mesh, config and layout mistakes the types cannot see. Messages are one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// A mesh that cannot exist or does not fit the request: no axes or more than 8, an
    /// axis of size 0, two axes with one name, a composition order that does not place
    /// every axis once, a communicator whose size is not the mesh's world size, or an
    /// axis, axis index or coordinates the mesh does not have. The string says which.
    #[error("mesh: {0}")]
    InvalidMesh(String),
    /// A [`ParallelConfig`](crate::ParallelConfig) that does not parse or validate
    /// (unknown or repeated key, a degree that is not a positive integer, `sp` without
    /// `tp` > 1), whose world size differs from the number of ranks running, or that
    /// cannot build the mesh asked for (a degree > 1 on an axis the model's layouts lack,
    /// a user-declared axis).
    #[error("parallel config `{input}`: {detail}")]
    InvalidConfig {
        /// The config: the string as given, or the parsed config displayed the same way
        /// (`dp=2,tp=2,sp`).
        input: String,
        /// What is wrong with it.
        detail: String,
    },
    /// A world rank at or beyond the mesh's world size.
    #[error("{op}: rank {rank} is outside a mesh of {world} ranks")]
    RankOutOfRange {
        /// The operation that was given the rank.
        op: &'static str,
        /// The rank asked for.
        rank: usize,
        /// The mesh's world size (number of ranks, the product of its axis sizes).
        world: usize,
    },
    /// A mesh axis named by a layout or an operation that the mesh does not have.
    #[error("{op}: axis {axis} is not in the mesh {mesh}")]
    AxisNotInMesh {
        /// The operation that named the axis.
        op: &'static str,
        /// The axis looked for.
        axis: AxisKind,
        /// The mesh, as displayed (`[dp=2, tp=2]`).
        mesh: String,
    },
    /// Placements that do not fit the mesh or the tensor: a count different from the
    /// mesh's axes, `Shard<D>` of a dim the tensor lacks, or a `Ragged` axis with a scalar
    /// or with another axis sharding dim 0.
    #[error("{op}: {detail}")]
    InvalidLayout {
        /// The operation that checked the placements.
        op: &'static str,
        /// What does not fit.
        detail: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
