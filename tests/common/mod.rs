//! Shared helpers for the integration tests: launching a mesh of thread ranks, a global
//! reference tensor, and the slow reference for "what should this rank hold".
#![allow(dead_code)]

use dtensor::prelude::*;
use dtensor_placement::local_ranges;
use std::sync::Arc;

/// Runs `f` on every rank of a threads-backed mesh with `axes`, and returns each rank's
/// value (panicking with the rank's error if one failed).
pub fn on_mesh<T: Send>(
    axes: &[(AxisKind, usize)],
    f: impl Fn(&Arc<DeviceMesh>) -> Result<T> + Sync,
) -> Vec<T> {
    let mesh = Mesh::new(axes).unwrap();
    let n = mesh.world_size();
    threads::launch(n, |world| {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        f(&dm)
    })
    .into_iter()
    .enumerate()
    .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
    .collect()
}

/// A global tensor of small integers stored as f64: every sum of a few of them is exact,
/// so reductions in any order give the same value and tests can compare exactly.
pub fn int_global(shape: &[usize]) -> Tensor {
    Tensor::from_fn(shape, |i| ((i * 7919 + 13) % 201) as f64 - 100.0)
}

/// A global tensor whose sums depend on the order they are taken in (for bitwise tests).
pub fn float_global(shape: &[usize]) -> Tensor {
    Tensor::from_fn(shape, |i| {
        (i as f64 * 0.731).sin() * 10f64.powi((i % 7) as i32 - 3)
    })
}

/// What the rank at `coords` must hold under non-partial `placements`: its slice of `g`.
pub fn expected_local(
    mesh: &Mesh,
    placements: &[Placement],
    coords: &[usize],
    g: &Tensor,
) -> Tensor {
    let ranges = local_ranges(mesh, placements, coords, g.shape()).unwrap();
    let mut t = g.clone();
    for (d, r) in ranges.iter().enumerate() {
        t = t.narrow(d, r.start, r.len()).unwrap();
    }
    t
}

/// Row-major flat index of a multi-index.
fn flat_index(shape: &[usize], idx: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

/// Re-splits the terms of every `Partial(sum)` axis so no coordinate holds zeros: adds
/// integer noise that sums to zero along the axis (exact in f64 for integer-valued data).
/// `distribute` puts the whole value on coordinate 0; this makes partial tests honest.
pub fn spread_partial_terms(t: AnyDTensor) -> AnyDTensor {
    let mesh = t.device_mesh().clone();
    let placements: Vec<Placement> = t.placements().to_vec();
    let global: Vec<usize> = t.global_shape().to_vec();
    let offset =
        dtensor_placement::global_offset(mesh.mesh(), &placements, mesh.coords(), &global).unwrap();
    let mut local = t.as_local().clone();
    let shape: Vec<usize> = local.shape().to_vec();
    let noise = |c: usize, g: usize| ((g * 31 + c * 17) % 11) as f64 - 5.0;
    let vals = local.as_mut_slice::<f64>().unwrap();
    for (axis, p) in placements.iter().enumerate() {
        if *p != Placement::Partial(PartialOp::Sum) {
            continue;
        }
        let (n, c) = (mesh.mesh().size(axis), mesh.coords()[axis]);
        let mut idx = vec![0usize; shape.len()];
        for v in vals.iter_mut() {
            let gidx: Vec<usize> = idx.iter().zip(offset.iter()).map(|(i, o)| i + o).collect();
            let g = flat_index(&global, &gidx);
            *v += if c == 0 {
                -(1..n).map(|k| noise(k, g)).sum::<f64>()
            } else {
                noise(c, g)
            };
            for d in (0..shape.len()).rev() {
                idx[d] += 1;
                if idx[d] < shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
    AnyDTensor::from_local(local, &global, &placements, &mesh).unwrap()
}

/// Distributes `g` from rank 0 with `placements`, spreading partial terms.
pub fn distribute_any(
    g: &Tensor,
    placements: &[Placement],
    mesh: &Arc<DeviceMesh>,
) -> Result<AnyDTensor> {
    let src = (mesh.rank() == 0).then_some(g);
    let t = AnyDTensor::distribute(src, 0, placements, mesh)?;
    Ok(spread_partial_terms(t))
}

/// Sum of the per-axis counters of a device mesh.
pub fn total_counters(mesh: &DeviceMesh) -> Vec<(AxisKind, CounterSnapshot)> {
    mesh.counters()
}

pub const SUM: Placement = Placement::Partial(PartialOp::Sum);

/// `full` laid out as `L` on this rank (rank 0 is the source), partial terms spread so no
/// rank holds the whole value.
pub fn dist<L: Layout>(full: &Tensor, mesh: &Arc<DeviceMesh>) -> DTensor<L> {
    let x = DTensor::<L>::distribute(Some(full).filter(|_| mesh.rank() == 0), 0, mesh).unwrap();
    if !L::placements().iter().any(|p| p.is_partial()) {
        return x;
    }
    DTensor::try_from_any(spread_partial_terms(x.into_any())).unwrap()
}

/// The workspace's target directory (`CARGO_TARGET_DIR` or `target/`), absolute: tests that
/// run cargo themselves build in a folder under it.
pub fn target_dir() -> std::path::PathBuf {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| root.join("target"));
    if target.is_absolute() {
        target
    } else {
        root.join(target)
    }
}

/// `⟨a, b⟩` over every element, in f64.
pub fn dot(a: &Tensor, b: &Tensor) -> f64 {
    a.to_f64_vec()
        .iter()
        .zip(b.to_f64_vec())
        .map(|(x, y)| x * y)
        .sum()
}

/// `d⟨seed, f(x)⟩/dx` by central differences.
pub fn numeric_grad(x: &Tensor, seed: &Tensor, f: &dyn Fn(&Tensor) -> Tensor) -> Vec<f64> {
    let h = 1e-6;
    let base = x.to_f64_vec();
    (0..base.len())
        .map(|i| {
            let at = |d: f64| {
                let mut v = base.clone();
                v[i] += d;
                dot(seed, &f(&Tensor::from_vec(v, x.shape()).unwrap()))
            };
            (at(h) - at(-h)) / (2.0 * h)
        })
        .collect()
}

/// A seeded `shape` tensor of f64 values in [−1, 1) (SplitMix64), the same on every rank.
pub fn values(shape: &[usize], seed: u64) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    Tensor::from_fn(shape, |_| {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 52) as f64 * 2.0 - 1.0
    })
}
