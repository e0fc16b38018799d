//! Causal multi-head self-attention with its heads split over `Tp` (Megatron's layout):
//! a column-parallel fused QKV projection (each rank holds whole heads, their q, k and v
//! rows together), local attention with rotary position embeddings, and a row-parallel
//! output projection. With SP the QKV entry all-gathers the tokens and the output leaves
//! with a reduce-scatter; without SP, `to_replicate` and `all_reduce`.
//!
//! The fused weight `[3·hidden, hidden]` stores its rows head by head: for head `h`, rows
//! `h·3·d .. h·3·d + d` are q, the next `d` are k, the next `d` are v (`d` the head dim).
//! `Shard<0>` over `Tp` therefore gives rank `r` heads `r·heads/tp ..`, complete.
//!
//! The local attention is a custom op on the tape ([`Var::custom`]): laid out [`ColOut`] in
//! and out (samples whole over `Dp`, heads whole over `Tp`, both checked when it runs).

use crate::linear::{ColumnParallelLinear, ParamInit, RowParallelLinear};
use crate::optim::{join_name, Module, ParamVisitor};
use crate::seq::{axis_size, ColOut, SeqMode, Stream};
use dtensor_core::{DeviceMesh, Error, Result, Tape, Var};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::AxisKind;
use std::sync::Arc;

/// Shape of an attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionConfig {
    pub hidden: usize,
    pub heads: usize,
    /// Tokens per sample: the stream's rows are samples of this many tokens, one after
    /// another.
    pub seq_len: usize,
    /// RoPE's base (10000 in most models).
    pub rope_base: f64,
}

impl AttentionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// `Err` unless the heads divide the hidden size (into an even head dim) and `tp`.
    pub fn check(&self, tp: usize) -> Result<()> {
        let bad = |detail: String| Error::ShapeMismatch {
            op: "ParallelAttention",
            detail,
        };
        if self.heads == 0 || self.hidden % self.heads != 0 || self.head_dim() % 2 != 0 {
            return Err(bad(format!(
                "hidden {} must split into {} heads of an even dimension",
                self.hidden, self.heads
            )));
        }
        if self.heads % tp != 0 {
            return Err(bad(format!(
                "{} heads are not divisible by tp={tp}",
                self.heads
            )));
        }
        Ok(())
    }
}

/// Causal self-attention, heads split over `Tp`.
pub struct ParallelAttention<M: SeqMode> {
    pub qkv: ColumnParallelLinear,
    pub out: RowParallelLinear<M>,
    pub config: AttentionConfig,
}

/// The RoPE angle's cosine and sine for position `pos`, pair `i` of a head of dim `d`.
fn rope_angle(base: f64, pos: usize, i: usize, d: usize) -> (f64, f64) {
    let theta = pos as f64 / base.powf(2.0 * i as f64 / d as f64);
    (theta.cos(), theta.sin())
}

/// Rotates each pair `(x[2i], x[2i+1])` by the position's angle (`sign = -1`: back).
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

fn to_tensor(v: Vec<f64>, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let t = Tensor::from_vec(v, shape)?;
    Ok(if dtype == DType::F64 {
        t
    } else {
        t.to_dtype(dtype)
    })
}

/// `(local heads, samples, seq, head dim)` for a local QKV of `rows` tokens.
fn dims(
    cfg: &AttentionConfig,
    rows: usize,
    local_cols: usize,
) -> Result<(usize, usize, usize, usize)> {
    let (s, d) = (cfg.seq_len, cfg.head_dim());
    if s == 0 || rows % s != 0 || local_cols % (3 * d) != 0 {
        return Err(Error::ShapeMismatch {
            op: "ParallelAttention::forward",
            detail: format!(
                "{rows} tokens × {local_cols} QKV columns on this rank are not whole samples of seq_len {s} and whole heads of 3·{d} columns (make the batch divisible by dp, the heads by tp)"
            ),
        });
    }
    Ok((local_cols / (3 * d), rows / s, s, d))
}

/// Rotated q, k, v and the probabilities, `[local head][sample]…`.
struct Attn {
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
    p: Vec<f64>,
    o: Vec<f64>,
}

fn attention_local(cfg: &AttentionConfig, qkv: &Tensor) -> Result<Attn> {
    let (rows, cols) = (qkv.shape()[0], qkv.shape()[1]);
    let (nh, nb, s, d) = dims(cfg, rows, cols)?;
    let base = cfg.rope_base;
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
    Ok(Attn { q, k, v, p, o })
}

fn attention_backward_local(cfg: &AttentionConfig, dout: &Tensor, qkv: &Tensor) -> Result<Tensor> {
    let (rows, cols) = (qkv.shape()[0], qkv.shape()[1]);
    let (nh, nb, s, d) = dims(cfg, rows, cols)?;
    let Attn { q, k, v, p, .. } = attention_local(cfg, qkv)?;
    let base = cfg.rope_base;
    let scale = 1.0 / (d as f64).sqrt();
    let g = dout.to_f64_vec();
    let mut dqkv = vec![0.0; rows * cols];
    let mut dp = vec![0.0; s];
    for h in 0..nh {
        for b in 0..nb {
            let blk = (h * nb + b) * s * d;
            let pblk = (h * nb + b) * s * s;
            let (mut dq, mut dk, mut dv) = (vec![0.0; s * d], vec![0.0; s * d], vec![0.0; s * d]);
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
    to_tensor(dqkv, &[rows, cols], qkv.dtype())
}

impl<M: SeqMode> ParallelAttention<M> {
    /// Parameter ids `init.id` (QKV weight), `+1` (its bias), `+2` (output weight), `+3`
    /// (its bias). The output projection is drawn with `out_std`.
    pub fn new(
        config: AttentionConfig,
        bias: bool,
        init: ParamInit,
        out_std: f64,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<Self> {
        config.check(axis_size(mesh, AxisKind::Tp))?;
        let h = config.hidden;
        let qkv = ColumnParallelLinear::new(h, 3 * h, bias, init, mesh)?;
        let out_init = ParamInit {
            std: out_std,
            ..init.with_id(init.id + 2)
        };
        let out = RowParallelLinear::new(h, h, bias, out_init, mesh)?;
        Ok(ParallelAttention { qkv, out, config })
    }

    pub fn forward<'t>(
        &self,
        tape: &'t Tape,
        x: &Var<'t, Stream<M>>,
    ) -> Result<Var<'t, Stream<M>>> {
        let qkv = self.qkv.forward::<M>(tape, x)?;
        let cfg = self.config;
        let global = [qkv.value().global_shape()[0], cfg.hidden];
        let o = qkv.custom::<ColOut>(
            "ParallelAttention::attention",
            &global,
            |qkv| {
                let rows = qkv.shape()[0];
                let a = attention_local(&cfg, qkv)?;
                let cols = a.o.len().checked_div(rows).unwrap_or(0);
                to_tensor(a.o, &[rows, cols], qkv.dtype())
            },
            move |dout, qkv| attention_backward_local(&cfg, dout, qkv),
        )?;
        self.out.forward(tape, &o)
    }
}

impl<M: SeqMode> Module for ParallelAttention<M> {
    fn visit_params<V: ParamVisitor>(&mut self, prefix: &str, v: &mut V) -> Result<()> {
        self.qkv.visit_params(&join_name(prefix, "qkv"), v)?;
        self.out.visit_params(&join_name(prefix, "out"), v)
    }
}
