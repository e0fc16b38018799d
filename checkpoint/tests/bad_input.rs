//! Bad checkpoints: every rank gets an `Err` naming the file and tensor, never a panic, a
//! hang or a wrong value; and a byte-flipping, truncating fuzz over a tiny checkpoint.

mod common;

use common::TempDir;
use dtensor_checkpoint::index::Index;
use dtensor_checkpoint::{load, read_index, save_with, Error, SaveOptions, Target};
use dtensor_collectives::threads;
use dtensor_core::{AnyDTensor, DeviceMesh};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{local_ranges, AxisKind, Mesh, Placement};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use Placement::{Replicate as R, Shard as S};

fn specs() -> Vec<(&'static str, Vec<usize>, DType, Vec<Placement>)> {
    vec![
        ("a", vec![6, 4], DType::F32, vec![S(0)]),
        ("b", vec![5], DType::F64, vec![R]),
        ("c", vec![3, 5], DType::BF16, vec![S(1)]),
    ]
}

fn full(t: usize, shape: &[usize], dtype: DType) -> Tensor {
    let n = shape.iter().product::<usize>();
    Tensor::from_f64_vec(
        (0..n).map(|i| (t * 100 + i) as f64 * 0.5 - 3.0).collect(),
        shape,
        dtype,
    )
    .unwrap()
}

fn piece(
    t: usize,
    shape: &[usize],
    dtype: DType,
    p: &[Placement],
    dm: &Arc<DeviceMesh>,
) -> AnyDTensor {
    let mut local = full(t, shape, dtype);
    for (d, r) in local_ranges(dm.mesh(), p, dm.coords(), shape)
        .unwrap()
        .iter()
        .enumerate()
    {
        local = local.narrow(d, r.start, r.len()).unwrap().deep_clone();
    }
    AnyDTensor::from_local(local, shape, p, dm).unwrap()
}

fn mesh2() -> Mesh {
    Mesh::new(&[(AxisKind::Tp, 2)]).unwrap()
}

/// A tiny checkpoint on 2 ranks, with 16-byte checksum blocks (so partial reads happen).
fn save_tiny(dir: &Path) {
    for r in threads::launch(2, |world| -> Result<(), Error> {
        let dm = DeviceMesh::new(world.clone(), mesh2())?;
        let ts: Vec<AnyDTensor> = specs()
            .iter()
            .enumerate()
            .map(|(i, (_, s, d, p))| piece(i, s, *d, p, &dm))
            .collect();
        let named: Vec<(&str, &AnyDTensor)> = specs().iter().map(|s| s.0).zip(&ts).collect();
        save_with(
            dir,
            &world,
            &named,
            &BTreeMap::new(),
            &SaveOptions { block_bytes: 16 },
        )?;
        Ok(())
    }) {
        r.unwrap();
    }
}

/// Loads on 2 ranks with the targets' layouts swapped per `alt` (a resharding load), each
/// rank checking values when it succeeds. Returns each rank's result as text.
fn try_load(
    dir: &Path,
    alt: bool,
    edit: impl Fn(usize, &mut Target) + Sync,
) -> Vec<Result<(), String>> {
    let layouts: Vec<Vec<Placement>> = if alt {
        vec![vec![S(1)], vec![S(0)], vec![S(0)]]
    } else {
        specs().into_iter().map(|s| s.3).collect()
    };
    threads::launch(2, |world| -> Result<(), Error> {
        let dm = DeviceMesh::new(world.clone(), mesh2())?;
        let specs = specs();
        let targets: Vec<Target> = specs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut t = Target {
                    name: s.0,
                    shape: &s.1,
                    dtype: s.2,
                    placements: &layouts[i],
                    mesh: &dm,
                };
                edit(i, &mut t);
                t
            })
            .collect();
        let got = load(dir, &world, &targets)?;
        for (i, g) in got.iter().enumerate() {
            let want = piece(i, &specs[i].1, specs[i].2, &layouts[i], &dm);
            let (a, b) = (g.as_local().to_f64_vec(), want.as_local().to_f64_vec());
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()) && a.len() == b.len(),
                "wrong value for {}",
                specs[i].0
            );
        }
        Ok(())
    })
    .into_iter()
    .map(|r| r.map_err(|e| e.to_string()))
    .collect()
}

fn all_err(res: &[Result<(), String>], needles: &[&str]) {
    for r in res {
        let e = r.as_ref().expect_err("expected an error on every rank");
        for n in needles {
            assert!(e.contains(n), "`{e}` should mention `{n}`");
        }
    }
}

fn data_file(dir: &Path, rank: usize) -> std::path::PathBuf {
    let index = read_index(dir).unwrap();
    dir.join(&index.files.iter().find(|f| f.rank == rank).unwrap().name)
}

#[test]
fn clean_load_works() {
    let dir = TempDir::new("clean");
    save_tiny(dir.path());
    for alt in [false, true] {
        for r in try_load(dir.path(), alt, |_, _| {}) {
            r.unwrap();
        }
    }
}

#[test]
fn missing_truncated_corrupted_shard() {
    let dir = TempDir::new("bad");
    save_tiny(dir.path());
    let f1 = data_file(dir.path(), 1);
    let name = f1.file_name().unwrap().to_str().unwrap().to_string();
    let pristine = std::fs::read(&f1).unwrap();

    std::fs::remove_file(&f1).unwrap();
    all_err(
        &try_load(dir.path(), false, |_, _| {}),
        &[&name, "tensor a"],
    );

    std::fs::write(&f1, &pristine[..pristine.len() - 3]).unwrap();
    all_err(
        &try_load(dir.path(), false, |_, _| {}),
        &[&name, "tensor a", "truncated"],
    );

    let mut bad = pristine.clone();
    let last = bad.len() - 1; // the last tensor's last byte
    bad[last] ^= 0x10;
    std::fs::write(&f1, &bad).unwrap();
    all_err(
        &try_load(dir.path(), false, |_, _| {}),
        &[&name, "checksum"],
    );
    // Whole-file verification catches it too.
    assert!(matches!(
        dtensor_checkpoint::verify_files(dir.path()),
        Err(Error::Checksum { .. })
    ));

    std::fs::write(&f1, &pristine).unwrap();
    dtensor_checkpoint::verify_files(dir.path()).unwrap();
    for r in try_load(dir.path(), false, |_, _| {}) {
        r.unwrap();
    }
}

#[test]
fn index_referencing_a_missing_file() {
    let dir = TempDir::new("ref");
    save_tiny(dir.path());
    let mut index: Index = read_index(dir.path()).unwrap();
    for f in &mut index.files {
        f.name = format!("moved-{}", f.name);
    }
    for t in index.tensors.values_mut() {
        for s in &mut t.shards {
            s.file = format!("moved-{}", s.file);
        }
    }
    std::fs::write(dir.path().join("index.json"), index.to_json_text()).unwrap();
    all_err(
        &try_load(dir.path(), false, |_, _| {}),
        &["moved-g", "tensor a"],
    );
}

#[test]
fn shape_dtype_layout_version_mismatch() {
    let dir = TempDir::new("mismatch");
    save_tiny(dir.path());
    all_err(
        &try_load(dir.path(), false, |i, t| {
            if i == 0 {
                t.shape = &[6, 5]
            }
        }),
        &["index.json", "tensor a", "[6, 4]"],
    );
    all_err(
        &try_load(dir.path(), false, |i, t| {
            if i == 1 {
                t.dtype = DType::F32
            }
        }),
        &["tensor b", "F64"],
    );
    // A layout the target mesh cannot hold: Shard(2) of a matrix; two placements on a 1-axis mesh.
    all_err(
        &try_load(dir.path(), false, |i, t| {
            if i == 2 {
                t.placements = &[S(2)]
            }
        }),
        &["tensor c", "layout"],
    );
    all_err(
        &try_load(dir.path(), false, |i, t| {
            if i == 2 {
                t.placements = &[S(0), R]
            }
        }),
        &["tensor c"],
    );
    // A tensor the checkpoint lacks.
    all_err(
        &try_load(dir.path(), false, |i, t| {
            if i == 1 {
                t.name = "nope"
            }
        }),
        &["tensor nope", "not in the checkpoint"],
    );
    // Another format version.
    let path = dir.path().join("index.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, text.replace("\"version\": 1", "\"version\": 2")).unwrap();
    all_err(
        &try_load(dir.path(), false, |_, _| {}),
        &["index.json", "version 2"],
    );
}

/// A crash mid-save (new data files written, index not yet renamed) leaves the previous
/// checkpoint loadable; a completed save replaces it and removes the old files.
#[test]
fn interrupted_save_keeps_previous() {
    let dir = TempDir::new("atomic");
    save_tiny(dir.path());
    let before = read_index(dir.path()).unwrap();
    // Simulate the debris of a crashed next save.
    std::fs::write(
        dir.path().join("g000002-rank00000.safetensors"),
        b"half written",
    )
    .unwrap();
    std::fs::write(
        dir.path().join("g000002-rank00001.safetensors.tmp"),
        b"half",
    )
    .unwrap();
    std::fs::write(dir.path().join("index.json.tmp"), b"{").unwrap();
    for r in try_load(dir.path(), true, |_, _| {}) {
        r.unwrap();
    }
    save_tiny(dir.path());
    let after = read_index(dir.path()).unwrap();
    assert_eq!(after.generation, before.generation + 2);
    let names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
    for r in try_load(dir.path(), false, |_, _| {}) {
        r.unwrap();
    }
}

/// 1,000 corruptions (bit flips, byte overwrites, truncations) of the index or a data file:
/// each load is an `Err` on every rank or a correct load (checked inside `try_load`).
#[test]
fn fuzz_flips_and_truncations() {
    let dir = TempDir::new("fuzz");
    save_tiny(dir.path());
    let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    let pristine: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut errs, mut oks) = (0, 0);
    for case in 0..1000 {
        let k = next() as usize % files.len();
        let mut bytes = pristine[k].clone();
        match next() % 4 {
            0 | 1 => {
                let flips = 1 + next() % 3;
                for _ in 0..flips {
                    let i = next() as usize % bytes.len();
                    bytes[i] ^= 1 << (next() % 8);
                }
            }
            2 => {
                let i = next() as usize % bytes.len();
                bytes[i] = next() as u8;
            }
            _ => {
                let n = next() as usize % bytes.len();
                bytes.truncate(n);
            }
        }
        std::fs::write(&files[k], &bytes).unwrap();
        let alt = case % 2 == 1;
        let res = try_load(dir.path(), alt, |_, _| {});
        // Every rank agrees.
        assert_eq!(res[0].is_ok(), res[1].is_ok(), "case {case}: {res:?}");
        if res[0].is_ok() {
            oks += 1;
        } else {
            errs += 1;
            for r in &res {
                let e = r.as_ref().unwrap_err();
                assert!(
                    !e.contains("wrong value") && !e.contains("panicked"),
                    "case {case}: {e}"
                );
            }
        }
        std::fs::write(&files[k], &pristine[k]).unwrap();
    }
    eprintln!("fuzz: {errs} errors, {oks} correct loads");
    assert!(errs > 900, "{errs}");
}
