//! # dtensor-datasets
//!
//! What turns text into training tokens, and tokens into training samples:
//!
//! - [`Tokenizer`]: a Hugging Face `tokenizer.json` through the `tokenizers` crate, with its
//!   special tokens; byte-level BPE training on a corpus.
//! - [`indexed`]: Megatron-LM's indexed dataset (`PREFIX.bin` + `PREFIX.idx`), written by
//!   [`IndexedDatasetBuilder`] and memory-mapped by [`IndexedDataset`], so a corpus larger
//!   than memory costs only the pages a rank reads. Files made here are read by Megatron-LM
//!   and the other way round.
//! - [`prepare`]: text files (`.txt`, one document each; `.jsonl`, one per line) tokenized
//!   into indexed datasets (what `dtensor data prepare` runs).
//! - [`loader`]: samples of `seq_len + 1` tokens packed across documents (with segment and
//!   position ids for document masks, or plain), a held-out validation split, a blend of
//!   several datasets by weight, and a deterministic, resumable sampler sharded over the
//!   data ranks.
//!
//! ```
//! use dtensor_datasets::indexed::{IndexedDataset, IndexedDatasetBuilder};
//! use dtensor_datasets::loader::{DataLoader, Holdout, PackedDataset, Packing, SampleSource, Sampler, Split};
//!
//! let dir = std::env::temp_dir().join(format!("dtensor-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let prefix = dir.join("corpus");
//! let mut builder = IndexedDatasetBuilder::<u16>::create(&prefix).unwrap();
//! for doc in 0..20u16 {
//!     let tokens: Vec<u16> = (0..10 + doc).collect();
//!     builder.add_document(&tokens).unwrap();
//! }
//! builder.finish().unwrap();
//!
//! let data = IndexedDataset::<u16>::open(&prefix).unwrap();
//! assert_eq!((data.len(), data.documents()), (20, 20));
//! assert_eq!(data.get(3), &[0u16, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12][..]);
//!
//! // 16 tokens per sample plus the shifted target; 10% of the documents held out.
//! let split = Split::new(data.documents() as u64, Holdout::Fraction(0.1), 7).unwrap();
//! let train = PackedDataset::open(&prefix, &split.train, 16, Packing::DocumentMasks, 7).unwrap();
//! let sampler = Sampler::new(train.len_samples(), 7, /* rank */ 0, /* world */ 2).unwrap();
//! let mut loader = DataLoader::new(train, sampler);
//! let batch = loader.next_batch(4).unwrap();
//! assert_eq!(batch.tokens.len(), 4 * 17);
//! std::fs::remove_dir_all(&dir).unwrap();
//! ```

#![warn(missing_docs)]

pub mod indexed;
pub mod loader;
pub mod prepare;
pub mod tokenizer;

pub use indexed::{IndexedDataset, IndexedDatasetBuilder, TokenDType};
use std::path::PathBuf;
pub use tokenizer::{BpeSettings, Tokenizer};

/// What reading, training or using a tokenizer, and writing, reading or sampling a dataset,
/// can fail with.
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
    /// An indexed dataset file (`.idx` or `.bin`) that is not what the format says: a bad
    /// magic, version or dtype code, a truncated file, a pointer past the end.
    #[error("indexed dataset {file}: {detail}")]
    Format {
        /// The `.idx` or `.bin` file.
        file: PathBuf,
        /// What is wrong with it, in words.
        detail: String,
    },
    /// A file that cannot be opened, read, mapped or written.
    #[error("{file}: {detail}")]
    Io {
        /// The file.
        file: PathBuf,
        /// The operating system's reason.
        detail: String,
    },
    /// An input of `prepare` that cannot be used (a `.jsonl` line that is not an object with
    /// the text key, an unknown extension, a token id the dtype cannot hold).
    #[error("input {file}: {detail}")]
    Input {
        /// The input file.
        file: PathBuf,
        /// What is wrong, with the line number where there is one.
        detail: String,
    },
    /// A loader, split, blend or sampler setting that cannot work (no samples, weights that do
    /// not sum to anything positive, a sampler state from another dataset).
    #[error("data loader: {detail}")]
    Loader {
        /// What is wrong, with the values involved.
        detail: String,
    },
}

/// `std::result::Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
