//! Fused causal attention (`ops::causal_attention` and its backward) against a plain f64
//! reference written here the textbook way: the full `s×s` scores, the causal mask, a max-subtracted softmax, `P·V`; the backward through the
//! softmax's own Jacobian (`dS = P∘(dP − rowsum(P∘dP))`, not the kernel's `dout·out`), and
//! central finite differences of the kernel itself. The kernel takes q and k already
//! rotated; `rope_then_attention_*` check the composition the GPT layer runs
//! (`ops::rope` on the fused q and k heads, then the kernel) against the same reference with
//! RoPE written in (`pos / base^(2i/d)` in f64).
//!
//! Tolerances (`scale` = the largest `|want|` of the tensor compared):
//! - f64: `1e-12·|want| + 1e-12` everywhere (forward, lse, backward).
//! - f32: forward and lse `tol(F32)` (`1e-5·|want| + 1e-6`); backward `1e-5·|want| + 1e-6·scale`
//!   (each gradient element is a sum of up to `s` products).
//! - bf16/f16 forward: `tol(dtype)` (one rounding of an f32 computation: half an ulp plus
//!   f32 noise); lse is kept in f32, so `tol(F32)`.
//! - bf16/f16 backward: `2^-8·|want| + 2^-8·scale` (bf16), `2^-11·|want| + 2^-11·scale` (f16):
//!   besides the final rounding, `D_i = dout_i·out_i` reads the *rounded* forward output (as
//!   flash attention does), an error of the order of one ulp of the output that every `dS`
//!   of the row inherits, so it is bounded relative to the gradient's scale.
//!
//! The max errors are printed (`cargo test --test ops_attention -- --nocapture`).

// The reference indexes its matrices the way the formulas do.
#![allow(clippy::needless_range_loop)]

mod common;

use common::*;
use dtensor_kernels::ops::{self, CausalAttention, Rope, RopeStyle};
use dtensor_kernels::{DType, Error, Tensor};

/// One test shape: `batch` samples of `s` tokens, `heads` query heads of dim `d` in KV
/// groups of `g` (the grouped fused layout), scores scaled by `scale` (`None`: `1/√d`).
#[derive(Clone, Copy, Debug)]
struct Case {
    batch: usize,
    s: usize,
    heads: usize,
    g: usize,
    scale: Option<f64>,
    d: usize,
    /// RoPE (interleaved, at `pos_offset + i`, base `base`) on q and k before the attention,
    /// in the reference and through `ops::rope` for the kernel.
    rope: bool,
    pos_offset: usize,
    base: f64,
}

impl Case {
    const fn new(batch: usize, s: usize, heads: usize, d: usize) -> Case {
        Case {
            batch,
            s,
            heads,
            g: 1,
            scale: None,
            d,
            rope: false,
            pos_offset: 0,
            base: 10000.0,
        }
    }
    /// `g` query heads per KV head (`heads` must divide by it).
    const fn grouped(self, g: usize) -> Case {
        Case { g, ..self }
    }
    const fn scaled(self, scale: f64) -> Case {
        Case {
            scale: Some(scale),
            ..self
        }
    }
    const fn with_rope(self, pos_offset: usize, base: f64) -> Case {
        Case {
            rope: true,
            pos_offset,
            base,
            ..self
        }
    }
    fn tokens(&self) -> usize {
        self.batch * self.s
    }
    fn cols(&self) -> usize {
        self.heads / self.g * (self.g + 2) * self.d
    }
    /// The first column of query head `h`, and of its KV head's k (v follows).
    fn q_col(&self, h: usize) -> usize {
        (h / self.g) * (self.g + 2) * self.d + (h % self.g) * self.d
    }
    fn k_col(&self, h: usize) -> usize {
        (h / self.g) * (self.g + 2) * self.d + self.g * self.d
    }
    fn score_scale(&self) -> f64 {
        self.scale.unwrap_or(1.0 / (self.d as f64).sqrt())
    }
    fn cfg(&self) -> CausalAttention {
        CausalAttention {
            seq_len: self.s,
            head_dim: self.d,
            q_per_kv: self.g,
            scale: self.scale,
        }
    }
    /// The RoPE op's configuration and positions for the fused rows.
    fn rope(&self) -> (Rope, Vec<usize>) {
        let cfg = Rope::new(self.d, self.base, RopeStyle::Interleaved).on_fused_qkv(self.g);
        let pos = (0..self.tokens())
            .map(|t| self.pos_offset + t % self.s)
            .collect();
        (cfg, pos)
    }
    fn qkv(&self, seed: u64, dtype: DType) -> (Tensor, Vec<f64>) {
        // Values in [-2, 2): scores of O(1) to O(10), so the softmax is far from uniform.
        input(&[self.tokens(), self.cols()], seed, 2.0, dtype)
    }
    fn dout(&self, seed: u64, dtype: DType) -> (Tensor, Vec<f64>) {
        input(&[self.tokens(), self.heads * self.d], seed, 1.0, dtype)
    }
}

/// The kernel's block is 64: 1 token, sizes below, at, and across block boundaries, heads 1
/// and 3, head dims 1, 2, 3, 5, 16 and 64 (odd ones too: nothing pairs columns), several
/// samples.
const CASES: [Case; 10] = [
    Case::new(1, 1, 1, 2),
    Case::new(3, 5, 3, 2),
    Case::new(2, 7, 2, 16),
    Case::new(2, 64, 1, 16),
    Case::new(2, 70, 3, 16),
    Case::new(1, 130, 1, 64),
    Case::new(3, 65, 1, 64),
    Case::new(2, 33, 2, 3),
    Case::new(2, 9, 3, 5),
    Case::new(1, 66, 2, 1),
];

/// Grouped-query (2 and 4 query heads per KV head) and multi-query attention, odd head dims
/// and head dims unrelated to any width, and a score scale of the caller's.
const GROUPED_CASES: [Case; 6] = [
    Case::new(2, 7, 4, 4).grouped(2),
    Case::new(2, 70, 8, 3).grouped(4),
    Case::new(1, 66, 4, 5).grouped(4),
    Case::new(3, 5, 6, 2).grouped(3),
    Case::new(2, 9, 4, 3).grouped(2).scaled(0.3),
    Case::new(1, 20, 2, 4).scaled(0.7),
];

/// RoPE through the op, then the kernel: non-zero position offsets, another base.
const ROPE_CASES: [Case; 5] = [
    Case::new(2, 9, 4, 6).grouped(2).with_rope(3, 10000.0),
    Case::new(3, 5, 3, 2).with_rope(0, 10000.0),
    Case::new(2, 7, 2, 16).with_rope(5, 10000.0),
    Case::new(1, 130, 1, 64).with_rope(1000, 10000.0),
    Case::new(2, 33, 2, 64).with_rope(17, 500.0),
];

/// Rotates each pair `(x[2i], x[2i+1])` by `sign·pos / base^(2i/d)`.
fn rope(x: &mut [f64], base: f64, pos: usize, sign: f64) {
    let d = x.len();
    for i in 0..d / 2 {
        let theta = sign * pos as f64 / base.powf(2.0 * i as f64 / d as f64);
        let (c, s) = (theta.cos(), theta.sin());
        let (a, b) = (x[2 * i], x[2 * i + 1]);
        x[2 * i] = a * c - b * s;
        x[2 * i + 1] = a * s + b * c;
    }
}

/// One (head, sample): q, k (rotated with RoPE cases), v (`[s][d]`) and the full probabilities `[s][s]`.
struct HeadRef {
    q: Vec<Vec<f64>>,
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
    p: Vec<Vec<f64>>,
    lse: Vec<f64>,
}

fn head_ref(qkv: &[f64], c: &Case, h: usize, b: usize) -> HeadRef {
    let (s, d) = (c.s, c.d);
    let (mut q, mut k, mut v) = (vec![], vec![], vec![]);
    for i in 0..s {
        let row = &qkv[(b * s + i) * c.cols()..][..c.cols()];
        let (qc, kc) = (c.q_col(h), c.k_col(h));
        let (mut qi, mut ki) = (row[qc..qc + d].to_vec(), row[kc..kc + d].to_vec());
        if c.rope {
            rope(&mut qi, c.base, c.pos_offset + i, 1.0);
            rope(&mut ki, c.base, c.pos_offset + i, 1.0);
        }
        q.push(qi);
        k.push(ki);
        v.push(row[kc + d..kc + 2 * d].to_vec());
    }
    let scale = c.score_scale();
    let (mut p, mut lse) = (vec![], vec![]);
    for i in 0..s {
        let scores: Vec<f64> = (0..s)
            .map(|j| {
                if j <= i {
                    scale * dot(&q[i], &k[j])
                } else {
                    f64::NEG_INFINITY
                }
            })
            .collect();
        let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
        p.push(scores.iter().map(|x| (x - m).exp() / z).collect());
        lse.push(m + z.ln());
    }
    HeadRef { q, k, v, p, lse }
}

/// `(out [tokens, heads·d], lse [tokens, heads])`.
fn attention_ref(qkv: &[f64], c: &Case) -> (Vec<f64>, Vec<f64>) {
    let (s, d, nh) = (c.s, c.d, c.heads);
    let mut out = vec![0.0; c.tokens() * nh * d];
    let mut lse = vec![0.0; c.tokens() * nh];
    for h in 0..nh {
        for b in 0..c.batch {
            let r = head_ref(qkv, c, h, b);
            for i in 0..s {
                let t = b * s + i;
                for e in 0..d {
                    out[t * nh * d + h * d + e] = (0..s).map(|j| r.p[i][j] * r.v[j][e]).sum();
                }
                lse[t * nh + h] = r.lse[i];
            }
        }
    }
    (out, lse)
}

/// `dqkv` (the fused layout) for the output gradient `dout`: a KV head's dk and dv summed
/// over its query heads.
fn attention_back_ref(dout: &[f64], qkv: &[f64], c: &Case) -> Vec<f64> {
    let (s, d, nh) = (c.s, c.d, c.heads);
    let scale = c.score_scale();
    let mut dqkv = vec![0.0; c.tokens() * c.cols()];
    for h in 0..nh {
        for b in 0..c.batch {
            let r = head_ref(qkv, c, h, b);
            let go: Vec<&[f64]> = (0..s)
                .map(|i| &dout[(b * s + i) * nh * d + h * d..][..d])
                .collect();
            let (mut dq, mut dk, mut dv) = (
                vec![vec![0.0; d]; s],
                vec![vec![0.0; d]; s],
                vec![vec![0.0; d]; s],
            );
            for i in 0..s {
                let dp: Vec<f64> = (0..s).map(|j| dot(go[i], &r.v[j])).collect();
                let rowdot = dot(&r.p[i], &dp);
                for j in 0..s {
                    let ds = r.p[i][j] * (dp[j] - rowdot);
                    for e in 0..d {
                        dv[j][e] += r.p[i][j] * go[i][e];
                        dq[i][e] += ds * r.k[j][e] * scale;
                        dk[j][e] += ds * r.q[i][e] * scale;
                    }
                }
            }
            for i in 0..s {
                if c.rope {
                    rope(&mut dq[i], c.base, c.pos_offset + i, -1.0);
                    rope(&mut dk[i], c.base, c.pos_offset + i, -1.0);
                }
                let row = &mut dqkv[(b * s + i) * c.cols()..][..c.cols()];
                let (qc, kc) = (c.q_col(h), c.k_col(h));
                row[qc..qc + d].copy_from_slice(&dq[i]);
                for e in 0..d {
                    row[kc + e] += dk[i][e];
                    row[kc + d + e] += dv[i][e];
                }
            }
        }
    }
    dqkv
}

/// Largest `|got − want|`, and that over the tensor's scale (largest `|want|`).
fn max_err(got: &Tensor, want: &[f64]) -> (f64, f64) {
    let g = got.to_f64_vec();
    let a = g
        .iter()
        .zip(want)
        .fold(0.0f64, |a, (&g, &w)| a.max((g - w).abs()));
    (a, a / scale_of(want).max(f64::MIN_POSITIVE))
}

fn report(what: &str, c: &Case, got: &Tensor, want: &[f64]) {
    let (a, r) = max_err(got, want);
    eprintln!(
        "{what} {:?} {c:?}: max abs err {a:.2e}, over scale {r:.2e}",
        got.dtype()
    );
}

fn scale_of(want: &[f64]) -> f64 {
    want.iter().fold(0.0f64, |m, w| m.max(w.abs()))
}

#[test]
fn forward_matches_reference() {
    for c in CASES.iter().chain(&GROUPED_CASES) {
        for dtype in ALL {
            let (qkv, qv) = c.qkv(1, dtype);
            let r = ops::causal_attention(&qkv, &c.cfg()).unwrap();
            let (out, lse) = attention_ref(&qv, c);
            assert_eq!(r.out.shape(), &[c.tokens(), c.heads * c.d]);
            assert_eq!(r.out.dtype(), dtype);
            assert_eq!(r.lse.shape(), &[c.tokens(), c.heads]);
            assert_eq!(r.lse.dtype(), ops::acc_dtype(dtype));
            report("out", c, &r.out, &out);
            report("lse", c, &r.lse, &lse);
            assert_close(&format!("out {c:?}"), &r.out, &out, tol(dtype));
            assert_close(
                &format!("lse {c:?}"),
                &r.lse,
                &lse,
                tol(ops::acc_dtype(dtype)),
            );
        }
    }
}

/// The stated backward tolerance (see the module docs).
fn back_tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-12, 1e-12),
        DType::F32 => (1e-5, 1e-6),
        DType::BF16 => (2f64.powi(-8), 2f64.powi(-8)),
        DType::F16 => (2f64.powi(-11), 2f64.powi(-11)),
        other => panic!("no tolerance for {other}"),
    }
}

#[test]
fn backward_matches_reference() {
    for c in CASES.iter().chain(&GROUPED_CASES) {
        for dtype in ALL {
            let cfg = c.cfg();
            let (qkv, qv) = c.qkv(2, dtype);
            let (dout, gv) = c.dout(3, dtype);
            let f = ops::causal_attention(&qkv, &cfg).unwrap();
            let dqkv = ops::causal_attention_backward(&dout, &qkv, &f.out, &f.lse, &cfg).unwrap();
            assert_eq!(dqkv.shape(), qkv.shape());
            assert_eq!(dqkv.dtype(), dtype);
            let want = attention_back_ref(&gv, &qv, c);
            report("dqkv", c, &dqkv, &want);
            let (rtol, stol) = back_tol(dtype);
            // f64 sums stay at ~1e-15 absolute: its atol is not scaled.
            let atol = if dtype == DType::F64 {
                stol
            } else {
                stol * scale_of(&want)
            };
            assert_close(&format!("dqkv {c:?}"), &dqkv, &want, Tol { rtol, atol });
        }
    }
}

/// The GPT layer's composition: RoPE on the fused q and k heads, the kernel.
fn rope_then_attention(qkv: &Tensor, c: &Case) -> ops::CausalAttentionOutput {
    let (rope, pos) = c.rope();
    let rotated = ops::rope(qkv, &pos, &rope).unwrap();
    ops::causal_attention(&rotated, &c.cfg()).unwrap()
}

#[test]
fn rope_then_attention_matches_reference_with_rope() {
    for c in &ROPE_CASES {
        for dtype in [DType::F64, DType::F32] {
            let (qkv, qv) = c.qkv(1, dtype);
            let r = rope_then_attention(&qkv, c);
            let (out, lse) = attention_ref(&qv, c);
            report("rope+attention out", c, &r.out, &out);
            assert_close(&format!("out {c:?}"), &r.out, &out, tol(dtype));
            assert_close(&format!("lse {c:?}"), &r.lse, &lse, tol(dtype));
            // The backward of the composition: the kernel's, then RoPE's transpose.
            let (rope, pos) = c.rope();
            let rotated = ops::rope(&qkv, &pos, &rope).unwrap();
            let (dout, gv) = c.dout(3, dtype);
            let drot =
                ops::causal_attention_backward(&dout, &rotated, &r.out, &r.lse, &c.cfg()).unwrap();
            let dqkv = ops::rope_backward(&drot, &pos, &rope).unwrap();
            let want = attention_back_ref(&gv, &qv, c);
            report("rope+attention dqkv", c, &dqkv, &want);
            let (rtol, stol) = back_tol(dtype);
            let atol = if dtype == DType::F64 {
                stol
            } else {
                stol * scale_of(&want)
            };
            assert_close(&format!("dqkv {c:?}"), &dqkv, &want, Tol { rtol, atol });
        }
    }
}

#[test]
fn backward_matches_finite_differences() {
    // Small shapes (each coordinate costs two forwards); the second crosses a block edge,
    // the last has an odd head dim.
    let cases = [
        Case::new(2, 5, 2, 4),
        Case::new(1, 67, 1, 2),
        Case::new(1, 9, 1, 16),
        Case::new(2, 6, 2, 3),
        Case::new(2, 6, 4, 3).grouped(2),
        Case::new(1, 7, 4, 2).grouped(4).scaled(0.8),
    ];
    for c in &cases {
        let cfg = c.cfg();
        let (qkv, qv) = c.qkv(4, DType::F64);
        let (dout, gv) = c.dout(5, DType::F64);
        let f = ops::causal_attention(&qkv, &cfg).unwrap();
        let dqkv = ops::causal_attention_backward(&dout, &qkv, &f.out, &f.lse, &cfg).unwrap();
        let loss = |x: &[f64]| {
            let y = ops::causal_attention(&t64(x, qkv.shape()), &cfg).unwrap();
            dot(&y.out.to_f64_vec(), &gv)
        };
        let numeric = fd_grad(&qv, loss);
        report("dqkv vs finite differences", c, &dqkv, &numeric);
        assert_fd(&format!("dqkv {c:?}"), &dqkv, &numeric);
    }
}

#[test]
fn future_tokens_and_other_samples_do_not_leak() {
    // Changing token 66 of sample 0 (in the second 64-block) must leave every earlier output
    // of sample 0 and all of sample 1 bit-for-bit unchanged, and change token 66's output.
    let c = Case::new(2, 70, 2, 16);
    for dtype in [DType::F32, DType::F64] {
        let (qkv, mut qv) = c.qkv(6, dtype);
        let base = ops::causal_attention(&qkv, &c.cfg())
            .unwrap()
            .out
            .to_f64_vec();
        for x in &mut qv[66 * c.cols()..67 * c.cols()] {
            *x = -3.0 * *x + 0.5;
        }
        let (changed, _) = make(&qv, qkv.shape(), dtype);
        let got = ops::causal_attention(&changed, &c.cfg())
            .unwrap()
            .out
            .to_f64_vec();
        let w = c.heads * c.d;
        for t in 0..c.tokens() {
            let (a, b) = (&base[t * w..(t + 1) * w], &got[t * w..(t + 1) * w]);
            if t < 66 || t >= c.s {
                assert_eq!(a, b, "{dtype}: token {t} sees token 66");
            } else if t == 66 {
                assert_ne!(a, b, "{dtype}: token 66 ignores its own q, k, v");
            }
        }
    }
}

#[test]
fn rope_offset_only_changes_rounding() {
    // RoPE scores depend on position differences only, and q and k share the offset here:
    // shifting every position changes the output by rounding alone (the reference tests
    // above check that the offset is applied as specified).
    let c = Case::new(2, 70, 2, 16).with_rope(0, 10000.0);
    let (qkv, _) = c.qkv(7, DType::F64);
    let at0 = rope_then_attention(&qkv, &c);
    let shifted = Case {
        pos_offset: 12345,
        ..c
    };
    let at1 = rope_then_attention(&qkv, &shifted);
    assert_ne!(
        at0.out, at1.out,
        "the offset changes the rotated values' rounding"
    );
    assert_close(
        "offset 12345 vs 0",
        &at1.out,
        &at0.out.to_f64_vec(),
        Tol {
            rtol: 1e-10,
            atol: 1e-10,
        },
    );
}

#[test]
fn same_inputs_same_bits() {
    let c = Case::new(2, 70, 3, 16);
    let (qkv, _) = c.qkv(8, DType::F32);
    let (dout, _) = c.dout(9, DType::F32);
    let a = ops::causal_attention(&qkv, &c.cfg()).unwrap();
    let b = ops::causal_attention(&qkv, &c.cfg()).unwrap();
    assert_eq!(a, b);
    let da = ops::causal_attention_backward(&dout, &qkv, &a.out, &a.lse, &c.cfg()).unwrap();
    let db = ops::causal_attention_backward(&dout, &qkv, &b.out, &b.lse, &c.cfg()).unwrap();
    assert_eq!(da, db);
}

#[test]
fn empty_inputs() {
    // No tokens, or no heads: empty outputs, no error.
    for shape in [[0, 12], [4, 0]] {
        let qkv = Tensor::zeros(&shape, DType::F32);
        let cfg = CausalAttention {
            seq_len: 2,
            head_dim: 4,
            q_per_kv: 1,
            scale: None,
        };
        let r = ops::causal_attention(&qkv, &cfg).unwrap();
        assert_eq!(r.out.shape(), &[shape[0], shape[1] / 3]);
        assert_eq!(r.lse.shape(), &[shape[0], shape[1] / 12]);
        let d = ops::causal_attention_backward(&r.out, &qkv, &r.out, &r.lse, &cfg).unwrap();
        assert_eq!(d.shape(), &shape);
    }
}

const FWD: &str = "ops::causal_attention";
const BWD: &str = "ops::causal_attention_backward";

#[test]
fn forward_rejects_bad_arguments() {
    let good = CausalAttention {
        seq_len: 4,
        head_dim: 4,
        q_per_kv: 1,
        scale: None,
    };
    let qkv = Tensor::zeros(&[8, 24], DType::F32);
    assert!(ops::causal_attention(&qkv, &good).is_ok());
    // An odd head dim is fine (24 columns are 8 heads of 3·1, or 4 of 3·2).
    for head_dim in [1, 2] {
        assert!(ops::causal_attention(&qkv, &CausalAttention { head_dim, ..good }).is_ok());
    }
    let bad_cfgs = [
        CausalAttention { seq_len: 3, ..good }, // 8 tokens are not samples of 3
        CausalAttention { seq_len: 0, ..good }, // no samples
        CausalAttention {
            head_dim: 0,
            ..good
        }, // no head dim
        CausalAttention {
            head_dim: 6,
            ..good
        }, // 24 columns are not heads of 18
        CausalAttention {
            head_dim: 3,
            ..good
        }, // 24 columns are not heads of 9
    ];
    for cfg in bad_cfgs {
        let e = assert_names_op(ops::causal_attention(&qkv, &cfg), FWD);
        assert!(matches!(e, Error::Invalid { .. }), "{cfg:?}: {e}");
        assert_names_op(
            ops::causal_attention_backward(&qkv, &qkv, &qkv, &qkv, &cfg),
            BWD,
        );
    }
    for shape in [vec![24], vec![2, 4, 24]] {
        assert_names_op(
            ops::causal_attention(&Tensor::zeros(&shape, DType::F32), &good),
            FWD,
        );
    }
    for dtype in [DType::I32, DType::I64] {
        assert_names_op(
            ops::causal_attention(&Tensor::zeros(&[8, 24], dtype), &good),
            FWD,
        );
    }
}

#[test]
fn backward_rejects_bad_arguments() {
    let cfg = CausalAttention {
        seq_len: 4,
        head_dim: 4,
        q_per_kv: 1,
        scale: None,
    };
    let qkv = Tensor::zeros(&[8, 24], DType::F32);
    let f = ops::causal_attention(&qkv, &cfg).unwrap();
    let (out, lse) = (&f.out, &f.lse);
    assert!(ops::causal_attention_backward(out, &qkv, out, lse, &cfg).is_ok());
    let out64 = out.to_dtype(DType::F64);
    let e = assert_names_op(
        ops::causal_attention_backward(&out64, &qkv, out, lse, &cfg),
        BWD,
    );
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let e = assert_names_op(
        ops::causal_attention_backward(out, &qkv, &out64, lse, &cfg),
        BWD,
    );
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");
    let wide = Tensor::zeros(&[8, 9], DType::F32);
    assert_names_op(
        ops::causal_attention_backward(&wide, &qkv, out, lse, &cfg),
        BWD,
    );
    assert_names_op(
        ops::causal_attention_backward(out, &qkv, &wide, lse, &cfg),
        BWD,
    );
    // lse: the compute dtype (f32 for f32), [tokens, heads].
    let lse64 = lse.to_dtype(DType::F64);
    assert_names_op(
        ops::causal_attention_backward(out, &qkv, out, &lse64, &cfg),
        BWD,
    );
    let lse_t = Tensor::zeros(&[2, 8], DType::F32);
    assert_names_op(
        ops::causal_attention_backward(out, &qkv, out, &lse_t, &cfg),
        BWD,
    );
    // bf16 inputs keep an f32 lse; a bf16 one is rejected.
    let qkv16 = qkv.to_dtype(DType::BF16);
    let out16 = out.to_dtype(DType::BF16);
    assert!(ops::causal_attention_backward(&out16, &qkv16, &out16, lse, &cfg).is_ok());
    let lse16 = lse.to_dtype(DType::BF16);
    assert_names_op(
        ops::causal_attention_backward(&out16, &qkv16, &out16, &lse16, &cfg),
        BWD,
    );
}

#[test]
fn overflowing_head_dims_are_errors_not_panics() {
    let good = CausalAttention {
        seq_len: 4,
        head_dim: 4,
        q_per_kv: 1,
        scale: None,
    };
    let qkv = Tensor::zeros(&[8, 24], DType::F32);
    // 3·head_dim does not fit a usize.
    let wide = CausalAttention {
        head_dim: usize::MAX - 1,
        ..good
    };
    let e = assert_names_op(ops::causal_attention(&qkv, &wide), FWD);
    assert!(e.to_string().contains("head_dim"), "{e}");
    let (out, lse) = (
        Tensor::zeros(&[8, 8], DType::F32),
        Tensor::zeros(&[8, 2], DType::F32),
    );
    assert_names_op(
        ops::causal_attention_backward(&out, &qkv, &out, &lse, &wide),
        BWD,
    );
}
