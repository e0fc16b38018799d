//! Save on one mesh and layout, load on others: values must come back bitwise.

mod common;

use common::TempDir;
use dtensor_checkpoint::{load, load_typed, read_index, save, Error, Target};
use dtensor_collectives::threads;
use dtensor_core::{AnyDTensor, DeviceMesh};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{layout, local_ranges, AxisKind, Mesh, Placement, Shard, Tp};
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use Placement::{Invariant as I, Replicate as R, Shard as S};

/// The value of global element `i` of tensor `t`: distinct bits everywhere.
fn value(t: usize, i: usize) -> f64 {
    (t * 1000 + i) as f64 * 0.37 + 0.001
}

/// The test tensors: name, global shape, dtype.
fn specs() -> Vec<(&'static str, Vec<usize>, DType)> {
    vec![
        ("w.col", vec![10, 6], DType::F32),
        ("w.row", vec![7, 5], DType::F64),
        ("bias", vec![9], DType::BF16),
        ("table", vec![5, 3, 4], DType::F32),
        ("scalar", vec![], DType::F64),
        ("ids", vec![6], DType::I64),
    ]
}

fn full(t: usize, shape: &[usize], dtype: DType) -> Tensor {
    let n = shape.iter().product::<usize>();
    Tensor::from_f64_vec((0..n).map(|i| value(t, i)).collect(), shape, dtype).unwrap()
}

/// This rank's piece of tensor `t` laid out `placements` on `mesh`.
fn piece(
    t: usize,
    shape: &[usize],
    dtype: DType,
    placements: &[Placement],
    mesh: &Arc<DeviceMesh>,
) -> AnyDTensor {
    let mut local = full(t, shape, dtype);
    let ranges = local_ranges(mesh.mesh(), placements, mesh.coords(), shape).unwrap();
    for (d, r) in ranges.iter().enumerate() {
        local = local.narrow(d, r.start, r.len()).unwrap().deep_clone();
    }
    AnyDTensor::from_local(local, shape, placements, mesh).unwrap()
}

/// Saves the specs on `[Dp=2, Tp=2]`, FSDP-like (sharded over Dp too) or DDP-like.
fn save_dp2_tp2(dir: &Path, fsdp: bool) {
    let mesh = Mesh::new(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)]).unwrap();
    let layouts: Vec<Vec<Placement>> = if fsdp {
        vec![
            vec![S(0), S(1)],
            vec![S(1), S(0)],
            vec![S(0), R],
            vec![S(0), S(0)],
            vec![R, I],
            vec![S(0), I],
        ]
    } else {
        vec![
            vec![R, S(1)],
            vec![R, S(0)],
            vec![R, I],
            vec![R, S(2)],
            vec![R, I],
            vec![I, R],
        ]
    };
    let res = threads::launch(4, |world| -> Result<(), Error> {
        let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
        let ts: Vec<AnyDTensor> = specs()
            .iter()
            .zip(&layouts)
            .enumerate()
            .map(|(i, ((_, s, d), p))| piece(i, s, *d, p, &dm))
            .collect();
        let named: Vec<(&str, &AnyDTensor)> = specs().iter().map(|s| s.0).zip(ts.iter()).collect();
        let mut extra = BTreeMap::new();
        extra.insert("step".to_string(), "3".to_string());
        save(dir, &world, &named, &extra)?;
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
}

/// Loads every spec on `mesh` (with `world` ranks; `sub` cuts a pipeline axis) and checks
/// bitwise.
fn load_and_check(
    dir: &Path,
    world_size: usize,
    mesh: Mesh,
    layouts: Vec<Vec<Placement>>,
    sub: Option<AxisKind>,
) {
    let res = threads::launch(world_size, |world| -> Result<(), Error> {
        let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
        // Pipeline: stage s loads the specs with index % stages == s on its sub-mesh.
        let (dm, keep): (Arc<DeviceMesh>, Vec<usize>) = match sub {
            Some(axis) => {
                let i = dm.mesh().index_of(axis).unwrap();
                let (stage, stages) = (dm.coords()[i], dm.mesh().size(i));
                (
                    dm.sub_mesh(axis)?,
                    (0..specs().len()).filter(|t| t % stages == stage).collect(),
                )
            }
            None => (dm, (0..specs().len()).collect()),
        };
        let specs = specs();
        let targets: Vec<Target> = keep
            .iter()
            .map(|&t| Target {
                name: specs[t].0,
                shape: &specs[t].1,
                dtype: specs[t].2,
                placements: &layouts[t],
                mesh: &dm,
            })
            .collect();
        let got = load(dir, &world, &targets)?;
        for (&t, g) in keep.iter().zip(&got) {
            let want = piece(t, &specs[t].1, specs[t].2, &layouts[t], &dm);
            assert_eq!(
                g.as_local().shape(),
                want.as_local().shape(),
                "{}",
                specs[t].0
            );
            let (a, b) = (g.as_local().to_f64_vec(), want.as_local().to_f64_vec());
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{} on rank {}: {a:?} vs {b:?}",
                specs[t].0,
                world.rank()
            );
        }
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
}

fn reshard_matrix(fsdp: bool) {
    let dir = TempDir::new(if fsdp { "fsdp" } else { "ddp" });
    save_dp2_tp2(dir.path(), fsdp);
    let index = read_index(dir.path()).unwrap();
    assert_eq!(index.extra["step"], "3");
    // No duplicates: the stored shards of each tensor hold exactly its elements.
    for (name, spec) in specs().iter().map(|s| (s.0, s)) {
        let e = &index.tensors[name];
        let stored: usize = e
            .shards
            .iter()
            .map(|s| s.shape.iter().product::<usize>())
            .sum();
        assert_eq!(stored, spec.1.iter().product::<usize>(), "{name}");
    }
    // tp=4
    let tp4 = Mesh::new(&[(AxisKind::Tp, 4)]).unwrap();
    load_and_check(
        dir.path(),
        4,
        tp4,
        vec![
            vec![S(0)],
            vec![S(1)],
            vec![S(0)],
            vec![S(2)],
            vec![I],
            vec![R],
        ],
        None,
    );
    // dp=1 (one rank)
    let dp1 = Mesh::new(&[(AxisKind::Dp, 1)]).unwrap();
    load_and_check(
        dir.path(),
        1,
        dp1,
        vec![vec![R], vec![R], vec![S(0)], vec![R], vec![R], vec![R]],
        None,
    );
    // pp=2, tp=2: each stage loads half the tensors on its [Tp=2] sub-mesh.
    let pp2 = Mesh::new(&[(AxisKind::Pp, 2), (AxisKind::Tp, 2)]).unwrap();
    load_and_check(
        dir.path(),
        4,
        pp2,
        vec![
            vec![S(1)],
            vec![S(0)],
            vec![I],
            vec![S(1)],
            vec![R],
            vec![S(0)],
        ],
        Some(AxisKind::Pp),
    );
    // dp=2,tp=2 again, in the other data mode's layout.
    let dp2tp2 = Mesh::new(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)]).unwrap();
    load_and_check(
        dir.path(),
        4,
        dp2tp2,
        vec![
            vec![S(1), S(0)],
            vec![S(0), S(1)],
            vec![R, S(0)],
            vec![S(1), S(2)],
            vec![R, R],
            vec![S(0), S(0)],
        ],
        None,
    );
}

#[test]
fn reshard_from_fsdp_dp2_tp2() {
    reshard_matrix(true);
}

#[test]
fn reshard_from_ddp_dp2_tp2() {
    reshard_matrix(false);
}

#[test]
fn typed_load_checks_the_asked_layout() {
    let dir = TempDir::new("typed");
    save_dp2_tp2(dir.path(), true);
    let mesh = Mesh::new(&[(AxisKind::Tp, 2)]).unwrap();
    let res = threads::launch(2, |world| -> Result<(), Error> {
        let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
        // Stored as [Dp: S(0), Tp: S(1)]; asked as Tp: Shard<0>.
        let w = load_typed::<layout![Tp: Shard<0>]>(
            dir.path(),
            &world,
            "w.col",
            &[10, 6],
            DType::F32,
            &dm,
        )?;
        let want = piece(0, &[10, 6], DType::F32, &[S(0)], &dm);
        assert_eq!(w.as_local().to_f64_vec(), want.as_local().to_f64_vec());
        Ok(())
    });
    for r in res {
        r.unwrap();
    }
    let _ = Tp;
}

#[test]
fn partial_is_refused_on_every_rank() {
    let dir = TempDir::new("partial");
    let mesh = Mesh::new(&[(AxisKind::Tp, 2)]).unwrap();
    let res = threads::launch(2, |world| -> Result<(), Error> {
        let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
        let p = AnyDTensor::from_local(
            Tensor::zeros(&[3], DType::F32),
            &[3],
            &[Placement::Partial(dtensor_placement::PartialOp::Sum)],
            &dm,
        )?;
        save(dir.path(), &world, &[("g", &p)], &BTreeMap::new())?;
        Ok(())
    });
    for r in res {
        let e = r.unwrap_err().to_string();
        assert!(e.contains("tensor g") && e.contains("Partial"), "{e}");
    }
    assert!(!dir.path().join("index.json").exists());
}
