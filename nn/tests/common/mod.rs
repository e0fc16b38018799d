//! Shared helpers: thread-rank meshes, seeded global tensors, slicing, error measures.
#![allow(dead_code)]

use dtensor_collectives::threads;
use dtensor_core::{DTensor, DeviceMesh, Gradients, Result};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::{Activation, DataMode, GptConfig, Init, NormKind, ParamKind, Precision, Weight};
use dtensor_placement::{AxisKind, Layout, Mesh};
use std::sync::Arc;

/// Runs `f` on every rank of a `[Dp: dp, Ep: 1, Cp: 1, Tp: tp]` mesh of threads (the
/// layers' axes); each rank's value.
pub fn on_mesh<T: Send>(
    dp: usize,
    tp: usize,
    f: impl Fn(&Arc<DeviceMesh>) -> Result<T> + Sync,
) -> Vec<T> {
    on_model_mesh(1, dp, 1, 1, tp, f)
}

/// Runs `f` on every rank of the model mesh with these degrees (`[Pp,] Dp, Ep, Cp, Tp`,
/// `Pp` only when `pp > 1`).
pub fn on_model_mesh<T: Send>(
    pp: usize,
    dp: usize,
    ep: usize,
    cp: usize,
    tp: usize,
    f: impl Fn(&Arc<DeviceMesh>) -> Result<T> + Sync,
) -> Vec<T> {
    let pp_axis = (pp > 1).then_some((AxisKind::Pp, pp));
    let axes: Vec<(AxisKind, usize)> = pp_axis
        .into_iter()
        .chain([
            (AxisKind::Dp, dp),
            (AxisKind::Ep, ep),
            (AxisKind::Cp, cp),
            (AxisKind::Tp, tp),
        ])
        .collect();
    on_axes(&axes, f)
}

/// Runs `f` on every rank of a mesh of `axes` on threads; each rank's value.
pub fn on_axes<T: Send>(
    axes: &[(AxisKind, usize)],
    f: impl Fn(&Arc<DeviceMesh>) -> Result<T> + Sync,
) -> Vec<T> {
    let mesh = Mesh::new(axes).unwrap();
    threads::launch(mesh.world_size(), |world| {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        f(&dm)
    })
    .into_iter()
    .enumerate()
    .map(|(r, res)| res.unwrap_or_else(|e| panic!("rank {r}: {e}")))
    .collect()
}

/// A seeded global f64 tensor with entries ~ Normal(0, 1).
pub fn randn(seed: u64, shape: &[usize]) -> Tensor {
    Init::Normal { std: 1.0 }.full(seed, 0, shape, DType::F64)
}

/// `n` token ids and their next-token targets from the sequence `seq(i) % 20` (the tiny
/// GPT's vocabulary): ids `0..n`, targets `1..n + 1`.
pub fn next_tokens(n: usize, seq: impl Fn(usize) -> usize) -> (Tensor, Tensor) {
    let seq: Vec<i64> = (0..n + 1).map(|i| (seq(i) % 20) as i64).collect();
    (
        Tensor::from_vec(seq[..n].to_vec(), &[n]).unwrap(),
        Tensor::from_vec(seq[1..].to_vec(), &[n]).unwrap(),
    )
}

/// Every rank's piece of `g` laid out as `L` (no communication: each slices its own).
pub fn piece<L: Layout>(g: &Tensor, mesh: &Arc<DeviceMesh>) -> Result<DTensor<L>> {
    DTensor::from_global(g, mesh)
}

/// `max |a − b| / max |b|`: the error relative to the reference's scale.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    assert_eq!(a.shape(), b.shape(), "shapes differ");
    let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
    let scale = b.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-300);
    a.iter()
        .zip(&b)
        .fold(0f64, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Asserts `rel_err(a, b) <= tol`, naming `what`; returns the error.
pub fn assert_close(what: &str, a: &Tensor, b: &Tensor, tol: f64) -> f64 {
    let e = rel_err(a, b);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
    e
}

/// The tensor-parallel sizes and sequence modes every layer test covers.
pub const TPS: [usize; 3] = [1, 2, 4];

/// A parameter's gradient reduced as the optimizer takes it (summed over `Dp`, reduced
/// over `Tp` where needed): the full-batch gradient, as a whole tensor. (`dp` only checks
/// the mesh.)
pub fn reduced<D: DataMode, K: ParamKind>(
    p: &Weight<D, K>,
    g: &mut Gradients,
    dp: usize,
) -> Result<Tensor> {
    let g = p.reduced_grad(g)?;
    assert_eq!(g.device_mesh().mesh().size(0), dp);
    g.full_tensor()
}

/// Runs `f` on every rank of a `[Pp: pp, Dp: dp, Ep: 1, Cp: 1, Tp: tp]` mesh of threads
/// (`Pp` even when `pp` is 1); each rank's value.
pub fn on_pp_mesh<T: Send>(
    pp: usize,
    dp: usize,
    tp: usize,
    f: impl Fn(&Arc<DeviceMesh>) -> Result<T> + Sync,
) -> Vec<T> {
    on_axes(
        &[
            (AxisKind::Pp, pp),
            (AxisKind::Dp, dp),
            (AxisKind::Ep, 1),
            (AxisKind::Cp, 1),
            (AxisKind::Tp, tp),
        ],
        f,
    )
}

/// The small f64 GPT the model tests train: vocabulary 20, hidden 16, 4 heads, SwiGLU
/// MLP of 32, RMSNorm, biases; `layers` blocks on samples of `seq_len` tokens.
pub fn tiny_gpt(layers: usize, seq_len: usize, seed: u64) -> GptConfig {
    GptConfig {
        vocab: 20,
        hidden: 16,
        heads: 4,
        kv_heads: None,
        rope_style: dtensor_kernels::ops::RopeStyle::Interleaved,
        attn: Default::default(),
        layers,
        ffn: 32,
        seq_len,
        norm: NormKind::Rms,
        activation: Activation::SwiGlu,
        bias: true,
        eps: 1e-5,
        dtype: DType::F64,
        seed,
        precision: Precision::default(),
        recompute: false,
        context: Default::default(),
        moe: None,
        z_loss: 0.0,
        tie_embeddings: false,
    }
}

/// Losses and whole parameters by name.
pub type Run = (Vec<f64>, std::collections::BTreeMap<String, Tensor>);

/// One [`Run`] from every rank's losses and parameters: the same losses everywhere, each
/// parameter by name (a pipeline stage holds only its layers'; replicas agree bitwise).
pub fn gather(ranks: Vec<(Vec<f64>, Vec<dtensor_nn::NamedParam>)>) -> Run {
    let mut named = std::collections::BTreeMap::new();
    for (losses, params) in &ranks {
        assert_eq!(losses, &ranks[0].0, "every rank reports the same losses");
        for p in params {
            if let Some(old) = named.insert(p.name.clone(), p.value.clone()) {
                assert_eq!(old, p.value, "{}: replicas differ", p.name);
            }
        }
    }
    (ranks[0].0.clone(), named)
}
