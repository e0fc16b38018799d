//! Trains a small byte-level GPT with tensor, sequence and data parallelism on thread ranks,
//! and (with `--check`) proves it computes what one device would.
//!
//! `cargo run --release --example train_gpt -- --mesh dp=2,tp=2 --sp --steps 50`
//!
//! Every rank runs the same code. The model's layouts say where each tensor lives on the
//! `[Dp, Tp]` mesh; with `--sp` the residual stream is sharded over `Tp` along the
//! sequence, column layers all-gather it on entry and row layers reduce-scatter on exit.
//! Gradients arrive `Partial` over `Dp` and are all-reduce-averaged before AdamW, which
//! accepts nothing else. At the end rank 0 prints a receipt: the composition that ran and
//! the collectives and bytes that crossed each mesh axis (summed over ranks).

use dtensor::nn::{AdamW, Gpt, GptConfig, Ids, NoSp, SeqMode, Sp};
use dtensor::prelude::*;
use std::process::ExitCode;
use std::time::Instant;

const TEXT: &str = include_str!("../data/tiny_corpus.txt");

const USAGE: &str = "\
usage: train_gpt [flags]

  --mesh <spec>     mesh as dp=<n>,tp=<n> (default dp=2,tp=2); `sp` may be added to the spec
  --sp              sequence parallelism: the residual stream is sharded over tp (needs tp > 1)
  --steps <n>       training steps (default 50)
  --batch <n>       global batch in sequences (default 8; must divide by dp)
  --seq <n>         tokens per sequence (default 64)
  --layers <n>      transformer blocks (default 2)
  --hidden <n>      hidden size (default 64)
  --heads <n>       attention heads (default 4; must divide by tp)
  --lr <x>          AdamW learning rate (default 3e-3)
  --clip <x>        global gradient-norm clip (default 1.0)
  --seed <n>        parameter seed (default 1234)
  --dtype <t>       f32 or f64 (default f32)
  --log-every <n>   print every n steps (default 10; first and last always)
  --check           also run one rank on the same global batch and seed; print
                    max_abs_loss_diff=<x> and exit 1 if above the dtype's tolerance
                    (f64: 1e-9, f32: 2e-3)
  --help            this text";

#[derive(Clone, Debug)]
struct Args {
    config: ParallelConfig,
    steps: usize,
    batch: usize,
    seq: usize,
    layers: usize,
    hidden: usize,
    heads: usize,
    lr: f64,
    clip: f64,
    seed: u64,
    dtype: DType,
    log_every: usize,
    check: bool,
}

fn parse_args() -> Result<Option<Args>, String> {
    let mut a = Args {
        config: ParallelConfig::parse("dp=2,tp=2").unwrap(),
        steps: 50,
        batch: 8,
        seq: 64,
        layers: 2,
        hidden: 64,
        heads: 4,
        lr: 3e-3,
        clip: 1.0,
        seed: 1234,
        dtype: DType::F32,
        log_every: 10,
        check: false,
    };
    let mut sp = false;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || {
            it.next()
                .ok_or(format!("{flag} needs a value (see --help)"))
        };
        fn num<T: std::str::FromStr>(flag: &str, v: String) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("{flag}: `{v}` is not a valid number"))
        }
        match flag.as_str() {
            "--mesh" => {
                a.config = ParallelConfig::parse(&value()?).map_err(|e| format!("--mesh: {e}"))?
            }
            "--sp" => sp = true,
            "--steps" => a.steps = num(&flag, value()?)?,
            "--batch" => a.batch = num(&flag, value()?)?,
            "--seq" => a.seq = num(&flag, value()?)?,
            "--layers" => a.layers = num(&flag, value()?)?,
            "--hidden" => a.hidden = num(&flag, value()?)?,
            "--heads" => a.heads = num(&flag, value()?)?,
            "--lr" => a.lr = num(&flag, value()?)?,
            "--clip" => a.clip = num(&flag, value()?)?,
            "--seed" => a.seed = num(&flag, value()?)?,
            "--log-every" => a.log_every = num::<usize>(&flag, value()?)?.max(1),
            "--dtype" => {
                a.dtype = match value()?.as_str() {
                    "f32" => DType::F32,
                    "f64" => DType::F64,
                    other => return Err(format!("--dtype: `{other}` is not f32 or f64")),
                }
            }
            "--check" => a.check = true,
            "--help" | "-h" => return Ok(None),
            other => return Err(format!("unknown flag `{other}` (see --help)")),
        }
    }
    a.config.sp |= sp;
    let c = &a.config;
    if c.pp > 1 || c.cp > 1 || c.ep > 1 {
        return Err(format!("--mesh {c}: this example runs dp and tp only"));
    }
    if c.sp && c.tp < 2 {
        return Err("--sp needs tensor parallelism (tp > 1)".into());
    }
    if a.heads == 0 || a.heads % c.tp != 0 {
        return Err(format!(
            "--heads {} is not divisible by tp={}",
            a.heads, c.tp
        ));
    }
    if a.hidden % a.heads != 0 || (a.hidden / a.heads) % 2 != 0 {
        return Err(format!(
            "--hidden {} must split into {} heads of an even dimension",
            a.hidden, a.heads
        ));
    }
    if a.batch == 0 || a.batch % c.dp != 0 {
        return Err(format!(
            "--batch {} is not divisible by dp={}",
            a.batch, c.dp
        ));
    }
    if a.seq == 0 || a.seq + 1 >= TEXT.len() || a.steps == 0 {
        return Err("--seq and --steps must be positive (and seq shorter than the text)".into());
    }
    Ok(Some(a))
}

fn model_config(a: &Args) -> GptConfig {
    GptConfig {
        hidden: a.hidden,
        heads: a.heads,
        layers: a.layers,
        ffn: 4 * a.hidden,
        seq_len: a.seq,
        seed: a.seed,
        ..GptConfig::small(a.dtype)
    }
}

/// The global batch of step `step`: `batch` windows of the text (inputs, next-byte targets).
fn global_batch(a: &Args, step: usize) -> (Tensor, Tensor) {
    let bytes = TEXT.as_bytes();
    let span = bytes.len() - a.seq - 1;
    let (mut ids, mut tg) = (Vec::new(), Vec::new());
    for b in 0..a.batch {
        let start = ((step * a.batch + b) * 7919 + b * 131) % span;
        ids.extend(bytes[start..start + a.seq].iter().map(|&c| c as i64));
        tg.extend(
            bytes[start + 1..start + a.seq + 1]
                .iter()
                .map(|&c| c as i64),
        );
    }
    let n = a.batch * a.seq;
    (
        Tensor::from_vec(ids, &[n]).unwrap(),
        Tensor::from_vec(tg, &[n]).unwrap(),
    )
}

/// This rank's tokens: its Dp chunk, the same on every Tp rank (no communication).
fn local_ids(t: &Tensor, mesh: &std::sync::Arc<DeviceMesh>) -> Result<DTensor<Ids>, Error> {
    let r = dtensor::placement::chunk_range(t.shape()[0], mesh.mesh().size(0), mesh.coords()[0]);
    DTensor::from_local(t.narrow(0, r.start, r.len())?, t.shape(), mesh)
}

struct RankOut {
    losses: Vec<f64>,
    counters: Vec<(AxisKind, CounterSnapshot)>,
}

fn train<M: SeqMode>(a: &Args, config: ParallelConfig, verbose: bool) -> Result<RankOut, String> {
    let mesh = config
        .mesh(&[AxisKind::Dp, AxisKind::Tp])
        .map_err(|e| e.to_string())?;
    let results = threads::launch(mesh.world_size(), |world| -> Result<RankOut, Error> {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let mut model = Gpt::<M>::new(model_config(a), &dm)?;
        let mut opt = AdamW::new(a.lr);
        let start_counters = dm.counters();
        let mut losses = Vec::with_capacity(a.steps);
        let t0 = Instant::now();
        for step in 0..a.steps {
            let (ids, tg) = global_batch(a, step);
            let t = Instant::now();
            let r = model.train_step(
                &local_ids(&ids, &dm)?,
                &local_ids(&tg, &dm)?,
                &mut opt,
                a.clip,
            )?;
            losses.push(r.loss);
            let tokens = (a.batch * a.seq) as f64;
            if verbose && dm.rank() == 0 && (step % a.log_every == 0 || step + 1 == a.steps) {
                println!(
                    "step {step:4}  loss {:.4}  grad_norm {:.3}  {:>8.0} tokens/s",
                    r.loss,
                    r.grad_norm,
                    tokens / t.elapsed().as_secs_f64()
                );
            }
        }
        if verbose && dm.rank() == 0 {
            let secs = t0.elapsed().as_secs_f64();
            println!(
                "trained {} steps in {secs:.2}s: {:.0} tokens/s",
                a.steps,
                (a.steps * a.batch * a.seq) as f64 / secs
            );
        }
        let counters = dm
            .counters()
            .into_iter()
            .zip(start_counters)
            .map(|((k, c), (_, s))| (k, c.since(&s)))
            .collect();
        Ok(RankOut { losses, counters })
    });
    let mut outs = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        outs.push(res.map_err(|e| format!("rank {r}: {e}"))?);
    }
    // Sum every rank's counters per axis for the receipt.
    let mut first = outs.swap_remove(0);
    for o in &outs {
        for (mine, theirs) in first.counters.iter_mut().zip(&o.counters) {
            mine.1 = mine.1.plus(&theirs.1);
        }
    }
    Ok(first)
}

fn run(a: &Args) -> Result<bool, String> {
    let c = &a.config;
    println!(
        "train_gpt: {} layers, hidden {}, {} heads, byte vocab 256, seq {}, global batch {} ({} tokens), {}, on {} thread ranks",
        a.layers, a.hidden, a.heads, a.seq, a.batch, a.batch * a.seq, a.dtype, c.world_size()
    );
    let out = if c.sp {
        train::<Sp>(a, *c, true)?
    } else {
        train::<NoSp>(a, *c, true)?
    };
    println!("receipt:");
    println!(
        "  composition: dp={} (DDP all-reduce average) × tp={} ({}), vocab-parallel embedding and loss",
        c.dp,
        c.tp,
        if c.sp {
            "Megatron TP + SP: all_gather / reduce_scatter of the sequence"
        } else {
            "Megatron TP: to_replicate / all_reduce"
        }
    );
    let tokens = (a.steps * a.batch * a.seq) as u64;
    for (axis, s) in &out.counters {
        println!(
            "  {}: {s} ({} B sent per token)",
            axis.name(),
            s.bytes_sent / tokens.max(1)
        );
    }
    if !a.check {
        return Ok(true);
    }
    let one = ParallelConfig::parse("dp=1,tp=1").unwrap();
    let reference = train::<NoSp>(a, one, false)?;
    let diff = out
        .losses
        .iter()
        .zip(&reference.losses)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    let tol = if a.dtype == DType::F64 { 1e-9 } else { 2e-3 };
    println!("max_abs_loss_diff={diff:e} (tolerance {tol:e}, one rank vs {c})");
    Ok(diff <= tol)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(Some(a)) => a,
        Ok(None) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
