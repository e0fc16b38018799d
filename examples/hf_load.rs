//! Loads a Hugging Face checkpoint into dtensor's decoder on `--mesh` (thread ranks) and
//! prints, per rank, what it cost: the seconds, the elements it read out of the files, and
//! the tensor bytes it held (the model's parameters before, the peak while loading) beside
//! the checkpoint's size. The figures of `docs/models.md`.
//!
//! `cargo run --release --example hf_load -- DIR --mesh tp=4`

use clap::Parser;
use dtensor::checkpoint::hf::HfModel;
use dtensor::collectives::Communicator;
use dtensor::kernels::{memory, DType};
use dtensor::nn::{DataMode, Ddp, Fsdp, Gpt, GptConfig, NoSp};
use dtensor::placement::{AxisKind, Composition, DataKind};
use dtensor::prelude::*;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// The model directory
    dir: PathBuf,
    /// The composition (pp = 1): dp, ep, cp, tp, fsdp, zero1/2
    #[arg(long, default_value = "dp=1")]
    mesh: Composition,
    /// Tokens per sample the model is built for
    #[arg(long, default_value_t = 512)]
    seq: usize,
}

/// Builds the decoder under data mode `D` and loads the checkpoint into it: the tensor
/// bytes held before loading (the peak window starts there), the elements read, seconds.
fn load<D: DataMode>(
    model: &HfModel,
    config: GptConfig,
    world: &Arc<dyn Communicator>,
    dm: &Arc<DeviceMesh>,
) -> Result<(usize, u64, f64), Error> {
    let mut g = Gpt::<NoSp, D>::new(config, dm)?;
    let held = memory::live_bytes();
    memory::reset_peak();
    let t = Instant::now();
    let stats = model
        .load_into(world, &mut g)
        .map_err(|e| Error::InvalidUse {
            op: "hf_load",
            detail: e.to_string(),
        })?;
    Ok((held, stats.elements_read, t.elapsed().as_secs_f64()))
}

fn main() -> Result<(), String> {
    let a = Args::parse();
    let model = HfModel::open(&a.dir).map_err(|e| e.to_string())?;
    let files: u64 = model
        .weights
        .files()
        .map(|f| std::fs::metadata(f).map(|m| m.len()).unwrap_or(0))
        .sum();
    let config = model
        .gpt_config(a.seq, DType::F32)
        .map_err(|e| e.to_string())?;
    let mesh = a
        .mesh
        .degrees
        .mesh(&[AxisKind::Dp, AxisKind::Ep, AxisKind::Cp, AxisKind::Tp])
        .map_err(|e| e.to_string())?;
    println!(
        "{}: {} MB of safetensors in {} files, mesh {}",
        a.dir.display(),
        files / 1_000_000,
        model.weights.files().count(),
        a.mesh
    );
    let results = threads::launch(mesh.world_size(), |world| {
        let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
        let (held, read, secs) = match a.mesh.data {
            DataKind::Fsdp => load::<Fsdp>(&model, config, &world, &dm)?,
            _ => load::<Ddp>(&model, config, &world, &dm)?,
        };
        Ok::<_, Error>((held, memory::peak_bytes(), read, secs))
    });
    for (r, res) in results.into_iter().enumerate() {
        let (held, peak, read, secs) = res.map_err(|e| format!("rank {r}: {e}"))?;
        println!(
            "rank {r}: load {secs:.3} s, read {:.1} M elements, parameters {:.1} MB, peak while loading {:.1} MB ({:.2}× the checkpoint's bytes)",
            read as f64 / 1e6,
            held as f64 / 1e6,
            peak as f64 / 1e6,
            peak as f64 / files as f64
        );
    }
    Ok(())
}
