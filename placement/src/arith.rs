//! Layout arithmetic: which part of the global tensor a rank holds.
//!
//! Uneven extents follow `torch.chunk`: `c = ⌈n / parts⌉`; chunk `i` covers
//! `[min(i·c, n), min((i+1)·c, n))`, so trailing chunks are short or empty. When several
//! mesh axes shard the same tensor dim, they nest left to right in the layout: the first
//! such axis chunks the whole extent, the next chunks that chunk, and so on.

use crate::error::{Error, Result};
use crate::mesh::Mesh;
use crate::placement::Placement;
use smallvec::SmallVec;
use std::ops::Range;

/// The range of chunk `index` when `extent` is cut into `parts` by `torch.chunk`.
pub fn chunk_range(extent: usize, parts: usize, index: usize) -> Range<usize> {
    let c = extent.div_ceil(parts.max(1));
    let start = (index * c).min(extent);
    let end = ((index + 1) * c).min(extent);
    start..end
}

/// Checks that `placements` fit `mesh` and a tensor of rank `ndim`.
pub fn check_placements(
    op: &'static str,
    mesh: &Mesh,
    placements: &[Placement],
    ndim: usize,
) -> Result<()> {
    if placements.len() != mesh.ndim() {
        return Err(Error::InvalidLayout {
            op,
            detail: format!(
                "{} placements for a mesh of {} axes {mesh}",
                placements.len(),
                mesh.ndim()
            ),
        });
    }
    let ragged = placements.iter().any(|p| p.is_ragged());
    if ragged && ndim == 0 {
        return Err(Error::InvalidLayout {
            op,
            detail: "a Ragged axis needs a dim 0 (its rows) but the tensor is a scalar".into(),
        });
    }
    for p in placements {
        if ragged && *p == Placement::Shard(0) {
            return Err(Error::InvalidLayout {
                op,
                detail: format!(
                    "{} shards dim 0, whose rows a Ragged axis holds as data",
                    fmt_list(placements)
                ),
            });
        }
        if let Placement::Shard(d) = *p {
            if d >= ndim {
                return Err(Error::InvalidLayout {
                    op,
                    detail: format!("{p} shards dim {d} of a tensor with {ndim} dims"),
                });
            }
        }
    }
    Ok(())
}

fn fmt_list(placements: &[Placement]) -> String {
    let v: Vec<String> = placements.iter().map(|p| p.to_string()).collect();
    format!("[{}]", v.join(", "))
}

/// For each tensor dim, the range of the global tensor that the rank at `coords` holds.
/// A `Ragged` axis cuts nothing: a ragged tensor's global extent of dim 0 is this rank's
/// own row count (see [`Placement::Ragged`]).
pub fn local_ranges(
    mesh: &Mesh,
    placements: &[Placement],
    coords: &[usize],
    global_shape: &[usize],
) -> Result<SmallVec<[Range<usize>; 4]>> {
    check_placements("local_ranges", mesh, placements, global_shape.len())?;
    let mut ranges: SmallVec<[Range<usize>; 4]> = global_shape.iter().map(|&n| 0..n).collect();
    for (axis, p) in placements.iter().enumerate() {
        if let Placement::Shard(d) = *p {
            let r = &ranges[d];
            let sub = chunk_range(r.len(), mesh.size(axis), coords[axis]);
            ranges[d] = r.start + sub.start..r.start + sub.end;
        }
    }
    Ok(ranges)
}

/// The local shape of the rank at `coords`.
pub fn local_shape(
    mesh: &Mesh,
    placements: &[Placement],
    coords: &[usize],
    global_shape: &[usize],
) -> Result<SmallVec<[usize; 4]>> {
    Ok(local_ranges(mesh, placements, coords, global_shape)?
        .iter()
        .map(|r| r.len())
        .collect())
}

/// The global offset (start index per dim) of the rank at `coords`.
pub fn global_offset(
    mesh: &Mesh,
    placements: &[Placement],
    coords: &[usize],
    global_shape: &[usize],
) -> Result<SmallVec<[usize; 4]>> {
    Ok(local_ranges(mesh, placements, coords, global_shape)?
        .iter()
        .map(|r| r.start)
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::axis::AxisKind;

    #[test]
    fn chunk_range_matches_torch_chunk() {
        // torch.chunk(arange(10), 4) -> [0..3, 3..6, 6..9, 9..10]
        let r: Vec<_> = (0..4).map(|i| chunk_range(10, 4, i)).collect();
        assert_eq!(r, vec![0..3, 3..6, 6..9, 9..10]);
        // 5 into 4: [0..2, 2..4, 4..5, 5..5]: the last is empty
        let r: Vec<_> = (0..4).map(|i| chunk_range(5, 4, i)).collect();
        assert_eq!(r, vec![0..2, 2..4, 4..5, 5..5]);
        // smaller than the mesh
        let r: Vec<_> = (0..4).map(|i| chunk_range(2, 4, i)).collect();
        assert_eq!(r, vec![0..1, 1..2, 2..2, 2..2]);
    }

    #[test]
    fn two_axes_on_one_dim_nest_left_to_right() {
        let mesh = Mesh::new(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)]).unwrap();
        let p = [Placement::Shard(0), Placement::Shard(0)];
        // 10 rows: dp chunks 0..5 | 5..10; tp chunks those into 0..3,3..5 | 5..8,8..10
        let got: Vec<_> = (0..4)
            .map(|r| {
                local_ranges(&mesh, &p, &mesh.coords(r).unwrap(), &[10, 3]).unwrap()[0].clone()
            })
            .collect();
        assert_eq!(got, vec![0..3, 3..5, 5..8, 8..10]);
        let shape = local_shape(&mesh, &p, &[1, 1], &[10, 3]).unwrap();
        assert_eq!(shape.as_slice(), &[2, 3]);
        let off = global_offset(&mesh, &p, &[1, 0], &[10, 3]).unwrap();
        assert_eq!(off.as_slice(), &[5, 0]);
    }

    #[test]
    fn different_dims_shard_independently() {
        let mesh = Mesh::new(&[(AxisKind::Dp, 2), (AxisKind::Tp, 4)]).unwrap();
        let p = [Placement::Shard(1), Placement::Shard(0)];
        let shape = local_shape(&mesh, &p, &[1, 3], &[6, 5]).unwrap();
        assert_eq!(shape.as_slice(), &[0, 2]);
        let off = global_offset(&mesh, &p, &[1, 2], &[6, 5]).unwrap();
        assert_eq!(off.as_slice(), &[4, 3]);
    }

    #[test]
    fn bad_placements_are_rejected() {
        let mesh = Mesh::new(&[(AxisKind::Tp, 2)]).unwrap();
        let e = local_shape(&mesh, &[Placement::Shard(2)], &[0], &[4, 4]).unwrap_err();
        assert!(e.to_string().contains("shards dim 2"), "{e}");
        assert!(local_shape(
            &mesh,
            &[Placement::Replicate, Placement::Replicate],
            &[0],
            &[4]
        )
        .is_err());
    }
}
