//! # dtensor-nn
//!
//! Tensor- and sequence-parallel layers written on [`DTensor`](dtensor_core::DTensor) as
//! **forward code only**: every op is a typed compute op or a named transition recorded on
//! a per-rank [`Tape`](dtensor_core::Tape), whose backward gives every gradient the dual of
//! its value's layout. No layer relabels a tensor (`nn` never calls `from_local`, and
//! `clippy.toml` forbids it), so a pending sum cannot be called a replica.
//!
//! Layers compute with parameters laid out [`ParamLayout`] (`Replicate` over `Dp`), whose
//! gradients arrive `Partial` over `Dp`. How a parameter is *held* over `Dp` is the data
//! mode, a type parameter of every layer ([`data`]: [`Ddp`] by default, [`Zero1`], [`Zero2`],
//! [`Fsdp`]; a layer's [`Weight`], in [`params`], holds the master and the compute copy). The optimizer
//! takes only gradients reduced to their master's placement ([`optim`]), so the DP
//! all-reduce or reduce-scatter (and, under SP, the norm weights' reduction over `Tp`) is
//! written, not forgotten. Every parameter is enumerable with its name and layout through
//! [`Module::visit_params`].
//!
//! | layer | input → output (stream `S` = `Stream<M>`) | forward communication (no SP / SP) |
//! |---|---|---|
//! | [`ColumnParallelLinear`] | `S` → [`ColOut`] (`Shard<1>` on `Tp`) | `to_replicate` / `all_gather` |
//! | [`RowParallelLinear`] | [`ColOut`] → `S`, bias after the reduction | `all_reduce` / `reduce_scatter` |
//! | [`ParallelMlp`] | `S` → `S` (column → GELU or SwiGLU → row) | both of the above |
//! | [`ParallelAttention`] | `S` → `S` (fused QKV column, heads over `Tp`, RoPE, causal, row O) | both of the above |
//! | [`Norm`] (RMS / Layer) | `S` → `S`; weight `Invariant` / `Replicate` over `Tp` | none (SP: its gradient is `Partial` over `Tp`) |
//! | [`VocabParallelEmbedding`] | [`Ids`] → `S` (masked lookup is `Partial`) | `all_reduce` / `reduce_scatter` |
//! | [`vocab_parallel_cross_entropy`] (and [`_ignoring`](vocab_parallel_cross_entropy_ignoring) an ignore index, [`_with`](vocab_parallel_cross_entropy_with) options: ignore index, z-loss) | [`ColOut`] logits → per-token loss | three `all_reduce`s of `[tokens]` (max, Σexp, target) |
//! | [`MoeMlp`] | `S` → `S` (router, top-k dispatch to the experts' `Ep` ranks, grouped expert MLPs, combine) and its auxiliary loss | all-to-all-v over `Ep` in and out, statistics all-reduces |
//! | [`TransformerBlock`], [`Gpt`] | pre-norm blocks with residuals; embedding → blocks → norm → LM head → loss | the layers' |
//!
//! ## Floors
//!
//! Each file imports only files on the floors below it (no circle):
//!
//! | floor | files | what they hold |
//! |---|---|---|
//! | 0 | [`seq`], [`pipeline`]'s `schedule.rs` | layouts, sequence modes, gradient-reduction rules; schedules as data |
//! | 1 | [`data`] | data modes: how a parameter is held, gathered and reduced over `Dp` |
//! | 2 | [`params`], [`init`] | [`Param`], [`Weight`], [`Module`] and its visitors, [`GradAccumulator`]; initialisation |
//! | 3 | [`optim`], [`buckets`], [`linear`], [`norm`], [`embedding`] | optimizers and the step; DDP buckets; the first layers |
//! | 4 | [`mlp`], [`attention`], then [`moe`] | layers built from layers |
//! | 5 | [`model`] (`config.rs`, then `block.rs`, then `gpt.rs`) | the GPT: its shape, block, forward and training step |
//! | 6 | [`pipeline`]'s `stage.rs`, then `runtime.rs` | a stage wraps a run of the model's layers; the runtime runs the schedule |
//!
//! Pipeline parallelism is [`pipeline`]: GPipe, 1F1B, interleaved 1F1B and ZB-H1 schedules
//! as per-rank action lists, validated (complete, matched, deadlock-free, within their
//! memory bound) and timed before they run, and [`Pipeline`], which runs one on a
//! `[Pp, Dp, Tp]` mesh with the GPT cut into [`GptStage`]s and typed hops between them.
//!
//! ```
//! use dtensor_collectives::threads;
//! use dtensor_core::{DTensor, DeviceMesh, Tape};
//! use dtensor_kernels::DType;
//! use dtensor_nn::*;
//!
//! // The layers' axes [Dp, Ep, Cp, Tp] with degrees 1, 1, 1, 2.
//! let mesh = model_mesh(&"tp=2".parse().unwrap()).unwrap();
//! let results = threads::launch(2, |world| -> dtensor_core::Result<()> {
//!     let dm = DeviceMesh::new(world, mesh.clone())?;
//!     let init = ParamInit::new(0, 0, 0.1, DType::F64);
//!     let mut mlp = ParallelMlp::<Sp, Ddp>::new(8, 32, Activation::Gelu, true, init, 0.1, &dm)?;
//!     // 6 tokens of width 8, sharded over Tp along the tokens (sequence parallelism).
//!     let x: DTensor<Stream<Sp>> = Init::Normal { std: 1.0 }.param(1, 0, &[6, 8], DType::F64, &dm)?;
//!     let tape = Tape::new();
//!     let y = mlp.forward(&tape, &tape.constant(x))?; // all_gather in, reduce_scatter out
//!     let loss = mean_loss(&y.sum_dim::<1>()?)?;        // Partial over Dp, Ep, Cp and Tp
//!     let mut grads = loss.backward()?;                 // the adjoints: reduce_scatter, all_gather
//!     // Raw gradients are Partial over Dp (and the SP bias over Tp too): `step` reduces
//!     // them, clips and updates.
//!     let mut opt = AdamW::new(1e-3);
//!     step(&mut mlp, &mut grads, &mut opt, 1.0)?;
//!     Ok(())
//! });
//! assert!(results.into_iter().all(|r| r.is_ok()));
//! ```

#![warn(missing_docs)]

pub mod attention;
pub mod buckets;
pub mod compose;
pub mod data;
pub mod embedding;
pub mod init;
pub mod linear;
pub mod mlp;
pub mod model;
pub mod moe;
pub mod norm;
pub mod optim;
pub mod params;
pub mod pipeline;
pub mod seq;

pub use attention::{
    from_stream_order, to_stream_order, AttentionConfig, ContextParallel, ParallelAttention,
    QkNorm, QkvProjection, RopeSettings, SharedKvProjection,
};
pub use buckets::{DdpBuckets, DEFAULT_BUCKET_BYTES};
pub use data::{
    to_compute, ColB, ColW, ComputeLayout, ComputeOf, DataMode, Ddp, DpGather, DpMaster,
    DpReducedOf, DpShardPlacement, DpWhole, EpParam, ExpertW, Fsdp, MasterLayout, ParamKind,
    Precision, ReducedLayout, RowW, StreamP, TpSharedW, WorkLayout, Zero1, Zero2,
};
pub use dtensor_core;
pub use embedding::{
    loss_total, loss_value, mean_loss, mean_loss_over, vocab_parallel_cross_entropy,
    vocab_parallel_cross_entropy_ignoring, vocab_parallel_cross_entropy_with,
    VocabParallelEmbedding,
};
pub use init::{Init, ParamInit};
pub use linear::{ColumnParallelLinear, RowParallelLinear};
pub use mlp::{Activation, ParallelMlp};
pub use model::{
    AttentionOptions, BatchTokens, BlockMlp, Gpt, GptConfig, KvCache, Sampling, SliceInput,
    SliceOutput, StepReport, TransformerBlock,
};
pub use moe::{MoeConfig, MoeMlp};
pub use norm::{Norm, NormKind};
pub use optim::{clip_coefficient, step, step_accumulated, AdamW, GradNorm, Optimizer, Sgd};
pub use params::{
    dp_average, join_name, named_params, reduce_grad, GradAccumulator, Module, NamedParam, Param,
    ParamVisitor, StateVisitor, Weight,
};
pub use pipeline::{
    Action, Costs, GptStage, Pipeline, PipelineReport, Schedule, ScheduleKind, Timeline,
};
pub use seq::{
    axis_coord, axis_size, model_mesh, ColOut, ColWeight, DpLayout, DpPartial, DpReduced, Full,
    Grad, Ids, Loss, NoSp, ParamLayout, PerMode, ReducedGrad, ReducedPlacement, RowPartial,
    RowWeight, SeqMode, Sp, Stream, StreamParam, TokenInvariant, TpParam, MODEL_AXES,
};
