//! Criterion: causal attention with RoPE, forward and forward+backward, f32, single-threaded,
//! at the two model sizes we train: 8 samples × 64 tokens, 4 heads of dim 16, and 8 samples
//! × 256 tokens, 8 heads of dim 64. `kernel` is `ops::causal_attention` (+ its backward);
//! `f64_loops` is the per-(head, sample) f64 loop code `nn/src/attention.rs` ran before the
//! kernel existed (copied below, with its f32 → f64 → f32 conversions), for comparison in
//! the same run.
//!
//! `cargo bench --bench attention`; `cargo bench --bench attention -- kernel` filters.

use criterion::{criterion_group, criterion_main, Criterion};
use dtensor::kernels::ops::{self, CausalAttention};
use dtensor::prelude::Tensor;
use std::hint::black_box;
use std::time::Duration;

/// `(name, samples, seq_len, heads, head_dim)`.
const SHAPES: [(&str, usize, usize, usize, usize); 2] = [
    ("512 tok (8x64) h4 d16", 8, 64, 4, 16),
    ("2048 tok (8x256) h8 d64", 8, 256, 8, 64),
];

const BASE: f64 = 10000.0;

fn attention(c: &mut Criterion) {
    for (name, nb, s, nh, d) in SHAPES {
        let tokens = nb * s;
        let cfg = CausalAttention {
            seq_len: s,
            head_dim: d,
            q_per_kv: 1,
            scale: None,
        };
        let qkv = Tensor::from_fn(&[tokens, nh * 3 * d], |i| {
            ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 1.5
        });
        let dout = Tensor::from_fn(&[tokens, nh * d], |i| {
            (i * 104729 % 997) as f32 / 997.0 - 0.5
        });
        let mut g = c.benchmark_group(format!("attention f32 {name}"));
        g.sample_size(10);
        g.warm_up_time(Duration::from_secs(1));
        g.measurement_time(Duration::from_secs(4));
        g.bench_function("kernel fwd", |b| {
            b.iter(|| ops::causal_attention(black_box(&qkv), &cfg).unwrap())
        });
        g.bench_function("kernel fwd+bwd", |b| {
            b.iter(|| {
                let f = ops::causal_attention(black_box(&qkv), &cfg).unwrap();
                ops::causal_attention_backward(&dout, &qkv, &f.out, &f.lse, &cfg).unwrap()
            })
        });
        g.bench_function("f64_loops fwd", |b| {
            b.iter(|| loops::forward(black_box(&qkv), nh, s, d))
        });
        g.bench_function("f64_loops fwd+bwd", |b| {
            b.iter(|| {
                let (o, ctx) = loops::forward(black_box(&qkv), nh, s, d);
                black_box(o);
                loops::backward(ctx, &dout, nh, s, d)
            })
        });
        g.finish();
    }
}

/// The loops of `nn/src/attention.rs` (before the kernel), on local tensors.
mod loops {
    use super::BASE;
    use dtensor::prelude::{DType, Tensor};

    pub struct Ctx {
        q: Vec<f64>,
        k: Vec<f64>,
        v: Vec<f64>,
        p: Vec<f64>,
        rows: usize,
        dtype: DType,
    }

    fn rope_angle(base: f64, pos: usize, i: usize, d: usize) -> (f64, f64) {
        let theta = pos as f64 / base.powf(2.0 * i as f64 / d as f64);
        (theta.cos(), theta.sin())
    }

    fn rope(x: &mut [f64], base: f64, pos: usize, sign: f64) {
        let d = x.len();
        for i in 0..d / 2 {
            let (c, s) = rope_angle(base, pos, i, d);
            let s = sign * s;
            let (a, b) = (x[2 * i], x[2 * i + 1]);
            x[2 * i] = a * c - b * s;
            x[2 * i + 1] = a * s + b * c;
        }
    }

    fn to_tensor(v: Vec<f64>, shape: &[usize], dtype: DType) -> Tensor {
        let t = Tensor::from_vec(v, shape).unwrap();
        if dtype == DType::F64 {
            t
        } else {
            t.to_dtype(dtype)
        }
    }

    pub fn forward(qkv: &Tensor, nh: usize, s: usize, d: usize) -> (Tensor, Ctx) {
        let (rows, cols) = (qkv.shape()[0], qkv.shape()[1]);
        let nb = rows / s;
        let base = BASE;
        let scale = 1.0 / (d as f64).sqrt();
        let src = qkv.to_f64_vec();
        let n = nh * nb * s * d;
        let (mut q, mut k, mut v) = (vec![0.0; n], vec![0.0; n], vec![0.0; n]);
        let mut p = vec![0.0; nh * nb * s * s];
        let mut o = vec![0.0; rows * nh * d];
        for h in 0..nh {
            for b in 0..nb {
                let blk = (h * nb + b) * s * d;
                for i in 0..s {
                    let row = (b * s + i) * cols + h * 3 * d;
                    let at = blk + i * d;
                    q[at..at + d].copy_from_slice(&src[row..row + d]);
                    k[at..at + d].copy_from_slice(&src[row + d..row + 2 * d]);
                    v[at..at + d].copy_from_slice(&src[row + 2 * d..row + 3 * d]);
                    rope(&mut q[at..at + d], base, i, 1.0);
                    rope(&mut k[at..at + d], base, i, 1.0);
                }
                let pblk = (h * nb + b) * s * s;
                for i in 0..s {
                    let qi = &q[blk + i * d..blk + (i + 1) * d];
                    let pr = &mut p[pblk + i * s..pblk + (i + 1) * s];
                    let mut m = f64::NEG_INFINITY;
                    for j in 0..=i {
                        let kj = &k[blk + j * d..blk + (j + 1) * d];
                        pr[j] = scale * qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>();
                        m = m.max(pr[j]);
                    }
                    let mut z = 0.0;
                    for pj in pr.iter_mut().take(i + 1) {
                        *pj = (*pj - m).exp();
                        z += *pj;
                    }
                    let orow = (b * s + i) * nh * d + h * d;
                    for j in 0..=i {
                        pr[j] /= z;
                        let vj = &v[blk + j * d..blk + (j + 1) * d];
                        for (e, vv) in vj.iter().enumerate() {
                            o[orow + e] += pr[j] * vv;
                        }
                    }
                }
            }
        }
        let dtype = qkv.dtype();
        let o = to_tensor(o, &[rows, nh * d], dtype);
        let ctx = Ctx {
            q,
            k,
            v,
            p,
            rows,
            dtype,
        };
        (o, ctx)
    }

    pub fn backward(ctx: Ctx, dout: &Tensor, nh: usize, s: usize, d: usize) -> Tensor {
        let rows = ctx.rows;
        let cols = dout.shape()[1] * 3;
        let nb = rows / s;
        let base = BASE;
        let scale = 1.0 / (d as f64).sqrt();
        let g = dout.to_f64_vec();
        let (q, k, v, p) = (&ctx.q, &ctx.k, &ctx.v, &ctx.p);
        let mut dqkv = vec![0.0; rows * cols];
        let mut dp = vec![0.0; s];
        for h in 0..nh {
            for b in 0..nb {
                let blk = (h * nb + b) * s * d;
                let pblk = (h * nb + b) * s * s;
                let (mut dq, mut dk, mut dv) =
                    (vec![0.0; s * d], vec![0.0; s * d], vec![0.0; s * d]);
                for i in 0..s {
                    let grow = (b * s + i) * nh * d + h * d;
                    let go = &g[grow..grow + d];
                    let pr = &p[pblk + i * s..pblk + (i + 1) * s];
                    let mut dot = 0.0;
                    for j in 0..=i {
                        let vj = &v[blk + j * d..blk + (j + 1) * d];
                        dp[j] = go.iter().zip(vj).map(|(a, b)| a * b).sum::<f64>();
                        dot += pr[j] * dp[j];
                        for e in 0..d {
                            dv[j * d + e] += pr[j] * go[e];
                        }
                    }
                    for j in 0..=i {
                        let ds = scale * pr[j] * (dp[j] - dot);
                        for e in 0..d {
                            dq[i * d + e] += ds * k[blk + j * d + e];
                            dk[j * d + e] += ds * q[blk + i * d + e];
                        }
                    }
                }
                for i in 0..s {
                    rope(&mut dq[i * d..(i + 1) * d], base, i, -1.0);
                    rope(&mut dk[i * d..(i + 1) * d], base, i, -1.0);
                    let row = (b * s + i) * cols + h * 3 * d;
                    dqkv[row..row + d].copy_from_slice(&dq[i * d..(i + 1) * d]);
                    dqkv[row + d..row + 2 * d].copy_from_slice(&dk[i * d..(i + 1) * d]);
                    dqkv[row + 2 * d..row + 3 * d].copy_from_slice(&dv[i * d..(i + 1) * d]);
                }
            }
        }
        to_tensor(dqkv, &[rows, cols], ctx.dtype)
    }
}

/// The two implementations agree (so the comparison times the same computation).
fn check_agree() {
    for (_, nb, s, nh, d) in SHAPES {
        let qkv = Tensor::from_fn(&[nb * s, nh * 3 * d], |i| (i % 13) as f32 * 0.1 - 0.6);
        let dout = Tensor::from_fn(&[nb * s, nh * d], |i| (i % 7) as f32 * 0.1 - 0.3);
        let cfg = CausalAttention {
            seq_len: s,
            head_dim: d,
            q_per_kv: 1,
            scale: None,
        };
        let f = ops::causal_attention(&qkv, &cfg).unwrap();
        let dq = ops::causal_attention_backward(&dout, &qkv, &f.out, &f.lse, &cfg).unwrap();
        let (o, ctx) = loops::forward(&qkv, nh, s, d);
        let dq_loops = loops::backward(ctx, &dout, nh, s, d);
        for (a, b) in [(&f.out, &o), (&dq, &dq_loops)] {
            let (a, b) = (a.to_f64_vec(), b.to_f64_vec());
            let err = a
                .iter()
                .zip(&b)
                .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
            assert!(err < 1e-4, "kernel and f64 loops differ by {err}");
        }
    }
}

fn benches(c: &mut Criterion) {
    check_agree();
    attention(c);
}

criterion_group!(attention_benches, benches);
criterion_main!(attention_benches);
