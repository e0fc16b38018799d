//! Criterion: what grouped-query attention and RoPE-as-its-own-op cost on the CPU, f32,
//! single-threaded, at 8 samples × 256 tokens, 8 query heads of dim 64 (the larger shape of
//! `benches/attention.rs`):
//!
//! - `mha` (8 KV heads) against `gqa` (2 KV heads, `kv_heads = heads/4`) at equal query
//!   heads: `ops::causal_attention` forward + backward on the grouped fused QKV. GQA reads
//!   a quarter of the K/V and computes the same scores, so it must not be slower;
//! - `rope` forward + backward on the q and k heads of the same fused QKV (with prebuilt
//!   tables, as the layer runs it): RoPE's share of the attention step (the goal is < 5%);
//! - `flops`: printed once, the attention's FLOPs (causal: half the `4·s²·d` per head and
//!   sample of the two products forward, twice that backward), so the attention's FLOP
//!   rate can be set beside `benches/gemm.rs`'s.
//!
//! `cargo bench --bench attention_gqa`.

use criterion::{criterion_group, criterion_main, Criterion};
use dtensor::kernels::ops::{self, CausalAttention, Rope, RopeStyle, RopeTables};
use dtensor::prelude::Tensor;
use std::hint::black_box;
use std::time::Duration;

const SAMPLES: usize = 8;
const SEQ: usize = 256;
const HEADS: usize = 8;
const D: usize = 64;

fn fused(kv_heads: usize) -> (Tensor, Tensor, CausalAttention) {
    let tokens = SAMPLES * SEQ;
    let g = HEADS / kv_heads;
    let cfg = CausalAttention::new(SEQ, D).grouped(g);
    let qkv = Tensor::from_fn(&[tokens, (HEADS + 2 * kv_heads) * D], |i| {
        ((i * 7919 % 1000) as f32 / 500.0 - 1.0) * 1.5
    });
    let dout = Tensor::from_fn(&[tokens, HEADS * D], |i| {
        (i * 104729 % 997) as f32 / 997.0 - 0.5
    });
    (qkv, dout, cfg)
}

fn attention_gqa(c: &mut Criterion) {
    // Forward: QKᵀ and PV, 2·s²·d each per head and sample, halved by the causal mask;
    // backward: four such products.
    let fwd = 2.0 * 2.0 * (SEQ * SEQ * D * HEADS * SAMPLES) as f64 / 2.0;
    println!(
        "attention FLOPs: forward {:.3} G, forward+backward {:.3} G",
        fwd / 1e9,
        3.0 * fwd / 1e9
    );
    let mut g = c.benchmark_group("attention f32 2048 tok (8x256) h8 d64");
    g.sample_size(10);
    g.warm_up_time(Duration::from_secs(1));
    g.measurement_time(Duration::from_secs(4));
    for (name, kv) in [("mha kv8", HEADS), ("gqa kv2", HEADS / 4)] {
        let (qkv, dout, cfg) = fused(kv);
        g.bench_function(format!("{name} fwd+bwd"), |b| {
            b.iter(|| {
                let f = ops::causal_attention(black_box(&qkv), &cfg).unwrap();
                ops::causal_attention_backward(&dout, &qkv, &f.out, &f.lse, &cfg).unwrap()
            })
        });
    }
    let (qkv, _, _) = fused(HEADS / 4);
    let rope = Rope::new(D, 10000.0, RopeStyle::HalfSplit).on_fused_qkv(HEADS / (HEADS / 4));
    let positions: Vec<usize> = (0..SAMPLES * SEQ).map(|t| t % SEQ).collect();
    g.bench_function("gqa kv2 rope fwd+bwd (tables built once per step)", |b| {
        b.iter(|| {
            let tables = RopeTables::new(&rope, &positions, &qkv).unwrap();
            let y = ops::rope_with(black_box(&qkv), &tables, &rope).unwrap();
            ops::rope_backward_with(&y, &tables, &rope).unwrap()
        })
    });
    g.finish();
}

criterion_group!(benches, attention_gqa);
criterion_main!(benches);
