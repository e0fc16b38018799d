//! The MoE MLP layer and GPTs with MoE blocks, in f64, against one rank.
//!
//! - The layer (dropless, top-2, SwiGLU and GELU): output, auxiliary loss, input gradient
//!   and every parameter gradient (reduced as the optimizer takes it) at ep = 2 and 4,
//!   with dp = 2, and with tp = 2 (SP and not) equal the one-rank run within 1e-10.
//! - A GPT with MoE blocks (aux loss and the aux-loss-free selection bias on): 3 AdamW
//!   steps at ep=2,dp=2 (DDP and FSDP) and ep=2,tp=2 with SP equal the one-rank losses
//!   within 1e-9 relative; every rank reports the same losses and bias bits.
//! - Bad configurations are an `Err` from the constructor naming the values.

mod common;

use common::*;
use dtensor_core::{DTensor, DeviceMesh, Result, RoutingStats, Tape};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::*;
use std::sync::Arc;

const T: usize = 24;
const H: usize = 8;
const F: usize = 12;
const E: usize = 4;
const COEF: f64 = 0.3;

fn init() -> ParamInit {
    ParamInit::new(5, 40, 0.4, DType::F64)
}

fn moe_config(k: usize) -> MoeConfig {
    MoeConfig {
        aux_loss_coef: COEF,
        ..MoeConfig::new(E, k)
    }
}

/// What one layer run gives (whole tensors, from rank 0).
struct LayerRun {
    out: Tensor,
    aux: f64,
    dx: Tensor,
    grads: Vec<Tensor>,
    stats: RoutingStats,
}

/// Every parameter's reduced gradient, whole, in visiting order.
struct Reduced<'g>(&'g mut dtensor_core::Gradients, Vec<Tensor>);
impl ParamVisitor for Reduced<'_> {
    fn visit<D: DataMode, K: ParamKind>(&mut self, _: &str, w: &mut Weight<D, K>) -> Result<()> {
        self.1.push(w.reduced_grad(self.0)?.full_tensor()?);
        Ok(())
    }
}

/// One forward and backward of the layer on a `[dp, ep, 1, tp]` mesh: loss
/// `Σ y ⊙ c + COEF · aux`.
macro_rules! layer_run {
    ($name:ident, $mode:ty, $v:ident => $to_loss:expr) => {
        fn $name(dp: usize, ep: usize, tp: usize, k: usize, act: Activation) -> LayerRun {
            let (x, c) = (randn(1, &[T, H]), randn(2, &[T, H]));
            let mut ranks = on_model_mesh(1, dp, ep, 1, tp, |mesh: &Arc<DeviceMesh>| {
                let mut mlp =
                    MoeMlp::<$mode, Ddp>::new(H, F, moe_config(k), act, init(), 0.3, mesh)?;
                let tape = Tape::new();
                let xv = tape.leaf(piece::<Stream<$mode>>(&x, mesh)?);
                let cv = tape.constant(piece::<Stream<$mode>>(&c, mesh)?);
                let (y, aux) = mlp.forward(&tape, &xv)?;
                let $v = y.mul(&cv)?.sum_dim::<1>()?.sum_dim::<0>()?;
                let main = $to_loss;
                let loss = main.add(&aux.scale(COEF)?)?;
                let aux_v = aux.value().full_tensor()?.to_f64_vec()[0];
                let out = y.value().full_tensor()?;
                let mut g = loss.backward()?;
                let dx: DTensor<Stream<$mode>> = g.take(&xv)?;
                let mut r = Reduced(&mut g, Vec::new());
                mlp.visit_params("", &mut r)?;
                let grads = r.1;
                let mut stats = mlp.take_stats();
                assert_eq!(stats.len(), 1, "one forward, one record");
                Ok(LayerRun {
                    out,
                    aux: aux_v,
                    dx: dx.full_tensor()?,
                    grads,
                    stats: stats.remove(0),
                })
            });
            ranks.remove(0)
        }
    };
}

layer_run!(layer_nosp, NoSp, main => main);
layer_run!(layer_sp, Sp, main => main.all_reduce(dtensor_placement::Tp)?);

fn compare_runs(what: &str, got: &LayerRun, want: &LayerRun) {
    assert_close(&format!("{what}: output"), &got.out, &want.out, 1e-10);
    assert_close(&format!("{what}: dx"), &got.dx, &want.dx, 1e-10);
    assert!(
        (got.aux - want.aux).abs() <= 1e-10 * want.aux.abs(),
        "{what}: aux loss {} vs {}",
        got.aux,
        want.aux
    );
    assert_eq!(got.grads.len(), want.grads.len());
    for (i, (a, b)) in got.grads.iter().zip(&want.grads).enumerate() {
        assert_close(&format!("{what}: grad of parameter {i}"), a, b, 1e-10);
    }
    assert_eq!(got.stats, want.stats, "{what}: routing statistics");
}

#[test]
fn moe_layer_forward_and_backward_equal_one_rank() {
    for (k, act) in [(2, Activation::SwiGlu), (1, Activation::Gelu)] {
        let want = layer_nosp(1, 1, 1, k, act);
        assert_eq!(want.stats.tokens, T);
        assert_eq!(want.stats.per_expert.iter().sum::<usize>(), T * k);
        assert_eq!(want.stats.dropped, 0);
        assert!(want.aux > 0.0);
        for (dp, ep, tp, sp) in [
            (1, 2, 1, false),
            (1, 4, 1, false),
            (2, 2, 1, false),
            (2, 4, 1, false),
            (1, 2, 2, true),
            (1, 2, 2, false),
        ] {
            let got = if sp {
                layer_sp(dp, ep, tp, k, act)
            } else {
                layer_nosp(dp, ep, tp, k, act)
            };
            compare_runs(
                &format!("k={k} {act:?} dp={dp} ep={ep} tp={tp} sp={sp}"),
                &got,
                &want,
            );
        }
    }
}

#[test]
fn bad_moe_configurations_are_errors_naming_the_values() {
    let errs = on_model_mesh(1, 1, 2, 1, 1, |mesh| {
        let error = |config| {
            MoeMlp::<NoSp, Ddp>::new(H, F, config, Activation::Gelu, init(), 0.3, mesh)
                .err()
                .map(|e| e.to_string())
        };
        Ok((error(MoeConfig::new(3, 1)), error(MoeConfig::new(4, 5))))
    });
    let (e1, e2) = errs[0].clone();
    let e1 = e1.expect("3 experts over ep = 2 is an error");
    assert!(e1.contains("3 experts") && e1.contains("2 ranks"), "{e1}");
    let e2 = e2.expect("top-k 5 of 4 experts is an error");
    assert!(e2.contains("top-k 5") && e2.contains("4"), "{e2}");
}

// ---------------------------------------------------------------------------------------
// GPT with MoE blocks
// ---------------------------------------------------------------------------------------

const S: usize = 6;
const B: usize = 4;

fn tokens() -> (Tensor, Tensor) {
    next_tokens(S * B, |i| i * i * 7 + i * 3 + 1)
}

fn moe_gpt() -> GptConfig {
    GptConfig {
        moe: Some(MoeConfig {
            aux_loss_coef: 0.05,
            bias_rate: Some(1e-2),
            ..MoeConfig::new(4, 2)
        }),
        ..tiny_gpt(2, S, 31)
    }
}

/// Losses of `steps` AdamW steps, and the selection biases after them (rank 0); asserts
/// every rank has the same bits of both.
fn gpt_train<M: SeqMode, D: DataMode>(
    dp: usize,
    ep: usize,
    tp: usize,
    steps: usize,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let (ids, tg) = tokens();
    let ranks = on_model_mesh(1, dp, ep, 1, tp, |mesh| {
        let mut model = Gpt::<M, D>::new(moe_gpt(), mesh)?;
        let mut opt = AdamW::new(3e-3);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let mut losses = Vec::new();
        for _ in 0..steps {
            losses.push(model.train_step(&i, &t, &mut opt, 1.0)?.loss);
            let stats = model.take_routing_stats();
            assert_eq!(stats.len(), 2, "two MoE blocks");
            for s in stats.iter().flatten() {
                assert_eq!((s.tokens, s.dropped), (S * B, 0));
            }
        }
        let bias: Vec<Vec<f64>> = model
            .blocks
            .iter()
            .map(|b| {
                b.mlp
                    .moe()
                    .and_then(|m| m.bias())
                    .expect("a biased MoE block")
            })
            .collect();
        Ok((losses, bias))
    });
    let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (l, b) in &ranks {
        assert_eq!(bits(l), bits(&ranks[0].0), "ranks report different losses");
        for (x, y) in b.iter().zip(&ranks[0].1) {
            assert_eq!(bits(x), bits(y), "ranks hold different selection biases");
        }
    }
    ranks.into_iter().next().expect("rank 0")
}

#[test]
fn gpt_with_moe_blocks_three_adamw_steps_equal_one_rank() {
    let (want_l, want_b) = gpt_train::<NoSp, Ddp>(1, 1, 1, 3);
    assert!(want_b.iter().flatten().any(|b| *b != 0.0), "the bias moved");
    let check = |what: &str, (l, b): (Vec<f64>, Vec<Vec<f64>>)| {
        for (a, w) in l.iter().zip(&want_l) {
            assert!((a - w).abs() <= 1e-9 * w.abs(), "{what}: loss {a} vs {w}");
        }
        assert_eq!(b, want_b, "{what}: selection bias");
        eprintln!("{what}: losses {l:?}");
    };
    check("ep=2 dp=2", gpt_train::<NoSp, Ddp>(2, 2, 1, 3));
    check("ep=2 tp=2 sp", gpt_train::<Sp, Ddp>(1, 2, 2, 3));
    check("ep=2 dp=2 fsdp", gpt_train::<NoSp, Fsdp>(2, 2, 1, 3));
    check("ep=2 dp=2 zero1", gpt_train::<NoSp, Zero1>(2, 2, 1, 3));
}

#[test]
fn moe_with_pipeline_stages_or_recompute_is_an_error() {
    let errs = on_model_mesh(1, 1, 1, 1, 1, |mesh| {
        let cfg = moe_gpt();
        let stage = GptStage::<NoSp, Ddp>::new(cfg, 0..1, true, false, mesh)
            .err()
            .map(|e| e.to_string());
        let rec = Gpt::<NoSp, Ddp>::new(
            GptConfig {
                recompute: true,
                ..cfg
            },
            mesh,
        )
        .err()
        .map(|e| e.to_string());
        Ok((stage, rec))
    });
    let (stage, rec) = errs[0].clone();
    assert!(stage.expect("an error").contains("pipeline"));
    assert!(rec.expect("an error").contains("recomputation"));
}
