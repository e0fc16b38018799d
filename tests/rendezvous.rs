//! The GPU path's point-to-point claims, checked on the host: over thread ranks wrapped in
//! the unbuffered emulator (`dtensor::collectives::unbuffered`: NCCL's rendezvous sends and
//! tagless, in-order matching), the pipeline schedules and ring attention complete, and
//! bitwise like the same run on the plain threads backend (the same backend underneath).
//!
//! - `pipeline_every_schedule_under_rendezvous_matches_threads_bitwise`: a pipelined GPT
//!   (`nn::pipeline::Pipeline`, set up as `train_gpt` does) with GPipe, 1F1B, interleaved
//!   1F1B (v = 2) and ZB-H1, at pp = 2 and 4, with tp = 2: 2 AdamW steps, every
//!   rank's losses and gradient norms equal.
//! - `pipeline_dp2_buckets_and_fsdp_prefetch_under_rendezvous_match_threads_bitwise`:
//!   1F1B and ZB-H1 at pp = 2, dp = 2 with DDP buckets and with FSDP's prefetch, whose
//!   asynchronous collectives are in flight around the hops (a hop waits for them under
//!   the emulator, as on NCCL's stream).
//! - `ring_attention_under_rendezvous_matches_threads_bitwise`: context-parallel ring
//!   attention forward and backward at cp = 2 (with tp = 2) and cp = 3.
//!
//! They can fail: with the host's former hop order in `transfer::shift` (every rank sends,
//! then receives: fine with buffered sends), the ring attention here timed out on the
//! first hop. Every wait is bounded by the threads backend's timeout: a hop that deadlocks
//! under rendezvous fails the test with a `Timeout` instead of hanging it.

use dtensor::collectives::{threads, unbuffered};
use dtensor::kernels::ops::CausalAttention;
use dtensor::nn::pipeline::{self, microbatches, Pipeline, Schedule};
use dtensor::nn::{
    model_mesh, Activation, AdamW, DataMode, Ddp, Fsdp, GptConfig, Ids, NoSp, NormKind, Precision,
};
use dtensor::prelude::*;
use std::sync::Arc;
use std::time::Duration;

/// Long enough for a debug build on a loaded machine, short enough to end a deadlock.
const TIMEOUT: Duration = Duration::from_secs(20);

/// Runs `f` on `n` thread ranks, plain or wrapped in the emulator; each rank's value.
fn launch<T: Send>(
    n: usize,
    rendezvous: bool,
    f: impl Fn(Arc<dyn Communicator>) -> Result<T> + Sync,
) -> Vec<T> {
    let options = threads::Options { timeout: TIMEOUT };
    let results = if rendezvous {
        unbuffered::launch_with(n, options, f)
    } else {
        threads::launch_with(n, options, f)
    };
    let what = if rendezvous { "unbuffered" } else { "threads" };
    results
        .into_iter()
        .enumerate()
        .map(|(r, res)| res.unwrap_or_else(|e| panic!("{what}, rank {r}: {e}")))
        .collect()
}

const SEQ: usize = 4;

fn gpt(layers: usize) -> GptConfig {
    GptConfig {
        vocab: 20,
        hidden: 8,
        heads: 2,
        kv_heads: None,
        rope_style: dtensor::kernels::ops::RopeStyle::Interleaved,
        attn: Default::default(),
        layers,
        ffn: 16,
        seq_len: SEQ,
        norm: NormKind::Rms,
        activation: Activation::SwiGlu,
        bias: true,
        eps: 1e-5,
        dtype: DType::F64,
        seed: 7,
        precision: Precision::default(),
        recompute: false,
        context: Default::default(),
        moe: None,
        z_loss: 0.0,
        tie_embeddings: false,
    }
}

/// Every rank's `(loss, grad_norm)` per step of a pipelined GPT with `schedule` over
/// `[Pp, Dp: 1, Ep: 1, Cp: 1, Tp: tp]` (the mesh, model and microbatches built as
/// `train_gpt`'s `train_rank` builds them).
fn pipelined(schedule: &Schedule, tp: usize, rendezvous: bool) -> Vec<Vec<(f64, f64)>> {
    pipelined_as::<Ddp>(schedule, (1, tp), None, Precision::default(), rendezvous)
}

/// [`pipelined`] over `[Pp, Dp: dp, Ep: 1, Cp: 1, Tp: tp]` in data mode `D`, with DDP
/// buckets of `buckets` bytes (started during each chunk's last backward: asynchronous
/// all-reduces in flight around the stage hops) and the given precision (FSDP's prefetch).
fn pipelined_as<D: DataMode>(
    schedule: &Schedule,
    (dp, tp): (usize, usize),
    buckets: Option<usize>,
    precision: Precision,
    rendezvous: bool,
) -> Vec<Vec<(f64, f64)>> {
    let config = ParallelConfig {
        pp: schedule.pp,
        dp,
        tp,
        ..Default::default()
    };
    let mesh = model_mesh(&config).unwrap();
    let m = schedule.microbatches;
    let rows = m * dp * SEQ;
    let seq: Vec<i64> = (0..rows + 1)
        .map(|i| ((i * i * 7 + 3) % 20) as i64)
        .collect();
    let ids = Tensor::from_vec(seq[..rows].to_vec(), &[rows]).unwrap();
    let tg = Tensor::from_vec(seq[1..].to_vec(), &[rows]).unwrap();
    let mut cfg = gpt(schedule.num_stages());
    cfg.precision = precision;
    launch(mesh.world_size(), rendezvous, |world| {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let mut model = Pipeline::<NoSp, D>::new(cfg, schedule.clone(), &dm)?;
        model.ddp_bucket_bytes = buckets;
        let sm = model.stage_mesh().clone();
        let split = |t: &Tensor| -> Result<Vec<DTensor<Ids>>> {
            microbatches(t, m, SEQ)?
                .iter()
                .map(|mb| DTensor::<Ids>::from_global(mb, &sm))
                .collect()
        };
        let (i, t) = (split(&ids)?, split(&tg)?);
        let mut opt = AdamW::new(3e-3);
        (0..2)
            .map(|_| {
                let r = model.train_step(&i, &t, &mut opt, 1.0)?;
                Ok((r.loss, r.grad_norm))
            })
            .collect()
    })
}

/// Asserts every rank's losses and gradient norms are the same bits in both runs.
fn same_bits(what: &str, got: &[Vec<(f64, f64)>], want: &[Vec<(f64, f64)>]) {
    let bits = |v: &[(f64, f64)]| -> Vec<(u64, u64)> {
        v.iter().map(|(l, n)| (l.to_bits(), n.to_bits())).collect()
    };
    assert_eq!(got.len(), want.len());
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(bits(g), bits(w), "{what} rank {r}: {g:?} vs {w:?}");
        assert!(g.iter().all(|(l, n)| l.is_finite() && n.is_finite()));
    }
    eprintln!("{what}: losses {:?} bitwise", got[0]);
}

#[test]
fn pipeline_every_schedule_under_rendezvous_matches_threads_bitwise() {
    for (pp, tp) in [(2, 2), (4, 2)] {
        let m = 2 * pp;
        let schedules = [
            pipeline::gpipe(pp, m).unwrap(),
            pipeline::one_f_one_b(pp, m).unwrap(),
            pipeline::interleaved_1f1b(pp, 2, m).unwrap(),
            pipeline::zero_bubble_h1(pp, m).unwrap(),
        ];
        for s in &schedules {
            let what = format!("{:?} pp={pp} tp={tp} m={m}", s.kind);
            let want = pipelined(s, tp, false);
            let got = pipelined(s, tp, true);
            same_bits(&what, &got, &want);
        }
    }
}

/// Asynchronous data-parallel collectives in flight around the stage hops (DDP buckets,
/// FSDP's prefetched gathers): under the emulator a hop waits for them, as on NCCL.
#[test]
fn pipeline_dp2_buckets_and_fsdp_prefetch_under_rendezvous_match_threads_bitwise() {
    let prefetch = Precision::default().resharded(true).prefetched(true);
    for s in [
        pipeline::one_f_one_b(2, 2).unwrap(),
        pipeline::zero_bubble_h1(2, 2).unwrap(),
    ] {
        let what = format!("{:?} pp=2 dp=2 ddp buckets", s.kind);
        let run = |rdv| pipelined_as::<Ddp>(&s, (2, 1), Some(256), Precision::default(), rdv);
        same_bits(&what, &run(true), &run(false));
        let what = format!("{:?} pp=2 dp=2 fsdp prefetch", s.kind);
        let run = |rdv| pipelined_as::<Fsdp>(&s, (2, 1), None, prefetch, rdv);
        same_bits(&what, &run(true), &run(false));
    }
}

type Qkv = layout![Cp: Shard<0>, Tp: Shard<1>];

/// Every rank's output and QKV gradient (local pieces) of a ring attention over `axes`.
fn ring(axes: &[(AxisKind, usize)], rendezvous: bool) -> Vec<(Tensor, Tensor)> {
    let cp = axes.iter().find(|a| a.0 == AxisKind::Cp).unwrap().1;
    let (samples, heads, d) = (2, 2, 4);
    let seq = 4 * cp; // 2·cp zigzag chunks of 2 tokens
    let cfg = ContextAttention {
        attn: CausalAttention {
            seq_len: seq,
            head_dim: d,
            q_per_kv: 1,
            scale: None,
        },
        zigzag: true,
        strategy: CpStrategy::Ring,
    };
    let tokens = samples * seq;
    let wave =
        |shape: &[usize], k: f64| Tensor::from_fn(shape, |i| ((i as f64 + k) * 0.377).sin() * 0.5);
    let qkv = wave(&[tokens, 3 * heads * d], 0.0);
    let dout = wave(&[tokens, heads * d], 1.0);
    let mesh = Mesh::new(axes).unwrap();
    launch(mesh.world_size(), rendezvous, |world| {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let x = DTensor::<Qkv>::from_global(&qkv, &dm)?;
        let w = DTensor::<<Qkv as Layout>::Grad>::from_global(&dout, &dm)?;
        let tape = Tape::new();
        let xv = tape.leaf(x);
        let y = xv.context_attention(Cp, &cfg)?;
        let out = y.value().as_local().clone();
        let mut grads = y.backward_with(w)?;
        Ok((out, grads.take(&xv)?.as_local().clone()))
    })
}

#[test]
fn ring_attention_under_rendezvous_matches_threads_bitwise() {
    for axes in [
        [(AxisKind::Cp, 2), (AxisKind::Tp, 2)],
        [(AxisKind::Cp, 3), (AxisKind::Tp, 1)],
    ] {
        let want = ring(&axes, false);
        let got = ring(&axes, true);
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            let bits =
                |t: &Tensor| -> Vec<u64> { t.to_f64_vec().iter().map(|v| v.to_bits()).collect() };
            assert_eq!(bits(&g.0), bits(&w.0), "{axes:?} rank {r}: output");
            assert_eq!(bits(&g.1), bits(&w.1), "{axes:?} rank {r}: QKV gradient");
        }
    }
}
