//! # dtensor-nn
//!
//! Tensor- and sequence-parallel layers written on [`DTensor`](dtensor_core::DTensor),
//! forward and backward, every gradient typed as the dual of its value.
//!
//! A layer's `forward` returns its output and a context; its `backward` takes the output's
//! gradient (laid out as the dual of the output) and returns the input's gradient (the dual
//! of the input) and the parameter gradients (the duals of the parameters: a weight
//! `Replicate` over `Dp` gets a gradient `Partial` over `Dp`). All communication is one of
//! the named transitions of `dtensor-core` or the adjoint its `_vjp` twin returns, chosen
//! by the sequence mode ([`NoSp`] / [`Sp`], see [`seq`] for every layout). Optimizers take
//! only gradients reduced to their parameter's placement ([`optim`]).
//!
//! | layer | input → output (stream `S` = `Stream<M>`) | forward communication (no SP / SP) |
//! |---|---|---|
//! | [`ColumnParallelLinear`] | `S` → [`ColOut`] (`Shard<1>` on `Tp`) | `to_replicate` / `all_gather` |
//! | [`RowParallelLinear`] | [`ColOut`] → `S`, bias after the reduction | `all_reduce` / `reduce_scatter` |
//! | [`ParallelMlp`] | `S` → `S` (column → GELU or SwiGLU → row) | both of the above |
//! | [`ParallelAttention`] | `S` → `S` (fused QKV column, heads over `Tp`, RoPE, causal, row O) | both of the above |
//! | [`Norm`] (RMS / Layer) | `S` → `S`; weight `Invariant` / `Replicate` over `Tp` | none (SP: its gradient is `Partial` over `Tp`) |
//! | [`VocabParallelEmbedding`] | [`Ids`] → `S` (masked lookup is `Partial`) | `all_reduce` / `reduce_scatter` |
//! | [`vocab_parallel_cross_entropy`] | [`ColOut`] logits → per-token loss | three `all_reduce`s of `[tokens]` (max, Σexp, target) |
//! | [`TransformerBlock`], [`Gpt`] | pre-norm blocks with residuals; embedding → blocks → norm → LM head → loss | the layers' |
//!
//! ```
//! use dtensor_collectives::threads;
//! use dtensor_core::{DTensor, DeviceMesh};
//! use dtensor_kernels::DType;
//! use dtensor_nn::*;
//! use dtensor_placement::{AxisKind, Mesh};
//!
//! let mesh = Mesh::new(&[(AxisKind::Dp, 1), (AxisKind::Tp, 2)]).unwrap();
//! let results = threads::launch(2, |world| -> dtensor_core::Result<()> {
//!     let dm = DeviceMesh::new(world, mesh.clone())?;
//!     let init = ParamInit::new(0, 0, 0.1, DType::F64);
//!     let mut mlp = ParallelMlp::<Sp>::new(8, 32, Activation::Gelu, true, init, 0.1, &dm)?;
//!     // 6 tokens of width 8, sharded over Tp along the tokens (sequence parallelism).
//!     let x: DTensor<Stream<Sp>> = Init::Normal { std: 1.0 }.param(1, 0, &[6, 8], DType::F64, &dm)?;
//!     let (y, ctx) = mlp.forward(x)?; // all_gather in, reduce_scatter out
//!     let (_dx, grads) = mlp.backward(ctx, &y)?; // their adjoints: reduce_scatter, all_gather
//!     // Raw gradients are Partial over Dp (and the SP bias over Tp): the optimizer takes
//!     // them only once reduced.
//!     let grads = grads.reduce()?;
//!     let mut opt = AdamW::new(1e-3);
//!     opt.begin_step();
//!     mlp.apply(&grads, &opt)
//! });
//! assert!(results.into_iter().all(|r| r.is_ok()));
//! ```

pub mod attention;
pub mod block;
pub mod embedding;
pub mod init;
pub mod linear;
pub mod mlp;
pub mod norm;
pub mod optim;
pub mod seq;

pub use attention::{
    AttentionConfig, AttentionCtx, AttentionGrads, AttentionGradsReduced, ParallelAttention,
};
pub use block::{
    BlockCtx, BlockGrads, BlockGradsReduced, Gpt, GptConfig, GptCtx, GptGrads, GptGradsReduced,
    StepReport, TransformerBlock,
};
pub use dtensor_core;
pub use embedding::{
    mean_loss, vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_backward, vocab_shard,
    CrossEntropyCtx, EmbeddingCtx, EmbeddingGrads, EmbeddingGradsReduced, VocabParallelEmbedding,
};
pub use init::Init;
pub use linear::{
    ColumnCtx, ColumnGrads, ColumnGradsReduced, ColumnParallelLinear, ParamInit, RowCtx, RowGrads,
    RowGradsReduced, RowParallelLinear,
};
pub use mlp::{Activation, MlpCtx, MlpGrads, MlpGradsReduced, ParallelMlp};
pub use norm::{Norm, NormCtx, NormGrads, NormGradsReduced, NormKind};
pub use optim::{
    clip_coefficient, dp_average, AdamW, GradNorm, Optimizer, Param, ReducedGrad, ReducedPlacement,
    Sgd,
};
pub use seq::{
    pointwise, ColOut, ColWeight, ColWeightReduced, DpPartial, DpReduced, Full, Grad, Ids, NoSp,
    ParamGradTp, ReducedTp, RowPartial, RowWeight, RowWeightReduced, SeqMode, Sp, Stream,
    StreamParam, StreamParamGrad, TokenInvariant,
};
