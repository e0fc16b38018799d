//! The cross-entropy pieces (`ce_targets`, `ce_row_max`, `ce_sum_target`, `ce_loss`,
//! `ce_grad`) against a plain f64 reference (log-sum-exp over the whole vocab, `softmax −
//! onehot`, plus `z·lse²` with a z-loss), on one rank and with the vocab split into uneven
//! pieces combined as the all-reduces would (Max, then Sum), and against finite differences
//! of the loss. The argument errors name the op; a bad target is reported once, by
//! `ce_targets`, with its row and id. Rows whose target is the ignore index score 0 (no
//! z-loss either) and get a zero gradient row; the other rows keep their bits, and a z-loss
//! of 0 keeps every bit.

mod common;

use common::*;
use dtensor_kernels::ops::{self, CrossEntropyTargets, IGNORE_INDEX};
use dtensor_kernels::{DType, Error, Tensor};

const ROWS: usize = 5;
const VOCAB: usize = 13;

/// Targets in `0..VOCAB`, hitting the first and last column and every piece of `PIECES`.
fn targets() -> Vec<i64> {
    vec![0, 12, 4, 7, 9]
}

/// Uneven column pieces `(start, len)` of the vocab, one of them empty.
const PIECES: [(usize, usize); 4] = [(0, 5), (5, 0), (5, 3), (8, 5)];

/// Computed in f64 and rounded once into `dtype`: half an ulp of the stored type (an f16
/// gradient may be subnormal, where an ulp is 2^-24), and f64 noise.
fn rounded_once(dtype: DType) -> Tol {
    let t = tol(dtype);
    match dtype {
        DType::F64 => Tol {
            rtol: 1e-13,
            atol: 1e-13,
        },
        DType::F16 => Tol {
            rtol: t.rtol,
            atol: 2f64.powi(-25),
        },
        _ => Tol {
            rtol: t.rtol,
            atol: 1e-13,
        },
    }
}

/// Rows 1 and 3 ignored (−100), the others as [`targets`]: the ignored rows are uneven
/// across the vocab pieces (rows 0, 2, 4 hit pieces 0, 0 and 3).
fn masked_targets() -> Vec<i64> {
    vec![0, IGNORE_INDEX, 4, IGNORE_INDEX, 9]
}

/// `(loss, dlogits)` of `logits` (`[ROWS, VOCAB]`, f64) for `ids` and the loss gradient
/// `dy`: `ln Σ exp(l) − l[t]` and `(softmax − onehot(t))·dy`, max-subtracted; 0 and a zero
/// row where the id is [`IGNORE_INDEX`].
fn reference(l: &[f64], ids: &[i64], dy: &[f64]) -> (Vec<f64>, Vec<f64>) {
    reference_z(l, ids, dy, 0.0)
}

/// [`reference`] with a z-loss of coefficient `z`, written from its definition: the loss is
/// `lse − l[t] + z·lse²` with `lse = ln Σ_c exp(l_c)`, and its derivative by `l_c` is
/// `p_c − [c = t] + 2z·lse·p_c` (`p = softmax`, `∂lse/∂l_c = p_c`).
fn reference_z(l: &[f64], ids: &[i64], dy: &[f64], z: f64) -> (Vec<f64>, Vec<f64>) {
    let mut loss = vec![0.0; ROWS];
    let mut grad = vec![0.0; ROWS * VOCAB];
    for r in 0..ROWS {
        if ids[r] == IGNORE_INDEX {
            continue;
        }
        let row = &l[r * VOCAB..(r + 1) * VOCAB];
        let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|x| (x - m).exp()).sum();
        let t = ids[r] as usize;
        let lse = m + s.ln();
        loss[r] = lse - row[t] + z * lse * lse;
        for c in 0..VOCAB {
            let onehot = if c == t { 1.0 } else { 0.0 };
            let p = (row[c] - m).exp() / s;
            grad[r * VOCAB + c] = (p - onehot + 2.0 * z * lse * p) * dy[r];
        }
    }
    (loss, grad)
}

/// The four pieces over `pieces` of the logits' columns, the reductions done by hand:
/// `(loss, dlogits)` with the pieces' gradients joined along the columns.
fn by_pieces(
    logits: &Tensor,
    ids: &Tensor,
    dy: &Tensor,
    pieces: &[(usize, usize)],
) -> (Tensor, Tensor) {
    by_pieces_with(logits, &CrossEntropyTargets::new(ids, VOCAB), dy, pieces)
}

/// [`by_pieces`] for any targets (an ignore index among them).
fn by_pieces_with(
    logits: &Tensor,
    targets: &CrossEntropyTargets,
    dy: &Tensor,
    pieces: &[(usize, usize)],
) -> (Tensor, Tensor) {
    by_pieces_z(logits, targets, dy, pieces, 0.0)
}

/// [`by_pieces_with`] with a z-loss of coefficient `z`.
fn by_pieces_z(
    logits: &Tensor,
    targets: &CrossEntropyTargets,
    dy: &Tensor,
    pieces: &[(usize, usize)],
    z: f64,
) -> (Tensor, Tensor) {
    let checked = ops::ce_targets(logits, targets).unwrap();
    let parts: Vec<Tensor> = pieces
        .iter()
        .map(|&(c0, n)| logits.narrow(1, c0, n).unwrap())
        .collect();
    let mut max = vec![f64::NEG_INFINITY; ROWS];
    for p in &parts {
        let m = ops::ce_row_max(p).unwrap();
        for (a, b) in max.iter_mut().zip(m.as_slice::<f64>().unwrap()) {
            *a = a.max(*b);
        }
    }
    let max = Tensor::from_vec(max, &[ROWS]).unwrap();
    let (mut sum, mut target) = (vec![0.0; ROWS], vec![0.0; ROWS]);
    for (p, &(c0, _)) in parts.iter().zip(pieces) {
        let (s, t) = ops::ce_sum_target(p, &max, &checked, c0).unwrap();
        for r in 0..ROWS {
            sum[r] += s.as_slice::<f64>().unwrap()[r];
            target[r] += t.as_slice::<f64>().unwrap()[r];
        }
    }
    let sum = Tensor::from_vec(sum, &[ROWS]).unwrap();
    let target = Tensor::from_vec(target, &[ROWS]).unwrap();
    let loss = ops::ce_loss(&max, &sum, &target, z, logits.dtype()).unwrap();
    let grads: Vec<Tensor> = parts
        .iter()
        .zip(pieces)
        .map(|(p, &(c0, _))| ops::ce_grad(p, &max, &sum, &checked, dy, c0, z).unwrap())
        .collect();
    (loss, Tensor::cat(&grads, 1).unwrap())
}

#[test]
fn cross_entropy_one_rank_matches_reference() {
    for dtype in ALL {
        let (logits, l) = input(&[ROWS, VOCAB], 1, 4.0, dtype);
        let (dy, d) = input(&[ROWS], 2, 1.0, dtype);
        let ids = Tensor::from_vec(targets(), &[ROWS]).unwrap();
        let (loss, grad) = by_pieces(&logits, &ids, &dy, &[(0, VOCAB)]);
        let (want_loss, want_grad) = reference(&l, &targets(), &d);
        assert_eq!((loss.dtype(), grad.dtype()), (dtype, dtype));
        assert_eq!(grad.shape(), &[ROWS, VOCAB]);
        let t = rounded_once(dtype);
        assert_close("ce_loss", &loss, &want_loss, t);
        assert_close("ce_grad", &grad, &want_grad, t);
    }
}

#[test]
fn cross_entropy_vocab_pieces_match_one_rank() {
    for dtype in ALL {
        let (logits, l) = input(&[ROWS, VOCAB], 3, 4.0, dtype);
        let (dy, d) = input(&[ROWS], 4, 1.0, dtype);
        let ids = Tensor::from_vec(
            targets().iter().map(|&i| i as i32).collect::<Vec<_>>(),
            &[ROWS],
        )
        .unwrap();
        let (loss, grad) = by_pieces(&logits, &ids, &dy, &PIECES);
        let (want_loss, want_grad) = reference(&l, &targets(), &d);
        // The sum of exponentials is added in another grouping: a few f64 ulps apart, far
        // below the rounding into the stored type.
        let t = rounded_once(dtype);
        assert_close("ce_loss over pieces", &loss, &want_loss, t);
        assert_close("ce_grad over pieces", &grad, &want_grad, t);
    }
}

#[test]
fn cross_entropy_row_max_is_exact_and_empty_pieces_are_neutral() {
    let (logits, l) = input(&[ROWS, VOCAB], 5, 4.0, DType::F32);
    let m = ops::ce_row_max(&logits).unwrap();
    assert_eq!(m.dtype(), DType::F64);
    for r in 0..ROWS {
        let want = l[r * VOCAB..(r + 1) * VOCAB]
            .iter()
            .cloned()
            .fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(m.as_slice::<f64>().unwrap()[r], want);
    }
    // No column: max −∞ (the identity of Max), sum and target 0 (that of Sum).
    let none = logits.narrow(1, 4, 0).unwrap();
    let m0 = ops::ce_row_max(&none).unwrap();
    assert!(m0
        .as_slice::<f64>()
        .unwrap()
        .iter()
        .all(|&v| v == f64::NEG_INFINITY));
    let ids = Tensor::from_vec(targets(), &[ROWS]).unwrap();
    let checked = ops::ce_targets(&none, &CrossEntropyTargets::new(&ids, VOCAB)).unwrap();
    let (s, t) = ops::ce_sum_target(&none, &m, &checked, 4).unwrap();
    assert!(s.as_slice::<f64>().unwrap().iter().all(|&v| v == 0.0));
    assert!(t.as_slice::<f64>().unwrap().iter().all(|&v| v == 0.0));
}

#[test]
fn cross_entropy_grad_matches_finite_differences() {
    let (logits, l) = input(&[ROWS, VOCAB], 6, 2.0, DType::F64);
    let (dy, d) = input(&[ROWS], 7, 1.0, DType::F64);
    let ids = Tensor::from_vec(targets(), &[ROWS]).unwrap();
    let (_, grad) = by_pieces(&logits, &ids, &dy, &PIECES);
    let numeric = fd_grad(&l, |x| {
        let (loss, _) = reference(x, &targets(), &d);
        dot(&loss, &d)
    });
    assert_fd("ce_grad", &grad, &numeric);
}

#[test]
fn cross_entropy_bad_arguments_name_the_op() {
    let (logits, _) = input(&[ROWS, VOCAB], 8, 1.0, DType::F32);
    let ids = Tensor::from_vec(targets(), &[ROWS]).unwrap();
    let max = ops::ce_row_max(&logits).unwrap();
    let flat = logits.clone().reshape(&[ROWS * VOCAB]).unwrap();
    assert_names_op(ops::ce_row_max(&flat), "ops::ce_row_max");
    let ints = Tensor::from_vec(vec![1i32; 4], &[2, 2]).unwrap();
    assert_names_op(ops::ce_row_max(&ints), "ops::ce_row_max");
    // The targets: one per row, inside the vocab, integers; checked by ce_targets alone.
    let all = |ids| CrossEntropyTargets::new(ids, VOCAB);
    let few = Tensor::from_vec(vec![1i64; ROWS - 1], &[ROWS - 1]).unwrap();
    assert_names_op(ops::ce_targets(&logits, &all(&few)), "ops::ce_targets");
    let outside = Tensor::from_vec(vec![VOCAB as i64; ROWS], &[ROWS]).unwrap();
    assert_names_op(ops::ce_targets(&logits, &all(&outside)), "ops::ce_targets");
    let float_ids = Tensor::from_vec(vec![1.0f32; ROWS], &[ROWS]).unwrap();
    assert_names_op(
        ops::ce_targets(&logits, &all(&float_ids)),
        "ops::ce_targets",
    );
    assert_names_op(ops::ce_targets(&flat, &all(&ids)), "ops::ce_targets");
    let checked = ops::ce_targets(&logits, &all(&ids)).unwrap();
    assert_eq!(
        (checked.rows(), checked.vocab(), checked.scored()),
        (ROWS, VOCAB, ROWS)
    );
    // The max must be f64 [rows].
    let max32 = max.to_dtype(DType::F32);
    assert_names_op(
        ops::ce_sum_target(&logits, &max32, &checked, 0),
        "ops::ce_sum_target",
    );
    // Checked targets fit only logits of their rows and columns inside their vocab.
    let fewer_rows = logits.narrow(0, 0, ROWS - 1).unwrap();
    let fewer_max = ops::ce_row_max(&fewer_rows).unwrap();
    assert_names_op(
        ops::ce_sum_target(&fewer_rows, &fewer_max, &checked, 0),
        "ops::ce_sum_target",
    );
    assert_names_op(
        ops::ce_sum_target(&logits, &max, &checked, 1),
        "ops::ce_sum_target",
    );
    assert_names_op(
        ops::ce_grad(&logits, &max, &max, &checked, &max32, 1, 0.0),
        "ops::ce_grad",
    );
    // dy must be [rows] of the logits' dtype.
    assert_names_op(
        ops::ce_grad(&logits, &max, &max, &checked, &max, 0, 0.0),
        "ops::ce_grad",
    );
    let (s, t) = ops::ce_sum_target(&logits, &max, &checked, 0).unwrap();
    assert_names_op(ops::ce_loss(&max, &s, &t, 0.0, DType::I64), "ops::ce_loss");
    let short = Tensor::from_vec(vec![0.0f64; ROWS - 1], &[ROWS - 1]).unwrap();
    assert_names_op(
        ops::ce_loss(&max, &s, &short, 0.0, DType::F32),
        "ops::ce_loss",
    );
    assert_names_op(
        ops::ce_loss(&short, &s, &t, 0.0, DType::F32),
        "ops::ce_loss",
    );
    // The z-loss coefficient: finite and not negative.
    for z in [-1e-4, f64::NAN, f64::INFINITY] {
        assert_names_op(ops::ce_loss(&max, &s, &t, z, DType::F32), "ops::ce_loss");
        assert_names_op(
            ops::ce_grad(&logits, &max, &s, &checked, &max32, 0, z),
            "ops::ce_grad",
        );
    }
}

/// The distributed cross-entropy's host arithmetic, written out as `dtensor` runs it on the
/// piece `c0..c0 + cols` of each row, with the reductions (`reduce(v, is_max)`) in between:
/// `(loss, dlogits of the piece)`.
fn host_path(
    l: &[f64],
    cols: usize,
    c0: usize,
    ids: &[usize],
    d: &[f64],
    reduce: &dyn Fn(&mut Vec<f64>, bool),
    dtype: DType,
) -> (Tensor, Tensor) {
    let rows = ids.len();
    let mut max: Vec<f64> = (0..rows)
        .map(|r| {
            l[r * cols..(r + 1) * cols]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &x| m.max(x))
        })
        .collect();
    reduce(&mut max, true);
    let mut probs = vec![0.0; rows * cols];
    let mut sum = vec![0.0; rows];
    let mut target = vec![0.0; rows];
    let mut target_col = vec![None; rows];
    let here = c0..c0 + cols;
    for r in 0..rows {
        for c in 0..cols {
            let e = (l[r * cols + c] - max[r]).exp();
            probs[r * cols + c] = e;
            sum[r] += e;
        }
        if here.contains(&ids[r]) {
            let c = ids[r] - c0;
            target_col[r] = Some(c);
            target[r] = l[r * cols + c] - max[r];
        }
    }
    reduce(&mut sum, false);
    reduce(&mut target, false);
    for r in 0..rows {
        probs[r * cols..(r + 1) * cols]
            .iter_mut()
            .for_each(|p| *p /= sum[r]);
    }
    let loss: Vec<f64> = (0..rows).map(|r| sum[r].ln() - target[r]).collect();
    let mut g = probs;
    for r in 0..rows {
        if let Some(c) = target_col[r] {
            g[r * cols + c] -= 1.0;
        }
        g[r * cols..(r + 1) * cols]
            .iter_mut()
            .for_each(|v| *v *= d[r]);
    }
    (
        Tensor::from_f64_vec(loss, &[rows], dtype).unwrap(),
        Tensor::from_f64_vec(g, &[rows, cols], dtype).unwrap(),
    )
}

fn bits(t: &Tensor) -> Vec<u64> {
    t.to_f64_vec().iter().map(|v| v.to_bits()).collect()
}

#[test]
fn cross_entropy_pieces_repeat_the_distributed_host_arithmetic_bitwise() {
    let ids_u: Vec<usize> = targets().iter().map(|&i| i as usize).collect();
    let ids = Tensor::from_vec(targets(), &[ROWS]).unwrap();
    for dtype in ALL {
        let (logits, _) = input(&[ROWS, VOCAB], 9, 5.0, dtype);
        let (dy, d) = input(&[ROWS], 10, 1.0, dtype);
        // The piece 5..13 of the vocab, with "all-reduces" that add fixed terms from the
        // other piece, so the reduced values differ from the local ones.
        let (c0, cols) = (5, 8);
        let piece = logits.narrow(1, c0, cols).unwrap();
        let other_max = 0.75;
        let other_sum = 0.5;
        let reduce = |v: &mut Vec<f64>, is_max: bool| {
            for x in v.iter_mut() {
                *x = if is_max {
                    x.max(other_max)
                } else {
                    *x + other_sum
                };
            }
        };
        let (want_loss, want_grad) =
            host_path(&piece.to_f64_vec(), cols, c0, &ids_u, &d, &reduce, dtype);

        let mut max = ops::ce_row_max(&piece).unwrap().to_f64_vec();
        reduce(&mut max, true);
        let max = Tensor::from_vec(max, &[ROWS]).unwrap();
        let targets = ops::ce_targets(&piece, &CrossEntropyTargets::new(&ids, VOCAB)).unwrap();
        let (s, t) = ops::ce_sum_target(&piece, &max, &targets, c0).unwrap();
        let (mut s, mut t) = (s.to_f64_vec(), t.to_f64_vec());
        reduce(&mut s, false);
        reduce(&mut t, false);
        let (s, t) = (
            Tensor::from_vec(s, &[ROWS]).unwrap(),
            Tensor::from_vec(t, &[ROWS]).unwrap(),
        );
        let loss = ops::ce_loss(&max, &s, &t, 0.0, dtype).unwrap();
        let grad = ops::ce_grad(&piece, &max, &s, &targets, &dy, c0, 0.0).unwrap();
        assert_eq!(bits(&loss), bits(&want_loss), "{dtype}: loss");
        assert_eq!(bits(&grad), bits(&want_grad), "{dtype}: grad");
    }
}

#[test]
fn cross_entropy_ignored_rows_score_zero_over_pieces() {
    let ids = Tensor::from_vec(masked_targets(), &[ROWS]).unwrap();
    let targets = CrossEntropyTargets::new(&ids, VOCAB).ignoring(IGNORE_INDEX);
    for dtype in ALL {
        let (logits, l) = input(&[ROWS, VOCAB], 11, 4.0, dtype);
        let (dy, d) = input(&[ROWS], 12, 1.0, dtype);
        let (want_loss, want_grad) = reference(&l, &masked_targets(), &d);
        for pieces in [&[(0, VOCAB)][..], &PIECES] {
            let (loss, grad) = by_pieces_with(&logits, &targets, &dy, pieces);
            let t = rounded_once(dtype);
            assert_close("ce_loss ignoring", &loss, &want_loss, t);
            assert_close("ce_grad ignoring", &grad, &want_grad, t);
            // Exactly zero, not merely small: loss and every gradient of rows 1 and 3.
            let (lv, gv) = (loss.to_f64_vec(), grad.to_f64_vec());
            for r in [1, 3] {
                assert_eq!(lv[r].to_bits(), 0, "{dtype}: loss of ignored row {r}");
                assert!(gv[r * VOCAB..(r + 1) * VOCAB]
                    .iter()
                    .all(|&g| g.to_bits() == 0));
            }
        }
    }
}

#[test]
fn cross_entropy_ignore_index_keeps_the_scored_rows_bits() {
    // The same scored rows with and without ignored neighbours, and with an ignore index
    // that no row uses: the scored rows' loss and gradient bits do not move.
    let plain = Tensor::from_vec(targets(), &[ROWS]).unwrap();
    let masked = Tensor::from_vec(masked_targets(), &[ROWS]).unwrap();
    for dtype in ALL {
        let (logits, _) = input(&[ROWS, VOCAB], 13, 5.0, dtype);
        let (dy, _) = input(&[ROWS], 14, 1.0, dtype);
        let (loss0, grad0) = by_pieces(&logits, &plain, &dy, &PIECES);
        let unused = CrossEntropyTargets::new(&plain, VOCAB).ignoring(IGNORE_INDEX);
        let (loss1, grad1) = by_pieces_with(&logits, &unused, &dy, &PIECES);
        assert_eq!(bits(&loss0), bits(&loss1), "{dtype}: unused ignore index");
        assert_eq!(bits(&grad0), bits(&grad1), "{dtype}: unused ignore index");
        let used = CrossEntropyTargets::new(&masked, VOCAB).ignoring(IGNORE_INDEX);
        let (loss2, grad2) = by_pieces_with(&logits, &used, &dy, &PIECES);
        let (b0, b2) = (bits(&loss0), bits(&loss2));
        let (g0, g2) = (bits(&grad0), bits(&grad2));
        for r in [0, 2, 4] {
            assert_eq!(b0[r], b2[r], "{dtype}: loss of scored row {r}");
            let row = r * VOCAB..(r + 1) * VOCAB;
            assert_eq!(g0[row.clone()], g2[row], "{dtype}: grad of scored row {r}");
        }
    }
}

#[test]
fn cross_entropy_ignoring_grad_matches_finite_differences() {
    let ids = Tensor::from_vec(masked_targets(), &[ROWS]).unwrap();
    let targets = CrossEntropyTargets::new(&ids, VOCAB).ignoring(IGNORE_INDEX);
    let (logits, l) = input(&[ROWS, VOCAB], 15, 2.0, DType::F64);
    let (dy, d) = input(&[ROWS], 16, 1.0, DType::F64);
    let (_, grad) = by_pieces_with(&logits, &targets, &dy, &PIECES);
    let numeric = fd_grad(&l, |x| {
        let (loss, _) = reference(x, &masked_targets(), &d);
        dot(&loss, &d)
    });
    assert_fd("ce_grad ignoring", &grad, &numeric);
}

#[test]
fn cross_entropy_all_ignored_gives_zero_loss_and_grad() {
    let ids = Tensor::from_vec(vec![IGNORE_INDEX; ROWS], &[ROWS]).unwrap();
    let targets = CrossEntropyTargets::new(&ids, VOCAB).ignoring(IGNORE_INDEX);
    let (logits, _) = input(&[ROWS, VOCAB], 17, 4.0, DType::F32);
    let (dy, _) = input(&[ROWS], 18, 1.0, DType::F32);
    let (loss, grad) = by_pieces_with(&logits, &targets, &dy, &PIECES);
    assert!(loss.to_f64_vec().iter().all(|&v| v.to_bits() == 0));
    assert!(grad.to_f64_vec().iter().all(|&v| v.to_bits() == 0));
}

#[test]
fn cross_entropy_ignore_index_inside_the_vocab_ignores_that_class() {
    // PyTorch's rule: the ignore index wins over a class of the same id (a pad token 0).
    let ids = Tensor::from_vec(targets(), &[ROWS]).unwrap();
    let targets = CrossEntropyTargets::new(&ids, VOCAB).ignoring(0);
    let (logits, l) = input(&[ROWS, VOCAB], 19, 4.0, DType::F64);
    let (dy, d) = input(&[ROWS], 20, 1.0, DType::F64);
    let (loss, grad) = by_pieces_with(&logits, &targets, &dy, &PIECES);
    let as_ignored: Vec<i64> = targets_with_row0(IGNORE_INDEX);
    let (want_loss, want_grad) = reference(&l, &as_ignored, &d);
    assert_close(
        "ce_loss ignoring class 0",
        &loss,
        &want_loss,
        rounded_once(DType::F64),
    );
    assert_close(
        "ce_grad ignoring class 0",
        &grad,
        &want_grad,
        rounded_once(DType::F64),
    );
}

fn targets_with_row0(id: i64) -> Vec<i64> {
    let mut t = targets();
    t[0] = id;
    t
}

#[test]
fn cross_entropy_out_of_range_targets_name_the_row_and_the_id() {
    let (logits, _) = input(&[ROWS, VOCAB], 21, 1.0, DType::F32);
    // −100 without an ignore index, −1 and VOCAB with one: each an Err naming row and id,
    // from ce_targets, the one place that reads and checks the ids.
    for (bad, ignore) in [
        (IGNORE_INDEX, None),
        (-1, Some(IGNORE_INDEX)),
        (VOCAB as i64, Some(IGNORE_INDEX)),
    ] {
        let mut ids = targets();
        ids[3] = bad;
        let ids = Tensor::from_vec(ids, &[ROWS]).unwrap();
        let targets = CrossEntropyTargets {
            ids: &ids,
            vocab: VOCAB,
            ignore_index: ignore,
        };
        let err = ops::ce_targets(&logits, &targets).unwrap_err();
        assert_eq!(
            err,
            Error::TargetOutOfRange {
                op: "ops::ce_targets",
                row: 3,
                id: bad,
                vocab: VOCAB,
                ignore_index: ignore,
            }
        );
        let msg = err.to_string();
        assert!(msg.contains(&format!("target {bad} of row 3 ")), "{msg}");
    }
}

/// `(loss, dlogits)` with a z-loss of `z` over `pieces`, and the reference's.
fn z_case(
    seed: u64,
    dtype: DType,
    ids: &[i64],
    z: f64,
    pieces: &[(usize, usize)],
) -> ((Tensor, Tensor), (Vec<f64>, Vec<f64>)) {
    let (logits, l) = input(&[ROWS, VOCAB], seed, 4.0, dtype);
    let (dy, d) = input(&[ROWS], seed + 1, 1.0, dtype);
    let t = Tensor::from_vec(ids.to_vec(), &[ROWS]).unwrap();
    let targets = CrossEntropyTargets::new(&t, VOCAB).ignoring(IGNORE_INDEX);
    (
        by_pieces_z(&logits, &targets, &dy, pieces, z),
        reference_z(&l, ids, &d, z),
    )
}

#[test]
fn cross_entropy_z_loss_matches_reference_over_pieces() {
    // A large coefficient, so the z term is far above the rounding in every dtype.
    let z = 0.05;
    for dtype in ALL {
        for pieces in [&[(0, VOCAB)][..], &PIECES] {
            for ids in [targets(), masked_targets()] {
                let ((loss, grad), (want_loss, want_grad)) = z_case(23, dtype, &ids, z, pieces);
                let t = rounded_once(dtype);
                assert_close("ce_loss z-loss", &loss, &want_loss, t);
                assert_close("ce_grad z-loss", &grad, &want_grad, t);
            }
        }
    }
    // The z term is there: the loss moves by z·lse² against plain cross-entropy.
    let ((with_z, _), _) = z_case(23, DType::F64, &targets(), z, &PIECES);
    let ((plain, _), _) = z_case(23, DType::F64, &targets(), 0.0, &PIECES);
    let moved = with_z
        .to_f64_vec()
        .iter()
        .zip(plain.to_f64_vec())
        .all(|(a, b)| a - b > 1e-3);
    assert!(moved, "{with_z:?} vs {plain:?}");
}

#[test]
fn cross_entropy_z_loss_grad_matches_finite_differences() {
    let z = 0.05;
    let ids = masked_targets();
    let t = Tensor::from_vec(ids.clone(), &[ROWS]).unwrap();
    let targets = CrossEntropyTargets::new(&t, VOCAB).ignoring(IGNORE_INDEX);
    let (logits, l) = input(&[ROWS, VOCAB], 25, 2.0, DType::F64);
    let (dy, d) = input(&[ROWS], 26, 1.0, DType::F64);
    let (_, grad) = by_pieces_z(&logits, &targets, &dy, &PIECES, z);
    let numeric = fd_grad(&l, |x| {
        let (loss, _) = reference_z(x, &ids, &d, z);
        dot(&loss, &d)
    });
    assert_fd("ce_grad z-loss", &grad, &numeric);
}

#[test]
fn cross_entropy_z_loss_leaves_ignored_rows_at_zero() {
    for dtype in ALL {
        let ((loss, grad), _) = z_case(27, dtype, &masked_targets(), 0.05, &PIECES);
        let (lv, gv) = (loss.to_f64_vec(), grad.to_f64_vec());
        for r in [1, 3] {
            assert_eq!(lv[r].to_bits(), 0, "{dtype}: loss of ignored row {r}");
            assert!(gv[r * VOCAB..(r + 1) * VOCAB]
                .iter()
                .all(|&g| g.to_bits() == 0));
        }
    }
}

#[test]
fn cross_entropy_z_loss_of_zero_keeps_every_bit() {
    // z = 0 is not "plus 0·lse²": the pieces take the plain path, whose bits the
    // distributed host arithmetic test pins down.
    let ids = Tensor::from_vec(targets(), &[ROWS]).unwrap();
    for dtype in ALL {
        let (logits, _) = input(&[ROWS, VOCAB], 29, 5.0, dtype);
        let (dy, _) = input(&[ROWS], 30, 1.0, dtype);
        let (loss0, grad0) = by_pieces(&logits, &ids, &dy, &PIECES);
        let targets = CrossEntropyTargets::new(&ids, VOCAB);
        let (loss1, grad1) = by_pieces_z(&logits, &targets, &dy, &PIECES, 0.0);
        assert_eq!(bits(&loss0), bits(&loss1), "{dtype}");
        assert_eq!(bits(&grad0), bits(&grad1), "{dtype}");
    }
}
