//! The device path: the same model code on NCCL ranks (every tensor in GPU memory) against
//! the threads backend (host memory). Redistributions move the same bits; a TP layer's
//! training steps (norm, SwiGLU MLP, AdamW with clipping) agree with the host to f64
//! rounding; AdamW's device kernel steps bit for bit as the host.
//!
//! Every test needs a CUDA GPU, libnccl, NVRTC and cuBLAS, and a build with
//! `--features cuda,nccl`: ignored otherwise (run with `--include-ignored` on a GPU machine).

use dtensor::collectives::threads;
use dtensor::core::{AnyDTensor, DTensor, DeviceMesh, Result, Tape};
use dtensor::kernels::{DType, Tensor};
use dtensor::nn::*;
use dtensor::placement::{
    layout, AxisKind, Invariant, Mesh, ParallelConfig, PartialOp, Placement, Tp,
};
use std::sync::Arc;

/// Runs `f` on every rank of `mesh` on threads (host memory); each rank's value.
fn on_host<T: Send>(mesh: &Mesh, f: impl Fn(&Arc<DeviceMesh>) -> Result<T> + Sync) -> Vec<T> {
    threads::launch(mesh.world_size(), |world| {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        f(&dm)
    })
    .into_iter()
    .enumerate()
    .map(|(r, res)| res.unwrap_or_else(|e| panic!("host rank {r}: {e}")))
    .collect()
}

/// Runs `f` on every rank of `mesh` on NCCL thread ranks (rank r on GPU r mod the GPU
/// count; the mesh keeps its tensors there); each rank's value.
#[cfg(feature = "nccl")]
fn on_gpus<T: Send>(mesh: &Mesh, f: impl Fn(&Arc<DeviceMesh>) -> Result<T> + Sync) -> Vec<T> {
    use dtensor::collectives::{nccl, Communicator};
    nccl::launch(mesh.world_size(), |comm| -> Result<T> {
        let dm = DeviceMesh::new(comm as Arc<dyn Communicator>, mesh.clone())?;
        assert!(
            dm.device().is_some(),
            "an NCCL mesh keeps its tensors on a GPU"
        );
        f(&dm)
    })
    .into_iter()
    .enumerate()
    .map(|(r, res)| res.unwrap_or_else(|e| panic!("GPU rank {r}: {e}")))
    .collect()
}

#[cfg(not(feature = "nccl"))]
fn on_gpus<T: Send>(_mesh: &Mesh, _f: impl Fn(&Arc<DeviceMesh>) -> Result<T> + Sync) -> Vec<T> {
    panic!("this test binary was built without the `nccl` feature: needs a CUDA GPU, libnccl, NVRTC and cuBLAS, and --features cuda,nccl")
}

fn seeded(seed: u64, shape: &[usize], dtype: DType) -> Tensor {
    Init::Normal { std: 1.0 }.full(seed, 0, shape, dtype)
}

/// Every redistribution kind on two Tp ranks, f32 `[6, 5]` (uneven over 2 on dim 1):
/// each step's local piece, read back to the host.
fn redistributions(dm: &Arc<DeviceMesh>) -> Result<Vec<Vec<f64>>> {
    let g = seeded(7, &[6, 5], DType::F32);
    let shard = |d: usize| vec![Placement::Shard(d)];
    let mut out = Vec::new();
    let mut push = |t: &AnyDTensor| -> Result<()> {
        if dm.device().is_some() && t.as_local().numel() > 0 {
            assert!(t.as_local().is_cuda(), "a piece left the device");
        }
        out.push(t.as_local().to_host()?.to_f64_vec());
        Ok(())
    };
    let rep = vec![Placement::Replicate];
    for (from, to) in [
        (shard(0), rep.clone()),                   // all-gather, contiguous
        (shard(1), rep.clone()),                   // all-gather of column blocks
        (shard(0), shard(1)),                      // all-to-all of column blocks
        (shard(1), shard(0)),                      // and back
        (rep.clone(), shard(1)),                   // local chunk
        (vec![Placement::Invariant], rep.clone()), // no-op
    ] {
        let t = AnyDTensor::from_global(&g, &from, dm)?;
        push(&t)?;
        push(&t.redistribute(&to)?)?;
    }
    // Partial terms: each rank's own, then reduce-scatter (rows and columns) and all-reduce.
    let term = seeded(8 + dm.rank() as u64, &[6, 5], DType::F32);
    let partial = vec![Placement::Partial(PartialOp::Sum)];
    for to in [shard(0), shard(1), vec![Placement::Invariant]] {
        let t = AnyDTensor::from_local(term.clone(), &[6, 5], &partial, dm)?;
        push(&t.redistribute(&to)?)?;
    }
    // distribute from rank 1 and the full tensor back.
    let t = AnyDTensor::distribute((dm.rank() == 1).then_some(&g), 1, &shard(1), dm)?;
    push(&t)?;
    out.push(t.full_tensor()?.to_host()?.to_f64_vec());
    Ok(out)
}

#[test]
#[ignore = "needs a CUDA GPU, libnccl, NVRTC and cuBLAS, and --features cuda,nccl"]
fn redistribute_tp2_device_equals_host_bitwise() {
    let mesh = Mesh::new(&[(AxisKind::Tp, 2)]).unwrap();
    let host = on_host(&mesh, redistributions);
    let gpu = on_gpus(&mesh, redistributions);
    // Two-rank sums are the same bits in either order, so even the reductions agree.
    for (r, (h, d)) in host.iter().zip(&gpu).enumerate() {
        for (i, (a, b)) in h.iter().zip(d).enumerate() {
            assert_eq!(a, b, "rank {r}, step {i}");
        }
    }
}

const T: usize = 8;
const H: usize = 8;
const FFN: usize = 16;

/// A LayerNorm and a SwiGLU MLP, tensor-parallel over Tp (f64 parameters).
struct Tiny {
    norm: Norm<NoSp>,
    mlp: ParallelMlp<NoSp>,
}

impl Module for Tiny {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        self.norm.visit_params(&join_name(prefix, "norm"), v)?;
        self.mlp.visit_params(&join_name(prefix, "mlp"), v)
    }
}

/// Three training steps (loss `mean_t Σ_j y[t, j]·target[t, j]`, AdamW, clipping at 0.5):
/// every parameter and every step's gradient norm, on the host.
fn tiny_steps(dm: &Arc<DeviceMesh>) -> Result<(Vec<Vec<f64>>, Vec<f64>)> {
    let init = ParamInit::new(5, 0, 0.3, DType::F64).with_bias_std(0.1);
    let mut m = Tiny {
        norm: Norm::new(NormKind::Layer, H, 1e-5, init.with_id(0), dm)?,
        mlp: ParallelMlp::new(H, FFN, Activation::SwiGlu, true, init.with_id(10), 0.2, dm)?,
    };
    let x = seeded(41, &[T, H], DType::F64);
    let target = seeded(42, &[T, H], DType::F64).scale(1.0 / T as f64);
    let mut opt = AdamW::new(1e-2);
    let mut norms = Vec::new();
    for _ in 0..3 {
        let tape = Tape::new();
        let h = m
            .norm
            .forward(&tape, &tape.constant(DTensor::from_global(&x, dm)?))?;
        let y = m.mlp.forward(&tape, &h)?;
        let mut grads = y.backward_with(DTensor::from_global(&target, dm)?)?;
        norms.push(step(&mut m, &mut grads, &mut opt, 0.5)?);
    }
    let params = named_params(&mut m)?
        .into_iter()
        .map(|p| Ok(p.value.to_host()?.to_f64_vec()))
        .collect::<Result<Vec<_>>>()?;
    Ok((params, norms))
}

#[test]
#[ignore = "needs a CUDA GPU, libnccl, NVRTC and cuBLAS, and --features cuda,nccl"]
fn tp2_norm_mlp_adamw_steps_on_device_match_host() {
    let mesh = dtensor::nn::model_mesh(&ParallelConfig::parse("tp=2").unwrap()).unwrap();
    let host = on_host(&mesh, tiny_steps);
    let gpu = on_gpus(&mesh, tiny_steps);
    // f64 throughout; cuBLAS orders the GEMM sums its own way, so agreement is to rounding.
    let tol = 1e-9;
    for (r, ((hp, hn), (dp, dn))) in host.iter().zip(&gpu).enumerate() {
        for (i, (a, b)) in hn.iter().zip(dn).enumerate() {
            assert!(
                (a - b).abs() <= tol * a.abs(),
                "rank {r} step {i} grad norm {a} vs {b}"
            );
        }
        for (i, (a, b)) in hp.iter().zip(dp).enumerate() {
            let scale = a.iter().fold(1e-300f64, |m, v| m.max(v.abs()));
            let err = a
                .iter()
                .zip(b)
                .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
            assert!(err <= tol * scale, "rank {r} param {i}: max |diff| {err:e}");
        }
    }
}

/// Three AdamW steps of one `[37]` parameter with fixed gradients (one rank, no
/// reduction): the parameter and both moments, on the host.
fn adamw_steps(dm: &Arc<DeviceMesh>, dtype: DType) -> Result<Vec<Vec<f64>>> {
    type L = layout![Tp: Invariant];
    let w = DTensor::<L>::from_global(&seeded(3, &[37], dtype), dm)?;
    let mut p = Param::new(w);
    let mut opt = AdamW::new(3e-2);
    for s in 0..3 {
        let g = DTensor::<L>::from_global(&seeded(10 + s, &[37], dtype), dm)?;
        opt.begin_step();
        opt.update(&mut p, &g)?;
    }
    let mut out = vec![p.local().to_host()?.to_f64_vec()];
    for m in p.state() {
        out.push(m.to_host()?.to_f64_vec());
    }
    Ok(out)
}

#[test]
#[ignore = "needs a CUDA GPU, libnccl, NVRTC and cuBLAS, and --features cuda,nccl"]
fn adamw_device_kernel_steps_bitwise_as_host() {
    let mesh = Mesh::new(&[(AxisKind::Tp, 1)]).unwrap();
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let host = on_host(&mesh, |dm| adamw_steps(dm, dtype));
        let gpu = on_gpus(&mesh, |dm| adamw_steps(dm, dtype));
        assert_eq!(host, gpu, "{dtype}: parameter and moments after 3 steps");
    }
}

/// The error a device op without a kernel gives: named, not a panic or a host fallback.
#[test]
#[ignore = "needs a CUDA GPU, libnccl, NVRTC and cuBLAS, and --features cuda,nccl"]
fn host_only_op_on_device_mesh_is_a_named_error() {
    let mesh = Mesh::new(&[(AxisKind::Tp, 1)]).unwrap();
    let errs = on_gpus(&mesh, |dm| {
        type L = layout![Tp: Invariant];
        let a = DTensor::<L>::from_global(&seeded(1, &[4], DType::F32), dm)?;
        // `div` computes in f64 on the host: on a device mesh it must refuse, naming itself.
        Ok(match a.div(&a) {
            Ok(_) => String::new(),
            Err(e) => e.to_string(),
        })
    });
    assert!(
        errs[0].contains("DTensor::div") && errs[0].contains("no device path"),
        "{}",
        errs[0]
    );
}

// ---- MoE on the device ------------------------------------------------------------------

/// f32 agreement of the device path with the host: cuBLAS sums each GEMM in its own order
/// (no TF32), so values agree to a few f32 roundings relative to their scale.
const F32_TOL: f64 = 1e-4;
const MOE_TOKENS: usize = 16;
const MOE_EXPERTS: usize = 4;
const MOE_AUX: f64 = 0.3;

/// Every parameter's gradient as the optimizer takes it, whole, on the host, in visiting
/// order.
struct HostGrads<'g>(&'g mut dtensor::core::Gradients, Vec<Vec<f64>>);
impl ParamVisitor for HostGrads<'_> {
    fn visit<D: DataMode, K: ParamKind>(&mut self, _: &str, w: &mut Weight<D, K>) -> Result<()> {
        let g = w.reduced_grad(self.0)?.full_tensor()?;
        self.1.push(g.to_host()?.to_f64_vec());
        Ok(())
    }
}

/// One forward and backward of an f32 MoE layer (4 experts, top-2, SwiGLU, dropless) with
/// the loss `Σ y ⊙ c + 0.3 · aux`: the output, the aux loss, the input gradient and every
/// parameter gradient (whole, on the host), and the routing statistics.
fn moe_layer_run(dm: &Arc<DeviceMesh>) -> Result<(Vec<Vec<f64>>, dtensor::core::RoutingStats)> {
    let config = MoeConfig {
        aux_loss_coef: MOE_AUX,
        ..MoeConfig::new(MOE_EXPERTS, 2)
    };
    let init = ParamInit::new(5, 40, 0.4, DType::F32);
    let mut mlp = MoeMlp::<NoSp, Ddp>::new(H, FFN, config, Activation::SwiGlu, init, 0.3, dm)?;
    let tape = Tape::new();
    let x = seeded(51, &[MOE_TOKENS, H], DType::F32);
    let c = seeded(52, &[MOE_TOKENS, H], DType::F32);
    let xv = tape.leaf(DTensor::<Stream<NoSp>>::from_global(&x, dm)?);
    let cv = tape.constant(DTensor::<Stream<NoSp>>::from_global(&c, dm)?);
    let (y, aux) = mlp.forward(&tape, &xv)?;
    if dm.device().is_some() {
        assert!(
            y.value().as_local().is_cuda(),
            "the MoE output left the device"
        );
    }
    let main = y.mul(&cv)?.sum_dim::<1>()?.sum_dim::<0>()?;
    let loss = main.add(&aux.scale(MOE_AUX)?)?;
    let mut out = vec![
        y.value().full_tensor()?.to_host()?.to_f64_vec(),
        aux.value().full_tensor()?.to_host()?.to_f64_vec(),
    ];
    let mut g = loss.backward()?;
    let dx: DTensor<Stream<NoSp>> = g.take(&xv)?;
    out.push(dx.full_tensor()?.to_host()?.to_f64_vec());
    let mut grads = HostGrads(&mut g, Vec::new());
    mlp.visit_params("", &mut grads)?;
    out.extend(grads.1);
    let stats = mlp
        .take_stats()
        .pop()
        .expect("one forward records its statistics");
    Ok((out, stats))
}

#[test]
#[ignore = "needs a CUDA GPU, libnccl, NVRTC and cuBLAS, and --features cuda,nccl"]
fn moe_layer_ep2_forward_backward_on_device_match_host() {
    let mesh = dtensor::nn::model_mesh(&ParallelConfig::parse("ep=2").unwrap()).unwrap();
    let host = on_host(&mesh, moe_layer_run);
    let gpu = on_gpus(&mesh, moe_layer_run);
    let names = [
        "output", "aux loss", "dx", "d router", "d w1", "d up", "d w2",
    ];
    for (r, ((hv, hs), (dv, ds))) in host.iter().zip(&gpu).enumerate() {
        // The routing is decided on the host from the logits: the same choices both ways.
        assert_eq!(hs, ds, "rank {r}: routing statistics");
        assert_eq!(hv.len(), names.len(), "rank {r}: values");
        assert_eq!(dv.len(), names.len(), "rank {r}: values");
        for (name, (a, b)) in names.iter().zip(hv.iter().zip(dv)) {
            assert_eq!(a.len(), b.len(), "rank {r} {name}: lengths");
            let scale = a.iter().fold(1e-300f64, |m, v| m.max(v.abs()));
            let err = a
                .iter()
                .zip(b)
                .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
            assert!(
                err <= F32_TOL * scale,
                "rank {r} {name}: max |diff| {err:e} (scale {scale:e})"
            );
        }
    }
}

// ---- Checkpoints on the device (dtensor-checkpoint over an NCCL world) ------------------

/// `Tiny` with parameters drawn from `seed`.
fn ckpt_tiny(dm: &Arc<DeviceMesh>, seed: u64) -> Result<Tiny> {
    let init = ParamInit::new(seed, 0, 0.3, DType::F64).with_bias_std(0.1);
    Ok(Tiny {
        norm: Norm::new(NormKind::Layer, H, 1e-5, init.with_id(0), dm)?,
        mlp: ParallelMlp::new(H, FFN, Activation::SwiGlu, true, init.with_id(10), 0.2, dm)?,
    })
}

fn ckpt_err(e: dtensor_checkpoint::Error) -> dtensor::core::Error {
    dtensor::core::Error::InvalidUse {
        op: "checkpoint",
        detail: e.to_string(),
    }
}

/// Every parameter's local master and both AdamW moments, as bits; each must live where
/// the mesh keeps its tensors (a GPU on an NCCL mesh).
fn ckpt_state_bits(m: &mut Tiny, dm: &Arc<DeviceMesh>) -> Result<Vec<Vec<u64>>> {
    struct Collect {
        on_device: bool,
        out: Vec<Vec<u64>>,
    }
    impl ParamVisitor for Collect {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            name: &str,
            w: &mut Weight<D, K>,
        ) -> Result<()> {
            let mut pieces = vec![w.value().as_local().clone()];
            pieces.extend(w.master().state().iter().cloned());
            assert_eq!(pieces.len(), 3, "{name}: a master and two AdamW moments");
            for t in pieces {
                assert_eq!(
                    t.is_cuda(),
                    self.on_device,
                    "{name}: a piece in the wrong memory"
                );
                let v = t.to_host()?.to_f64_vec();
                self.out.push(v.iter().map(|x| x.to_bits()).collect());
            }
            Ok(())
        }
    }
    let mut c = Collect {
        on_device: dm.device().is_some(),
        out: Vec::new(),
    };
    m.visit_params("", &mut c)?;
    Ok(c.out)
}

/// Two training steps of `Tiny` (so AdamW holds moments), saved to `dir`: the state saved.
fn ckpt_train_save(dm: &Arc<DeviceMesh>, dir: &std::path::Path) -> Result<Vec<Vec<u64>>> {
    let mut m = ckpt_tiny(dm, 5)?;
    let x = seeded(41, &[T, H], DType::F64);
    let target = seeded(42, &[T, H], DType::F64).scale(1.0 / T as f64);
    let mut opt = AdamW::new(1e-2);
    for _ in 0..2 {
        let tape = Tape::new();
        let h = m
            .norm
            .forward(&tape, &tape.constant(DTensor::from_global(&x, dm)?))?;
        let y = m.mlp.forward(&tape, &h)?;
        let mut grads = y.backward_with(DTensor::from_global(&target, dm)?)?;
        step(&mut m, &mut grads, &mut opt, 0.5)?;
    }
    let extra: std::collections::BTreeMap<String, String> =
        [("data.step".to_string(), "2".to_string())].into();
    dtensor_checkpoint::nn::save_model(dir, dm.world(), &mut m, &opt, &extra).map_err(ckpt_err)?;
    ckpt_state_bits(&mut m, dm)
}

/// A `Tiny` of other weights loaded from `from` (and saved again to `to` if given): the
/// state loaded and the optimizer's step count.
fn ckpt_load(
    dm: &Arc<DeviceMesh>,
    from: &std::path::Path,
    to: Option<&std::path::Path>,
) -> Result<(Vec<Vec<u64>>, u64)> {
    let mut m = ckpt_tiny(dm, 77)?;
    let mut opt = AdamW::new(1e-2);
    let extra =
        dtensor_checkpoint::nn::load_model(from, dm.world(), &mut m, &mut opt).map_err(ckpt_err)?;
    assert_eq!(extra.get("data.step").map(String::as_str), Some("2"));
    if let Some(to) = to {
        dtensor_checkpoint::nn::save_model(to, dm.world(), &mut m, &opt, &extra)
            .map_err(ckpt_err)?;
    }
    Ok((ckpt_state_bits(&mut m, dm)?, opt.steps()))
}

#[test]
#[ignore = "needs a CUDA GPU, libnccl, NVRTC and cuBLAS, and --features cuda,nccl"]
fn checkpoint_tp2_saved_on_device_loads_on_host_and_back_bitwise() {
    let mesh = dtensor::nn::model_mesh(&ParallelConfig::parse("tp=2").unwrap()).unwrap();
    let root = std::env::temp_dir().join(format!("dtensor-device-ckpt-{}", std::process::id()));
    let (from_gpu, from_host) = (root.join("gpu"), root.join("host"));
    let _ = std::fs::remove_dir_all(&root);
    // Masters and moments saved from device memory by 2 NCCL ranks ...
    let saved = on_gpus(&mesh, |dm| ckpt_train_save(dm, &from_gpu));
    // ... load on the threads backend (host memory), which saves them again ...
    let host = on_host(&mesh, |dm| ckpt_load(dm, &from_gpu, Some(&from_host)));
    // ... and that load back onto NCCL ranks, into device memory.
    let back = on_gpus(&mesh, |dm| ckpt_load(dm, &from_host, None));
    let _ = std::fs::remove_dir_all(&root);
    for (r, (s, ((h, hs), (b, bs)))) in saved.iter().zip(host.iter().zip(&back)).enumerate() {
        assert_eq!((*hs, *bs), (2, 2), "rank {r}: AdamW's step count");
        assert_eq!(s, h, "rank {r}: saved on the device, loaded on the host");
        assert_eq!(s, b, "rank {r}: saved on the host, loaded on the device");
    }
}

// ---- Pipeline stages on the device (pp = 2: stage hops are NCCL sends and receives) ------

/// Two 1F1B steps (4 microbatches) of a tiny f32 GPT cut into 2 stages over `Pp` (set up
/// as `train_gpt` does): each step's loss and gradient norm.
fn pipelined_steps(dm: &Arc<DeviceMesh>) -> Result<Vec<(f64, f64)>> {
    const SEQ: usize = 4;
    let m = 4;
    let config = GptConfig {
        vocab: 20,
        hidden: 16,
        heads: 2,
        kv_heads: None,
        rope_style: dtensor::kernels::ops::RopeStyle::Interleaved,
        attn: Default::default(),
        layers: 2,
        ffn: 32,
        seq_len: SEQ,
        norm: NormKind::Rms,
        activation: Activation::SwiGlu,
        bias: true,
        eps: 1e-5,
        dtype: DType::F32,
        seed: 11,
        precision: Precision::default(),
        recompute: false,
        context: Default::default(),
        moe: None,
        z_loss: 0.0,
        tie_embeddings: false,
    };
    let schedule = pipeline::one_f_one_b(2, m)?;
    let mut model = Pipeline::<NoSp, Ddp>::new(config, schedule, dm)?;
    let sm = model.stage_mesh().clone();
    let seq: Vec<i64> = (0..m * SEQ + 1)
        .map(|i| ((i * 5 + 2) % 20) as i64)
        .collect();
    let split = |t: Vec<i64>| -> Result<Vec<DTensor<Ids>>> {
        pipeline::microbatches(&Tensor::from_vec(t, &[m * SEQ])?, m, SEQ)?
            .iter()
            .map(|mb| DTensor::<Ids>::from_global(mb, &sm))
            .collect()
    };
    let (ids, targets) = (split(seq[..m * SEQ].to_vec())?, split(seq[1..].to_vec())?);
    let mut opt = AdamW::new(3e-3);
    (0..2)
        .map(|_| {
            let r = model.train_step(&ids, &targets, &mut opt, 1.0)?;
            Ok((r.loss, r.grad_norm))
        })
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU, libnccl, NVRTC and cuBLAS, and --features cuda,nccl"]
fn pp2_pipeline_steps_on_two_nccl_ranks_match_host() {
    assert!(
        dtensor::kernels::cuda::driver_present(),
        "needs a CUDA GPU: libcuda.so.1 not found (or a build without --features cuda,nccl)"
    );
    let mesh = dtensor::nn::model_mesh(&ParallelConfig::parse("pp=2").unwrap()).unwrap();
    let host = on_host(&mesh, pipelined_steps);
    let gpu = on_gpus(&mesh, pipelined_steps);
    for (r, (h, d)) in host.iter().zip(&gpu).enumerate() {
        assert_eq!(h.len(), d.len());
        for (i, ((hl, hn), (dl, dn))) in h.iter().zip(d).enumerate() {
            assert!(
                (hl - dl).abs() <= F32_TOL * hl.abs() && (hn - dn).abs() <= F32_TOL * hn.abs(),
                "rank {r} step {i}: host loss {hl}, grad norm {hn}; GPU {dl}, {dn}"
            );
        }
    }
}
