//! The numbers transformers prints for a causal LM on a batch of token ids, computed by
//! dtensor on any mesh: the check that a loaded checkpoint is the model its authors
//! trained (torchtitan ships the same kind of check for its converters).
//!
//! transformers' convention: the labels are the ids themselves, shifted by one inside the
//! model (position `t` predicts token `t + 1`; the last position predicts nothing), and
//! the loss is the mean over the predicted tokens. dtensor runs the same batch with the
//! targets shifted and the last position of each sample set to
//! [`IGNORE_INDEX`], so its mean over the scored tokens is that loss.

use super::model::HfModel;
use crate::{Error, Result};
use dtensor_core::{DTensor, DeviceMesh, Gradients, Tape};
use dtensor_kernels::ops::IGNORE_INDEX;
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::{
    from_stream_order, loss_value, to_stream_order, ContextParallel, DataMode, Gpt, Ids,
    Module, ParamKind, ParamVisitor, SeqMode, Weight,
};
use std::collections::BTreeMap;
use std::sync::Arc;

/// What [`run`] measures, as `dtensor hf-parity` prints it.
#[derive(Clone, Debug, PartialEq)]
pub struct Parity {
    /// The causal-LM loss: mean cross-entropy over the predicted tokens.
    pub loss: f64,
    /// The sum of every logit.
    pub logits_sum: f64,
    /// `logits[0][0][:8]`: the first sample's first position.
    pub logits_first8: Vec<f64>,
    /// `logits[-1][-1][-8:]`: the last sample's last position, its last 8 vocabulary
    /// entries.
    pub logits_last8: Vec<f64>,
    /// The L2 norm of the loss's gradient for each Hugging Face tensor, by its name (for
    /// `q_proj`, `k_proj` and `v_proj`, the norm of their rows of the fused QKV's gradient).
    pub grad_norms: BTreeMap<String, f64>,
}

/// The batch as one flat `[samples · seq]` id tensor and its shifted targets (the last
/// position of each sample ignored).
fn ids_and_targets(ids: &[Vec<u32>]) -> Result<(Tensor, Tensor, usize)> {
    let seq = ids.first().map_or(0, Vec::len);
    if seq < 2 || ids.iter().any(|s| s.len() != seq) {
        return Err(Error::Core(dtensor_core::Error::InvalidUse {
            op: "hf::parity",
            detail: format!(
                "input_ids must be samples of one length ≥ 2, got lengths {:?}",
                ids.iter().map(Vec::len).collect::<Vec<_>>()
            ),
        }));
    }
    let flat: Vec<i64> = ids.iter().flatten().map(|&t| i64::from(t)).collect();
    let targets: Vec<i64> = ids
        .iter()
        .flat_map(|s| {
            s[1..]
                .iter()
                .map(|&t| i64::from(t))
                .chain([IGNORE_INDEX])
        })
        .collect();
    let n = flat.len();
    let t = |v: Vec<i64>| Tensor::from_vec(v, &[n]).map_err(Error::from);
    Ok((t(flat)?, t(targets)?, seq))
}

/// Collective over `mesh` (`world` its root communicator): builds `model`'s decoder on
/// `mesh` under sequence mode `M` and data mode `D` in `dtype`, loads the checkpoint, and
/// runs one forward and backward of the causal-LM loss on `ids` (samples of one length,
/// the sequence length; the sample count divisible by the data ranks). Every rank returns
/// the same numbers.
pub fn run<M: SeqMode, D: DataMode>(
    model: &HfModel,
    world: &Arc<dyn dtensor_collectives::Communicator>,
    mesh: &Arc<DeviceMesh>,
    ids: &[Vec<u32>],
    dtype: DType,
    context: ContextParallel,
) -> Result<Parity> {
    let (flat, targets, seq) = ids_and_targets(ids)?;
    let config = dtensor_nn::GptConfig {
        context,
        ..model.gpt_config(seq, dtype)?
    };
    let vocab = config.vocab;
    let mut gpt = Gpt::<M, D>::new(config, mesh)?;
    model.load_into(world, &mut gpt)?;

    let place = |t: &Tensor| -> Result<DTensor<Ids>> {
        Ok(DTensor::<Ids>::from_global(
            &to_stream_order(t, seq, &context, mesh)?,
            mesh,
        )?)
    };
    let tape = Tape::new();
    let (loss, logits) = gpt.forward_with_logits(&tape, &place(&flat)?, &place(&targets)?)?;
    let loss_v = loss_value(&loss)?;
    let logits = from_stream_order(
        &logits.value().full_tensor()?.to_host()?,
        seq,
        &context,
        mesh,
    )?
    .to_f64_vec();
    let mut grads = loss.backward()?;
    let grad_norms = grad_norms(&mut gpt, &mut grads, model)?;

    let tokens = logits.len() / vocab;
    Ok(Parity {
        loss: loss_v,
        logits_sum: logits.iter().sum(),
        logits_first8: logits[..8.min(vocab)].to_vec(),
        logits_last8: logits[(tokens * vocab).saturating_sub(8.min(vocab))..].to_vec(),
        grad_norms,
    })
}

/// Collective: each Hugging Face tensor's gradient norm, from the whole reduced gradient
/// of every parameter of `m` (gathered on every rank: a parity check's model is small).
fn grad_norms(
    m: &mut impl Module,
    grads: &mut Gradients,
    model: &HfModel,
) -> Result<BTreeMap<String, f64>> {
    struct Norms<'a> {
        grads: &'a mut Gradients,
        model: &'a HfModel,
        squares: BTreeMap<String, f64>,
        failed: Option<Error>,
    }
    impl ParamVisitor for Norms<'_> {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            name: &str,
            w: &mut Weight<D, K>,
        ) -> dtensor_core::Result<()> {
            let g = w.reduced_grad(self.grads)?.full_tensor()?.to_host()?;
            let Some(segments) = self.model.names.segments(name) else {
                self.failed.get_or_insert(Error::Tensor {
                    file: self.model.dir.clone(),
                    tensor: name.to_string(),
                    detail: "a parameter with no Hugging Face tensor behind it".into(),
                });
                return Ok(());
            };
            let rows = g.shape().first().copied().unwrap_or(1);
            let values = g.to_f64_vec();
            let per_row = values.len() / rows.max(1);
            for s in segments {
                let sq: f64 = values[s.rows.start * per_row..s.rows.end * per_row]
                    .iter()
                    .map(|x| x * x)
                    .sum();
                *self.squares.entry(s.tensor.clone()).or_default() += sq;
            }
            Ok(())
        }
    }
    let mut v = Norms {
        grads,
        model,
        squares: BTreeMap::new(),
        failed: None,
    };
    m.visit_params("", &mut v)?;
    if let Some(e) = v.failed {
        return Err(e);
    }
    Ok(v.squares.into_iter().map(|(k, s)| (k, s.sqrt())).collect())
}
