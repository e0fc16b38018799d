//! The checks every rank runs on all posts (what a rank posts before a collective, a
//! [`Post`]) once everyone has joined. All ranks see the same posts, so all reach the same
//! verdict: either every rank moves data or every rank returns an error.
//!
//! # Invariant: `check` is panic-free and gives every rank the same verdict
//!
//! `check` runs after the join, outside the data phase's panic guard. If it panicked, or
//! said "go" on one rank and "stop" on another, a rank would leave `run` (and free or
//! reuse its buffers) while its peers go on to read them through the posted addresses.
//! So `check`:
//!
//! - is a pure function of the posts, which every rank receives identically from the
//!   join; the only use of `me` is to tell the rank with invalid arguments `Invalid` where
//!   its peers get `Mismatch`, and both are errors;
//! - indexes nothing it has not checked. Slices are reached with `get`, and a missing
//!   entry is a mismatch, not a panic.

use super::view::Post;
pub(super) use crate::call::Call;
use crate::call::ROWS_DIFFER;

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
    let (Some(mine), Some(first)) = (posts.get(me), posts.first()) else {
        return Err(Problem::Mismatch(format!(
            "rank {me} of a group of {} ranks",
            posts.len()
        )));
    };
    if let Some(detail) = &mine.invalid {
        return Err(Problem::Invalid(detail.clone()));
    }
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
        let described: Vec<String> = posts
            .iter()
            .map(|p| p.call.describe_rows(p.dtype))
            .collect();
        return Err(Problem::Mismatch(crate::mismatch::mismatch_detail(
            ROWS_DIFFER,
            &described,
            members,
        )));
    }
    for (p, post) in posts.iter().enumerate() {
        let Call::AllToAllV { send_counts, .. } = &post.call else {
            break;
        };
        for (r, peer) in posts.iter().enumerate() {
            let Call::AllToAllV { recv_counts, .. } = &peer.call else {
                break;
            };
            // Every valid post has one count per rank (`counts_sum`), but a missing entry
            // must be a mismatch here, never a panic (see the module docs).
            let (Some(sent), Some(expected)) = (send_counts.get(r), recv_counts.get(p)) else {
                return mismatch(format!("rank {p} or {r} passed counts of the wrong length"));
            };
            if sent != expected {
                return mismatch(format!(
                    "rank {p} sends {sent} elements to rank {r}, which expects {expected} from it"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::threads::view::RawBuf;
    use dtensor_kernels::{DType, ReduceOp};

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
    fn check_column_rows_differ_names_every_ranks_rows() {
        let rs = |rows| Call::ReduceScatterV {
            send: 4,
            recv: 2,
            counts: vec![2, 2],
            op: ReduceOp::Sum,
            rows,
        };
        let posts = [post(rs(2), DType::F32), post(rs(1), DType::F32)];
        let Err(Problem::Mismatch(d)) = check(&posts, 0, &[0, 1]) else {
            panic!("expected a mismatch");
        };
        assert_eq!(
            d,
            "rows of the column blocks differ: \
             rank 0: reduce_scatterv(f32 x 4 -> 2, counts [2, 2], sum, 2 rows); \
             rank 1: reduce_scatterv(f32 x 4 -> 2, counts [2, 2], sum, 1 row)"
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
