//! The GPT model: its shape ([`GptConfig`]), the pre-norm [`TransformerBlock`], and the
//! [`Gpt`] with its forward (embedding → blocks → final norm → head → loss) and training
//! step.
//!
//! The model knows nothing of pipelines: a pipeline stage ([`GptStage`](crate::GptStage))
//! holds a run of the model's layers, built by the model's own constructors, and runs the
//! model's forward over them.
//!
//! | file | holds | imports |
//! |---|---|---|
//! | `config.rs` | [`GptConfig`], [`AttentionOptions`] | the layers' configurations |
//! | `block.rs` | [`TransformerBlock`], [`BlockMlp`] | `config.rs`, the layers |
//! | `gpt.rs` | [`Gpt`], the forward over a run of layers, the layers' constructors | `block.rs`, `config.rs`, the layers, the optimizer step |
//! | `generate.rs` | [`Gpt::generate`] with a [`KvCache`], [`Sampling`] | `gpt.rs` |

mod block;
mod config;
mod generate;
mod gpt;

pub use block::{BlockMlp, TransformerBlock};
pub use config::{AttentionOptions, GptConfig};
pub use generate::{KvCache, Sampling};
pub(crate) use gpt::{build_block, build_embedding, build_head, GptSlice};
pub use gpt::{BatchTokens, Gpt, SliceInput, SliceOutput, StepReport};
