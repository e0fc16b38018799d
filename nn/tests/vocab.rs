//! Vocab-parallel embedding and cross-entropy against single-rank f64 references
//! (`embedding`, `embedding_backward`, `−log_softmax[target]`, `softmax − one-hot`) at
//! TP = 1, 2, 4, SP on and off, and DP×TP; vocabularies that divide unevenly too.
//! Error measure: `max |a − b| / max |b|` ≤ 1e-10.

mod common;

use common::*;
use dtensor_core::Tape;
use dtensor_kernels::ops;
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::*;

const T: usize = 12;
const H: usize = 6;
const TOL: f64 = 1e-10;

fn ids(vocab: usize, seed: usize) -> Tensor {
    Tensor::from_fn(&[T], |i| ((i * 7 + seed * 13 + 3) % vocab) as i64)
}

fn embedding_matches_reference<M: SeqMode>(vocab: usize, dp: usize, tp: usize) -> f64 {
    let table = Init::Normal { std: 0.7 }.full(9, 400, &[vocab, H], DType::F64);
    let id = ids(vocab, 1);
    let dy = randn(61, &[T, H]);
    let y_ref = ops::embedding(&table, &id).unwrap();
    let dw_ref = ops::embedding_backward(&dy, &id, vocab).unwrap();
    let errs = on_mesh(dp, tp, |mesh| {
        let emb = VocabParallelEmbedding::<Ddp>::new(
            vocab,
            H,
            ParamInit::new(9, 400, 0.7, DType::F64),
            mesh,
        )?;
        let tape = Tape::new();
        let y = emb.forward::<M>(&tape, &tape.constant(piece(&id, mesh)?))?;
        let y_full = y.value().full_tensor()?;
        let mut g = y.backward_with(piece::<Stream<M>>(&dy, mesh)?)?;
        let mut e = assert_close("embedding y", &y_full, &y_ref, TOL);
        e = e.max(assert_close(
            "embedding dW",
            &emb.weight.grad(&mut g)?.full_tensor()?,
            &dw_ref,
            TOL,
        ));
        Ok(e)
    });
    errs.into_iter().fold(0.0, f64::max)
}

#[test]
fn vocab_parallel_embedding_matches_reference() {
    for tp in TPS {
        for vocab in [16, 11] {
            let a = embedding_matches_reference::<NoSp>(vocab, 1, tp);
            let b = embedding_matches_reference::<Sp>(vocab, 1, tp);
            eprintln!("embedding vocab={vocab} tp={tp}: {a:e} (no SP), {b:e} (SP)");
        }
    }
    embedding_matches_reference::<Sp>(16, 2, 2);
}

fn cross_entropy_matches_reference(vocab: usize, dp: usize, tp: usize) -> f64 {
    let logits = randn(71, &[T, vocab]).scale(3.0);
    let tg = ids(vocab, 2);
    let dloss = randn(72, &[T]);
    let logp = ops::log_softmax(&logits).unwrap();
    let p = ops::softmax(&logits).unwrap();
    let lp = logp.to_f64_vec();
    let t = tg.as_slice::<i64>().unwrap();
    let loss_ref = Tensor::from_fn(&[T], |r| -lp[r * vocab + t[r] as usize]);
    let mut g = p.to_f64_vec();
    let d = dloss.to_f64_vec();
    for r in 0..T {
        g[r * vocab + t[r] as usize] -= 1.0;
        for v in &mut g[r * vocab..(r + 1) * vocab] {
            *v *= d[r];
        }
    }
    let dl_ref = Tensor::from_vec(g, &[T, vocab]).unwrap();
    let mean_ref = loss_ref.to_f64_vec().iter().sum::<f64>() / T as f64;
    let errs = on_mesh(dp, tp, |mesh| {
        let tape = Tape::new();
        let lg = tape.leaf(piece::<ColOut>(&logits, mesh)?);
        let loss = vocab_parallel_cross_entropy(&lg, &tape.constant(piece(&tg, mesh)?))?;
        let mean = loss_value(&mean_loss(&loss)?)?;
        let loss_full = loss.value().full_tensor()?;
        let mut g = loss.backward_with(piece(&dloss, mesh)?)?;
        let dl = g.take(&lg)?;
        let mut e = assert_close("ce loss", &loss_full, &loss_ref, TOL);
        e = e.max(assert_close("ce dlogits", &dl.full_tensor()?, &dl_ref, TOL));
        assert!(
            (mean - mean_ref).abs() <= TOL * mean_ref.abs(),
            "mean {mean} vs {mean_ref}"
        );
        Ok(e)
    });
    errs.into_iter().fold(0.0, f64::max)
}

#[test]
fn vocab_parallel_cross_entropy_matches_reference_without_gathering_logits() {
    for tp in TPS {
        for vocab in [16, 11] {
            let e = cross_entropy_matches_reference(vocab, 1, tp);
            eprintln!("cross-entropy vocab={vocab} tp={tp}: {e:e}");
        }
    }
    cross_entropy_matches_reference(16, 2, 2);
    // The loss moves per-token values over Tp, never a [tokens, vocab] logit tensor:
    // three all-reduces of T values each, whatever the vocabulary.
    let logits = randn(71, &[T, 64]);
    let tg = ids(64, 2);
    let bytes = on_mesh(1, 2, |mesh| {
        let before = mesh
            .comm(dtensor_placement::AxisKind::Tp)
            .unwrap()
            .counters();
        let tape = Tape::new();
        let lg = tape.leaf(piece::<ColOut>(&logits, mesh)?);
        let _loss = vocab_parallel_cross_entropy(&lg, &tape.constant(piece(&tg, mesh)?))?;
        let after = mesh
            .comm(dtensor_placement::AxisKind::Tp)
            .unwrap()
            .counters();
        let d = after.since(&before);
        Ok((d.collectives(), d.bytes_sent))
    });
    for (calls, sent) in bytes {
        assert_eq!(calls, 3);
        assert!(sent <= 3 * (T as u64) * 8, "sent {sent} bytes");
    }
}
