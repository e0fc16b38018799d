//! # dtensor-datasets
//!
//! What turns text into training tokens: [`Tokenizer`] (a Hugging Face `tokenizer.json`
//! through the `tokenizers` crate, with its special tokens; byte-level BPE training on a
//! corpus).

#![warn(missing_docs)]

pub mod tokenizer;

use std::path::PathBuf;
pub use tokenizer::{BpeSettings, Tokenizer};

/// What reading, training or using a tokenizer can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// A tokenizer file that cannot be read, trained or used; names the file.
    #[error("tokenizer {file}: {detail}")]
    Tokenizer {
        /// The `tokenizer.json`, `tokenizer_config.json` or training corpus involved.
        file: PathBuf,
        /// What went wrong, in words.
        detail: String,
    },
}

/// `std::result::Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
