//! Redistribution steps and plans.
//!
//! A [`Step`] changes the placement of one mesh axis and issues at most one collective; it
//! is the run-time form of one named transition. Each step has an adjoint step (its
//! backward), as in this table (ported from the arithmetic of Megatron's
//! `mappings.py`, and extended with `R → I` and `I → P`, which the exhaustive
//! any-to-any redistribution needs):
//!
//! | step (one axis) | from → to | collective | adjoint step |
//! |---|---|---|---|
//! | `ToReplicate` (Megatron `f`) | I → R | none | `AllReduce` P → I |
//! | `AllReduce` (Megatron `g`) | P → I | all-reduce | `ToReplicate` I → R |
//! | `AllGather{d}` | S(d) → R | all-gather | `ReduceScatter{d}` P → S(d) |
//! | `AllGatherInvariant{d}` | S(d) → I | all-gather | `Chunk{d}` I → S(d) |
//! | `ReduceScatter{d}` | P → S(d) | reduce-scatter | `AllGather{d}` S(d) → R |
//! | `AllToAll{a, b}` | S(a) → S(b) | all-to-all | `AllToAll{b, a}` |
//! | `Chunk{d}` from I | I → S(d) | none (local slice) | `AllGatherInvariant{d}` S(d) → I |
//! | `Chunk{d}` from R | R → S(d) | none (local slice) | `PadToPartial{d}` S(d) → P |
//! | `PadToPartial{d}` | S(d) → P(sum) | none (zero padding) | `Chunk{d}` R → S(d) |
//! | `ToPartial` from R | R → P | none (sum: rank 0 keeps, others zero) | `ToPartial` R → P |
//! | `ToInvariant` | R → I | none | `ToPartial` I → P |
//! | `ToPartial` from I | I → P | none (as from R) | `ToInvariant` R → I |
//!
//! Adjoints exist for sum reductions only: the backward of a max/min/avg reduction is not
//! the plain table entry, and asking for it returns [`Error::NotDifferentiable`].
//!
//! Nesting rule: when several axes shard one tensor dim they nest left to right, so a step
//! on axis `a` that creates or removes a shard of dim `d` needs every axis right of `a` to
//! leave `d` unsharded. The planner orders steps (and temporarily gathers inner axes) so the
//! rule holds; the single named transitions return `Err` when it does not.

use crate::error::{Error, Result};
use dtensor_collectives::CollectiveKind;
use dtensor_kernels::chunk_sizes;
use dtensor_placement::{local_shape, AxisKind, Mesh, PartialOp, Placement};
use smallvec::SmallVec;
use std::fmt;

/// What one step does to one axis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepKind {
    /// `S(dim) → R`: all-gather over the axis; adjoint `ReduceScatter { dim }`.
    AllGather {
        /// The tensor dim that was sharded.
        dim: usize,
    },
    /// `S(dim) → I`: all-gather over the axis; adjoint `Chunk { dim }` (a local slice).
    AllGatherInvariant {
        /// The tensor dim that was sharded.
        dim: usize,
    },
    /// `P → S(dim)`: reduce-scatter over the axis; adjoint `AllGather { dim }` (sum only).
    ReduceScatter {
        /// The tensor dim the reduced result is sharded along.
        dim: usize,
    },
    /// `P → I` (Megatron's `g`): all-reduce over the axis; adjoint `ToReplicate` (sum only).
    AllReduce,
    /// `S(from) → S(to)`: all-to-all over the axis; adjoint `AllToAll { from: to, to: from }`.
    AllToAll {
        /// The tensor dim sharded before the step.
        from: usize,
        /// The tensor dim sharded after it (different from `from`).
        to: usize,
    },
    /// `R` or `I → S(dim)`: a local slice, no communication; adjoint `PadToPartial { dim }`
    /// from `R`, `AllGatherInvariant { dim }` from `I`.
    Chunk {
        /// The tensor dim to slice.
        dim: usize,
    },
    /// `S(dim) → P(sum)`: the chunk zero-padded to the extent the axis's group covers
    /// (the whole dim, or an outer axis's chunk of it when several axes shard `dim`), no
    /// communication; adjoint `Chunk { dim }`.
    PadToPartial {
        /// The tensor dim that was sharded.
        dim: usize,
    },
    /// `I → R` (Megatron's `f`): no communication, a relabelling; adjoint `AllReduce`.
    ToReplicate,
    /// `R → I`: no communication; adjoint `ToPartial { op: Sum }`.
    ToInvariant,
    /// `R` or `I → P(op)`: no communication; for a sum the rank at coordinate 0 on the
    /// axis keeps the value and the others hold zeros, for avg, max and min every rank
    /// keeps it. Adjoint (sum only): itself from `R`, `ToInvariant` from `I`.
    ToPartial {
        /// The reduction the partial terms will combine by.
        op: PartialOp,
    },
}

impl StepKind {
    /// The method name a user calls for this step.
    pub fn name(self) -> &'static str {
        match self {
            StepKind::AllGather { .. } => "all_gather",
            StepKind::AllGatherInvariant { .. } => "all_gather_invariant",
            StepKind::ReduceScatter { .. } => "reduce_scatter",
            StepKind::AllReduce => "all_reduce",
            StepKind::AllToAll { .. } => "all_to_all",
            StepKind::Chunk { .. } => "chunk",
            StepKind::PadToPartial { .. } => "pad_to_partial",
            StepKind::ToReplicate => "to_replicate",
            StepKind::ToInvariant => "to_invariant",
            StepKind::ToPartial { .. } => "to_partial",
        }
    }

    /// The collective the step issues, if any.
    pub fn collective(self) -> Option<CollectiveKind> {
        match self {
            StepKind::AllGather { .. } | StepKind::AllGatherInvariant { .. } => {
                Some(CollectiveKind::AllGather)
            }
            StepKind::ReduceScatter { .. } => Some(CollectiveKind::ReduceScatter),
            StepKind::AllReduce => Some(CollectiveKind::AllReduce),
            StepKind::AllToAll { .. } => Some(CollectiveKind::AllToAll),
            _ => None,
        }
    }

    /// The placement after the step, given the one before; `Err` when the step does not
    /// apply to `from`.
    pub fn target(self, from: Placement) -> std::result::Result<Placement, String> {
        use Placement::*;
        let to = match (self, from) {
            (StepKind::AllGather { dim }, Shard(d)) if d == dim => Replicate,
            (StepKind::AllGatherInvariant { dim }, Shard(d)) if d == dim => Invariant,
            (StepKind::PadToPartial { dim }, Shard(d)) if d == dim => Partial(PartialOp::Sum),
            (StepKind::AllToAll { from: a, to: b }, Shard(d)) if d == a && a != b => Shard(b),
            (StepKind::ReduceScatter { dim }, Partial(_)) => Shard(dim),
            (StepKind::AllReduce, Partial(_)) => Invariant,
            (StepKind::Chunk { dim }, Replicate | Invariant) => Shard(dim),
            (StepKind::ToReplicate, Invariant) => Replicate,
            (StepKind::ToInvariant, Replicate) => Invariant,
            (StepKind::ToPartial { op }, Replicate | Invariant) => Partial(op),
            _ => {
                return Err(format!(
                    "{} does not apply to a {from} axis{}",
                    self.name(),
                    match self {
                        StepKind::AllGather { dim }
                        | StepKind::AllGatherInvariant { dim }
                        | StepKind::PadToPartial { dim } => format!(" (it needs S({dim}))"),
                        StepKind::AllToAll { from, to } if from == to => {
                            format!(" (source and target dim are both {from})")
                        }
                        StepKind::AllToAll { from, .. } => format!(" (it needs S({from}))"),
                        StepKind::ReduceScatter { .. } | StepKind::AllReduce => {
                            " (it needs Partial)".into()
                        }
                        StepKind::Chunk { .. } => " (it needs R or I)".into(),
                        StepKind::ToReplicate => " (it needs I)".into(),
                        StepKind::ToInvariant => " (it needs R)".into(),
                        StepKind::ToPartial { .. } => " (it needs R or I)".into(),
                    }
                ))
            }
        };
        Ok(to)
    }

    /// Tensor dims whose sharding the step creates or removes (see the nesting rule).
    pub fn dims(self) -> SmallVec<[usize; 2]> {
        match self {
            StepKind::AllGather { dim }
            | StepKind::AllGatherInvariant { dim }
            | StepKind::ReduceScatter { dim }
            | StepKind::Chunk { dim }
            | StepKind::PadToPartial { dim } => smallvec::smallvec![dim],
            StepKind::AllToAll { from, to } => smallvec::smallvec![from, to],
            _ => SmallVec::new(),
        }
    }

    /// The adjoint step (backward), given the placement the forward step started from.
    pub fn adjoint(self, from: Placement) -> Result<StepKind> {
        let not_diff = |detail: String| Error::NotDifferentiable {
            op: "adjoint",
            detail,
        };
        Ok(match (self, from) {
            (StepKind::AllGather { dim }, _) => StepKind::ReduceScatter { dim },
            (StepKind::AllGatherInvariant { dim }, _) => StepKind::Chunk { dim },
            (StepKind::ReduceScatter { dim }, Placement::Partial(PartialOp::Sum)) => {
                StepKind::AllGather { dim }
            }
            (StepKind::AllReduce, Placement::Partial(PartialOp::Sum)) => StepKind::ToReplicate,
            (StepKind::ReduceScatter { .. } | StepKind::AllReduce, p) => {
                return Err(not_diff(format!("{} of a {p} axis", self.name())))
            }
            (StepKind::AllToAll { from, to }, _) => StepKind::AllToAll { from: to, to: from },
            (StepKind::Chunk { dim }, Placement::Invariant) => StepKind::AllGatherInvariant { dim },
            (StepKind::Chunk { dim }, _) => StepKind::PadToPartial { dim },
            (StepKind::PadToPartial { dim }, _) => StepKind::Chunk { dim },
            (StepKind::ToReplicate, _) => StepKind::AllReduce,
            (StepKind::ToInvariant, _) => StepKind::ToPartial { op: PartialOp::Sum },
            (StepKind::ToPartial { op: PartialOp::Sum }, Placement::Replicate) => {
                StepKind::ToPartial { op: PartialOp::Sum }
            }
            (StepKind::ToPartial { op: PartialOp::Sum }, _) => StepKind::ToInvariant,
            (StepKind::ToPartial { op }, _) => {
                return Err(not_diff(format!("to_partial into P({})", op.name())))
            }
        })
    }
}

/// One planned step on one axis, with what it costs this rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// Layout index of the axis.
    pub axis: usize,
    /// The axis itself (its name and role).
    pub axis_kind: AxisKind,
    /// The axis's placement before the step.
    pub from: Placement,
    /// The axis's placement after the step.
    pub to: Placement,
    /// What the step does, and so which collective it issues.
    pub kind: StepKind,
    /// Bytes this rank receives from its peers in this step (0 for local steps).
    pub bytes_received: u64,
}

impl Step {
    /// The collective this step issues, or `None` for a local step.
    pub fn collective(&self) -> Option<CollectiveKind> {
        self.kind.collective()
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} -> {}  {}",
            self.axis_kind.name(),
            self.from,
            self.to,
            self.kind.name()
        )?;
        match self.collective() {
            Some(c) => write!(f, " ({}, {} B received)", c.name(), self.bytes_received),
            None => f.write_str(" (local)"),
        }
    }
}

/// The steps that take one layout to another, for one rank and one tensor: printable and
/// assertable before it runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    /// The placements before the plan, one per mesh axis in layout order.
    pub from: SmallVec<[Placement; 4]>,
    /// The placements after it.
    pub to: SmallVec<[Placement; 4]>,
    /// The tensor's global shape, in elements per dim.
    pub global_shape: SmallVec<[usize; 4]>,
    /// The steps in the order they run, at most one collective each.
    pub steps: Vec<Step>,
}

impl Plan {
    /// Number of collectives the plan issues.
    pub fn collectives(&self) -> usize {
        self.steps
            .iter()
            .filter(|s| s.collective().is_some())
            .count()
    }
    /// Number of steps issuing `kind`.
    pub fn count(&self, kind: CollectiveKind) -> usize {
        self.steps
            .iter()
            .filter(|s| s.collective() == Some(kind))
            .count()
    }
    /// Bytes this rank receives over the whole plan.
    pub fn bytes_received(&self) -> u64 {
        self.steps.iter().map(|s| s.bytes_received).sum()
    }
    /// Bytes received over one axis.
    pub fn bytes_on(&self, axis: AxisKind) -> u64 {
        self.steps
            .iter()
            .filter(|s| s.axis_kind == axis)
            .map(|s| s.bytes_received)
            .sum()
    }
}

fn fmt_placements(p: &[Placement]) -> String {
    let v: Vec<String> = p.iter().map(|p| p.to_string()).collect();
    format!("[{}]", v.join(", "))
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "plan {} -> {} for global shape {:?}: {} steps, {} collectives, {} B received",
            fmt_placements(&self.from),
            fmt_placements(&self.to),
            self.global_shape.as_slice(),
            self.steps.len(),
            self.collectives(),
            self.bytes_received()
        )?;
        for (i, s) in self.steps.iter().enumerate() {
            writeln!(f, "  {}. {}", i + 1, s)?;
        }
        Ok(())
    }
}

/// The steps that move one axis from `from` to `to`, ignoring other axes.
pub fn axis_moves(
    from: Placement,
    to: Placement,
) -> std::result::Result<SmallVec<[StepKind; 2]>, String> {
    use Placement::*;
    let mut v = SmallVec::new();
    match (from, to) {
        _ if from == to => {}
        (Ragged, _) | (_, Ragged) => {
            return Err(format!(
                "{from} cannot become {to}: a Ragged axis's row counts are data, not layout; \
                 it leaves the ragged world only through the MoE combine of the routing that \
                 dispatched it"
            ))
        }
        (Shard(a), Shard(b)) => v.push(StepKind::AllToAll { from: a, to: b }),
        (Shard(d), Replicate) => v.push(StepKind::AllGather { dim: d }),
        (Shard(d), Invariant) => v.push(StepKind::AllGatherInvariant { dim: d }),
        (Shard(d), Partial(PartialOp::Sum)) => v.push(StepKind::PadToPartial { dim: d }),
        (Shard(d), Partial(op)) => {
            v.push(StepKind::AllGather { dim: d });
            v.push(StepKind::ToPartial { op });
        }
        (Replicate | Invariant, Shard(d)) => v.push(StepKind::Chunk { dim: d }),
        (Replicate, Invariant) => v.push(StepKind::ToInvariant),
        (Invariant, Replicate) => v.push(StepKind::ToReplicate),
        (Replicate | Invariant, Partial(op)) => v.push(StepKind::ToPartial { op }),
        (Partial(_), Shard(d)) => v.push(StepKind::ReduceScatter { dim: d }),
        (Partial(_), Invariant) => v.push(StepKind::AllReduce),
        (Partial(_), Replicate) => {
            v.push(StepKind::AllReduce);
            v.push(StepKind::ToReplicate);
        }
        (Partial(a), Partial(b)) => {
            return Err(format!(
                "P({}) cannot become P({}): reduce it first",
                a.name(),
                b.name()
            ))
        }
        (Replicate, Replicate) | (Invariant, Invariant) => {}
    }
    Ok(v)
}

/// The innermost axis right of `axis` that shards one of `dims`, if any (the nesting rule).
pub fn nesting_blocker(placements: &[Placement], axis: usize, dims: &[usize]) -> Option<usize> {
    (axis + 1..placements.len())
        .rev()
        .find(|&b| matches!(placements[b], Placement::Shard(d) if dims.contains(&d)))
}

/// Which tensor a plan is for, seen from which rank.
#[derive(Clone, Copy, Debug)]
pub struct PlanTarget<'a> {
    /// The mesh the tensor is distributed over.
    pub mesh: &'a Mesh,
    /// The planning rank's coordinates.
    pub coords: &'a [usize],
    /// The tensor's global shape, in elements per dim.
    pub global_shape: &'a [usize],
    /// Bytes per element.
    pub elem_size: usize,
}

/// Bytes the rank receives when `kind` runs on `axis`, turning `before` into `after`
/// placements (the counters' table in `dtensor-collectives`).
pub fn step_bytes(
    t: PlanTarget<'_>,
    axis: usize,
    kind: StepKind,
    before: &[Placement],
    after: &[Placement],
) -> Result<u64> {
    let PlanTarget {
        mesh,
        coords,
        global_shape,
        elem_size,
    } = t;
    let n = mesh.size(axis);
    let shape_before = local_shape(mesh, before, coords, global_shape)?;
    let shape_after = local_shape(mesh, after, coords, global_shape)?;
    let numel = |s: &[usize]| s.iter().product::<usize>();
    let elems = match kind {
        StepKind::AllGather { .. } | StepKind::AllGatherInvariant { .. } => {
            numel(&shape_after) - numel(&shape_before)
        }
        StepKind::ReduceScatter { .. } => numel(&shape_after) * (n - 1),
        StepKind::AllReduce => {
            let len = numel(&shape_before);
            let own = chunk_sizes(len, n)[coords[axis]];
            own * (n - 1) + (len - own)
        }
        StepKind::AllToAll { to, .. } => {
            let mut own_block = shape_before.clone();
            own_block[to] = shape_after[to];
            numel(&shape_after) - numel(&own_block)
        }
        _ => 0,
    };
    Ok((elems * elem_size) as u64)
}

/// Plans the steps from `from` to `to` for one rank and tensor.
///
/// Axes are settled outermost first; before a step on axis `a` that touches dim `d`, every
/// inner axis sharding `d` is gathered to `R` (innermost first), and re-sharded later if
/// its target says so.
pub fn plan(t: PlanTarget<'_>, from: &[Placement], to: &[Placement]) -> Result<Plan> {
    let op = "plan";
    let (mesh, global_shape) = (t.mesh, t.global_shape);
    dtensor_placement::check_placements(op, mesh, from, global_shape.len())?;
    dtensor_placement::check_placements(op, mesh, to, global_shape.len())?;
    let mut cur: SmallVec<[Placement; 4]> = from.into();
    let mut steps = Vec::new();
    let mut push =
        |cur: &mut SmallVec<[Placement; 4]>, axis: usize, kind: StepKind| -> Result<()> {
            let before = cur.clone();
            let next = kind
                .target(cur[axis])
                .map_err(|detail| Error::PlacementMismatch {
                    op,
                    axis: mesh.axes()[axis].0,
                    placements: before.clone(),
                    detail,
                })?;
            cur[axis] = next;
            let bytes = step_bytes(t, axis, kind, &before, cur)?;
            steps.push(Step {
                axis,
                axis_kind: mesh.axes()[axis].0,
                from: before[axis],
                to: next,
                kind,
                bytes_received: bytes,
            });
            Ok(())
        };
    while let Some(a) = (0..cur.len()).find(|&a| cur[a] != to[a]) {
        let moves = axis_moves(cur[a], to[a]).map_err(|detail| Error::PlacementMismatch {
            op,
            axis: mesh.axes()[a].0,
            placements: cur.clone(),
            detail,
        })?;
        for kind in moves {
            while let Some(b) = nesting_blocker(&cur, a, &kind.dims()) {
                let d = cur[b].shard_dim().expect("a blocker shards a dim");
                push(&mut cur, b, StepKind::AllGather { dim: d })?;
            }
            push(&mut cur, a, kind)?;
        }
    }
    Ok(Plan {
        from: from.into(),
        to: to.into(),
        global_shape: global_shape.into(),
        steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dtensor_placement::AxisKind;
    use Placement::*;

    #[test]
    fn every_adjoint_maps_duals() {
        let kinds = [
            StepKind::AllGather { dim: 1 },
            StepKind::AllGatherInvariant { dim: 1 },
            StepKind::ReduceScatter { dim: 1 },
            StepKind::AllReduce,
            StepKind::AllToAll { from: 0, to: 1 },
            StepKind::Chunk { dim: 1 },
            StepKind::PadToPartial { dim: 1 },
            StepKind::ToReplicate,
            StepKind::ToInvariant,
            StepKind::ToPartial { op: PartialOp::Sum },
        ];
        let froms = [
            Shard(0),
            Shard(1),
            Replicate,
            Invariant,
            Partial(PartialOp::Sum),
        ];
        let mut checked = 0;
        for k in kinds {
            for from in froms {
                let Ok(to) = k.target(from) else { continue };
                let adj = k.adjoint(from).unwrap();
                // backward maps dual(to) to dual(from)
                assert_eq!(adj.target(to.dual()), Ok(from.dual()), "{k:?} from {from}");
                // and adjoint of the adjoint is the step again
                assert_eq!(adj.adjoint(to.dual()).unwrap(), k, "{k:?} from {from}");
                checked += 1;
            }
        }
        assert_eq!(checked, 12);
    }

    #[test]
    fn planner_gathers_inner_axes_first() {
        let mesh = Mesh::new(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)]).unwrap();
        let t = PlanTarget {
            mesh: &mesh,
            coords: &[0, 0],
            global_shape: &[8, 4],
            elem_size: 4,
        };
        let p = plan(t, &[Shard(0), Shard(0)], &[Replicate, Shard(0)]).unwrap();
        let kinds: Vec<_> = p.steps.iter().map(|s| (s.axis_kind, s.kind)).collect();
        assert_eq!(
            kinds,
            vec![
                (AxisKind::Tp, StepKind::AllGather { dim: 0 }),
                (AxisKind::Dp, StepKind::AllGather { dim: 0 }),
                (AxisKind::Tp, StepKind::Chunk { dim: 0 }),
            ]
        );
        // tp gather: 2x4 -> 4x4 receives 8 floats; dp gather: 4x4 -> 8x4 receives 16 floats
        assert_eq!(p.bytes_received(), (8 + 16) * 4);
        assert_eq!(p.collectives(), 2);
        assert!(p.to_string().contains("tp: S(0) -> R  all_gather"), "{p}");
    }

    #[test]
    fn partial_to_other_partial_is_refused() {
        let mesh = Mesh::new(&[(AxisKind::Tp, 2)]).unwrap();
        let t = PlanTarget {
            mesh: &mesh,
            coords: &[0],
            global_shape: &[4],
            elem_size: 4,
        };
        let e = plan(t, &[Partial(PartialOp::Sum)], &[Partial(PartialOp::Max)]).unwrap_err();
        assert!(e.to_string().contains("P(sum) cannot become P(max)"), "{e}");
    }
}
