//! The text of a `CollectiveMismatch`, shared by the backends.

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
