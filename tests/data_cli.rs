//! `dtensor data prepare`, end to end on the built binary: .txt and .jsonl inputs become
//! indexed datasets holding exactly the tokenizer's ids (read back here and by the
//! independent Python reader), and bad inputs exit 1 naming the file and line.

use dtensor::datasets::indexed::IndexedDataset;
use dtensor::datasets::Tokenizer;
use std::path::{Path, PathBuf};
use std::process::Command;

fn tokenizer_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/tests/data/tokenizer")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dtensor-data-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn prepare(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dtensor"))
        .args(["data", "prepare"])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn read_python(prefix: &Path) -> serde_json::Value {
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("datasets/tests/support/megatron_indexed.py");
    let out = Command::new("python3")
        .arg(script)
        .arg("read")
        .arg(prefix)
        .output()
        .unwrap_or_else(|e| panic!("python3 is required by this test: {e}"));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn data_prepare_txt_and_jsonl_hold_the_tokenizers_ids() {
    let dir = scratch("ok");
    let texts = [
        "The quick brown fox jumps over the lazy dog.",
        "Ünïcödé and \"quotes\"\nand a newline",
        "",
        "a third document",
    ];
    let mut jsonl = String::new();
    for (k, t) in texts.iter().enumerate() {
        jsonl.push_str(&serde_json::json!({ "id": k, "body": t }).to_string());
        jsonl.push_str("\n\n");
    }
    std::fs::write(dir.join("web.jsonl"), jsonl).unwrap();
    let book = "Once upon a time.\nThe end.\n";
    std::fs::write(dir.join("book.txt"), book).unwrap();
    let out = dir.join("out");
    let tok = tokenizer_dir().join("tokenizer.json");
    let (code, stdout, stderr) = prepare(&[
        "--tokenizer",
        tok.to_str().unwrap(),
        "--input",
        dir.join("web.jsonl").to_str().unwrap(),
        dir.join("book.txt").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--text-key",
        "body",
        "--append-eos",
    ]);
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("4 documents"), "{stdout}");
    assert!(stdout.contains("1 documents"), "{stdout}");
    assert!(
        stdout.contains("prepared 2 file(s)") && stdout.contains("tokens/s"),
        "{stdout}"
    );
    // Not a terminal: plain lines, no bar.
    assert!(!stderr.contains('\u{1b}'), "{stderr:?}");

    let t = Tokenizer::from_dir(&tokenizer_dir()).unwrap();
    let eos = t.eos_id().unwrap();
    let want = |text: &str| -> Vec<u64> {
        let mut ids = t.encode(text, true).unwrap();
        ids.push(eos);
        ids.into_iter().map(u64::from).collect()
    };
    let web = IndexedDataset::<u16>::open(&out.join("web")).unwrap();
    assert_eq!(web.documents(), texts.len());
    let py = read_python(&out.join("web"));
    assert_eq!(py["dtype"], 8);
    for (k, text) in texts.iter().enumerate() {
        let got: Vec<u64> = web.get(k).iter().map(|&x| x as u64).collect();
        assert_eq!(got, want(text), "document {k}");
        assert_eq!(py["documents"][k][0], serde_json::json!(want(text)));
    }
    let bookd = IndexedDataset::<u16>::open(&out.join("book")).unwrap();
    let got: Vec<u64> = bookd.get(0).iter().map(|&x| x as u64).collect();
    assert_eq!((bookd.documents(), got), (1, want(book)));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn data_prepare_bad_inputs_exit_1_naming_file_and_line() {
    let dir = scratch("bad");
    let tok = tokenizer_dir().join("tokenizer.json");
    let file = |name: &str, body: &str| {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p.to_str().unwrap().to_string()
    };
    let good = file("good.jsonl", "{\"text\": \"x\"}\n");
    let cases = [
        (
            file("nokey.jsonl", "{\"text\": \"x\"}\n{\"body\": \"y\"}\n"),
            "line 2: no \"text\" key",
        ),
        (
            file("notjson.jsonl", "{\"text\": \"x\"\n"),
            "line 1: not JSON",
        ),
        (file("number.jsonl", "{\"text\": 3}\n"), "holds a number"),
        (file("notes.md", "text"), "unknown extension"),
        (
            dir.join("absent.txt").to_str().unwrap().to_string(),
            "absent.txt",
        ),
    ];
    let out = dir.join("out");
    for (input, want) in &cases {
        let (code, _, stderr) = prepare(&[
            "--tokenizer",
            tok.to_str().unwrap(),
            "--input",
            input,
            "--out",
            out.to_str().unwrap(),
        ]);
        assert_eq!(code, 1, "{input}: {stderr}");
        assert!(stderr.contains(want), "{input}: {stderr}");
        let name = Path::new(input).file_name().unwrap().to_str().unwrap();
        assert!(stderr.contains(name), "{stderr}");
    }
    // Two inputs of one name would write the same dataset.
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let twin = dir.join("sub/good.jsonl");
    std::fs::write(&twin, "{\"text\": \"y\"}\n").unwrap();
    let (code, _, stderr) = prepare(&[
        "--tokenizer",
        tok.to_str().unwrap(),
        "--input",
        &good,
        twin.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert!(stderr.contains("same name"), "{stderr}");
    // A missing tokenizer names its file; a missing flag is clap's exit 2.
    let (code, _, stderr) = prepare(&["--tokenizer", "nope.json", "--input", &good, "--out", "o"]);
    assert_eq!(code, 1);
    assert!(stderr.contains("nope.json"), "{stderr}");
    let (code, _, stderr) = prepare(&["--input", &good, "--out", "o"]);
    assert_eq!(code, 2);
    assert!(stderr.contains("--tokenizer"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
