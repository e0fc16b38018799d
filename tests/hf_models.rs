//! Hugging Face checkpoints against transformers: each fixture of `tests/fixtures/hf/`
//! (tiny random models written by `scripts/make_hf_fixtures.py`, with transformers'
//! float64 loss, logits and gradient norms in `golden.json`) loaded into dtensor's decoder
//! on one rank and on several meshes, and run forward and backward on `ids.json`: the loss,
//! the logits' sum and corners, and every tensor's gradient norm within 1e-5 relative.
//!
//! Why 1e-5 and not 1e-12: transformers computes RMSNorm, the RoPE tables, the attention
//! softmax and the loss in float32 even in a float64 model, so its goldens are only
//! float32-accurate (the differences measured here are about 1e-7). Between dtensor's own
//! meshes the numbers agree far tighter: `hf_meshes_agree_with_one_rank` holds them to
//! 1e-12.

use dtensor::hf::{parity_on_threads, read_ids, Parity};
use dtensor::placement::Composition;
use std::path::{Path, PathBuf};

const TOLERANCE: f64 = 1e-5;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf")
}

fn golden(model: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join(model).join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn parity(model: &str, spec: &str) -> Parity {
    let ids = read_ids(&fixtures().join("ids.json")).unwrap();
    let comp: Composition = spec.parse().unwrap();
    parity_on_threads(&fixtures().join(model), &ids, &comp)
        .unwrap_or_else(|e| panic!("{model} on {spec}: {e}"))
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-300)
}

/// The largest relative difference of `got` from the golden numbers; panics past `tol`.
fn compare(what: &str, got: &Parity, want: &serde_json::Value, tol: f64) -> f64 {
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    let mut worst = rel(got.loss, f(&want["loss"]));
    if let Some(l) = &got.logits {
        worst = worst.max(rel(l.sum, f(&want["logits_sum"])));
        for (key, ours) in [("logits_first8", &l.first8), ("logits_last8", &l.last8)] {
            let theirs = want[key].as_array().unwrap();
            assert_eq!(ours.len(), theirs.len(), "{what}: {key}");
            // Corner logits near zero: relative to the largest of the eight.
            let scale = theirs.iter().map(|x| f(x).abs()).fold(0.0, f64::max);
            for (a, b) in ours.iter().zip(theirs) {
                worst = worst.max((a - f(b)).abs() / scale);
            }
        }
    }
    let norms = want["grad_norms"].as_object().unwrap();
    for (name, ours) in &got.grad_norms {
        let theirs = norms
            .get(name)
            .unwrap_or_else(|| panic!("{what}: transformers has no gradient for {name}"));
        worst = worst.max(rel(*ours, f(theirs)));
    }
    if got.logits.is_some() {
        assert_eq!(
            got.grad_norms.len(),
            norms.len(),
            "{what}: one gradient norm per tensor"
        );
    }
    assert!(
        worst <= tol,
        "{what}: largest relative difference {worst:e} > {tol:e}"
    );
    eprintln!("{what}: largest relative difference {worst:e}");
    worst
}

/// Each architecture's meshes: one rank, tp = 2, dp = 2 × tp = 2 with SP, cp = 2 (ring
/// attention over zigzag chunks), pp = 2 (no tied or MoE model: refused there), ep = 2
/// for the MoE ones.
fn meshes(model: &str) -> Vec<&'static str> {
    let mut m = vec!["f64", "tp=2,f64", "dp=2,tp=2,sp,f64", "cp=2,f64"];
    let (moe, tied) = (
        model.contains("moe") || model == "mixtral",
        model == "llama32",
    );
    if moe {
        m.extend(["ep=2,f64", "ep=2,tp=2,sp,f64"]);
    } else if !tied {
        m.push("pp=2,m=2,f64");
    }
    if model == "llama" {
        // tp = 4 > 2 KV heads: the shared-KV projection; ZeRO and FSDP shards.
        m.extend(["tp=4,f64", "dp=2,fsdp,f64", "dp=2,zero1,tp=2,f64"]);
    }
    m
}

macro_rules! oracle {
    ($($name:ident: $model:expr;)*) => {$(
        #[test]
        fn $name() {
            let want = golden($model);
            for spec in meshes($model) {
                compare(&format!("{} on {spec}", $model), &parity($model, spec), &want, TOLERANCE);
            }
        }
    )*};
}

oracle! {
    llama_matches_transformers: "llama";
    llama32_matches_transformers: "llama32";
    mistral_matches_transformers: "mistral";
    qwen2_matches_transformers: "qwen2";
    qwen3_matches_transformers: "qwen3";
    mixtral_matches_transformers: "mixtral";
    qwen3_moe_matches_transformers: "qwen3_moe";
}

/// dtensor's meshes agree with its one rank far below the goldens' float32 accuracy.
#[test]
fn hf_meshes_agree_with_one_rank() {
    let one = parity("llama", "f64");
    for spec in [
        "tp=2,f64",
        "dp=2,tp=2,sp,f64",
        "cp=2,tp=2,f64",
        "pp=2,m=2,f64",
    ] {
        let got = parity("llama", spec);
        assert!(rel(got.loss, one.loss) <= 1e-12, "{spec}: loss");
        for (name, g) in &got.grad_norms {
            assert!(rel(*g, one.grad_norms[name]) <= 1e-12, "{spec}: {name}");
        }
    }
}

/// Greedy generation with the KV cache gives transformers' greedy tokens (`golden.json`'s
/// `greedy`: 8 tokens after the first sample's first 8 ids, each step's winner ahead of
/// the runner-up by more than 1e-3), on one rank and with the heads over tp = 2.
#[test]
fn greedy_generation_matches_transformers() {
    for model in [
        "llama",
        "llama32",
        "mistral",
        "qwen2",
        "qwen3",
        "mixtral",
        "qwen3_moe",
    ] {
        let want = golden(model);
        let ids = |k: &str| -> Vec<u32> {
            want[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        };
        let (prompt, greedy) = (ids("greedy_prompt"), ids("greedy"));
        for spec in ["f64", "tp=2,f64"] {
            let comp: Composition = spec.parse().unwrap();
            let (got, _) = dtensor::hf::generate_on_threads(
                &fixtures().join(model),
                &prompt,
                greedy.len(),
                &dtensor::nn::Sampling::greedy(),
                &[],
                &comp,
            )
            .unwrap_or_else(|e| panic!("{model} on {spec}: {e}"));
            assert_eq!(got, greedy, "{model} on {spec}: greedy tokens");
        }
    }
}

/// A dtensor checkpoint of a Hugging Face model, written from a mesh (tp = 2, f32 masters
/// with AdamW moments), converts back into the Hugging Face layout: untrained, bitwise the
/// tensors it came from.
#[test]
fn our_checkpoints_export_to_hugging_face() {
    use dtensor::checkpoint::hf::{HfModel, HfWeights};
    let tmp = std::env::temp_dir().join(format!("dtensor-hf-export-{}", std::process::id()));
    let (ckpt, out) = (tmp.join("ckpt"), tmp.join("hf"));
    let source = fixtures().join("llama");
    let model = HfModel::open(&source).unwrap();
    let config = model.gpt_config(24, dtensor::kernels::DType::F32).unwrap();
    let mesh: Composition = "tp=2".parse().unwrap();
    let mesh = mesh
        .degrees
        .mesh(&[
            dtensor::placement::AxisKind::Dp,
            dtensor::placement::AxisKind::Ep,
            dtensor::placement::AxisKind::Cp,
            dtensor::placement::AxisKind::Tp,
        ])
        .unwrap();
    for r in dtensor::threads::launch(2, |world| -> Result<(), String> {
        let dm =
            dtensor::DeviceMesh::new(world.clone(), mesh.clone()).map_err(|e| e.to_string())?;
        let mut gpt = dtensor::nn::Gpt::<dtensor::nn::NoSp, dtensor::nn::Ddp>::new(config, &dm)
            .map_err(|e| e.to_string())?;
        model
            .load_into(&world, &mut gpt)
            .map_err(|e| e.to_string())?;
        let opt = dtensor::nn::AdamW::new(1e-3);
        dtensor::checkpoint::nn::save_model(&ckpt, &world, &mut gpt, &opt, &Default::default())
            .map_err(|e| e.to_string())?;
        Ok(())
    }) {
        r.unwrap();
    }
    dtensor::hf::export_checkpoint(&ckpt, &source, &out).unwrap();
    let (_, want) = HfWeights::open_checked(&source).unwrap();
    let (_, got) = HfWeights::open_checked(&out).unwrap();
    assert_eq!(
        want.names().collect::<Vec<_>>(),
        got.names().collect::<Vec<_>>()
    );
    for n in want.names() {
        let info = want.info(n).unwrap();
        let all: Vec<_> = info.shape.iter().map(|&d| 0..d).collect();
        assert_eq!(
            want.read(n, &all, info.dtype).unwrap(),
            got.read(n, &all, info.dtype).unwrap(),
            "{n}"
        );
    }
    std::fs::remove_dir_all(&tmp).unwrap();
}
