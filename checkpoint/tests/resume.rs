//! Model and optimizer state: resuming at step k gives bitwise the losses of the
//! uninterrupted run; a checkpoint loads into a model on another mesh or data mode.

mod common;

use common::TempDir;
use dtensor_checkpoint::nn::{load_model, save_model};
use dtensor_collectives::threads;
use dtensor_core::{DTensor, DeviceMesh};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::{
    model_mesh, named_params, AdamW, DataMode, Ddp, Fsdp, Gpt, GptConfig, Ids, MoeConfig, NoSp,
};
use dtensor_placement::{local_ranges, Layout};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

fn config(seed: u64) -> GptConfig {
    let mut c = GptConfig::small(DType::F64);
    c.hidden = 16;
    c.heads = 4;
    c.layers = 1;
    c.ffn = 32;
    c.seq_len = 8;
    c.seed = seed;
    c
}

/// Step `step`'s batch of 4 sequences: a deterministic function of the step.
fn batch(step: usize, dm: &Arc<DeviceMesh>) -> (DTensor<Ids>, DTensor<Ids>) {
    let n = 4 * 8;
    let ids: Vec<i64> = (0..n).map(|i| ((step * 31 + i * 7) % 251) as i64).collect();
    let tg: Vec<i64> = (0..n)
        .map(|i| ((step * 17 + i * 13 + 1) % 251) as i64)
        .collect();
    let local = |v: Vec<i64>| {
        let t = Tensor::from_vec(v, &[n]).unwrap();
        let r = local_ranges(dm.mesh(), &<Ids as Layout>::placements(), dm.coords(), &[n]).unwrap();
        DTensor::<Ids>::from_local(t.narrow(0, r[0].start, r[0].len()).unwrap(), &[n], dm).unwrap()
    };
    (local(ids), local(tg))
}

/// Trains `steps` steps from `from` (loading `resume` first if given, saving to `save`
/// after the last step); returns rank 0's losses and full parameters.
fn run<D: DataMode>(
    mesh: &str,
    from: usize,
    steps: usize,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> (Vec<f64>, Vec<Tensor>) {
    let mesh = model_mesh(&mesh.parse().unwrap()).unwrap();
    let mut out = threads::launch(
        mesh.world_size(),
        |world| -> Result<_, dtensor_checkpoint::Error> {
            let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
            // A resumed model starts from other weights: the load must overwrite them all.
            let mut model =
                Gpt::<NoSp, D>::new(config(if resume.is_some() { 99 } else { 7 }), &dm)?;
            let mut opt = AdamW::new(1e-2);
            if let Some(dir) = resume {
                let extra = load_model(dir, &world, &mut model, &mut opt)?;
                assert_eq!(extra["data.step"], from.to_string());
                assert_eq!(opt.steps(), from as u64);
            }
            let mut losses = Vec::new();
            for step in from..from + steps {
                let (ids, tg) = batch(step, &dm);
                losses.push(model.train_step(&ids, &tg, &mut opt, 1.0)?.loss);
            }
            if let Some(dir) = save {
                let mut extra = BTreeMap::new();
                extra.insert("data.step".to_string(), (from + steps).to_string());
                save_model(dir, &world, &mut model, &opt, &extra)?;
            }
            let full = named_params(&mut model)?;
            Ok((
                losses,
                full.into_iter().map(|p| p.value).collect::<Vec<_>>(),
            ))
        },
    );
    out.swap_remove(0).unwrap()
}

fn bits(v: &[f64]) -> Vec<u64> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn same_params(a: &[Tensor], b: &[Tensor]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| bits(&x.to_f64_vec()) == bits(&y.to_f64_vec()))
}

fn resume_bitwise<D: DataMode>(mesh: &str) {
    let dir = TempDir::new("resume");
    let (all, _) = run::<D>(mesh, 0, 6, None, None);
    let (first, _) = run::<D>(mesh, 0, 3, None, Some(dir.path()));
    let (rest, _) = run::<D>(mesh, 3, 3, Some(dir.path()), None);
    assert_eq!(bits(&all[..3]), bits(&first));
    assert_eq!(
        bits(&all[3..]),
        bits(&rest),
        "{all:?} vs {first:?} + {rest:?}"
    );
}

#[test]
fn resume_is_bitwise_ddp_dp2_tp2() {
    resume_bitwise::<Ddp>("dp=2,tp=2");
}

#[test]
fn resume_is_bitwise_fsdp_dp2_tp2() {
    resume_bitwise::<Fsdp>("dp=2,tp=2");
}

/// Saved from FSDP at dp=2,tp=2, loaded into DDP at tp=4 and at dp=1 and into FSDP at
/// dp=4: the same parameters, bitwise; and training continues there.
#[test]
fn model_loads_on_other_meshes_and_modes() {
    let dir = TempDir::new("model");
    let (_, saved) = run::<Fsdp>("dp=2,tp=2", 0, 2, None, Some(dir.path()));
    for (mesh, fsdp) in [("tp=4", false), ("dp=1", false), ("dp=4", true)] {
        let (losses, got) = if fsdp {
            run::<Fsdp>(mesh, 2, 0, Some(dir.path()), None)
        } else {
            run::<Ddp>(mesh, 2, 1, Some(dir.path()), None)
        };
        if fsdp {
            assert!(same_params(&saved, &got), "{mesh}");
        } else {
            assert!(losses[0].is_finite());
        }
        let (_, reloaded) = run::<Ddp>(mesh, 2, 0, Some(dir.path()), None);
        assert!(same_params(&saved, &reloaded), "{mesh}");
    }
}

/// MoE blocks with an expert selection bias (layer state, not a parameter): `steps` steps
/// from `from` on ep=2,dp=2 (loading `resume` first, saving to `save` after); rank 0's
/// losses and every block's bias.
fn run_moe(
    from: usize,
    steps: usize,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let mesh = model_mesh(&"ep=2,dp=2".parse().unwrap()).unwrap();
    let mut out = threads::launch(
        mesh.world_size(),
        |world| -> Result<_, dtensor_checkpoint::Error> {
            let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
            let c = GptConfig {
                layers: 2,
                moe: Some(MoeConfig {
                    bias_rate: Some(5e-2),
                    ..MoeConfig::new(4, 2)
                }),
                ..config(7)
            };
            let mut model = Gpt::<NoSp, Ddp>::new(c, &dm)?;
            let mut opt = AdamW::new(1e-2);
            if let Some(dir) = resume {
                load_model(dir, &world, &mut model, &mut opt)?;
            }
            let mut losses = Vec::new();
            for step in from..from + steps {
                let (ids, tg) = batch(step, &dm);
                losses.push(model.train_step(&ids, &tg, &mut opt, 1.0)?.loss);
            }
            if let Some(dir) = save {
                let mut extra = BTreeMap::new();
                extra.insert("data.step".to_string(), (from + steps).to_string());
                save_model(dir, &world, &mut model, &opt, &extra)?;
            }
            let bias = model
                .blocks
                .iter()
                .map(|b| b.mlp.moe().and_then(|m| m.bias()).expect("biased MoE"))
                .collect();
            Ok((losses, bias))
        },
    );
    out.swap_remove(0).unwrap()
}

/// The expert selection bias is saved and loaded with the model: 6 steps equal 3 + save +
/// load + 3, bitwise (losses and biases); a fresh model's zero bias would route otherwise.
#[test]
fn resume_restores_moe_expert_bias() {
    let dir = TempDir::new("moe-bias");
    let (all, all_bias) = run_moe(0, 6, None, None);
    let (first, saved_bias) = run_moe(0, 3, None, Some(dir.path()));
    assert!(
        saved_bias.iter().flatten().any(|b| *b != 0.0),
        "the bias moved in 3 steps: {saved_bias:?}"
    );
    let index = dtensor_checkpoint::read_index(dir.path()).unwrap();
    assert!(
        index.tensors.contains_key("blocks.0.mlp.expert_bias"),
        "{:?}",
        index.tensors.keys().collect::<Vec<_>>()
    );
    // Loaded and not stepped: the saved bias, bitwise.
    let (_, loaded_bias) = run_moe(3, 0, Some(dir.path()), None);
    let vb = |v: &[Vec<f64>]| v.iter().map(|b| bits(b)).collect::<Vec<_>>();
    assert_eq!(vb(&loaded_bias), vb(&saved_bias));
    let (rest, rest_bias) = run_moe(3, 3, Some(dir.path()), None);
    assert_eq!(bits(&all[..3]), bits(&first));
    assert_eq!(
        bits(&all[3..]),
        bits(&rest),
        "{all:?} vs {first:?} + {rest:?}"
    );
    assert_eq!(vb(&all_bias), vb(&rest_bias));
}
