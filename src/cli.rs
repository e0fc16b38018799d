//! Command-line pieces shared by `train_gpt` and the `dtensor` binary: the flags that
//! describe a run's [`Composition`], defined once ([`CompositionArgs`], flattened into each
//! program's clap parser), and the check that an output path can be written before any
//! work starts ([`check_output_path`]).
//!
//! ```
//! use clap::Parser;
//! use dtensor::cli::CompositionArgs;
//!
//! #[derive(Parser)]
//! struct Cli {
//!     #[command(flatten)]
//!     run: CompositionArgs,
//! }
//! let cli = Cli::parse_from(["prog", "--mesh", "pp=2,dp=2", "--zero", "1", "--schedule", "zb"]);
//! let c = cli.run.composition("dp=1").unwrap();
//! assert_eq!(c.to_string(), "pp=2,dp=2,zero1,m=2,zb");
//! ```

use crate::placement::{Composition, CpStrategy, DataKind, MasterDType, ScheduleKind};
use std::path::{Path, PathBuf};

/// The flags that describe a run's [`Composition`]. `--mesh` takes the composition's whole
/// spec (`pp=2,dp=2,tp=2,sp,zero1,m=4`, see [`Composition`]'s `FromStr`); each other flag
/// sets one switch over it. [`CompositionArgs::composition`] resolves them into one value.
#[derive(clap::Args, Clone, Debug, Default, PartialEq)]
pub struct CompositionArgs {
    /// The composition: degrees pp=N,dp=N,ep=N,cp=N,tp=N (any subset), and
    /// optionally any switch below in spec form (sp, zero1, fsdp, m=4, interleaved, v=2, a2a,
    /// bf16, ...). ep shards the tokens like dp outside the experts and the experts inside
    /// MoE blocks (the batch must divide by dp·ep)
    #[arg(long, value_name = "SPEC")]
    pub mesh: Option<Composition>,
    /// Sequence parallelism: the residual stream is sharded over tp (needs tp > 1)
    #[arg(long)]
    pub sp: bool,
    /// FSDP (ZeRO-3): parameters sharded over dp, gathered for use
    #[arg(long, conflicts_with = "zero")]
    pub fsdp: bool,
    /// ZeRO-1 / ZeRO-2: optimizer state (and gradients) sharded over dp; 3 is --fsdp
    #[arg(long, value_name = "1|2|3", value_parser = parse_zero)]
    pub zero: Option<DataKind>,
    /// FSDP: keep gathered parameters until the backward (default: gather again)
    #[arg(long)]
    pub no_reshard: bool,
    /// Overlap communication with compute: DDP gradients all-reduced in buckets during the
    /// backward, FSDP's gathers prefetched one layer ahead (off by default: on thread ranks
    /// that fill every core it costs more than it hides)
    #[arg(long)]
    pub overlap: bool,
    /// Pipeline schedule: gpipe, 1f1b (default), interleaved, zb (ZB-H1)
    #[arg(long, value_name = "S", value_parser = parse_schedule)]
    pub schedule: Option<ScheduleKind>,
    /// Microbatches per step (default pp; must divide the batch per dp rank)
    #[arg(long, value_name = "M", value_parser = clap::value_parser!(u64).range(1..))]
    pub microbatches: Option<u64>,
    /// Interleaved schedule: model chunks per pp rank (default 2)
    #[arg(long = "virtual", value_name = "V", value_parser = clap::value_parser!(u64).range(1..))]
    pub virtual_stages: Option<u64>,
    /// Activation recomputation: each block's forward runs again in backward
    #[arg(long)]
    pub recompute: bool,
    /// Context parallelism (cp > 1): attention by `ring` (default: K/V passed round the cp
    /// ring, any head count) or `a2a` (all-to-all, Ulysses: the heads per tp rank must
    /// divide by cp)
    #[arg(long, value_name = "ring|a2a", value_parser = parse_cp)]
    pub cp_impl: Option<CpStrategy>,
    /// cp > 1: rank c holds chunk c of cp (default: chunks c and 2·cp−1−c of 2·cp, which
    /// balances the causal work)
    #[arg(long)]
    pub no_zigzag: bool,
    /// Mixed precision: bf16 parameters and activations in compute, f32 masters and
    /// optimizer state, gradients reduced in f32 (see --reduce-dtype)
    #[arg(long)]
    pub bf16: bool,
    /// With --bf16: f32 (default) or bf16 gradient reduction
    #[arg(long, value_name = "f32|bf16", value_parser = parse_reduce)]
    pub reduce_dtype: Option<bool>,
    /// Masters and optimizer state (and everything without --bf16): f32 (default) or f64
    #[arg(long, value_name = "f32|f64", value_parser = parse_dtype)]
    pub dtype: Option<MasterDType>,
}

fn parse_zero(s: &str) -> Result<DataKind, String> {
    match s {
        "1" => Ok(DataKind::Zero1),
        "2" => Ok(DataKind::Zero2),
        "3" => Ok(DataKind::Fsdp),
        _ => Err("expected 1, 2 or 3".into()),
    }
}

fn parse_schedule(s: &str) -> Result<ScheduleKind, String> {
    s.parse()
        .map_err(|_| "expected gpipe, 1f1b, interleaved or zb".into())
}

fn parse_cp(s: &str) -> Result<CpStrategy, String> {
    match s {
        "ring" => Ok(CpStrategy::Ring),
        "a2a" => Ok(CpStrategy::AllToAll),
        _ => Err("expected ring or a2a".into()),
    }
}

/// `--reduce-dtype`: whether the reduction runs in bf16.
fn parse_reduce(s: &str) -> Result<bool, String> {
    match s {
        "f32" => Ok(false),
        "bf16" => Ok(true),
        _ => Err("expected f32 or bf16".into()),
    }
}

fn parse_dtype(s: &str) -> Result<MasterDType, String> {
    match s {
        "f32" => Ok(MasterDType::F32),
        "f64" => Ok(MasterDType::F64),
        _ => Err("expected f32 or f64".into()),
    }
}

impl CompositionArgs {
    /// The composition: `--mesh` (or `default_mesh` without it), then each flag given set
    /// over it. A flag wins over the spec; `--microbatches` defaults to the spec's `m` (so to
    /// `pp`), `--virtual` to the spec's `v` under `interleaved` (so to 2). `Err` names the
    /// flag.
    pub fn composition(&self, default_mesh: &str) -> Result<Composition, String> {
        let mut c = match self.mesh {
            Some(c) => c,
            None => default_mesh
                .parse()
                .map_err(|e| format!("--mesh {default_mesh}: {e}"))?,
        };
        c.degrees.sp |= self.sp;
        if self.fsdp {
            c.data = DataKind::Fsdp;
        }
        if let Some(d) = self.zero {
            c.data = d;
        }
        c.reshard &= !self.no_reshard;
        c.overlap |= self.overlap;
        c.recompute |= self.recompute;
        c.zigzag &= !self.no_zigzag;
        if let Some(s) = self.cp_impl {
            c.cp_strategy = s;
        }
        if let Some(m) = self.microbatches {
            c.microbatches =
                usize::try_from(m).map_err(|_| format!("--microbatches {m}: too large"))?;
        }
        let was_interleaved = c.schedule == ScheduleKind::Interleaved1F1B;
        if let Some(s) = self.schedule {
            c.schedule = s;
        }
        c.virtual_stages = match (c.schedule, self.virtual_stages) {
            (ScheduleKind::Interleaved1F1B, Some(v)) => {
                usize::try_from(v).map_err(|_| format!("--virtual {v}: too large"))?
            }
            (ScheduleKind::Interleaved1F1B, None) if was_interleaved => c.virtual_stages,
            (ScheduleKind::Interleaved1F1B, None) => 2,
            // Only the interleaved schedule has chunks; the flag is ignored otherwise.
            _ => 1,
        };
        if let Some(t) = self.dtype {
            c.dtype = t;
        }
        c.bf16 |= self.bf16;
        if let Some(bf16) = self.reduce_dtype {
            // Without --bf16 every reduction runs in the master dtype: the flag has nothing
            // to change.
            c.reduce_bf16 = bf16 && c.bf16;
        }
        if c.degrees.sp && c.degrees.tp < 2 {
            return Err("--sp needs tensor parallelism (tp > 1)".into());
        }
        if c.bf16 && c.dtype != MasterDType::F32 {
            return Err("--bf16 keeps f32 masters: leave --dtype at f32".into());
        }
        c.validate().map_err(|e| format!("--mesh {c}: {e}"))?;
        Ok(c)
    }
}

/// What an output path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputKind {
    /// A file, created or replaced: its parent directory must exist and take a new file,
    /// and the path must not be a directory.
    File,
    /// A directory, created when missing (with its parents): it, or else its nearest
    /// existing ancestor, must be a directory that takes a new file.
    Dir,
}

/// Checks, before any work, that `path` (given to `flag`) can be written as `kind`, so a
/// run that would end unable to write its output fails at once instead of after
/// training. Tries for real: a probe file is created in the directory that will receive the
/// output and removed (an existing file is opened for appending, never truncated). Leaves
/// the file system as it found it. `Err` names the flag, the path and the reason.
pub fn check_output_path(flag: &str, path: &Path, kind: OutputKind) -> Result<(), String> {
    let fail = |why: String| Err(format!("{flag} {}: {why}", path.display()));
    if path.as_os_str().is_empty() {
        return fail("an empty path".into());
    }
    match kind {
        OutputKind::File => {
            if path.is_dir() {
                return fail("is a directory, not a file".into());
            }
            if path.exists() {
                return std::fs::OpenOptions::new()
                    .append(true)
                    .open(path)
                    .map(drop)
                    .or_else(|e| fail(format!("cannot be written ({e})")));
            }
            let parent = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            if !parent.is_dir() {
                return fail(format!("its directory {} does not exist", parent.display()));
            }
            probe(&parent).or_else(|e| fail(format!("cannot create a file there ({e})")))
        }
        OutputKind::Dir => {
            let mut dir = path;
            while !dir.exists() {
                match dir.parent() {
                    Some(p) if !p.as_os_str().is_empty() => dir = p,
                    _ => {
                        dir = Path::new(".");
                        break;
                    }
                }
            }
            if !dir.is_dir() {
                return fail(format!("{} is not a directory", dir.display()));
            }
            probe(dir).or_else(|e| fail(format!("cannot write in {} ({e})", dir.display())))
        }
    }
}

/// Creates and removes a uniquely named file in `dir`. The name carries the process id, the
/// clock and a counter; processes on different machines sharing `dir` (MPI ranks with the
/// same pid on two nodes) may still pick one name, so a name that exists is retried.
fn probe(dir: &Path) -> std::io::Result<()> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut last = None;
    for _ in 0..16 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let name = format!(
            ".dtensor-probe-{}-{nanos:x}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let p = dir.join(name);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&p)
        {
            Ok(_) => return std::fs::remove_file(&p),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
            Err(e) => return Err(e),
        }
    }
    Err(last.expect("the loop ran"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: CompositionArgs,
    }

    fn comp(args: &[&str]) -> Result<Composition, String> {
        let cli = Cli::try_parse_from(std::iter::once("prog").chain(args.iter().copied()))
            .map_err(|e| e.to_string())?;
        cli.run.composition("dp=2,tp=2")
    }

    #[test]
    fn composition_flags_set_switches_over_the_spec() {
        assert_eq!(comp(&[]).unwrap().to_string(), "dp=2,tp=2");
        let c = comp(&[
            "--mesh",
            "pp=2,dp=2,tp=2",
            "--sp",
            "--fsdp",
            "--schedule",
            "1f1b",
            "--microbatches",
            "4",
        ])
        .unwrap();
        assert_eq!(c.to_string(), "pp=2,dp=2,tp=2,sp,fsdp,m=4,1f1b");
        let c = comp(&[
            "--mesh",
            "pp=2",
            "--schedule",
            "interleaved",
            "--virtual",
            "3",
        ])
        .unwrap();
        assert_eq!((c.virtual_stages, c.microbatches), (3, 2));
        let c = comp(&["--mesh", "pp=2,interleaved,v=4"]).unwrap();
        assert_eq!(c.virtual_stages, 4);
        let c = comp(&["--mesh", "pp=2", "--virtual", "3"]).unwrap();
        assert_eq!(
            c.virtual_stages, 1,
            "--virtual counts for the interleaved schedule only"
        );
        let c = comp(&[
            "--bf16",
            "--reduce-dtype",
            "bf16",
            "--cp-impl",
            "a2a",
            "--no-zigzag",
            "--zero",
            "2",
        ])
        .unwrap();
        assert!(c.bf16 && c.reduce_bf16 && !c.zigzag && c.data == DataKind::Zero2);
        assert_eq!(c.cp_strategy, CpStrategy::AllToAll);
        assert!(!comp(&["--reduce-dtype", "bf16"]).unwrap().reduce_bf16);
    }

    #[test]
    fn composition_flag_errors_name_the_flag() {
        for (args, want) in [
            (&["--schedule", "2f2b"][..], "--schedule"),
            (&["--zero", "4"], "--zero"),
            (&["--microbatches", "0"], "--microbatches"),
            (&["--mesh", "dp=2,warp"], "--mesh"),
            (&["--mesh", "dp=2", "--sp"], "--sp"),
            (&["--dtype", "f64", "--bf16"], "--dtype"),
            (&["--fsdp", "--zero", "1"], "--zero"),
        ] {
            let e = comp(args).unwrap_err();
            assert!(e.contains(want), "{args:?}: {e}");
        }
    }

    #[test]
    fn output_paths_that_cannot_be_written_are_refused() {
        let dir = std::env::temp_dir().join(format!("dtensor-cli-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("out.json");
        assert!(check_output_path("--trace", &file, OutputKind::File).is_ok());
        assert!(!file.exists(), "the check leaves nothing behind");
        let e = check_output_path("--trace", &dir, OutputKind::File).unwrap_err();
        assert!(e.contains("--trace") && e.contains("is a directory"), "{e}");
        let e = check_output_path("--metrics", &dir.join("no/such/m.jsonl"), OutputKind::File)
            .unwrap_err();
        assert!(
            e.contains("--metrics") && e.contains("does not exist"),
            "{e}"
        );
        std::fs::write(&file, "kept").unwrap();
        assert!(check_output_path("--plot", &file, OutputKind::File).is_ok());
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "kept");
        // A directory to be made under an existing one is fine; under a file it is not.
        assert!(check_output_path("--save-dir", &dir.join("a/b"), OutputKind::Dir).is_ok());
        assert!(!dir.join("a").exists());
        let e = check_output_path("--save-dir", &file.join("ckpt"), OutputKind::Dir).unwrap_err();
        assert!(
            e.contains("--save-dir") && e.contains("not a directory"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
