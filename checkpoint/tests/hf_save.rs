//! A Hugging Face checkpoint loaded into dtensor's decoder on a mesh and saved back
//! untrained gives bitwise the tensors it was loaded from, whatever the mesh (one rank,
//! tp = 2, dp = 2 under FSDP, pp = 2), as one file or in shards, for every architecture
//! (bfloat16 storage, tied embeddings, q/k norms, experts); the copy reads back as a valid
//! checkpoint of the same architecture, with the source's config.json verbatim.

mod common;

use common::TempDir;
use dtensor_checkpoint::hf::{save_params, HfModel, HfSaveOptions, HfWeights};
use dtensor_checkpoint::Error;
use dtensor_collectives::threads;
use dtensor_core::DeviceMesh;
use dtensor_kernels::DType;
use dtensor_nn::pipeline::{one_f_one_b, Pipeline};
use dtensor_nn::{DataMode, Ddp, Fsdp, Gpt, NoSp};
use dtensor_placement::{AxisKind, Mesh};
use std::path::{Path, PathBuf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf")
        .join(name)
}

/// Loads `name` on `(pp, dp, tp)` (`fsdp`: parameters sharded over dp) and saves it into
/// `out` with shards of at most `shard` bytes.
fn round_trip(
    name: &str,
    (pp, dp, tp): (usize, usize, usize),
    fsdp: bool,
    out: &Path,
    shard: usize,
) {
    let source = HfModel::open(&fixture(name)).unwrap();
    let axes: Vec<(AxisKind, usize)> = (pp > 1)
        .then_some((AxisKind::Pp, pp))
        .into_iter()
        .chain([
            (AxisKind::Dp, dp),
            (AxisKind::Ep, 1),
            (AxisKind::Cp, 1),
            (AxisKind::Tp, tp),
        ])
        .collect();
    let mesh = Mesh::new(&axes).unwrap();
    let opts = HfSaveOptions {
        dtype: None,
        max_shard_bytes: shard,
    };
    fn go<D: DataMode>(
        source: &HfModel,
        world: &std::sync::Arc<dyn dtensor_collectives::Communicator>,
        dm: &std::sync::Arc<DeviceMesh>,
        pp: usize,
        out: &Path,
        opts: &HfSaveOptions,
    ) -> Result<(), Error> {
        // f32 masters hold every stored dtype (f32, bf16) exactly.
        let config = source.gpt_config(16, DType::F32)?;
        if pp > 1 {
            let mut p = Pipeline::<NoSp, D>::new(config, one_f_one_b(pp, pp)?, dm)?;
            source.load_into(world, &mut p)?;
            save_params(world, &mut p, source, out, opts)?;
        } else {
            let mut g = Gpt::<NoSp, D>::new(config, dm)?;
            source.load_into(world, &mut g)?;
            save_params(world, &mut g, source, out, opts)?;
        }
        Ok(())
    }
    for r in threads::launch(mesh.world_size(), |world| {
        let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
        match fsdp {
            true => go::<Fsdp>(&source, &world, &dm, pp, out, &opts),
            false => go::<Ddp>(&source, &world, &dm, pp, out, &opts),
        }
    }) {
        r.unwrap();
    }
}

fn assert_same_tensors(a: &Path, b: &Path) {
    let (ca, wa) = HfWeights::open_checked(a).unwrap();
    let (_, wb) = HfWeights::open_checked(b).unwrap();
    let names: Vec<&str> = wa.names().collect();
    assert_eq!(names, wb.names().collect::<Vec<_>>());
    for n in names {
        let (ia, ib) = (wa.info(n).unwrap(), wb.info(n).unwrap());
        assert_eq!((ia.dtype, &ia.shape), (ib.dtype, &ib.shape), "{n}");
        let all: Vec<_> = ia.shape.iter().map(|&d| 0..d).collect();
        assert_eq!(
            wa.read(n, &all, ia.dtype).unwrap(),
            wb.read(n, &all, ib.dtype).unwrap(),
            "{n} differs"
        );
    }
    assert_eq!(
        std::fs::read(a.join("config.json")).unwrap(),
        std::fs::read(b.join("config.json")).unwrap(),
        "config.json verbatim"
    );
    let _ = ca;
}

#[test]
fn load_then_save_is_bitwise_on_every_mesh() {
    for (mesh, fsdp, shard) in [
        ((1, 1, 1), false, usize::MAX),
        ((1, 1, 2), false, 20_000),
        ((1, 2, 1), true, 20_000),
        ((2, 1, 1), false, 20_000),
        ((2, 1, 2), false, usize::MAX),
    ] {
        let out = TempDir::new("hf_save");
        round_trip("llama", mesh, fsdp, out.path(), shard);
        assert_same_tensors(&fixture("llama"), out.path());
        let sharded = out.path().join("model.safetensors.index.json").exists();
        assert_eq!(sharded, shard != usize::MAX, "{mesh:?}: shards");
    }
}

#[test]
fn every_architecture_round_trips_bitwise() {
    for name in [
        "llama32",
        "mistral",
        "qwen2",
        "qwen3",
        "mixtral",
        "qwen3_moe",
    ] {
        for (mesh, shard) in [((1, 1, 1), usize::MAX), ((1, 1, 2), 30_000)] {
            let out = TempDir::new("hf_save_arch");
            round_trip(name, mesh, false, out.path(), shard);
            assert_same_tensors(&fixture(name), out.path());
        }
    }
}

/// A save that fails on both pipeline stages (a Qwen3 model saved as a Llama: other head
/// dims, no q/k norms) fails on every rank, promptly, naming the parameter: the stage that
/// fails before sending all its tensors tells rank 0 so, which stops waiting for them.
#[test]
fn a_failing_stage_fails_every_rank() {
    let qwen3 = HfModel::open(&fixture("qwen3")).unwrap();
    let llama = HfModel::open(&fixture("llama")).unwrap();
    let mesh = Mesh::new(&[
        (AxisKind::Pp, 2),
        (AxisKind::Dp, 1),
        (AxisKind::Ep, 1),
        (AxisKind::Cp, 1),
        (AxisKind::Tp, 1),
    ])
    .unwrap();
    let out = TempDir::new("hf_save_fail");
    let started = std::time::Instant::now();
    let results = threads::launch(2, |world| {
        let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
        let config = qwen3.gpt_config(16, DType::F32)?;
        let mut p = Pipeline::<NoSp, Ddp>::new(config, one_f_one_b(2, 2)?, &dm)?;
        qwen3.load_into(&world, &mut p)?;
        Ok::<_, Error>(
            save_params(
                &world,
                &mut p,
                &llama,
                out.path(),
                &HfSaveOptions::default(),
            )
            .err()
            .map(|e| e.to_string()),
        )
    });
    for (r, res) in results.into_iter().enumerate() {
        let e = res.unwrap().unwrap_or_else(|| panic!("rank {r} saved"));
        // Each stage names one of its own parameters (or the other ranks' failure).
        assert!(
            e.contains("checkpoint save of tensor") || e.contains("other ranks"),
            "rank {r}: {e}"
        );
    }
    assert!(started.elapsed().as_secs() < 30, "{:?}", started.elapsed());
}
