//! What a rank posts before a collective (a [`Post`]), and the checks every rank runs on
//! all posts once everyone has joined. All ranks see the same posts, so all reach the same
//! verdict: either every rank moves data or every rank returns an error.

use crate::CollectiveKind;
use dtensor_kernels::{DType, ReduceOp};

/// The address of one rank's buffer, published to its peers in the group's post table.
#[derive(Clone, Copy, Debug)]
pub(super) struct RawBuf(pub(super) *mut u8);

// SAFETY: a `RawBuf` is only an address. Peers dereference it only between the join and
// the leave barrier of the collective that posted it: all that time the poster keeps the
// buffer borrowed (it is blocked in the protocol and cannot return), and the protocol in
// `comm.rs` fixes which rank writes which region, so no region is read and written at once.
unsafe impl Send for RawBuf {}

impl RawBuf {
    pub(super) fn null() -> RawBuf {
        RawBuf(std::ptr::null_mut())
    }
}

/// A collective call with the lengths of the caller's own buffers.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Call {
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
}

impl Call {
    pub(super) fn name(&self) -> &'static str {
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
        }
    }

    pub(super) fn kind(&self) -> CollectiveKind {
        match self {
            Call::AllReduce { .. } => CollectiveKind::AllReduce,
            Call::AllGather { .. } | Call::AllGatherV { .. } => CollectiveKind::AllGather,
            Call::ReduceScatter { .. } | Call::ReduceScatterV { .. } => {
                CollectiveKind::ReduceScatter
            }
            Call::AllToAll { .. } | Call::AllToAllV { .. } => CollectiveKind::AllToAll,
            Call::Broadcast { .. } => CollectiveKind::Broadcast,
            Call::Barrier => CollectiveKind::Barrier,
            Call::Split { .. } => CollectiveKind::Split,
        }
    }

    fn reduce_op(&self) -> Option<ReduceOp> {
        match self {
            Call::AllReduce { op, .. }
            | Call::ReduceScatter { op, .. }
            | Call::ReduceScatterV { op, .. } => Some(*op),
            _ => None,
        }
    }

    fn root(&self) -> Option<usize> {
        match self {
            Call::Broadcast { root, .. } => Some(*root),
            _ => None,
        }
    }

    /// The length every rank must pass alike (for the collectives with equal pieces).
    fn agreed_len(&self) -> Option<usize> {
        match self {
            Call::AllReduce { len, .. } | Call::Broadcast { len, .. } => Some(*len),
            Call::AllGather { send, .. } | Call::AllToAll { send, .. } => Some(*send),
            Call::ReduceScatter { recv, .. } => Some(*recv),
            _ => None,
        }
    }

    /// Rows of a column-block call that every rank must pass alike.
    fn agreed_rows(&self) -> Option<usize> {
        match self {
            Call::AllGatherV { rows, .. } | Call::ReduceScatterV { rows, .. } => Some(*rows),
            _ => None,
        }
    }

    fn counts(&self) -> Option<&[usize]> {
        match self {
            Call::AllGatherV { counts, .. } | Call::ReduceScatterV { counts, .. } => Some(counts),
            _ => None,
        }
    }
}

/// One rank's side of a collective, as its peers see it.
#[derive(Clone, Debug)]
pub(super) struct Post {
    pub(super) call: Call,
    /// `None` for the calls that move no data (barrier, split).
    pub(super) dtype: Option<DType>,
    /// Read-only for everyone (for in-place calls, the same address as `recv`).
    pub(super) send: RawBuf,
    /// Written only by its owner.
    pub(super) recv: RawBuf,
    /// The caller's own arguments were inconsistent: the reason. Posted anyway so that
    /// every rank fails together instead of its peers waiting for it.
    pub(super) invalid: Option<String>,
}

impl Post {
    /// `all_reduce(f32 x 16, sum)`: what the rank called, for mismatch messages.
    pub(super) fn describe(&self) -> String {
        let dt = self
            .dtype
            .map_or_else(|| "-".to_string(), |d| d.to_string());
        match &self.call {
            Call::AllReduce { len, op } => format!("all_reduce({dt} x {len}, {op})"),
            Call::AllGather { send, recv } => format!("all_gather({dt} x {send} -> {recv})"),
            Call::AllGatherV {
                send,
                recv,
                counts,
                rows,
            } => format!(
                "all_gatherv({dt} x {send} -> {recv}, counts {counts:?}{})",
                rows_note(*rows)
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
                rows_note(*rows)
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
                rows_note(*rows)
            ),
            Call::Broadcast { len, root } => format!("broadcast({dt} x {len}, root {root})"),
            Call::Barrier => "barrier()".to_string(),
            Call::Split { color, key } => format!("split(color {color}, key {key})"),
        }
    }
}

/// `, 4 rows` for column-block calls, nothing for plain ones.
fn rows_note(rows: usize) -> String {
    if rows > 1 {
        format!(", {rows} rows")
    } else {
        String::new()
    }
}

/// Why a joined collective cannot run.
#[derive(Debug)]
pub(super) enum Problem {
    /// This rank's own arguments are inconsistent.
    Invalid(String),
    /// The ranks' posts disagree (or a peer's arguments were invalid).
    Mismatch(String),
}

/// Checks all posts of a joined collective from rank `me`'s point of view. Every rank gets
/// the same answer except that the rank with invalid arguments gets `Invalid` where its
/// peers get `Mismatch`. `members` maps group ranks to world ranks, for the message.
pub(super) fn check(posts: &[Post], me: usize, members: &[usize]) -> Result<(), Problem> {
    if let Some(detail) = &posts[me].invalid {
        return Err(Problem::Invalid(detail.clone()));
    }
    let first = &posts[0];
    let mismatch = |what: String| {
        let described: Vec<String> = posts.iter().map(Post::describe).collect();
        Err(Problem::Mismatch(crate::mismatch::mismatch_detail(
            &what, &described, members,
        )))
    };

    if posts.iter().any(|p| p.call.name() != first.call.name()) {
        return mismatch("ranks called different collectives".into());
    }
    if let Some((r, detail)) = posts
        .iter()
        .enumerate()
        .find_map(|(r, p)| p.invalid.as_ref().map(|d| (r, d)))
    {
        return mismatch(format!("rank {r} passed invalid arguments ({detail})"));
    }
    if posts.iter().any(|p| p.dtype != first.dtype) {
        return mismatch("dtypes differ".into());
    }
    if posts
        .iter()
        .any(|p| p.call.reduce_op() != first.call.reduce_op())
    {
        return mismatch("reduce ops differ".into());
    }
    if posts.iter().any(|p| p.call.root() != first.call.root()) {
        return mismatch("roots differ".into());
    }
    if posts
        .iter()
        .any(|p| p.call.agreed_len() != first.call.agreed_len())
    {
        return mismatch("lengths differ".into());
    }
    if posts.iter().any(|p| p.call.counts() != first.call.counts()) {
        return mismatch("counts differ".into());
    }
    if posts
        .iter()
        .any(|p| p.call.agreed_rows() != first.call.agreed_rows())
    {
        return mismatch("rows of the column blocks differ".into());
    }
    for (p, post) in posts.iter().enumerate() {
        let Call::AllToAllV { send_counts, .. } = &post.call else {
            break;
        };
        for (r, peer) in posts.iter().enumerate() {
            let Call::AllToAllV { recv_counts, .. } = &peer.call else {
                break;
            };
            if send_counts[r] != recv_counts[p] {
                return mismatch(format!(
                    "rank {p} sends {} elements to rank {r}, which expects {} from it",
                    send_counts[r], recv_counts[p]
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn post(call: Call, dtype: DType) -> Post {
        Post {
            call,
            dtype: Some(dtype),
            send: RawBuf::null(),
            recv: RawBuf::null(),
            invalid: None,
        }
    }

    #[test]
    fn check_different_ops_names_both() {
        let posts = [
            post(
                Call::AllReduce {
                    len: 16,
                    op: ReduceOp::Sum,
                },
                DType::F32,
            ),
            post(Call::AllGather { send: 8, recv: 16 }, DType::F32),
        ];
        let Err(Problem::Mismatch(d)) = check(&posts, 0, &[0, 1]) else {
            panic!("expected a mismatch");
        };
        assert_eq!(
            d,
            "ranks called different collectives: rank 0: all_reduce(f32 x 16, sum); \
             rank 1: all_gather(f32 x 8 -> 16)"
        );
    }

    #[test]
    fn check_all_to_allv_pairs_disagree_names_pair() {
        let a = Call::AllToAllV {
            send: 3,
            recv: 3,
            send_counts: vec![1, 2],
            recv_counts: vec![1, 2],
            rows: 1,
        };
        let b = Call::AllToAllV {
            send: 2,
            recv: 2,
            send_counts: vec![1, 1],
            recv_counts: vec![1, 1],
            rows: 1,
        };
        let posts = [post(a, DType::I64), post(b, DType::I64)];
        let Err(Problem::Mismatch(d)) = check(&posts, 1, &[2, 3]) else {
            panic!("expected a mismatch");
        };
        assert!(
            d.starts_with("rank 0 sends 2 elements to rank 1, which expects 1"),
            "{d}"
        );
        assert!(d.ends_with("(group ranks; world ranks [2, 3])"), "{d}");
    }
}
