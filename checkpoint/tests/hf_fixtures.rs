//! The tiny checkpoints transformers wrote (`tests/fixtures/hf/`, made by
//! `scripts/make_hf_fixtures.py`): every one loads and matches the tensor list its config
//! implies, names and shapes both (the goldens' gradient norms are keyed by the names
//! transformers itself writes); broken copies are refused naming the tensor and the file;
//! and saving them back with `HfWriter`, sharded or not, gives bitwise the same tensors.

#![allow(clippy::single_range_in_vec_init)] // a block of a 1-D tensor is one range

mod common;

use common::TempDir;
use dtensor_checkpoint::hf::{Architecture, HfConfig, HfWeights, HfWriter};
use dtensor_checkpoint::Error;
use dtensor_kernels::{half, DType};
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

const FIXTURES: [(&str, Architecture); 7] = [
    ("llama", Architecture::Llama),
    ("llama32", Architecture::Llama),
    ("mistral", Architecture::Mistral),
    ("qwen2", Architecture::Qwen2),
    ("qwen3", Architecture::Qwen3),
    ("mixtral", Architecture::Mixtral),
    ("qwen3_moe", Architecture::Qwen3Moe),
];

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf")
        .join(name)
}

fn golden(name: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixture(name).join("golden.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// A copy of fixture `name` in a fresh temp dir.
fn copy_of(name: &str) -> TempDir {
    let dir = TempDir::new(&format!("hf-{name}"));
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), dir.path().join(entry.file_name())).unwrap();
    }
    dir
}

/// The checkpoint's `Error::Tensor` fields, or a panic naming what happened instead.
fn tensor_error(r: Result<(), Error>) -> (PathBuf, String, String) {
    match r {
        Err(e @ Error::Tensor { .. }) => {
            let msg = e.to_string();
            let Error::Tensor { file, tensor, .. } = e else {
                unreachable!()
            };
            (file, tensor, msg)
        }
        Err(e) => panic!("not a tensor error: {e}"),
        Ok(()) => panic!("accepted"),
    }
}

fn open_and_validate(dir: &Path) -> Result<(), Error> {
    HfWeights::open_checked(dir).map(|_| ())
}

/// Rewrites the safetensors file `file` through `edit` (name → (dtype, shape, bytes)).
fn rewrite(
    file: &Path,
    edit: impl FnOnce(&mut BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    let bytes = std::fs::read(file).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: BTreeMap<_, _> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    edit(&mut tensors);
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, (d, s, b))| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), file).unwrap();
}

#[test]
fn hf_fixtures_load_and_validate() {
    for (name, arch) in FIXTURES {
        let dir = fixture(name);
        let (config, weights) =
            HfWeights::open_checked(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(config.architecture, arch, "{name}");
        let expected: BTreeSet<String> = config
            .expected_tensors()
            .into_iter()
            .map(|t| t.name)
            .collect();
        let stored: BTreeSet<String> = weights.names().map(str::to_string).collect();
        assert_eq!(expected, stored, "{name}");
        // The names transformers keys its gradients by after its own save conversion.
        let graded: BTreeSet<String> = golden(name)["grad_norms"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        assert_eq!(expected, graded, "{name}");
        for t in config.expected_tensors() {
            assert_eq!(
                weights.info(&t.name).unwrap().shape,
                t.shape,
                "{name} {}",
                t.name
            );
        }
    }
}

#[test]
fn hf_fixtures_cover_each_variant() {
    let config = |name: &str| HfConfig::from_dir(&fixture(name)).unwrap();
    let llama = config("llama");
    assert!(llama.kv_heads < llama.heads && !llama.tie_word_embeddings);
    let llama32 = config("llama32");
    assert!(llama32.tie_word_embeddings);
    assert!(matches!(
        llama32.rope.scaling,
        dtensor_kernels::ops::RopeScaling::Llama3 { .. }
    ));
    let seq = golden("llama")["greedy_prompt"].as_array().unwrap().len();
    let ids: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("ids.json")).unwrap()).unwrap();
    let seq_len = ids["input_ids"][0].as_array().unwrap().len();
    assert!(seq < seq_len);
    assert!(config("mistral").sliding_window.unwrap() < seq_len);
    assert!(config("qwen2").qkv_bias);
    let qwen3 = config("qwen3");
    assert!(qwen3.qk_norm && qwen3.head_dim * qwen3.heads != qwen3.hidden_size);
    let mixtral = config("mixtral").moe.unwrap();
    assert_eq!((mixtral.experts, mixtral.top_k), (4, 2));
    assert!(config("qwen3_moe").moe.unwrap().norm_topk_prob);
    assert!(fixture("mixtral")
        .join("model.safetensors.index.json")
        .exists());
}

#[test]
fn hf_bf16_fixture_converts_exactly() {
    let dir = fixture("qwen2");
    let (config, weights) = HfWeights::open_checked(&dir).unwrap();
    assert_eq!(config.stored_dtype, Some(DType::BF16));
    let name = "model.layers.0.self_attn.q_proj.bias";
    assert_eq!(weights.info(name).unwrap().dtype, DType::BF16);
    let n = weights.info(name).unwrap().shape[0];
    let stored: Vec<f64> = weights
        .stored_bytes(name)
        .unwrap()
        .chunks_exact(2)
        .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
        .collect();
    let wide = weights.read(name, &[0..n], DType::F64).unwrap();
    assert_eq!(wide.as_slice::<f64>().unwrap(), stored.as_slice());
    assert!(stored.iter().any(|&x| x != 0.0), "biases are drawn nonzero");
}

#[test]
fn hf_missing_tensor_names_tensor_and_file() {
    let dir = copy_of("llama");
    let file = dir.path().join("model.safetensors");
    let gone = "model.layers.1.mlp.up_proj.weight";
    rewrite(&file, |t| {
        t.remove(gone);
    });
    let (f, tensor, msg) = tensor_error(open_and_validate(dir.path()));
    assert_eq!((f, tensor.as_str()), (file, gone), "{msg}");
    assert!(msg.contains("missing"), "{msg}");
}

#[test]
fn hf_missing_tensor_of_a_sharded_checkpoint_names_the_index() {
    let dir = copy_of("mixtral");
    let index = dir.path().join("model.safetensors.index.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
    let gone = "model.layers.1.block_sparse_moe.experts.3.w2.weight";
    assert!(v["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove(gone)
        .is_some());
    std::fs::write(&index, serde_json::to_string(&v).unwrap()).unwrap();
    let (f, tensor, msg) = tensor_error(open_and_validate(dir.path()));
    assert_eq!((f, tensor.as_str()), (index, gone), "{msg}");
}

#[test]
fn hf_unexpected_tensor_names_tensor_and_file() {
    let dir = copy_of("qwen3");
    let file = dir.path().join("model.safetensors");
    let extra = "model.layers.0.self_attn.rotary_emb.inv_freq";
    rewrite(&file, |t| {
        t.insert(
            extra.into(),
            (safetensors::Dtype::F32, vec![8], vec![0; 32]),
        );
    });
    let (f, tensor, msg) = tensor_error(open_and_validate(dir.path()));
    assert_eq!((f, tensor.as_str()), (file, extra), "{msg}");
    assert!(msg.contains("unexpected"), "{msg}");
}

#[test]
fn hf_lm_head_beside_tied_embeddings_is_refused() {
    let dir = copy_of("llama32");
    let file = dir.path().join("model.safetensors");
    rewrite(&file, |t| {
        let embed = t["model.embed_tokens.weight"].clone();
        t.insert("lm_head.weight".into(), embed);
    });
    let (f, tensor, msg) = tensor_error(open_and_validate(dir.path()));
    assert_eq!((f, tensor.as_str()), (file, "lm_head.weight"), "{msg}");
    assert!(msg.contains("ties"), "{msg}");
}

#[test]
fn hf_misshaped_tensor_names_tensor_and_file() {
    // A transposed matrix: the same bytes, the other shape.
    let dir = copy_of("mistral");
    let file = dir.path().join("model.safetensors");
    let bad = "model.layers.0.self_attn.k_proj.weight";
    rewrite(&file, |t| {
        let (_, shape, _) = t.get_mut(bad).unwrap();
        shape.reverse();
    });
    let config = HfConfig::from_dir(dir.path()).unwrap();
    assert_ne!(
        config.kv_heads * config.head_dim,
        config.hidden_size,
        "k_proj is not square"
    );
    let (f, tensor, msg) = tensor_error(open_and_validate(dir.path()));
    assert_eq!((f, tensor.as_str()), (file, bad), "{msg}");
    assert!(msg.contains("shape"), "{msg}");
}

#[test]
fn hf_config_disagreeing_with_the_weights_names_a_tensor_and_file() {
    // A config edited after the save: every MLP weight is now mis-shaped; the error names
    // the first and counts the rest.
    let dir = copy_of("llama");
    let config = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace("\"intermediate_size\": 64", "\"intermediate_size\": 48"),
    )
    .unwrap();
    let (f, tensor, msg) = tensor_error(open_and_validate(dir.path()));
    assert_eq!(f, dir.path().join("model.safetensors"), "{msg}");
    assert_eq!(tensor, "model.layers.0.mlp.down_proj.weight", "{msg}");
    assert!(msg.contains("and 5 more"), "{msg}");
}

#[test]
fn hf_wrong_dtype_names_tensor_and_file() {
    // One tensor stored as float16 where config.json declares float32.
    let dir = copy_of("qwen3_moe");
    let file = dir.path().join("model.safetensors");
    let bad = "model.layers.1.mlp.gate.weight";
    rewrite(&file, |t| {
        let (dtype, _, bytes) = t.get_mut(bad).unwrap();
        *dtype = safetensors::Dtype::F16;
        *bytes = bytes
            .chunks_exact(4)
            .flat_map(|c| {
                let x = f32::from_le_bytes(c.try_into().unwrap());
                half::f16::from_f32(x).to_bits().to_le_bytes()
            })
            .collect();
    });
    let (f, tensor, msg) = tensor_error(open_and_validate(dir.path()));
    assert_eq!((f, tensor.as_str()), (file.clone(), bad), "{msg}");
    assert!(msg.contains("F16") && msg.contains("F32"), "{msg}");

    // A type dtensor never loads (integers) is refused when the file is opened.
    rewrite(&file, |t| {
        let (dtype, shape, bytes) = t.get_mut(bad).unwrap();
        *dtype = safetensors::Dtype::I32;
        *bytes = vec![0; shape.iter().product::<usize>() * 4];
    });
    let (f, tensor, msg) = tensor_error(open_and_validate(dir.path()));
    assert_eq!((f, tensor.as_str()), (file, bad), "{msg}");
}

#[test]
fn hf_float32_beside_a_bfloat16_declaration_is_accepted() {
    // transformers keeps `_keep_in_fp32_modules` in float32 in a bfloat16 save.
    let dir = copy_of("llama");
    let config = dir.path().join("config.json");
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, text.replace("\"float32\"", "\"bfloat16\"")).unwrap();
    let (config, _) = HfWeights::open_checked(dir.path()).unwrap();
    assert_eq!(config.stored_dtype, Some(DType::BF16));
}

#[test]
fn hf_truncated_shard_names_the_file() {
    let dir = copy_of("mixtral");
    let shard = dir.path().join("model-00002-of-00003.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() - 100]).unwrap();
    match HfWeights::open(dir.path()) {
        Err(e @ Error::Format { .. }) => {
            let msg = e.to_string();
            let Error::Format { file, .. } = e else {
                unreachable!()
            };
            assert_eq!(file, shard, "{msg}");
        }
        other => panic!("not a format error: {other:?}"),
    }
}

/// Every tensor of `a` is in `b` with the same dtype, shape and bytes, and no other.
fn assert_same_tensors(a: &HfWeights, b: &HfWeights, what: &str) {
    let names_a: Vec<&str> = a.names().collect();
    let names_b: Vec<&str> = b.names().collect();
    assert_eq!(names_a, names_b, "{what}");
    for name in names_a {
        let (ia, ib) = (a.info(name).unwrap(), b.info(name).unwrap());
        assert_eq!(
            (ia.dtype, &ia.shape),
            (ib.dtype, &ib.shape),
            "{what} {name}"
        );
        assert!(
            a.stored_bytes(name).unwrap() == b.stored_bytes(name).unwrap(),
            "{what} {name}: bytes differ"
        );
    }
}

#[test]
fn hf_save_round_trips_every_fixture_bitwise() {
    for (name, _) in FIXTURES {
        let src = fixture(name);
        let weights = HfWeights::open(&src).unwrap();
        let total: usize = weights
            .names()
            .map(|n| weights.stored_bytes(n).unwrap().len())
            .sum();
        // Unsharded from the stored bytes; sharded from tensors read in their stored dtype.
        for max_shard in [usize::MAX, 16 * 1024] {
            let out = TempDir::new(&format!("hf-save-{name}"));
            let mut w = HfWriter::create(out.path(), max_shard).unwrap();
            w.copy_files_from(&src).unwrap();
            for n in weights.names() {
                let info = weights.info(n).unwrap();
                if max_shard == usize::MAX {
                    w.add_bytes(n, info.dtype, &info.shape, weights.stored_bytes(n).unwrap())
                        .unwrap();
                } else {
                    let ranges: Vec<_> = info.shape.iter().map(|&d| 0..d).collect();
                    w.add(n, &weights.read(n, &ranges, info.dtype).unwrap())
                        .unwrap();
                }
            }
            let saved = w.finish().unwrap();
            let what = format!("{name}, shards of at most {max_shard} bytes");
            assert_eq!(saved.total_size, total as u64, "{what}");
            assert_eq!(saved.tensors, weights.names().count(), "{what}");
            let index = out.path().join("model.safetensors.index.json");
            if max_shard == usize::MAX {
                assert_eq!(
                    saved.files,
                    vec![out.path().join("model.safetensors")],
                    "{what}"
                );
                assert!(!index.exists(), "{what}");
            } else {
                let count = saved.files.len() - 1;
                assert!(count > 1, "{what}: {count} shards");
                assert_eq!(saved.files[count], index, "{what}");
                for (i, f) in saved.files[..count].iter().enumerate() {
                    let expected = format!("model-{:05}-of-{count:05}.safetensors", i + 1);
                    assert_eq!(f.file_name().unwrap().to_str().unwrap(), expected);
                    let shard = file_tensors(f);
                    let data: usize = shard.iter().map(|(_, len)| len).sum();
                    assert!(data <= max_shard || shard.len() == 1, "{what}: {f:?}");
                }
                let v: serde_json::Value =
                    serde_json::from_str(&std::fs::read_to_string(&index).unwrap()).unwrap();
                assert_eq!(v["metadata"]["total_size"], total as u64, "{what}");
                assert_eq!(
                    v["weight_map"].as_object().unwrap().len(),
                    weights.names().count(),
                    "{what}"
                );
            }
            assert!(!out.path().join("model.safetensors.tmp").exists());
            for f in ["config.json", "generation_config.json"] {
                assert_eq!(
                    std::fs::read(src.join(f)).unwrap(),
                    std::fs::read(out.path().join(f)).unwrap(),
                    "{what}: {f} copied verbatim"
                );
            }
            let back = HfWeights::open(out.path()).unwrap();
            assert_same_tensors(&weights, &back, &what);
            back.validate(&HfConfig::from_dir(out.path()).unwrap())
                .unwrap_or_else(|e| panic!("{what}: {e}"));
        }
    }
}

/// Each tensor's name and data length in one safetensors file, whose header must carry
/// the `{"format": "pt"}` transformers checks.
fn file_tensors(file: &Path) -> Vec<(String, usize)> {
    let bytes = std::fs::read(file).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let (_, meta) = SafeTensors::read_metadata(&bytes).unwrap();
    assert_eq!(
        meta.metadata()
            .as_ref()
            .and_then(|m| m.get("format"))
            .map(String::as_str),
        Some("pt"),
        "{file:?}: transformers wants format pt"
    );
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, v.data().len()))
        .collect()
}

#[test]
fn hf_save_over_an_earlier_save_removes_its_stale_weights() {
    let src = fixture("qwen2");
    let weights = HfWeights::open(&src).unwrap();
    let out = TempDir::new("hf-restale");
    for max_shard in [4 * 1024, usize::MAX] {
        if max_shard == usize::MAX {
            // What a sharded save that failed midway leaves.
            std::fs::write(out.path().join("model-00002.safetensors.tmp"), b"partial").unwrap();
        }
        let mut w = HfWriter::create(out.path(), max_shard).unwrap();
        w.write_config(&HfConfig::from_dir(&src).unwrap()).unwrap();
        for n in weights.names() {
            let info = weights.info(n).unwrap();
            w.add_bytes(n, info.dtype, &info.shape, weights.stored_bytes(n).unwrap())
                .unwrap();
        }
        w.finish().unwrap();
    }
    let mut files: Vec<String> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    files.sort();
    assert_eq!(files, ["config.json", "model.safetensors"]);
    let (config, back) = HfWeights::open_checked(out.path()).unwrap();
    assert_eq!(config, HfConfig::from_dir(&src).unwrap());
    assert_same_tensors(&weights, &back, "resaved");
}

#[test]
fn hf_writer_refuses_bad_tensors_by_name() {
    let out = TempDir::new("hf-refuse");
    let mut w = HfWriter::create(out.path(), usize::MAX).unwrap();
    let refused = |r: Result<(), Error>| match r {
        Err(Error::Refused { tensor, detail }) => (tensor, detail),
        other => panic!("not refused: {other:?}"),
    };
    w.add_bytes("a", DType::F32, &[2], &[0; 8]).unwrap();
    let (t, d) = refused(w.add_bytes("a", DType::F32, &[2], &[0; 8]));
    assert_eq!(t, "a");
    assert!(d.contains("twice"), "{d}");
    let (t, d) = refused(w.add_bytes("b", DType::BF16, &[3], &[0; 8]));
    assert_eq!(t, "b");
    assert!(d.contains("bytes"), "{d}");
    let (t, _) = refused(w.add_bytes("c", DType::I64, &[1], &[0; 8]));
    assert_eq!(t, "c");
    match w.finish() {
        Err(Error::Refused { tensor, .. }) => assert_eq!(tensor, "config.json"),
        other => panic!("finished without a config: {other:?}"),
    }
}
