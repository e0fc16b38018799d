//! Masked attention (`ops::causal_attention_masked` and its backward: packed documents, a
//! sliding window, both) against a plain f64 reference written here the textbook way: the
//! full `s×s` scores, the mask as a predicate on `(i, j)` (`j ≤ i`, same document id,
//! `i − window < j`), a max-subtracted softmax, `P·V`; the backward through the softmax's
//! Jacobian and central finite differences of the kernel itself. Also: the empty mask is
//! plain causal attention bit for bit, tiles no query sees are skipped (counted by
//! `ops::host_tiles_computed`), and the front door's checks.
//!
//! Tolerances as `ops_attention.rs`: f64 `1e-12·|want| + 1e-12`; f32 forward `tol(F32)`,
//! f32 backward `1e-5·|want| + 1e-6·scale` (`scale` the largest `|want|`).

// The reference indexes its matrices the way the formulas do.
#![allow(clippy::needless_range_loop)]

mod common;

use common::*;
use dtensor_kernels::ops::{self, AttentionMask, CausalAttention};
use dtensor_kernels::{DType, Tensor};

/// One test shape and mask: `batch` samples of `s` tokens, `heads` query heads of dim `d`
/// in KV groups of `g`; `docs[b]` the document lengths of sample `b` (summing to `s`).
#[derive(Clone, Debug)]
struct Case {
    batch: usize,
    s: usize,
    heads: usize,
    g: usize,
    d: usize,
    docs: Option<Vec<Vec<usize>>>,
    window: Option<usize>,
}

impl Case {
    fn new(batch: usize, s: usize, heads: usize, d: usize) -> Case {
        Case {
            batch,
            s,
            heads,
            g: 1,
            d,
            docs: None,
            window: None,
        }
    }
    fn grouped(self, g: usize) -> Case {
        Case { g, ..self }
    }
    fn docs(self, docs: &[&[usize]]) -> Case {
        assert_eq!(docs.len(), self.batch);
        for l in docs {
            assert_eq!(l.iter().sum::<usize>(), self.s);
        }
        Case {
            docs: Some(docs.iter().map(|l| l.to_vec()).collect()),
            ..self
        }
    }
    fn window(self, w: usize) -> Case {
        Case {
            window: Some(w),
            ..self
        }
    }
    fn cfg(&self) -> CausalAttention {
        CausalAttention::new(self.s, self.d).grouped(self.g)
    }
    /// Per token, its document id: documents numbered from 0 in each sample.
    fn ids(&self) -> Option<Vec<u32>> {
        self.docs.as_ref().map(|docs| {
            docs.iter()
                .flat_map(|lens| {
                    lens.iter()
                        .enumerate()
                        .flat_map(|(k, &n)| std::iter::repeat_n(k as u32, n))
                })
                .collect()
        })
    }
    fn mask<'a>(&self, ids: &'a Option<Vec<u32>>) -> AttentionMask<'a> {
        AttentionMask {
            documents: ids.as_deref(),
            window: self.window,
        }
    }
    fn cols(&self) -> usize {
        self.heads / self.g * (self.g + 2) * self.d
    }
    fn q_col(&self, h: usize) -> usize {
        (h / self.g) * (self.g + 2) * self.d + (h % self.g) * self.d
    }
    fn k_col(&self, h: usize) -> usize {
        (h / self.g) * (self.g + 2) * self.d + self.g * self.d
    }
    fn qkv(&self, seed: u64, dtype: DType) -> (Tensor, Vec<f64>) {
        input(&[self.batch * self.s, self.cols()], seed, 1.5, dtype)
    }
    fn dout(&self, seed: u64, dtype: DType) -> (Tensor, Vec<f64>) {
        input(
            &[self.batch * self.s, self.heads * self.d],
            seed,
            1.0,
            dtype,
        )
    }
}

/// Whether query `i` of sample `b` sees key `j`: the definition, not the kernels' bounds.
fn visible(c: &Case, ids: &Option<Vec<u32>>, b: usize, i: usize, j: usize) -> bool {
    let same_doc = ids
        .as_ref()
        .is_none_or(|ids| ids[b * c.s + i] == ids[b * c.s + j]);
    let in_window = c.window.is_none_or(|w| i < j + w);
    j <= i && same_doc && in_window
}

/// Probabilities `P[b][h][i][j]`: per sample, head and query, a row over the keys.
type Probs = Vec<Vec<Vec<Vec<f64>>>>;

/// The reference's probabilities (0 where masked), and the lse.
fn probs(c: &Case, x: &[f64]) -> (Probs, Vec<f64>) {
    let (s, d, nh, cols) = (c.s, c.d, c.heads, c.cols());
    let scale = 1.0 / (d as f64).sqrt();
    let ids = c.ids();
    let mut lse = vec![0.0; c.batch * s * nh];
    let p = (0..c.batch)
        .map(|b| {
            (0..nh)
                .map(|h| {
                    (0..s)
                        .map(|i| {
                            let q = &x[(b * s + i) * cols + c.q_col(h)..][..d];
                            let sc: Vec<Option<f64>> = (0..s)
                                .map(|j| {
                                    visible(c, &ids, b, i, j).then(|| {
                                        let k = &x[(b * s + j) * cols + c.k_col(h)..][..d];
                                        scale * dot(q, k)
                                    })
                                })
                                .collect();
                            let m = sc
                                .iter()
                                .flatten()
                                .fold(f64::NEG_INFINITY, |a, &v| a.max(v));
                            let z: f64 = sc.iter().flatten().map(|v| (v - m).exp()).sum();
                            lse[(b * s + i) * nh + h] = m + z.ln();
                            sc.iter()
                                .map(|v| v.map_or(0.0, |v| (v - m).exp() / z))
                                .collect()
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    (p, lse)
}

/// The reference forward: `out` `[tokens, H·d]` and `lse` `[tokens, H]`.
fn reference(c: &Case, x: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (s, d, nh, cols) = (c.s, c.d, c.heads, c.cols());
    let (p, lse) = probs(c, x);
    let mut out = vec![0.0; c.batch * s * nh * d];
    for b in 0..c.batch {
        for h in 0..nh {
            for i in 0..s {
                for j in 0..s {
                    let v = &x[(b * s + j) * cols + c.k_col(h) + d..][..d];
                    for e in 0..d {
                        out[((b * s + i) * nh + h) * d + e] += p[b][h][i][j] * v[e];
                    }
                }
            }
        }
    }
    (out, lse)
}

/// The reference backward through the softmax Jacobian: `dS = P∘(dP − rowsum(P∘dP))`.
fn reference_backward(c: &Case, x: &[f64], go: &[f64]) -> Vec<f64> {
    let (s, d, nh, cols) = (c.s, c.d, c.heads, c.cols());
    let scale = 1.0 / (d as f64).sqrt();
    let (p, _) = probs(c, x);
    let mut dx = vec![0.0; x.len()];
    for b in 0..c.batch {
        for h in 0..nh {
            let (qc, kc) = (c.q_col(h), c.k_col(h));
            for i in 0..s {
                let g = &go[((b * s + i) * nh + h) * d..][..d];
                let dp: Vec<f64> = (0..s)
                    .map(|j| dot(g, &x[(b * s + j) * cols + kc + d..][..d]))
                    .collect();
                let row: f64 = (0..s).map(|j| p[b][h][i][j] * dp[j]).sum();
                for j in 0..s {
                    let pij = p[b][h][i][j];
                    let ds = pij * (dp[j] - row);
                    for e in 0..d {
                        let (qi, kj) = ((b * s + i) * cols + qc + e, (b * s + j) * cols + kc + e);
                        dx[qi] += scale * ds * x[kj];
                        dx[kj] += scale * ds * x[qi];
                        dx[kj + d] += pij * g[e];
                    }
                }
            }
        }
    }
    dx
}

/// Masks across tile edges (64), GQA and MQA, documents that differ per sample.
fn cases() -> Vec<Case> {
    vec![
        Case::new(2, 9, 2, 4).docs(&[&[4, 5], &[2, 3, 4]]),
        Case::new(2, 9, 2, 4).window(3),
        Case::new(2, 9, 2, 4).docs(&[&[9], &[1, 7, 1]]).window(4),
        Case::new(1, 150, 2, 4).docs(&[&[70, 3, 77]]),
        Case::new(1, 150, 1, 8).window(65),
        Case::new(2, 140, 2, 4)
            .docs(&[&[64, 64, 12], &[10, 120, 10]])
            .window(40),
        Case::new(2, 12, 4, 3)
            .grouped(2)
            .docs(&[&[5, 7], &[12]])
            .window(5),
        Case::new(1, 11, 4, 2)
            .grouped(4)
            .docs(&[&[3, 3, 5]])
            .window(2),
        Case::new(1, 8, 2, 4).window(1),
    ]
}

#[test]
fn masked_attention_matches_the_reference() {
    for c in cases() {
        let ids = c.ids();
        for dtype in [DType::F64, DType::F32] {
            let (qkv, x) = c.qkv(3, dtype);
            let (out, lse) = reference(&c, &x);
            let r = ops::causal_attention_masked(&qkv, &c.cfg(), &c.mask(&ids)).unwrap();
            assert_close(&format!("out {c:?}"), &r.out, &out, tol(dtype));
            assert_close(&format!("lse {c:?}"), &r.lse, &lse, tol(dtype));
        }
    }
}

#[test]
fn masked_backward_matches_the_reference() {
    for c in cases() {
        let ids = c.ids();
        for dtype in [DType::F64, DType::F32] {
            let (qkv, x) = c.qkv(5, dtype);
            let (dout, go) = c.dout(6, dtype);
            let (cfg, mask) = (c.cfg(), c.mask(&ids));
            let f = ops::causal_attention_masked(&qkv, &cfg, &mask).unwrap();
            let dx =
                ops::causal_attention_masked_backward(&dout, &qkv, &f.out, &f.lse, &cfg, &mask)
                    .unwrap();
            let want = reference_backward(&c, &x, &go);
            let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let t = if dtype == DType::F64 {
                tol(DType::F64)
            } else {
                Tol {
                    rtol: 1e-5,
                    atol: 1e-6 * scale,
                }
            };
            assert_close(&format!("dqkv {c:?}"), &dx, &want, t);
        }
    }
}

/// The largest `|analytic − numeric| / (1e-7 + 1e-7·|numeric|)`: above 1 fails
/// [`assert_fd`]'s bound.
fn fd_violation(analytic: &Tensor, numeric: &[f64]) -> f64 {
    analytic
        .to_f64_vec()
        .iter()
        .zip(numeric)
        .map(|(a, n)| (a - n).abs() / (1e-7 + 1e-7 * n.abs()))
        .fold(0.0, f64::max)
}

#[test]
fn masked_backward_matches_finite_differences_and_a_perturbed_one_does_not() {
    let small = [
        Case::new(2, 7, 2, 3).docs(&[&[3, 4], &[1, 2, 4]]),
        Case::new(1, 8, 2, 3).window(3),
        Case::new(2, 8, 4, 2)
            .grouped(2)
            .docs(&[&[5, 3], &[2, 6]])
            .window(3),
    ];
    for c in &small {
        let ids = c.ids();
        let (cfg, mask) = (c.cfg(), c.mask(&ids));
        let (qkv, x) = c.qkv(8, DType::F64);
        let (dout, go) = c.dout(9, DType::F64);
        let f = ops::causal_attention_masked(&qkv, &cfg, &mask).unwrap();
        let dx = ops::causal_attention_masked_backward(&dout, &qkv, &f.out, &f.lse, &cfg, &mask)
            .unwrap();
        let numeric = fd_grad(&x, |v| {
            let y = ops::causal_attention_masked(&t64(v, qkv.shape()), &cfg, &mask).unwrap();
            dot(&y.out.to_f64_vec(), &go)
        });
        assert_fd(&format!("dqkv {c:?}"), &dx, &numeric);
        // The backward under a mask one key wider (documents dropped, or the window grown)
        // is a wrong gradient the same check must reject.
        let wider = AttentionMask {
            documents: None,
            window: mask.window.map(|w| w + 1),
        };
        let wrong =
            ops::causal_attention_masked_backward(&dout, &qkv, &f.out, &f.lse, &cfg, &wider)
                .unwrap();
        let v = fd_violation(&wrong, &numeric);
        assert!(
            v > 1e3,
            "{c:?}: a perturbed backward passes the gradcheck ({v:e})"
        );
    }
}

#[test]
fn the_empty_mask_is_plain_causal_attention_bit_for_bit() {
    let c = Case::new(2, 130, 2, 8).grouped(2);
    let (qkv, _) = c.qkv(1, DType::F32);
    let (dout, _) = c.dout(2, DType::F32);
    let cfg = c.cfg();
    let plain = ops::causal_attention(&qkv, &cfg).unwrap();
    let dplain = ops::causal_attention_backward(&dout, &qkv, &plain.out, &plain.lse, &cfg).unwrap();
    // No documents, one document per sample, a window as long as the sample: nothing masked
    // beyond causality, so the same arithmetic.
    let one_doc = vec![7u32; 2 * 130];
    for mask in [
        AttentionMask::CAUSAL,
        AttentionMask::default().documents(&one_doc),
        AttentionMask::default().window(130),
    ] {
        let m = ops::causal_attention_masked(&qkv, &cfg, &mask).unwrap();
        assert_eq!(m, plain, "{mask:?}");
        let dm = ops::causal_attention_masked_backward(&dout, &qkv, &m.out, &m.lse, &cfg, &mask)
            .unwrap();
        assert_eq!(dm, dplain, "{mask:?}");
    }
}

#[test]
fn documents_are_runs_of_equal_ids() {
    // An id used again after another document starts a new document.
    let c = Case::new(1, 12, 2, 4);
    let (qkv, _) = c.qkv(4, DType::F64);
    let reused = [0u32, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0];
    let fresh = [0u32, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2];
    let a =
        ops::causal_attention_masked(&qkv, &c.cfg(), &AttentionMask::default().documents(&reused))
            .unwrap();
    let b =
        ops::causal_attention_masked(&qkv, &c.cfg(), &AttentionMask::default().documents(&fresh))
            .unwrap();
    assert_eq!(a, b);
}

#[test]
fn a_packed_sample_attends_like_its_documents_apart() {
    // Documents of 3 and 5 packed in one sample of 8, against the two run as samples alone.
    let (d, cols) = (4, 3 * 4);
    let (qkv, x) = input(&[8, cols], 12, 1.5, DType::F64);
    let ids = [0u32, 0, 0, 1, 1, 1, 1, 1];
    let packed = ops::causal_attention_masked(
        &qkv,
        &CausalAttention::new(8, d),
        &AttentionMask::default().documents(&ids),
    )
    .unwrap();
    let first = ops::causal_attention(
        &t64(&x[..3 * cols], &[3, cols]),
        &CausalAttention::new(3, d),
    )
    .unwrap();
    let second = ops::causal_attention(
        &t64(&x[3 * cols..], &[5, cols]),
        &CausalAttention::new(5, d),
    )
    .unwrap();
    let want: Vec<f64> = first
        .out
        .to_f64_vec()
        .into_iter()
        .chain(second.out.to_f64_vec())
        .collect();
    assert_close("packed out", &packed.out, &want, tol(DType::F64));
}

/// Tiles the host kernels compute for one forward (and, separately, one backward).
fn tiles(c: &Case) -> (u64, u64) {
    let ids = c.ids();
    let (cfg, mask) = (c.cfg(), c.mask(&ids));
    let (qkv, _) = c.qkv(1, DType::F32);
    let (dout, _) = c.dout(2, DType::F32);
    let t0 = ops::host_tiles_computed();
    let f = ops::causal_attention_masked(&qkv, &cfg, &mask).unwrap();
    let t1 = ops::host_tiles_computed();
    ops::causal_attention_masked_backward(&dout, &qkv, &f.out, &f.lse, &cfg, &mask).unwrap();
    (t1 - t0, ops::host_tiles_computed() - t1)
}

#[test]
fn tiles_no_query_sees_are_skipped() {
    // One head, one sample of 256 tokens: 4 × 4 tiles of 64.
    let base = Case::new(1, 256, 1, 4);
    // Causal: the 10 tiles on and below the diagonal.
    assert_eq!(tiles(&base), (10, 10));
    // Four documents on tile edges: the 4 diagonal tiles.
    assert_eq!(tiles(&base.clone().docs(&[&[64, 64, 64, 64]])), (4, 4));
    // A window of 64: each query tile needs its own and the previous key tile.
    assert_eq!(tiles(&base.clone().window(64)), (7, 7));
    // A window of 1 (each token sees itself): the diagonal.
    assert_eq!(tiles(&base.clone().window(1)), (4, 4));
    // Documents off the edges: tile (1, 0) holds keys 0..64 that queries 64..70 see.
    assert_eq!(tiles(&base.clone().docs(&[&[70, 186]])), (8, 8));
    // Heads and samples multiply the count.
    assert_eq!(
        tiles(&Case::new(2, 256, 2, 4).docs(&[&[64, 192], &[128, 128]])),
        (2 * (1 + 6) + 2 * (3 + 3), 2 * (1 + 6) + 2 * (3 + 3))
    );
}

#[test]
fn the_tile_rule_keeps_exactly_the_tiles_some_query_sees() {
    // key_tile_masked on aligned tiles of 4 against a brute-force search of one sample.
    let s = 32;
    let (t, window) = (4, [None, Some(1), Some(3), Some(9)]);
    let docs: Vec<u32> = (0..s as u32).map(|p| p / 7 + u32::from(p >= 20)).collect();
    for w in window {
        for with_docs in [false, true] {
            let c = Case {
                window: w,
                ..Case::new(1, s, 1, 1)
            };
            let ids = with_docs.then(|| docs.clone());
            let first = |i: usize| (0..=i).find(|&j| visible(&c, &ids, 0, i, j)).unwrap();
            for q0 in (0..s).step_by(t) {
                for k0 in (0..s).step_by(t) {
                    let any =
                        (q0..q0 + t).any(|i| (k0..k0 + t).any(|j| visible(&c, &ids, 0, i, j)));
                    let skip = ops::key_tile_masked(first(q0), q0 + t - 1, k0, k0 + t - 1);
                    // Skipping is exact on aligned tiles: a tile kept has a visible key.
                    assert_eq!(skip, !any, "w {w:?} docs {with_docs} tile ({q0}, {k0})");
                }
            }
        }
    }
}

const FWD: &str = "ops::causal_attention_masked";
const BWD: &str = "ops::causal_attention_masked_backward";

#[test]
fn bad_masks_are_errors_naming_the_op_and_sizes() {
    let c = Case::new(2, 4, 1, 2);
    let (qkv, _) = c.qkv(1, DType::F32);
    let cfg = c.cfg();
    let short = [0u32; 7];
    let e = assert_names_op(
        ops::causal_attention_masked(&qkv, &cfg, &AttentionMask::default().documents(&short)),
        FWD,
    );
    let msg = e.to_string();
    assert!(
        msg.contains("7 document ids") && msg.contains("2 samples of 4 tokens"),
        "{msg}"
    );
    let e = assert_names_op(
        ops::causal_attention_masked(&qkv, &cfg, &AttentionMask::default().window(0)),
        FWD,
    );
    assert!(e.to_string().contains("window"), "{e}");
    let f = ops::causal_attention(&qkv, &cfg).unwrap();
    let out = f.out.clone();
    assert_names_op(
        ops::causal_attention_masked_backward(
            &out,
            &qkv,
            &out,
            &f.lse,
            &cfg,
            &AttentionMask::default().documents(&short),
        ),
        BWD,
    );
    assert_names_op(
        ops::causal_attention_masked_backward(
            &out,
            &qkv,
            &out,
            &f.lse,
            &cfg,
            &AttentionMask::default().window(0),
        ),
        BWD,
    );
    // The config's own checks keep naming the masked op.
    let bad = CausalAttention { seq_len: 3, ..cfg };
    assert_names_op(
        ops::causal_attention_masked(&qkv, &bad, &AttentionMask::CAUSAL),
        FWD,
    );
}
