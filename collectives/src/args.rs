//! Checks of a rank's own collective arguments, shared by the backends: each returns the
//! reason the arguments are inconsistent, for `Error::InvalidArgument` (and the peers'
//! `CollectiveMismatch`).

use crate::{Slice, SliceMut};

/// Same dtype on both sides, else the reason.
pub(crate) fn same_dtype(send: &Slice<'_>, recv: &SliceMut<'_>) -> Option<String> {
    (send.dtype() != recv.dtype())
        .then(|| format!("send is {} but recv is {}", send.dtype(), recv.dtype()))
}

/// Checks `counts` has one entry per rank and returns its sum.
pub(crate) fn counts_sum(counts: &[usize], name: &str, n: usize) -> Result<usize, String> {
    if counts.len() != n {
        return Err(format!(
            "{name} has {} entries for a group of {n}",
            counts.len()
        ));
    }
    counts
        .iter()
        .try_fold(0usize, |a, &c| a.checked_add(c))
        .ok_or_else(|| format!("{name} overflows: {counts:?}"))
}

/// `None` if `long.len() == ranks × short.len()`, else the reason.
pub(crate) fn is_multiple(long: (&str, usize), short: (&str, usize), n: usize) -> Option<String> {
    (Some(long.1) != short.1.checked_mul(n)).then(|| {
        format!(
            "{} has {} elements, expected {n} ranks x {} {}",
            long.0, long.1, short.0, short.1
        )
    })
}

/// For an all-to-all of equal blocks: `send` splits into one block per rank and `recv` is as
/// long as `send`, else the reason.
pub(crate) fn equal_blocks(send: usize, recv: usize, n: usize) -> Option<String> {
    if !send.is_multiple_of(n) {
        Some(format!(
            "send has {send} elements, not a multiple of the group size {n}"
        ))
    } else if recv != send {
        Some(format!("recv has {recv} elements but send has {send}"))
    } else {
        None
    }
}
