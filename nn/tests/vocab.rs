//! Vocab-parallel embedding and cross-entropy against single-rank f64 references
//! (`embedding`, `embedding_backward`, `−log_softmax[target]`, `softmax − one-hot`) at
//! TP = 1, 2, 4, SP on and off, and DP×TP; vocabularies that divide unevenly too.
//! Error measure: `max |a − b| / max |b|` ≤ 1e-10. With an ignore index (−100): the
//! per-token loss and gradient against the same reference with those rows zeroed, and the
//! mean over the scored tokens of the global batch the same on every mesh, where the
//! ignored tokens are spread unevenly over the data ranks. With a z-loss: against the
//! definition written out in f64, tp = 2 and 4 equal to one rank, ignored tokens adding
//! nothing, and a coefficient of 0 giving plain cross-entropy's bits.

mod common;

use common::*;
use dtensor_core::{CrossEntropy, DTensor, Tape};
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

/// Targets with the ignore index on 5 of the first 6 tokens and 1 of the last 6: split over
/// `Dp` = 2 (or `Cp` = 2), the ranks hold very different numbers of scored tokens.
fn masked_ids(vocab: usize) -> Tensor {
    let ignored = [0, 1, 2, 4, 5, 9];
    Tensor::from_fn(&[T], |i| match ignored.contains(&i) {
        true => ops::IGNORE_INDEX,
        false => ((i * 7 + 29) % vocab) as i64,
    })
}

/// `(per-token loss, dlogits for dloss)` of the reference with ignored rows zeroed.
fn masked_reference(logits: &Tensor, tg: &Tensor, dloss: &Tensor) -> (Tensor, Tensor) {
    let vocab = logits.shape()[1];
    let lp = ops::log_softmax(logits).unwrap().to_f64_vec();
    let mut g = ops::softmax(logits).unwrap().to_f64_vec();
    let t = tg.as_slice::<i64>().unwrap();
    let d = dloss.to_f64_vec();
    let scored = |r: usize| t[r] != ops::IGNORE_INDEX;
    let loss = Tensor::from_fn(&[T], |r| match scored(r) {
        true => -lp[r * vocab + t[r] as usize],
        false => 0.0,
    });
    for r in 0..T {
        let row = &mut g[r * vocab..(r + 1) * vocab];
        if scored(r) {
            row[t[r] as usize] -= 1.0;
            row.iter_mut().for_each(|v| *v *= d[r]);
        } else {
            row.fill(0.0);
        }
    }
    (loss, Tensor::from_vec(g, &[T, vocab]).unwrap())
}

#[test]
fn cross_entropy_ignoring_matches_reference_on_every_mesh() {
    let vocab = 11;
    let logits = randn(81, &[T, vocab]).scale(3.0);
    let tg = masked_ids(vocab);
    let dloss = randn(82, &[T]);
    let (loss_ref, dl_ref) = masked_reference(&logits, &tg, &dloss);
    for (dp, tp) in [(1, 1), (1, 2), (2, 2)] {
        on_mesh(dp, tp, |mesh| {
            let tape = Tape::new();
            let lg = tape.leaf(piece::<ColOut>(&logits, mesh)?);
            let targets = piece::<Ids>(&tg, mesh)?;
            let loss = vocab_parallel_cross_entropy_ignoring(
                &lg,
                &tape.constant(targets.clone()),
                ops::IGNORE_INDEX,
            )?;
            // The tape-free op gives the same bits.
            let plain = lg
                .value()
                .cross_entropy_ignoring(&targets, ops::IGNORE_INDEX)?;
            assert_eq!(
                plain.as_local().to_f64_vec(),
                loss.value().as_local().to_f64_vec()
            );
            let loss_full = loss.value().full_tensor()?;
            let mut g = loss.backward_with(piece(&dloss, mesh)?)?;
            let dl = g.take(&lg)?.full_tensor()?;
            let e = assert_close("masked ce loss", &loss_full, &loss_ref, TOL).max(assert_close(
                "masked ce dlogits",
                &dl,
                &dl_ref,
                TOL,
            ));
            eprintln!("masked cross-entropy dp={dp} tp={tp}: {e:e}");
            Ok(())
        });
    }
}

#[test]
fn cross_entropy_ignoring_rejects_other_out_of_range_targets() {
    let vocab = 11;
    let logits = randn(83, &[T, vocab]);
    for bad in [-1, vocab as i64, ops::IGNORE_INDEX] {
        let tg = Tensor::from_fn(&[T], |i| if i == 3 { bad } else { 1 });
        let msgs = on_mesh(1, 2, |mesh| {
            let lg = piece::<ColOut>(&logits, mesh)?;
            let tg = piece::<Ids>(&tg, mesh)?;
            // −100 is a target like any other without an ignore index.
            let err = match bad == ops::IGNORE_INDEX {
                true => lg.cross_entropy(&tg).map(|_| ()).unwrap_err(),
                false => lg
                    .cross_entropy_ignoring(&tg, ops::IGNORE_INDEX)
                    .map(|_| ())
                    .unwrap_err(),
            };
            Ok(err.to_string())
        });
        // Checked once, by the kernels' ce_targets (row and id), the placements added.
        for m in msgs {
            assert!(
                m.starts_with("DTensor::cross_entropy: ops::ce_targets"),
                "{m}"
            );
            assert!(m.contains(&format!("target {bad} of row 3 ")), "{m}");
            assert!(m.contains("laid out as"), "{m}");
        }
    }
}

/// `(loss value, dlogits)` of the masked mean on a `dp × cp × tp` mesh: the per-token
/// losses summed and divided by the scored targets of the whole batch, or (`per_rank`) by
/// this rank's own scored targets and the data ranks' count, the mean of per-rank means.
fn masked_mean(
    logits: &Tensor,
    tg: &Tensor,
    (dp, cp, tp): (usize, usize, usize),
    per_rank: bool,
) -> (f64, Tensor) {
    let out = on_model_mesh(1, dp, 1, cp, tp, |mesh| {
        let tape = Tape::new();
        let lg = tape.leaf(piece::<ColOut>(logits, mesh)?);
        let targets = piece::<Ids>(tg, mesh)?;
        let losses = vocab_parallel_cross_entropy_ignoring(
            &lg,
            &tape.constant(targets.clone()),
            ops::IGNORE_INDEX,
        )?;
        let scored = targets.scored_tokens(Some(ops::IGNORE_INDEX))?;
        let mean = match per_rank {
            false => mean_loss_over(&losses, scored)?,
            true => {
                let ids = targets.as_local().as_slice::<i64>()?;
                let mine = ids.iter().filter(|&&i| i != ops::IGNORE_INDEX).count();
                mean_loss_over(&losses, mine * dp * cp)?
            }
        };
        let value = loss_value(&mean)?;
        let mut g = mean.backward()?;
        Ok((value, g.take(&lg)?.full_tensor()?))
    });
    let (value, dl) = out[0].clone();
    for (v, d) in &out {
        assert_eq!(
            v.to_bits(),
            value.to_bits(),
            "every rank reads the same loss"
        );
        assert_eq!(d.to_f64_vec(), dl.to_f64_vec());
    }
    (value, dl)
}

#[test]
fn masked_mean_loss_is_the_same_on_every_mesh_with_uneven_ignored_tokens() {
    let vocab = 11;
    let logits = randn(84, &[T, vocab]).scale(3.0);
    let tg = masked_ids(vocab);
    let scored = 6;
    let ones = Tensor::from_vec(vec![1.0 / scored as f64; T], &[T]).unwrap();
    let (loss_ref, dl_ref) = masked_reference(&logits, &tg, &ones);
    let mean_ref = loss_ref.to_f64_vec().iter().sum::<f64>() / scored as f64;
    let meshes = [
        (1, 1, 1),
        (1, 1, 2),
        (2, 1, 1),
        (2, 1, 2),
        (2, 2, 1),
        (1, 2, 2),
    ];
    for mesh in meshes {
        let (mean, dl) = masked_mean(&logits, &tg, mesh, false);
        assert!(
            (mean - mean_ref).abs() <= TOL * mean_ref.abs(),
            "{mesh:?}: mean {mean} vs {mean_ref}"
        );
        assert_close("masked mean dlogits", &dl, &dl_ref, TOL);
        // The count is summed over the token axes only: the same on every mesh.
        let counts = on_model_mesh(1, mesh.0, 1, mesh.1, mesh.2, |m| {
            piece::<Ids>(&tg, m)?.scored_tokens(Some(ops::IGNORE_INDEX))
        });
        assert!(counts.iter().all(|&c| c == scored), "{mesh:?}: {counts:?}");
    }
    // A mean of per-rank means (each rank dividing by its own scored tokens) agrees on one
    // data rank and not on two, where rank 0 holds 1 scored token and rank 1 holds 5.
    let (one, _) = masked_mean(&logits, &tg, (1, 1, 2), true);
    assert!((one - mean_ref).abs() <= TOL * mean_ref.abs());
    let (two, _) = masked_mean(&logits, &tg, (2, 1, 2), true);
    assert!(
        (two - mean_ref).abs() > 0.01 * mean_ref.abs(),
        "per-rank means {two} should differ from {mean_ref}"
    );
}

#[test]
fn masked_mean_loss_of_an_all_ignored_batch_is_zero() {
    let vocab = 11;
    let logits = randn(85, &[T, vocab]).scale(3.0);
    let tg = Tensor::from_vec(vec![ops::IGNORE_INDEX; T], &[T]).unwrap();
    for mesh in [(1, 1, 1), (2, 1, 2)] {
        let (mean, dl) = masked_mean(&logits, &tg, mesh, false);
        assert_eq!(mean.to_bits(), 0, "{mesh:?}: loss {mean}");
        assert!(
            dl.to_f64_vec().iter().all(|&g| g.to_bits() == 0),
            "{mesh:?}"
        );
    }
}

/// `(per-token loss, dlogits for dloss)` with a z-loss of `z`, from the definition in f64:
/// `lse − l[t] + z·lse²` with `lse = ln Σ_c exp(l_c)` (max-subtracted), derivative
/// `p_c − [c = t] + 2z·lse·p_c`; ignored rows (−100) 0 and a zero row.
fn z_reference(logits: &Tensor, tg: &Tensor, dloss: &Tensor, z: f64) -> (Tensor, Tensor) {
    let vocab = logits.shape()[1];
    let l = logits.to_f64_vec();
    let t = tg.as_slice::<i64>().unwrap();
    let d = dloss.to_f64_vec();
    let (mut loss, mut grad) = (vec![0.0; T], vec![0.0; T * vocab]);
    for r in (0..T).filter(|&r| t[r] != ops::IGNORE_INDEX) {
        let row = &l[r * vocab..(r + 1) * vocab];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|x| (x - m).exp()).sum();
        let lse = m + s.ln();
        let target = t[r] as usize;
        loss[r] = lse - row[target] + z * lse * lse;
        for c in 0..vocab {
            let p = (row[c] - m).exp() / s;
            let onehot = if c == target { 1.0 } else { 0.0 };
            grad[r * vocab + c] = (p - onehot + 2.0 * z * lse * p) * d[r];
        }
    }
    (
        Tensor::from_vec(loss, &[T]).unwrap(),
        Tensor::from_vec(grad, &[T, vocab]).unwrap(),
    )
}

/// `(per-token loss, dlogits)` of the vocab-parallel loss with `options` on `dp × tp`, as
/// whole tensors (every rank's the same: the first's).
fn with_options(
    logits: &Tensor,
    tg: &Tensor,
    dloss: &Tensor,
    (dp, tp): (usize, usize),
    options: CrossEntropy,
) -> (Tensor, Tensor) {
    let out = on_mesh(dp, tp, |mesh| {
        let tape = Tape::new();
        let lg = tape.leaf(piece::<ColOut>(logits, mesh)?);
        let loss =
            vocab_parallel_cross_entropy_with(&lg, &tape.constant(piece(tg, mesh)?), options)?;
        let loss_full = loss.value().full_tensor()?;
        let mut g = loss.backward_with(piece(dloss, mesh)?)?;
        Ok((loss_full, g.take(&lg)?.full_tensor()?))
    });
    out[0].clone()
}

#[test]
fn z_loss_matches_reference_and_one_rank_with_the_vocab_split() {
    let vocab = 11;
    // Large logits, so lse is far from 0 and the z term is large.
    let shifted = randn(86, &[T, vocab])
        .to_f64_vec()
        .iter()
        .map(|x| 3.0 * x + 2.0)
        .collect();
    let logits = Tensor::from_vec(shifted, &[T, vocab]).unwrap();
    let dloss = randn(87, &[T]);
    let z = 0.02;
    for tg in [ids(vocab, 3), masked_ids(vocab)] {
        let (loss_ref, dl_ref) = z_reference(&logits, &tg, &dloss, z);
        let options = CrossEntropy::default()
            .ignoring(ops::IGNORE_INDEX)
            .with_z_loss(z);
        let (one_loss, one_dl) = with_options(&logits, &tg, &dloss, (1, 1), options);
        assert_close("z-loss one rank", &one_loss, &loss_ref, TOL);
        assert_close("z-loss dlogits one rank", &one_dl, &dl_ref, TOL);
        // The z term is in: the loss is not plain cross-entropy's.
        let (plain, _) = z_reference(&logits, &tg, &dloss, 0.0);
        assert!(rel_err(&one_loss, &plain) > 0.1);
        for mesh in [(1, 2), (1, 4), (2, 2)] {
            let (loss, dl) = with_options(&logits, &tg, &dloss, mesh, options);
            // lse from the max and Σ exp reduced over Tp: one rank's, up to the order of
            // the sum over the vocab pieces.
            let e = assert_close("z-loss vs one rank", &loss, &one_loss, 1e-13).max(assert_close(
                "z-loss dlogits vs one rank",
                &dl,
                &one_dl,
                1e-13,
            ));
            eprintln!("z-loss dp={} tp={}: {e:e} from one rank", mesh.0, mesh.1);
            // Ignored tokens add no z-loss and get no gradient.
            let (lv, gv) = (loss.to_f64_vec(), dl.to_f64_vec());
            let t = tg.as_slice::<i64>().unwrap();
            for r in (0..T).filter(|&r| t[r] == ops::IGNORE_INDEX) {
                assert_eq!(lv[r].to_bits(), 0, "{mesh:?}: loss of ignored token {r}");
                let row = &gv[r * vocab..(r + 1) * vocab];
                assert!(row.iter().all(|g| g.to_bits() == 0), "{mesh:?}: row {r}");
            }
        }
    }
}

#[test]
fn z_loss_of_zero_is_plain_cross_entropy_bit_for_bit() {
    let vocab = 11;
    let logits = randn(88, &[T, vocab]).scale(3.0);
    let dloss = randn(89, &[T]);
    let tg = ids(vocab, 4);
    let bits = |t: &Tensor| -> Vec<u64> { t.to_f64_vec().iter().map(|v| v.to_bits()).collect() };
    for mesh in [(1, 1), (1, 2)] {
        let (a, da) = with_options(&logits, &tg, &dloss, mesh, CrossEntropy::default());
        let (b, db) = with_options(
            &logits,
            &tg,
            &dloss,
            mesh,
            CrossEntropy::default().with_z_loss(0.0),
        );
        let out = on_mesh(mesh.0, mesh.1, |m| {
            let lg = piece::<ColOut>(&logits, m)?;
            lg.cross_entropy(&piece::<Ids>(&tg, m)?)?.full_tensor()
        });
        assert_eq!(bits(&a), bits(&out[0]), "{mesh:?}");
        assert_eq!(bits(&a), bits(&b), "{mesh:?}");
        assert_eq!(bits(&da), bits(&db), "{mesh:?}");
    }
}

#[test]
fn z_loss_coefficient_must_be_finite_and_not_negative() {
    let vocab = 11;
    let logits = randn(90, &[T, vocab]);
    let tg = ids(vocab, 5);
    for z in [-0.1, f64::NAN, f64::INFINITY] {
        let msgs = on_mesh(1, 2, |mesh| {
            let lg = piece::<ColOut>(&logits, mesh)?;
            let tg = piece::<Ids>(&tg, mesh)?;
            let options = CrossEntropy::default().with_z_loss(z);
            Ok(lg.cross_entropy_with(&tg, options).unwrap_err().to_string())
        });
        for m in msgs {
            assert!(m.contains("z-loss coefficient"), "{m}");
        }
    }
}

#[test]
fn scored_tokens_of_microbatches_is_one_all_reduce_per_axis() {
    let vocab = 11;
    let tg = masked_ids(vocab);
    let halves = [
        tg.narrow(0, 0, T / 2).unwrap(),
        tg.narrow(0, T / 2, T / 2).unwrap(),
    ];
    let out = on_model_mesh(1, 2, 1, 1, 2, |mesh| {
        let mbs: Vec<DTensor<Ids>> = halves
            .iter()
            .map(|h| piece(h, mesh))
            .collect::<Result<_, _>>()?;
        let dp = mesh.comm(dtensor_placement::AxisKind::Dp).unwrap();
        let before = dp.counters();
        let n = DTensor::scored_tokens_of(&mbs, Some(ops::IGNORE_INDEX))?;
        Ok((n, dp.counters().since(&before).collectives()))
    });
    // 6 scored of 12 (5 of the first half's 6 ignored, 1 of the second's), one call.
    assert!(out.iter().all(|&o| o == (6, 1)), "{out:?}");
}
