//! Optimizers and clipping: AdamW against its formula; the global gradient norm counts every
//! element once across sharded and replicated parameters; a few AdamW steps of norm → MLP
//! with clipping at dp=2 × tp=2 (SP on and off) equal the one-rank run in f64.

mod common;

use common::*;
use dtensor_core::{DTensor, Result};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::*;
use dtensor_placement::Invariant;

const T: usize = 8;
const H: usize = 8;
const FFN: usize = 16;

struct Tiny<M: SeqMode> {
    norm: Norm<M>,
    mlp: ParallelMlp<M>,
}

struct TinyGrads {
    norm: NormGradsReduced,
    mlp: MlpGradsReduced,
}

impl<M: SeqMode> Tiny<M> {
    fn new(mesh: &std::sync::Arc<dtensor_core::DeviceMesh>) -> Result<Self> {
        let init = ParamInit::new(5, 0, 0.3, DType::F64).with_bias_std(0.1);
        Ok(Tiny {
            norm: Norm::new(NormKind::Layer, H, 1e-5, init.with_id(0), mesh)?,
            mlp: ParallelMlp::new(
                H,
                FFN,
                Activation::SwiGlu,
                true,
                init.with_id(10),
                0.2,
                mesh,
            )?,
        })
    }

    /// Loss = mean over tokens of `Σ_j y[t, j]·target[t, j]`; returns reduced gradients.
    fn grads(&self, x: &Tensor, target: &Tensor) -> Result<TinyGrads> {
        let mesh = self.norm.weight.value().device_mesh().clone();
        let dp = mesh.mesh().size(0) as f64;
        let (h, nctx) = self.norm.forward(&piece(x, &mesh)?)?;
        let (_, mctx) = self.mlp.forward(h)?;
        // d loss / d y on this Dp rank's tokens, for the mean over its own tokens.
        let dy: DTensor<Stream<M>> = piece(&target.scale(dp / T as f64), &mesh)?;
        let (dh, mg) = self.mlp.backward(mctx, &dy)?;
        let (_, ng) = self.norm.backward(nctx, &dh)?;
        Ok(TinyGrads {
            norm: ng.reduce()?,
            mlp: mg.reduce()?,
        })
    }

    fn step(&mut self, x: &Tensor, target: &Tensor, opt: &mut AdamW) -> Result<f64> {
        let g = self.grads(x, target)?;
        let mut n = GradNorm::new();
        g.norm.norm(&mut n)?;
        g.mlp.norm(&mut n)?;
        let norm = n.finish(self.norm.weight.value())?;
        let c = clip_coefficient(norm, 0.5);
        opt.begin_step();
        self.norm.apply(&g.norm.scale(c)?, opt)?;
        self.mlp.apply(&g.mlp.scale(c)?, opt)?;
        Ok(norm)
    }

    fn params(&self) -> Result<Vec<Tensor>> {
        let m = &self.mlp;
        Ok(vec![
            self.norm.weight.value().full_tensor()?,
            self.norm.bias.as_ref().unwrap().value().full_tensor()?,
            m.fc1.weight.value().full_tensor()?,
            m.up.as_ref().unwrap().weight.value().full_tensor()?,
            m.fc2.weight.value().full_tensor()?,
            m.fc2.bias.as_ref().unwrap().value().full_tensor()?,
        ])
    }
}

fn train<M: SeqMode>(dp: usize, tp: usize, steps: usize) -> (Vec<Tensor>, Vec<f64>) {
    let x = randn(41, &[T, H]);
    let target = randn(42, &[T, H]);
    let mut out = on_mesh(dp, tp, |mesh| {
        let mut model = Tiny::<M>::new(mesh)?;
        let mut opt = AdamW::new(1e-2);
        let norms = (0..steps)
            .map(|_| model.step(&x, &target, &mut opt))
            .collect::<Result<Vec<_>>>()?;
        Ok((model.params()?, norms))
    });
    out.swap_remove(0)
}

#[test]
fn adamw_steps_at_dp2_tp2_match_one_rank() {
    let (want, want_norms) = train::<NoSp>(1, 1, 4);
    // Clipping is active: the first norm exceeds the 0.5 threshold.
    assert!(want_norms[0] > 0.5, "norm {}", want_norms[0]);
    for (dp, tp, sp) in [(2, 2, true), (2, 2, false), (1, 4, true), (2, 1, false)] {
        let (got, norms) = if sp {
            train::<Sp>(dp, tp, 4)
        } else {
            train::<NoSp>(dp, tp, 4)
        };
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_close(&format!("dp={dp} tp={tp} sp={sp} param {i}"), a, b, 1e-10);
        }
        for (a, b) in norms.iter().zip(&want_norms) {
            assert!((a - b).abs() <= 1e-10 * b, "grad norm {a} vs {b}");
        }
    }
}

#[test]
fn grad_norm_counts_every_element_once() {
    // One sharded parameter (column weight, Shard<0> over Tp) and one replicated (an SP
    // norm weight, reduced to Invariant over Tp and Dp): the norm is that of the whole
    // tensors, whatever the mesh.
    let w = randn(51, &[H, 4]);
    let v = randn(52, &[4]);
    let want = w
        .to_f64_vec()
        .iter()
        .chain(v.to_f64_vec().iter())
        .map(|x| x * x)
        .sum::<f64>()
        .sqrt();
    for (dp, tp) in [(1, 1), (1, 2), (2, 2), (1, 4)] {
        let got = on_mesh(dp, tp, |mesh| {
            let gw: DTensor<ColWeightReduced> = piece(&w, mesh)?;
            let gv: DTensor<ReducedTp<Invariant>> = piece(&v, mesh)?;
            let mut n = GradNorm::new();
            n.add(&gw)?;
            n.add(&gv)?;
            n.finish(&gw)
        });
        for g in got {
            assert!(
                (g - want).abs() <= 1e-12 * want,
                "dp={dp} tp={tp}: {g} vs {want}"
            );
        }
    }
}

#[test]
fn adamw_and_sgd_follow_their_formulas() {
    on_mesh(1, 1, |mesh| {
        let p0 = Tensor::from_vec(vec![1.0f64, -2.0], &[2])?;
        let g = Tensor::from_vec(vec![0.5f64, 0.25], &[2])?;
        let gd: DTensor<ReducedTp<Invariant>> = piece(&g, mesh)?;
        let mut p = Param::new(piece::<StreamParam<NoSp>>(&p0, mesh)?);
        let mut opt = AdamW::new(0.1);
        opt.begin_step();
        opt.update(&mut p, &gd)?;
        opt.begin_step();
        opt.update(&mut p, &gd)?;
        // By hand: constant gradient, so m̂ = g and v̂ = g² after bias correction, the step
        // is lr·(sign(g)·|g|/(|g| + eps) + wd·w) each time.
        let mut w = p0.to_f64_vec();
        for _ in 0..2 {
            for (wi, gi) in w.iter_mut().zip(g.to_f64_vec()) {
                *wi -= 0.1 * (gi / (gi.abs() + 1e-8) + 0.01 * *wi);
            }
        }
        let want = Tensor::from_vec(w, &[2])?;
        assert_close("adamw", p.local(), &want, 1e-12);
        let mut q = Param::new(piece::<StreamParam<NoSp>>(&p0, mesh)?);
        Sgd { lr: 0.5 }.update(&mut q, &gd)?;
        let want = Tensor::from_vec(vec![0.75f64, -2.125], &[2])?;
        assert_eq!(q.local(), &want);
        Ok(())
    });
}
