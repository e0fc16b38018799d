//! Hugging Face checkpoints: a model directory's `config.json` read into one decoder
//! description ([`HfConfig`]) for every supported architecture, and its safetensors
//! weights memory-mapped so each rank reads only its own slices ([`HfWeights`]), mapped
//! onto dtensor's parameters ([`NameMap`]) and loaded into a model on any mesh
//! ([`load_params`]).

pub mod config;
pub mod load;
pub mod model;
pub mod names;
pub mod parity;
pub mod weights;

pub use config::{Architecture, HfConfig, MoeConfig};
pub use load::{check_weights, load_params, HfLoadStats};
pub use model::HfModel;
pub use names::{NameMap, Segment, Source};
pub use weights::{HfWeights, WeightInfo};
