//! The collective calls as the backends describe them to each other: what was called,
//! with which lengths; the mismatch text; and the bytes each call moves (the table in
//! `counters.rs`). Shared by every backend, so a call reads and counts alike on all.
//!
//! The words on the wire live here too, for every backend that sends them: the dtype
//! codes, the rendezvous header of a point-to-point message ([`p2p_header`]), and
//! `wire`, the header a rank announces a collective with and the verdict drawn from
//! all of them (MPI's header round and NCCL's agreement).

#[cfg(any(feature = "mpi", feature = "nccl", test))]
pub(crate) mod wire;

use crate::CollectiveKind;
use dtensor_kernels::{chunk_sizes, DType, ReduceOp};

/// A dtype as a number (1..=6) on the wire.
pub(crate) fn dtype_code(dtype: DType) -> u64 {
    match dtype {
        DType::F32 => 1,
        DType::F64 => 2,
        DType::BF16 => 3,
        DType::F16 => 4,
        DType::I32 => 5,
        DType::I64 => 6,
    }
}

/// The inverse of [`dtype_code`].
pub(crate) fn dtype_from_code(code: u64) -> Option<DType> {
    DType::ALL.into_iter().find(|&d| dtype_code(d) == code)
}

/// The 4 words a rendezvous send announces its message with before the data (the NCCL
/// backend's `send_device` and the `unbuffered` emulator's `send`, which mirrors it):
/// dtype code, length, tag, 0. The receiver answers with [`check_p2p_header`]'s verdict.
pub(crate) fn p2p_header(dtype: DType, len: usize, tag: u32) -> [u64; 4] {
    [dtype_code(dtype), len as u64, u64::from(tag), 0]
}

/// What a receive finds in the next message's [`p2p_header`] from its source.
#[derive(Debug, PartialEq)]
pub(crate) enum P2pHeaderCheck {
    /// Dtype, length and tag are the receive's own: the data follows.
    Agrees,
    /// The tag is the receive's, the dtype or the length is not.
    Message { got_dtype: DType, got_len: usize },
    /// Another tag (or a dtype code no dtype has): on a backend without tags, this receive
    /// would take a message meant for another one.
    Tag {
        got_dtype: Option<DType>,
        got_len: usize,
        got_tag: u64,
    },
}

/// Compares `header` (the sender's [`p2p_header`]) with a receive of `len` elements of
/// `dtype` with `tag`.
pub(crate) fn check_p2p_header(
    header: &[u64],
    dtype: DType,
    len: usize,
    tag: u32,
) -> P2pHeaderCheck {
    let word = |i: usize| header.get(i).copied().unwrap_or(0);
    let got_dtype = dtype_from_code(word(0));
    let (got_len, got_tag) = (word(1) as usize, word(2));
    match got_dtype {
        Some(d) if got_tag == u64::from(tag) && d == dtype && got_len == len => {
            P2pHeaderCheck::Agrees
        }
        Some(got_dtype) if got_tag == u64::from(tag) => {
            P2pHeaderCheck::Message { got_dtype, got_len }
        }
        _ => P2pHeaderCheck::Tag {
            got_dtype,
            got_len,
            got_tag,
        },
    }
}

/// The reason of a mismatch between column-block calls whose ranks agree on element
/// counts but not on rows (described with [`Call::describe_rows`]).
pub(crate) const ROWS_DIFFER: &str = "rows of the column blocks differ";

/// A collective call with the lengths of the caller's own buffers.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Call {
    AllReduce {
        len: usize,
        op: ReduceOp,
    },
    AllGather {
        send: usize,
        recv: usize,
    },
    /// `rows > 1`: column blocks (see `Communicator::all_gather_cols`); `counts` are
    /// elements (`rows × width`).
    AllGatherV {
        send: usize,
        recv: usize,
        counts: Vec<usize>,
        rows: usize,
    },
    ReduceScatter {
        send: usize,
        recv: usize,
        op: ReduceOp,
    },
    /// `rows > 1`: column blocks of `send` (see `Communicator::reduce_scatter_cols`).
    ReduceScatterV {
        send: usize,
        recv: usize,
        counts: Vec<usize>,
        op: ReduceOp,
        rows: usize,
    },
    AllToAll {
        send: usize,
        recv: usize,
    },
    /// `rows > 1`: this rank's send blocks are column blocks of a `rows`-row matrix (see
    /// `Communicator::all_to_all_cols`); `rows` is the sender's own and may differ.
    AllToAllV {
        send: usize,
        recv: usize,
        send_counts: Vec<usize>,
        recv_counts: Vec<usize>,
        rows: usize,
    },
    Broadcast {
        len: usize,
        root: usize,
    },
    Barrier,
    Split {
        color: usize,
        key: usize,
    },
    /// The rank's program ended (MPI: `mpi::run` returned or `Mpi::finalize`): not a
    /// collective a user calls, but a peer waiting in a collective sees it and fails with
    /// `RankFailed` instead of waiting for a rank that will never come. Only the MPI
    /// backend sends it.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code))]
    Leave,
}

impl Call {
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Call::AllReduce { .. } => "all_reduce",
            Call::AllGather { .. } => "all_gather",
            Call::AllGatherV { .. } => "all_gatherv",
            Call::ReduceScatter { .. } => "reduce_scatter",
            Call::ReduceScatterV { .. } => "reduce_scatterv",
            Call::AllToAll { .. } => "all_to_all",
            Call::AllToAllV { .. } => "all_to_allv",
            Call::Broadcast { .. } => "broadcast",
            Call::Barrier => "barrier",
            Call::Split { .. } => "split",
            Call::Leave => "finalize",
        }
    }

    pub(crate) fn kind(&self) -> CollectiveKind {
        match self {
            Call::AllReduce { .. } => CollectiveKind::AllReduce,
            Call::AllGather { .. } | Call::AllGatherV { .. } => CollectiveKind::AllGather,
            Call::ReduceScatter { .. } | Call::ReduceScatterV { .. } => {
                CollectiveKind::ReduceScatter
            }
            Call::AllToAll { .. } | Call::AllToAllV { .. } => CollectiveKind::AllToAll,
            Call::Broadcast { .. } => CollectiveKind::Broadcast,
            Call::Barrier | Call::Leave => CollectiveKind::Barrier,
            Call::Split { .. } => CollectiveKind::Split,
        }
    }

    pub(crate) fn reduce_op(&self) -> Option<ReduceOp> {
        match self {
            Call::AllReduce { op, .. }
            | Call::ReduceScatter { op, .. }
            | Call::ReduceScatterV { op, .. } => Some(*op),
            _ => None,
        }
    }

    pub(crate) fn root(&self) -> Option<usize> {
        match self {
            Call::Broadcast { root, .. } => Some(*root),
            _ => None,
        }
    }

    /// The length every rank must pass alike (for the collectives with equal pieces).
    pub(crate) fn agreed_len(&self) -> Option<usize> {
        match self {
            Call::AllReduce { len, .. } | Call::Broadcast { len, .. } => Some(*len),
            Call::AllGather { send, .. } | Call::AllToAll { send, .. } => Some(*send),
            Call::ReduceScatter { recv, .. } => Some(*recv),
            _ => None,
        }
    }

    /// Rows of a column-block call that every rank must pass alike.
    pub(crate) fn agreed_rows(&self) -> Option<usize> {
        match self {
            Call::AllGatherV { rows, .. } | Call::ReduceScatterV { rows, .. } => Some(*rows),
            _ => None,
        }
    }

    pub(crate) fn counts(&self) -> Option<&[usize]> {
        match self {
            Call::AllGatherV { counts, .. } | Call::ReduceScatterV { counts, .. } => Some(counts),
            _ => None,
        }
    }

    /// `all_reduce(f32 x 16, sum)`: what the rank called, for mismatch messages. The rows
    /// of a column-block call are named when they are not 1.
    pub(crate) fn describe(&self, dtype: Option<DType>) -> String {
        self.describe_as(dtype, false)
    }

    /// [`describe`](Self::describe) for a mismatch whose reason is [`ROWS_DIFFER`]: the
    /// rows are named on every rank, 1 included, so the message says each rank's rows.
    pub(crate) fn describe_rows(&self, dtype: Option<DType>) -> String {
        self.describe_as(dtype, true)
    }

    fn describe_as(&self, dtype: Option<DType>, rows_always: bool) -> String {
        let dt = dtype.map_or_else(|| "-".to_string(), |d| d.to_string());
        let note = |rows: usize| rows_note(rows, rows_always);
        match self {
            Call::AllReduce { len, op } => format!("all_reduce({dt} x {len}, {op})"),
            Call::AllGather { send, recv } => format!("all_gather({dt} x {send} -> {recv})"),
            Call::AllGatherV {
                send,
                recv,
                counts,
                rows,
            } => format!(
                "all_gatherv({dt} x {send} -> {recv}, counts {counts:?}{})",
                note(*rows)
            ),
            Call::ReduceScatter { send, recv, op } => {
                format!("reduce_scatter({dt} x {send} -> {recv}, {op})")
            }
            Call::ReduceScatterV {
                send,
                recv,
                counts,
                op,
                rows,
            } => format!(
                "reduce_scatterv({dt} x {send} -> {recv}, counts {counts:?}, {op}{})",
                note(*rows)
            ),
            Call::AllToAll { send, recv } => format!("all_to_all({dt} x {send} -> {recv})"),
            Call::AllToAllV {
                send,
                recv,
                send_counts,
                recv_counts,
                rows,
            } => format!(
                "all_to_allv({dt} x {send} -> {recv}, send_counts {send_counts:?}, \
                 recv_counts {recv_counts:?}{})",
                note(*rows)
            ),
            Call::Broadcast { len, root } => format!("broadcast({dt} x {len}, root {root})"),
            Call::Barrier => "barrier()".to_string(),
            Call::Split { color, key } => format!("split(color {color}, key {key})"),
            Call::Leave => "returned (its program ended)".to_string(),
        }
    }

    /// Elements this rank sent to and received from peers, per the table in `counters.rs`.
    pub(crate) fn elements_moved(&self, me: usize, n: usize) -> (u64, u64) {
        let peers = n - 1;
        let (sent, received) = match self {
            Call::AllReduce { len, .. } => {
                let b = chunk_sizes(*len, n)[me];
                let moved = (len - b) + b * peers;
                (moved, moved)
            }
            Call::AllGather { send, .. } => (send * peers, send * peers),
            Call::AllGatherV { counts, recv, .. } => (counts[me] * peers, recv - counts[me]),
            Call::ReduceScatter { send, recv, .. } => (send - recv, recv * peers),
            Call::ReduceScatterV { counts, send, .. } => (send - counts[me], counts[me] * peers),
            Call::AllToAll { send, recv } => (send - send / n, recv - send / n),
            Call::AllToAllV {
                send,
                recv,
                send_counts,
                recv_counts,
                ..
            } => (send - send_counts[me], recv - recv_counts[me]),
            Call::Broadcast { len, root } if *root == me => (len * peers, 0),
            Call::Broadcast { len, .. } => (0, *len),
            Call::Barrier | Call::Split { .. } | Call::Leave => (0, 0),
        };
        (sent as u64, received as u64)
    }
}

/// `, 4 rows` for column-block calls, nothing for plain ones (1 row) unless `always`.
fn rows_note(rows: usize, always: bool) -> String {
    match rows {
        1 if always => ", 1 row".to_string(),
        1 => String::new(),
        _ => format!(", {rows} rows"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn p2p_header_check_classifies_what_differs() {
        let h = p2p_header(DType::F32, 8, 3);
        assert_eq!(
            check_p2p_header(&h, DType::F32, 8, 3),
            P2pHeaderCheck::Agrees
        );
        assert_eq!(
            check_p2p_header(&h, DType::F64, 8, 3),
            P2pHeaderCheck::Message {
                got_dtype: DType::F32,
                got_len: 8
            }
        );
        assert_eq!(
            check_p2p_header(&h, DType::F32, 9, 3),
            P2pHeaderCheck::Message {
                got_dtype: DType::F32,
                got_len: 8
            }
        );
        assert_eq!(
            check_p2p_header(&h, DType::F32, 8, 4),
            P2pHeaderCheck::Tag {
                got_dtype: Some(DType::F32),
                got_len: 8,
                got_tag: 3
            }
        );
        // An unreadable dtype code is never taken for a match.
        assert_eq!(
            check_p2p_header(&[0, 8, 3, 0], DType::F32, 8, 3),
            P2pHeaderCheck::Tag {
                got_dtype: None,
                got_len: 8,
                got_tag: 3
            }
        );
        for d in DType::ALL {
            assert_eq!(dtype_from_code(dtype_code(d)), Some(d));
        }
    }
}
