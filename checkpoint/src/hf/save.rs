//! Saving a model on any mesh as a Hugging Face checkpoint.
//!
//! Parameter by parameter, the ranks holding it gather it whole (a collective over the
//! parameter's mesh: a pipeline stage's, or the model's), the root of that mesh (its
//! coordinates all zero) cuts it into its Hugging Face tensors ([`NameMap`]: the fused
//! QKV's rows back into `q_proj`, `k_proj`, `v_proj`; an expert stack into one tensor per
//! expert) and world rank 0 writes them ([`HfWriter`]: sharded safetensors, their index,
//! the source's `config.json` verbatim). Under a pipeline the other stages' roots send
//! their tensors to rank 0 as they go, so no rank holds more than one parameter whole and
//! one shard being written.

use super::model::HfModel;
use super::names::{NameMap, Source};
use super::writer::{HfSaved, HfWriter};
use crate::{agree, Error, Result};
use dtensor_collectives::{Communicator, Element};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::{DataMode, Module, ParamKind, ParamVisitor, Weight};
use std::path::Path;
use std::sync::Arc;

/// How [`save_params`] writes.
#[derive(Clone, Debug)]
pub struct HfSaveOptions {
    /// The stored dtype (`None`: the one the source `config.json` declares, else f32).
    pub dtype: Option<DType>,
    /// Shards of at most this many bytes of tensor data (transformers' default is 5 GB
    /// for `save_pretrained`'s `max_shard_size`; `usize::MAX` writes one
    /// `model.safetensors`).
    pub max_shard_bytes: usize,
}

impl Default for HfSaveOptions {
    /// The config's dtype, 5 GB shards.
    fn default() -> Self {
        HfSaveOptions {
            dtype: None,
            max_shard_bytes: 5_000_000_000,
        }
    }
}

/// The Hugging Face tensors of our parameter `name`, from its whole value `full`, each in
/// `dtype`, in the order of their first rows.
fn hf_tensors(
    map: &NameMap,
    name: &str,
    full: &Tensor,
    dtype: DType,
) -> Result<Vec<(String, Tensor)>> {
    let segments = map.segments(name).ok_or_else(|| Error::Refused {
        tensor: name.to_string(),
        detail: "a parameter with no Hugging Face tensor behind it".into(),
    })?;
    let mut order: Vec<&str> = Vec::new();
    for s in segments {
        if !order.contains(&s.tensor.as_str()) {
            order.push(&s.tensor);
        }
    }
    let mut out = Vec::with_capacity(order.len());
    for tensor in order {
        let mut parts: Vec<_> = segments.iter().filter(|s| s.tensor == tensor).collect();
        parts.sort_by_key(|s| match s.source {
            Source::Rows { start } => start,
            Source::Stacked => 0,
        });
        let pieces = parts
            .iter()
            .map(|s| full.narrow(0, s.rows.start, s.rows.len()))
            .collect::<dtensor_kernels::Result<Vec<_>>>()?;
        let whole = match (parts[0].source, pieces.len()) {
            (Source::Stacked, _) => {
                let p = pieces.into_iter().next().expect("one expert");
                let shape = p.shape()[1..].to_vec();
                p.reshape(&shape)?
            }
            (_, 1) => pieces.into_iter().next().expect("one piece"),
            _ => Tensor::cat(&pieces, 0)?,
        };
        out.push((tensor.to_string(), whole.try_to_dtype(dtype)?));
    }
    Ok(out)
}

/// Point-to-point tag of the tensors a stage root sends rank 0.
const TAG: u32 = 0x4846; // "HF"

fn dtype_code(d: DType) -> i64 {
    match d {
        DType::F32 => 0,
        DType::F64 => 1,
        DType::BF16 => 2,
        DType::F16 => 3,
        _ => -1,
    }
}

fn code_dtype(c: i64) -> Option<DType> {
    [DType::F32, DType::F64, DType::BF16, DType::F16]
        .get(usize::try_from(c).ok()?)
        .copied()
}

/// Sends `(name, t)` to `dst`: a header `[name bytes, ndim, shape…, dtype]`, the name's
/// bytes (one per word), the data.
fn send_tensor(world: &dyn Communicator, dst: usize, name: &str, t: &Tensor) -> Result<()> {
    let mut header = vec![name.len() as i64, t.shape().len() as i64];
    header.extend(t.shape().iter().map(|&n| n as i64));
    header.push(dtype_code(t.dtype()));
    world.send(i64::slice(&[header.len() as i64]), dst, TAG)?;
    world.send(i64::slice(&header), dst, TAG)?;
    let bytes: Vec<i64> = name.bytes().map(i64::from).collect();
    world.send(i64::slice(&bytes), dst, TAG)?;
    dtensor_core::transfer::send(world, t, dst, TAG)?;
    Ok(())
}

/// The next tensor `src` sends; `None` when it sends the empty header instead: it failed
/// and sends no more (its error reaches every rank through the closing agreement).
fn recv_tensor(world: &dyn Communicator, src: usize) -> Result<Option<(String, Tensor)>> {
    let mut len = [0i64];
    world.recv(i64::slice_mut(&mut len), src, TAG)?;
    if len[0] == 0 {
        return Ok(None);
    }
    let mut header = vec![0i64; len[0] as usize];
    world.recv(i64::slice_mut(&mut header), src, TAG)?;
    let bad = || Error::Refused {
        tensor: "(from another pipeline stage)".into(),
        detail: format!("malformed tensor header {header:?} from rank {src}"),
    };
    let (name_len, ndim) = (header[0] as usize, header[1] as usize);
    if header.len() != ndim + 3 {
        return Err(bad());
    }
    let shape: Vec<usize> = header[2..2 + ndim].iter().map(|&n| n as usize).collect();
    let dtype = code_dtype(header[2 + ndim]).ok_or_else(bad)?;
    let mut name = vec![0i64; name_len];
    world.recv(i64::slice_mut(&mut name), src, TAG)?;
    let name: String = name.iter().map(|&b| b as u8 as char).collect();
    let mut t = Tensor::zeros(&shape, dtype);
    dtensor_core::transfer::recv(world, &mut t, src, TAG)?;
    Ok(Some((name, t)))
}

/// Collective over `world` (every rank of the model, the root world of a pipeline):
/// writes `m`'s parameters into `dir` as a Hugging Face checkpoint of `source`'s
/// architecture (its `config.json`, `generation_config.json` and tokenizer files copied
/// verbatim), whatever mesh and data mode `m` runs on. A model loaded from `source` and
/// saved untrained gives back bitwise the tensors it was loaded from (in their stored
/// dtype). Every rank returns what rank 0 wrote, or every rank an `Err`.
pub fn save_params(
    world: &Arc<dyn Communicator>,
    m: &mut impl Module,
    source: &HfModel,
    dir: &Path,
    opts: &HfSaveOptions,
) -> Result<HfSaved> {
    let dtype = opts
        .dtype
        .or(source.config.stored_dtype)
        .unwrap_or(DType::F32);
    let me = world.rank();

    // Which ranks are the roots of the meshes holding parameters (the pipeline stages'),
    // and how many tensors each sends.
    struct Plan<'a> {
        map: &'a NameMap,
        root: bool,
        tensors: usize,
    }
    impl ParamVisitor for Plan<'_> {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            name: &str,
            w: &mut Weight<D, K>,
        ) -> dtensor_core::Result<()> {
            self.root = w.value().device_mesh().coords().iter().all(|&c| c == 0);
            let mut seen: Vec<&str> = Vec::new();
            for s in self.map.segments(name).unwrap_or_default() {
                if !seen.contains(&s.tensor.as_str()) {
                    seen.push(&s.tensor);
                }
            }
            self.tensors += seen.len();
            Ok(())
        }
    }
    let mut plan = Plan {
        map: &source.names,
        root: false,
        tensors: 0,
    };
    m.visit_params("", &mut plan)?;
    let sends = if plan.root && me != 0 {
        plan.tensors
    } else {
        0
    };
    let counts = crate::all_gather_bytes(world, &(sends as u64).to_le_bytes())?;
    let counts: Vec<usize> = counts
        .iter()
        .map(|b| {
            b.get(..8).map_or(0, |b| {
                u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize
            })
        })
        .collect();

    let mut writer = if me == 0 {
        let mut w = HfWriter::create(dir, opts.max_shard_bytes)?;
        w.copy_files_from(&source.dir)?;
        Some(w)
    } else {
        None
    };

    struct Write<'a> {
        world: &'a Arc<dyn Communicator>,
        map: &'a NameMap,
        dtype: DType,
        writer: Option<&'a mut HfWriter>,
        sent: usize,
        failed: Option<Error>,
    }
    impl ParamVisitor for Write<'_> {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            name: &str,
            w: &mut Weight<D, K>,
        ) -> dtensor_core::Result<()> {
            // Every rank of the parameter's mesh takes part in the gather, even after an
            // error of its own, so its peers do not wait for it.
            let full = w.value().full_tensor()?.to_host()?;
            if self.failed.is_some() || !w.value().device_mesh().coords().iter().all(|&c| c == 0) {
                return Ok(());
            }
            let result = hf_tensors(self.map, name, &full, self.dtype)
                .map_err(|e| match e {
                    Error::Refused { .. } => e,
                    other => Error::Refused {
                        tensor: name.to_string(),
                        detail: format!(
                            "cutting it into its Hugging Face tensors (is the source model the \
                             one it was built from?): {other}"
                        ),
                    },
                })
                .and_then(|tensors| {
                    for (n, t) in tensors {
                        match self.writer.as_deref_mut() {
                            Some(w) => w.add(&n, &t)?,
                            None => {
                                send_tensor(&**self.world, 0, &n, &t)?;
                                self.sent += 1;
                            }
                        }
                    }
                    Ok(())
                });
            if let Err(e) = result {
                self.failed = Some(e);
            }
            Ok(())
        }
    }
    let mut write = Write {
        world,
        map: &source.names,
        dtype,
        writer: writer.as_mut(),
        sent: 0,
        failed: None,
    };
    m.visit_params("", &mut write)?;
    let sent = write.sent;
    let mut local = match write.failed {
        Some(e) => Err(e),
        None => Ok(()),
    };
    if local.is_err() && sent < sends {
        // Rank 0 waits for `sends` tensors: tell it none more are coming.
        let _ = world.send(i64::slice(&[0]), 0, TAG);
    }
    if let Some(w) = writer.as_mut() {
        for (src, &n) in counts.iter().enumerate() {
            for _ in 0..n {
                match recv_tensor(&**world, src) {
                    // After an error of its own, rank 0 still drains what the stages send,
                    // so none is left waiting.
                    Ok(Some((name, t))) if local.is_ok() => local = w.add(&name, &t),
                    Ok(Some(_)) => {}
                    // The stage failed; its error comes through the agreement below.
                    Ok(None) => break,
                    Err(e) => {
                        if local.is_ok() {
                            local = Err(e);
                        }
                        break;
                    }
                }
            }
        }
    }
    let saved = match (local, writer) {
        (Ok(()), Some(w)) => w.finish().map(Some),
        (Ok(()), None) => Ok(None),
        (Err(e), _) => Err(e),
    };
    let saved = agree(world, "hf save", saved)?;
    // Every rank returns rank 0's report: broadcast its bytes.
    let text = saved
        .map(|s| {
            let files: Vec<String> = s.files.iter().map(|f| f.display().to_string()).collect();
            format!("{}\n{}\n{}", s.total_size, s.tensors, files.join("\n"))
        })
        .unwrap_or_default();
    let all = crate::all_gather_bytes(world, text.as_bytes())?;
    let text = String::from_utf8_lossy(&all[0]).into_owned();
    let mut lines = text.lines();
    let total_size = lines.next().and_then(|l| l.parse().ok()).unwrap_or(0);
    let tensors = lines.next().and_then(|l| l.parse().ok()).unwrap_or(0);
    Ok(HfSaved {
        files: lines.map(std::path::PathBuf::from).collect(),
        total_size,
        tensors,
    })
}
