//! Trains a small byte-level GPT with pipeline, data (DDP, ZeRO-1/2, FSDP), expert (MoE),
//! context, tensor and sequence parallelism on thread ranks, and (with `--check`) proves it
//! computes what one device would.
//!
//! `cargo run --release --example train_gpt -- --mesh dp=2,tp=2 --sp --steps 50`
//! `cargo run --release --example train_gpt -- --mesh pp=2,dp=2,tp=2 --sp --fsdp --schedule 1f1b --microbatches 4`
//! `cargo run --release --example train_gpt -- --mesh dp=2,cp=2,tp=2 --sp --cp-impl ring`
//! `cargo run --release --example train_gpt -- --moe --experts 4 --top-k 2 --mesh ep=2,dp=2`
//!
//! On GPUs (build with `--features cuda,nccl`), `--device cuda` runs the ranks as threads,
//! one per GPU, over the NCCL backend: every tensor of the model lives in device memory,
//! the collectives move device memory, and the kernels and AdamW run on the device
//! (`docs/gpus.md`): `cargo run --release --features cuda,nccl --example train_gpt --
//! --device cuda --mesh dp=2,tp=2 --check`. Under MPI (`--features mpi,cuda,nccl`), `mpirun
//! -np 4 train_gpt --backend mpi --device cuda …` runs one process per GPU, each over an
//! NCCL communicator made from the MPI world; checkpoints work on the device too.
//!
//! The same program runs on MPI ranks, one process each (build with `--features mpi`):
//! `mpirun -np 4 target/release/examples/train_gpt --backend mpi --mesh dp=2,tp=2 --sp`.
//! Both backends run one per-rank function ([`train_rank`]); MPI reductions keep the
//! threads backend's order, so the losses are bitwise the same (`--print-loss-bits`).
//!
//! Every rank runs the same code. The model's layouts say where each tensor lives on the
//! `[Dp, Ep, Cp, Tp]` mesh of its pipeline stage (behind `Pp` with `pp > 1`); the tokens
//! are sharded over `Dp`, `Ep` and `Cp` (in CP order: each `Cp` rank holds chunks of every
//! sample, and attention runs over `Cp` by ring or all-to-all); with `--sp` the residual
//! stream is also sharded over `Tp` along the sequence, column layers all-gather it on
//! entry and row layers reduce-scatter on exit. Gradients arrive reduced over `Ep` and `Cp`
//! (the adjoint of the parameters' `to_replicate`) and `Partial` over `Dp`, and are
//! all-reduced (DDP), reduce-scattered (ZeRO), or arrive reduce-scattered from the
//! parameters' gathers (FSDP) before AdamW, which accepts nothing else; MoE experts are
//! sharded over `Ep` and their gradients are never reduced there. The
//! schedule (GPipe, 1F1B, interleaved, ZB-H1) runs the microbatches through the stages.
//! At the end rank 0 prints a receipt: the composition that ran, the collectives and bytes
//! that crossed each mesh axis (summed over ranks), and the measured pipeline bubble beside
//! the schedule's analytic one. `--metrics <file.jsonl>` writes one JSON line per step and
//! `--plot <file.png>` draws loss and tokens/s (the same drawing as `plot_metrics`).

#[path = "support/metrics.rs"]
mod metrics;

use clap::{Parser, ValueEnum};
use dtensor::cli::{check_output_path, CompositionArgs, OutputKind};
use dtensor::collectives::{mpi as mpi_backend, trace, Counters};
use dtensor::kernels::memory;
use dtensor::kernels::ops::RopeStyle;
use dtensor::nn::pipeline::{self, check_pipeline, microbatches, Pipeline};
use dtensor::nn::{
    to_stream_order, AdamW, AttentionOptions, ContextParallel, DataMode, Ddp, Fsdp, GptConfig, Ids,
    MoeConfig, NoSp, Schedule, SeqMode, Sp, Zero1, Zero2,
};
use dtensor::placement::{DataKind, ScheduleKind};
use dtensor::prelude::*;
use dtensor_checkpoint as ckpt;
use metrics::StepMetrics;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

const TEXT: &str = include_str!("../data/tiny_corpus.txt");

/// Trains a small byte-level GPT on thread ranks (or MPI processes, or GPUs) with pipeline,
/// data, expert, context, tensor and sequence parallelism; with --check, proves it computes
/// what one device would.
#[derive(Parser, Clone, Debug)]
#[command(
    name = "train_gpt",
    args_override_self = true,
    allow_negative_numbers = true
)]
struct Args {
    #[command(flatten)]
    flags: CompositionArgs,
    /// The run's composition: `flags` resolved by [`resolve`], not a flag itself.
    #[arg(skip)]
    comp: Composition,
    /// With --overlap: DDP bucket size in MiB
    #[arg(long, value_name = "X", default_value_t = 25.0)]
    bucket_mb: f64,
    /// Write a timeline (Chrome trace-event JSON: open it in Perfetto or chrome://tracing):
    /// one row per rank, forward and backward of each layer, every collective with its axis,
    /// bytes and wait time, the optimizer step, pipeline actions
    #[arg(long, value_name = "FILE")]
    trace: Option<String>,
    /// A mixture-of-experts MLP in every block (experts sharded over ep; pp = 1, no
    /// --recompute)
    #[arg(long)]
    moe: bool,
    /// With --moe: experts per block (must divide by ep)
    #[arg(long, value_name = "N", default_value_t = 4)]
    experts: usize,
    /// With --moe: experts per token, 1 or 2
    #[arg(long, value_name = "K", default_value_t = 2)]
    top_k: usize,
    /// With --moe: capacity factor (default: dropless). --check needs a dropless run (the
    /// one-rank reference drops other tokens)
    #[arg(long, value_name = "F")]
    capacity: Option<f64>,
    /// With --moe: Switch load-balancing loss coefficient
    #[arg(long, value_name = "C", default_value_t = 0.01)]
    aux_loss: f64,
    /// z-loss coefficient (PaLM: 1e-4): each scored token's loss gains z·log²Z, Z the
    /// softmax normaliser over the whole vocab; 0 is off (finite and >= 0)
    #[arg(long, value_name = "Z", default_value_t = 0.0)]
    z_loss: f64,
    /// With --moe: aux-loss-free balancing (DeepSeek-V3): after each step every expert's
    /// selection bias moves by g·sign(mean load − load)
    #[arg(long, value_name = "G")]
    expert_bias: Option<f64>,
    /// Training steps: the total, also when resuming
    #[arg(long, value_name = "N", default_value_t = 50)]
    steps: usize,
    /// Save a checkpoint after every n-th step (needs --save-dir)
    #[arg(long, value_name = "N", default_value_t = 0)]
    save_every: usize,
    /// Checkpoint directory: one safetensors file per rank and index.json, replaced
    /// atomically by each save (dtensor-checkpoint)
    #[arg(long, value_name = "DIR")]
    save_dir: Option<String>,
    /// Load parameters, AdamW state, step count, data position and MoE expert biases from a
    /// checkpoint (any mesh or data mode) and continue to --steps (after a lost rank:
    /// restart under a fresh mpirun)
    #[arg(long, value_name = "DIR")]
    resume: Option<String>,
    /// Global batch in sequences (must divide by dp·ep)
    #[arg(long, value_name = "N", default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence
    #[arg(long, value_name = "N", default_value_t = 64)]
    seq: usize,
    /// Transformer blocks
    #[arg(long, value_name = "N", default_value_t = 2)]
    layers: usize,
    /// Hidden size
    #[arg(long, value_name = "N", default_value_t = 64)]
    hidden: usize,
    /// Attention (query) heads
    #[arg(long, value_name = "N", default_value_t = 4)]
    heads: usize,
    /// Key/value heads (grouped-query attention: must divide --heads; tp either divides
    /// them, or is a multiple of them that divides --heads, each tensor rank then holding
    /// the KV head its query heads read; 1 is multi-query); default: --heads (multi-head
    /// attention)
    #[arg(long, value_name = "N")]
    kv_heads: Option<usize>,
    /// Features per attention head (even); default: --hidden / --heads. Other values
    /// decouple the heads from the width (the output projection maps heads·head-dim back
    /// to --hidden)
    #[arg(long, value_name = "N")]
    head_dim: Option<usize>,
    /// A bias on the q, k and v projections even without the model's other biases (Qwen2)
    #[arg(long)]
    qkv_bias: bool,
    /// RMSNorm of every q and k head over its head dim before RoPE, one learned weight
    /// for q and one for k (Qwen3)
    #[arg(long)]
    qk_norm: bool,
    /// RoPE's pairing of a head's columns: `interleaved` (x[2i], x[2i+1]) or `half`
    /// (x[i], x[i+d/2], the Hugging Face layout)
    #[arg(long, value_name = "STYLE", default_value = "interleaved")]
    rope_style: RopeStyleArg,
    /// AdamW learning rate (finite and > 0)
    #[arg(long, value_name = "X", default_value_t = 3e-3)]
    lr: f64,
    /// Global gradient-norm clip (finite and > 0)
    #[arg(long, value_name = "X", default_value_t = 1.0)]
    clip: f64,
    /// A step whose gradient norm is inf or NaN skips its update and is counted (as
    /// Megatron-LM does); default: such a step, or a non-finite loss, stops the run with an
    /// error naming the step and exit code 1
    #[arg(long)]
    skip_nonfinite: bool,
    /// Parameter seed
    #[arg(long, value_name = "N", default_value_t = 1234)]
    seed: u64,
    /// Print every n steps (first and last always)
    #[arg(long, value_name = "N", default_value_t = 10)]
    log_every: usize,
    /// Also run one rank on the same global batch and seed; print max_abs_loss_diff=<x> and
    /// exit 1 if above the dtype's tolerance (f64: 1e-9, f32: 2e-3); with --backend mpi,
    /// rank 0 runs that reference on a thread after the MPI run
    #[arg(long)]
    check: bool,
    /// threads: ranks are threads of this process; mpi: each process started by `mpirun -np
    /// <pp·dp·ep·cp·tp>` is one rank (needs a build with `--features mpi`)
    #[arg(long, value_enum, value_name = "B", default_value_t = Backend::Threads)]
    backend: Backend,
    /// cpu, or cuda: thread ranks over the NCCL backend, rank r on GPU r mod the GPU count
    /// (one rank per GPU; sharing a GPU needs NCCL ≥ 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1),
    /// every tensor in device memory; docs/gpus.md says what it needs and runs
    #[arg(long, value_enum, value_name = "D", default_value_t = Place::Cpu)]
    device: Place,
    /// Also print every step's loss as the exact bits of the f64 value, `step <n>
    /// loss_bits=0x<16 hex digits>`, to compare runs bitwise
    #[arg(long)]
    print_loss_bits: bool,
    /// Rank 0 writes one JSON object per line per step at the end: step, loss, grad_norm,
    /// tokens_per_s, bytes_sent (object: mesh axis -> bytes sent that step, summed over
    /// ranks), peak_tensor_bytes (array, by rank)
    #[arg(long, value_name = "FILE")]
    metrics: Option<String>,
    /// Rank 0 draws loss and tokens/s against step as a PNG (text in a font shipped with the
    /// examples; `plot_metrics` draws a --metrics file)
    #[arg(long, value_name = "FILE.png")]
    plot: Option<String>,
    /// After the receipt, the planner's bytes per axis and peak tensor memory per rank beside
    /// the measured ones (`dtensor plan`, docs/planner.md)
    #[arg(long)]
    plan: bool,
    /// Start from a Hugging Face checkpoint (a Llama, Mistral, Qwen2, Qwen3, Mixtral or
    /// Qwen3-MoE directory: config.json, safetensors weights, tokenizer.json): the model's
    /// shape comes from its config.json, its weights are loaded into the mesh (each rank
    /// its own slices), and the bundled corpus is tokenized with its tokenizer
    #[arg(long, value_name = "DIR", conflicts_with_all = [
        "hidden", "heads", "kv_heads", "head_dim", "layers", "rope_style", "qkv_bias",
        "qk_norm", "moe", "experts", "top_k", "plan",
    ])]
    init_from: Option<std::path::PathBuf>,
}

/// `--rope-style`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum RopeStyleArg {
    Interleaved,
    Half,
}

impl From<RopeStyleArg> for RopeStyle {
    fn from(s: RopeStyleArg) -> RopeStyle {
        match s {
            RopeStyleArg::Interleaved => RopeStyle::Interleaved,
            RopeStyleArg::Half => RopeStyle::HalfSplit,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Backend {
    Threads,
    Mpi,
}

/// Where the ranks' tensors live (`--device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Place {
    Cpu,
    Cuda,
}

impl Args {
    /// Key/value heads: `--kv-heads`, or as many as query heads.
    fn kv_heads(&self) -> usize {
        self.kv_heads.unwrap_or(self.heads)
    }

    /// The element type of the masters (and of everything without --bf16).
    fn dtype(&self) -> DType {
        dtensor::nn::compose::master_dtype(&self.comp)
    }

    /// Attention over cp: strategy and chunking.
    fn context(&self) -> ContextParallel {
        ContextParallel {
            strategy: self.comp.cp_strategy,
            zigzag: self.comp.zigzag,
        }
    }
}

/// The default composition (`--mesh` left out).
const DEFAULT_MESH: &str = "dp=2,tp=2";

/// Resolves the composition flags and checks what no run can train with, each refused
/// with the flag and its rule, before any rank starts; then that every output path can be
/// written.
fn resolve(mut a: Args) -> Result<Args, String> {
    a.comp = a.flags.composition(DEFAULT_MESH)?;
    a.log_every = a.log_every.max(1);
    if a.save_every > 0 && a.save_dir.is_none() {
        return Err("--save-every needs --save-dir".into());
    }
    if a.resume.is_some() && a.check {
        return Err("--check compares a whole run from step 0: leave out --resume".into());
    }
    let c = &a.comp.degrees;
    for (flag, v) in [
        ("--batch", a.batch),
        ("--seq", a.seq),
        ("--layers", a.layers),
        ("--hidden", a.hidden),
        ("--heads", a.heads),
        ("--steps", a.steps),
    ] {
        if v == 0 {
            return Err(format!("{flag} 0: must be at least 1"));
        }
    }
    for (flag, v) in [("--lr", a.lr), ("--clip", a.clip)] {
        if !(v.is_finite() && v > 0.0) {
            return Err(format!("{flag} {v}: must be a finite number > 0"));
        }
    }
    if !(a.z_loss.is_finite() && a.z_loss >= 0.0) {
        return Err(format!(
            "--z-loss {}: must be a finite number >= 0 (0 is off)",
            a.z_loss
        ));
    }
    let zigzag = a.comp.zigzag;
    let chunks = if zigzag { 2 * c.cp } else { c.cp };
    if c.cp > 1 && !a.seq.is_multiple_of(chunks) {
        return Err(format!(
            "--seq {} does not cut into {chunks} equal chunks for cp={}{}",
            a.seq,
            c.cp,
            if zigzag {
                " (zigzag: 2·cp chunks; --no-zigzag: cp)"
            } else {
                ""
            }
        ));
    }
    // Tensor ranks beyond the KV heads each hold one (shared) KV head.
    let kv_per_rank = (a.kv_heads() / c.tp).max(1);
    if c.cp > 1 && a.comp.cp_strategy == CpStrategy::AllToAll && !kv_per_rank.is_multiple_of(c.cp) {
        return Err(format!(
            "--cp-impl a2a: {kv_per_rank} KV heads per tp rank (--kv-heads {}, tp={}) are not divisible by cp={}",
            a.kv_heads(),
            c.tp,
            c.cp
        ));
    }
    if a.moe {
        if c.pp > 1 || a.comp.recompute {
            return Err("--moe runs with pp = 1 and without --recompute".into());
        }
        MoeConfig::new(a.experts, a.top_k)
            .validate(c.ep)
            .map_err(|e| format!("--moe --experts {} --top-k {}: {e}", a.experts, a.top_k))?;
        if a.check && a.capacity.is_some() {
            return Err(
                "--check compares with one rank, which needs a dropless run: leave out --capacity"
                    .into(),
            );
        }
        if a.check && a.comp.microbatches > 1 {
            return Err(
                "--moe --check: the auxiliary loss is per microbatch; run one microbatch".into(),
            );
        }
    }
    if a.plan && (a.head_dim.is_some() || a.qkv_bias || a.qk_norm) {
        return Err(
            "--plan with --head-dim, --qkv-bias or --qk-norm: the planner models attention with head dim hidden / heads, the model's biases and no q/k norm".into(),
        );
    }
    if a.plan && c.tp > a.kv_heads() {
        return Err(format!(
            "--plan with tp={} > --kv-heads {}: the planner models KV heads split over tp (each rank whole groups), not shared",
            c.tp,
            a.kv_heads()
        ));
    }
    if a.kv_heads() == 0 || !a.heads.is_multiple_of(a.kv_heads()) {
        return Err(format!(
            "--kv-heads {} does not divide --heads {}",
            a.kv_heads(),
            a.heads
        ));
    }
    if c.tp <= a.kv_heads() && !a.kv_heads().is_multiple_of(c.tp) {
        return Err(format!(
            "--kv-heads {} is not divisible by tp={} (each tensor rank holds whole groups of a KV head and its query heads)",
            a.kv_heads(),
            c.tp
        ));
    }
    if c.tp > a.kv_heads() && !(c.tp.is_multiple_of(a.kv_heads()) && a.heads.is_multiple_of(c.tp)) {
        return Err(format!(
            "tp={} exceeds --kv-heads {}: it must be a multiple of them and divide --heads {} (each tensor rank holds whole query heads of one group)",
            c.tp,
            a.kv_heads(),
            a.heads
        ));
    }
    match a.head_dim {
        Some(d) if d == 0 || !d.is_multiple_of(2) => {
            return Err(format!("--head-dim {d} must be even and nonzero"));
        }
        Some(_) => {}
        None if !a.hidden.is_multiple_of(a.heads) || !(a.hidden / a.heads).is_multiple_of(2) => {
            return Err(format!(
                "--hidden {} must split into {} heads of an even dimension (or set --head-dim)",
                a.hidden, a.heads
            ));
        }
        None => {}
    }
    if !a.batch.is_multiple_of(c.dp * c.ep) {
        return Err(format!(
            "--batch {} is not divisible by dp·ep={}",
            a.batch,
            c.dp * c.ep
        ));
    }
    // The schedule and the model's cut are checked here, before any rank starts.
    let s = schedule(&a)?;
    let m = s.microbatches;
    if !a.batch.is_multiple_of(m) || !(a.batch / m).is_multiple_of(c.dp * c.ep) {
        return Err(format!(
            "--microbatches {m}: {} sequences do not cut into {m} microbatches of a multiple of dp·ep={} sequences",
            a.batch,
            c.dp * c.ep
        ));
    }
    if let Some(start) = hf_start(&a)? {
        start
            .model
            .gpt_config(a.seq, a.dtype())
            .map_err(|e| format!("--init-from: {e}"))?;
    }
    check_pipeline(&model_config(&a), &s)
        .map_err(|e| format!("--schedule {}: {e}", a.comp.schedule.token()))?;
    if a.seq + 1 >= corpus(&a).len() {
        return Err(format!(
            "--seq must be shorter than the text ({} tokens)",
            corpus(&a).len()
        ));
    }
    // Output paths: a run that could not write its results fails now, not after training.
    // The trace, metrics and plot are written by rank 0 alone, so under an MPI launcher only
    // rank 0 checks them (a path on the launch node need not exist on the others); every
    // rank writes its own checkpoint file into --save-dir, so every rank checks that.
    if a.backend != Backend::Mpi || mpi_backend::launcher_rank().unwrap_or(0) == 0 {
        for (flag, path) in [
            ("--trace", &a.trace),
            ("--metrics", &a.metrics),
            ("--plot", &a.plot),
        ] {
            if let Some(p) = path {
                check_output_path(flag, p.as_ref(), OutputKind::File)?;
            }
        }
    }
    if let Some(dir) = &a.save_dir {
        check_output_path("--save-dir", dir.as_ref(), OutputKind::Dir)?;
    }
    Ok(a)
}

/// A Hugging Face checkpoint to start from: its model, and the bundled corpus in its
/// tokenizer's ids.
struct HfStart {
    model: ckpt::hf::HfModel,
    tokens: Vec<i64>,
}

/// The checkpoint of `--init-from`, opened, checked and the corpus tokenized once per
/// process (`None` without the flag).
fn hf_start(a: &Args) -> Result<Option<&'static HfStart>, String> {
    static START: std::sync::OnceLock<Result<HfStart, String>> = std::sync::OnceLock::new();
    let Some(dir) = &a.init_from else {
        return Ok(None);
    };
    let start = START.get_or_init(|| {
        let model = ckpt::hf::HfModel::open(dir).map_err(|e| format!("--init-from: {e}"))?;
        let tokenizer = dtensor::datasets::Tokenizer::from_dir(dir)
            .map_err(|e| format!("--init-from {}: {e}", dir.display()))?;
        let ids = tokenizer
            .encode(TEXT, false)
            .map_err(|e| format!("--init-from {}: {e}", dir.display()))?;
        let vocab = model.config.vocab_size;
        if let Some(&bad) = ids.iter().find(|&&t| t as usize >= vocab) {
            return Err(format!(
                "--init-from {}: the tokenizer gives id {bad}, beyond the model's vocab_size {vocab}",
                dir.display()
            ));
        }
        Ok(HfStart {
            model,
            tokens: ids.into_iter().map(i64::from).collect(),
        })
    });
    start.as_ref().map(Some).map_err(Clone::clone)
}

/// The training text as token ids: the bytes of the bundled corpus, or its tokens under
/// `--init-from`'s tokenizer (each made once per process: every step's batch reads it).
fn corpus(a: &Args) -> &'static [i64] {
    static BYTES: std::sync::OnceLock<Vec<i64>> = std::sync::OnceLock::new();
    match hf_start(a) {
        Ok(Some(s)) => &s.tokens,
        _ => BYTES.get_or_init(|| TEXT.bytes().map(i64::from).collect()),
    }
}

fn model_config(a: &Args) -> GptConfig {
    if let Ok(Some(s)) = hf_start(a) {
        // Checked by `resolve`, which opened it first.
        let from = s
            .model
            .gpt_config(a.seq, a.dtype())
            .expect("checked when the flags were resolved");
        return GptConfig {
            seed: a.seed,
            z_loss: a.z_loss,
            ..from
        }
        .composed(&a.comp);
    }
    GptConfig {
        hidden: a.hidden,
        heads: a.heads,
        kv_heads: a.kv_heads,
        rope_style: a.rope_style.into(),
        attn: AttentionOptions {
            head_dim: a.head_dim,
            qkv_bias: a.qkv_bias,
            qk_norm: a.qk_norm,
            ..AttentionOptions::default()
        },
        layers: a.layers,
        ffn: 4 * a.hidden,
        seq_len: a.seq,
        seed: a.seed,
        moe: a.moe.then_some(MoeConfig {
            capacity_factor: a.capacity,
            aux_loss_coef: a.aux_loss,
            bias_rate: a.expert_bias,
            ..MoeConfig::new(a.experts, a.top_k)
        }),
        z_loss: a.z_loss,
        ..GptConfig::small(a.dtype())
    }
    .composed(&a.comp)
}

/// One step's routing over every MoE block (and microbatch): tokens per expert, the
/// smallest and largest of any block and the mean, and the copies dropped.
#[derive(Clone, Copy, Debug, Default)]
struct RoutingStep {
    min: usize,
    mean: f64,
    max: usize,
    dropped: usize,
}

impl RoutingStep {
    fn of(stats: &[Vec<RoutingStats>]) -> Option<Self> {
        let all: Vec<&RoutingStats> = stats.iter().flatten().collect();
        (!all.is_empty()).then(|| RoutingStep {
            min: all.iter().map(|s| s.min).min().unwrap_or(0),
            mean: all.iter().map(|s| s.mean).sum::<f64>() / all.len() as f64,
            max: all.iter().map(|s| s.max).max().unwrap_or(0),
            dropped: all.iter().map(|s| s.dropped).sum(),
        })
    }
}

impl std::fmt::Display for RoutingStep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tokens per expert min {} mean {:.1} max {}, dropped {}",
            self.min, self.mean, self.max, self.dropped
        )
    }
}

/// The pipeline schedule the flags ask for (every rank builds the same).
fn schedule(a: &Args) -> Result<Schedule, String> {
    pipeline::for_composition(&a.comp)
        .map_err(|e| format!("--schedule {}: {e}", a.comp.schedule.token()))
}

/// The global batch of step `step`: `batch` windows of the text (inputs, next-byte targets).
fn global_batch(a: &Args, step: usize) -> (Tensor, Tensor) {
    let text = corpus(a);
    let span = text.len() - a.seq - 1;
    let (mut ids, mut tg) = (Vec::new(), Vec::new());
    for b in 0..a.batch {
        let start = ((step * a.batch + b) * 7919 + b * 131) % span;
        ids.extend_from_slice(&text[start..start + a.seq]);
        tg.extend_from_slice(&text[start + 1..start + a.seq + 1]);
    }
    let n = a.batch * a.seq;
    (
        Tensor::from_vec(ids, &[n]).unwrap(),
        Tensor::from_vec(tg, &[n]).unwrap(),
    )
}

/// One rank's numbers of one step.
#[derive(Clone, Debug, Default)]
struct StepRecord {
    loss: f64,
    grad_norm: f64,
    /// This step's wall time on this rank.
    secs: f64,
    /// Bytes this rank sent during the step, per mesh axis (in `DeviceMesh::counters` order).
    bytes_sent: Vec<u64>,
    /// The most bytes of live tensors this rank's thread held during the step.
    peak_bytes: u64,
}

/// `StepRecord` as numbers (for the MPI gather): loss, grad_norm, secs, peak, bytes per axis.
fn record_to_numbers(r: &StepRecord) -> impl Iterator<Item = f64> + '_ {
    [r.loss, r.grad_norm, r.secs, r.peak_bytes as f64]
        .into_iter()
        .chain(r.bytes_sent.iter().map(|&b| b as f64))
}

fn record_from_numbers(v: &[f64]) -> StepRecord {
    StepRecord {
        loss: v[0],
        grad_norm: v[1],
        secs: v[2],
        peak_bytes: v[3] as u64,
        bytes_sent: v[4..].iter().map(|&b| b as u64).collect(),
    }
}

/// The metrics lines from every rank's records (`per_rank[r][step]`): rank 0's loss,
/// grad_norm and tokens/s, bytes summed over ranks per axis, peaks by rank.
fn step_metrics(a: &Args, axes: &[AxisKind], per_rank: &[Vec<StepRecord>]) -> Vec<StepMetrics> {
    let tokens = (a.batch * a.seq) as f64;
    let ran = per_rank.first().map_or(0, Vec::len);
    // A resumed run ran the last `ran` of the `a.steps` steps.
    let first = a.steps - ran;
    (0..ran)
        .map(|step| {
            let r0 = &per_rank[0][step];
            StepMetrics {
                step: first + step,
                loss: r0.loss,
                grad_norm: r0.grad_norm,
                tokens_per_s: tokens / r0.secs,
                bytes_sent: axes
                    .iter()
                    .enumerate()
                    .map(|(i, axis)| {
                        let sum = per_rank.iter().map(|r| r[step].bytes_sent[i]).sum();
                        (axis.name().to_string(), sum)
                    })
                    .collect(),
                peak_tensor_bytes: per_rank.iter().map(|r| r[step].peak_bytes).collect(),
            }
        })
        .collect()
}

struct RankOut {
    losses: Vec<f64>,
    /// This rank's per-step numbers; after the gather, rank 0's `metrics` hold every rank's.
    records: Vec<StepRecord>,
    metrics: Vec<StepMetrics>,
    counters: Vec<(AxisKind, CounterSnapshot)>,
    /// This rank's idle share of the steps after the first.
    bubble: f64,
    /// `--moe`: each step's routing (the same on every rank).
    routing: Vec<RoutingStep>,
}

/// One rank's training, the same on every backend: `world` is this rank's world
/// communicator (a thread rank's or an MPI process's), `mesh` the mesh over it. Rank 0
/// prints the log when `verbose`.
fn train_rank<M: SeqMode, D: DataMode>(
    a: &Args,
    world: Arc<dyn Communicator>,
    mesh: Mesh,
    verbose: bool,
) -> Result<RankOut, Error> {
    let dm = DeviceMesh::new(world, mesh)?;
    let sched = schedule(a).map_err(|detail| Error::InvalidSchedule { detail })?;
    let m = sched.microbatches;
    let mut model = Pipeline::<M, D>::new(model_config(a), sched, &dm)?;
    if let Some(start) = hf_start(a).map_err(|detail| Error::InvalidUse {
        op: "--init-from",
        detail,
    })? {
        start
            .model
            .load_into(dm.world(), &mut model)
            .map_err(|e| Error::InvalidUse {
                op: "--init-from",
                detail: e.to_string(),
            })?;
    }
    model.ddp_bucket_bytes = a
        .comp
        .overlap
        .then_some(((a.bucket_mb * (1u64 << 20) as f64) as usize).max(1));
    let sm = model.stage_mesh().clone();
    let mut opt = AdamW::new(a.lr);
    let ckpt_err = |e: dtensor_checkpoint::Error| Error::InvalidUse {
        op: "checkpoint",
        detail: e.to_string(),
    };
    // Resuming: parameters, AdamW state and step count, then the data position (the batch
    // of a step is a function of the step) and the RNG (the parameter seed: training draws
    // no random numbers).
    let start = match &a.resume {
        None => 0,
        Some(dir) => {
            let dir = std::path::Path::new(dir);
            let extra =
                ckpt::nn::load_model(dir, dm.world(), &mut model, &mut opt).map_err(ckpt_err)?;
            let field = |k: &str| -> Result<usize, Error> {
                extra
                    .get(k)
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| Error::InvalidUse {
                        op: "checkpoint",
                        detail: format!("{}: no `{k}` in the checkpoint's extra", dir.display()),
                    })
            };
            let step = field("data.step")?;
            if field("rng.seed")? as u64 != a.seed || field("data.batch")? != a.batch {
                return Err(Error::InvalidUse {
                    op: "checkpoint",
                    detail: format!(
                        "{}: saved with another --seed or --batch (extra {extra:?})",
                        dir.display()
                    ),
                });
            }
            if verbose && dm.rank() == 0 {
                println!("resumed from {} at step {step}", dir.display());
            }
            step.min(a.steps)
        }
    };
    let start_counters = dm.counters();
    let mut losses = Vec::with_capacity(a.steps);
    let mut records = Vec::with_capacity(a.steps);
    let mut routing = Vec::new();
    let t0 = Instant::now();
    // The first step pays for warm-up (fresh buffers page-fault, the pool fills): the steady
    // rate is timed from its end, as PyTorch benchmarks time after warm-up steps.
    let mut after_first = None;
    let mut skipped = 0usize;
    let (mut busy, mut stepped) = (0.0, 0.0);
    for step in start..a.steps {
        let (ids, tg) = global_batch(a, step);
        let split = |t: &Tensor| -> Result<Vec<DTensor<Ids>>, Error> {
            microbatches(t, m, a.seq)?
                .iter()
                .map(|mb| {
                    DTensor::<Ids>::from_global(
                        &to_stream_order(mb, a.seq, &a.context(), &sm)?,
                        &sm,
                    )
                })
                .collect()
        };
        let before = dm.counters();
        memory::reset_peak();
        let t = Instant::now();
        let r = model.train_step(&split(&ids)?, &split(&tg)?, &mut opt, a.clip)?;
        let secs = t.elapsed().as_secs_f64();
        // A diverged step (every rank sees the same reduced loss and norm): stop, or, with
        // --skip-nonfinite, count it (its update was skipped when the norm is not finite).
        if !(r.loss.is_finite() && r.grad_norm.is_finite()) {
            if a.skip_nonfinite && !r.grad_norm.is_finite() {
                skipped += 1;
            } else {
                return Err(Error::NonFinite {
                    step,
                    detail: format!(
                        "loss {} and gradient norm {} are not both finite: the run diverged (a smaller --lr may help; --skip-nonfinite skips such updates)",
                        r.loss, r.grad_norm
                    ),
                });
            }
        }
        let routed = RoutingStep::of(&model.take_routing_stats());
        routing.extend(routed);
        records.push(StepRecord {
            loss: r.loss,
            grad_norm: r.grad_norm,
            secs,
            bytes_sent: dm
                .counters()
                .iter()
                .zip(&before)
                .map(|((_, now), (_, then))| now.since(then).bytes_sent)
                .collect(),
            peak_bytes: memory::peak_bytes() as u64,
        });
        losses.push(r.loss);
        if a.save_every > 0 && (step + 1) % a.save_every == 0 {
            let dir = std::path::Path::new(
                a.save_dir
                    .as_deref()
                    .expect("--save-every needs --save-dir: checked by resolve"),
            );
            let extra = [
                ("data.step", step + 1),
                ("data.batch", a.batch),
                ("rng.seed", a.seed as usize),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
            let t = Instant::now();
            let rep = ckpt::nn::save_model(dir, dm.world(), &mut model, &opt, &extra)
                .map_err(ckpt_err)?;
            if verbose && dm.rank() == 0 {
                println!(
                    "step {step:4}  saved {} ({} bytes, generation {}) in {:.3}s",
                    dir.display(),
                    rep.total_bytes,
                    rep.generation,
                    t.elapsed().as_secs_f64()
                );
            }
        }
        if step == start {
            after_first = Some(Instant::now());
        } else {
            busy += r.busy_secs;
            stepped += r.step_secs;
        }
        let tokens = (a.batch * a.seq) as f64;
        if verbose && dm.rank() == 0 && (step % a.log_every == 0 || step + 1 == a.steps) {
            println!(
                "step {step:4}  loss {:.4}  grad_norm {:.3}  {:>8.0} tokens/s{}",
                r.loss,
                r.grad_norm,
                tokens / secs,
                routed.map_or(String::new(), |r| format!("  moe: {r}"))
            );
        }
        if verbose && dm.rank() == 0 && a.print_loss_bits {
            println!("step {step:4}  loss_bits=0x{:016x}", r.loss.to_bits());
        }
    }
    if verbose && dm.rank() == 0 {
        let secs = t0.elapsed().as_secs_f64();
        let ran = a.steps - start;
        let steady = match after_first {
            Some(t) if ran > 1 => format!(
                " ({:.0} tokens/s after the first step)",
                ((ran - 1) * a.batch * a.seq) as f64 / t.elapsed().as_secs_f64()
            ),
            _ => String::new(),
        };
        println!(
            "trained {ran} steps in {secs:.2}s: {:.0} tokens/s{steady}",
            (ran * a.batch * a.seq) as f64 / secs
        );
        if skipped > 0 {
            println!("skipped {skipped} updates whose gradient norm was not finite");
        }
    }
    let counters = dm
        .counters()
        .into_iter()
        .zip(start_counters)
        .map(|((k, c), (_, s))| (k, c.since(&s)))
        .collect();
    let bubble = if stepped > 0.0 {
        (1.0 - busy / stepped).max(0.0)
    } else {
        0.0
    };
    Ok(RankOut {
        losses,
        records,
        metrics: Vec::new(),
        counters,
        bubble,
        routing,
    })
}

/// Something to run with the sequence mode `M` and data mode `D` the flags ask for.
trait WithModes {
    type Out;
    fn run<M: SeqMode, D: DataMode>(self, a: &Args) -> Self::Out;
}

/// Calls `f` with the modes of `a` (one monomorphization per pair).
fn with_modes<F: WithModes>(a: &Args, f: F) -> F::Out {
    fn pick_d<M: SeqMode, F: WithModes>(a: &Args, f: F) -> F::Out {
        match a.comp.data {
            DataKind::Ddp => f.run::<M, Ddp>(a),
            DataKind::Zero1 => f.run::<M, Zero1>(a),
            DataKind::Zero2 => f.run::<M, Zero2>(a),
            DataKind::Fsdp => f.run::<M, Fsdp>(a),
        }
    }
    if a.comp.degrees.sp {
        pick_d::<Sp, F>(a, f)
    } else {
        pick_d::<NoSp, F>(a, f)
    }
}

/// Training on thread ranks.
struct OnThreads;
impl WithModes for OnThreads {
    type Out = Result<RankOut, String>;
    fn run<M: SeqMode, D: DataMode>(self, a: &Args) -> Self::Out {
        train::<M, D>(a, a.comp.degrees, true)
    }
}

/// Training on MPI ranks.
struct OnMpi;
impl WithModes for OnMpi {
    type Out = Result<MpiOut, String>;
    fn run<M: SeqMode, D: DataMode>(self, a: &Args) -> Self::Out {
        train_mpi::<M, D>(a)
    }
}

/// The model's mesh: `[Dp, Ep, Cp, Tp]`, behind `Pp` with pipeline stages.
fn model_mesh(config: ParallelConfig) -> Result<Mesh, String> {
    dtensor::nn::model_mesh(&config).map_err(|e| e.to_string())
}

/// Trains on `config.world_size()` thread ranks; rank 0's losses, counters summed over
/// ranks, the bubble averaged over ranks.
fn train<M: SeqMode, D: DataMode>(
    a: &Args,
    config: ParallelConfig,
    verbose: bool,
) -> Result<RankOut, String> {
    let mesh = model_mesh(config)?;
    let results = launch_ranks(a, mesh.world_size(), |world| {
        train_rank::<M, D>(a, world, mesh.clone(), verbose)
    });
    let mut outs = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        outs.push(res.map_err(|e| format!("rank {r}: {e}"))?);
    }
    let axes: Vec<AxisKind> = outs[0].counters.iter().map(|(k, _)| *k).collect();
    let per_rank: Vec<Vec<StepRecord>> = outs.iter().map(|o| o.records.clone()).collect();
    // Sum every rank's counters per axis for the receipt; average the bubble.
    let ranks = outs.len() as f64;
    let mut first = outs.swap_remove(0);
    first.metrics = step_metrics(a, &axes, &per_rank);
    first.bubble = (first.bubble + outs.iter().map(|o| o.bubble).sum::<f64>()) / ranks;
    for o in &outs {
        for (mine, theirs) in first.counters.iter_mut().zip(&o.counters) {
            mine.1 = mine.1.plus(&theirs.1);
        }
    }
    Ok(first)
}

/// Runs `f` on `n` thread ranks: plain threads (`--device cpu`), or one per GPU over NCCL
/// (`--device cuda`, checked by [`device_preflight`] first).
fn launch_ranks<T, F>(a: &Args, n: usize, f: F) -> Vec<Result<T, String>>
where
    T: Send,
    F: Fn(Arc<dyn Communicator>) -> Result<T, Error> + Sync,
{
    match a.device {
        Place::Cpu => errors_as_text(threads::launch(n, f)),
        Place::Cuda => errors_as_text(launch_nccl(n, f)),
    }
}

fn errors_as_text<T, E: std::fmt::Display>(r: Vec<Result<T, E>>) -> Vec<Result<T, String>> {
    r.into_iter()
        .map(|r| r.map_err(|e| e.to_string()))
        .collect()
}

#[cfg(feature = "nccl")]
fn launch_nccl<T, F>(n: usize, f: F) -> Vec<Result<T, Error>>
where
    T: Send,
    F: Fn(Arc<dyn Communicator>) -> Result<T, Error> + Sync,
{
    dtensor::collectives::nccl::launch(n, |comm| f(comm as Arc<dyn Communicator>))
}

#[cfg(not(feature = "nccl"))]
fn launch_nccl<T, F>(n: usize, _f: F) -> Vec<Result<T, Error>>
where
    T: Send,
    F: Fn(Arc<dyn Communicator>) -> Result<T, Error> + Sync,
{
    (0..n)
        .map(|_| {
            Err(Error::InvalidUse {
                op: "train_gpt --device cuda",
                detail: BUILT_WITHOUT_CUDA.into(),
            })
        })
        .collect()
}

/// Writes `line` and a newline to stderr in one write, so that the lines of MPI processes
/// sharing mpirun's stderr do not interleave mid-line.
fn say_line(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

/// This MPI process's NCCL communicator (`--backend mpi --device cuda`): rank 0's unique id
/// is broadcast over the MPI world, and the process takes GPU `local rank mod` the GPU
/// count, the local rank being the launcher's node-local one (`OMPI_COMM_WORLD_LOCAL_RANK`,
/// `MPI_LOCALRANKID`, `SLURM_LOCALID`), else the world rank.
#[cfg(feature = "nccl")]
fn nccl_over_mpi(world: &dyn Communicator) -> Result<Arc<dyn Communicator>, Error> {
    use dtensor::collectives::nccl;
    Ok(Arc::new(nccl::from_host(world, nccl::Options::default())?))
}

#[cfg(not(feature = "nccl"))]
fn nccl_over_mpi(_world: &dyn Communicator) -> Result<Arc<dyn Communicator>, Error> {
    Err(Error::InvalidUse {
        op: "train_gpt --device cuda",
        detail: BUILT_WITHOUT_CUDA.into(),
    })
}

const BUILT_WITHOUT_CUDA: &str = "--device cuda: this train_gpt was built without the `cuda` and `nccl` features; rebuild with `cargo build --release --example train_gpt --features cuda,nccl` (needs the CUDA driver and libnccl at run time only)";

/// Checks that `--device cuda` can run in this process: built with the features, a CUDA
/// driver, NVRTC and libnccl present. Each failure is an error, never a panic. Under
/// `--backend mpi` every process runs it itself, before any collective ([`train_mpi`]).
fn device_preflight(a: &Args) -> Result<(), String> {
    if a.device == Place::Cpu {
        return Ok(());
    }
    if !cfg!(feature = "nccl") {
        return Err(BUILT_WITHOUT_CUDA.into());
    }
    if !dtensor::kernels::cuda::driver_present() {
        return Err("--device cuda: no CUDA driver found (libcuda.so.1 could not be loaded); run on a machine with an NVIDIA GPU and driver, or use --device cpu".into());
    }
    if !dtensor::kernels::cuda::nvrtc_present() {
        return Err("--device cuda: NVRTC (libnvrtc.so) not found: put it on LD_LIBRARY_PATH (e.g. the nvidia-cuda-nvrtc wheel's nvidia/cu13/lib; scripts/cuda-tools.sh)".into());
    }
    dtensor::collectives::nccl::require_library().map_err(|e| format!("--device cuda: {e}"))?;
    Ok(())
}

/// What an MPI process ends with.
enum MpiOut {
    /// Rank 0: its losses and every rank's counters summed.
    Root(RankOut),
    /// Any other rank.
    Peer,
    /// This world cannot run: its size is not the mesh's (rank 0 has said so), or the
    /// device checks failed on some rank (every rank has said so). Every rank exits 1.
    Refused,
}

/// `CollectiveKind::ALL` calls, then bytes sent and received: one axis's counters as numbers.
const COUNTER_FIELDS: usize = CollectiveKind::ALL.len() + 2;

fn counters_to_numbers(c: &CounterSnapshot) -> impl Iterator<Item = i64> + '_ {
    CollectiveKind::ALL
        .iter()
        .map(|&k| c.calls(k))
        .chain([c.bytes_sent, c.bytes_received])
        .map(|n| n as i64)
}

fn counters_from_numbers(v: &[i64]) -> CounterSnapshot {
    let live = Counters::default();
    for (&k, &n) in CollectiveKind::ALL.iter().zip(v) {
        for _ in 0..n {
            live.record(k, 0, 0);
        }
    }
    let mut s = live.snapshot();
    s.bytes_sent = v[CollectiveKind::ALL.len()] as u64;
    s.bytes_received = v[CollectiveKind::ALL.len() + 1] as u64;
    s
}

/// Trains with each process `mpirun` started as one rank (`train_rank` on the MPI world,
/// or with `--device cuda` on an NCCL communicator made over it). Rank 0 prints the header
/// and the log, and gets every rank's counters summed.
fn train_mpi<M: SeqMode, D: DataMode>(a: &Args) -> Result<MpiOut, String> {
    let c = a.comp.degrees;
    let mesh = model_mesh(c)?;
    Ok(mpi_backend::run(|world| -> Result<MpiOut, Error> {
        let (rank, size) = (world.rank(), world.size());
        if size != mesh.world_size() {
            // Every rank sees the same sizes, so all return and MPI ends cleanly.
            if rank == 0 {
                eprintln!(
                    "error: --backend mpi: mesh {c} needs {} ranks but mpirun started {size}; run it as `mpirun -np {} … train_gpt --backend mpi --mesh …`",
                    mesh.world_size(),
                    mesh.world_size()
                );
            }
            return Ok(MpiOut::Refused);
        }
        // --device cuda: each process checks its own machine before any collective, then
        // the ranks share their verdicts over MPI (host memory), so a failure on any rank
        // ends every rank with an error and exit code 1, none left waiting in NCCL's setup.
        if a.device == Place::Cuda {
            let mine = device_preflight(a);
            if let Err(e) = &mine {
                say_line(&format!("error: rank {rank}: {e}"));
            }
            let verdicts = world.all_gather_vec(&[i64::from(mine.is_err())])?;
            let failed: Vec<usize> = (0..size).filter(|&r| verdicts[r] != 0).collect();
            if !failed.is_empty() {
                if mine.is_ok() {
                    say_line(&format!("error: rank {rank}: --device cuda: the device checks failed on ranks {failed:?}"));
                }
                return Ok(MpiOut::Refused);
            }
        }
        if rank == 0 {
            println!("{}", header(a, "MPI"));
        }
        // The model's collectives: the MPI world itself, or NCCL over it with --device cuda
        // (the reports below stay on the MPI world: host values).
        let comm = match a.device {
            Place::Cpu => world.clone(),
            Place::Cuda => nccl_over_mpi(&*world)?,
        };
        let out = train_rank::<M, D>(a, comm, mesh.clone(), true)?;
        if let Some(path) = &a.trace {
            // Every process renders its own events; rank 0 gathers and writes them.
            let mine: Vec<i32> = trace::chrome_lines(&trace::take())
                .bytes()
                .map(i32::from)
                .collect();
            let lens = world.all_gather_vec(&[mine.len() as i64])?;
            let counts: Vec<usize> = lens.iter().map(|&n| n as usize).collect();
            let mut all = vec![0i32; counts.iter().sum()];
            world.all_gatherv(
                dtensor::kernels::Slice::I32(&mine[..]),
                dtensor::kernels::SliceMut::I32(&mut all[..]),
                &counts,
            )?;
            if rank == 0 {
                let mut parts = Vec::new();
                let mut at = 0;
                for n in counts {
                    let bytes: Vec<u8> = all[at..at + n].iter().map(|&b| b as u8).collect();
                    parts.push(String::from_utf8_lossy(&bytes).into_owned());
                    at += n;
                }
                write_trace(path, &trace::wrap(&parts)).map_err(|detail| Error::InvalidUse {
                    op: "train_gpt",
                    detail,
                })?;
            }
        }
        // Sum the counters (counted before this all-reduce, on the axis communicators).
        let mut totals: Vec<i64> = out
            .counters
            .iter()
            .flat_map(|(_, s)| counters_to_numbers(s))
            .collect();
        world.all_reduce_in_place(&mut totals, ReduceOp::Sum)?;
        let mut bubble = [out.bubble / size as f64];
        world.all_reduce_in_place(&mut bubble, ReduceOp::Sum)?;
        // Every rank's per-step numbers to every rank (equal lengths: same steps and axes).
        let mine: Vec<f64> = out.records.iter().flat_map(record_to_numbers).collect();
        let all = world.all_gather_vec(&mine)?;
        if rank != 0 {
            return Ok(MpiOut::Peer);
        }
        let per_step = 4 + out.counters.len();
        let per_rank: Vec<Vec<StepRecord>> = all
            .chunks(mine.len().max(1))
            .map(|r| r.chunks(per_step).map(record_from_numbers).collect())
            .collect();
        let axes: Vec<AxisKind> = out.counters.iter().map(|(k, _)| *k).collect();
        let counters = out
            .counters
            .iter()
            .zip(totals.chunks(COUNTER_FIELDS))
            .map(|((axis, _), v)| (*axis, counters_from_numbers(v)))
            .collect();
        Ok(MpiOut::Root(RankOut {
            losses: out.losses,
            metrics: step_metrics(a, &axes, &per_rank),
            records: out.records,
            counters,
            bubble: bubble[0],
            routing: out.routing,
        }))
    }))
}

fn header(a: &Args, ranks: &str) -> String {
    if let Ok(Some(start)) = hf_start(a) {
        let c = &start.model.config;
        return format!(
            "train_gpt: initialized from {} ({}: {} layers, hidden {}, {} heads ({} KV heads), vocab {}), the corpus in its tokenizer's {} tokens, seq {}, global batch {} ({} tokens), {}, on {} {ranks} ranks",
            start.model.dir.display(),
            c.architecture.model_type(),
            c.layers,
            c.hidden_size,
            c.heads,
            c.kv_heads,
            c.vocab_size,
            start.tokens.len(),
            a.seq,
            a.batch,
            a.batch * a.seq,
            a.dtype(),
            a.comp.degrees.world_size(),
        );
    }
    let z_loss = match a.z_loss {
        z if z > 0.0 => format!(", z-loss {z}"),
        _ => String::new(),
    };
    // Today's attention is said as before; GQA and the Hugging Face pairing are named.
    let mut heads = format!("{} heads", a.heads);
    if a.kv_heads() != a.heads {
        heads += &format!(" ({} KV heads)", a.kv_heads());
    }
    if let Some(d) = a.head_dim {
        heads += &format!(", head dim {d}");
    }
    if a.rope_style == RopeStyleArg::Half {
        heads += ", half-split RoPE";
    }
    if a.qkv_bias {
        heads += ", q/k/v bias";
    }
    if a.qk_norm {
        heads += ", q/k norm";
    }
    format!(
        "train_gpt: {} layers, hidden {}, {heads}, byte vocab 256, seq {}, global batch {} ({} tokens){z_loss}, {}, on {} {ranks} ranks, device {}",
        a.layers, a.hidden, a.seq, a.batch, a.batch * a.seq, a.dtype(), a.comp.degrees.world_size(),
        match (a.device, a.backend) {
            (Place::Cpu, _) => "cpu",
            (Place::Cuda, Backend::Threads) => "cuda (NCCL; rank r on GPU r mod the GPU count)",
            (Place::Cuda, Backend::Mpi) => "cuda (NCCL over MPI; each process on GPU (its node-local rank) mod the GPU count)",
        }
    )
}

/// Checks that `--backend mpi` can run here: built with the feature, started by mpirun
/// (unless the mesh is a single rank).
fn mpi_preflight(a: &Args) -> Result<(), String> {
    if !cfg!(feature = "mpi") {
        return Err("--backend mpi: this train_gpt was built without the `mpi` feature; rebuild with `cargo build --release --example train_gpt --features mpi` (needs OpenMPI and libclang)".into());
    }
    let n = a.comp.degrees.world_size();
    if n > 1 && !mpi_backend::launched_by_mpirun() {
        return Err(format!(
            "--backend mpi: mesh {} needs {n} ranks but this process was not started by mpirun (a world of 1 rank). {} Here: `mpirun -np {n} <train_gpt> --backend mpi …`",
            a.comp.degrees,
            mpi_backend::LAUNCH_HINT
        ));
    }
    Ok(())
}

/// Writes a trace document and says where.
fn write_trace(path: &str, json: &str) -> Result<(), String> {
    std::fs::write(path, json).map_err(|e| format!("--trace {path}: {e}"))?;
    println!(
        "trace: {path} ({} bytes; open it in https://ui.perfetto.dev or chrome://tracing)",
        json.len()
    );
    Ok(())
}

/// `--plan`: the planner's figures for this run beside the receipt's (bytes per axis over
/// the `steps` run, and the largest per-rank peak of the last step).
fn print_plan(a: &Args, out: &RankOut, steps: u64) -> Result<(), String> {
    use dtensor::planner::{self, human, Axis, Model};
    let model = Model {
        name: "train_gpt".into(),
        vocab: 256,
        hidden: a.hidden,
        heads: a.heads,
        kv_heads: a.kv_heads(),
        layers: a.layers,
        ffn: 4 * a.hidden,
        seq_len: a.seq,
        global_batch: a.batch,
        layer_norm: false,
        bias: true,
        activation: planner::Activation::Gelu,
        moe: a.moe.then_some(planner::Moe {
            experts: a.experts,
            top_k: a.top_k,
        }),
    };
    let comp = a.comp;
    let p = planner::plan(&model, &comp)?;
    println!("plan ({comp}; `dtensor plan`, docs/planner.md), over {steps} steps:");
    for (axis, s) in &out.counters {
        let ax = match axis.name() {
            "pp" => Axis::Pp,
            "dp" => Axis::Dp,
            "ep" => Axis::Ep,
            "cp" => Axis::Cp,
            _ => Axis::Tp,
        };
        let (planned, note) = if a.moe && ax == Axis::Ep {
            (
                p.axis_bytes(ax) * steps,
                " (MoE dispatch: uniform-routing expectation)",
            )
        } else {
            (p.axis_bytes(ax) * steps, "")
        };
        if planned == 0 && s.bytes_sent == 0 {
            continue;
        }
        println!(
            "  {}: planned {planned} B sent, measured {} B ({:+.2}%){note}",
            axis.name(),
            s.bytes_sent,
            100.0 * (planned as f64 - s.bytes_sent as f64) / (s.bytes_sent.max(1)) as f64
        );
    }
    let measured = out
        .metrics
        .last()
        .and_then(|m| m.peak_tensor_bytes.iter().max().copied())
        .unwrap_or(0);
    println!(
        "  peak tensor memory per rank: planned {}, measured {} (largest rank, last step); pipeline bubble planned {:.3}",
        human(p.peak_bytes() as f64),
        human(measured as f64),
        p.bubble
    );
    Ok(())
}

/// Trains, prints the receipt and writes the outputs; `Ok(Some(passed))` with `--check`'s
/// verdict (true without it), `Ok(None)`: this process has nothing more to do (an MPI rank
/// other than 0).
fn run(a: &Args) -> Result<Option<bool>, String> {
    let c = &a.comp.degrees;
    if a.trace.is_some() {
        trace::enable();
    }
    // A trace that cannot be written fails the run, but only after the receipt, the other
    // outputs and the check: a finished run's results are not thrown away for it.
    let mut trace_err = None;
    let out = match a.backend {
        Backend::Threads => {
            device_preflight(a)?;
            println!("{}", header(a, "thread"));
            let out = with_modes(a, OnThreads)?;
            if let Some(path) = &a.trace {
                trace_err = write_trace(path, &trace::chrome_json(&trace::take())).err();
            }
            out
        }
        Backend::Mpi => {
            // A build without the device features says so before MPI starts; the machine's
            // checks run in every MPI process (train_mpi).
            if !cfg!(feature = "nccl") {
                device_preflight(a)?;
            }
            mpi_preflight(a)?;
            let out = with_modes(a, OnMpi)?;
            match out {
                MpiOut::Root(out) => out,
                MpiOut::Peer => return Ok(None),
                MpiOut::Refused => return Ok(Some(false)),
            }
        }
    };
    println!("receipt:");
    let sched = schedule(a)?;
    println!(
        "  composition: pp={} ({:?}, {} microbatches{}) × dp={} ({}) × tp={} ({}), vocab-parallel embedding and loss{}{}{}",
        c.pp,
        sched.kind.expect("a generated schedule"),
        sched.microbatches,
        if sched.virtual_stages_per_rank > 1 {
            format!(", {} chunks per rank", sched.virtual_stages_per_rank)
        } else {
            String::new()
        },
        c.dp,
        match a.comp.data {
            DataKind::Ddp => "DDP all-reduce of the gradients",
            DataKind::Zero1 => "ZeRO-1: reduce-scatter once per step, sharded optimizer state, all-gather of the updated parameters",
            DataKind::Zero2 => "ZeRO-2: reduce-scatter after every backward, sharded gradients and optimizer state",
            DataKind::Fsdp if a.comp.reshard => "FSDP: parameters sharded, gathered in forward and again in backward, gradients reduce-scattered",
            DataKind::Fsdp => "FSDP: parameters sharded, gathered once and kept until backward, gradients reduce-scattered",
        },
        c.tp,
        if c.sp {
            "Megatron TP + SP: all_gather / reduce_scatter of the sequence"
        } else {
            "Megatron TP: to_replicate / all_reduce"
        },
        if a.comp.recompute { ", blocks recomputed in backward" } else { "" },
        if !a.comp.overlap {
            ""
        } else if a.comp.data == DataKind::Fsdp {
            ", FSDP gathers prefetched one layer ahead"
        } else if matches!(a.comp.data, DataKind::Ddp) {
            ", DDP gradients all-reduced in buckets during the backward"
        } else {
            ""
        },
        if a.comp.bf16 {
            if a.comp.reduce_bf16 { ", bf16 compute, f32 masters, bf16 gradient reduction" } else { ", bf16 compute, f32 masters, f32 gradient reduction" }
        } else { "" },
    );
    if c.cp > 1 {
        println!(
            "  context parallel: cp={} ({}, {} chunks): the sequence Shard<0> over cp everywhere, parameter gradients all-reduced over cp (adjoint of to_replicate)",
            c.cp,
            match a.comp.cp_strategy {
                CpStrategy::Ring => "ring attention: K/V blocks passed round the cp ring",
                CpStrategy::AllToAll => "all-to-all attention: sequence-sharded to head-sharded and back",
            },
            if a.comp.zigzag { "zigzag" } else { "contiguous" },
        );
    }
    if c.pp > 1 {
        let analytic = sched
            .analytic_bubble()
            .map_or("none known".to_string(), |b| format!("{b:.3}"));
        let simulated = sched
            .simulate(dtensor::nn::Costs::new(1.0, 1.0, 1.0))
            .map(|t| format!("{:.3}", t.bubble_fraction()))
            .unwrap_or_else(|e| e.to_string());
        println!(
            "  pipeline bubble: measured {:.3} (idle share of the steps after the first, mean over ranks), analytic {analytic}, simulated with F = B = W {simulated}",
            out.bubble
        );
    }
    if a.moe {
        println!(
            "  moe: {} experts over ep={} ({} per rank), top-{}, {}, aux loss {}{}; expert grads reduced over dp (and tp with sp), not ep",
            a.experts,
            c.ep,
            a.experts / c.ep.max(1),
            a.top_k,
            a.capacity.map_or("dropless".to_string(), |f| format!("capacity factor {f}")),
            a.aux_loss,
            a.expert_bias.map_or(String::new(), |g| format!(", expert bias rate {g}")),
        );
        // A resumed run ran the last steps of `a.steps`.
        let first = a.steps - out.losses.len();
        for (i, r) in out.routing.iter().enumerate() {
            let step = first + i;
            if a.steps <= 10 || step.is_multiple_of(a.log_every) || step + 1 == a.steps {
                println!("  moe step {step}: {r}");
            }
        }
    }
    let tokens = (out.losses.len() * a.batch * a.seq) as u64;
    for (axis, s) in &out.counters {
        // Expert and context parallelism of degree 1 move nothing: no line for them.
        if matches!(axis.name(), "ep" | "cp") && c.degree(*axis) == 1 {
            continue;
        }
        println!(
            "  {}: {s} ({} B sent per token)",
            axis.name(),
            s.bytes_sent / tokens.max(1)
        );
    }
    if a.plan {
        print_plan(a, &out, tokens / (a.batch * a.seq) as u64)?;
    }
    if let Some(path) = &a.metrics {
        std::fs::write(path, metrics::jsonl(&out.metrics))
            .map_err(|e| format!("--metrics {path}: {e}"))?;
        println!("  metrics: {} steps written to {path}", out.metrics.len());
    }
    if let Some(path) = &a.plot {
        let series: Vec<metrics::Point> = out
            .metrics
            .iter()
            .map(|m| (m.step as f64, m.loss, m.tokens_per_s))
            .collect();
        metrics::draw(&series, path.as_ref()).map_err(|e| format!("--plot: {e}"))?;
        println!("  plot: loss and tokens/s against step drawn to {path}");
    }
    if !a.check {
        return trace_err.map_or(Ok(Some(true)), Err);
    }
    // One rank, plain: no pipeline, DDP, the whole batch as one microbatch.
    let one = ParallelConfig::default();
    let plain = Args {
        comp: Composition {
            degrees: one,
            data: DataKind::Ddp,
            schedule: ScheduleKind::GPipe,
            microbatches: 1,
            virtual_stages: 1,
            recompute: false,
            ..a.comp
        },
        device: Place::Cpu,
        ..a.clone()
    };
    let reference = train::<NoSp, Ddp>(&plain, one, false)?;
    let diff = out
        .losses
        .iter()
        .zip(&reference.losses)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    // On a GPU, cuBLAS sums each GEMM in its own order (split-K, tensor-core tiles): the
    // rounding of every product differs from the CPU's, and 50 steps of AdamW carry it on.
    let tol = match (a.dtype(), a.device) {
        (DType::F64, Place::Cpu) => 1e-9,
        (DType::F64, Place::Cuda) => 1e-6,
        _ if a.comp.bf16 => 5e-2,
        (_, Place::Cpu) => 2e-3,
        (_, Place::Cuda) => 1e-2,
    };
    println!("max_abs_loss_diff={diff:e} (tolerance {tol:e}, one rank vs {c})");
    trace_err.map_or(Ok(Some(diff <= tol)), Err)
}

fn main() -> ExitCode {
    // Clap exits 2 on a bad flag or value, naming it; the checks across flags do the same.
    let args = match resolve(Args::parse()) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(Some(true) | None) => ExitCode::SUCCESS,
        Ok(Some(false)) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
