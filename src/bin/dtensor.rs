//! `dtensor plan`: per-rank memory, bytes per mesh axis and the pipeline bubble of a GPT
//! composition as dtensor-nn runs it, or the best compositions for a number of devices
//! (see `docs/planner.md`).
//!
//! `cargo run --release --bin dtensor -- plan --model 7b --devices 64 --memory-gib 131`
//! `cargo run --release --bin dtensor -- plan --model gpt-small --devices 4 --mesh dp=2,tp=2,sp`
use dtensor::planner::{self, human, Composition, Interconnect, Model};
use std::process::ExitCode;

const USAGE: &str = "\
usage: dtensor plan --model <preset|file.json> --devices <n> [flags]
  --model <m>        a preset (gpt-small, 7b, 70b, moe-8x7b) or a JSON model file
  --devices <n>      ranks (with --mesh: must equal the mesh's world size)
  --mesh <spec>      one composition: pp=,dp=,ep=,cp=,tp= and flags sp, zero1, zero2, fsdp,
                     no-reshard, recompute, m=<microbatches>, gpipe|1f1b|interleaved|zb,
                     v=<chunks>, ring|a2a, bf16, reduce-bf16 (default: search and rank)
  --memory-gib <g>   memory per device (default 131, an H200); compositions over it are
                     refused, saying by how much
  --batch <n>        override the model's global batch (sequences per step)
  --seq <n>          override the model's sequence length
  --node-size <n>    devices per node (default 8)
  --intra-gbps <x>   per-rank bandwidth inside a node, GB/s (default 900)
  --inter-gbps <x>   per-rank bandwidth across nodes, GB/s (default 50)
  --tflops <x>       sustained TFLOP/s per device (default 400)
  --top <k>          compositions to print when searching (default 5)";

struct Args {
    model: String,
    devices: usize,
    mesh: Option<String>,
    batch: Option<usize>,
    seq: Option<usize>,
    net: Interconnect,
    top: usize,
}

fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
    match it.next().as_deref() {
        Some("plan") => {}
        Some("--help") | Some("-h") | None => return Err(USAGE.into()),
        Some(other) => return Err(format!("unknown command `{other}`\n{USAGE}")),
    }
    let mut a = Args {
        model: String::new(),
        devices: 0,
        mesh: None,
        batch: None,
        seq: None,
        net: Interconnect::default(),
        top: 5,
    };
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err(USAGE.into());
        }
        let v = it
            .next()
            .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("{flag}: `{v}` is not a valid number"))
        }
        match flag.as_str() {
            "--model" => a.model = v,
            "--devices" => a.devices = num(&flag, &v)?,
            "--mesh" => a.mesh = Some(v),
            "--memory-gib" => a.net.memory_gib = num(&flag, &v)?,
            "--batch" => a.batch = Some(num(&flag, &v)?),
            "--seq" => a.seq = Some(num(&flag, &v)?),
            "--node-size" => a.net.node_size = num(&flag, &v)?,
            "--intra-gbps" => a.net.intra_gbps = num(&flag, &v)?,
            "--inter-gbps" => a.net.inter_gbps = num(&flag, &v)?,
            "--tflops" => a.net.tflops = num(&flag, &v)?,
            "--top" => a.top = num(&flag, &v)?,
            _ => return Err(format!("unknown flag `{flag}`\n{USAGE}")),
        }
    }
    if a.model.is_empty() {
        return Err(format!("--model is required\n{USAGE}"));
    }
    if a.devices == 0 && a.mesh.is_none() {
        return Err(format!("--devices is required\n{USAGE}"));
    }
    if a.net.node_size == 0 || a.net.intra_gbps <= 0.0 || a.net.inter_gbps <= 0.0 {
        return Err("--node-size, --intra-gbps and --inter-gbps must be positive".into());
    }
    Ok(a)
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
    if let Some(spec) = &a.mesh {
        let c: Composition = spec.parse()?;
        if a.devices != 0 && a.devices != c.world() {
            return Err(format!(
                "--mesh {spec} has {} ranks, --devices says {}",
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
    let a = match parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
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
