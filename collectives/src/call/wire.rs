//! The wire format of the backends whose ranks agree by exchanging words (MPI's header
//! round, NCCL's agreement all-gather): what a rank announces before each collective (a
//! fixed-size [`Header`]), and the verdict every rank draws from all headers. Neither
//! library notices mismatched calls (they hang, truncate or corrupt), so this check is
//! what turns them into [`Error::CollectiveMismatch`](crate::Error::CollectiveMismatch)
//! on every rank.
//!
//! The header is a fixed [`HEADER_WORDS`] × u64 whatever the group size: counts travel as
//! hashes. Counts of all_gatherv / reduce_scatterv must be equal on every rank, so their
//! hashes must be too, and so must their rows (one word: 1 for the plain calls, the
//! matrix's rows for the column-block ones, `all_gather_cols` / `reduce_scatter_cols`,
//! whose ranks could otherwise agree on element counts while cutting different columns). For all_to_allv, rank `p`'s `send_counts[r]` must equal rank
//! `r`'s `recv_counts[p]`: every rank adds up a hash of each `(from, to, count)` it sends
//! and, separately, of each it expects; the two totals over all ranks agree exactly when
//! the pairs do (up to a 2⁻⁶⁴ collision). Only when the verdict is a mismatch do the ranks
//! exchange full descriptions (one more round, on the failure path only), so the message
//! names who called what, as the threads backend's does.

// Without the `mpi` and `nccl` features this module is compiled only for its unit tests.
#![cfg_attr(not(any(feature = "mpi", feature = "nccl")), allow(dead_code))]

use super::{dtype_code, Call, ROWS_DIFFER};
use dtensor_kernels::{DType, ReduceOp};

/// Words in a [`Header`].
pub(crate) const HEADER_WORDS: usize = 11;

/// Marks a header as ours (and of this layout: the last byte is its version).
const MAGIC: u64 = 0x6474_656e_736f_7202;

/// One rank's header, as sent to its peers.
pub(crate) type Header = [u64; HEADER_WORDS];

impl Call {
    fn code(&self) -> u64 {
        match self {
            Call::AllReduce { .. } => 1,
            Call::AllGather { .. } => 2,
            Call::AllGatherV { .. } => 3,
            Call::ReduceScatter { .. } => 4,
            Call::ReduceScatterV { .. } => 5,
            Call::AllToAll { .. } => 6,
            Call::AllToAllV { .. } => 7,
            Call::Broadcast { .. } => 8,
            Call::Barrier => 9,
            Call::Split { .. } => 10,
            Call::Leave => 11,
        }
    }

    fn reduce_word(&self) -> u64 {
        match self {
            Call::AllReduce { op, .. }
            | Call::ReduceScatter { op, .. }
            | Call::ReduceScatterV { op, .. } => match op {
                ReduceOp::Sum => 1,
                ReduceOp::Avg => 2,
                ReduceOp::Max => 3,
                ReduceOp::Min => 4,
            },
            _ => 0,
        }
    }

    /// The length every rank must pass alike (for the collectives with equal pieces).
    fn agreed_len_word(&self) -> u64 {
        match self {
            Call::AllReduce { len, .. } | Call::Broadcast { len, .. } => *len as u64,
            Call::AllGather { send, .. } | Call::AllToAll { send, .. } => *send as u64,
            Call::ReduceScatter { recv, .. } => *recv as u64,
            _ => 0,
        }
    }

    /// The rows every rank must pass alike (all_gatherv / reduce_scatterv and their
    /// column-block forms), else 0. all_to_allv's rows are the sender's own and may
    /// differ (see `Communicator::all_to_all_cols`), so they are not agreed.
    fn agreed_rows_word(&self) -> u64 {
        self.agreed_rows().map_or(0, |r| r as u64)
    }

    /// This rank's header (`me` of `n`); `invalid` says its own arguments were bad.
    pub(crate) fn header(&self, dtype: Option<DType>, invalid: bool, me: usize) -> Header {
        let dtype_code = dtype.map_or(0, dtype_code);
        let (root, counts_hash) = match self {
            Call::Broadcast { root, .. } => (*root as u64 + 1, 0),
            Call::AllGatherV { counts, .. } | Call::ReduceScatterV { counts, .. } => {
                (0, fnv(counts))
            }
            _ => (0, 0),
        };
        let (out, inn) = match self {
            Call::AllToAllV {
                send_counts,
                recv_counts,
                ..
            } => (
                send_counts
                    .iter()
                    .enumerate()
                    .fold(0u64, |a, (to, &c)| a.wrapping_add(pair_hash(me, to, c))),
                recv_counts
                    .iter()
                    .enumerate()
                    .fold(0u64, |a, (from, &c)| a.wrapping_add(pair_hash(from, me, c))),
            ),
            _ => (0, 0),
        };
        [
            MAGIC,
            self.code(),
            dtype_code,
            self.agreed_len_word(),
            self.reduce_word(),
            root,
            counts_hash,
            out,
            inn,
            u64::from(invalid),
            self.agreed_rows_word(),
        ]
    }
}

/// FNV-1a over the counts and their number (stable across processes, unlike std's hasher).
fn fnv(counts: &[usize]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in std::iter::once(counts.len()).chain(counts.iter().copied()) {
        for b in (v as u64).to_le_bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// splitmix64 of one all_to_allv pair `(from, to, count)`.
fn pair_hash(from: usize, to: usize, count: usize) -> u64 {
    let mut z = (from as u64)
        .wrapping_mul(0x9e37_79b9_7f4a_7c15)
        .wrapping_add((to as u64).wrapping_mul(0xc2b2_ae3d_27d4_eb4f))
        .wrapping_add((count as u64).wrapping_mul(0x1656_67b1_9e37_79f9))
        .wrapping_add(0x27d4_eb2f_1656_67c5);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What every rank concludes from all headers of one collective.
#[derive(Debug, PartialEq)]
pub(crate) enum Verdict {
    /// Everyone agrees: move the data.
    Go,
    /// Group rank `rank` has left (its program ended) while its peers wait in a collective.
    Departed { rank: usize },
    /// This rank's own arguments are invalid (its peers get `Mismatch`).
    Invalid,
    /// The headers disagree: the reason; the details come from a second exchange.
    Mismatch(String),
}

/// Checks all headers (indexed by group rank) from rank `me`'s point of view. Every rank
/// gets the same verdict except that a rank with invalid arguments gets `Invalid` where its
/// peers get `Mismatch`.
pub(crate) fn check(headers: &[Header], me: usize) -> Verdict {
    const CODE: usize = 1;
    let leave = Call::Leave.code();
    let first = &headers[0];
    if headers.iter().any(|h| h[0] != MAGIC) {
        return Verdict::Mismatch("a rank sent a malformed header".into());
    }
    if headers.iter().any(|h| h[CODE] != first[CODE]) {
        if let Some(rank) = headers.iter().position(|h| h[CODE] == leave) {
            return Verdict::Departed { rank };
        }
        return Verdict::Mismatch("ranks called different collectives".into());
    }
    if headers[me][9] != 0 {
        return Verdict::Invalid;
    }
    if let Some(r) = headers.iter().position(|h| h[9] != 0) {
        return Verdict::Mismatch(format!("rank {r} passed invalid arguments"));
    }
    let differs = |i: usize| headers.iter().any(|h| h[i] != first[i]);
    let checks = [
        (2, "dtypes differ"),
        (4, "reduce ops differ"),
        (5, "roots differ"),
        (3, "lengths differ"),
        (6, "counts differ"),
        (10, ROWS_DIFFER),
    ];
    if let Some((_, what)) = checks.iter().find(|(i, _)| differs(*i)) {
        return Verdict::Mismatch((*what).into());
    }
    let sum = |i: usize| headers.iter().fold(0u64, |a, h| a.wrapping_add(h[i]));
    if sum(7) != sum(8) {
        return Verdict::Mismatch(
            "all_to_allv send_counts and recv_counts do not pair up across ranks".into(),
        );
    }
    Verdict::Go
}

pub(crate) use crate::mismatch::mismatch_detail;

#[cfg(test)]
mod tests {
    use super::*;

    fn h(call: &Call, dtype: DType, me: usize) -> Header {
        call.header(Some(dtype), false, me)
    }

    #[test]
    fn check_same_call_go() {
        let c = Call::AllReduce {
            len: 16,
            op: ReduceOp::Sum,
        };
        let hs = [h(&c, DType::F32, 0), h(&c, DType::F32, 1)];
        assert_eq!(check(&hs, 0), Verdict::Go);
    }

    #[test]
    fn check_different_ops_dtypes_lengths_roots_mismatch() {
        let ar = |len| Call::AllReduce {
            len,
            op: ReduceOp::Sum,
        };
        let ag = Call::AllGather { send: 8, recv: 16 };
        let v = check(&[h(&ar(16), DType::F32, 0), h(&ag, DType::F32, 1)], 1);
        assert_eq!(
            v,
            Verdict::Mismatch("ranks called different collectives".into())
        );
        let v = check(&[h(&ar(16), DType::F32, 0), h(&ar(16), DType::F64, 1)], 0);
        assert_eq!(v, Verdict::Mismatch("dtypes differ".into()));
        let v = check(&[h(&ar(16), DType::F32, 0), h(&ar(15), DType::F32, 1)], 0);
        assert_eq!(v, Verdict::Mismatch("lengths differ".into()));
        let b = |root| Call::Broadcast { len: 3, root };
        let v = check(&[h(&b(0), DType::I32, 0), h(&b(1), DType::I32, 1)], 0);
        assert_eq!(v, Verdict::Mismatch("roots differ".into()));
    }

    #[test]
    fn check_column_rows_differ_with_equal_counts_mismatch() {
        let rs = |rows| Call::ReduceScatterV {
            send: 4,
            recv: 2,
            counts: vec![2, 2],
            op: ReduceOp::Sum,
            rows,
        };
        // 2 rows of width 1 against 1 row of width 2: the same counts.
        let hs = [h(&rs(2), DType::F32, 0), h(&rs(1), DType::F32, 1)];
        assert_eq!(check(&hs, 1), Verdict::Mismatch(ROWS_DIFFER.into()));
        let hs = [h(&rs(2), DType::F32, 0), h(&rs(2), DType::F32, 1)];
        assert_eq!(check(&hs, 0), Verdict::Go);
        // Counts are checked first, as in the threads backend.
        let mut other = rs(1);
        if let Call::ReduceScatterV { counts, .. } = &mut other {
            *counts = vec![3, 1];
        }
        let hs = [h(&rs(2), DType::F32, 0), h(&other, DType::F32, 1)];
        assert_eq!(check(&hs, 0), Verdict::Mismatch("counts differ".into()));
        // all_to_allv's rows are each sender's own: not agreed.
        let a2av = |rows| Call::AllToAllV {
            send: 4,
            recv: 4,
            send_counts: vec![2, 2],
            recv_counts: vec![2, 2],
            rows,
        };
        let hs = [h(&a2av(2), DType::F32, 0), h(&a2av(1), DType::F32, 1)];
        assert_eq!(check(&hs, 0), Verdict::Go);
    }

    #[test]
    fn check_all_to_allv_pairs_hash_detects_disagreement() {
        let a2av = |s: Vec<usize>, r: Vec<usize>| Call::AllToAllV {
            send: s.iter().sum(),
            recv: r.iter().sum(),
            send_counts: s,
            recv_counts: r,
            rows: 1,
        };
        // Rank 0 sends 2 to rank 1, rank 1 expects 2 from rank 0: consistent.
        let ok = [
            h(&a2av(vec![1, 2], vec![1, 3]), DType::I64, 0),
            h(&a2av(vec![3, 4], vec![2, 4]), DType::I64, 1),
        ];
        assert_eq!(check(&ok, 0), Verdict::Go);
        // Rank 1 expects 1 from rank 0 instead.
        let bad = [
            h(&a2av(vec![1, 2], vec![1, 3]), DType::I64, 0),
            h(&a2av(vec![3, 4], vec![1, 4]), DType::I64, 1),
        ];
        assert!(matches!(check(&bad, 1), Verdict::Mismatch(_)));
    }

    #[test]
    fn check_invalid_rank_invalid_peer_mismatch_leave_departed() {
        let c = Call::Barrier;
        let hs = [c.header(None, true, 0), c.header(None, false, 1)];
        assert_eq!(check(&hs, 0), Verdict::Invalid);
        assert_eq!(
            check(&hs, 1),
            Verdict::Mismatch("rank 0 passed invalid arguments".into())
        );
        let hs = [c.header(None, false, 0), Call::Leave.header(None, false, 1)];
        assert_eq!(check(&hs, 0), Verdict::Departed { rank: 1 });
    }

    #[test]
    fn mismatch_detail_groups_ranks_and_names_world_ranks() {
        let d = mismatch_detail(
            "counts differ",
            &["a".into(), "b".into(), "a".into()],
            &[4, 5, 6],
        );
        assert_eq!(
            d,
            "counts differ: ranks 0, 2: a; rank 1: b (group ranks; world ranks [4, 5, 6])"
        );
    }
}
