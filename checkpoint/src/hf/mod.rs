//! Hugging Face checkpoints: a model directory's `config.json` read into one decoder
//! description ([`HfConfig`]) for every supported architecture, the tensors it implies
//! ([`HfConfig::expected_tensors`]) and the check of a checkpoint against them
//! ([`HfWeights::validate`]), its safetensors weights memory-mapped so each rank reads
//! only its own slices ([`HfWeights`]), and a streaming writer of the same layout
//! ([`HfWriter`]): sharded safetensors, their index, the config files.

pub mod config;
pub mod layout;
pub mod weights;
pub mod writer;

pub use config::{Architecture, HfConfig, MoeConfig};
pub use layout::ExpectedTensor;
pub use weights::{HfWeights, WeightInfo};
pub use writer::{HfSaved, HfWriter};
