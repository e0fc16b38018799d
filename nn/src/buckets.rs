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

use crate::data::{DataMode, ParamKind};
use crate::params::{GradAccumulator, Module, ParamVisitor, Weight};
use dtensor_core::{AnyDTensor, FusedAllReduce, Result};
use dtensor_kernels::DType;
use dtensor_placement::AxisKind;
use std::collections::HashMap;

/// PyTorch DDP's default bucket size.
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Buckets of gradients all-reduced over `Dp` while the backward runs.
pub struct DdpBuckets {
    cap: usize,
    /// Parameters reduced by an all-reduce: their reduction and master dtypes.
    plan: HashMap<u64, (DType, DType)>,
    has_dp: bool,
    open: Vec<(u64, AnyDTensor)>,
    open_bytes: usize,
    flying: Vec<(Vec<(u64, DType)>, FusedAllReduce)>,
    /// Gradients of a mesh without `Dp`: nothing to reduce.
    done: Vec<(u64, AnyDTensor, DType)>,
}

impl DdpBuckets {
    /// Buckets of about `cap_bytes` for the all-reduced parameters of `m`.
    pub fn new(m: &mut impl Module, cap_bytes: usize) -> Result<Self> {
        struct Plan(HashMap<u64, (DType, DType)>, bool);
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
                    self.1 |= w.value().device_mesh().comm(AxisKind::Dp).is_some();
                }
                Ok(())
            }
        }
        let mut p = Plan(HashMap::new(), false);
        m.visit_params("", &mut p)?;
        Ok(DdpBuckets {
            cap: cap_bytes.max(1),
            plan: p.0,
            has_dp: p.1,
            open: Vec::new(),
            open_bytes: 0,
            flying: Vec::new(),
            done: Vec::new(),
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
            Some(earlier) => earlier.add(&g.to_dtype(master)?)?,
            None => g,
        };
        let g = g.to_dtype(reduce)?;
        acc.mark_bucketed(key);
        if !self.has_dp {
            self.done.push((key, g, master));
            return Ok(None);
        }
        if self.open.first().is_some_and(|(_, o)| o.dtype() != reduce) {
            self.flush()?;
        }
        self.open_bytes += g.as_local().size_in_bytes();
        self.open.push((key, g));
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
        let (keys, grads): (Vec<u64>, Vec<AnyDTensor>) =
            std::mem::take(&mut self.open).into_iter().unzip();
        self.open_bytes = 0;
        let masters = keys.iter().map(|k| (*k, self.plan[k].1)).collect();
        self.flying
            .push((masters, FusedAllReduce::start(grads, AxisKind::Dp)?));
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
        for (key, g, master) in self.done {
            acc.put_dp_reduced(key, g.to_dtype(master)?);
        }
        for (keys, bucket) in self.flying {
            for ((key, master), g) in keys.into_iter().zip(bucket.wait()?) {
                acc.put_dp_reduced(key, g.to_dtype(master)?);
            }
        }
        Ok(())
    }
}
