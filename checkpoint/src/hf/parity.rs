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
use dtensor_nn::pipeline::{microbatches, Pipeline, Schedule};
use dtensor_nn::{
    from_stream_order, loss_value, named_params, to_stream_order, ContextParallel, DataMode, Gpt,
    Ids, Module, Optimizer, Param, ParamKind, ParamVisitor, ReducedGrad, SeqMode, Weight,
};
use dtensor_placement::Layout;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// What [`run`] measures, as `dtensor hf-parity` prints it.
#[derive(Clone, Debug, PartialEq)]
pub struct Parity {
    /// The causal-LM loss: mean cross-entropy over the predicted tokens.
    pub loss: f64,
    /// The logits' summary; `None` from a pipeline ([`run`] with a schedule), whose last
    /// stage scores the logits without handing them out.
    pub logits: Option<LogitStats>,
    /// The L2 norm of the loss's gradient for each Hugging Face tensor, by its name (for
    /// `q_proj`, `k_proj` and `v_proj`, the norm of their rows of the fused QKV's gradient).
    /// From a pipeline, the tensors of this rank's stage only.
    pub grad_norms: BTreeMap<String, f64>,
}

/// A summary of the logits `[samples, seq, vocab]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LogitStats {
    /// The sum of every logit.
    pub sum: f64,
    /// `logits[0][0][:8]`: the first sample's first position.
    pub first8: Vec<f64>,
    /// `logits[-1][-1][-8:]`: the last sample's last position, its last 8 vocabulary
    /// entries.
    pub last8: Vec<f64>,
}

impl Parity {
    /// The JSON object the parity tool prints: `loss`, `logits_sum`, `logits_first8`,
    /// `logits_last8` (absent without logits) and `grad_norms`.
    pub fn to_json(&self) -> serde_json::Value {
        let mut o = serde_json::Map::new();
        o.insert("loss".into(), self.loss.into());
        if let Some(l) = &self.logits {
            o.insert("logits_sum".into(), l.sum.into());
            o.insert("logits_first8".into(), l.first8.clone().into());
            o.insert("logits_last8".into(), l.last8.clone().into());
        }
        let norms: serde_json::Map<String, serde_json::Value> = self
            .grad_norms
            .iter()
            .map(|(k, v)| (k.clone(), (*v).into()))
            .collect();
        o.insert("grad_norms".into(), norms.into());
        o.into()
    }
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
        .flat_map(|s| s[1..].iter().map(|&t| i64::from(t)).chain([IGNORE_INDEX]))
        .collect();
    let n = flat.len();
    let t = |v: Vec<i64>| Tensor::from_vec(v, &[n]).map_err(Error::from);
    Ok((t(flat)?, t(targets)?, seq))
}

/// Collective over `mesh` (`world` its root communicator): builds `model`'s decoder on
/// `mesh` under sequence mode `M` and data mode `D` in `dtype`, loads the checkpoint, and
/// runs one forward and backward of the causal-LM loss on `ids` (samples of one length,
/// the sequence length; the sample count divisible by the data ranks and microbatches).
/// With a `schedule` the mesh has a `Pp` axis and the decoder is cut into the stages it
/// runs, each rank loading only its stage's slices; every rank then returns the loss, its
/// own stage's gradient norms and no logits (the pipeline's last stage scores them without
/// handing them out). Without, every rank returns the same numbers.
pub fn run<M: SeqMode, D: DataMode>(
    model: &HfModel,
    world: &Arc<dyn dtensor_collectives::Communicator>,
    mesh: &Arc<DeviceMesh>,
    ids: &[Vec<u32>],
    dtype: DType,
    context: ContextParallel,
    schedule: Option<Schedule>,
) -> Result<Parity> {
    let (flat, targets, seq) = ids_and_targets(ids)?;
    let config = dtensor_nn::GptConfig {
        context,
        ..model.gpt_config(seq, dtype)?
    };
    let batch = Batch {
        flat: &flat,
        targets: &targets,
        seq,
        context,
    };
    match schedule {
        None => whole::<M, D>(model, world, mesh, config, batch),
        Some(s) => pipelined::<M, D>(model, world, mesh, config, batch, s),
    }
}

/// The batch of a parity run: ids, shifted targets, sequence length, CP layout.
#[derive(Clone, Copy)]
struct Batch<'a> {
    flat: &'a Tensor,
    targets: &'a Tensor,
    seq: usize,
    context: ContextParallel,
}

fn whole<M: SeqMode, D: DataMode>(
    model: &HfModel,
    world: &Arc<dyn dtensor_collectives::Communicator>,
    mesh: &Arc<DeviceMesh>,
    config: dtensor_nn::GptConfig,
    Batch {
        flat,
        targets,
        seq,
        context,
    }: Batch<'_>,
) -> Result<Parity> {
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
    let (loss, logits) = gpt.forward_with_logits(&tape, &place(flat)?, &place(targets)?)?;
    let loss_v = loss_value(&loss)?;
    let logits = from_stream_order(
        &logits.value().full_tensor()?.to_host()?,
        seq,
        &context,
        mesh,
    )?
    .to_f64_vec();
    let mut grads = loss.backward()?;
    let mut whole = Vec::new();
    gpt.visit_params("", &mut WholeGrads(&mut grads, &mut whole))?;
    let grad_norms = hf_grad_norms(model, whole)?;

    Ok(Parity {
        loss: loss_v,
        logits: Some(LogitStats {
            sum: logits.iter().sum(),
            first8: logits[..8.min(vocab)].to_vec(),
            last8: logits[logits.len() - 8.min(vocab)..].to_vec(),
        }),
        grad_norms,
    })
}

/// Collective: every parameter's whole reduced gradient, by name, in visiting order
/// (gathered on every rank: a parity check's model is small).
struct WholeGrads<'a>(&'a mut Gradients, &'a mut Vec<(String, Tensor)>);
impl ParamVisitor for WholeGrads<'_> {
    fn visit<D: DataMode, K: ParamKind>(
        &mut self,
        name: &str,
        w: &mut Weight<D, K>,
    ) -> dtensor_core::Result<()> {
        let g = w.reduced_grad(self.0)?.full_tensor()?.to_host()?;
        self.1.push((name.to_string(), g));
        Ok(())
    }
}

/// Each Hugging Face tensor's gradient norm from our parameters' whole gradients.
fn hf_grad_norms(model: &HfModel, grads: Vec<(String, Tensor)>) -> Result<BTreeMap<String, f64>> {
    let mut squares: BTreeMap<String, f64> = BTreeMap::new();
    for (name, g) in grads {
        let segments = model.names.segments(&name).ok_or_else(|| Error::Tensor {
            file: model.dir.clone(),
            tensor: name.clone(),
            detail: "a parameter with no Hugging Face tensor behind it".into(),
        })?;
        let rows = g.shape().first().copied().unwrap_or(1).max(1);
        let values = g.to_f64_vec();
        let per_row = values.len() / rows;
        for s in segments {
            let sq: f64 = values[s.rows.start * per_row..s.rows.end * per_row]
                .iter()
                .map(|x| x * x)
                .sum();
            *squares.entry(s.tensor.clone()).or_default() += sq;
        }
    }
    Ok(squares.into_iter().map(|(k, s)| (k, s.sqrt())).collect())
}

/// An optimizer that records each parameter's reduced gradient (whole) instead of
/// updating it: how a pipeline, which runs its backward inside its training step, hands
/// out its gradients.
#[derive(Default)]
struct RecordGradients(Mutex<Vec<Tensor>>);

impl Optimizer for RecordGradients {
    fn begin_step(&mut self) {}
    fn update<L, G>(&self, _: &mut Param<L>, g: &DTensor<G>) -> dtensor_core::Result<()>
    where
        L: Layout,
        G: Layout + ReducedGrad<L>,
    {
        let whole = g.full_tensor()?.to_host()?;
        self.0.lock().expect("not poisoned").push(whole);
        Ok(())
    }
}

fn pipelined<M: SeqMode, D: DataMode>(
    model: &HfModel,
    world: &Arc<dyn dtensor_collectives::Communicator>,
    mesh: &Arc<DeviceMesh>,
    config: dtensor_nn::GptConfig,
    Batch {
        flat,
        targets,
        seq,
        context,
    }: Batch<'_>,
    schedule: Schedule,
) -> Result<Parity> {
    let m = schedule.microbatches;
    let mut p = Pipeline::<M, D>::new(config, schedule, mesh)?;
    model.load_into(world, &mut p)?;
    let sm = p.stage_mesh().clone();
    let split = |t: &Tensor| -> Result<Vec<DTensor<Ids>>> {
        microbatches(t, m, seq)?
            .iter()
            .map(|mb| {
                Ok(DTensor::<Ids>::from_global(
                    &to_stream_order(mb, seq, &context, &sm)?,
                    &sm,
                )?)
            })
            .collect()
    };
    let mut probe = RecordGradients::default();
    let report = p.train_step(&split(flat)?, &split(targets)?, &mut probe, f64::INFINITY)?;
    let recorded = probe.0.into_inner().expect("not poisoned");
    let names: Vec<String> = named_params(&mut p)?.into_iter().map(|n| n.name).collect();
    if names.len() != recorded.len() {
        return Err(Error::Core(dtensor_core::Error::InvalidUse {
            op: "hf::parity::run",
            detail: format!(
                "{} gradients recorded for {} parameters (a skipped, non-finite step?)",
                recorded.len(),
                names.len()
            ),
        }));
    }
    Ok(Parity {
        loss: report.loss,
        logits: None,
        grad_norms: hf_grad_norms(model, names.into_iter().zip(recorded).collect())?,
    })
}
