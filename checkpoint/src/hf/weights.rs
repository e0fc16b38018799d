//! A Hugging Face model directory's weights: `model.safetensors`, or the shards a
//! `model.safetensors.index.json` lists, memory-mapped and read block by block.
//!
//! [`HfWeights::open`] maps every file and checks its header (every tensor's byte range
//! lies inside the file, so a truncated file is refused by name before anything is read);
//! nothing else is read. [`HfWeights::read`] copies one block of one tensor (a range per
//! dim, the rank's own slice) out of the map, converting it to the dtype asked for: the
//! operating system pages in only the bytes of that block (a slice along dim 0 is one
//! contiguous range; a column slice is one run per row), so no rank holds the whole model.

use crate::{io_err, st_dtype, tensor_from_bytes, Error, Result};
use dtensor_kernels::{DType, Tensor};
use memmap2::Mmap;
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

/// The single-file weights of a model directory.
pub const SINGLE_FILE: &str = "model.safetensors";
/// The index of a sharded model's weights.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// One tensor of the checkpoint, as its file's header describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightInfo {
    /// The stored element type.
    pub dtype: DType,
    /// The stored shape.
    pub shape: Vec<usize>,
    /// The file that holds it.
    pub file: PathBuf,
}

struct Mapped {
    path: PathBuf,
    map: Mmap,
}

/// The memory-mapped weight files of one model directory.
pub struct HfWeights {
    /// The index, or the single file: what names the checkpoint as a whole.
    source: PathBuf,
    files: Vec<Mapped>,
    /// Each tensor's file (an index into `files`), header entry, and byte range in the
    /// file (checked to lie inside it when opened).
    tensors: BTreeMap<String, (usize, WeightInfo, Range<usize>)>,
}

impl std::fmt::Debug for HfWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HfWeights")
            .field(
                "files",
                &self.files.iter().map(|m| &m.path).collect::<Vec<_>>(),
            )
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

fn format_err(file: &Path, detail: impl std::fmt::Display) -> Error {
    Error::Format {
        file: file.to_path_buf(),
        detail: detail.to_string(),
    }
}

fn tensor_err(file: &Path, tensor: &str, detail: impl std::fmt::Display) -> Error {
    Error::Tensor {
        file: file.to_path_buf(),
        tensor: tensor.to_string(),
        detail: detail.to_string(),
    }
}

/// The training dtypes a stored dtype converts from.
fn our_dtype(d: Dtype) -> Option<DType> {
    [DType::F32, DType::F64, DType::BF16, DType::F16]
        .into_iter()
        .find(|&t| st_dtype(t) == d)
}

impl HfWeights {
    /// Maps the weights of `dir`: the files `model.safetensors.index.json` lists, or else
    /// `model.safetensors`. `Err` naming the file when one is missing, unreadable,
    /// truncated or not safetensors, when the index names a tensor its file does not hold,
    /// or when a tensor's dtype is not a float type dtensor trains in.
    pub fn open(dir: &Path) -> Result<HfWeights> {
        let index = dir.join(INDEX_FILE);
        let source = if index.exists() {
            index.clone()
        } else {
            dir.join(SINGLE_FILE)
        };
        let (names, wanted): (Vec<PathBuf>, Option<BTreeMap<String, usize>>) = if index.exists() {
            let text = std::fs::read_to_string(&index).map_err(|e| io_err(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| format_err(&index, format!("not JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| format_err(&index, "no \"weight_map\" object"))?;
            let mut files: Vec<PathBuf> = Vec::new();
            let mut wanted = BTreeMap::new();
            for (tensor, file) in map {
                let name = file.as_str().ok_or_else(|| {
                    format_err(&index, format!("weight_map[{tensor}] is not a file name"))
                })?;
                if name.contains('/') || name.contains("..") {
                    return Err(format_err(
                        &index,
                        format!("weight_map[{tensor}] = {name:?} is not a file of this directory"),
                    ));
                }
                let path = dir.join(name);
                let i = match files.iter().position(|f| *f == path) {
                    Some(i) => i,
                    None => {
                        files.push(path);
                        files.len() - 1
                    }
                };
                wanted.insert(tensor.clone(), i);
            }
            (files, Some(wanted))
        } else {
            (vec![dir.join(SINGLE_FILE)], None)
        };
        let mut files = Vec::with_capacity(names.len());
        let mut tensors = BTreeMap::new();
        for (i, path) in names.into_iter().enumerate() {
            let file = File::open(&path).map_err(|e| io_err(&path, format!("open: {e}")))?;
            // SAFETY: the map is read-only and lives as long as `HfWeights`. The one
            // condition Rust cannot check is that nobody truncates or rewrites the file
            // while it is mapped (the pages would change under a `&[u8]`); a checkpoint is
            // not modified while it is being loaded, which the docs state.
            let map =
                unsafe { Mmap::map(&file) }.map_err(|e| io_err(&path, format!("map: {e}")))?;
            // Checks the header and that every tensor's bytes lie inside the file.
            let st = SafeTensors::deserialize(&map)
                .map_err(|e| format_err(&path, format!("not a complete safetensors file: {e}")))?;
            for (name, view) in st.tensors() {
                let dtype = our_dtype(view.dtype()).ok_or_else(|| {
                    tensor_err(
                        &path,
                        &name,
                        format!(
                            "stored as {:?}: dtensor loads F32, F64, BF16 and F16 weights",
                            view.dtype()
                        ),
                    )
                })?;
                if let Some(w) = &wanted {
                    if w.get(&name) != Some(&i) {
                        // A tensor the index puts elsewhere (or nowhere) is not read from here.
                        continue;
                    }
                }
                let info = WeightInfo {
                    dtype,
                    shape: view.shape().to_vec(),
                    file: path.clone(),
                };
                // Where the view's bytes sit in the map (the header parse checked them).
                let start = view.data().as_ptr() as usize - map.as_ptr() as usize;
                let bytes = start..start + view.data().len();
                tensors.insert(name, (i, info, bytes));
            }
            drop(st);
            files.push(Mapped { path, map });
        }
        if let Some(w) = wanted {
            for (name, &i) in &w {
                if !tensors.contains_key(name) {
                    return Err(tensor_err(
                        &files[i].path,
                        name,
                        format!("listed in {INDEX_FILE} but not in the file"),
                    ));
                }
            }
        }
        Ok(HfWeights {
            source,
            files,
            tensors,
        })
    }

    /// Every tensor's name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// The header entry of `name`, or `None` when no file holds it.
    pub fn info(&self, name: &str) -> Option<&WeightInfo> {
        self.tensors.get(name).map(|(_, info, _)| info)
    }

    /// The index when the weights are sharded, else the single file: the file errors
    /// about the checkpoint as a whole (a missing tensor) name.
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// The stored little-endian bytes of tensor `name`, as its file holds them (no
    /// conversion): what a save copies to write the tensor back unchanged. `Err` naming
    /// the tensor when no file holds it.
    pub fn stored_bytes(&self, name: &str) -> Result<&[u8]> {
        let (i, _, bytes) = self
            .tensors
            .get(name)
            .ok_or_else(|| tensor_err(&self.source, name, "not in the checkpoint"))?;
        Ok(&self.files[*i].map[bytes.clone()])
    }

    /// The files mapped, in the order the index lists them.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|f| f.path.as_path())
    }

    /// Block `ranges` (one range per dim) of tensor `name`, converted to `dtype`. `Err`
    /// naming the tensor and its file when it is missing, when `ranges` does not fit its
    /// shape, or when its bytes cannot be read.
    pub fn read(&self, name: &str, ranges: &[Range<usize>], dtype: DType) -> Result<Tensor> {
        let (i, info, bytes) = self
            .tensors
            .get(name)
            .ok_or_else(|| tensor_err(&self.source, name, "not in the checkpoint"))?;
        let file = &self.files[*i];
        let shape = &info.shape;
        if ranges.len() != shape.len()
            || ranges
                .iter()
                .zip(shape)
                .any(|(r, &n)| r.start > r.end || r.end > n)
        {
            return Err(tensor_err(
                &file.path,
                name,
                format!("block {ranges:?} does not fit the stored shape {shape:?}"),
            ));
        }
        let bytes = copy_block(
            &file.map[bytes.clone()],
            shape,
            ranges,
            info.dtype.size_in_bytes(),
        );
        let block: Vec<usize> = ranges.iter().map(|r| r.len()).collect();
        let t = tensor_from_bytes(&bytes, &block, info.dtype)
            .map_err(|e| tensor_err(&file.path, name, e))?;
        Ok(if info.dtype == dtype {
            t
        } else {
            t.to_dtype(dtype)
        })
    }
}

/// The bytes of block `ranges` of a row-major tensor of `shape` stored in `data`: one copy
/// per contiguous run (the trailing dims a block covers whole are one run with the dim
/// before them).
fn copy_block(data: &[u8], shape: &[usize], ranges: &[Range<usize>], elem: usize) -> Vec<u8> {
    let n = shape.len();
    let total: usize = ranges.iter().map(|r| r.len()).product::<usize>() * elem;
    let mut out = Vec::with_capacity(total);
    if total == 0 {
        return out;
    }
    if n == 0 {
        out.extend_from_slice(&data[..elem]);
        return out;
    }
    // `inner`: the first dim from which the block covers every later dim whole.
    let mut inner = n - 1;
    while inner > 0
        && ranges[inner..]
            .iter()
            .zip(&shape[inner..])
            .all(|(r, &s)| r.len() == s)
    {
        inner -= 1;
    }
    let stride = |d: usize| shape[d + 1..].iter().product::<usize>() * elem;
    let run = ranges[inner].len() * stride(inner);
    // Walk the outer dims' indices like an odometer.
    let mut idx: Vec<usize> = ranges[..inner].iter().map(|r| r.start).collect();
    loop {
        let start: usize = idx
            .iter()
            .enumerate()
            .map(|(d, &i)| i * stride(d))
            .sum::<usize>()
            + ranges[inner].start * stride(inner);
        out.extend_from_slice(&data[start..start + run]);
        let mut d = inner;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < ranges[d].end {
                break;
            }
            idx[d] = ranges[d].start;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::copy_block;

    /// The block, element by element, for comparison.
    fn slow(shape: &[usize], ranges: &[std::ops::Range<usize>]) -> Vec<u8> {
        let strides: Vec<usize> = (0..shape.len())
            .map(|d| shape[d + 1..].iter().product())
            .collect();
        let mut out = Vec::new();
        let count: usize = ranges.iter().map(|r| r.len()).product();
        for k in 0..count {
            let mut rem = k;
            let mut flat = 0;
            for d in (0..shape.len()).rev() {
                let len = ranges[d].len();
                flat += (ranges[d].start + rem % len) * strides[d];
                rem /= len;
            }
            out.push(flat as u8);
        }
        out
    }

    #[test]
    fn blocks_equal_the_element_by_element_copy() {
        let shape = [3, 4, 5];
        let data: Vec<u8> = (0..60).collect();
        for ranges in [
            vec![0..3, 0..4, 0..5],
            vec![1..2, 0..4, 0..5],
            vec![0..3, 1..3, 0..5],
            vec![0..3, 0..4, 2..4],
            vec![2..3, 3..4, 4..5],
            vec![0..3, 0..0, 0..5],
        ] {
            assert_eq!(
                copy_block(&data, &shape, &ranges, 1),
                slow(&shape, &ranges),
                "{ranges:?}"
            );
        }
    }
}
