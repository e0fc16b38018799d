//! `dtensor data prepare`: text files tokenized into Megatron-LM indexed datasets
//! (`OUT/<name>.bin` + `.idx`), with a progress bar on a terminal and plain lines
//! otherwise (see `docs/data.md`).

use clap::Subcommand;
use dtensor::datasets::prepare::{prepare, PrepareOptions, PrepareSummary, Progress};
use dtensor::datasets::Tokenizer;
use indicatif::{ProgressBar, ProgressStyle};
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `dtensor data …`.
#[derive(clap::Args)]
pub struct DataArgs {
    #[command(subcommand)]
    command: DataCommand,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Tokenize .txt files (one document each) and .jsonl files (one document per line)
    /// into Megatron-LM indexed datasets, DIR/<name>.bin + DIR/<name>.idx
    Prepare(PrepareArgs),
}

#[derive(clap::Args)]
struct PrepareArgs {
    /// A tokenizer.json (its tokenizer_config.json beside it names BOS/EOS), or a
    /// directory holding them
    #[arg(long, value_name = "FILE")]
    tokenizer: PathBuf,
    /// The text files: .txt (one document) or .jsonl (one JSON object per line)
    #[arg(long, value_name = "FILES", num_args = 1.., required = true)]
    input: Vec<PathBuf>,
    /// The folder the datasets are written to (made when missing)
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The key of the text in each .jsonl object
    #[arg(long, value_name = "KEY", default_value = "text")]
    text_key: String,
    /// End every document with the tokenizer's end-of-sequence token
    #[arg(long)]
    append_eos: bool,
}

fn load_tokenizer(path: &Path) -> dtensor::datasets::Result<Tokenizer> {
    if path.is_dir() {
        return Tokenizer::from_dir(path);
    }
    match (path.file_name(), path.parent()) {
        // `from_dir` also reads the special tokens' names from tokenizer_config.json.
        (Some(name), Some(dir)) if name == "tokenizer.json" => {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            Tokenizer::from_dir(dir)
        }
        _ => Tokenizer::from_file(path),
    }
}

/// Runs `dtensor data …`; failures print one line naming the file and exit 1.
pub fn run(args: DataArgs) -> ExitCode {
    let DataCommand::Prepare(a) = args.command;
    match prepare_command(&a) {
        Ok(s) => {
            println!(
                "prepared {} file(s) into {}: {} documents, {} tokens ({}) in {:.2} s, {:.0} tokens/s",
                s.files.len(),
                a.out.display(),
                s.documents,
                s.tokens,
                s.dtype,
                s.seconds,
                s.tokens as f64 / s.seconds.max(1e-9)
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("dtensor data prepare: {e}");
            ExitCode::from(1)
        }
    }
}

fn prepare_command(a: &PrepareArgs) -> dtensor::datasets::Result<PrepareSummary> {
    let tokenizer = load_tokenizer(&a.tokenizer)?;
    let options = PrepareOptions {
        text_key: a.text_key.clone(),
        append_eos: a.append_eos,
    };
    let bar = std::io::stderr().is_terminal().then(|| {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .expect("a valid template"),
        );
        bar
    });
    let mut report = |p: Progress<'_>| match p {
        Progress::Bytes { done, total } => {
            if let Some(bar) = &bar {
                bar.set_length(total);
                bar.set_position(done);
            }
        }
        Progress::FileDone(f) => {
            let line = format!(
                "{} -> {}.bin/.idx: {} documents, {} tokens, {:.2} s",
                f.input.display(),
                f.prefix.display(),
                f.written.documents,
                f.written.tokens,
                f.seconds
            );
            match &bar {
                Some(bar) => bar.suspend(|| println!("{line}")),
                None => println!("{line}"),
            }
        }
    };
    let summary = prepare(&tokenizer, &a.input, &a.out, &options, &mut report);
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    summary
}
