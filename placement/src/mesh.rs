//! The device mesh: named axes with sizes, and how world ranks map onto them.

use crate::axis::{AxisKind, AxisRole};
use crate::error::{Error, Result};
use smallvec::SmallVec;
use std::fmt;

/// The default composition order, fastest-varying first (Megatron's `tp-cp-ep-dp-pp`):
/// TP neighbours are adjacent ranks (the fastest links), PP is outermost. [`Mesh::new`]
/// places a user-declared axis by its [role](AxisKind::role) in this order.
pub const DEFAULT_ORDER: [AxisKind; 5] = [
    AxisKind::Tp,
    AxisKind::Cp,
    AxisKind::Ep,
    AxisKind::Dp,
    AxisKind::Pp,
];

/// A mesh of 1 to 8 named axes.
///
/// Invariants: axes have distinct names (a mesh identifies its axes by name), every size is
/// ≥ 1, and `order` lists every axis of the mesh exactly once (fastest-varying first).
/// "Layout order" is the order the axes were given in (the order of a `DTensor`'s
/// placements); "composition order" only decides which world rank sits at which
/// coordinates.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mesh {
    axes: SmallVec<[(AxisKind, usize); 4]>,
    /// Layout indices of the axes, fastest-varying first.
    order: SmallVec<[usize; 4]>,
}

impl Mesh {
    /// A mesh with these axes (in layout order) and the default composition order: axes
    /// by [role](AxisKind::role) as in [`DEFAULT_ORDER`] (`tp-cp-ep-dp-pp`, fastest first),
    /// and among axes of one role, the one further left in the layout is outer (varies
    /// slower). So TorchTitan's HSDP mesh `[dp_replicate, dp_shard, cp, tp]` puts
    /// `dp_shard` groups on nearer ranks than `dp_replicate` groups: the frequent
    /// all-gathers and reduce-scatters run over the closer links. For built-in axes alone
    /// (one per role) this is exactly `DEFAULT_ORDER`.
    pub fn new(axes: &[(AxisKind, usize)]) -> Result<Mesh> {
        let order: SmallVec<[AxisKind; 4]> = DEFAULT_ORDER
            .iter()
            .flat_map(|d| {
                axes.iter()
                    .rev()
                    .filter(move |(a, _)| a.role() == d.role())
                    .map(|&(a, _)| a)
            })
            .collect();
        Mesh::with_order(axes, &order)
    }

    /// A mesh whose ranks are laid out by `order` (fastest-varying first). Axes of `order`
    /// that the mesh lacks are skipped; every mesh axis must appear in it. Entries are
    /// matched to the mesh's axes by name, so custom kinds (`DpShard::KIND`) go in `order`
    /// like built-in ones.
    pub fn with_order(axes: &[(AxisKind, usize)], order: &[AxisKind]) -> Result<Mesh> {
        if axes.is_empty() || axes.len() > 8 {
            return Err(Error::InvalidMesh(format!(
                "a mesh has 1 to 8 axes, got {}",
                axes.len()
            )));
        }
        for (i, &(a, n)) in axes.iter().enumerate() {
            if n == 0 {
                return Err(Error::InvalidMesh(format!("axis {a} has size 0")));
            }
            if let Some(&(b, _)) = axes[..i].iter().find(|(b, _)| b.name() == a.name()) {
                return Err(Error::InvalidMesh(if b == a {
                    format!("axis {a} appears twice")
                } else {
                    format!("axes {b} and {a} are both named `{}`", a.name())
                }));
            }
        }
        let mut idx: SmallVec<[usize; 4]> = SmallVec::new();
        for &k in order {
            if let Some(i) = axes.iter().position(|&(a, _)| a.name() == k.name()) {
                if idx.contains(&i) {
                    return Err(Error::InvalidMesh(format!(
                        "axis {k} appears twice in the order"
                    )));
                }
                idx.push(i);
            }
        }
        if idx.len() != axes.len() {
            return Err(Error::InvalidMesh(format!(
                "composition order {} does not place every axis of {:?}",
                order.iter().map(|a| a.name()).collect::<Vec<_>>().join("-"),
                axes
            )));
        }
        Ok(Mesh {
            axes: axes.into(),
            order: idx,
        })
    }

    /// Parses a composition order such as `tp-cp-ep-dp-pp`. Only the built-in names
    /// (`dp`, `pp`, `ep`, `cp`, `tp`) are known here: a custom axis is a type of the user's
    /// crate, not an entry of a registry, so an order that places one is built as a slice
    /// of kinds (`[AxisKind::Tp, DpShard::KIND, DpReplicate::KIND]`) for
    /// [`Mesh::with_order`].
    pub fn parse_order(s: &str) -> Result<Vec<AxisKind>> {
        s.split('-')
            .map(|t| {
                AxisKind::from_name(t.trim())
                    .ok_or_else(|| Error::InvalidMesh(format!("unknown axis `{t}` in order `{s}`")))
            })
            .collect()
    }

    /// The composition order: the mesh's axes, fastest-varying first.
    pub fn order(&self) -> SmallVec<[AxisKind; 4]> {
        self.order.iter().map(|&i| self.axes[i].0).collect()
    }

    /// The mesh without `axis` (the other axes in the same layout and composition order):
    /// the sub-mesh of the ranks that share a coordinate on `axis`, as a pipeline stage
    /// sees the mesh without `Pp`. `Err` if the mesh lacks `axis` or has no other axis.
    pub fn without(&self, axis: AxisKind) -> Result<Mesh> {
        let i = self.index_of(axis).ok_or_else(|| {
            Error::InvalidMesh(format!("the mesh {self} has no axis {axis} to leave out"))
        })?;
        let rest: SmallVec<[(AxisKind, usize); 4]> = self
            .axes
            .iter()
            .enumerate()
            .filter(|&(j, _)| j != i)
            .map(|(_, &a)| a)
            .collect();
        let order: SmallVec<[AxisKind; 4]> =
            self.order().into_iter().filter(|&k| k != axis).collect();
        Mesh::with_order(&rest, &order)
    }

    /// Number of mesh axes (1 to 8).
    pub fn ndim(&self) -> usize {
        self.axes.len()
    }
    /// Axes and sizes, in layout order.
    pub fn axes(&self) -> &[(AxisKind, usize)] {
        &self.axes
    }
    /// The axes without their sizes, in layout order.
    pub fn axis_kinds(&self) -> SmallVec<[AxisKind; 4]> {
        self.axes.iter().map(|&(a, _)| a).collect()
    }
    /// Size (number of ranks) of the axis at layout index `axis`.
    ///
    /// # Panics
    /// If `axis >= self.ndim()`.
    pub fn size(&self, axis: usize) -> usize {
        self.axes[axis].1
    }
    /// Layout index of `axis` (looked up by name), if the mesh has it.
    pub fn index_of(&self, axis: AxisKind) -> Option<usize> {
        self.axes.iter().position(|&(a, _)| a.name() == axis.name())
    }
    /// Layout indices of the axes that carry `role` (`AxisRole::Dp`: `dp`, or HSDP's
    /// `dp_replicate` and `dp_shard`), in layout order.
    pub fn axes_with_role(&self, role: AxisRole) -> SmallVec<[usize; 4]> {
        (0..self.ndim())
            .filter(|&i| self.axes[i].0.role() == role)
            .collect()
    }
    /// Number of ranks: the product of the axis sizes.
    pub fn world_size(&self) -> usize {
        self.axes.iter().map(|&(_, n)| n).product()
    }

    fn check_rank(&self, op: &'static str, rank: usize) -> Result<()> {
        if rank >= self.world_size() {
            return Err(Error::RankOutOfRange {
                op,
                rank,
                world: self.world_size(),
            });
        }
        Ok(())
    }

    /// Coordinates of `rank`, one per axis in layout order.
    pub fn coords(&self, rank: usize) -> Result<SmallVec<[usize; 4]>> {
        self.check_rank("Mesh::coords", rank)?;
        let mut c: SmallVec<[usize; 4]> = smallvec::smallvec![0; self.ndim()];
        let mut rest = rank;
        for &i in &self.order {
            c[i] = rest % self.axes[i].1;
            rest /= self.axes[i].1;
        }
        Ok(c)
    }

    /// The world rank at `coords` (layout order).
    pub fn rank_of(&self, coords: &[usize]) -> Result<usize> {
        if coords.len() != self.ndim() || coords.iter().zip(&self.axes).any(|(&c, &(_, n))| c >= n)
        {
            return Err(Error::InvalidMesh(format!(
                "coordinates {coords:?} are outside the mesh {self}"
            )));
        }
        let mut rank = 0;
        for &i in self.order.iter().rev() {
            rank = rank * self.axes[i].1 + coords[i];
        }
        Ok(rank)
    }

    /// The ranks that share every coordinate of `rank` but the one on `axis` (layout
    /// index), ordered by their coordinate on `axis`: `rank`'s sub-group for that axis.
    pub fn axis_group(&self, rank: usize, axis: usize) -> Result<Vec<usize>> {
        let mut c = self.coords(rank)?;
        if axis >= self.ndim() {
            return Err(Error::InvalidMesh(format!(
                "axis index {axis} is outside the mesh {self}"
            )));
        }
        (0..self.axes[axis].1)
            .map(|k| {
                c[axis] = k;
                self.rank_of(&c)
            })
            .collect()
    }
}

impl fmt::Display for Mesh {
    /// `[dp=2, tp=2]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, (a, n)) in self.axes.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{}={}", a.name(), n)?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_order_puts_tp_fastest() {
        let m = Mesh::new(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)]).unwrap();
        // rank = tp + 2*dp
        assert_eq!(m.coords(0).unwrap().as_slice(), &[0, 0]);
        assert_eq!(m.coords(1).unwrap().as_slice(), &[0, 1]);
        assert_eq!(m.coords(2).unwrap().as_slice(), &[1, 0]);
        assert_eq!(m.axis_group(1, 1).unwrap(), vec![0, 1]);
        assert_eq!(m.axis_group(1, 0).unwrap(), vec![1, 3]);
    }

    #[test]
    fn four_axes_follow_tp_cp_dp_pp() {
        let m = Mesh::new(&[
            (AxisKind::Pp, 2),
            (AxisKind::Dp, 2),
            (AxisKind::Cp, 2),
            (AxisKind::Tp, 2),
        ])
        .unwrap();
        // rank = tp + 2*(cp + 2*(dp + 2*pp))
        assert_eq!(m.rank_of(&[1, 0, 1, 1]).unwrap(), 1 + 2 * (1 + 2 * (2)));
        for r in 0..16 {
            assert_eq!(m.rank_of(&m.coords(r).unwrap()).unwrap(), r);
        }
        assert_eq!(m.axis_group(0, 0).unwrap(), vec![0, 8]);
        assert_eq!(m.axis_group(0, 2).unwrap(), vec![0, 2]);
    }

    #[test]
    fn custom_order_changes_layout() {
        let order = Mesh::parse_order("dp-tp").unwrap();
        let m = Mesh::with_order(&[(AxisKind::Dp, 2), (AxisKind::Tp, 3)], &order).unwrap();
        assert_eq!(m.coords(1).unwrap().as_slice(), &[1, 0]);
        assert_eq!(m.axis_group(0, 1).unwrap(), vec![0, 2, 4]);
    }

    crate::mesh_axis!(DpReplicate, "dp_replicate", role = Dp);
    crate::mesh_axis!(DpShard, "dp_shard", role = Dp);
    crate::mesh_axis!(OtherShard, "dp_shard", role = Dp);
    use crate::axis::MeshAxis;

    #[test]
    fn custom_axes_follow_their_role_left_outer() {
        let (r, s) = (DpReplicate::KIND, DpShard::KIND);
        let m = Mesh::new(&[(r, 2), (s, 2), (AxisKind::Tp, 2)]).unwrap();
        assert_eq!(m.to_string(), "[dp_replicate=2, dp_shard=2, tp=2]");
        // rank = tp + 2*(dp_shard + 2*dp_replicate)
        assert_eq!(m.coords(1).unwrap().as_slice(), &[0, 0, 1]);
        assert_eq!(m.coords(2).unwrap().as_slice(), &[0, 1, 0]);
        assert_eq!(m.coords(4).unwrap().as_slice(), &[1, 0, 0]);
        assert_eq!(m.coords(7).unwrap().as_slice(), &[1, 1, 1]);
        assert_eq!(m.rank_of(&[1, 0, 1]).unwrap(), 5);
        assert_eq!(m.rank_of(&[0, 1, 1]).unwrap(), 3);
        for rank in 0..8 {
            assert_eq!(m.rank_of(&m.coords(rank).unwrap()).unwrap(), rank);
        }
        assert_eq!(m.axis_group(0, 2).unwrap(), vec![0, 1]);
        assert_eq!(m.axis_group(0, 1).unwrap(), vec![0, 2]);
        assert_eq!(m.axis_group(5, 1).unwrap(), vec![5, 7]);
        assert_eq!(m.axis_group(0, 0).unwrap(), vec![0, 4]);
        assert_eq!(m.axis_group(3, 0).unwrap(), vec![3, 7]);
        assert_eq!(m.index_of(s), Some(1));
        assert_eq!(m.index_of(AxisKind::Dp), None);
        assert_eq!(m.axes_with_role(AxisRole::Dp).as_slice(), &[0, 1]);
        assert_eq!(m.axes_with_role(AxisRole::Tp).as_slice(), &[2]);
        assert!(m.axes_with_role(AxisRole::Pp).is_empty());

        // Written the other way round, dp_shard is the outer one.
        let m = Mesh::new(&[(s, 2), (r, 2)]).unwrap();
        assert_eq!(m.coords(1).unwrap().as_slice(), &[0, 1]);
        // Custom axes sit between built-ins by role: tp < dp_shard < pp.
        let m = Mesh::new(&[(AxisKind::Pp, 2), (s, 2), (AxisKind::Tp, 2)]).unwrap();
        assert_eq!(m.coords(1).unwrap().as_slice(), &[0, 0, 1]);
        assert_eq!(m.coords(2).unwrap().as_slice(), &[0, 1, 0]);
        assert_eq!(m.coords(4).unwrap().as_slice(), &[1, 0, 0]);
    }

    #[test]
    fn explicit_orders_place_custom_axes() {
        let (r, s) = (DpReplicate::KIND, DpShard::KIND);
        // dp_replicate fastest.
        let m = Mesh::with_order(&[(r, 2), (s, 3)], &[r, AxisKind::Tp, s]).unwrap();
        assert_eq!(m.coords(1).unwrap().as_slice(), &[1, 0]);
        assert_eq!(m.axis_group(0, 1).unwrap(), vec![0, 2, 4]);
        assert!(Mesh::with_order(&[(r, 2), (s, 3)], &[r, AxisKind::Dp]).is_err());
        assert!(Mesh::with_order(&[(r, 2), (s, 3)], &[r, s, r]).is_err());
        // parse_order knows the built-in names only.
        assert!(Mesh::parse_order("tp-dp_shard").is_err());
    }

    #[test]
    fn axes_are_identified_by_name() {
        let e = Mesh::new(&[(DpShard::KIND, 2), (DpShard::KIND, 2)]).unwrap_err();
        assert!(e.to_string().contains("DpShard appears twice"), "{e}");
        let e = Mesh::new(&[(DpShard::KIND, 2), (OtherShard::KIND, 2)]).unwrap_err();
        assert!(
            e.to_string()
                .contains("axes DpShard and OtherShard are both named `dp_shard`"),
            "{e}"
        );
        let m = Mesh::new(&[(DpShard::KIND, 2)]).unwrap();
        assert_eq!(m.index_of(OtherShard::KIND), Some(0));
    }

    #[test]
    fn invalid_meshes_are_rejected() {
        assert!(Mesh::new(&[]).is_err());
        // Five built-in axes fit (a pipelined model mesh); a ninth axis does not.
        let five: Vec<(AxisKind, usize)> = AxisKind::ALL.iter().map(|&a| (a, 1)).collect();
        assert_eq!(Mesh::new(&five).unwrap().ndim(), 5);
        crate::mesh_axis!(X1, "x1", role = Dp);
        crate::mesh_axis!(X2, "x2", role = Dp);
        crate::mesh_axis!(X3, "x3", role = Dp);
        crate::mesh_axis!(X4, "x4", role = Dp);
        use crate::MeshAxis;
        let mut nine = five;
        nine.extend([X1::KIND, X2::KIND, X3::KIND, X4::KIND].map(|a| (a, 1)));
        let e = Mesh::new(&nine).unwrap_err();
        assert!(e.to_string().contains("1 to 8 axes"), "{e}");
        assert!(Mesh::new(&[(AxisKind::Dp, 0)]).is_err());
        let e = Mesh::new(&[(AxisKind::Tp, 2), (AxisKind::Tp, 2)]).unwrap_err();
        assert!(e.to_string().contains("Tp appears twice"), "{e}");
        assert!(
            Mesh::with_order(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)], &[AxisKind::Tp]).is_err()
        );
        assert!(Mesh::parse_order("tp-xx").is_err());
        let m = Mesh::new(&[(AxisKind::Tp, 4)]).unwrap();
        assert!(matches!(
            m.coords(4),
            Err(Error::RankOutOfRange {
                rank: 4,
                world: 4,
                ..
            })
        ));
        assert!(m.rank_of(&[4]).is_err());
        assert!(m.axis_group(0, 1).is_err());
    }
}
