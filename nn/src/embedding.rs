//! Vocab-parallel embedding and the vocab-parallel cross-entropy loss.
//!
//! The table `[vocab, hidden]` is sharded over `Tp` by vocabulary rows ([`ColWeight`](crate::ColWeight)).
//! The lookup of `Tp`-invariant ids is derived `Partial` over `Tp` (each rank finds the ids
//! it holds, zeros for the rest: Megatron's masked lookup) and leaves into the stream with
//! [`SeqMode::exit`]. The loss takes logits sharded over the vocabulary ([`ColOut`]) and
//! gives per-token losses `Invariant` over `Tp`, reducing only `[tokens]`-sized statistics
//! (the row max, the sum of exponentials, the target's logit), never the logits.
//!
//! Label masking (fine-tuning): [`vocab_parallel_cross_entropy_ignoring`] scores nothing
//! where the target is the ignore index (Hugging Face's −100,
//! [`IGNORE_INDEX`](dtensor_kernels::ops::IGNORE_INDEX)), and [`mean_loss_over`] divides by
//! the scored tokens of the whole global batch ([`DTensor::scored_tokens`]), so the loss and
//! its gradients do not depend on how the tokens are split over `Dp`, `Ep` and `Cp`.
//! [`vocab_parallel_cross_entropy_with`] takes both options ([`CrossEntropy`]: the ignore
//! index and a z-loss).

use crate::data::{ColW, DataMode, Ddp, MasterLayout};
use crate::init::{Init, ParamInit};
use crate::params::{join_name, Module, ParamVisitor, Weight};
use crate::seq::{ColOut, Ids, Loss, SeqMode, Stream, TokenInvariant};
use dtensor_core::{CrossEntropy, DTensor, DeviceMesh, Result, Tape, Var};
use dtensor_placement::{Cp, Dp, Ep, LinearLayout, SumLayout, SumOut};
use std::sync::Arc;

/// The token embedding, its table sharded over `Tp` by vocabulary rows.
#[derive(Clone)]
pub struct VocabParallelEmbedding<D: DataMode = Ddp> {
    /// The table `[vocab, hidden]`, `Shard<0>` (vocabulary rows) over `Tp`.
    pub weight: Weight<D, ColW>,
}

impl<D: DataMode> VocabParallelEmbedding<D> {
    /// Table drawn `Normal(0, init.std)`, parameter id `init.id`.
    pub fn new(
        vocab: usize,
        hidden: usize,
        init: ParamInit,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        let w = Init::Normal { std: init.std }.param::<MasterLayout<D, ColW>>(
            init.seed,
            init.id,
            &[vocab, hidden],
            init.dtype,
            mesh,
        )?;
        Ok(VocabParallelEmbedding {
            weight: Weight::new(w, init.precision)?,
        })
    }

    /// Starts gathering the table over `Dp` (FSDP's prefetch; nothing otherwise).
    pub fn prefetch(&self) -> Result<()> {
        self.weight.prefetch()
    }

    /// Vocabulary size: the table's global rows (all `Tp` ranks' rows together).
    pub fn vocab(&self) -> usize {
        self.weight.value().global_shape()[0]
    }

    /// Masked lookup (`Partial` over `Tp`), then the stream's exit.
    pub fn forward<'t, M: SeqMode>(
        &self,
        tape: &'t Tape,
        ids: &Var<'t, Ids>,
    ) -> Result<Var<'t, Stream<M>>> {
        M::exit(&self.weight.apply(tape, ids, |ids, w| w.embedding(ids))?)
    }
}

impl<D: DataMode> Module for VocabParallelEmbedding<D> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        v.visit(&join_name(prefix, "weight"), &mut self.weight)
    }
}

/// Per-token cross-entropy of vocab-sharded logits: `Invariant` over `Tp`, three
/// all-reduces of `[tokens]` inside.
pub fn vocab_parallel_cross_entropy<'t>(
    logits: &Var<'t, ColOut>,
    targets: &Var<'t, Ids>,
) -> Result<Var<'t, TokenInvariant>> {
    logits.cross_entropy(targets)
}

/// [`vocab_parallel_cross_entropy`] where a target equal to `ignore_index` scores nothing:
/// its loss is 0 and its logits get no gradient. Average with [`mean_loss_over`] and the
/// count of scored targets, not with [`mean_loss`].
pub fn vocab_parallel_cross_entropy_ignoring<'t>(
    logits: &Var<'t, ColOut>,
    targets: &Var<'t, Ids>,
    ignore_index: i64,
) -> Result<Var<'t, TokenInvariant>> {
    logits.cross_entropy_ignoring(targets, ignore_index)
}

/// [`vocab_parallel_cross_entropy`] with options ([`CrossEntropy`]): an ignore index (as
/// [`vocab_parallel_cross_entropy_ignoring`]) and PaLM's z-loss, `z · lse²` per scored
/// token with `lse` the log of the softmax normaliser over the whole vocab (the max and the
/// sum the loss already all-reduces over `Tp`: no extra communication). The default options
/// give [`vocab_parallel_cross_entropy`]'s bits.
pub fn vocab_parallel_cross_entropy_with<'t>(
    logits: &Var<'t, ColOut>,
    targets: &Var<'t, Ids>,
    options: CrossEntropy,
) -> Result<Var<'t, TokenInvariant>> {
    logits.cross_entropy_with(targets, options)
}

/// The training loss: per-token losses summed over this `Dp` rank's tokens and divided by
/// the global token count (so the sum over `Dp`, which the `Partial` stands for, is the
/// mean over the global batch).
pub fn mean_loss<'t, L>(losses: &Var<'t, L>) -> Result<Var<'t, SumOut<L, 0>>>
where
    L: SumLayout<0>,
    SumOut<L, 0>: LinearLayout,
{
    mean_loss_over(losses, losses.value().global_shape()[0])
}

/// The training loss over `tokens` counted tokens: per-token losses summed over this
/// rank's tokens and divided by `tokens` (at least 1), which must be the same on every rank
/// (the sum over the data axes is then the mean). With an ignore index, pass the scored
/// targets of the whole global batch, `targets.scored_tokens(Some(ignore_index))` (summed
/// over every microbatch where there are several): a per-rank count would weigh a rank's
/// tokens by how many of its neighbours are ignored. With no token scored, the loss and its
/// gradients are 0.
pub fn mean_loss_over<'t, L>(losses: &Var<'t, L>, tokens: usize) -> Result<Var<'t, SumOut<L, 0>>>
where
    L: SumLayout<0>,
    SumOut<L, 0>: LinearLayout,
{
    losses.sum_dim::<0>()?.scale(1.0 / tokens.max(1) as f64)
}

/// Collective over `Dp`, `Ep` and `Cp`: the value of a [`Loss`] (the same on every rank).
pub fn loss_value(loss: &Var<'_, Loss>) -> Result<f64> {
    loss_total(loss.value().clone())
}

/// Collective over `Dp`, `Ep` and `Cp`: the sum a [`Loss`] stands for, on every rank.
pub fn loss_total(loss: DTensor<Loss>) -> Result<f64> {
    let whole = loss.all_reduce(Dp)?.all_reduce(Ep)?.all_reduce(Cp)?;
    Ok(whole.as_local().to_f64_vec()[0])
}
