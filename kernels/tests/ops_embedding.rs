//! Embedding gather / scatter-add, plain and vocab-parallel (masked), against plain loops.
//! The forward is an exact copy (compared bit for bit); the backward sums each id's rows in
//! the compute type and rounds once (`common::tol` plus `count·ε·Σ|dy|`).

mod common;

use common::*;
use dtensor_kernels::ops::{self, Accum, VocabShard};
use dtensor_kernels::{DType, Error, Tensor};

const VOCAB: usize = 7;
const H: usize = 3;

fn ids64(v: &[i64], shape: &[usize]) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape).unwrap()
}

fn gather_ref(table: &[f64], ids: &[i64], start: usize, len: usize) -> Vec<f64> {
    let mut out = vec![];
    for &id in ids {
        let id = id as usize;
        if id >= start && id < start + len {
            out.extend_from_slice(&table[(id - start) * H..(id - start + 1) * H]);
        } else {
            out.extend([0.0; H]);
        }
    }
    out
}

/// `(dtable, Σ|dy| per element)` over rows `start..start+len`.
fn scatter_ref(dy: &[f64], ids: &[i64], start: usize, len: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut d, mut abs) = (vec![0.0; len * H], vec![0.0; len * H]);
    for (pos, &id) in ids.iter().enumerate() {
        let id = id as usize;
        if id >= start && id < start + len {
            for j in 0..H {
                d[(id - start) * H + j] += dy[pos * H + j];
                abs[(id - start) * H + j] += dy[pos * H + j].abs();
            }
        }
    }
    (d, abs)
}

/// Ids with repeats (id 2 four times, 6 twice) and some rows never used.
const IDS: [i64; 10] = [2, 0, 6, 2, 2, 5, 6, 1, 2, 3];

fn grad_bound(dtype: DType, abs: &[f64]) -> impl Fn(usize, f64) -> f64 + '_ {
    move |i, w| tol(dtype).rtol * w.abs() + tol(dtype).atol + 6.0 * acc_eps(dtype) * abs[i]
}

#[test]
fn embedding_forward_gathers_rows_exactly() {
    for dtype in ALL {
        let (table, tv) = input(&[VOCAB, H], 1, 1.0, dtype);
        let ids = ids64(&IDS, &[2, 5]);
        let out = ops::embedding(&table, &ids).unwrap();
        assert_eq!(out.shape(), &[2, 5, H]);
        assert_eq!(out.to_f64_vec(), gather_ref(&tv, &IDS, 0, VOCAB), "{dtype}");
        // i32 ids and a scalar id.
        let ids32 = Tensor::from_vec(IDS.iter().map(|&i| i as i32).collect(), &[10]).unwrap();
        assert_eq!(
            ops::embedding(&table, &ids32).unwrap().to_f64_vec(),
            out.to_f64_vec()
        );
        let one = ops::embedding(&table, &ids64(&[4], &[])).unwrap();
        assert_eq!(one.shape(), &[H]);
        assert_eq!(one.to_f64_vec(), tv[4 * H..5 * H].to_vec());
    }
}

#[test]
fn embedding_backward_scatter_adds_matches_reference() {
    for dtype in ALL {
        let (dy, gv) = input(&[2, 5, H], 2, 1.0, dtype);
        let ids = ids64(&IDS, &[2, 5]);
        let d = ops::embedding_backward(&dy, &ids, VOCAB).unwrap();
        assert_eq!(d.shape(), &[VOCAB, H]);
        let (want, abs) = scatter_ref(&gv, &IDS, 0, VOCAB);
        assert_close_with("embedding_backward", &d, &want, grad_bound(dtype, &abs));
        // Unused row 4 is exactly zero.
        assert!(d.to_f64_vec()[4 * H..5 * H].iter().all(|&v| v == 0.0));
    }
}

#[test]
fn embedding_backward_into_accum_add_and_replace() {
    for dtype in ALL {
        let (dy, gv) = input(&[10, H], 3, 1.0, dtype);
        let ids = ids64(&IDS, &[10]);
        let (mut d, cv) = input(&[VOCAB, H], 4, 1.0, dtype);
        ops::embedding_backward_into(&mut d, &dy, &ids, Accum::Add).unwrap();
        let (s, abs) = scatter_ref(&gv, &IDS, 0, VOCAB);
        let want: Vec<f64> = s.iter().zip(&cv).map(|(s, c)| s + c).collect();
        let abs: Vec<f64> = abs.iter().zip(&cv).map(|(a, c)| a + c.abs()).collect();
        assert_close_with("embedding_backward Add", &d, &want, grad_bound(dtype, &abs));
        // Replace ignores (and clears) the old contents, including rows no id touches.
        let mut d = make(&[f64::NAN; VOCAB * H], &[VOCAB, H], dtype).0;
        ops::embedding_backward_into(&mut d, &dy, &ids, Accum::Replace).unwrap();
        assert_eq!(d, ops::embedding_backward(&dy, &ids, VOCAB).unwrap());
    }
}

#[test]
fn embedding_backward_matches_finite_differences() {
    // The output is linear in the table: L = Σ dy ⊙ table[ids].
    let tv = values(VOCAB * H, 5);
    let gv = values(IDS.len() * H, 6);
    let ids = ids64(&IDS, &[10]);
    let loss = |t: &[f64]| {
        let y = ops::embedding(&t64(t, &[VOCAB, H]), &ids).unwrap();
        dot(&y.to_f64_vec(), &gv)
    };
    let d = ops::embedding_backward(&t64(&gv, &[10, H]), &ids, VOCAB).unwrap();
    assert_fd("embedding dtable", &d, &fd_grad(&tv, loss));
}

#[test]
fn embedding_masked_forward_zeroes_other_ranks_rows() {
    let (start, len) = (2, 3); // rows 2, 3, 4
    let shard = VocabShard {
        start,
        len,
        vocab: VOCAB,
    };
    for dtype in ALL {
        let (local, lv) = input(&[len, H], 7, 1.0, dtype);
        let out = ops::embedding_masked(&local, &ids64(&IDS, &[2, 5]), shard).unwrap();
        assert_eq!(out.shape(), &[2, 5, H]);
        assert_eq!(
            out.to_f64_vec(),
            gather_ref(&lv, &IDS, start, len),
            "{dtype}"
        );
    }
}

#[test]
fn embedding_masked_over_all_shards_sums_to_full_lookup() {
    // The vocab-parallel embedding: each rank's masked lookup, summed (the all-reduce),
    // equals the full lookup; the masked backwards, concatenated, equal the full backward.
    let (table, _) = input(&[VOCAB, H], 8, 1.0, DType::F64);
    let (dy, _) = input(&[10, H], 9, 1.0, DType::F64);
    let ids = ids64(&IDS, &[10]);
    let full = ops::embedding(&table, &ids).unwrap();
    let full_grad = ops::embedding_backward(&dy, &ids, VOCAB).unwrap();
    let mut sum = Tensor::zeros(&[10, H], DType::F64);
    let mut grads = vec![];
    let mut start = 0;
    for len in [3, 0, 4] {
        let shard = VocabShard {
            start,
            len,
            vocab: VOCAB,
        };
        let local = table.narrow(0, start, len).unwrap();
        sum.add_assign(&ops::embedding_masked(&local, &ids, shard).unwrap())
            .unwrap();
        grads.push(ops::embedding_masked_backward(&dy, &ids, shard).unwrap());
        start += len;
    }
    assert_eq!(sum, full);
    assert_eq!(Tensor::cat(&grads, 0).unwrap(), full_grad);
}

#[test]
fn embedding_masked_backward_skips_other_ranks_ids() {
    let shard = VocabShard {
        start: 2,
        len: 3,
        vocab: VOCAB,
    };
    for dtype in ALL {
        let (dy, gv) = input(&[10, H], 10, 1.0, dtype);
        let ids = ids64(&IDS, &[10]);
        let d = ops::embedding_masked_backward(&dy, &ids, shard).unwrap();
        assert_eq!(d.shape(), &[3, H]);
        let (want, abs) = scatter_ref(&gv, &IDS, 2, 3);
        assert_close_with(
            "embedding_masked_backward",
            &d,
            &want,
            grad_bound(dtype, &abs),
        );
        let (mut acc, cv) = input(&[3, H], 11, 1.0, dtype);
        ops::embedding_masked_backward_into(&mut acc, &dy, &ids, shard, Accum::Add).unwrap();
        let want: Vec<f64> = want.iter().zip(&cv).map(|(w, c)| w + c).collect();
        let abs: Vec<f64> = abs.iter().zip(&cv).map(|(a, c)| a + c.abs()).collect();
        assert_close_with(
            "embedding_masked_backward Add",
            &acc,
            &want,
            grad_bound(dtype, &abs),
        );
    }
}

#[test]
fn embedding_masked_backward_matches_finite_differences() {
    let shard = VocabShard {
        start: 3,
        len: 4,
        vocab: VOCAB,
    };
    let tv = values(4 * H, 12);
    let gv = values(IDS.len() * H, 13);
    let ids = ids64(&IDS, &[10]);
    let loss = |t: &[f64]| {
        let y = ops::embedding_masked(&t64(t, &[4, H]), &ids, shard).unwrap();
        dot(&y.to_f64_vec(), &gv)
    };
    let d = ops::embedding_masked_backward(&t64(&gv, &[10, H]), &ids, shard).unwrap();
    assert_fd("embedding_masked dtable", &d, &fd_grad(&tv, loss));
}

#[test]
fn embedding_id_out_of_range_errs_naming_id_and_vocab() {
    let table = Tensor::zeros(&[VOCAB, H], DType::F32);
    for bad in [7i64, 100, -1] {
        let ids = ids64(&[0, 1, bad, 2], &[2, 2]);
        let e = assert_names_op(ops::embedding(&table, &ids), "ops::embedding");
        let msg = e.to_string();
        assert!(
            msg.contains(&format!("id {bad}")) && msg.contains("vocab 7"),
            "{msg}"
        );
        let dy = Tensor::zeros(&[2, 2, H], DType::F32);
        let e = assert_names_op(
            ops::embedding_backward(&dy, &ids, VOCAB),
            "ops::embedding_backward",
        );
        assert!(e.to_string().contains(&format!("id {bad}")), "{e}");
    }
    let ids32 = Tensor::from_vec(vec![9i32], &[1]).unwrap();
    let e = assert_names_op(ops::embedding(&table, &ids32), "ops::embedding");
    assert!(e.to_string().contains("id 9"), "{e}");
    // The masked variant also rejects ids no rank owns (>= vocab), not just masks them.
    let shard = VocabShard {
        start: 0,
        len: 3,
        vocab: VOCAB,
    };
    let local = Tensor::zeros(&[3, H], DType::F32);
    let e = assert_names_op(
        ops::embedding_masked(&local, &ids64(&[3, 7], &[2]), shard),
        "ops::embedding_masked",
    );
    assert!(
        e.to_string().contains("id 7") && e.to_string().contains("vocab 7"),
        "{e}"
    );
}

#[test]
fn embedding_bad_shapes_and_dtypes_err_naming_op() {
    let table = Tensor::zeros(&[VOCAB, H], DType::F32);
    let ids = ids64(&[0, 1], &[2]);
    let op = "ops::embedding";
    assert_names_op(
        ops::embedding(&Tensor::zeros(&[VOCAB], DType::F32), &ids),
        op,
    );
    let float_ids = Tensor::zeros(&[2], DType::F32);
    let e = assert_names_op(ops::embedding(&table, &float_ids), op);
    assert!(e.to_string().contains("i64 or i32"), "{e}");
    let int_table = Tensor::zeros(&[VOCAB, H], DType::I64);
    assert_names_op(ops::embedding(&int_table, &ids), op);

    let op = "ops::embedding_backward";
    let e = assert_names_op(
        ops::embedding_backward(&Tensor::zeros(&[3, H], DType::F32), &ids, VOCAB),
        op,
    );
    assert!(matches!(e, Error::ShapeMismatch { .. }));
    let dy = Tensor::zeros(&[2, H], DType::F32);
    let mut wrong = Tensor::zeros(&[VOCAB, H + 1], DType::F32);
    assert_names_op(
        ops::embedding_backward_into(&mut wrong, &dy, &ids, Accum::Add),
        op,
    );
    let mut wrong = Tensor::zeros(&[VOCAB, H], DType::F64);
    assert_names_op(
        ops::embedding_backward_into(&mut wrong, &dy, &ids, Accum::Add),
        op,
    );

    let op = "ops::embedding_masked";
    let past_end = VocabShard {
        start: 5,
        len: 3,
        vocab: VOCAB,
    };
    let local = Tensor::zeros(&[3, H], DType::F32);
    assert_names_op(ops::embedding_masked(&local, &ids, past_end), op);
    let shard = VocabShard {
        start: 0,
        len: 4,
        vocab: VOCAB,
    };
    assert_names_op(ops::embedding_masked(&local, &ids, shard), op);
    let op = "ops::embedding_masked_backward";
    assert_names_op(ops::embedding_masked_backward(&dy, &ids, past_end), op);
    let mut wrong = Tensor::zeros(&[3, H], DType::F32);
    assert_names_op(
        ops::embedding_masked_backward_into(&mut wrong, &dy, &ids, shard, Accum::Replace),
        op,
    );
}
