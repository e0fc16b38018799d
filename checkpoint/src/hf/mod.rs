//! Hugging Face checkpoints: a model directory's `config.json` read into one decoder
//! description ([`HfConfig`]) for every supported architecture, the tensors it implies
//! ([`HfConfig::expected_tensors`]) and the check of a checkpoint against them
//! ([`HfWeights::validate`]), its safetensors weights memory-mapped so each rank reads
//! only its own slices ([`HfWeights`]), mapped onto dtensor's parameters ([`NameMap`])
//! and loaded into a model on any mesh ([`HfModel`], [`load_params`]), the parity check
//! against transformers ([`parity`]), and a streaming writer of the same layout
//! ([`HfWriter`]): sharded safetensors, their index, the config files.

pub mod config;
pub mod layout;
pub mod load;
pub mod model;
pub mod names;
pub mod parity;
pub mod save;
pub mod weights;
pub mod writer;

pub use config::{Architecture, HfConfig, MoeConfig};
pub use layout::ExpectedTensor;
pub use load::{load_params, HfLoadStats};
pub use model::HfModel;
pub use names::{NameMap, Segment, Source};
pub use save::{save_params, HfSaveOptions};
pub use weights::{HfWeights, WeightInfo};
pub use writer::{HfSaved, HfWriter};
