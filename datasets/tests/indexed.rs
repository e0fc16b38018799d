//! Megatron-LM's indexed dataset: files written here read back, files written by an
//! independent Python reader/writer of the published layout (`tests/support/
//! megatron_indexed.py`, standard library only) read here and the other way round, and
//! damaged files refused naming the file and the field.

use dtensor_datasets::indexed::{
    paths, read_header, Element, IndexedDataset, IndexedDatasetBuilder, TokenDType,
};
use dtensor_datasets::Error;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dtensor-indexed-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Documents of sequences of pseudo-random ids below `vocab`: some documents of several
/// sequences, an empty sequence and an empty document among them.
fn corpus(vocab: u32, seed: u64) -> Vec<Vec<Vec<u32>>> {
    let mut x = seed;
    let mut next = move |n: u32| {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 33) % n as u64) as u32
    };
    let mut docs = Vec::new();
    for d in 0..23 {
        let seqs = if d == 5 { 0 } else { 1 + next(3) };
        let doc = (0..seqs)
            .map(|s| {
                let len = if d == 7 && s == 0 { 0 } else { 1 + next(40) };
                (0..len).map(|_| next(vocab)).collect()
            })
            .collect();
        docs.push(doc);
    }
    docs
}

fn write_rust<T: Element>(prefix: &Path, docs: &[Vec<Vec<u32>>]) {
    let mut b = IndexedDatasetBuilder::<T>::create(prefix).unwrap();
    for doc in docs {
        for seq in doc {
            let seq: Vec<T> = seq.iter().map(|&t| T::from_token(t).unwrap()).collect();
            b.add_sequence(&seq).unwrap();
        }
        b.end_document().unwrap();
    }
    let s = b.finish().unwrap();
    assert_eq!(s.documents, docs.len() as u64);
    assert_eq!(
        s.sequences,
        docs.iter().map(|d| d.len() as u64).sum::<u64>()
    );
}

fn read_rust<T: Element>(prefix: &Path) -> Vec<Vec<Vec<u32>>> {
    let d = IndexedDataset::<T>::open(prefix).unwrap();
    (0..d.documents())
        .map(|k| {
            d.document_sequences(k)
                .map(|s| d.get(s).iter().map(|x| x.to_token().unwrap()).collect())
                .collect()
        })
        .collect()
}

fn python(args: &[&str], stdin: Option<String>) -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/megatron_indexed.py");
    let mut child = Command::new("python3")
        .arg(&script)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("python3 is required by this test (the independent reader/writer): {e}")
        });
    let input = stdin.unwrap_or_default();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python3 {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn python_read(prefix: &Path) -> (u8, Vec<Vec<Vec<u32>>>) {
    let out = python(&["read", prefix.to_str().unwrap()], None);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let docs = v["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            d.as_array()
                .unwrap()
                .iter()
                .map(|s| {
                    s.as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t.as_f64().unwrap() as u32)
                        .collect()
                })
                .collect()
        })
        .collect();
    (v["dtype"].as_u64().unwrap() as u8, docs)
}

fn python_write(prefix: &Path, code: u8, docs: &[Vec<Vec<u32>>]) {
    let json = serde_json::json!({ "documents": docs }).to_string();
    python(
        &["write", prefix.to_str().unwrap(), &code.to_string()],
        Some(json),
    );
}

#[test]
fn indexed_every_dtype_round_trips_through_rust() {
    let dir = scratch("roundtrip");
    let docs = corpus(100, 1);
    macro_rules! check {
        ($t:ty) => {{
            let prefix = dir.join(stringify!($t));
            write_rust::<$t>(&prefix, &docs);
            assert_eq!(read_rust::<$t>(&prefix), docs, "{}", stringify!($t));
            assert_eq!(read_header(&prefix).unwrap().dtype, <$t>::DTYPE);
        }};
    }
    check!(u8);
    check!(i8);
    check!(i16);
    check!(i32);
    check!(i64);
    check!(f64);
    check!(f32);
    check!(u16);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn indexed_written_by_rust_reads_in_python() {
    let dir = scratch("rust-to-python");
    for (code, vocab) in [(8u8, 65_000u32), (4, 200_000), (1, 256), (5, 1 << 31)] {
        let docs = corpus(vocab, code as u64);
        let prefix = dir.join(format!("c{code}"));
        match code {
            8 => write_rust::<u16>(&prefix, &docs),
            4 => write_rust::<i32>(&prefix, &docs),
            1 => write_rust::<u8>(&prefix, &docs),
            _ => write_rust::<i64>(&prefix, &docs),
        }
        let (got_code, got) = python_read(&prefix);
        assert_eq!(got_code, code);
        assert_eq!(got, docs, "code {code}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn indexed_written_by_python_reads_in_rust() {
    let dir = scratch("python-to-rust");
    for (code, vocab) in [(8u8, 65_000u32), (4, 200_000), (3, 30_000), (7, 1 << 20)] {
        let docs = corpus(vocab, 10 + code as u64);
        let prefix = dir.join(format!("c{code}"));
        python_write(&prefix, code, &docs);
        let got = match code {
            8 => read_rust::<u16>(&prefix),
            4 => read_rust::<i32>(&prefix),
            3 => read_rust::<i16>(&prefix),
            _ => read_rust::<f32>(&prefix),
        };
        assert_eq!(got, docs, "code {code}");
        let d = IndexedDataset::<u16>::open(&prefix);
        if code != 8 {
            assert!(matches!(d, Err(Error::Format { .. })), "{d:?}");
        }
    }
    // The document indices as Python wrote them: from 0, one per document boundary.
    let d = IndexedDataset::<u16>::open(&dir.join("c8")).unwrap();
    let docs = corpus(65_000, 18);
    let mut want = vec![0u64];
    for doc in &docs {
        want.push(want.last().unwrap() + doc.len() as u64);
    }
    assert_eq!(d.document_indices(), want);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn indexed_header_is_34_bytes_and_matches_the_layout() {
    let dir = scratch("layout");
    let prefix = dir.join("x");
    let mut b = IndexedDatasetBuilder::<u16>::create(&prefix).unwrap();
    b.add_document(&[1, 2, 3]).unwrap();
    b.add_sequence(&[4]).unwrap();
    b.add_sequence(&[5, 6]).unwrap();
    b.finish().unwrap();
    let (bin, idx) = paths(&prefix);
    let idx = std::fs::read(idx).unwrap();
    let mut want = b"MMIDIDX\x00\x00".to_vec();
    want.extend(1u64.to_le_bytes());
    want.push(8);
    want.extend(3u64.to_le_bytes());
    want.extend(3u64.to_le_bytes());
    assert_eq!(want.len(), 34);
    for l in [3i32, 1, 2] {
        want.extend(l.to_le_bytes());
    }
    for p in [0i64, 6, 8] {
        want.extend(p.to_le_bytes());
    }
    // The open sequences were closed into a document by finish.
    for d in [0i64, 1, 3] {
        want.extend(d.to_le_bytes());
    }
    assert_eq!(idx, want);
    let bin = std::fs::read(bin).unwrap();
    assert_eq!(bin, [1u8, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0]);
    assert_eq!(TokenDType::for_vocab(65_499), TokenDType::U16);
    assert_eq!(TokenDType::for_vocab(65_500), TokenDType::I32);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Edits the `.bin` and `.idx` bytes of a small dataset.
type Damage = Box<dyn FnOnce(&mut Vec<u8>, &mut Vec<u8>)>;

fn damaged(dir: &Path, name: &str, edit: Damage) -> String {
    let prefix = dir.join(name);
    let mut b = IndexedDatasetBuilder::<u16>::create(&prefix).unwrap();
    b.add_document(&[1, 2, 3]).unwrap();
    b.add_document(&[4, 5]).unwrap();
    b.finish().unwrap();
    let (bin_path, idx_path) = paths(&prefix);
    let (mut bin, mut idx) = (
        std::fs::read(&bin_path).unwrap(),
        std::fs::read(&idx_path).unwrap(),
    );
    edit(&mut bin, &mut idx);
    std::fs::write(&bin_path, bin).unwrap();
    std::fs::write(&idx_path, idx).unwrap();
    let e = IndexedDataset::<u16>::open(&prefix).unwrap_err();
    assert!(matches!(e, Error::Format { .. }), "{e:?}");
    let msg = e.to_string();
    assert!(msg.contains(name), "{msg}");
    msg
}

#[test]
fn indexed_damaged_files_are_refused_naming_file_and_field() {
    let dir = scratch("damaged");
    let cases: Vec<(&str, Damage, &str)> = vec![
        ("magic", Box::new(|_, i| i[0] = b'X'), "bad magic"),
        ("version", Box::new(|_, i| i[9] = 2), "version 2"),
        ("dtype", Box::new(|_, i| i[17] = 9), "dtype code 9"),
        (
            "wrongtype",
            Box::new(|_, i| i[17] = 4),
            "dtype i32 (code 4), read as u16",
        ),
        ("short", Box::new(|_, i| i.truncate(40)), "truncated"),
        ("header", Box::new(|_, i| i.truncate(20)), "truncated"),
        ("trailing", Box::new(|_, i| i.push(0)), "trailing bytes"),
        (
            "bin",
            Box::new(|b, _| b.truncate(7)),
            "truncated: sequence 1",
        ),
        ("odd", Box::new(|_, i| i[34 + 8 + 8] = 3), "not a multiple"),
        ("negative", Box::new(|_, i| i[34 + 3] = 0xff), "negative"),
        (
            "docs",
            Box::new(|_, i| {
                let n = i.len();
                i[n - 8] = 1;
            }),
            "document index 2 is 1",
        ),
    ];
    for (name, edit, want) in cases {
        let msg = damaged(&dir, name, edit);
        assert!(msg.contains(want), "{name}: {msg}");
    }
    let e = IndexedDataset::<u16>::open(&dir.join("missing")).unwrap_err();
    assert!(
        matches!(e, Error::Io { .. }) && e.to_string().contains("missing.idx"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn indexed_empty_dataset_opens() {
    let dir = scratch("empty");
    let prefix = dir.join("none");
    IndexedDatasetBuilder::<i32>::create(&prefix)
        .unwrap()
        .finish()
        .unwrap();
    let d = IndexedDataset::<i32>::open(&prefix).unwrap();
    assert!(d.is_empty());
    assert_eq!(d.documents(), 0);
    assert_eq!(python_read(&prefix), (4, vec![]));
    std::fs::remove_dir_all(&dir).unwrap();
}
