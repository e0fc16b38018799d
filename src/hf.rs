//! Hugging Face models on thread ranks: what `dtensor hf-parity` runs.
//!
//! [`parity_on_threads`] opens a model directory, builds its decoder on the composition
//! given (one thread per rank), loads the weights into it (each rank its own slices) and
//! measures what transformers prints for the same ids ([`Parity`]).

pub use crate::checkpoint::hf::parity::{LogitStats, Parity};
use crate::checkpoint::hf::{parity, HfModel};
use crate::collectives::{threads, Communicator};
use crate::core::DeviceMesh;
use crate::kernels::DType;
use crate::nn::pipeline::{self, Schedule};
use crate::nn::{ContextParallel, DataMode, Ddp, Fsdp, NoSp, SeqMode, Sp, Zero1, Zero2};
use crate::placement::{AxisKind, Composition, DataKind, MasterDType};
use std::path::Path;
use std::sync::Arc;

/// The token ids of a parity file: `{"input_ids": [[...], ...]}`, samples of one length.
pub fn read_ids(file: &Path) -> Result<Vec<Vec<u32>>, String> {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    #[derive(serde::Deserialize)]
    struct Ids {
        input_ids: Vec<Vec<u32>>,
    }
    let ids: Ids = serde_json::from_str(&text).map_err(|e| {
        format!(
            "{}: expected {{\"input_ids\": [[...], ...]}}: {e}",
            file.display()
        )
    })?;
    Ok(ids.input_ids)
}

/// The parity numbers of the model in `dir` on `ids`, run on `comp` with one thread per
/// rank, in `comp`'s dtype (`f64` in the spec for a tight comparison). Every rank
/// computes the same loss; with `pp > 1` each stage's ranks give their stage's gradient
/// norms (merged here) and there are no logits. `Err` with every failing rank's message.
pub fn parity_on_threads(
    dir: &Path,
    ids: &[Vec<u32>],
    comp: &Composition,
) -> Result<Parity, String> {
    let d = comp.degrees;
    let model = HfModel::open(dir).map_err(|e| e.to_string())?;
    let pp = (d.pp > 1).then_some(AxisKind::Pp);
    let axes: Vec<AxisKind> = pp
        .into_iter()
        .chain([AxisKind::Dp, AxisKind::Ep, AxisKind::Cp, AxisKind::Tp])
        .collect();
    let mesh = d.mesh(&axes).map_err(|e| e.to_string())?;
    let schedule = match d.pp {
        1 => None,
        _ => Some(pipeline::for_composition(comp).map_err(|e| e.to_string())?),
    };
    let job = Job {
        model: &model,
        ids,
        dtype: match comp.dtype {
            MasterDType::F32 => DType::F32,
            MasterDType::F64 => DType::F64,
        },
        context: ContextParallel {
            strategy: comp.cp_strategy,
            zigzag: comp.zigzag,
        },
        schedule,
    };
    let results = threads::launch(mesh.world_size(), |world| {
        let dm = DeviceMesh::new(world.clone(), mesh.clone()).map_err(|e| e.to_string())?;
        if d.sp {
            job.run_modes::<Sp>(comp.data, &world, &dm)
        } else {
            job.run_modes::<NoSp>(comp.data, &world, &dm)
        }
    });
    let mut merged: Option<Parity> = None;
    let mut errors = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match (res, &mut merged) {
            (Ok(p), None) => merged = Some(p),
            (Ok(p), Some(m)) => m.grad_norms.extend(p.grad_norms),
            (Err(e), _) => errors.push(format!("rank {r}: {e}")),
        }
    }
    match (errors.is_empty(), merged) {
        (true, Some(p)) => Ok(p),
        _ => Err(errors.join("\n")),
    }
}

/// One parity run's inputs, shared by the ranks.
struct Job<'a> {
    model: &'a HfModel,
    ids: &'a [Vec<u32>],
    dtype: DType,
    context: ContextParallel,
    schedule: Option<Schedule>,
}

impl Job<'_> {
    fn run_modes<M: SeqMode>(
        &self,
        data: DataKind,
        world: &Arc<dyn Communicator>,
        dm: &Arc<DeviceMesh>,
    ) -> Result<Parity, String> {
        match data {
            DataKind::Ddp => self.run::<M, Ddp>(world, dm),
            DataKind::Zero1 => self.run::<M, Zero1>(world, dm),
            DataKind::Zero2 => self.run::<M, Zero2>(world, dm),
            DataKind::Fsdp => self.run::<M, Fsdp>(world, dm),
        }
    }

    fn run<M: SeqMode, D: DataMode>(
        &self,
        world: &Arc<dyn Communicator>,
        dm: &Arc<DeviceMesh>,
    ) -> Result<Parity, String> {
        parity::run::<M, D>(
            self.model,
            world,
            dm,
            self.ids,
            self.dtype,
            self.context,
            self.schedule.clone(),
        )
        .map_err(|e| e.to_string())
    }
}

/// Generation on thread ranks: the model in `dir` on `comp` (tensor parallelism only: one
/// sample), `prompt` followed by up to `max_new` tokens drawn as `sampling` says (stopping
/// after any of `stop`), with a KV cache; parameters in `comp`'s dtype. Returns the new
/// tokens and the seconds the generation took (prefill included, loading not).
pub fn generate_on_threads(
    dir: &Path,
    prompt: &[u32],
    max_new: usize,
    sampling: &crate::nn::Sampling,
    stop: &[u32],
    comp: &Composition,
) -> Result<(Vec<u32>, f64), String> {
    let d = comp.degrees;
    if d.world_size() != d.tp || d.sp {
        return Err(format!(
            "generation runs one sample: give a mesh of tensor parallelism only, without sp (got {comp})"
        ));
    }
    let model = HfModel::open(dir).map_err(|e| e.to_string())?;
    let mesh = d
        .mesh(&[AxisKind::Dp, AxisKind::Ep, AxisKind::Cp, AxisKind::Tp])
        .map_err(|e| e.to_string())?;
    let dtype = match comp.dtype {
        MasterDType::F32 => DType::F32,
        MasterDType::F64 => DType::F64,
    };
    let config = model
        .gpt_config(prompt.len() + max_new, dtype)
        .map_err(|e| e.to_string())?;
    let results = threads::launch(mesh.world_size(), |world| {
        let run = || -> Result<(Vec<u32>, f64), String> {
            let dm = DeviceMesh::new(world.clone(), mesh.clone()).map_err(|e| e.to_string())?;
            let mut gpt =
                crate::nn::Gpt::<NoSp, Ddp>::new(config, &dm).map_err(|e| e.to_string())?;
            model
                .load_into(&world, &mut gpt)
                .map_err(|e| e.to_string())?;
            let t0 = std::time::Instant::now();
            let tokens = gpt
                .generate(prompt, max_new, sampling, stop)
                .map_err(|e| e.to_string())?;
            Ok((tokens, t0.elapsed().as_secs_f64()))
        };
        run()
    });
    let mut first = None;
    let mut errors = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(v) => {
                if let Some((tokens, _)) = &first {
                    if tokens != &v.0 {
                        errors.push(format!("rank {r} drew other tokens than rank 0"));
                    }
                } else {
                    first = Some(v);
                }
            }
            Err(e) => errors.push(format!("rank {r}: {e}")),
        }
    }
    match (errors.is_empty(), first) {
        (true, Some(v)) => Ok(v),
        _ => Err(errors.join("\n")),
    }
}

/// Converts a dtensor checkpoint of a Hugging Face model (written by `train_gpt
/// --init-from LIKE --save-dir CKPT`, on any mesh) into a Hugging Face model directory
/// `out`, with `like`'s `config.json`, `generation_config.json` and tokenizer files: the
/// decoder `like` describes is built on one rank, the checkpoint's parameters are loaded
/// into it (resharded from whatever mesh wrote them; the optimizer state is not needed)
/// and saved as [`save_params`](crate::checkpoint::hf::save_params) writes. Stored in
/// `like`'s declared dtype.
pub fn export_checkpoint(checkpoint: &Path, like: &Path, out: &Path) -> Result<(), String> {
    let model = HfModel::open(like).map_err(|e| e.to_string())?;
    let index = crate::checkpoint::read_index(checkpoint).map_err(|e| e.to_string())?;
    // The parameters' dtype and the sequence length the model was built for do not change
    // the weights; the dtype is the checkpoint's (a load does not convert).
    let dtype = index
        .tensors
        .get("embedding.weight")
        .map(|t| t.dtype)
        .ok_or_else(|| {
            format!(
                "{}: no embedding.weight: not a checkpoint of a dtensor decoder",
                checkpoint.display()
            )
        })?;
    let config = model.gpt_config(2, dtype).map_err(|e| e.to_string())?;
    let mesh = crate::placement::ParallelConfig::default()
        .mesh(&[AxisKind::Dp, AxisKind::Ep, AxisKind::Cp, AxisKind::Tp])
        .map_err(|e| e.to_string())?;
    let results = threads::launch(1, |world| {
        let run = || -> Result<(), String> {
            let dm = DeviceMesh::new(world.clone(), mesh.clone()).map_err(|e| e.to_string())?;
            let mut gpt =
                crate::nn::Gpt::<NoSp, Ddp>::new(config, &dm).map_err(|e| e.to_string())?;
            let mut opt = crate::nn::AdamW::new(0.0);
            crate::checkpoint::nn::load_model(checkpoint, &world, &mut gpt, &mut opt)
                .map_err(|e| e.to_string())?;
            crate::checkpoint::hf::save_params(
                &world,
                &mut gpt,
                &model,
                out,
                &crate::checkpoint::hf::HfSaveOptions::default(),
            )
            .map_err(|e| e.to_string())?;
            Ok(())
        };
        run()
    });
    results
        .into_iter()
        .next()
        .unwrap_or(Ok(()))
        .map_err(|e| e.to_string())
}
