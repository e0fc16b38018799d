//! # dtensor-checkpoint
//!
//! Distributed checkpoints of [`AnyDTensor`]s (and typed [`DTensor`]s) that reshard on
//! load.
//!
//! **Save** ([`save`], collective over a world communicator): every rank writes the shards
//! it owns into one safetensors file, `g<generation>-rank<r>.safetensors`. Only one replica
//! is written: a rank writes a tensor's shard only if its coordinate is 0 on every axis
//! where the tensor is `Replicate` or `Invariant`. A `Partial` (pending sum) or `Ragged`
//! tensor is refused with an `Err` on every rank: reduce it first. After all ranks agree
//! their files are in place, rank 0 writes the [index](index::Index) (`index.json`): the
//! format version, each tensor's global shape, dtype, mesh and placements, and for each
//! stored shard its file, global offset, local shape, byte range and CRC-32 per block.
//!
//! **Atomicity**: data files are written under `*.tmp` names, synced, and renamed to names
//! that carry a new generation number, so they never replace a file the current index
//! references; the index is written the same way and renamed last (an atomic replace).
//! A crash at any point leaves either the previous checkpoint or the new one loadable.
//! Files of older generations and stray `*.tmp` files are removed after the index lands.
//!
//! **Load** ([`load`], collective): each target names a tensor, the global shape and dtype
//! the model expects, and the placements and mesh it wants, which need not be the saved
//! ones. A rank computes its global block from the target layout
//! ([`dtensor_placement::local_ranges`]), intersects it with every stored shard and reads
//! only the checksum blocks that hold the intersection (a seek and a read per run of
//! blocks). Every rank loads into temporaries; the ranks then agree (an all-gather of the
//! error messages) and either all return the tensors or all return an `Err` that names the
//! file and tensor that failed.
//!
//! **Integrity guarantee**: every byte a load copies into a tensor lies in a checksum block
//! that was read whole and whose CRC-32 matched the index, and the index's own CRC-32
//! covers every field of it; the safetensors header of each file touched is parsed and
//! checked against the index (dtype, shape, byte range, file length). Bytes a rank does not
//! need are not read, so corruption there is not detected by that rank: [`verify_files`]
//! (or [`LoadOptions::verify_files`]) checks each whole file's size and CRC-32 on demand.
//! CRC-32 detects accidental corruption (all bursts up to 32 bits, and random damage with
//! probability 1 − 2⁻³²); it is not a defence against deliberate tampering.
//!
//! All file IO is per rank; the only collectives are the agreements, the gather of shard
//! records to rank 0 and the broadcast of the generation, so the same code runs on thread
//! ranks and on MPI processes over a shared file system. Only rank 0 creates the directory
//! (before the first agreement, so no other process touches it earlier) and writes the
//! index; `scripts/mpi-tests.sh` saves under one `mpirun` and resumes under another, and
//! `scripts/mpi-restart.sh` resumes after a rank was killed with SIGKILL mid-run.
//!
//! **Device meshes** (a world over the NCCL backend, whose collectives take device memory
//! only): the agreements, the gather of shard records and the broadcast of the generation
//! are a few host values, moved through `dtensor_core::transfer`'s `*_values` helpers (up
//! to the device, the device collective, back), so the same code runs there. A rank copies
//! each shard it writes from device to host memory once, just before serializing its file
//! (writing a file is a host operation); shards it does not write (replicas) are not
//! copied. A load reads into host memory and builds each piece with
//! [`AnyDTensor::from_local`], which copies it to the mesh's GPU once: every loaded tensor
//! lives where the model's tensors do.
//!
//! [`nn::save_model`] / [`nn::load_model`] add a model's training state: masters, AdamW
//! moments and step count, and the layers' non-parameter state
//! ([`dtensor_nn::Module::visit_state`], e.g. an MoE layer's expert selection bias).
//!
//! [`hf`] reads and writes the Hugging Face layout instead: a model directory's
//! `config.json` ([`hf::HfConfig`]), the tensors it implies and the check of a checkpoint
//! against them ([`hf::HfWeights::validate`]), its safetensors weights memory-mapped and
//! read block by block ([`hf::HfWeights`]), and a streaming writer of sharded safetensors
//! with their index ([`hf::HfWriter`]):
//!
//! ```no_run
//! use dtensor_checkpoint::hf::{HfWeights, HfWriter};
//! use std::path::Path;
//!
//! # fn main() -> dtensor_checkpoint::Result<()> {
//! let source = Path::new("Qwen3-0.6B");
//! let (config, weights) = HfWeights::open_checked(source)?; // every tensor present, shaped
//! println!("{:?}: {} tensors", config.architecture, weights.names().count());
//! let mut out = HfWriter::create(Path::new("copy"), 2 << 30)?; // shards of at most 2 GiB
//! out.copy_files_from(source)?;
//! for name in weights.names() {
//!     let info = weights.info(name).expect("a listed name");
//!     out.add_bytes(name, info.dtype, &info.shape, weights.stored_bytes(name)?)?;
//! }
//! out.finish()?;
//! # Ok(())
//! # }
//! ```

#![warn(missing_docs)]

pub mod crc;
pub mod hf;
pub mod index;
pub mod nn;

use crate::crc::crc32;
use crate::index::{
    dtype_name, FileEntry, Index, ShardEntry, TensorEntry, DEFAULT_BLOCK_BYTES, INDEX_FILE, VERSION,
};
use dtensor_collectives::Communicator;
use dtensor_core::{transfer, AnyDTensor, DTensor, DeviceMesh};
use dtensor_kernels::{half, DType, Tensor};
use dtensor_placement::{local_ranges, Layout, Placement};
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What a save or a load can reject. Every message names the file and, where one is
/// involved, the tensor.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// The operating system refused a file operation (create, open, read, write, sync,
    /// rename) on `file` or the checkpoint directory.
    #[error("checkpoint file {file}: {detail}")]
    Io {
        /// The file or directory operated on.
        file: PathBuf,
        /// The operation and the OS error, in words.
        detail: String,
    },
    /// A file that does not parse, or says something impossible.
    #[error("checkpoint file {file}: {detail}")]
    Format {
        /// The index or data file at fault.
        file: PathBuf,
        /// What does not parse or does not agree, in words.
        detail: String,
    },
    /// An index written in another format version than this build reads.
    #[error("checkpoint file {file}: format version {found}, this build reads version {expected}")]
    Version {
        /// The index file.
        file: PathBuf,
        /// The version the index records.
        found: u64,
        /// The version this build reads and writes ([`index::VERSION`]).
        expected: u64,
    },
    /// A CRC-32 that does not match the index: of the index itself, of a checksum block a
    /// load read, or of a whole data file ([`verify_files`]).
    #[error("checkpoint file {file}{}: checksum mismatch: {detail}", tensor.as_ref().map(|t| format!(", tensor {t}")).unwrap_or_default())]
    Checksum {
        /// The file whose bytes do not match.
        file: PathBuf,
        /// The tensor whose shard the bad block belongs to; `None` for the index or a
        /// whole-file check.
        tensor: Option<String>,
        /// Which block or file, the CRC-32 computed and the one recorded.
        detail: String,
    },
    /// The file or index is fine but does not hold what the model needs (a missing
    /// tensor, another global shape or dtype), or a file-level error met while loading a
    /// tensor.
    #[error("checkpoint file {file}, tensor {tensor}: {detail}")]
    Tensor {
        /// The index or data file involved.
        file: PathBuf,
        /// The tensor being loaded.
        tensor: String,
        /// What is missing or differs, in words.
        detail: String,
    },
    /// A save of something that cannot be stored as is: a `Partial` (pending sum) or
    /// `Ragged` tensor, a name given twice, or a shard safetensors cannot serialize.
    #[error("checkpoint save of tensor {tensor}: {detail}")]
    Refused {
        /// The tensor refused.
        tensor: String,
        /// Why, and what to do first (e.g. reduce a `Partial` axis).
        detail: String,
    },
    /// A model configuration (a Hugging Face `config.json`) with a field that is
    /// missing, malformed, or set to something dtensor does not implement.
    #[error("model config {file}: field `{field}`: {detail}")]
    Config {
        /// The configuration file.
        file: PathBuf,
        /// The field at fault (`rope_parameters.factor` for a nested one).
        field: String,
        /// What is wrong with it, in words.
        detail: String,
    },
    /// This rank succeeded but others did not; their messages.
    #[error("checkpoint {op} failed on other ranks: {detail}")]
    OtherRanks {
        /// The collective operation that failed elsewhere (`"save"`, `"load"`).
        op: &'static str,
        /// The failed ranks' messages, each with its rank.
        detail: String,
    },
    /// A collective (an agreement, a gather, a broadcast) or a `DTensor` construction
    /// failed; from `dtensor-core` (which wraps collective errors too).
    #[error(transparent)]
    Core(#[from] dtensor_core::Error),
}

/// `std::result::Result` with this crate's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl From<dtensor_collectives::Error> for Error {
    fn from(e: dtensor_collectives::Error) -> Self {
        Error::Core(e.into())
    }
}

impl From<dtensor_kernels::Error> for Error {
    fn from(e: dtensor_kernels::Error) -> Self {
        Error::Core(e.into())
    }
}

pub(crate) fn io_err(file: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io {
        file: file.to_path_buf(),
        detail: e.to_string(),
    }
}

/// Collective over `world`: every rank returns `Ok` only if every rank's `local` is `Ok`.
/// A failed rank returns its own error; the others return [`Error::OtherRanks`] with the
/// failed ranks' messages.
pub fn agree<T>(world: &Arc<dyn Communicator>, op: &'static str, local: Result<T>) -> Result<T> {
    let msg = match &local {
        Ok(_) => Vec::new(),
        Err(e) => format!("{e}").into_bytes(),
    };
    let messages = all_gather_bytes(world, &msg)?;
    if messages.iter().all(Vec::is_empty) {
        return local;
    }
    let local = local?;
    let detail: Vec<String> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| !m.is_empty())
        .map(|(r, m)| format!("rank {r}: {}", String::from_utf8_lossy(m)))
        .collect();
    drop(local);
    Err(Error::OtherRanks {
        op,
        detail: detail.join("; "),
    })
}

/// Collective over `world`: every rank's `bytes`, in rank order (lengths first, then the
/// bytes packed into words; no second collective when every rank's bytes are empty).
fn all_gather_bytes(world: &Arc<dyn Communicator>, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
    let lens: Vec<i64> = transfer::all_gather_values(&**world, &[bytes.len() as i64])?;
    if lens.iter().all(|&l| l == 0) {
        return Ok(vec![Vec::new(); lens.len()]);
    }
    let words: Vec<usize> = lens.iter().map(|&l| (l as usize).div_ceil(8)).collect();
    let mut recv = vec![0i64; words.iter().sum()];
    transfer::all_gatherv_values(&**world, &pack(bytes), &mut recv, &words)?;
    let mut out = Vec::with_capacity(lens.len());
    let mut at = 0;
    for (&l, &w) in lens.iter().zip(&words) {
        out.push(unpack(&recv[at..at + w], l as usize));
        at += w;
    }
    Ok(out)
}

fn pack(bytes: &[u8]) -> Vec<i64> {
    bytes
        .chunks(8)
        .map(|c| {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            i64::from_le_bytes(w)
        })
        .collect()
}

fn unpack(words: &[i64], len: usize) -> Vec<u8> {
    let mut out: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    out.truncate(len);
    out
}

/// The local tensor's elements as little-endian bytes. A piece in device memory is copied
/// to the host first, once (writing a file is a host operation).
pub(crate) fn tensor_bytes(t: &Tensor) -> dtensor_kernels::Result<Vec<u8>> {
    let t = &t.to_host()?;
    fn le<T: bytemuck::Pod, const N: usize>(s: &[T], f: impl Fn(&T) -> [u8; N]) -> Vec<u8> {
        if cfg!(target_endian = "little") {
            bytemuck::cast_slice(s).to_vec()
        } else {
            s.iter().flat_map(f).collect()
        }
    }
    macro_rules! s {
        ($t:ty) => {
            t.as_slice::<$t>()?
        };
    }
    Ok(match t.dtype() {
        DType::F32 => le(s!(f32), |x| x.to_le_bytes()),
        DType::F64 => le(s!(f64), |x| x.to_le_bytes()),
        DType::I32 => le(s!(i32), |x| x.to_le_bytes()),
        DType::I64 => le(s!(i64), |x| x.to_le_bytes()),
        DType::BF16 => s!(half::bf16)
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
        DType::F16 => s!(half::f16)
            .iter()
            .flat_map(|x| x.to_bits().to_le_bytes())
            .collect(),
    })
}

/// A tensor of `shape` and `dtype` from its little-endian bytes.
pub(crate) fn tensor_from_bytes(
    b: &[u8],
    shape: &[usize],
    dtype: DType,
) -> dtensor_kernels::Result<Tensor> {
    fn from<T: bytemuck::Pod, const N: usize>(b: &[u8], f: impl Fn([u8; N]) -> T) -> Vec<T> {
        if cfg!(target_endian = "little") {
            let n = b.len() / N;
            let mut v = vec![T::zeroed(); n];
            bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(&b[..n * N]);
            v
        } else {
            b.chunks_exact(N)
                .map(|c| f(c.try_into().expect("N bytes")))
                .collect()
        }
    }
    match dtype {
        DType::F32 => Tensor::from_vec(from(b, f32::from_le_bytes), shape),
        DType::F64 => Tensor::from_vec(from(b, f64::from_le_bytes), shape),
        DType::I32 => Tensor::from_vec(from(b, i32::from_le_bytes), shape),
        DType::I64 => Tensor::from_vec(from(b, i64::from_le_bytes), shape),
        DType::BF16 => Tensor::from_vec(
            b.chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect::<Vec<_>>(),
            shape,
        ),
        DType::F16 => Tensor::from_vec(
            b.chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect::<Vec<_>>(),
            shape,
        ),
    }
}

pub(crate) fn st_dtype(d: DType) -> safetensors::Dtype {
    match d {
        DType::F32 => safetensors::Dtype::F32,
        DType::F64 => safetensors::Dtype::F64,
        DType::BF16 => safetensors::Dtype::BF16,
        DType::F16 => safetensors::Dtype::F16,
        DType::I32 => safetensors::Dtype::I32,
        DType::I64 => safetensors::Dtype::I64,
    }
}

fn block_crcs(data: &[u8], block: usize) -> Vec<u32> {
    data.chunks(block).map(crc32).collect()
}

/// Writes `bytes` to `path` through `path.tmp`, synced, then renamed.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = tmp_name(path);
    let mut f = File::create(&tmp).map_err(|e| io_err(&tmp, e))?;
    f.write_all(bytes).map_err(|e| io_err(&tmp, e))?;
    f.sync_all().map_err(|e| io_err(&tmp, e))?;
    drop(f);
    fs::rename(&tmp, path).map_err(|e| io_err(path, e))
}

fn tmp_name(path: &Path) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

fn sync_dir(dir: &Path) {
    // Best effort: makes the renames durable where the platform allows opening a directory.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
}

/// The generation in a data file name `g<gen>-rank<r>.safetensors`.
fn generation_of(name: &str) -> Option<u64> {
    let rest = name.strip_prefix('g')?;
    let (g, tail) = rest.split_once("-rank")?;
    tail.strip_suffix(".safetensors")
        .or_else(|| tail.strip_suffix(".safetensors.tmp"))?;
    g.parse().ok()
}

fn data_file_name(generation: u64, rank: usize) -> String {
    format!("g{generation:06}-rank{rank:05}.safetensors")
}

/// Options of a save.
#[derive(Clone, Debug)]
pub struct SaveOptions {
    /// Checksum block size in bytes (one CRC-32 per block of each shard).
    pub block_bytes: usize,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            block_bytes: DEFAULT_BLOCK_BYTES,
        }
    }
}

/// What a save did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SaveReport {
    /// The checkpoint's generation: one past the highest found in the directory; the data
    /// files are named `g<generation>-rank<r>.safetensors`.
    pub generation: u64,
    /// Bytes this rank wrote (its data file).
    pub rank_bytes: u64,
    /// Bytes of all data files.
    pub total_bytes: u64,
    /// Bytes of tensor data in all files (no headers): the checkpoint's payload.
    pub payload_bytes: u64,
}

/// Collective over `world`: saves `tensors` (this rank's named tensors; names unique
/// across the world, a tensor on several ranks passed by each) and `extra` into `dir`.
/// See the [crate docs](crate) for the layout and the atomicity.
pub fn save(
    dir: &Path,
    world: &Arc<dyn Communicator>,
    tensors: &[(&str, &AnyDTensor)],
    extra: &BTreeMap<String, String>,
) -> Result<SaveReport> {
    save_with(dir, world, tensors, extra, &SaveOptions::default())
}

/// [`save`] with options.
pub fn save_with(
    dir: &Path,
    world: &Arc<dyn Communicator>,
    tensors: &[(&str, &AnyDTensor)],
    extra: &BTreeMap<String, String>,
    opts: &SaveOptions,
) -> Result<SaveReport> {
    let me = world.rank();
    // Rank 0 picks the generation: one past any data file already in the directory.
    let generation = if me == 0 {
        fs::create_dir_all(dir)
            .map_err(|e| io_err(dir, e))
            .and_then(|_| {
                let mut g = 0;
                for e in fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
                    let e = e.map_err(|e| io_err(dir, e))?;
                    if let Some(x) = e.file_name().to_str().and_then(generation_of) {
                        g = g.max(x);
                    }
                }
                Ok(g + 1)
            })
    } else {
        Ok(0)
    };
    let generation = agree(world, "save", generation)?;
    let mut g = [generation as i64];
    transfer::broadcast_values(&**world, &mut g, 0)?;
    let generation = g[0] as u64;

    let file_name = data_file_name(generation, me);
    let path = dir.join(&file_name);
    let local = write_rank_file(&path, &file_name, me, tensors, opts.block_bytes);
    let record = match agree(world, "save", local) {
        Ok(r) => r,
        Err(e) => {
            let _ = fs::remove_file(&path);
            return Err(e);
        }
    };

    // Gather every rank's record (JSON) on every rank; rank 0 writes the index.
    let text = serde_json::to_vec(&record).expect("JSON values serialize");
    let records = all_gather_bytes(world, &text)?;
    let index_path = dir.join(INDEX_FILE);
    let merged = merge_records(
        &records,
        &index_path,
        generation,
        world.size(),
        opts.block_bytes,
    );
    let committed = match (me, merged) {
        (0, Ok((mut index, report))) => {
            index.extra = extra.clone();
            write_atomic(&index_path, index.to_json_text().as_bytes()).map(|_| {
                sync_dir(dir);
                remove_stale(dir, &index);
                report
            })
        }
        (_, m) => m.map(|(_, r)| r),
    }
    .map(|mut r| {
        r.rank_bytes = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        r
    });
    let report = agree(world, "save", committed);
    if report.is_err() {
        let _ = fs::remove_file(&path);
    }
    report
}

/// Removes data files of other generations and `*.tmp` files (after a commit).
fn remove_stale(dir: &Path, index: &Index) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        let stale = match generation_of(name) {
            Some(g) => g != index.generation || name.ends_with(".tmp"),
            None => name == format!("{INDEX_FILE}.tmp"),
        };
        if stale {
            let _ = fs::remove_file(e.path());
        }
    }
}

/// Writes this rank's shards; returns its record for the index.
fn write_rank_file(
    path: &Path,
    file_name: &str,
    rank: usize,
    tensors: &[(&str, &AnyDTensor)],
    block_bytes: usize,
) -> Result<serde_json::Value> {
    let mut names = std::collections::HashSet::new();
    let mut owned: Vec<(&str, &AnyDTensor, Vec<u8>)> = Vec::new();
    let mut metas = serde_json::Map::new();
    for &(name, t) in tensors {
        if !names.insert(name) {
            return Err(Error::Refused {
                tensor: name.into(),
                detail: "the name is passed twice".into(),
            });
        }
        if let Some(p) = t
            .placements()
            .iter()
            .find(|p| p.is_partial() || p.is_ragged())
        {
            return Err(Error::Refused {
                tensor: name.into(),
                detail: format!(
                    "placement {p} in {:?}: a Partial tensor holds pending sums and a Ragged one data-dependent rows; reduce or gather it before saving",
                    t.placements()
                ),
            });
        }
        let mesh = t.device_mesh();
        let writer = t
            .placements()
            .iter()
            .zip(mesh.coords())
            .all(|(p, &c)| p.is_shard() || c == 0);
        let entry = TensorEntry {
            shape: t.global_shape().to_vec(),
            dtype: t.dtype(),
            mesh: mesh
                .mesh()
                .axes()
                .iter()
                .map(|(k, n)| (k.name().to_string(), *n))
                .collect(),
            placements: t.placements().to_vec(),
            shards: Vec::new(),
        };
        metas.insert(name.to_string(), entry.to_json());
        if writer {
            let bytes = tensor_bytes(t.as_local()).map_err(dtensor_core::Error::from)?;
            owned.push((name, t, bytes));
        }
    }
    if owned.is_empty() {
        return Ok(serde_json::json!({ "tensors": metas }));
    }
    let views = owned
        .iter()
        .map(|(name, t, bytes)| {
            safetensors::tensor::TensorView::new(
                st_dtype(t.dtype()),
                t.local_shape().to_vec(),
                bytes,
            )
            .map(|v| (name.to_string(), v))
            .map_err(|e| Error::Refused {
                tensor: name.to_string(),
                detail: format!("safetensors: {e}"),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    let buf = safetensors::serialize(views, None).map_err(|e| io_err(path, e))?;
    let (n, meta) = safetensors::SafeTensors::read_metadata(&buf).map_err(|e| io_err(path, e))?;
    let data_start = 8 + n as u64;
    for (name, t, bytes) in &owned {
        let info = meta.info(name).expect("just serialized");
        let offset = dtensor_placement::global_offset(
            t.device_mesh().mesh(),
            t.placements(),
            t.device_mesh().coords(),
            t.global_shape(),
        )
        .map_err(dtensor_core::Error::from)?;
        let shard = ShardEntry {
            file: file_name.to_string(),
            key: name.to_string(),
            offset: offset.to_vec(),
            shape: t.local_shape().to_vec(),
            data_offsets: (
                data_start + info.data_offsets.0 as u64,
                data_start + info.data_offsets.1 as u64,
            ),
            crc32: block_crcs(bytes, block_bytes),
        };
        let m = metas[*name].as_object().cloned().expect("an object");
        let mut m = m;
        m.insert("shards".into(), serde_json::json!([shard.to_json()]));
        metas.insert(name.to_string(), serde_json::Value::Object(m));
    }
    drop(owned);
    let file = FileEntry {
        name: file_name.to_string(),
        rank,
        bytes: buf.len() as u64,
        crc32: crc32(&buf),
    };
    write_atomic(path, &buf)?;
    Ok(serde_json::json!({ "file": file.to_json(), "tensors": metas }))
}

/// Merges the ranks' records into the index (checking they agree on each tensor).
fn merge_records(
    records: &[Vec<u8>],
    index_path: &Path,
    generation: u64,
    world_size: usize,
    block_bytes: usize,
) -> Result<(Index, SaveReport)> {
    let r = index::Reader { file: index_path };
    let mut files = Vec::new();
    let mut tensors: BTreeMap<String, TensorEntry> = BTreeMap::new();
    let mut report = SaveReport {
        generation,
        rank_bytes: 0,
        total_bytes: 0,
        payload_bytes: 0,
    };
    for (rank, text) in records.iter().enumerate() {
        let v: serde_json::Value =
            serde_json::from_slice(text).map_err(|e| io_err(index_path, e))?;
        if let Some(f) = v.get("file") {
            let f = r.file_entry(f, "record")?;
            report.total_bytes += f.bytes;
            files.push(f);
        }
        let Some(ts) = v.get("tensors").and_then(|t| t.as_object()) else {
            continue;
        };
        for (name, t) in ts {
            let t = r.tensor(t, name)?;
            for s in &t.shards {
                report.payload_bytes += s.data_offsets.1 - s.data_offsets.0;
            }
            match tensors.get_mut(name) {
                None => {
                    tensors.insert(name.clone(), t);
                }
                Some(have) => {
                    if (&have.shape, have.dtype, &have.placements, &have.mesh)
                        != (&t.shape, t.dtype, &t.placements, &t.mesh)
                    {
                        return Err(Error::Refused {
                            tensor: name.clone(),
                            detail: format!(
                                "rank {rank} saves it as {:?} {} {:?}, another rank as {:?} {} {:?}",
                                t.shape,
                                dtype_name(t.dtype),
                                t.placements,
                                have.shape,
                                dtype_name(have.dtype),
                                have.placements
                            ),
                        });
                    }
                    have.shards.extend(t.shards);
                }
            }
        }
    }
    let index = Index {
        version: VERSION,
        generation,
        world_size,
        block_bytes,
        files,
        tensors,
        extra: BTreeMap::new(),
    };
    Ok((index, report))
}

/// Reads and checks `dir/index.json` (format, version, its own checksum). Local.
pub fn read_index(dir: &Path) -> Result<Index> {
    let path = dir.join(INDEX_FILE);
    let text = fs::read(&path).map_err(|e| io_err(&path, e))?;
    Index::parse(&text, &path)
}

/// Checks every data file the index lists: present, of the recorded size, and of the
/// recorded whole-file CRC-32. Local (reads every file in full).
pub fn verify_files(dir: &Path) -> Result<()> {
    let index = read_index(dir)?;
    for f in &index.files {
        let path = dir.join(&f.name);
        let mut file = File::open(&path).map_err(|e| io_err(&path, e))?;
        let mut crc = crc::Crc32::new();
        let mut buf = vec![0u8; 1 << 20];
        let mut total = 0u64;
        loop {
            let n = file.read(&mut buf).map_err(|e| io_err(&path, e))?;
            if n == 0 {
                break;
            }
            total += n as u64;
            crc.update(&buf[..n]);
        }
        if total != f.bytes {
            return Err(Error::Format {
                file: path,
                detail: format!("{total} bytes, the index records {}", f.bytes),
            });
        }
        let c = crc.finish();
        if c != f.crc32 {
            return Err(Error::Checksum {
                file: path,
                tensor: None,
                detail: format!("file CRC-32 {c:#010x}, recorded {:#010x}", f.crc32),
            });
        }
    }
    Ok(())
}

/// One tensor to load: what the model expects (global shape, dtype) and how it wants it
/// laid out (placements on `mesh`), whatever the checkpoint's layout was.
#[derive(Clone)]
pub struct Target<'a> {
    /// The tensor's name in the checkpoint.
    pub name: &'a str,
    /// The global shape the model expects; a checkpoint holding another is an
    /// [`Error::Tensor`].
    pub shape: &'a [usize],
    /// The element type the model expects; a checkpoint holding another is an
    /// [`Error::Tensor`] (no conversion).
    pub dtype: DType,
    /// The placement per axis of `mesh` the loaded tensor gets, whatever the saved one
    /// was; `Partial` and `Ragged` are an [`Error::Tensor`] (a checkpoint holds whole
    /// values).
    pub placements: &'a [Placement],
    /// The device mesh the loaded tensor lives on.
    pub mesh: &'a Arc<DeviceMesh>,
}

impl<'a> Target<'a> {
    /// A target shaped, typed and laid out like `like` (the model's current tensor).
    pub fn like(name: &'a str, like: &'a AnyDTensor) -> Self {
        Target {
            name,
            shape: like.global_shape(),
            dtype: like.dtype(),
            placements: like.placements(),
            mesh: like.device_mesh(),
        }
    }
}

/// Options of a load.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Also check every data file's size and whole-file CRC-32 before loading (each rank
    /// reads every file in full).
    pub verify_files: bool,
}

/// What a load read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoadStats {
    /// Bytes of tensor data this rank read from data files (whole checksum blocks).
    pub bytes_read: u64,
    /// Bytes this rank copied into its targets.
    pub bytes_loaded: u64,
}

/// Collective over `world`: loads `targets` from `dir`, resharding to each target's layout;
/// every rank gets all its tensors or every rank gets an `Err`.
pub fn load(
    dir: &Path,
    world: &Arc<dyn Communicator>,
    targets: &[Target<'_>],
) -> Result<Vec<AnyDTensor>> {
    Ok(load_with(dir, world, targets, &LoadOptions::default())?.0)
}

/// [`load`] with options, also returning what this rank read.
pub fn load_with(
    dir: &Path,
    world: &Arc<dyn Communicator>,
    targets: &[Target<'_>],
    opts: &LoadOptions,
) -> Result<(Vec<AnyDTensor>, LoadStats)> {
    let local = (|| {
        if opts.verify_files {
            verify_files(dir)?;
        }
        let index = read_index(dir)?;
        let mut reader = ShardReader::new(dir, &index);
        let mut out = Vec::with_capacity(targets.len());
        for t in targets {
            out.push(load_one(&index, &mut reader, t)?);
        }
        Ok((out, reader.stats))
    })();
    agree(world, "load", local)
}

/// Collective: loads one tensor as a typed `DTensor<L>`: the target layout is `L` (checked
/// against `mesh`), whatever layout the checkpoint holds.
pub fn load_typed<L: Layout>(
    dir: &Path,
    world: &Arc<dyn Communicator>,
    name: &str,
    shape: &[usize],
    dtype: DType,
    mesh: &Arc<DeviceMesh>,
) -> Result<DTensor<L>> {
    let placements = L::placements();
    let t = Target {
        name,
        shape,
        dtype,
        placements: &placements,
        mesh,
    };
    let mut v = load(dir, world, &[t])?;
    Ok(DTensor::try_from_any(v.pop().expect("one target"))?)
}

/// Open data files and their checked safetensors headers.
struct ShardReader<'a> {
    dir: &'a Path,
    index: &'a Index,
    open: HashMap<String, (File, serde_json::Map<String, serde_json::Value>)>,
    stats: LoadStats,
}

/// Largest safetensors header we accept (the crate's own limit).
const MAX_HEADER: u64 = 100_000_000;

impl<'a> ShardReader<'a> {
    fn new(dir: &'a Path, index: &'a Index) -> Self {
        ShardReader {
            dir,
            index,
            open: HashMap::new(),
            stats: LoadStats::default(),
        }
    }

    /// The file, opened and its header parsed and checked against the index's record.
    fn file(
        &mut self,
        name: &str,
    ) -> Result<&mut (File, serde_json::Map<String, serde_json::Value>)> {
        if !self.open.contains_key(name) {
            let path = self.dir.join(name);
            let entry = self
                .index
                .files
                .iter()
                .find(|f| f.name == name)
                .ok_or_else(|| Error::Format {
                    file: self.dir.join(INDEX_FILE),
                    detail: format!(
                        "a shard references file {name}, which the index does not list"
                    ),
                })?;
            let mut f = File::open(&path).map_err(|e| io_err(&path, e))?;
            let len = f.metadata().map_err(|e| io_err(&path, e))?.len();
            if len != entry.bytes {
                return Err(Error::Format {
                    file: path,
                    detail: format!(
                        "{len} bytes, the index records {} (truncated?)",
                        entry.bytes
                    ),
                });
            }
            let mut n = [0u8; 8];
            f.read_exact(&mut n).map_err(|e| io_err(&path, e))?;
            let n = u64::from_le_bytes(n);
            if n > MAX_HEADER || n > len.saturating_sub(8) {
                return Err(Error::Format {
                    file: path,
                    detail: format!("safetensors header length {n} in a file of {len} bytes"),
                });
            }
            let mut h = vec![0u8; n as usize];
            f.read_exact(&mut h).map_err(|e| io_err(&path, e))?;
            let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&h)
                .map_err(|e| Error::Format {
                    file: path.clone(),
                    detail: format!("safetensors header is not valid JSON: {e}"),
                })?;
            // The data section ends where the last tensor ends: the file's length.
            let mut end = 0u64;
            for (k, v) in &header {
                if k == "__metadata__" {
                    continue;
                }
                let info: safetensors::tensor::TensorInfo = serde_json::from_value(v.clone())
                    .map_err(|e| Error::Format {
                        file: path.clone(),
                        detail: format!("safetensors header entry {k}: {e}"),
                    })?;
                end = end.max(info.data_offsets.1 as u64);
            }
            if (8 + n).checked_add(end) != Some(len) {
                return Err(Error::Format {
                    file: path,
                    detail: format!(
                        "safetensors header says {} bytes, the file has {len}",
                        8 + n + end
                    ),
                });
            }
            self.open.insert(name.to_string(), (f, header));
        }
        Ok(self.open.get_mut(name).expect("inserted above"))
    }
}

/// Checks that the shards of `t` tile its global shape exactly once.
fn check_tiling(t: &TensorEntry, name: &str, index_file: &Path) -> Result<()> {
    let bad = |detail: String| Error::Tensor {
        file: index_file.to_path_buf(),
        tensor: name.to_string(),
        detail,
    };
    let total = checked_numel(&t.shape).ok_or_else(|| bad("global shape overflows".into()))?;
    let mut sum = 0usize;
    for (i, s) in t.shards.iter().enumerate() {
        if s.offset.len() != t.shape.len() || s.shape.len() != t.shape.len() {
            return Err(bad(format!(
                "shard {i} has rank {} / {}, the tensor {}",
                s.offset.len(),
                s.shape.len(),
                t.shape.len()
            )));
        }
        for d in 0..t.shape.len() {
            let end = s.offset[d].checked_add(s.shape[d]);
            if end.is_none_or(|e| e > t.shape[d]) {
                return Err(bad(format!(
                    "shard {i} (offset {:?}, shape {:?}) exceeds the global shape {:?}",
                    s.offset, s.shape, t.shape
                )));
            }
        }
        sum += checked_numel(&s.shape).ok_or_else(|| bad("shard shape overflows".into()))?;
    }
    if sum != total {
        return Err(bad(format!(
            "the stored shards hold {sum} elements, the tensor {total}"
        )));
    }
    for (i, a) in t.shards.iter().enumerate() {
        for b in &t.shards[i + 1..] {
            let overlap = (0..t.shape.len()).all(|d| {
                a.offset[d].max(b.offset[d])
                    < (a.offset[d] + a.shape[d]).min(b.offset[d] + b.shape[d])
            });
            if overlap && checked_numel(&a.shape) != Some(0) && checked_numel(&b.shape) != Some(0) {
                return Err(bad(format!(
                    "stored shards at {:?} and {:?} overlap",
                    a.offset, b.offset
                )));
            }
        }
    }
    Ok(())
}

fn checked_numel(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |a, &b| a.checked_mul(b))
}

fn load_one(index: &Index, reader: &mut ShardReader<'_>, t: &Target<'_>) -> Result<AnyDTensor> {
    let index_file = reader.dir.join(INDEX_FILE);
    let bad = |file: &Path, detail: String| Error::Tensor {
        file: file.to_path_buf(),
        tensor: t.name.to_string(),
        detail,
    };
    let entry = index
        .tensors
        .get(t.name)
        .ok_or_else(|| bad(&index_file, "not in the checkpoint".into()))?;
    if entry.shape != t.shape || entry.dtype != t.dtype {
        return Err(bad(
            &index_file,
            format!(
                "saved as {:?} {}, the model has {:?} {}",
                entry.shape,
                dtype_name(entry.dtype),
                t.shape,
                dtype_name(t.dtype)
            ),
        ));
    }
    let mesh = t.mesh.mesh();
    dtensor_placement::check_placements("checkpoint::load", mesh, t.placements, t.shape.len())
        .map_err(|e| bad(&index_file, format!("target layout on mesh {mesh}: {e}")))?;
    if let Some(p) = t
        .placements
        .iter()
        .find(|p| p.is_partial() || p.is_ragged())
    {
        return Err(bad(
            &index_file,
            format!(
                "target placement {p}: a checkpoint loads whole values, not Partial or Ragged ones"
            ),
        ));
    }
    check_tiling(entry, t.name, &index_file)?;
    let want = local_ranges(mesh, t.placements, t.mesh.coords(), t.shape)
        .map_err(|e| bad(&index_file, e.to_string()))?;
    let esize = t.dtype.size_in_bytes();
    let lshape: Vec<usize> = want.iter().map(|r| r.len()).collect();
    let lnumel = lshape.iter().product::<usize>();
    let mut out = vec![0u8; lnumel * esize];
    let mut copied = 0usize;
    // Scalars are one-element vectors here.
    let nd = t.shape.len().max(1);
    let pad = |v: &[usize], fill: usize| -> Vec<usize> {
        if v.is_empty() {
            vec![fill]
        } else {
            v.to_vec()
        }
    };
    let (wlo, whi): (Vec<usize>, Vec<usize>) = if t.shape.is_empty() {
        (vec![0], vec![1])
    } else {
        (
            want.iter().map(|r| r.start).collect(),
            want.iter().map(|r| r.end).collect(),
        )
    };
    for s in &entry.shards {
        let soff = pad(&s.offset, 0);
        let sshape = pad(&s.shape, 1);
        let lo: Vec<usize> = (0..nd).map(|d| wlo[d].max(soff[d])).collect();
        let hi: Vec<usize> = (0..nd).map(|d| whi[d].min(soff[d] + sshape[d])).collect();
        if (0..nd).any(|d| lo[d] >= hi[d]) {
            continue;
        }
        let path = reader.dir.join(&s.file);
        let (file, header) = reader.file(&s.file).map_err(|e| with_tensor(e, t.name))?;
        // The header must agree with the index.
        let info = header.get(&s.key).ok_or_else(|| {
            bad(
                &path,
                format!("key {} missing from the safetensors header", s.key),
            )
        })?;
        let info: safetensors::tensor::TensorInfo = serde_json::from_value(info.clone())
            .map_err(|e| bad(&path, format!("safetensors header: {e}")))?;
        let hlen = {
            // Absolute data start = 8 + header length; recompute from the stream position
            // recorded at open: the data section starts right after the header.
            let mut n = [0u8; 8];
            file.seek(SeekFrom::Start(0))
                .map_err(|e| io_err(&path, e))?;
            file.read_exact(&mut n).map_err(|e| io_err(&path, e))?;
            8 + u64::from_le_bytes(n)
        };
        let nbytes = checked_numel(&s.shape)
            .and_then(|n| n.checked_mul(esize))
            .ok_or_else(|| bad(&path, "shard shape overflows".into()))?;
        if info.dtype != st_dtype(entry.dtype)
            || info.shape != s.shape
            || (
                hlen + info.data_offsets.0 as u64,
                hlen + info.data_offsets.1 as u64,
            ) != s.data_offsets
            || s.data_offsets.1 - s.data_offsets.0 != nbytes as u64
        {
            return Err(bad(
                &path,
                format!(
                    "safetensors header entry {:?} {:?} at {:?} disagrees with the index ({} {:?} at {:?})",
                    info.dtype, info.shape, info.data_offsets, dtype_name(entry.dtype), s.shape, s.data_offsets
                ),
            ));
        }
        let block = index.block_bytes;
        let nblocks = nbytes.div_ceil(block);
        if s.crc32.len() != nblocks {
            return Err(bad(
                &index_file,
                format!(
                    "{} block checksums for a shard of {nbytes} bytes",
                    s.crc32.len()
                ),
            ));
        }
        // The runs to copy: one per row of the intersection (all dims but the last).
        let sstride = strides(&sshape);
        let lshape_p = pad(&lshape, 1);
        let lstride = strides(&lshape_p);
        let mut runs = Vec::new(); // (src byte, dst byte, len bytes)
        let mut idx = lo.clone();
        let row = (hi[nd - 1] - lo[nd - 1]) * esize;
        loop {
            let src: usize = (0..nd).map(|d| (idx[d] - soff[d]) * sstride[d]).sum();
            let dst: usize = (0..nd).map(|d| (idx[d] - wlo[d]) * lstride[d]).sum();
            runs.push((src * esize, dst * esize, row));
            // Odometer over dims 0..nd-1 (the last dim is the run).
            let mut done = true;
            let mut d = nd - 1;
            while d > 0 {
                d -= 1;
                idx[d] += 1;
                if idx[d] < hi[d] {
                    done = false;
                    break;
                }
                idx[d] = lo[d];
            }
            if done {
                break;
            }
        }
        // The blocks those runs touch, read in runs of consecutive blocks and verified.
        let mut touched = vec![false; nblocks];
        for &(src, _, len) in &runs {
            touched[src / block..=(src + len - 1) / block].fill(true);
        }
        let first = touched.iter().position(|&x| x).expect("a run exists");
        let base = first * block;
        let last = touched.iter().rposition(|&x| x).expect("a run exists");
        let mut buf = vec![0u8; ((last + 1) * block).min(nbytes) - base];
        let mut read = 0u64;
        let mut b = first;
        while b <= last {
            if !touched[b] {
                b += 1;
                continue;
            }
            let mut e = b;
            while e < last && touched[e + 1] {
                e += 1;
            }
            let (from, to) = (b * block, ((e + 1) * block).min(nbytes));
            file.seek(SeekFrom::Start(s.data_offsets.0 + from as u64))
                .map_err(|e| io_err(&path, e))?;
            file.read_exact(&mut buf[from - base..to - base])
                .map_err(|e| {
                    bad(
                        &path,
                        format!("reading bytes {from}..{to} of the shard: {e}"),
                    )
                })?;
            read += (to - from) as u64;
            for k in b..=e {
                let (x, y) = (k * block - base, ((k + 1) * block).min(nbytes) - base);
                let c = crc32(&buf[x..y]);
                if c != s.crc32[k] {
                    return Err(Error::Checksum {
                        file: path,
                        tensor: Some(t.name.to_string()),
                        detail: format!(
                            "block {k} (bytes {}..{} of the shard at {:?}): CRC-32 {c:#010x}, recorded {:#010x}",
                            k * block,
                            y + base,
                            s.offset,
                            s.crc32[k]
                        ),
                    });
                }
            }
            b = e + 1;
        }
        reader.stats.bytes_read += read;
        for (src, dst, len) in runs {
            out[dst..dst + len].copy_from_slice(&buf[src - base..src - base + len]);
            copied += len;
        }
    }
    if copied != out.len() {
        return Err(bad(
            &index_file,
            format!(
                "the stored shards cover {copied} of the {} bytes this rank needs",
                out.len()
            ),
        ));
    }
    reader.stats.bytes_loaded += copied as u64;
    let local = tensor_from_bytes(&out, &lshape, t.dtype).map_err(dtensor_core::Error::from)?;
    Ok(AnyDTensor::from_local(
        local,
        t.shape,
        t.placements,
        t.mesh,
    )?)
}

/// A file-level error reported while loading `tensor`: names the tensor too.
fn with_tensor(e: Error, tensor: &str) -> Error {
    match e {
        Error::Io { file, detail } | Error::Format { file, detail } => Error::Tensor {
            file,
            tensor: tensor.to_string(),
            detail,
        },
        e => e,
    }
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}
