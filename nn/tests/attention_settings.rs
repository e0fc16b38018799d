//! The attention layer's settings: a free head dim, the softmax scale, RoPE with partial
//! rotary dims and frequency scaling, q/k/v biases without an output bias, the per-head
//! q/k RMSNorm, and KV heads shared by more `Tp` ranks than there are KV heads.
//!
//! - At `tp = 1` each setting against a naive single-rank f64 implementation written here:
//!   the forward, and the input and parameter gradients against central differences of it.
//! - Over `tp = 2` and `dp = 2 × tp = 2` (SP on and off), and `tp = 4` over 2 KV heads, the
//!   output and every gradient equal `tp = 1` (the shared-KV parameters mapped back to the
//!   fused rows), multi-query attention (`kv_heads = 1`) at `tp = 2` included.
//! - A GPT with multi-query attention trains at `dp = 2 × tp = 2` as at one rank, with the
//!   replicated KV weights bitwise identical on every rank after each step.

mod common;

use common::*;
use dtensor_core::{DTensor, Gradients, Result, Tape};
use dtensor_kernels::ops::{RopeScaling, RopeStyle};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::*;
use dtensor_placement::AxisKind;

const S: usize = 6;
const B: usize = 4;
const T: usize = S * B;
const H: usize = 12;
const SEED: u64 = 7;
const ID: u64 = 40;
const W_STD: f64 = 0.3;
const B_STD: f64 = 0.1;
const O_STD: f64 = 0.2;

fn init() -> ParamInit {
    ParamInit::new(SEED, ID, W_STD, DType::F64).with_bias_std(B_STD)
}

/// 4 query heads of 6 columns over a width of 12 (`heads·head_dim ≠ hidden`), 2 KV heads.
fn base() -> AttentionConfig {
    let mut c = AttentionConfig::new(H, 4, S, RopeStyle::HalfSplit);
    c.kv_heads = 2;
    c.head_dim = Some(6);
    c.rope.base = 50.0;
    c
}

/// Every setting at once: free head dim, scale, partial rotary dim with linear scaling,
/// q/k/v biases only, q/k norm.
fn everything() -> AttentionConfig {
    let mut c = base();
    c.scale = Some(0.3);
    c.rope.rotary_dim = Some(4);
    c.rope.scaling = RopeScaling::Linear { factor: 2.0 };
    c.rope.style = RopeStyle::Interleaved;
    c.qkv_bias = true;
    c.qk_norm = Some(1e-3);
    c
}

/// The settings one by one (on [`base`]), all together, and multi-query attention.
fn settings() -> Vec<(&'static str, AttentionConfig)> {
    let mut scale = base();
    scale.scale = Some(0.25);
    let mut rope = base();
    rope.rope.rotary_dim = Some(2);
    rope.rope.scaling = RopeScaling::Linear { factor: 4.0 };
    let mut biases = base();
    biases.qkv_bias = true;
    let mut out_bias = base();
    out_bias.out_bias = true;
    let mut qk_norm = base();
    qk_norm.qk_norm = Some(1e-5);
    let mut mqa = everything();
    mqa.kv_heads = 1;
    vec![
        ("head_dim 6 over hidden 12", base()),
        ("scale", scale),
        ("rotary dim 2, linear scaling", rope),
        ("qkv bias, no out bias", biases),
        ("out bias only", out_bias),
        ("qk norm", qk_norm),
        ("everything", everything()),
        ("multi-query, everything", mqa),
    ]
}

/// The layer's parameters as whole f64 tensors in the fused layout (the naive model's).
#[derive(Clone)]
struct Params {
    wqkv: Vec<f64>,
    bqkv: Option<Vec<f64>>,
    wo: Vec<f64>,
    bo: Option<Vec<f64>>,
    qn: Option<Vec<f64>>,
    kn: Option<Vec<f64>>,
}

/// The values the layer draws (same seed, ids and global indices; norm weights ones).
fn params(c: &AttentionConfig) -> Params {
    let d = c.head_dim();
    let normal = |std: f64, id: u64, shape: &[usize]| {
        Init::Normal { std }
            .full(SEED, id, shape, DType::F64)
            .to_f64_vec()
    };
    Params {
        wqkv: normal(W_STD, ID, &[c.qkv_rows(), H]),
        bqkv: c.qkv_bias.then(|| normal(B_STD, ID + 1, &[c.qkv_rows()])),
        wo: normal(O_STD, ID + 2, &[H, c.heads * d]),
        bo: c.out_bias.then(|| normal(B_STD, ID + 3, &[H])),
        qn: c.qk_norm.map(|_| vec![1.0; d]),
        kn: c.qk_norm.map(|_| vec![1.0; d]),
    }
}

/// Naive attention written from the definitions, independently of the layer: `x·Wᵀ + b`
/// into fused rows (per KV group its q heads, then k, then v), RMSNorm of each q and k
/// head, RoPE on the first `rotary_dim` columns (inverse frequencies divided by a linear
/// factor), causal softmax of `scale·q·kᵀ` per sample, the output projection.
fn naive(x: &[f64], c: &AttentionConfig, p: &Params) -> Vec<f64> {
    let (heads, kv, d) = (c.heads, c.kv_heads, c.head_dim());
    let (g, rows, width) = (heads / kv, c.qkv_rows(), heads * d);
    let r = c.rotary_dim();
    let factor = match c.rope.scaling {
        RopeScaling::None => 1.0,
        RopeScaling::Linear { factor } => factor,
        other => panic!("the naive model has no {other:?}"),
    };
    let scale = c.scale.unwrap_or(1.0 / (d as f64).sqrt());
    let linear = |x: &[f64], w: &[f64], b: Option<&Vec<f64>>, n_in: usize, n_out: usize| {
        let mut y = vec![0.0; T * n_out];
        for t in 0..T {
            for o in 0..n_out {
                let dot: f64 = (0..n_in).map(|i| x[t * n_in + i] * w[o * n_in + i]).sum();
                y[t * n_out + o] = dot + b.map_or(0.0, |b| b[o]);
            }
        }
        y
    };
    let qkv = linear(x, &p.wqkv, p.bqkv.as_ref(), H, rows);
    let norm = |v: &[f64], w: Option<&Vec<f64>>| -> Vec<f64> {
        match (w, c.qk_norm) {
            (Some(w), Some(eps)) => {
                let ms = v.iter().map(|a| a * a).sum::<f64>() / d as f64;
                let rstd = 1.0 / (ms + eps).sqrt();
                v.iter().zip(w).map(|(a, w)| a * rstd * w).collect()
            }
            _ => v.to_vec(),
        }
    };
    let rot = |v: &[f64], pos: usize| -> Vec<f64> {
        let mut out = v.to_vec();
        for i in 0..r / 2 {
            let th = pos as f64 * c.rope.base.powf(-(2.0 * i as f64) / r as f64) / factor;
            let (a, b) = match c.rope.style {
                RopeStyle::HalfSplit => (i, i + r / 2),
                RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            };
            out[a] = v[a] * th.cos() - v[b] * th.sin();
            out[b] = v[a] * th.sin() + v[b] * th.cos();
        }
        out
    };
    let q_col = |h: usize| (h / g) * (g + 2) * d + (h % g) * d;
    let kv_col = |j: usize, which: usize| j * (g + 2) * d + (g + which) * d;
    let mut o = vec![0.0; T * width];
    for b in 0..B {
        let head = |t: usize, col: usize| {
            let base = (b * S + t) * rows + col;
            qkv[base..base + d].to_vec()
        };
        for h in 0..heads {
            let j = h / g;
            for i in 0..S {
                let q = rot(&norm(&head(i, q_col(h)), p.qn.as_ref()), i);
                let scores: Vec<f64> = (0..=i)
                    .map(|t| {
                        let k = rot(&norm(&head(t, kv_col(j, 0)), p.kn.as_ref()), t);
                        scale * q.iter().zip(&k).map(|(a, b)| a * b).sum::<f64>()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                for (t, s) in scores.iter().enumerate() {
                    let w = (s - m).exp() / z;
                    for (e, v) in head(t, kv_col(j, 1)).iter().enumerate() {
                        o[(b * S + i) * width + h * d + e] += w * v;
                    }
                }
            }
        }
    }
    linear(&o, &p.wo, p.bo.as_ref(), width, H)
}

/// A layer run's whole tensors: output, input gradient, then the parameter gradients in
/// the fused layout: QKV weight, QKV bias, output weight, output bias, q norm, k norm
/// (absent ones empty).
type Run = Vec<Vec<f64>>;

/// The fused row of q row `r` and of KV row `r` (k then v per KV head), as the layer
/// documents for shared KV heads.
fn fused_rows(c: &AttentionConfig) -> (Vec<usize>, Vec<usize>) {
    let (d, g) = (c.head_dim(), c.q_per_kv());
    let group = (g + 2) * d;
    let q = (0..c.heads * d)
        .map(|r| (r / d / g) * group + (r / d % g) * d + r % d)
        .collect();
    let kv = (0..2 * c.kv_heads * d)
        .map(|r| (r / (2 * d)) * group + g * d + r % (2 * d))
        .collect();
    (q, kv)
}

/// The q and KV gradients (`[rows, cols]` each) written into the fused rows.
fn unshare(c: &AttentionConfig, q: &[f64], kv: &[f64], cols: usize) -> Vec<f64> {
    let (q_rows, kv_rows) = fused_rows(c);
    let mut out = vec![f64::NAN; c.qkv_rows() * cols];
    for (src, rows) in [(q, &q_rows), (kv, &kv_rows)] {
        for (r, &f) in rows.iter().enumerate() {
            out[f * cols..(f + 1) * cols].copy_from_slice(&src[r * cols..(r + 1) * cols]);
        }
    }
    out
}

fn grad_of<D: DataMode, K: ParamKind>(
    w: Option<&Weight<D, K>>,
    g: &mut Gradients,
    dp: usize,
) -> Result<Vec<f64>> {
    w.map_or(Ok(Vec::new()), |w| Ok(reduced(w, g, dp)?.to_f64_vec()))
}

fn layer_run<M: SeqMode>(c: &AttentionConfig, dp: usize, tp: usize, x: &Tensor) -> Run {
    let dy = randn(62, &[T, H]);
    on_mesh(dp, tp, |mesh| {
        let attn = ParallelAttention::<M, Ddp>::new(*c, init(), O_STD, mesh)?;
        let tape = Tape::new();
        let xs = tape.leaf(piece::<Stream<M>>(x, mesh)?);
        let y = attn.forward(&tape, &xs)?;
        let y_full = y.value().full_tensor()?.to_f64_vec();
        let mut g = y.backward_with(piece(&dy, mesh)?)?;
        let dx = g.take(&xs)?.full_tensor()?.to_f64_vec();
        let (w, b) = match &attn.qkv {
            QkvProjection::Fused(l) => (
                grad_of(Some(&l.weight), &mut g, dp)?,
                grad_of(l.bias.as_ref(), &mut g, dp)?,
            ),
            QkvProjection::SharedKv(s) => {
                let w = unshare(
                    c,
                    &grad_of(Some(&s.q.weight), &mut g, dp)?,
                    &grad_of(Some(&s.kv_weight), &mut g, dp)?,
                    H,
                );
                let b = match (&s.q.bias, &s.kv_bias) {
                    (Some(qb), Some(kvb)) => unshare(
                        c,
                        &grad_of(Some(qb), &mut g, dp)?,
                        &grad_of(Some(kvb), &mut g, dp)?,
                        1,
                    ),
                    _ => Vec::new(),
                };
                (w, b)
            }
        };
        assert_eq!(
            matches!(attn.qkv, QkvProjection::SharedKv(_)),
            tp > c.kv_heads,
            "KV heads are shared exactly when tp exceeds them"
        );
        Ok(vec![
            y_full,
            dx,
            w,
            b,
            grad_of(Some(&attn.out.weight), &mut g, dp)?,
            grad_of(attn.out.bias.as_ref(), &mut g, dp)?,
            grad_of(attn.qk_norm.as_ref().map(|n| &n.q), &mut g, dp)?,
            grad_of(attn.qk_norm.as_ref().map(|n| &n.k), &mut g, dp)?,
        ])
    })
    .swap_remove(0)
}

fn max_rel(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f64, |m, v| m.max(v.abs())).max(1e-300);
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / scale)
        .fold(0.0, f64::max)
}

/// Central differences of `sum(naive · dy)` at a few entries of one input of the naive
/// model, against the layer's gradient there.
fn check_fd(what: &str, grad: &[f64], value: &[f64], f: impl Fn(&[f64]) -> f64) {
    let eps = 1e-5;
    let n = value.len();
    for idx in [0, 1, n / 3, n / 2, n - 2, n - 1] {
        let mut v = value.to_vec();
        v[idx] += eps;
        let lp = f(&v);
        v[idx] -= 2.0 * eps;
        let lm = f(&v);
        let fd = (lp - lm) / (2.0 * eps);
        assert!(
            (fd - grad[idx]).abs() <= 1e-7 * (1.0 + fd.abs()),
            "{what}[{idx}]: layer {} vs central difference {fd}",
            grad[idx]
        );
    }
}

#[test]
fn attention_settings_at_tp1_match_naive_forward_and_central_differences() {
    let x = randn(61, &[T, H]);
    let dy = randn(62, &[T, H]).to_f64_vec();
    let xv = x.to_f64_vec();
    for (name, c) in settings() {
        let p = params(&c);
        let got = layer_run::<NoSp>(&c, 1, 1, &x);
        let want = naive(&xv, &c, &p);
        let e = max_rel(&got[0], &want);
        assert!(e <= 1e-12, "{name}: forward off by {e:e}");
        let loss = |x: &[f64], p: &Params| -> f64 {
            naive(x, &c, p).iter().zip(&dy).map(|(a, b)| a * b).sum()
        };
        check_fd(&format!("{name}: dx"), &got[1], &xv, |v| loss(v, &p));
        check_fd(&format!("{name}: dWqkv"), &got[2], &p.wqkv, |v| {
            loss(
                &xv,
                &Params {
                    wqkv: v.to_vec(),
                    ..p.clone()
                },
            )
        });
        if let Some(b) = &p.bqkv {
            check_fd(&format!("{name}: dbqkv"), &got[3], b, |v| {
                loss(
                    &xv,
                    &Params {
                        bqkv: Some(v.to_vec()),
                        ..p.clone()
                    },
                )
            });
        }
        check_fd(&format!("{name}: dWo"), &got[4], &p.wo, |v| {
            loss(
                &xv,
                &Params {
                    wo: v.to_vec(),
                    ..p.clone()
                },
            )
        });
        if let Some(b) = &p.bo {
            check_fd(&format!("{name}: dbo"), &got[5], b, |v| {
                loss(
                    &xv,
                    &Params {
                        bo: Some(v.to_vec()),
                        ..p.clone()
                    },
                )
            });
        } else {
            assert!(got[5].is_empty(), "{name}: no output bias");
        }
        if let (Some(qn), Some(kn)) = (&p.qn, &p.kn) {
            check_fd(&format!("{name}: dq_norm"), &got[6], qn, |v| {
                loss(
                    &xv,
                    &Params {
                        qn: Some(v.to_vec()),
                        ..p.clone()
                    },
                )
            });
            check_fd(&format!("{name}: dk_norm"), &got[7], kn, |v| {
                loss(
                    &xv,
                    &Params {
                        kn: Some(v.to_vec()),
                        ..p.clone()
                    },
                )
            });
        }
    }
}

fn compare_runs(what: &str, got: &Run, want: &Run) {
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let e = if b.is_empty() { 0.0 } else { max_rel(a, b) };
        assert!(e <= 1e-12, "{what}: item {i} off by {e:e}");
    }
}

#[test]
fn attention_settings_over_tp_and_dp_equal_tp1() {
    let x = randn(61, &[T, H]);
    for (name, c) in settings() {
        let want = layer_run::<NoSp>(&c, 1, 1, &x);
        let mut meshes = vec![(1, 2), (2, 2)];
        if c.kv_heads == 2 {
            // 2 KV heads over 4 ranks: each pair of ranks shares one.
            meshes.push((1, 4));
        }
        for (dp, tp) in meshes {
            let what = format!("{name} dp={dp} tp={tp}");
            compare_runs(&what, &layer_run::<NoSp>(&c, dp, tp, &x), &want);
            compare_runs(
                &format!("{what} sp"),
                &layer_run::<Sp>(&c, dp, tp, &x),
                &want,
            );
        }
    }
}

#[test]
fn attention_refuses_tp_that_neither_divides_nor_is_a_multiple_of_the_kv_heads() {
    let mut c = base();
    c.kv_heads = 2;
    let err = c.check(3).unwrap_err().to_string();
    assert!(err.contains("tp=3 exceeds the 2 KV heads"), "{err}");
    c.kv_heads = 1;
    // 4 query heads over 8 ranks: a rank would hold half a head.
    let err = c.check(8).unwrap_err().to_string();
    assert!(err.contains("divide the 4 query heads"), "{err}");
    let mut odd = base();
    odd.rope.rotary_dim = Some(3);
    let err = odd.check(1).unwrap_err().to_string();
    assert!(err.contains("RoPE rotates 3 columns"), "{err}");
}

/// Every parameter's name and local piece on this rank.
struct Locals(Vec<(String, Vec<u64>)>);
impl ParamVisitor for Locals {
    fn visit<D: DataMode, K: ParamKind>(&mut self, name: &str, p: &mut Weight<D, K>) -> Result<()> {
        let bits = p.local().to_f64_vec().iter().map(|v| v.to_bits()).collect();
        self.0.push((name.to_string(), bits));
        Ok(())
    }
}

fn mqa_gpt_train<M: SeqMode>(dp: usize, tp: usize) -> Vec<f64> {
    let (ids, tg) = {
        let seq: Vec<i64> = (0..T)
            .map(|i| ((i * i * 7 + i * 3 + 1) % 20) as i64)
            .collect();
        let next: Vec<i64> = (0..T).map(|i| seq[(i + 1) % T]).collect();
        (
            Tensor::from_vec(seq, &[T]).unwrap(),
            Tensor::from_vec(next, &[T]).unwrap(),
        )
    };
    let ranks = on_mesh(dp, tp, |mesh| {
        let mut cfg = tiny_gpt(2, S, 23);
        cfg.kv_heads = Some(1);
        cfg.attn.head_dim = Some(6);
        cfg.attn.qk_norm = true;
        cfg.attn.qkv_bias = true;
        let mut model = Gpt::<M, Ddp>::new(cfg, mesh)?;
        let mut opt = AdamW::new(3e-3);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        let losses = (0..3)
            .map(|_| Ok(model.train_step(&i, &t, &mut opt, 1.0)?.loss))
            .collect::<Result<Vec<_>>>()?;
        let mut locals = Locals(Vec::new());
        model.visit_params("", &mut locals)?;
        Ok((losses, axis_coord(mesh, AxisKind::Tp), locals.0))
    });
    for (losses, tp_coord, locals) in &ranks {
        let bits = |l: &[f64]| l.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            bits(losses),
            bits(&ranks[0].0),
            "every rank reports one loss"
        );
        for (name, local) in locals {
            // Dp replicas hold every parameter alike; Tp ranks the ones replicated there
            // (the shared KV projection, the q/k norms).
            let shared = name.contains(".kv.") || name.contains("_norm.");
            for other in ranks.iter().filter(|r| shared || r.1 == *tp_coord) {
                let twin = &other
                    .2
                    .iter()
                    .find(|(n, _)| n == name)
                    .expect("same names")
                    .1;
                assert!(twin == local, "{name}: replicas differ");
            }
        }
        if tp > 1 {
            assert!(
                locals.iter().any(|(n, _)| n == "blocks.0.attn.kv.weight"),
                "tp={tp} over one KV head shares it"
            );
        }
    }
    ranks.into_iter().next().expect("rank 0").0
}

#[test]
fn multi_query_gpt_at_dp2_tp2_trains_as_one_rank_with_bitwise_replicas() {
    let want = mqa_gpt_train::<NoSp>(1, 1);
    for (dp, tp, sp) in [(1, 2, false), (2, 2, true), (2, 2, false)] {
        let got = if sp {
            mqa_gpt_train::<Sp>(dp, tp)
        } else {
            mqa_gpt_train::<NoSp>(dp, tp)
        };
        for (a, b) in got.iter().zip(&want) {
            assert!(
                (a - b).abs() <= 1e-10 * b.abs(),
                "dp={dp} tp={tp} sp={sp}: loss {a} vs {b}"
            );
        }
    }
}

#[test]
fn attention_rope_carries_scaling_rotary_dim_and_the_local_groups_to_the_kernel() {
    let mut c = base();
    c.rope.scaling = RopeScaling::yarn(4.0, 64);
    c.rope.rotary_dim = Some(4);
    for (tp, g) in [(1, 2), (2, 2), (4, 1)] {
        let r = c.rope_on(tp);
        assert_eq!((r.head_dim, r.rotary_dim, r.theta), (6, 4, 50.0));
        assert_eq!(r.scaling, c.rope.scaling);
        assert_eq!(
            r.heads,
            dtensor_kernels::ops::RotatedHeads::fused_qkv(g),
            "tp={tp}"
        );
    }
}
