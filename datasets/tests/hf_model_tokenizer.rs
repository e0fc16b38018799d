//! The tokenizer that ships beside a model: `tests/fixtures/hf/llama32/` holds a byte-level
//! BPE `tokenizer.json` and `tokenizer_config.json` next to the checkpoint (made by
//! `scripts/make_hf_fixtures.py` with the Python `tokenizers`); read from the model
//! directory it encodes the golden text to the golden ids, its BOS/EOS are the ones the
//! model's `config.json` names, its vocabulary is the model's, and training here with the
//! same settings gives the same tokenizer.

use dtensor_datasets::{BpeSettings, Tokenizer};
use std::path::{Path, PathBuf};

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/llama32")
}

fn json(file: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(model_dir().join(file)).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn tokenizer_of_a_model_directory_matches_its_goldens_and_config() {
    let tok = Tokenizer::from_dir(&model_dir()).unwrap();
    let golden = json("tokenizer_golden.json");
    let config = json("config.json");
    let text = golden["text"].as_str().unwrap();
    assert_eq!(tok.encode(text, true).unwrap(), ids(&golden["ids"]));
    let plain = tok.encode(text, false).unwrap();
    assert_eq!(plain, ids(&golden["ids_without_specials"]));
    assert_eq!(tok.decode(&plain, false).unwrap(), text);
    assert_eq!(
        tok.bos_id(),
        Some(golden["bos_id"].as_u64().unwrap() as u32)
    );
    assert_eq!(
        tok.eos_id(),
        Some(golden["eos_id"].as_u64().unwrap() as u32)
    );
    assert_eq!(tok.bos_id().map(u64::from), config["bos_token_id"].as_u64());
    assert_eq!(tok.eos_id().map(u64::from), config["eos_token_id"].as_u64());
    assert_eq!(
        tok.vocab_size() as u64,
        config["vocab_size"].as_u64().unwrap()
    );
}

#[test]
fn tokenizer_trained_here_equals_the_model_directory_one() {
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tiny_corpus.txt");
    let golden = json("tokenizer_golden.json");
    let settings = BpeSettings {
        vocab_size: golden["vocab_size"].as_u64().unwrap() as usize,
        ..BpeSettings::default()
    };
    let tok = Tokenizer::train_bpe(&[corpus], &settings).unwrap();
    let text = golden["text"].as_str().unwrap();
    assert_eq!(tok.encode(text, true).unwrap(), ids(&golden["ids"]));
    assert_eq!(tok.vocab_size(), settings.vocab_size);
}
