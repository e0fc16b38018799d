//! # dtensor-nn
//!
//! Parallel layers written on [`DTensor`](dtensor_core::DTensor): column- and
//! row-parallel linear, MLP, attention, norms, embeddings, the vocab-parallel loss,
//! sequence parallelism, MoE, ring attention, pipeline stages and FSDP.
//!
//! Not written yet: the layers arrive with the tensor- and sequence-parallel issue. This
//! crate exists now so the workspace layout shows the architecture and the facade's
//! `dtensor::nn` path is stable.

pub use dtensor_core;
