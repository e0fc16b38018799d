//! Several tensors' pending sums reduced as one asynchronous collective: a data-parallel
//! gradient bucket.
//!
//! [`FusedAllReduce::start`] concatenates the local pieces of tensors that are
//! `Partial<Sum>` on one mesh axis and starts one all-reduce of the whole over that axis;
//! [`FusedAllReduce::wait`] returns each tensor reduced, `Invariant` on the axis (the same
//! transition as [`AnyDTensor::apply`] with an all-reduce step, one tensor at a time). The
//! reduction is elementwise in rank order, so every element is bitwise what a separate
//! all-reduce would give.

use crate::any::AnyDTensor;
use crate::error::{Error, Result};
use crate::transfer::{self, PendingTensor};
use dtensor_collectives::ReduceOp;
use dtensor_kernels::Tensor;
use dtensor_placement::{AxisKind, PartialOp, Placement};

/// A started all-reduce of several tensors over one mesh axis.
pub struct FusedAllReduce {
    tensors: Vec<AnyDTensor>,
    axis: usize,
    request: PendingTensor,
}

impl FusedAllReduce {
    /// Collective over `axis`: starts the all-reduce of `tensors`' pending sums on `axis`
    /// (all `Partial<Sum>` there, on one mesh, of one dtype) and returns at once.
    pub fn start(tensors: Vec<AnyDTensor>, axis: AxisKind) -> Result<Self> {
        const OP: &str = "FusedAllReduce::start";
        let Some(first) = tensors.first() else {
            return Err(Error::InvalidUse {
                op: OP,
                detail: "nothing to reduce".into(),
            });
        };
        let mesh = first.device_mesh().clone();
        let a = mesh
            .mesh()
            .index_of(axis)
            .ok_or_else(|| Error::InvalidUse {
                op: OP,
                detail: format!("the mesh {} has no axis {axis}", mesh.mesh()),
            })?;
        for t in &tensors {
            if t.device_mesh().mesh() != mesh.mesh() || t.dtype() != first.dtype() {
                return Err(Error::MeshMismatch {
                    op: OP,
                    lhs: format!("{} {}", mesh.mesh(), first.dtype()),
                    rhs: format!("{} {}", t.device_mesh().mesh(), t.dtype()),
                });
            }
            if t.placements()[a] != Placement::Partial(PartialOp::Sum) {
                return Err(Error::PlacementMismatch {
                    op: OP,
                    axis,
                    placements: t.placements().into(),
                    detail: "only pending sums (Partial<Sum>) are all-reduced".into(),
                });
            }
        }
        let flat: Vec<Tensor> = tensors
            .iter()
            .map(|t| {
                let l = t.as_local().clone();
                let n = l.numel();
                l.reshape(&[n])
            })
            .collect::<std::result::Result<_, _>>()?;
        let flat = Tensor::cat(&flat, 0)?;
        let request = transfer::start_all_reduce(&**mesh.axis_comm(a), flat, ReduceOp::Sum)?;
        Ok(FusedAllReduce {
            tensors,
            axis: a,
            request,
        })
    }

    /// Waits for the reduction: every tensor, `Invariant` on the axis.
    pub fn wait(self) -> Result<Vec<AnyDTensor>> {
        let flat = self.request.wait()?;
        let mut offset = 0;
        let mut out = Vec::with_capacity(self.tensors.len());
        for t in self.tensors {
            let n = t.as_local().numel();
            // A copy per tensor: views would keep the whole bucket alive.
            let local = flat
                .narrow(0, offset, n)?
                .reshape(t.local_shape())?
                .deep_clone();
            offset += n;
            let mut placements = t.placements().to_vec();
            placements[self.axis] = Placement::Invariant;
            out.push(AnyDTensor::from_local_for(
                "FusedAllReduce::wait",
                local,
                t.global_shape(),
                &placements,
                t.device_mesh(),
            )?);
        }
        Ok(out)
    }
}
