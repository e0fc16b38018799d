//! Hugging Face weights (`model.safetensors`, or shards with `model.safetensors.index.json`)
//! memory-mapped and read block by block, converted to the dtype asked for. The files here
//! are written byte by byte from the published layout (8-byte little-endian header length,
//! the JSON header, the data), not by the reader's own library; and every broken directory
//! is an error naming the file and, where there is one, the tensor.

#![allow(clippy::single_range_in_vec_init)] // a block of a 1-D tensor is one range

mod common;

use common::TempDir;
use dtensor_checkpoint::hf::HfWeights;
use dtensor_checkpoint::Error;
use dtensor_kernels::{half, DType, Tensor};
use std::path::Path;

/// One stored tensor: name, safetensors dtype name, shape, little-endian bytes.
struct Stored {
    name: &'static str,
    dtype: &'static str,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

fn f32s(name: &'static str, shape: &[usize], f: impl Fn(usize) -> f32) -> Stored {
    let n: usize = shape.iter().product();
    Stored {
        name,
        dtype: "F32",
        shape: shape.to_vec(),
        bytes: (0..n).flat_map(|i| f(i).to_le_bytes()).collect(),
    }
}

fn bf16s(name: &'static str, shape: &[usize], f: impl Fn(usize) -> f32) -> Stored {
    let n: usize = shape.iter().product();
    Stored {
        name,
        dtype: "BF16",
        shape: shape.to_vec(),
        bytes: (0..n)
            .flat_map(|i| half::bf16::from_f32(f(i)).to_bits().to_le_bytes())
            .collect(),
    }
}

/// Writes a safetensors file by hand: header length, JSON header (offsets relative to
/// the end of the header), data.
fn write_safetensors(path: &Path, tensors: &[Stored]) {
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0;
    for t in tensors {
        header.insert(
            t.name.into(),
            serde_json::json!({
                "dtype": t.dtype,
                "shape": t.shape,
                "data_offsets": [offset, offset + t.bytes.len()],
            }),
        );
        offset += t.bytes.len();
    }
    let mut json = serde_json::to_vec(&header).unwrap();
    // The format pads the header with spaces to a multiple of 8.
    while !json.len().is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&json);
    for t in tensors {
        out.extend_from_slice(&t.bytes);
    }
    std::fs::write(path, out).unwrap();
}

fn write_index(dir: &Path, map: &[(&str, &str)]) {
    let weight_map: serde_json::Map<String, serde_json::Value> = map
        .iter()
        .map(|(t, f)| (t.to_string(), serde_json::json!(f)))
        .collect();
    let index = serde_json::json!({ "metadata": { "total_size": 0 }, "weight_map": weight_map });
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_vec_pretty(&index).unwrap(),
    )
    .unwrap();
}

fn value(i: usize) -> f32 {
    (i as f32 * 0.37).sin() * 3.0
}

/// What block `ranges` of a row-major `[rows, cols]` tensor of `value`s holds.
fn expected(cols: usize, rows: std::ops::Range<usize>, c: std::ops::Range<usize>) -> Vec<f64> {
    rows.flat_map(|r| c.clone().map(move |j| value(r * cols + j) as f64))
        .collect()
}

#[test]
fn blocks_of_a_single_file_in_any_dtype() {
    let dir = TempDir::new("hf-single");
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &[
            f32s("model.embed_tokens.weight", &[6, 4], value),
            bf16s("model.norm.weight", &[4], value),
            f32s("model.layers.0.mlp.up_proj.weight", &[2, 3, 5], value),
        ],
    );
    let w = HfWeights::open(dir.path()).unwrap();
    assert_eq!(
        w.names().collect::<Vec<_>>(),
        [
            "model.embed_tokens.weight",
            "model.layers.0.mlp.up_proj.weight",
            "model.norm.weight"
        ]
    );
    let info = w.info("model.norm.weight").unwrap();
    assert_eq!((info.dtype, info.shape.clone()), (DType::BF16, vec![4]));

    // Rows (one contiguous range), columns (one run per row), both, and the whole tensor.
    for (rows, cols) in [
        (0..6, 0..4),
        (2..5, 0..4),
        (0..6, 1..3),
        (4..6, 3..4),
        (3..3, 0..4),
    ] {
        let t = w
            .read(
                "model.embed_tokens.weight",
                &[rows.clone(), cols.clone()],
                DType::F64,
            )
            .unwrap();
        assert_eq!(t.shape(), &[rows.len(), cols.len()]);
        assert_eq!(t.to_f64_vec(), expected(4, rows, cols));
    }
    // A 3-D block: the middle dim cut, so one run per (i, j).
    let t = w
        .read(
            "model.layers.0.mlp.up_proj.weight",
            &[1..2, 1..3, 2..5],
            DType::F32,
        )
        .unwrap();
    let want: Vec<f64> = (1..3)
        .flat_map(|j| (2..5).map(move |k| value(15 + j * 5 + k) as f64))
        .collect();
    assert_eq!(t.to_f64_vec(), want);

    // Conversions: bf16 → f64 is exact; f32 → bf16 rounds as `Tensor::to_dtype` does.
    let norm = w.read("model.norm.weight", &[0..4], DType::F64).unwrap();
    let want: Vec<f64> = (0..4)
        .map(|i| half::bf16::from_f32(value(i)).to_f64())
        .collect();
    assert_eq!(norm.to_f64_vec(), want);
    let as_bf16 = w
        .read("model.embed_tokens.weight", &[0..6, 0..4], DType::BF16)
        .unwrap();
    let f32_whole = w
        .read("model.embed_tokens.weight", &[0..6, 0..4], DType::F32)
        .unwrap();
    assert_eq!(as_bf16.dtype(), DType::BF16);
    assert_eq!(as_bf16, f32_whole.to_dtype(DType::BF16));
    let t = Tensor::from_vec(expected(4, 0..6, 0..4), &[6, 4]).unwrap();
    assert_eq!(f32_whole.to_f64_vec(), t.to_f64_vec());
}

#[test]
fn sharded_weights_through_the_index() {
    let dir = TempDir::new("hf-sharded");
    write_safetensors(
        &dir.path().join("model-00001-of-00002.safetensors"),
        &[
            f32s("a", &[2, 2], value),
            // Also in this file but the index puts it in the other: not read from here.
            f32s("b", &[1], |_| -1.0),
        ],
    );
    write_safetensors(
        &dir.path().join("model-00002-of-00002.safetensors"),
        &[f32s("b", &[3], |i| i as f32)],
    );
    write_index(
        dir.path(),
        &[
            ("a", "model-00001-of-00002.safetensors"),
            ("b", "model-00002-of-00002.safetensors"),
        ],
    );
    let w = HfWeights::open(dir.path()).unwrap();
    assert_eq!(w.files().count(), 2);
    assert_eq!(
        w.read("b", &[0..3], DType::F64).unwrap().to_f64_vec(),
        [0.0, 1.0, 2.0]
    );
    assert!(w
        .info("b")
        .unwrap()
        .file
        .ends_with("model-00002-of-00002.safetensors"));
    assert_eq!(
        w.read("a", &[1..2, 0..2], DType::F64).unwrap().to_f64_vec(),
        expected(2, 1..2, 0..2)
    );
}

fn open_err(dir: &Path) -> String {
    match HfWeights::open(dir) {
        Ok(w) => panic!("opened: {w:?}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn broken_directories_are_errors_naming_file_and_tensor() {
    // No weights at all.
    let dir = TempDir::new("hf-empty");
    let e = open_err(dir.path());
    assert!(e.contains("model.safetensors"), "{e}");

    // A truncated file: refused when opened, before any read.
    let dir = TempDir::new("hf-truncated");
    let file = dir.path().join("model.safetensors");
    write_safetensors(&file, &[f32s("w", &[64], value)]);
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 10]).unwrap();
    let e = open_err(dir.path());
    assert!(
        e.contains("model.safetensors") && e.contains("not a complete safetensors"),
        "{e}"
    );

    // Integer weights are not a training dtype.
    let dir = TempDir::new("hf-int");
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &[Stored {
            name: "ids",
            dtype: "I32",
            shape: vec![2],
            bytes: vec![0; 8],
        }],
    );
    let e = open_err(dir.path());
    assert!(e.contains("tensor ids") && e.contains("I32"), "{e}");

    // The index lists a tensor its file does not hold, or a file that is missing.
    let dir = TempDir::new("hf-index");
    write_safetensors(
        &dir.path().join("part.safetensors"),
        &[f32s("a", &[2], value)],
    );
    write_index(
        dir.path(),
        &[("a", "part.safetensors"), ("ghost", "part.safetensors")],
    );
    let e = open_err(dir.path());
    assert!(
        e.contains("tensor ghost") && e.contains("part.safetensors"),
        "{e}"
    );
    write_index(dir.path(), &[("a", "missing.safetensors")]);
    let e = open_err(dir.path());
    assert!(e.contains("missing.safetensors"), "{e}");
    write_index(dir.path(), &[("a", "../elsewhere.safetensors")]);
    let e = open_err(dir.path());
    assert!(e.contains("not a file of this directory"), "{e}");

    // Reads: an unknown tensor, a block that does not fit.
    let dir = TempDir::new("hf-reads");
    write_safetensors(
        &dir.path().join("model.safetensors"),
        &[f32s("w", &[2, 3], value)],
    );
    let w = HfWeights::open(dir.path()).unwrap();
    match w.read("nope", &[0..1], DType::F32) {
        Err(Error::Tensor { tensor, .. }) => assert_eq!(tensor, "nope"),
        other => panic!("{other:?}"),
    }
    for ranges in [vec![0..3, 0..3], vec![0..2], vec![0..2, 2..4]] {
        let e = w.read("w", &ranges, DType::F32).unwrap_err().to_string();
        assert!(
            e.contains("tensor w") && e.contains("does not fit"),
            "{ranges:?}: {e}"
        );
    }
}
