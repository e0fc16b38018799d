//! `dtensor plan`: per-rank memory, bytes per mesh axis and the pipeline bubble of a GPT
//! composition as dtensor-nn runs it, or the best compositions for a number of devices
//! (see `docs/planner.md`).
//!
//! `cargo run --release --bin dtensor -- plan --model 7b --devices 64 --memory-gib 131`
//! `cargo run --release --bin dtensor -- plan --model gpt-small --devices 4 --mesh dp=2,tp=2,sp`
//!
//! `dtensor data prepare`: text into Megatron-LM indexed datasets (`data.rs`, `docs/data.md`).
//!
//! `cargo run --release --bin dtensor -- data prepare --tokenizer tok/tokenizer.json --input web.jsonl --out data/`
//!
//! `dtensor hf-parity` and `dtensor generate`: a Hugging Face checkpoint on a mesh of
//! thread ranks (`hf.rs`, `docs/models.md`).
//!
//! `cargo run --release --bin dtensor -- hf-parity --model DIR --ids ids.json --mesh tp=2`
//! `cargo run --release --bin dtensor -- generate --model DIR --prompt "Once" --max-new-tokens 20`
//! `cargo run --release --bin dtensor -- hf-export --checkpoint CKPT --like DIR --out OUT`
use clap::{Parser, Subcommand};
use dtensor::cli::CompositionArgs;
use dtensor::planner::{self, human, Composition, Interconnect, Model};
use std::process::ExitCode;

// Beside this file, not in src/bin/, where cargo would take it for a binary of its own.
#[path = "dtensor/data.rs"]
mod data;
#[path = "dtensor/hf.rs"]
mod hf;

/// Distributed tensors: tools.
#[derive(Parser)]
#[command(name = "dtensor")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Per-rank memory, bytes per mesh axis and the pipeline bubble of one composition
    /// (--mesh), or the best compositions for --devices (docs/planner.md)
    #[command(args_override_self = true, allow_negative_numbers = true)]
    Plan(PlanArgs),
    /// Data preparation: `data prepare` tokenizes text into Megatron-LM indexed datasets
    /// (docs/data.md)
    Data(data::DataArgs),
    /// A Hugging Face model's causal-LM loss, logits and gradient norms on a batch of ids,
    /// computed on a mesh of thread ranks, as one JSON object (docs/models.md)
    HfParity(hf::ParityArgs),
    /// Text from a Hugging Face model and its tokenizer, with a KV cache, on thread ranks
    /// (heads over tp) (docs/models.md)
    Generate(hf::GenerateArgs),
    /// A dtensor checkpoint of a Hugging Face model (train_gpt --init-from … --save-dir …)
    /// written back in the Hugging Face layout (docs/models.md)
    HfExport(hf::ExportArgs),
}

#[derive(clap::Args)]
struct PlanArgs {
    /// A preset (gpt-small, 7b, 70b, moe-8x7b) or a JSON model file
    #[arg(long, value_name = "M")]
    model: String,
    /// Ranks (with --mesh: must equal the mesh's world size)
    #[arg(long, value_name = "N")]
    devices: Option<usize>,
    /// One composition (`--mesh` and the flags over it); without --mesh: search and rank
    #[command(flatten)]
    run: CompositionArgs,
    /// Memory per device, GiB (an H200's by default); compositions over it are refused,
    /// saying by how much
    #[arg(long, value_name = "G", default_value_t = Interconnect::default().memory_gib)]
    memory_gib: f64,
    /// Override the model's global batch (sequences per step)
    #[arg(long, value_name = "N")]
    batch: Option<usize>,
    /// Override the model's sequence length
    #[arg(long, value_name = "N")]
    seq: Option<usize>,
    /// Devices per node
    #[arg(long, value_name = "N", default_value_t = Interconnect::default().node_size)]
    node_size: usize,
    /// Per-rank bandwidth inside a node, GB/s
    #[arg(long, value_name = "X", default_value_t = Interconnect::default().intra_gbps)]
    intra_gbps: f64,
    /// Per-rank bandwidth across nodes, GB/s
    #[arg(long, value_name = "X", default_value_t = Interconnect::default().inter_gbps)]
    inter_gbps: f64,
    /// Sustained TFLOP/s per device
    #[arg(long, value_name = "X", default_value_t = Interconnect::default().tflops)]
    tflops: f64,
    /// Compositions to print when searching
    #[arg(long, value_name = "K", default_value_t = 5)]
    top: usize,
}

struct Args {
    model: String,
    devices: usize,
    composition: Option<Composition>,
    batch: Option<usize>,
    seq: Option<usize>,
    net: Interconnect,
    top: usize,
}

/// The checks across flags (clap has checked each value).
fn resolve(p: PlanArgs) -> Result<Args, String> {
    let composition = match p.run.mesh {
        Some(_) => Some(p.run.composition("dp=1")?),
        None if p.run != CompositionArgs::default() => {
            return Err("the composition flags set switches over --mesh: give --mesh".into())
        }
        None => None,
    };
    let devices = p.devices.unwrap_or(0);
    if devices == 0 && composition.is_none() {
        return Err("--devices is required (at least 1) without --mesh".into());
    }
    if p.node_size == 0 || p.intra_gbps <= 0.0 || p.inter_gbps <= 0.0 {
        return Err("--node-size, --intra-gbps and --inter-gbps must be positive".into());
    }
    Ok(Args {
        model: p.model,
        devices,
        composition,
        batch: p.batch,
        seq: p.seq,
        net: Interconnect {
            memory_gib: p.memory_gib,
            node_size: p.node_size,
            intra_gbps: p.intra_gbps,
            inter_gbps: p.inter_gbps,
            tflops: p.tflops,
        },
        top: p.top,
    })
}

fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.2} µs", s * 1e6)
    }
}

fn estimate_line(r: &planner::Ranked) -> String {
    let comm: Vec<String> = r
        .comm_secs
        .iter()
        .map(|(a, s)| format!("{} {}", a.name(), secs(*s)))
        .collect();
    format!(
        "estimated step {} (communication: {})",
        secs(r.step_secs),
        if comm.is_empty() {
            "none".to_string()
        } else {
            comm.join(", ")
        }
    )
}

fn fit_line(r: &planner::Ranked, net: &Interconnect) -> String {
    if r.over_bytes == 0 {
        format!("fits in {} GiB per device", net.memory_gib)
    } else {
        format!(
            "REFUSED: needs {} per rank, {} over the {} GiB per device",
            human(r.plan.peak_bytes() as f64),
            human(r.over_bytes as f64),
            net.memory_gib
        )
    }
}

fn run(a: &Args) -> Result<bool, String> {
    let mut model = Model::load(&a.model)?;
    if let Some(b) = a.batch {
        model.global_batch = b;
    }
    if let Some(s) = a.seq {
        model.seq_len = s;
    }
    if let Some(c) = a.composition {
        if a.devices != 0 && a.devices != c.world() {
            return Err(format!(
                "--mesh {c} has {} ranks, --devices says {}",
                c.world(),
                a.devices
            ));
        }
        let p = planner::plan(&model, &c)?;
        let r = planner::cost::estimate(&p, &a.net);
        print!("{}", p.report());
        println!("{}", estimate_line(&r));
        println!("{}", fit_line(&r, &a.net));
        return Ok(r.over_bytes == 0);
    }
    let ranked = planner::rank(&model, a.devices, &a.net);
    if ranked.is_empty() {
        return Err(format!(
            "no composition of {} devices runs {} (heads, vocab, ffn, layers and batch must divide)",
            a.devices, model.name
        ));
    }
    let fitting = ranked.iter().filter(|r| r.over_bytes == 0).count();
    println!(
        "{} compositions of {} devices considered, {fitting} fit in {} GiB; best by estimated step time:\n",
        ranked.len(),
        a.devices,
        a.net.memory_gib
    );
    let show: Vec<&planner::Ranked> = if fitting > 0 {
        ranked.iter().take(a.top.min(fitting)).collect()
    } else {
        println!("none fits: the closest (refused):\n");
        ranked.iter().take(a.top).collect()
    };
    for (i, r) in show.iter().enumerate() {
        println!("#{} {}", i + 1, r.plan.composition);
        print!("{}", r.plan.report());
        println!("{}", estimate_line(r));
        println!("{}\n", fit_line(r, &a.net));
    }
    Ok(fitting > 0)
}

fn main() -> ExitCode {
    // Clap exits 2 on a bad flag or value, naming it; the checks across flags do the same.
    let plan = match Cli::parse().command {
        Command::Plan(plan) => plan,
        Command::Data(args) => return data::run(args),
        Command::HfParity(args) => return hf::parity(args),
        Command::Generate(args) => return hf::generate(args),
        Command::HfExport(args) => return hf::export(args),
    };
    let a = match resolve(plan) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("dtensor plan: {e}");
            return ExitCode::from(2);
        }
    };
    match run(&a) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("dtensor plan: {e}");
            ExitCode::from(2)
        }
    }
}
