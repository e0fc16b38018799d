//! Loading a Hugging Face checkpoint's weights straight into a model on any mesh.
//!
//! Each rank walks its own parameters ([`Module::visit_params`]), finds the block of the
//! global tensor it holds ([`local_ranges`] of the master's layout: `Tp`, `Ep`, a sharding
//! `Dp`), and reads only that block out of the memory-mapped files, segment by segment
//! ([`NameMap`]): no rank reads, converts or holds a tensor it does not keep. Every block is
//! read first and every rank agrees, and only then are the parameters replaced, so a failed
//! load leaves the model as it was on every rank. (Which tensors the checkpoint holds is
//! checked before, by [`HfWeights::validate`], as [`HfModel::open`](super::HfModel::open)
//! does.)

use super::names::{overlapping, NameMap, Source};
use super::weights::HfWeights;
use crate::{agree, Error, Result};
use dtensor_collectives::Communicator;
use dtensor_core::{AnyDTensor, DTensor};
use dtensor_kernels::Tensor;
use dtensor_nn::{DataMode, Module, ParamKind, ParamVisitor, Weight};
use dtensor_placement::local_ranges;
use std::path::PathBuf;
use std::sync::Arc;

/// What one rank read in [`load_params`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HfLoadStats {
    /// Elements this rank read out of the files (its own blocks only).
    pub elements_read: u64,
}

/// This rank's block of our parameter `name`, whose master is laid out like `like`.
fn read_block(
    weights: &HfWeights,
    map: &NameMap,
    name: &str,
    like: &AnyDTensor,
    stats: &mut HfLoadStats,
) -> Result<AnyDTensor> {
    let not_mapped = |detail: String| Error::Tensor {
        file: weights
            .files()
            .next()
            .map(PathBuf::from)
            .unwrap_or_default(),
        tensor: name.to_string(),
        detail,
    };
    let segments = map.segments(name).ok_or_else(|| {
        not_mapped("a parameter of the model with no Hugging Face tensor behind it".into())
    })?;
    let shape = like.global_shape();
    let covered = segments.last().map_or(0, |s| s.rows.end);
    if shape.is_empty() || covered != shape[0] {
        return Err(not_mapped(format!(
            "the model holds it as {shape:?}; its Hugging Face tensors give {covered} rows"
        )));
    }
    let mesh = like.device_mesh();
    let want = local_ranges(mesh.mesh(), like.placements(), mesh.coords(), shape)
        .map_err(|e| not_mapped(e.to_string()))?;
    let mut pieces = Vec::new();
    for (seg, theirs) in overlapping(segments, &want[0]) {
        let piece = match seg.source {
            Source::Rows { .. } => {
                let mut ranges = vec![theirs];
                ranges.extend(want[1..].iter().cloned());
                weights.read(&seg.tensor, &ranges, like.dtype())?
            }
            Source::Stacked => {
                let block = weights.read(&seg.tensor, &want[1..], like.dtype())?;
                let mut stacked = vec![1];
                stacked.extend_from_slice(block.shape());
                block.reshape(&stacked)?
            }
        };
        stats.elements_read += piece.numel() as u64;
        pieces.push(piece);
    }
    let local = match pieces.len() {
        1 => pieces.pop().expect("one piece"),
        _ => Tensor::cat(&pieces, 0)?,
    };
    Ok(AnyDTensor::from_local(
        local,
        shape,
        like.placements(),
        mesh,
    )?)
}

/// Collective over `world` (every rank of the model's mesh, or the root world of a
/// pipeline): replaces every parameter of `m` with its value in `weights`, converted to
/// the parameter's dtype and laid out as the parameter is, each rank reading only its own
/// block. The optimizer state of each parameter is cleared (a fresh start from the
/// weights). Every rank loads everything or every rank gets an `Err` (naming the tensor
/// and its file) with `m` untouched.
pub fn load_params(
    world: &Arc<dyn Communicator>,
    weights: &HfWeights,
    map: &NameMap,
    m: &mut impl Module,
) -> Result<HfLoadStats> {
    struct Read<'a> {
        weights: &'a HfWeights,
        map: &'a NameMap,
        stats: HfLoadStats,
        values: Vec<AnyDTensor>,
        failed: Option<Error>,
    }
    impl ParamVisitor for Read<'_> {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            name: &str,
            w: &mut Weight<D, K>,
        ) -> dtensor_core::Result<()> {
            if self.failed.is_some() {
                return Ok(());
            }
            let like = w.value().as_any();
            match read_block(self.weights, self.map, name, like, &mut self.stats) {
                Ok(v) => self.values.push(v),
                Err(e) => self.failed = Some(e),
            }
            Ok(())
        }
    }
    let local = (|| {
        let mut read = Read {
            weights,
            map,
            stats: HfLoadStats::default(),
            values: Vec::new(),
            failed: None,
        };
        m.visit_params("", &mut read)?;
        match read.failed {
            Some(e) => Err(e),
            None => Ok((read.values, read.stats)),
        }
    })();
    let (values, stats) = agree(world, "hf load", local)?;

    // Every rank read everything it needs: commit.
    struct Apply(std::vec::IntoIter<AnyDTensor>);
    impl ParamVisitor for Apply {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            _: &str,
            w: &mut Weight<D, K>,
        ) -> dtensor_core::Result<()> {
            let value = DTensor::try_from_any(self.0.next().expect("one value per parameter"))?;
            w.restore(value, Vec::new())
        }
    }
    m.visit_params("", &mut Apply(values.into_iter()))?;
    Ok(stats)
}
