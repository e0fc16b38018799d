//! Draws a `train_gpt --metrics` file as a PNG: loss (top) and tokens/s (bottom) against
//! step. The text uses a font shipped with the examples, so no system fonts are needed.
//!
//! `cargo run --release --example plot_metrics -- metrics.jsonl metrics.png`

#[path = "support/metrics.rs"]
mod metrics;

use std::process::ExitCode;

const USAGE: &str = "usage: plot_metrics <metrics.jsonl> <out.png>

Reads the per-step lines that `train_gpt --metrics <file>` writes and draws loss and
tokens/s against step into a PNG (`train_gpt --plot <file>` draws the same directly).";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = match args.as_slice() {
        [a, b] if !a.starts_with('-') => [a, b],
        [h] if h == "--help" || h == "-h" => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        _ => {
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let run = || -> Result<(), String> {
        let text = std::fs::read_to_string(input).map_err(|e| format!("{input}: {e}"))?;
        let series = metrics::read_series(&text).map_err(|e| format!("{input}: {e}"))?;
        metrics::draw(&series, output.as_ref())?;
        println!("wrote {output} ({} steps)", series.len());
        Ok(())
    };
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
