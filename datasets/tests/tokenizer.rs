//! Tokenizers against transformers: a byte-level BPE `tokenizer.json` with its
//! `tokenizer_config.json` (made by `tests/data/tokenizer/make_fixture.py` with the Python
//! `tokenizers` and transformers) encodes and decodes as transformers' `AutoTokenizer`
//! does, special tokens included; a BPE trained here with the same settings on the same
//! corpus is the same tokenizer; save and reload give the same ids.

use dtensor_datasets::{BpeSettings, Tokenizer};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer")
}

fn corpus() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tiny_corpus.txt")
}

fn goldens() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture().join("goldens.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Every golden case: ids with and without special tokens, and the decoded text.
fn check_against_goldens(tok: &Tokenizer, what: &str) {
    let g = goldens();
    for case in g["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let with = tok.encode(text, true).unwrap();
        assert_eq!(
            with,
            ids(&case["with_special"]),
            "{what}: {text:?} with special tokens"
        );
        assert_eq!(
            tok.encode(text, false).unwrap(),
            ids(&case["without_special"]),
            "{what}: {text:?} without"
        );
        assert_eq!(
            tok.decode(&with, true).unwrap(),
            case["decoded"].as_str().unwrap(),
            "{what}: decode"
        );
    }
}

#[test]
fn a_tokenizer_directory_encodes_as_transformers_does() {
    let tok = Tokenizer::from_dir(&fixture()).unwrap();
    let g = goldens();
    assert_eq!(tok.bos_id(), Some(g["bos_id"].as_u64().unwrap() as u32));
    assert_eq!(tok.eos_id(), Some(g["eos_id"].as_u64().unwrap() as u32));
    assert_eq!(tok.vocab_size() as u64, g["vocab_size"].as_u64().unwrap());
    check_against_goldens(&tok, "tokenizer.json from transformers");
}

#[test]
fn training_here_gives_the_same_tokenizer_and_it_survives_save_and_reload() {
    let settings = BpeSettings {
        vocab_size: 320,
        min_frequency: 2,
        bos: Some("<|begin_of_text|>".into()),
        eos: "<|end_of_text|>".into(),
    };
    let tok = Tokenizer::train_bpe(&[corpus()], &settings).unwrap();
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(0), Some(1)));
    check_against_goldens(&tok, "trained here");

    let dir = std::env::temp_dir().join(format!("dtensor-tokenizer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokenizer.json");
    tok.save(&file).unwrap();
    let back = Tokenizer::from_file(&file)
        .unwrap()
        .with_specials(Some("<|begin_of_text|>"), Some("<|end_of_text|>"))
        .unwrap();
    check_against_goldens(&back, "saved and reloaded");
    // Byte-level: any text round-trips, bytes the corpus never had included.
    let odd = "tab\t, nul-free emoji 🦀, CJK 漢字, combining e\u{301}";
    assert_eq!(
        back.decode(&back.encode(odd, false).unwrap(), false)
            .unwrap(),
        odd
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_inputs_name_the_file() {
    let missing = fixture().join("nope.json");
    let e = Tokenizer::from_file(&missing).unwrap_err().to_string();
    assert!(e.contains("nope.json"), "{e}");
    let tok = Tokenizer::from_dir(&fixture()).unwrap();
    let e = tok
        .with_specials(Some("<|not_a_token|>"), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("<|not_a_token|>") && e.contains("tokenizer.json"),
        "{e}"
    );
    let small = BpeSettings {
        vocab_size: 100,
        ..BpeSettings::default()
    };
    let e = Tokenizer::train_bpe(&[corpus()], &small)
        .unwrap_err()
        .to_string();
    assert!(e.contains("vocab_size 100"), "{e}");
    let e = Tokenizer::train_bpe(&[fixture().join("no_corpus.txt")], &BpeSettings::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("no_corpus.txt"), "{e}");
}
