//! Optimizers and clipping: AdamW against its formula; the global gradient norm counts every
//! element once across sharded and replicated parameters; a few AdamW steps of norm → MLP
//! with clipping at dp=2 × tp=2 (SP on and off) equal the one-rank run in f64.

mod common;

use common::*;
use dtensor_core::{DTensor, Result, Tape};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::*;
use dtensor_placement::{Invariant, Shard};

const T: usize = 8;
const H: usize = 8;
const FFN: usize = 16;

struct Tiny<M: SeqMode> {
    norm: Norm<M>,
    mlp: ParallelMlp<M>,
}

impl<M: SeqMode> Module for Tiny<M> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        self.norm.visit_params(&join_name(prefix, "norm"), v)?;
        self.mlp.visit_params(&join_name(prefix, "mlp"), v)
    }
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

    /// Loss = mean over the global batch's tokens of `Σ_j y[t, j]·target[t, j]`: backward
    /// from `y` with its gradient (target / tokens), then one optimizer step with clipping
    /// at 0.5.
    fn step(&mut self, x: &Tensor, target: &Tensor, opt: &mut AdamW) -> Result<f64> {
        let mesh = self.norm.weight.value().device_mesh().clone();
        let tape = Tape::new();
        let h = self.norm.forward(&tape, &tape.constant(piece(x, &mesh)?))?;
        let y = self.mlp.forward(&tape, &h)?;
        let mut grads = y.backward_with(piece(&target.scale(1.0 / T as f64), &mesh)?)?;
        step(self, &mut grads, opt, 0.5)
    }

    fn params(&mut self) -> Result<Vec<Tensor>> {
        Ok(named_params(self)?.into_iter().map(|p| p.value).collect())
    }
}

/// [`Tiny`] whose every third walk over its parameters — the update pass of [`step`], after
/// the accumulation and reduction passes — visits them in the reverse order.
struct Reversing<M: SeqMode> {
    tiny: Tiny<M>,
    walks: usize,
}

impl<M: SeqMode> Module for Reversing<M> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        self.walks += 1;
        if !self.walks.is_multiple_of(3) {
            return self.tiny.visit_params(prefix, v);
        }
        self.tiny.mlp.visit_params(&join_name(prefix, "mlp"), v)?;
        self.tiny.norm.visit_params(&join_name(prefix, "norm"), v)
    }
}

impl<M: SeqMode> Reversing<M> {
    /// [`Tiny::step`] through the reversing walks.
    fn step(&mut self, x: &Tensor, target: &Tensor, opt: &mut AdamW) -> Result<f64> {
        let mesh = self.tiny.norm.weight.value().device_mesh().clone();
        let tape = Tape::new();
        let h = self
            .tiny
            .norm
            .forward(&tape, &tape.constant(piece(x, &mesh)?))?;
        let y = self.tiny.mlp.forward(&tape, &h)?;
        let mut grads = y.backward_with(piece(&target.scale(1.0 / T as f64), &mesh)?)?;
        step(self, &mut grads, opt, 0.5)
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
fn step_updates_each_parameter_from_its_own_gradient_whatever_the_visiting_order() {
    // The update pass finds every parameter's reduced gradient by the parameter, not by
    // its position in the reduction pass: updating in the reverse order is bitwise the
    // same training.
    let x = randn(41, &[T, H]);
    let target = randn(42, &[T, H]);
    let out = on_mesh(2, 2, |mesh| {
        let mut plain = Tiny::<Sp>::new(mesh)?;
        let mut reversing = Reversing {
            tiny: Tiny::<Sp>::new(mesh)?,
            walks: 0,
        };
        let (mut a, mut b) = (AdamW::new(1e-2), AdamW::new(1e-2));
        for _ in 0..3 {
            let (n, m) = (
                plain.step(&x, &target, &mut a)?,
                reversing.step(&x, &target, &mut b)?,
            );
            assert_eq!(n.to_bits(), m.to_bits(), "grad norm {n} vs {m}");
        }
        Ok((plain.params()?, reversing.tiny.params()?))
    });
    for (want, got) in out {
        assert_eq!(want.len(), got.len());
        for (i, (w, g)) in want.iter().zip(&got).enumerate() {
            assert_eq!(w.to_f64_vec(), g.to_f64_vec(), "param {i}");
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
            let gw: DTensor<DpReduced<Shard<0>>> = piece(&w, mesh)?;
            let gv: DTensor<DpReduced<Invariant>> = piece(&v, mesh)?;
            let mut n = GradNorm::new();
            n.add(&gw)?;
            n.add(&gv)?;
            n.finish(mesh)
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
        let gd: DTensor<DpReduced<Invariant>> = piece(&g, mesh)?;
        let mut p = Param::new(piece::<StreamParam<NoSp>>(&p0, mesh)?);
        let mut opt = AdamW::new(0.1);
        opt.decay_vectors = true; // a vector: decayed only when asked
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

#[test]
fn adamw_does_not_decay_vectors_by_default() {
    on_mesh(1, 1, |mesh| {
        let zeros = Tensor::from_vec(vec![0.0f64, 0.0], &[2])?;
        let gd: DTensor<DpReduced<Invariant>> = piece(&zeros, mesh)?;
        let p0 = Tensor::from_vec(vec![1.0f64, -2.0], &[2])?;
        // A zero gradient: only weight decay could move the parameter.
        let mut bias = Param::new(piece::<StreamParam<NoSp>>(&p0, mesh)?);
        let mut opt = AdamW::new(0.1);
        opt.begin_step();
        opt.update(&mut bias, &gd)?;
        assert_eq!(bias.local(), &p0, "a bias (1-D) is not decayed by default");
        opt.decay_vectors = true;
        opt.update(&mut bias, &gd)?;
        assert_ne!(bias.local(), &p0, "decay_vectors decays it");
        // A matrix is decayed by default.
        let m0 = Tensor::from_vec(vec![1.0f64, -2.0, 3.0, 4.0], &[2, 2])?;
        let gm: DTensor<DpReduced<Shard<0>>> =
            piece(&Tensor::from_vec(vec![0.0f64; 4], &[2, 2])?, mesh)?;
        let mut w = Param::new(piece::<ColWeight>(&m0, mesh)?);
        AdamW::new(0.1).update(&mut w, &gm)?;
        let want: Vec<f64> = m0.to_f64_vec().iter().map(|v| v - 0.1 * 0.01 * v).collect();
        assert_close(
            "matrix decay",
            w.local(),
            &Tensor::from_vec(want, &[2, 2])?,
            1e-15,
        );
        Ok(())
    });
}
