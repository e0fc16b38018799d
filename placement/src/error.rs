use crate::axis::AxisKind;

/// Mesh, config and layout mistakes the types cannot see. Messages are one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("mesh: {0}")]
    InvalidMesh(String),
    #[error("parallel config `{input}`: {detail}")]
    InvalidConfig { input: String, detail: String },
    #[error("{op}: rank {rank} is outside a mesh of {world} ranks")]
    RankOutOfRange {
        op: &'static str,
        rank: usize,
        world: usize,
    },
    #[error("{op}: axis {axis} is not in the mesh {mesh}")]
    AxisNotInMesh {
        op: &'static str,
        axis: AxisKind,
        mesh: String,
    },
    #[error("{op}: {detail}")]
    InvalidLayout { op: &'static str, detail: String },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
