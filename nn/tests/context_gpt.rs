//! Context parallelism in the GPT: the sequence `Shard<0>` over `Cp` everywhere, attention
//! by ring or all-to-all over `Cp`, composed with DP, TP and SP.
//!
//! - The attention layer with `cp = 2, 4` (ring and all-to-all, zigzag on and off), with
//!   `tp = 2` and SP, on 3 samples: output, input gradient and every parameter gradient
//!   equal the one-rank layer within 1e-10.
//! - 3 AdamW steps of the f64 GPT at `dp=2, cp=2, tp=2` with SP (ring, zigzag and
//!   contiguous chunks; all-to-all), at `cp=4` and at `cp=2` alone equal the one-rank run:
//!   losses within 1e-9, every parameter within 1e-9, replicas bitwise equal.
//! - Communication: the bytes one block's forward and backward send over `Cp` per token
//!   equal the ring's and the all-to-all's formulas.

mod common;

use common::*;
use dtensor_core::{CpStrategy, DTensor, Result, Tape};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::*;
use dtensor_placement::AxisKind;

/// Tokens per sample: 8 cuts into 2·cp zigzag chunks for cp = 2 and 4.
const S: usize = 8;
/// Samples: 2 per data rank at dp = 2.
const B: usize = 4;
const T: usize = S * B;

fn tokens() -> (Tensor, Tensor) {
    next_tokens(T, |i| i * i * 5 + i * 7 + 3)
}

struct Run {
    losses: Vec<f64>,
    params: Vec<Tensor>,
}

/// `steps` AdamW steps of the tiny GPT on the `[Dp, Ep: 1, Cp, Tp]` mesh: rank 0's losses
/// and whole parameters, after checking every rank reported the same loss bits.
fn train<M: SeqMode>(dp: usize, cp: usize, tp: usize, context: ContextParallel) -> Run {
    let (ids, tg) = tokens();
    let ranks = on_model_mesh(1, dp, 1, cp, tp, |mesh| {
        let mut cfg = tiny_gpt(2, S, 23);
        cfg.context = context;
        let mut model = Gpt::<M, Ddp>::new(cfg, mesh)?;
        let mut opt = AdamW::new(3e-3);
        // The data loader's job: ids and targets in the stream's token order, then sliced.
        let order = |t: &Tensor| -> Result<DTensor<Ids>> {
            piece(&to_stream_order(t, S, &context, mesh)?, mesh)
        };
        let (i, t) = (order(&ids)?, order(&tg)?);
        let losses = (0..3)
            .map(|_| Ok(model.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<Result<Vec<_>>>()?;
        Ok((losses, model.full_params()?))
    });
    let bits = |l: &[f64]| l.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (r, (l, _)) in ranks.iter().enumerate() {
        assert_eq!(bits(l), bits(&ranks[0].0), "rank {r}'s losses differ");
    }
    let (losses, params) = ranks.into_iter().next().expect("rank 0");
    Run { losses, params }
}

fn assert_matches(what: &str, got: &Run, want: &Run) {
    for (a, b) in got.losses.iter().zip(&want.losses) {
        assert!((a - b).abs() <= 1e-9 * b.abs(), "{what}: loss {a} vs {b}");
    }
    for (k, (a, b)) in got.params.iter().zip(&want.params).enumerate() {
        assert_close(&format!("{what}: parameter {k}"), a, b, 1e-9);
    }
}

#[test]
fn gpt_with_context_parallel_attention_trains_like_one_rank() {
    let want = train::<NoSp>(1, 1, 1, ContextParallel::default());
    assert!(want.losses[2] < want.losses[0], "{:?}", want.losses);
    let ring = ContextParallel {
        strategy: CpStrategy::Ring,
        zigzag: true,
    };
    let a2a = ContextParallel {
        strategy: CpStrategy::AllToAll,
        zigzag: true,
    };
    let contiguous = ContextParallel {
        strategy: CpStrategy::Ring,
        zigzag: false,
    };
    assert_matches("dp=2 cp=2 tp=2 sp ring", &train::<Sp>(2, 2, 2, ring), &want);
    assert_matches("dp=2 cp=2 tp=2 sp a2a", &train::<Sp>(2, 2, 2, a2a), &want);
    assert_matches(
        "cp=2 tp=2 ring contiguous",
        &train::<NoSp>(1, 2, 2, contiguous),
        &want,
    );
    assert_matches("cp=4 ring", &train::<NoSp>(1, 4, 1, ring), &want);
    assert_matches("cp=4 a2a", &train::<NoSp>(1, 4, 1, a2a), &want);
}

/// The attention layer on 3 samples of `S` tokens (width 16, 4 heads) at `[Cp: cp, Tp: tp]`:
/// output, input gradient (both back in natural token order) and the reduced parameter
/// gradients, as whole tensors.
fn attention_run<M: SeqMode>(cp: usize, tp: usize, context: ContextParallel) -> Vec<Tensor> {
    let t = 3 * S;
    let x = randn(41, &[t, 16]);
    let dy = randn(42, &[t, 16]);
    on_model_mesh(1, 1, 1, cp, tp, |mesh| {
        let mut cfg = AttentionConfig::new(16, 4, S, dtensor_kernels::ops::RopeStyle::Interleaved);
        cfg.rope.base = 100.0;
        cfg.context = context;
        cfg.qkv_bias = true;
        cfg.out_bias = true;
        let init = ParamInit::new(3, 10, 0.3, DType::F64).with_bias_std(0.1);
        let attn = ParallelAttention::<M, Ddp>::new(cfg, init, 0.2, mesh)?;
        let order = |v: &Tensor| to_stream_order(v, S, &context, mesh);
        let natural = |v: &Tensor| from_stream_order(v, S, &context, mesh);
        let tape = Tape::new();
        let xs = tape.leaf(piece::<Stream<M>>(&order(&x)?, mesh)?);
        let y = attn.forward(&tape, &xs)?;
        let y_full = natural(&y.value().full_tensor()?)?;
        let mut g = y.backward_with(piece(&order(&dy)?, mesh)?)?;
        Ok(vec![
            y_full,
            natural(&g.take(&xs)?.full_tensor()?)?,
            reduced(&attn.qkv.fused().unwrap().weight, &mut g, 1)?,
            reduced(attn.qkv.fused().unwrap().bias.as_ref().unwrap(), &mut g, 1)?,
            reduced(&attn.out.weight, &mut g, 1)?,
            reduced(attn.out.bias.as_ref().unwrap(), &mut g, 1)?,
        ])
    })
    .swap_remove(0)
}

#[test]
fn attention_layer_over_cp_equals_one_rank() {
    let want = attention_run::<NoSp>(1, 1, ContextParallel::default());
    for strategy in [CpStrategy::Ring, CpStrategy::AllToAll] {
        for zigzag in [true, false] {
            let context = ContextParallel { strategy, zigzag };
            let runs = [
                ("cp=2", attention_run::<NoSp>(2, 1, context)),
                ("cp=4", attention_run::<NoSp>(4, 1, context)),
                ("cp=2 tp=2 sp", attention_run::<Sp>(2, 2, context)),
            ];
            for (what, got) in &runs {
                for (k, (a, b)) in got.iter().zip(&want).enumerate() {
                    let what = format!("{what} {strategy:?} zigzag={zigzag} item {k}");
                    assert_close(&what, a, b, 1e-10);
                }
            }
        }
    }
}

/// Counts a module's parameter elements (their master pieces on this rank).
struct Elements(u64);
impl ParamVisitor for Elements {
    fn visit<D: DataMode, K: ParamKind>(&mut self, _: &str, p: &mut Weight<D, K>) -> Result<()> {
        self.0 += p.local().numel() as u64;
        Ok(())
    }
}

/// Bytes one block's forward and backward send over `Cp` on rank 0, and the block's
/// parameter elements.
fn block_cp_bytes(cp: usize, context: ContextParallel) -> (u64, u64) {
    let x = randn(31, &[T, 16]);
    on_model_mesh(1, 1, 1, cp, 1, |mesh| {
        let mut cfg = tiny_gpt(1, S, 5);
        cfg.context = context;
        let init = ParamInit::new(5, 10, 0.3, DType::F64);
        let mut block = TransformerBlock::<NoSp, Ddp>::new(&cfg, init, mesh)?;
        let mut params = Elements(0);
        block.visit_params("", &mut params)?;
        let tape = Tape::new();
        let xs = tape.leaf(piece::<Stream<NoSp>>(
            &to_stream_order(&x, S, &context, mesh)?,
            mesh,
        )?);
        let comm = mesh.comm(AxisKind::Cp).unwrap().clone();
        let before = comm.counters();
        let y = block.forward(&tape, &xs)?;
        let seed = y.value().clone();
        let _ = y.backward_with(seed)?;
        Ok((comm.counters().since(&before).bytes_sent, params.0))
    })
    .swap_remove(0)
}

#[test]
fn block_cp_bytes_per_token_match_the_formulas() {
    // Per block, per local token, `heads` heads of dim `d` (16 = 4 × 4), f64:
    //   ring: forward K,V to cp − 1 peers: 2·d·heads·(cp − 1) elements; backward the same
    //         K,V again plus dK,dV cp times (each block's gradient travels home):
    //         2·d·heads·(2·cp − 1) more.
    //   a2a:  qkv out and the output back in the forward, dout and dqkv in the backward,
    //         each `(cp − 1)/cp` of a token's row: (3 + 1 + 1 + 3)·d·heads·(cp − 1)/cp.
    // Plus, once per step and not per token, the parameters' gradients all-reduced over
    // Cp (the adjoint of `to_compute`): 2·(cp − 1)/cp of them per rank.
    let (d, heads, e) = (4u64, 4u64, 8u64);
    let tokens = |cp: u64| T as u64 / cp;
    for cp in [2u64, 4] {
        let grads = |p: u64| 2 * (cp - 1) * p / cp * e;
        let (ring, p) = block_cp_bytes(
            cp as usize,
            ContextParallel {
                strategy: CpStrategy::Ring,
                zigzag: true,
            },
        );
        assert_eq!(
            ring - grads(p),
            (2 * d * heads * (cp - 1) + 2 * d * heads * (2 * cp - 1)) * e * tokens(cp),
            "ring cp={cp}"
        );
        let (a2a, p) = block_cp_bytes(
            cp as usize,
            ContextParallel {
                strategy: CpStrategy::AllToAll,
                zigzag: true,
            },
        );
        assert_eq!(
            a2a - grads(p),
            8 * d * heads * (cp - 1) * e * tokens(cp) / cp,
            "a2a cp={cp}"
        );
    }
}
