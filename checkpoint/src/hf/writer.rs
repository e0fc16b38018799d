//! Writing a model directory in the Hugging Face layout, tensor by tensor.
//!
//! [`HfWriter`] takes tensors one at a time ([`HfWriter::add`] for a [`Tensor`],
//! [`HfWriter::add_bytes`] for stored little-endian bytes) and packs them, in the order
//! given, into shards of at most [`HfWriter::create`]'s `max_shard_bytes` of tensor data
//! (a tensor larger than that gets a shard of its own, as transformers does): at most one
//! shard's tensors are held in memory. [`HfWriter::finish`] names the files as
//! transformers does: one shard is `model.safetensors` with no index; several are
//! `model-00001-of-0000N.safetensors` … with `model.safetensors.index.json`
//! (`{"metadata": {"total_size": bytes of tensor data}, "weight_map": {tensor: file}}`).
//! Every safetensors header carries `{"format": "pt"}`, which transformers checks.
//!
//! `config.json` is copied verbatim from the source directory
//! ([`HfWriter::copy_files_from`], with `generation_config.json` and the tokenizer files
//! when the source has them) or written from an [`HfConfig`]'s fields as read
//! ([`HfWriter::write_config`]).
//!
//! Shards are written under `*.tmp` names and renamed by `finish`, which then removes the
//! weight files of an earlier save into the same directory that this one did not write
//! (a stale `model.safetensors` beside a new index would be read instead of it), and the
//! `*.tmp` shards of an earlier save that failed. A save that fails leaves its `*.tmp`
//! files and the earlier files untouched.

use super::layout::is_weight_file;
use super::weights::{INDEX_FILE, SINGLE_FILE};
use super::HfConfig;
use crate::{io_err, st_dtype, tensor_bytes, Error, Result};
use dtensor_kernels::{DType, Tensor};
use safetensors::tensor::TensorView;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

/// The files besides the weights that [`HfWriter::copy_files_from`] copies when the
/// source directory has them (`config.json` must be there).
pub const MODEL_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// One tensor waiting for its shard.
struct Pending {
    name: String,
    dtype: DType,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// What [`HfWriter::finish`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct HfSaved {
    /// The weight files, in order (`model.safetensors`, or the shards), then the index
    /// when there is one.
    pub files: Vec<PathBuf>,
    /// Bytes of tensor data in all shards (the index's `metadata.total_size`).
    pub total_size: u64,
    /// Tensors written.
    pub tensors: usize,
}

/// A Hugging Face model directory being written (see [`crate::hf::writer`]).
#[derive(Debug)]
pub struct HfWriter {
    dir: PathBuf,
    max_shard_bytes: usize,
    pending: Vec<Pending>,
    pending_bytes: usize,
    /// Shards written so far under their temporary names, each with its tensors.
    shards: Vec<(PathBuf, Vec<String>)>,
    names: BTreeSet<String>,
    total_size: u64,
    config_written: bool,
}

impl std::fmt::Debug for Pending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {:?} {:?}", self.name, self.dtype, self.shape)
    }
}

impl HfWriter {
    /// Starts writing into `dir` (created when missing), with shards of at most
    /// `max_shard_bytes` of tensor data (transformers' default is 50 GB; `usize::MAX`
    /// gives one `model.safetensors`). `Err` naming `dir` when it cannot be created.
    pub fn create(dir: &Path, max_shard_bytes: usize) -> Result<HfWriter> {
        fs::create_dir_all(dir).map_err(|e| io_err(dir, format!("create directory: {e}")))?;
        Ok(HfWriter {
            dir: dir.to_path_buf(),
            max_shard_bytes: max_shard_bytes.max(1),
            pending: Vec::new(),
            pending_bytes: 0,
            shards: Vec::new(),
            names: BTreeSet::new(),
            total_size: 0,
            config_written: false,
        })
    }

    /// Copies `config.json` verbatim from `source` (a model directory), and
    /// `generation_config.json` and the tokenizer files ([`MODEL_FILES`]) when `source`
    /// has them. `Err` naming the file when `config.json` is missing or a copy fails.
    pub fn copy_files_from(&mut self, source: &Path) -> Result<()> {
        for name in MODEL_FILES {
            let from = source.join(name);
            if *name != "config.json" && !from.exists() {
                continue;
            }
            let to = self.dir.join(name);
            if from == to {
                continue;
            }
            fs::copy(&from, &to)
                .map_err(|e| io_err(&from, format!("copy to {}: {e}", to.display())))?;
        }
        self.config_written = true;
        Ok(())
    }

    /// Writes `config.json` from the fields of `config` as they were read (for a model
    /// whose source directory is not at hand). `Err` naming the file when writing fails.
    pub fn write_config(&mut self, config: &HfConfig) -> Result<()> {
        let file = self.dir.join("config.json");
        let text = serde_json::to_string_pretty(&config.raw).expect("JSON values serialize");
        fs::write(&file, text + "\n").map_err(|e| io_err(&file, format!("write: {e}")))?;
        self.config_written = true;
        Ok(())
    }

    /// Adds tensor `name` (copied to host memory when it lives on a device).
    /// `Err` as for [`add_bytes`](Self::add_bytes).
    pub fn add(&mut self, name: &str, tensor: &Tensor) -> Result<()> {
        let bytes = tensor_bytes(tensor).map_err(|e| Error::Refused {
            tensor: name.into(),
            detail: format!("reading the tensor: {e}"),
        })?;
        self.add_owned(name, tensor.dtype(), tensor.shape(), bytes)
    }

    /// Adds tensor `name` of `dtype` and `shape` from its little-endian `bytes` (as
    /// [`HfWeights::stored_bytes`](super::HfWeights::stored_bytes) gives them). `Err`
    /// ([`Error::Refused`]) when the name was given before, when the dtype is not a
    /// float type, when the byte count does not match the shape, or when writing the
    /// shard it completes fails.
    pub fn add_bytes(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        bytes: &[u8],
    ) -> Result<()> {
        self.add_owned(name, dtype, shape, bytes.to_vec())
    }

    fn add_owned(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        bytes: Vec<u8>,
    ) -> Result<()> {
        let refuse = |detail: String| Error::Refused {
            tensor: name.into(),
            detail,
        };
        if !dtype.is_float() {
            return Err(refuse(format!(
                "{dtype:?}: a Hugging Face checkpoint holds float weights"
            )));
        }
        let want = shape.iter().product::<usize>() * dtype.size_in_bytes();
        if bytes.len() != want {
            return Err(refuse(format!(
                "{} bytes for shape {shape:?} of {dtype:?}, which takes {want}",
                bytes.len()
            )));
        }
        if !self.names.insert(name.to_string()) {
            return Err(refuse("given twice".into()));
        }
        if !self.pending.is_empty() && self.pending_bytes + bytes.len() > self.max_shard_bytes {
            self.flush()?;
        }
        self.pending_bytes += bytes.len();
        self.total_size += bytes.len() as u64;
        self.pending.push(Pending {
            name: name.to_string(),
            dtype,
            shape: shape.to_vec(),
            bytes,
        });
        Ok(())
    }

    /// Writes the pending tensors as the next shard, under a temporary name.
    fn flush(&mut self) -> Result<()> {
        let path = self.dir.join(format!(
            "model-{:05}.safetensors.tmp",
            self.shards.len() + 1
        ));
        let views = self
            .pending
            .iter()
            .map(|p| {
                TensorView::new(st_dtype(p.dtype), p.shape.clone(), &p.bytes)
                    .map(|v| (p.name.clone(), v))
                    .map_err(|e| Error::Refused {
                        tensor: p.name.clone(),
                        detail: format!("safetensors: {e}"),
                    })
            })
            .collect::<Result<Vec<_>>>()?;
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(metadata), &path)
            .map_err(|e| io_err(&path, format!("write: {e}")))?;
        let names = self.pending.drain(..).map(|p| p.name).collect();
        self.pending_bytes = 0;
        self.shards.push((path, names));
        Ok(())
    }

    /// Writes the last shard, renames the shards to their final names, writes the index
    /// when there are several, and removes weight files of an earlier save this one did
    /// not write. `Err` when no `config.json` was written or copied, or naming the file
    /// an operation failed on.
    pub fn finish(mut self) -> Result<HfSaved> {
        if !self.config_written {
            return Err(Error::Refused {
                tensor: "config.json".into(),
                detail: "no config: call copy_files_from or write_config before finish".into(),
            });
        }
        if !self.pending.is_empty() || self.shards.is_empty() {
            self.flush()?;
        }
        let count = self.shards.len();
        let final_name = |i: usize| {
            if count == 1 {
                SINGLE_FILE.to_string()
            } else {
                format!("model-{:05}-of-{count:05}.safetensors", i + 1)
            }
        };
        let mut files = Vec::with_capacity(count + 1);
        let mut weight_map = BTreeMap::new();
        for (i, (tmp, names)) in self.shards.iter().enumerate() {
            let name = final_name(i);
            let path = self.dir.join(&name);
            fs::rename(tmp, &path).map_err(|e| io_err(tmp, format!("rename to {name}: {e}")))?;
            for t in names {
                weight_map.insert(t.clone(), serde_json::Value::from(name.clone()));
            }
            files.push(path);
        }
        if count > 1 {
            let index = serde_json::json!({
                "metadata": { "total_size": self.total_size },
                "weight_map": weight_map,
            });
            let path = self.dir.join(INDEX_FILE);
            let text = serde_json::to_string_pretty(&index).expect("JSON values serialize");
            fs::write(&path, text + "\n").map_err(|e| io_err(&path, format!("write: {e}")))?;
            files.push(path);
        }
        let written: BTreeSet<&Path> = files.iter().map(PathBuf::as_path).collect();
        let entries =
            fs::read_dir(&self.dir).map_err(|e| io_err(&self.dir, format!("list: {e}")))?;
        for entry in entries {
            let entry = entry.map_err(|e| io_err(&self.dir, format!("list: {e}")))?;
            let path = entry.path();
            // A failed earlier save's shards are left under their temporary names.
            let stale = entry.file_name().to_str().is_some_and(|f| {
                is_weight_file(f) || (f.starts_with("model-") && f.ends_with(".safetensors.tmp"))
            }) && !written.contains(path.as_path());
            if stale {
                fs::remove_file(&path)
                    .map_err(|e| io_err(&path, format!("remove stale weights: {e}")))?;
            }
        }
        Ok(HfSaved {
            files,
            total_size: self.total_size,
            tensors: self.names.len(),
        })
    }
}
