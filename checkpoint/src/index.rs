//! The metadata index (`index.json`): what every tensor is, where each stored shard lives
//! and the checksums that guard it. Written by rank 0 last, read by every rank.

use crate::crc::crc32;
use crate::Error;
use dtensor_kernels::DType;
use dtensor_placement::Placement;
use serde_json::{json, Map, Value};
use std::collections::BTreeMap;
use std::path::Path;

/// What the `format` field says.
pub const FORMAT: &str = "dtensor-checkpoint";
/// The version this build writes and reads. Bump it when the meaning of a field changes.
pub const VERSION: u64 = 1;
/// The index's file name inside a checkpoint directory.
pub const INDEX_FILE: &str = "index.json";
/// Default checksum block: each stored shard has one CRC-32 per this many bytes.
pub const DEFAULT_BLOCK_BYTES: usize = 1 << 20;

/// One data file (one rank's shards).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileEntry {
    /// Its file name inside the checkpoint directory, `g<generation>-rank<r>.safetensors`.
    pub name: String,
    /// The world rank that wrote it.
    pub rank: usize,
    /// Its length in bytes (header included).
    pub bytes: u64,
    /// CRC-32 of the whole file (checked by [`verify_files`](crate::verify_files)).
    pub crc32: u32,
}

/// One stored shard of a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardEntry {
    /// The data file holding it.
    pub file: String,
    /// Its safetensors key in that file.
    pub key: String,
    /// Global offset of its first element per dim. An empty shard's offset on its sharded
    /// dim is clamped to the dim's extent (PyTorch DCP's convention, `torch.chunk` chunks).
    pub offset: Vec<usize>,
    /// Its local shape.
    pub shape: Vec<usize>,
    /// `[begin, end)` byte range of its data in the file (absolute, past the safetensors
    /// header), so a reader can seek without parsing more than it needs.
    pub data_offsets: (u64, u64),
    /// CRC-32 of each `block_bytes` block of its data (the last one short).
    pub crc32: Vec<u32>,
}

/// One tensor as saved.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// Its global shape.
    pub shape: Vec<usize>,
    /// Its element type (loads must ask for the same one).
    pub dtype: DType,
    /// The mesh it lived on when saved: `(axis name, size)` in layout order.
    pub mesh: Vec<(String, usize)>,
    /// Its placement on each of those axes.
    pub placements: Vec<Placement>,
    /// One entry per stored shard: only one replica (coordinate 0 of every `Replicate` or
    /// `Invariant` axis) is stored, so the shards tile the tensor exactly once.
    pub shards: Vec<ShardEntry>,
}

/// The whole index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Index {
    /// The format version it was written in ([`VERSION`] for this build).
    pub version: u64,
    /// Increases with every save into the same directory; data files carry it in their
    /// names, so a new save never overwrites a file the previous index references.
    pub generation: u64,
    /// The number of ranks that saved it (one data file each).
    pub world_size: usize,
    /// The checksum block size in bytes ([`SaveOptions::block_bytes`](crate::SaveOptions)).
    pub block_bytes: usize,
    /// The data files, one per rank.
    pub files: Vec<FileEntry>,
    /// The tensors by name.
    pub tensors: BTreeMap<String, TensorEntry>,
    /// Caller's metadata (step, data position, RNG state, optimizer scalars).
    pub extra: BTreeMap<String, String>,
}

pub(crate) fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::I32 => "I32",
        DType::I64 => "I64",
    }
}

pub(crate) fn parse_dtype(s: &str) -> Option<DType> {
    Some(match s {
        "F32" => DType::F32,
        "F64" => DType::F64,
        "BF16" => DType::BF16,
        "F16" => DType::F16,
        "I32" => DType::I32,
        "I64" => DType::I64,
        _ => return None,
    })
}

pub(crate) fn parse_placement(s: &str) -> Option<Placement> {
    match s {
        "R" => Some(Placement::Replicate),
        "I" => Some(Placement::Invariant),
        _ => {
            let d = s.strip_prefix("S(")?.strip_suffix(')')?;
            Some(Placement::Shard(d.parse().ok()?))
        }
    }
}

impl ShardEntry {
    pub(crate) fn to_json(&self) -> Value {
        json!({
            "file": self.file,
            "key": self.key,
            "offset": self.offset,
            "shape": self.shape,
            "data_offsets": [self.data_offsets.0, self.data_offsets.1],
            "crc32": self.crc32,
        })
    }
}

impl TensorEntry {
    pub(crate) fn to_json(&self) -> Value {
        json!({
            "shape": self.shape,
            "dtype": dtype_name(self.dtype),
            "mesh": self.mesh.iter().map(|(n, s)| json!([n, s])).collect::<Vec<_>>(),
            "placements": self.placements.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
            "shards": self.shards.iter().map(|s| s.to_json()).collect::<Vec<_>>(),
        })
    }
}

impl FileEntry {
    pub(crate) fn to_json(&self) -> Value {
        json!({ "name": self.name, "rank": self.rank, "bytes": self.bytes, "crc32": self.crc32 })
    }
}

/// Reads fields of a JSON value, with errors naming the file and the path of the field.
pub(crate) struct Reader<'a> {
    pub file: &'a Path,
}

impl Reader<'_> {
    fn err(&self, what: &str) -> Error {
        Error::Format {
            file: self.file.to_path_buf(),
            detail: what.to_string(),
        }
    }
    fn obj<'v>(&self, v: &'v Value, at: &str) -> Result<&'v Map<String, Value>, Error> {
        v.as_object()
            .ok_or_else(|| self.err(&format!("{at}: expected an object")))
    }
    fn field<'v>(&self, o: &'v Map<String, Value>, k: &str, at: &str) -> Result<&'v Value, Error> {
        o.get(k)
            .ok_or_else(|| self.err(&format!("{at}: missing field `{k}`")))
    }
    fn u64(&self, v: &Value, at: &str) -> Result<u64, Error> {
        v.as_u64()
            .ok_or_else(|| self.err(&format!("{at}: expected an unsigned integer")))
    }
    fn usize(&self, v: &Value, at: &str) -> Result<usize, Error> {
        usize::try_from(self.u64(v, at)?).map_err(|_| self.err(&format!("{at}: too large")))
    }
    fn u32(&self, v: &Value, at: &str) -> Result<u32, Error> {
        u32::try_from(self.u64(v, at)?).map_err(|_| self.err(&format!("{at}: not a CRC-32")))
    }
    fn str<'v>(&self, v: &'v Value, at: &str) -> Result<&'v str, Error> {
        v.as_str()
            .ok_or_else(|| self.err(&format!("{at}: expected a string")))
    }
    fn arr<'v>(&self, v: &'v Value, at: &str) -> Result<&'v Vec<Value>, Error> {
        v.as_array()
            .ok_or_else(|| self.err(&format!("{at}: expected an array")))
    }
    fn usizes(&self, v: &Value, at: &str) -> Result<Vec<usize>, Error> {
        self.arr(v, at)?.iter().map(|x| self.usize(x, at)).collect()
    }

    pub(crate) fn shard(&self, v: &Value, at: &str) -> Result<ShardEntry, Error> {
        let o = self.obj(v, at)?;
        let offs = self.arr(self.field(o, "data_offsets", at)?, at)?;
        if offs.len() != 2 {
            return Err(self.err(&format!("{at}: data_offsets must have 2 entries")));
        }
        Ok(ShardEntry {
            file: self.str(self.field(o, "file", at)?, at)?.to_string(),
            key: self.str(self.field(o, "key", at)?, at)?.to_string(),
            offset: self.usizes(self.field(o, "offset", at)?, at)?,
            shape: self.usizes(self.field(o, "shape", at)?, at)?,
            data_offsets: (self.u64(&offs[0], at)?, self.u64(&offs[1], at)?),
            crc32: self
                .arr(self.field(o, "crc32", at)?, at)?
                .iter()
                .map(|x| self.u32(x, at))
                .collect::<Result<_, _>>()?,
        })
    }

    pub(crate) fn tensor(&self, v: &Value, at: &str) -> Result<TensorEntry, Error> {
        let o = self.obj(v, at)?;
        let dtype = self.str(self.field(o, "dtype", at)?, at)?;
        let dtype = parse_dtype(dtype)
            .ok_or_else(|| self.err(&format!("{at}: unknown dtype `{dtype}`")))?;
        let mesh = self
            .arr(self.field(o, "mesh", at)?, at)?
            .iter()
            .map(|a| {
                let a = self.arr(a, at)?;
                match a.as_slice() {
                    [n, s] => Ok((self.str(n, at)?.to_string(), self.usize(s, at)?)),
                    _ => Err(self.err(&format!("{at}: mesh axes are [name, size]"))),
                }
            })
            .collect::<Result<_, _>>()?;
        let placements = self
            .arr(self.field(o, "placements", at)?, at)?
            .iter()
            .map(|p| {
                let s = self.str(p, at)?;
                parse_placement(s)
                    .ok_or_else(|| self.err(&format!("{at}: unknown placement `{s}`")))
            })
            .collect::<Result<_, _>>()?;
        let shards = self
            .arr(self.field(o, "shards", at)?, at)?
            .iter()
            .enumerate()
            .map(|(i, s)| self.shard(s, &format!("{at}.shards[{i}]")))
            .collect::<Result<_, _>>()?;
        Ok(TensorEntry {
            shape: self.usizes(self.field(o, "shape", at)?, at)?,
            dtype,
            mesh,
            placements,
            shards,
        })
    }

    pub(crate) fn file_entry(&self, v: &Value, at: &str) -> Result<FileEntry, Error> {
        let o = self.obj(v, at)?;
        Ok(FileEntry {
            name: self.str(self.field(o, "name", at)?, at)?.to_string(),
            rank: self.usize(self.field(o, "rank", at)?, at)?,
            bytes: self.u64(self.field(o, "bytes", at)?, at)?,
            crc32: self.u32(self.field(o, "crc32", at)?, at)?,
        })
    }
}

impl Index {
    /// The index as JSON text, with `index_crc32`: the CRC-32 of the compact serialization
    /// of every other field (serde_json orders keys, so the text is canonical).
    pub fn to_json_text(&self) -> String {
        let mut v = json!({
            "format": FORMAT,
            "version": self.version,
            "generation": self.generation,
            "world_size": self.world_size,
            "block_bytes": self.block_bytes,
            "files": self.files.iter().map(|f| f.to_json()).collect::<Vec<_>>(),
            "tensors": self.tensors.iter().map(|(k, t)| (k.clone(), t.to_json())).collect::<Map<_, _>>(),
            "extra": self.extra.iter().map(|(k, x)| (k.clone(), Value::String(x.clone()))).collect::<Map<_, _>>(),
        });
        let crc = crc32(&serde_json::to_vec(&v).expect("JSON values serialize"));
        v.as_object_mut()
            .expect("an object")
            .insert("index_crc32".into(), json!(crc));
        serde_json::to_string_pretty(&v).expect("JSON values serialize")
    }

    /// Parses and checks an index read from `file`: format name, version (checked first,
    /// so another version's index is named as such), own checksum, then every field.
    pub fn parse(text: &[u8], file: &Path) -> Result<Index, Error> {
        let r = Reader { file };
        let mut v: Value = serde_json::from_slice(text).map_err(|e| Error::Format {
            file: file.to_path_buf(),
            detail: format!("not valid JSON: {e}"),
        })?;
        let o = r.obj(&v, "index")?;
        match o.get("format").and_then(|f| f.as_str()) {
            Some(FORMAT) => {}
            other => return Err(r.err(&format!("not a {FORMAT} index (format field {other:?})"))),
        }
        let version = r.u64(r.field(o, "version", "index")?, "index.version")?;
        if version != VERSION {
            return Err(Error::Version {
                file: file.to_path_buf(),
                found: version,
                expected: VERSION,
            });
        }
        let stored = o
            .get("index_crc32")
            .and_then(|c| c.as_u64())
            .ok_or_else(|| r.err("index: missing field `index_crc32`"))?;
        v.as_object_mut().expect("checked").remove("index_crc32");
        let crc = crc32(&serde_json::to_vec(&v).expect("JSON values serialize"));
        if u64::from(crc) != stored {
            return Err(Error::Checksum {
                file: file.to_path_buf(),
                tensor: None,
                detail: format!("index checksum {crc:#010x}, recorded {stored:#010x}"),
            });
        }
        let o = r.obj(&v, "index")?;
        let block_bytes = r.usize(r.field(o, "block_bytes", "index")?, "index.block_bytes")?;
        if block_bytes == 0 {
            return Err(r.err("index.block_bytes is 0"));
        }
        let files = r
            .arr(r.field(o, "files", "index")?, "index.files")?
            .iter()
            .enumerate()
            .map(|(i, f)| r.file_entry(f, &format!("index.files[{i}]")))
            .collect::<Result<_, _>>()?;
        let tensors = r
            .obj(r.field(o, "tensors", "index")?, "index.tensors")?
            .iter()
            .map(|(k, t)| Ok((k.clone(), r.tensor(t, &format!("tensor {k}"))?)))
            .collect::<Result<_, Error>>()?;
        let extra = r
            .obj(r.field(o, "extra", "index")?, "index.extra")?
            .iter()
            .map(|(k, x)| Ok((k.clone(), r.str(x, "index.extra")?.to_string())))
            .collect::<Result<_, Error>>()?;
        Ok(Index {
            version,
            generation: r.u64(r.field(o, "generation", "index")?, "index.generation")?,
            world_size: r.usize(r.field(o, "world_size", "index")?, "index.world_size")?,
            block_bytes,
            files,
            tensors,
            extra,
        })
    }
}
