//! The text of a `CollectiveMismatch`, shared by the backends.

/// Separates a rank's call description from its invalid-argument text in the strings the
/// MPI and NCCL backends exchange after a mismatch verdict: a control character no
/// description contains (not NUL, which ends a string in NCCL's gathered bytes).
#[cfg(any(feature = "mpi", feature = "nccl"))]
const INVALID_SEP: char = '\u{1}';

/// What a rank tells its peers after a mismatch (or invalid-arguments) verdict: its call's
/// description, and why its arguments are invalid when they are.
#[cfg(any(feature = "mpi", feature = "nccl"))]
pub(crate) fn described_call(described: &str, invalid: Option<&str>) -> String {
    format!("{described}{INVALID_SEP}{}", invalid.unwrap_or_default())
}

/// Every rank's description from the strings [`described_call`] made, and `what` naming
/// the first rank's invalid-argument text when the verdict is that a rank passed invalid
/// arguments.
#[cfg(any(feature = "mpi", feature = "nccl"))]
pub(crate) fn split_described(what: String, all: &[String]) -> (String, Vec<String>) {
    let (described, invalids): (Vec<String>, Vec<String>) = all
        .iter()
        .map(|s| {
            let (d, i) = s.split_once(INVALID_SEP).unwrap_or((s, ""));
            (d.to_string(), i.to_string())
        })
        .unzip();
    let what = match invalids.iter().position(|i| !i.is_empty()) {
        Some(r) if what.ends_with("passed invalid arguments") => {
            format!("{what} ({})", invalids[r])
        }
        _ => what,
    };
    (what, described)
}

/// `what: rank 0: all_reduce(f32 x 16, sum); ranks 1, 2: all_gather(f32 x 8 -> 24)`, from
/// every rank's description; `members` maps group ranks to world ranks.
pub(crate) fn mismatch_detail(what: &str, described: &[String], members: &[usize]) -> String {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (r, d) in described.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == d) {
            Some((_, ranks)) => ranks.push(r),
            None => groups.push((d, vec![r])),
        }
    }
    let mut out = format!("{what}: ");
    for (i, (d, ranks)) in groups.iter().enumerate() {
        if i > 0 {
            out.push_str("; ");
        }
        let list = ranks
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let label = if ranks.len() == 1 { "rank" } else { "ranks" };
        out.push_str(&format!("{label} {list}: {d}"));
    }
    if members.iter().enumerate().any(|(i, &w)| i != w) {
        out.push_str(&format!(" (group ranks; world ranks {members:?})"));
    }
    out
}
