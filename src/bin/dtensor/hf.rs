//! `dtensor hf-parity`, `dtensor generate` and `dtensor hf-export`: a Hugging Face
//! checkpoint on a mesh of thread ranks, and dtensor's checkpoints of one back into its
//! layout (see `docs/models.md`).

use dtensor::placement::{Composition, MasterDType};
use std::path::PathBuf;
use std::process::ExitCode;

/// `dtensor hf-parity`.
#[derive(clap::Args)]
pub struct ParityArgs {
    /// The model directory (config.json and its safetensors weights)
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// A JSON file {"input_ids": [[...], ...]}: samples of one length
    #[arg(long, value_name = "FILE")]
    ids: PathBuf,
    /// The composition (default one rank): degrees and switches as train_gpt's --mesh
    /// takes them (pp=2,m=2 gives no logits: the pipeline keeps them on its last stage)
    #[arg(long, value_name = "SPEC", default_value = "dp=1")]
    mesh: Composition,
    /// Parameters and compute: f64 (default; transformers' goldens come from
    /// `model.double()`) or f32
    #[arg(long, value_name = "f64|f32", default_value = "f64", value_parser = ["f64", "f32"])]
    dtype: String,
}

/// `dtensor generate`.
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// The model directory (config.json, safetensors weights, tokenizer.json)
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// The text to continue (encoded with the tokenizer's own special tokens, a BOS for
    /// a Llama tokenizer)
    #[arg(long, value_name = "TEXT")]
    prompt: String,
    /// Tokens to generate at most (generation stops early at the end-of-sequence token)
    #[arg(long, value_name = "N", default_value_t = 32)]
    max_new_tokens: usize,
    /// Softmax temperature; 0 (the default) is greedy
    #[arg(long, value_name = "T", default_value_t = 0.0)]
    temperature: f64,
    /// Keep only the K most likely tokens before drawing
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Keep the most likely tokens whose probabilities add up to P before drawing
    #[arg(long, value_name = "P", default_value_t = 1.0)]
    top_p: f64,
    /// Seed of the draws (the same on every rank)
    #[arg(long, value_name = "S", default_value_t = 0)]
    seed: u64,
    /// The composition: tensor parallelism only (tp=N), the heads and their KV cache split
    /// over it
    #[arg(long, value_name = "SPEC", default_value = "tp=1")]
    mesh: Composition,
    /// Parameters and compute: f32 (default) or f64
    #[arg(long, value_name = "f32|f64", default_value = "f32", value_parser = ["f32", "f64"])]
    dtype: String,
}

/// `dtensor hf-export`.
#[derive(clap::Args)]
pub struct ExportArgs {
    /// A dtensor checkpoint of a Hugging Face model (`train_gpt --init-from LIKE
    /// --save-dir CHECKPOINT`), written on any mesh
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// The Hugging Face directory the run started from: its config.json,
    /// generation_config.json and tokenizer files are copied
    #[arg(long, value_name = "DIR")]
    like: PathBuf,
    /// The Hugging Face directory to write
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

/// Writes the checkpoint in the Hugging Face layout.
pub fn export(a: ExportArgs) -> ExitCode {
    exit(
        "hf-export",
        dtensor::hf::export_checkpoint(&a.checkpoint, &a.like, &a.out).map(|()| {
            println!("wrote {}", a.out.display());
        }),
    )
}

fn with_dtype(mut c: Composition, dtype: &str) -> Composition {
    c.dtype = match dtype {
        "f64" => MasterDType::F64,
        _ => MasterDType::F32,
    };
    c
}

fn exit(what: &str, r: Result<(), String>) -> ExitCode {
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("dtensor {what}: {e}");
            ExitCode::from(2)
        }
    }
}

/// Prints the parity numbers as one JSON object.
pub fn parity(a: ParityArgs) -> ExitCode {
    exit(
        "hf-parity",
        (|| {
            let ids = dtensor::hf::read_ids(&a.ids)?;
            let p = dtensor::hf::parity_on_threads(&a.model, &ids, &with_dtype(a.mesh, &a.dtype))?;
            println!("{}", p.to_json());
            Ok(())
        })(),
    )
}

/// Prints the prompt's continuation, and the rate on stderr.
pub fn generate(a: GenerateArgs) -> ExitCode {
    exit(
        "generate",
        (|| {
            let tokenizer =
                dtensor::datasets::Tokenizer::from_dir(&a.model).map_err(|e| e.to_string())?;
            let prompt = tokenizer
                .encode(&a.prompt, true)
                .map_err(|e| e.to_string())?;
            let sampling = dtensor::nn::Sampling {
                temperature: a.temperature,
                top_k: a.top_k,
                top_p: a.top_p,
                seed: a.seed,
            };
            let stop: Vec<u32> = tokenizer.eos_id().into_iter().collect();
            let (tokens, secs) = dtensor::hf::generate_on_threads(
                &a.model,
                &prompt,
                a.max_new_tokens,
                &sampling,
                &stop,
                &with_dtype(a.mesh, &a.dtype),
            )?;
            let text = tokenizer.decode(&tokens, true).map_err(|e| e.to_string())?;
            println!("{}{text}", a.prompt);
            eprintln!(
                "{} tokens in {secs:.3} s ({:.1} tokens/s, prompt of {} tokens included)",
                tokens.len(),
                tokens.len() as f64 / secs.max(1e-9),
                prompt.len()
            );
            Ok(())
        })(),
    )
}
