//! Hugging Face checkpoints: a model directory's `config.json` read into one decoder
//! description ([`HfConfig`]) for every supported architecture, and its safetensors
//! weights memory-mapped so each rank reads only its own slices ([`HfWeights`]).

pub mod config;
pub mod weights;

pub use config::{Architecture, HfConfig, MoeConfig};
pub use weights::{HfWeights, WeightInfo};
