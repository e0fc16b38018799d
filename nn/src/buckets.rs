//! Data-parallel gradient reduction overlapped with the backward: DDP's buckets.
//!
//! The tape hands each parameter's gradient to a hook as soon as it is final
//! ([`Var::backward_hooked`](dtensor_core::Var::backward_hooked)); [`DdpBuckets`] fuses the
//! gradients that are all-reduced over `Dp` (DDP's, and column biases' in every mode) into
//! buckets of about `cap` bytes, in the order they become final (roughly the reverse of
//! the forward), and starts each bucket's all-reduce asynchronously the moment it is full,
//! so the reduction of the last layers overlaps the backward of the first ones, as
//! PyTorch's DDP does with its 25 MB buckets. [`DdpBuckets::finish`] waits for them and
//! hands the reduced gradients to the [`GradAccumulator`]. With several microbatches, only
//! the step's last backward is hooked (PyTorch's `no_sync` for the others): earlier ones
//! accumulate raw, and the bucket adds that sum before reducing.
//!
//! A bucket is one all-reduce of the concatenated local pieces: the reduction is
//! elementwise in rank order, so the result is bitwise that of one all-reduce per
//! parameter.

use crate::data::{DataMode, ParamKind, Weight};
use crate::optim::{GradAccumulator, Module, ParamVisitor};
use dtensor_collectives::{Buffer, Communicator, ReduceOp, Request};
use dtensor_core::{AnyDTensor, Error, Result};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{AxisKind, Placement};
use std::collections::HashMap;
use std::sync::Arc;

/// PyTorch DDP's default bucket size.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// What a bucket needs of one parameter to put its reduced gradient back together.
struct Entry {
    key: u64,
    raw: AnyDTensor,
    master: DType,
}

/// Buckets of gradients all-reduced over `Dp` while the backward runs.
pub struct DdpBuckets {
    cap: usize,
    /// Parameters reduced by an all-reduce: their reduction and master dtypes.
    plan: HashMap<u64, (DType, DType)>,
    comm: Option<Arc<dyn Communicator>>,
    open: Vec<Entry>,
    open_bytes: usize,
    flying: Vec<(Vec<Entry>, Request)>,
}

impl DdpBuckets {
    /// Buckets of about `cap_bytes` for the all-reduced parameters of `m`.
    pub fn new(m: &mut impl Module, cap_bytes: usize) -> Result<Self> {
        struct Plan(HashMap<u64, (DType, DType)>, Option<Arc<dyn Communicator>>);
        impl ParamVisitor for Plan {
            fn visit<D: DataMode, K: ParamKind>(
                &mut self,
                _: &str,
                w: &mut Weight<D, K>,
            ) -> Result<()> {
                // Only where the gradient is reduced once per step (DDP): a mode that
                // reduces after every backward already holds reduced sums.
                if w.is_all_reduced() && !D::REDUCE_EACH_BACKWARD {
                    let master = w.local().dtype();
                    self.0
                        .insert(w.master().key(), (w.precision().reduce_of(master), master));
                    if self.1.is_none() {
                        self.1 = w.value().device_mesh().comm(AxisKind::Dp).cloned();
                    }
                }
                Ok(())
            }
        }
        let mut p = Plan(HashMap::new(), None);
        m.visit_params("", &mut p)?;
        Ok(DdpBuckets {
            cap: cap_bytes.max(1),
            plan: p.0,
            comm: p.1,
            open: Vec::new(),
            open_bytes: 0,
            flying: Vec::new(),
        })
    }

    /// The backward hook: takes a final gradient of an all-reduced parameter (adding what
    /// earlier microbatches accumulated in `acc`) into the open bucket, and starts the
    /// bucket's all-reduce when it is full. Other parameters' gradients are given back.
    pub fn push(
        &mut self,
        acc: &mut GradAccumulator,
        key: u64,
        g: AnyDTensor,
    ) -> Result<Option<AnyDTensor>> {
        let Some(&(reduce, master)) = self.plan.get(&key) else {
            return Ok(Some(g));
        };
        let g = match acc.take_raw(key) {
            Some(earlier) => earlier.add(&cast(&g, master)?)?,
            None => g,
        };
        let g = cast(&g, reduce)?;
        acc.mark_bucketed(key);
        if self.open.first().is_some_and(|e| e.raw.dtype() != reduce) {
            self.flush()?;
        }
        self.open_bytes += g.as_local().size_in_bytes();
        self.open.push(Entry {
            key,
            raw: g,
            master,
        });
        if self.open_bytes >= self.cap {
            self.flush()?;
        }
        Ok(None)
    }

    /// Starts the open bucket's all-reduce (the backward's end: the last, partial bucket).
    pub fn flush(&mut self) -> Result<()> {
        if self.open.is_empty() {
            return Ok(());
        }
        let entries = std::mem::take(&mut self.open);
        self.open_bytes = 0;
        let flat: Vec<Tensor> = entries
            .iter()
            .map(|e| {
                let t = e.raw.as_local().clone();
                let n = t.numel();
                t.reshape(&[n])
            })
            .collect::<std::result::Result<_, _>>()?;
        let flat = Tensor::cat(&flat, 0)?;
        let req = match &self.comm {
            Some(c) => c.start_all_reduce(Buffer::from(flat.to_storage()), ReduceOp::Sum),
            // No Dp axis: nothing to reduce.
            None => Request::ready("all_reduce", Ok(Buffer::from(flat.to_storage()))),
        };
        self.flying.push((entries, req));
        Ok(())
    }

    /// Buckets started so far.
    pub fn started(&self) -> usize {
        self.flying.len()
    }

    /// Waits for every bucket and gives `acc` the gradients, reduced over `Dp` (laid out
    /// `Invariant` there) in their masters' dtype.
    pub fn finish(mut self, acc: &mut GradAccumulator) -> Result<()> {
        self.flush()?;
        for (entries, req) in self.flying {
            let buf = req.wait()?;
            let len = buf.len();
            let flat = Tensor::from_cpu_storage(&[len], buf.into_storage())?;
            let mut offset = 0;
            for e in entries {
                let n = e.raw.as_local().numel();
                let piece = flat
                    .narrow(0, offset, n)?
                    .reshape(e.raw.local_shape())?
                    .deep_clone();
                offset += n;
                let piece = if piece.dtype() == e.master {
                    piece
                } else {
                    piece.to_dtype(e.master)
                };
                let mesh = e.raw.device_mesh();
                let dp = mesh.mesh().index_of(AxisKind::Dp);
                let placements: Vec<Placement> = e
                    .raw
                    .placements()
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        if Some(i) == dp {
                            Placement::Invariant
                        } else {
                            p
                        }
                    })
                    .collect();
                let reduced =
                    AnyDTensor::from_local(piece, e.raw.global_shape(), &placements, mesh)?;
                acc.put_dp_reduced(e.key, reduced);
            }
            if offset != len {
                return Err(Error::InvalidUse {
                    op: "DdpBuckets::finish",
                    detail: format!("a bucket of {len} elements came back for {offset}"),
                });
            }
        }
        Ok(())
    }
}

fn cast(g: &AnyDTensor, dtype: DType) -> Result<AnyDTensor> {
    if g.dtype() == dtype {
        return Ok(g.clone());
    }
    AnyDTensor::from_local(
        g.as_local().to_dtype(dtype),
        g.global_shape(),
        g.placements(),
        g.device_mesh(),
    )
}
