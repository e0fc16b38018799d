//! Running a [`Schedule`] on ranks: each rank walks its own action list, nothing else.
//!
//! The mesh is `[Pp, …]`; a stage's tensors live on the sub-mesh without `Pp` (the layers'
//! `[Dp, Tp]`), and the hops between stages are typed [`StageHop`]s of the residual stream
//! over the `Pp` communicator, activations forward and gradients backward, with the same
//! layout on both sides. Every microbatch of every chunk records on its own tape, kept
//! from its forward to its backward; gradients of a step are summed over microbatches in
//! a [`GradAccumulator`] (reduced over `Dp` after every backward for ZeRO-2 and FSDP, once
//! for DDP and ZeRO-1), and one optimizer step follows the last backward, its gradient
//! norm taken across all stages.
//!
//! Loss accounting: the last stage divides each microbatch's summed token losses by the
//! count of scored tokens (targets other than the ignore index −100) of the *global batch*
//! ([`BatchTokens`], summed over the data axes and the microbatches before the first
//! forward), so the microbatches' losses add up to the batch mean whatever the microbatch
//! count and the mesh, and so do their gradients.

use crate::buckets::DdpBuckets;
use crate::data::{DataMode, Ddp};
use crate::embedding::loss_total;
use crate::model::{BatchTokens, GptConfig, SliceInput, SliceOutput};
use crate::optim::{step_accumulated, Optimizer};
use crate::params::{GradAccumulator, Module, ParamVisitor, StateVisitor};
use crate::pipeline::schedule::{Action, Schedule};
use crate::pipeline::stage::GptStage;
use crate::seq::{Grad, Ids, Loss, SeqMode, Stream};
use dtensor_collectives::Communicator;
use dtensor_core::{DTensor, DeviceMesh, Error, Result, StageHop, Tape, Var, WeightPass};
use dtensor_kernels::Tensor;
use dtensor_placement::AxisKind;
use std::sync::Arc;
use std::time::Instant;

/// What one pipelined training step reports (the same on every rank but the times).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PipelineReport {
    /// Mean loss over the global batch, before the update.
    pub loss: f64,
    /// Global gradient norm before clipping, across all stages; not finite when the update
    /// was skipped.
    pub grad_norm: f64,
    /// Seconds this rank spent in forwards and backwards.
    pub busy_secs: f64,
    /// Seconds from the start of the schedule to its last action on this rank.
    pub step_secs: f64,
}

impl PipelineReport {
    /// This rank's idle share of the step: the measured bubble.
    pub fn bubble(&self) -> f64 {
        if self.step_secs > 0.0 {
            (1.0 - self.busy_secs / self.step_secs).max(0.0)
        } else {
            0.0
        }
    }
}

/// Checks, before any rank starts, that `config`'s layers divide into the schedule's
/// stages and that the schedule validates (its error names the first offending action).
pub fn check_pipeline(config: &GptConfig, schedule: &Schedule) -> Result<()> {
    let stages = schedule.num_stages();
    if stages == 0 || !config.layers.is_multiple_of(stages) || config.layers == 0 {
        return Err(Error::InvalidSchedule {
            detail: format!(
                "{} layers do not divide into {stages} stages (pp={} × {} chunk(s) per rank)",
                config.layers, schedule.pp, schedule.virtual_stages_per_rank
            ),
        });
    }
    schedule.validate()
}

/// Cuts a global batch of token rows (`[samples · seq_len]`) into `m` microbatches of
/// whole samples; `Err` unless `m` divides the samples.
pub fn microbatches(global: &Tensor, m: usize, seq_len: usize) -> Result<Vec<Tensor>> {
    let rows = global.shape().first().copied().unwrap_or(0);
    let samples = rows / seq_len.max(1);
    if m == 0 || seq_len == 0 || rows % seq_len != 0 || !samples.is_multiple_of(m) {
        return Err(Error::ShapeMismatch {
            op: "pipeline::microbatches",
            detail: format!(
                "{m} microbatches do not divide a batch of {samples} samples of {seq_len} tokens ({rows} rows)"
            ),
        });
    }
    let per = rows / m;
    (0..m)
        .map(|i| Ok(global.narrow(0, i * per, per)?.deep_clone()))
        .collect()
}

/// This rank's part of a pipelined GPT: its chunks (virtual stages `c·pp + rank`), the
/// schedule, and the stage mesh.
pub struct Pipeline<M: SeqMode, D: DataMode = Ddp> {
    /// The whole model's shape.
    pub config: GptConfig,
    /// What every rank runs, validated when the pipeline was built.
    pub schedule: Schedule,
    /// Chunk `c` is virtual stage `c·pp + rank`.
    pub chunks: Vec<GptStage<M, D>>,
    /// DDP's gradient buckets, started during each chunk's last backward of a step (see
    /// [`Gpt::ddp_bucket_bytes`](crate::Gpt)); `None` (the default): reduced after the
    /// schedule.
    pub ddp_bucket_bytes: Option<usize>,
    stage_mesh: Arc<DeviceMesh>,
    pp: Option<Arc<dyn Communicator>>,
    rank: usize,
}

impl<M: SeqMode, D: DataMode> Pipeline<M, D> {
    /// Collective over `mesh`: cuts the model into the schedule's stages and builds this
    /// rank's chunks on the sub-mesh without `Pp` (the whole mesh when it has no `Pp`).
    pub fn new(config: GptConfig, schedule: Schedule, mesh: &Arc<DeviceMesh>) -> Result<Self> {
        check_pipeline(&config, &schedule)?;
        let (stage_mesh, pp, rank) = match mesh.mesh().index_of(AxisKind::Pp) {
            Some(i) => (
                mesh.sub_mesh(AxisKind::Pp)?,
                Some(mesh.axis_comm(i).clone()),
                mesh.coords()[i],
            ),
            None => (mesh.clone(), None, 0),
        };
        let pp_size = pp.as_ref().map_or(1, |c| c.size());
        if pp_size != schedule.pp {
            return Err(Error::InvalidSchedule {
                detail: format!(
                    "the schedule has pp={} but the mesh {} has pp={pp_size}",
                    schedule.pp,
                    mesh.mesh()
                ),
            });
        }
        let stages = schedule.num_stages();
        let per = config.layers / stages;
        let chunks = schedule
            .stages_of(rank)
            .into_iter()
            .map(|s| {
                GptStage::new(
                    config,
                    s * per..(s + 1) * per,
                    s == 0,
                    s + 1 == stages,
                    &stage_mesh,
                )
            })
            .collect::<Result<_>>()?;
        Ok(Pipeline {
            config,
            schedule,
            chunks,
            ddp_bucket_bytes: None,
            stage_mesh,
            pp,
            rank,
        })
    }

    /// The mesh this rank's stages live on (`[Dp, Tp]`): where a microbatch's ids go.
    pub fn stage_mesh(&self) -> &Arc<DeviceMesh> {
        &self.stage_mesh
    }

    /// This rank's coordinate on `Pp`.
    pub fn pp_rank(&self) -> usize {
        self.rank
    }

    /// Collective: one training step over the microbatches `ids[k]` / `targets[k]` (each
    /// `[tokens]` on the stage mesh; every rank passes them, only the first and last
    /// stages read them): the schedule's forwards, hops and backwards, then one
    /// optimizer step.
    pub fn train_step(
        &mut self,
        ids: &[DTensor<Ids>],
        targets: &[DTensor<Ids>],
        opt: &mut impl Optimizer,
        max_norm: f64,
    ) -> Result<PipelineReport> {
        let m = self.schedule.microbatches;
        if ids.len() != m || targets.len() != m {
            return Err(Error::InvalidUse {
                op: "Pipeline::train_step",
                detail: format!(
                    "the schedule runs {m} microbatches, got {} id and {} target tensors",
                    ids.len(),
                    targets.len()
                ),
            });
        }
        let batch = BatchTokens::of(targets)?;
        let hidden_dtype = self.config.precision.compute.unwrap_or(self.config.dtype);
        let v = self.schedule.virtual_stages_per_rank;
        let (pp, rank) = (self.schedule.pp, self.rank);
        let slot = |mb: usize, stage: usize| mb * v + stage / pp;
        // Tags name the boundary (the sending stage), the microbatch and the direction,
        // so a transfer can only match its own peer.
        let tag = |grad: bool, mb: usize, boundary: usize| {
            ((boundary * m + mb) * 2 + grad as usize) as u32
        };
        let hop_for = |mb: usize| -> Result<StageHop<Stream<M>>> {
            let pp = self.pp.clone().ok_or_else(|| Error::InvalidUse {
                op: "Pipeline::train_step",
                detail: "a transfer in a schedule on a mesh without Pp".into(),
            })?;
            let tokens = ids[mb].global_shape()[0];
            Ok(StageHop::new(
                pp,
                self.stage_mesh.clone(),
                &[tokens, self.config.hidden],
                hidden_dtype,
            ))
        };
        let missing = |what: &str, a: Action| Error::InvalidSchedule {
            detail: format!("rank {rank}: {a} has no {what} (validate the schedule)"),
        };

        let tapes: Vec<Tape> = (0..m * v).map(|_| Tape::new()).collect();
        let mut inputs: Vec<Option<Var<'_, Stream<M>>>> = (0..m * v).map(|_| None).collect();
        let mut outputs: Vec<Option<SliceOutput<'_, M>>> = (0..m * v).map(|_| None).collect();
        let mut out_grads: Vec<Option<DTensor<Grad<Stream<M>>>>> =
            (0..m * v).map(|_| None).collect();
        let mut in_grads: Vec<Option<DTensor<Grad<Stream<M>>>>> =
            (0..m * v).map(|_| None).collect();
        let mut weight_passes: Vec<Option<WeightPass>> = (0..m * v).map(|_| None).collect();
        let mut losses: Vec<DTensor<Loss>> = Vec::new();
        let mut acc = GradAccumulator::new();
        // Per chunk: backwards run so far, and its buckets once its last backward starts.
        let mut backwards = vec![0usize; v];
        let mut buckets: Vec<DdpBuckets> = Vec::new();
        let mut busy = 0.0;
        let actions = self.schedule.actions[rank].clone();
        if let Some(pp) = &self.pp {
            pp.barrier()?;
        }
        let start = Instant::now();
        for a in actions {
            let _span = dtensor_collectives::trace::span_with(|| a.to_string(), "pipeline");
            let t0 = Instant::now();
            match a {
                Action::RecvActivation { mb, stage, peer } => {
                    let x = hop_for(mb)?.recv::<Stream<M>>(peer, tag(false, mb, stage - 1))?;
                    inputs[slot(mb, stage)] = Some(tapes[slot(mb, stage)].leaf(x));
                }
                Action::Forward { mb, stage } => {
                    let i = slot(mb, stage);
                    let input = if stage == 0 {
                        SliceInput::Ids(&ids[mb])
                    } else {
                        SliceInput::Hidden(inputs[i].as_ref().ok_or_else(|| missing("input", a))?)
                    };
                    let out = self.chunks[stage / pp].forward(
                        &tapes[i],
                        input,
                        Some(&targets[mb]),
                        batch,
                    )?;
                    if let SliceOutput::Loss(l) = &out {
                        losses.push(l.value().clone());
                    }
                    outputs[i] = Some(out);
                    busy += t0.elapsed().as_secs_f64();
                }
                Action::SendActivation { mb, stage, peer } => match &outputs[slot(mb, stage)] {
                    Some(SliceOutput::Hidden(h)) => {
                        hop_for(mb)?.send(h.value(), peer, tag(false, mb, stage))?
                    }
                    _ => return Err(missing("activation to send", a)),
                },
                Action::RecvGradient { mb, stage, peer } => {
                    let g = hop_for(mb)?.recv_grad::<Stream<M>>(peer, tag(true, mb, stage))?;
                    out_grads[slot(mb, stage)] = Some(g);
                }
                // Zero-bubble `B`: the input gradient now, the weights' later.
                Action::BackwardInput { mb, stage } if stage > 0 => {
                    let i = slot(mb, stage);
                    let x = inputs[i].take().ok_or_else(|| missing("input", a))?;
                    let (dx, pass) = match outputs[i].take() {
                        Some(SliceOutput::Loss(l)) => l.backward_input_from_loss(&x)?,
                        Some(SliceOutput::Hidden(h)) => h.backward_input(
                            out_grads[i].take().ok_or_else(|| missing("gradient", a))?,
                            &x,
                        )?,
                        None => return Err(missing("forward", a)),
                    };
                    in_grads[i] = Some(dx);
                    weight_passes[i] = Some(pass);
                    busy += t0.elapsed().as_secs_f64();
                }
                // A full backward (and the first stage's `B`, which has no input gradient
                // to send: it runs whole, and its `W` finds nothing left).
                Action::Backward { mb, stage } | Action::BackwardInput { mb, stage } => {
                    let i = slot(mb, stage);
                    let c = stage / pp;
                    backwards[c] += 1;
                    // The chunk's last backward of the step reduces its DDP gradients in
                    // buckets as they become final; the earlier ones accumulate.
                    let mut bucket = match self.ddp_bucket_bytes {
                        Some(cap) if backwards[c] == m => {
                            Some(DdpBuckets::new(&mut self.chunks[c], cap)?)
                        }
                        _ => None,
                    };
                    let out = outputs[i].take().ok_or_else(|| missing("forward", a))?;
                    let mut grads = match (out, &mut bucket) {
                        (SliceOutput::Loss(l), None) => l.backward()?,
                        (SliceOutput::Loss(l), Some(b)) => {
                            l.backward_hooked(&mut |k, g| b.push(&mut acc, k, g))?
                        }
                        (SliceOutput::Hidden(h), b) => {
                            let dy = out_grads[i].take().ok_or_else(|| missing("gradient", a))?;
                            match b {
                                None => h.backward_with(dy)?,
                                Some(b) => {
                                    h.backward_with_hook(dy, &mut |k, g| b.push(&mut acc, k, g))?
                                }
                            }
                        }
                    };
                    if let Some(mut b) = bucket {
                        b.flush()?;
                        buckets.push(b);
                    }
                    if stage > 0 {
                        let x = inputs[i].take().ok_or_else(|| missing("input", a))?;
                        in_grads[i] = Some(grads.take(&x)?);
                    }
                    acc.add(&mut self.chunks[stage / pp], &mut grads)?;
                    busy += t0.elapsed().as_secs_f64();
                }
                Action::BackwardWeight { mb, stage } => {
                    if let Some(pass) = weight_passes[slot(mb, stage)].take() {
                        let mut grads = pass.run()?;
                        acc.add(&mut self.chunks[stage / pp], &mut grads)?;
                    }
                    busy += t0.elapsed().as_secs_f64();
                }
                Action::SendGradient { mb, stage, peer } => {
                    let g = in_grads[slot(mb, stage)]
                        .take()
                        .ok_or_else(|| missing("gradient to send", a))?;
                    hop_for(mb)?.send_grad(&g, peer, tag(true, mb, stage - 1))?;
                }
            }
        }
        for b in buckets {
            b.finish(&mut acc)?;
        }
        let step_secs = start.elapsed().as_secs_f64();
        drop(outputs);
        drop(inputs);
        drop(tapes);

        // The loss lives on the last stage: summed over microbatches and the token axes
        // (Dp, Ep, Cp), then broadcast over Pp so every rank reports it.
        let mut loss = [0.0f64];
        if let Some(first) = losses.pop() {
            let total = losses.iter().try_fold(first, |s, l| s.add(l))?;
            loss[0] = loss_total(total)?;
        }
        if let Some(pp) = &self.pp {
            dtensor_core::transfer::broadcast_values(&**pp, &mut loss, pp.size() - 1)?;
        }
        let grad_norm = step_accumulated(self, acc, opt, max_norm)?;
        self.update_expert_bias();
        Ok(PipelineReport {
            loss: loss[0],
            grad_norm,
            busy_secs: busy,
            step_secs,
        })
    }
}

impl<M: SeqMode, D: DataMode> Pipeline<M, D> {
    /// Aux-loss-free balancing after an optimizer step (see
    /// [`Gpt::update_expert_bias`](crate::Gpt::update_expert_bias));
    /// [`train_step`](Self::train_step) calls it.
    pub fn update_expert_bias(&self) {
        for b in self.chunks.iter().flat_map(|c| &c.blocks) {
            if let Some(m) = b.mlp.moe() {
                m.update_bias();
            }
        }
    }

    /// The routing statistics this rank's MoE blocks recorded since the last call (one
    /// entry per forward), per block in order; empty for a dense model.
    pub fn take_routing_stats(&self) -> Vec<Vec<dtensor_core::RoutingStats>> {
        self.chunks
            .iter()
            .flat_map(|c| &c.blocks)
            .filter_map(|b| b.mlp.moe().map(|m| m.take_stats()))
            .collect()
    }
}

impl<M: SeqMode, D: DataMode> Module for Pipeline<M, D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        for c in &mut self.chunks {
            c.visit_params(prefix, v)?;
        }
        Ok(())
    }
    fn visit_state<V: StateVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        for c in &mut self.chunks {
            c.visit_state(prefix, v)?;
        }
        Ok(())
    }
}
