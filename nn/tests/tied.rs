//! Tied embeddings (`GptConfig::tie_embeddings`): the LM head is the embedding's weight.
//!
//! - Its gradient is the sum of both uses: equal to an untied model's embedding gradient
//!   plus its head gradient when the head starts as a copy of the embedding (f64, 1 rank),
//!   and the loss is the same.
//! - Training a tied model at dp = 2 × tp = 2 (with and without SP, with DDP's gradient
//!   buckets) equals one rank: 3 AdamW steps, losses within 1e-9, parameters within 1e-12;
//!   replicas bitwise equal; no `head.weight` parameter.
//! - Across pipeline stages it is refused, by name.

mod common;

use common::*;
use dtensor_core::{DTensor, Result, Tape};
use dtensor_kernels::Tensor;
use dtensor_nn::pipeline::{self, Pipeline};
use dtensor_nn::*;

const S: usize = 4;

fn tied(seed: u64) -> GptConfig {
    GptConfig {
        tie_embeddings: true,
        ..tiny_gpt(2, S, seed)
    }
}

fn batch() -> (Tensor, Tensor) {
    next_tokens(8 * S, |i| i * i * 5 + 2 * i + 3)
}

#[test]
fn tied_gradient_is_the_sum_of_both_uses() {
    let (ids, tg) = batch();
    let out = on_mesh(1, 1, |mesh| {
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let model = Gpt::<NoSp, Ddp>::new(tied(7), mesh)?;
        assert!(model.head.is_none(), "a tied model has no head of its own");
        let tape = Tape::new();
        let loss = model.forward(&tape, &i, &t)?;
        let tied_loss = loss_value(&loss)?;
        let mut g = loss.backward()?;
        let tied_grad = reduced(&model.embedding.weight, &mut g, 1)?;

        let mut untied = Gpt::<NoSp, Ddp>::new(tiny_gpt(2, S, 7), mesh)?;
        let emb = untied.embedding.weight.value().clone();
        untied
            .head
            .as_mut()
            .expect("an untied model has a head")
            .weight
            .restore(emb, Vec::new())?;
        let tape = Tape::new();
        let loss = untied.forward(&tape, &i, &t)?;
        let untied_loss = loss_value(&loss)?;
        let mut g = loss.backward()?;
        let sum = reduced(&untied.embedding.weight, &mut g, 1)?.add(&reduced(
            &untied.head.as_ref().unwrap().weight,
            &mut g,
            1,
        )?)?;
        Ok((tied_loss, untied_loss, tied_grad, sum))
    });
    let (tl, ul, tgrad, sum) = &out[0];
    assert_eq!(tl, ul, "the same weights give the same loss");
    assert_close("tied embedding gradient", tgrad, sum, 1e-13);
}

fn train<M: SeqMode>((dp, tp): (usize, usize), buckets: Option<usize>) -> Run {
    let (ids, tg) = batch();
    let ranks = on_mesh(dp, tp, |mesh| {
        let mut model = Gpt::<M, Ddp>::new(tied(11), mesh)?;
        model.ddp_bucket_bytes = buckets;
        let mut opt = AdamW::new(3e-3);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let losses = (0..3)
            .map(|_| Ok(model.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<Result<Vec<_>>>()?;
        Ok((losses, named_params(&mut model)?))
    });
    gather(ranks)
}

#[test]
fn tied_training_on_meshes_equals_one_rank() {
    let one = train::<NoSp>((1, 1), None);
    assert!(!one.1.contains_key("head.weight"));
    assert!(one.1.contains_key("embedding.weight"));
    for (what, got) in [
        ("dp2 tp2", train::<NoSp>((2, 2), None)),
        ("dp2 tp2 sp", train::<Sp>((2, 2), None)),
        ("dp2 tp2 sp buckets", train::<Sp>((2, 2), Some(512))),
    ] {
        for (a, b) in got.0.iter().zip(&one.0) {
            assert!((a - b).abs() <= 1e-9 * b.abs(), "{what}: loss {a} vs {b}");
        }
        assert_eq!(
            got.1.keys().collect::<Vec<_>>(),
            one.1.keys().collect::<Vec<_>>()
        );
        for (n, a) in &got.1 {
            assert_close(&format!("{what} {n}"), a, &one.1[n], 1e-12);
        }
    }
}

#[test]
fn tied_across_pipeline_stages_is_refused() {
    let errs = on_pp_mesh(2, 1, 1, |mesh| {
        let schedule = pipeline::one_f_one_b(2, 2).unwrap();
        Ok(Pipeline::<NoSp, Ddp>::new(tied(1), schedule, mesh)
            .err()
            .map(|e| e.to_string()))
    });
    for e in errs {
        let e = e.expect("refused");
        assert!(e.contains("tied embeddings across pipeline stages"), "{e}");
    }
}
