//! Text files into indexed datasets: what `dtensor data prepare` runs.
//!
//! Each input becomes `OUT/<file stem>.bin` + `.idx` (see [`crate::indexed`]), one document
//! per `.txt` file or per line of a `.jsonl` file (the string under the text key; blank
//! lines are skipped), each document one sequence. Token ids are stored as u16 when the
//! tokenizer's vocabulary has fewer than 65 500 ids, as i32 otherwise. Encoding adds the
//! tokenizer's own special tokens (a Llama 3 tokenizer's `<|begin_of_text|>`; nothing for
//! GPT-2), as transformers' `tokenizer(text)` does; `append_eos` ends every document with
//! the end-of-sequence token, which Megatron-LM's `preprocess_data.py --append-eod` does
//! and a model trained on packed documents needs to tell where one stops.

use crate::indexed::{paths, BuildSummary, Element, IndexedDatasetBuilder, TokenDType};
use crate::{Error, Result, Tokenizer};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How [`prepare`] reads and encodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PrepareOptions {
    /// The key of a `.jsonl` object that holds the text.
    pub text_key: String,
    /// End each document with the tokenizer's end-of-sequence token.
    pub append_eos: bool,
}

impl Default for PrepareOptions {
    fn default() -> Self {
        PrepareOptions {
            text_key: "text".into(),
            append_eos: false,
        }
    }
}

/// What [`prepare`] reports while it works.
#[derive(Clone, Debug, PartialEq)]
pub enum Progress<'a> {
    /// Input bytes read so far, of all inputs together, after each document.
    Bytes {
        /// Bytes read.
        done: u64,
        /// Bytes of all inputs.
        total: u64,
    },
    /// An input is finished.
    FileDone(&'a PreparedFile),
}

/// One input and the dataset it became.
#[derive(Clone, Debug, PartialEq)]
pub struct PreparedFile {
    /// The input.
    pub input: PathBuf,
    /// The dataset's prefix (`OUT/<stem>`).
    pub prefix: PathBuf,
    /// Documents, sequences and tokens written.
    pub written: BuildSummary,
    /// Seconds it took.
    pub seconds: f64,
}

/// What [`prepare`] made.
#[derive(Clone, Debug, PartialEq)]
pub struct PrepareSummary {
    /// One entry per input, in order.
    pub files: Vec<PreparedFile>,
    /// The element type of every dataset.
    pub dtype: TokenDType,
    /// Documents in all.
    pub documents: u64,
    /// Tokens in all.
    pub tokens: u64,
    /// Input bytes in all.
    pub bytes: u64,
    /// Seconds in all.
    pub seconds: f64,
}

fn input_err(file: &Path, detail: impl std::fmt::Display) -> Error {
    Error::Input {
        file: file.to_path_buf(),
        detail: detail.to_string(),
    }
}

fn io_err(file: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io {
        file: file.to_path_buf(),
        detail: e.to_string(),
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Text,
    JsonLines,
}

/// Tokenizes `inputs` (`.txt` or `.jsonl`) into one indexed dataset each under `out_dir`
/// (made when missing), calling `progress` as it goes. Every input is checked (extension,
/// readable, stems distinct) before anything is written.
pub fn prepare(
    tokenizer: &Tokenizer,
    inputs: &[PathBuf],
    out_dir: &Path,
    options: &PrepareOptions,
    progress: &mut dyn FnMut(Progress<'_>),
) -> Result<PrepareSummary> {
    let start = Instant::now();
    let Some(first) = inputs.first() else {
        return Err(input_err(out_dir, "no input files"));
    };
    let eos = match (options.append_eos, tokenizer.eos_id()) {
        (false, _) => None,
        (true, Some(id)) => Some(id),
        (true, None) => {
            return Err(input_err(
                first,
                "append_eos: the tokenizer names no end-of-sequence token (eos_token in its \
                 tokenizer_config.json)",
            ))
        }
    };
    let mut plan: Vec<(PathBuf, PathBuf, Kind)> = Vec::with_capacity(inputs.len());
    let mut total = 0u64;
    for input in inputs {
        let kind = match input.extension().and_then(|e| e.to_str()) {
            Some("txt") => Kind::Text,
            Some("jsonl") => Kind::JsonLines,
            _ => {
                return Err(input_err(
                    input,
                    "unknown extension: .txt (one document) or .jsonl (one per line)",
                ))
            }
        };
        let stem = input
            .file_stem()
            .ok_or_else(|| input_err(input, "no file name"))?;
        let prefix = out_dir.join(stem);
        if let Some((other, _, _)) = plan.iter().find(|(_, p, _)| *p == prefix) {
            return Err(input_err(
                input,
                format!(
                    "{} has the same name and would overwrite {}",
                    other.display(),
                    paths(&prefix).0.display()
                ),
            ));
        }
        total += std::fs::metadata(input)
            .map_err(|e| io_err(input, e))?
            .len();
        plan.push((input.clone(), prefix, kind));
    }
    std::fs::create_dir_all(out_dir).map_err(|e| io_err(out_dir, e))?;
    let dtype = TokenDType::for_vocab(tokenizer.vocab_size());
    let mut files = Vec::with_capacity(plan.len());
    let mut done = 0u64;
    for (input, prefix, kind) in plan {
        let t = Instant::now();
        let mut job = Job {
            tokenizer,
            eos,
            input: &input,
            kind,
            text_key: &options.text_key,
            done: &mut done,
            total,
            progress,
        };
        let written = match dtype {
            TokenDType::U16 => job.run::<u16>(&prefix)?,
            _ => job.run::<i32>(&prefix)?,
        };
        files.push(PreparedFile {
            input,
            prefix,
            written,
            seconds: t.elapsed().as_secs_f64(),
        });
        progress(Progress::FileDone(files.last().expect("just pushed")));
    }
    Ok(PrepareSummary {
        dtype,
        documents: files.iter().map(|f| f.written.documents).sum(),
        tokens: files.iter().map(|f| f.written.tokens).sum(),
        bytes: total,
        seconds: start.elapsed().as_secs_f64(),
        files,
    })
}

struct Job<'a, 'p> {
    tokenizer: &'a Tokenizer,
    eos: Option<u32>,
    input: &'a Path,
    kind: Kind,
    text_key: &'a str,
    done: &'a mut u64,
    total: u64,
    progress: &'a mut dyn FnMut(Progress<'p>),
}

impl Job<'_, '_> {
    fn run<T: Element>(&mut self, prefix: &Path) -> Result<BuildSummary> {
        let mut builder = IndexedDatasetBuilder::<T>::create(prefix)?;
        let mut tokens: Vec<T> = Vec::new();
        match self.kind {
            Kind::Text => {
                let bytes = std::fs::read(self.input).map_err(|e| io_err(self.input, e))?;
                let text = std::str::from_utf8(&bytes)
                    .map_err(|e| input_err(self.input, format!("not UTF-8: {e}")))?;
                self.document::<T>(text, &mut tokens, "")?;
                builder.add_document(&tokens)?;
                self.advance(bytes.len() as u64);
            }
            Kind::JsonLines => {
                let f = std::fs::File::open(self.input).map_err(|e| io_err(self.input, e))?;
                let mut reader = std::io::BufReader::with_capacity(1 << 20, f);
                let mut line = String::new();
                for number in 1.. {
                    line.clear();
                    let n = reader
                        .read_line(&mut line)
                        .map_err(|e| input_err(self.input, format!("line {number}: {e}")))?;
                    if n == 0 {
                        break;
                    }
                    if !line.trim().is_empty() {
                        let text = self.text_of(&line, number)?;
                        self.document::<T>(&text, &mut tokens, &format!("line {number}: "))?;
                        builder.add_document(&tokens)?;
                    }
                    self.advance(n as u64);
                }
            }
        }
        builder.finish()
    }

    fn text_of(&self, line: &str, number: usize) -> Result<String> {
        let value: serde_json::Value = serde_json::from_str(line)
            .map_err(|e| input_err(self.input, format!("line {number}: not JSON: {e}")))?;
        match value.get(self.text_key) {
            Some(serde_json::Value::String(s)) => Ok(s.clone()),
            Some(other) => Err(input_err(
                self.input,
                format!(
                    "line {number}: \"{}\" holds {}, not a string",
                    self.text_key,
                    kind_of(other)
                ),
            )),
            None => Err(input_err(
                self.input,
                format!(
                    "line {number}: no \"{}\" key (choose the key with --text-key)",
                    self.text_key
                ),
            )),
        }
    }

    fn document<T: Element>(&self, text: &str, out: &mut Vec<T>, at: &str) -> Result<()> {
        out.clear();
        let ids = self.tokenizer.encode(text, true)?;
        for id in ids.into_iter().chain(self.eos) {
            out.push(T::from_token(id).ok_or_else(|| {
                input_err(
                    self.input,
                    format!("{at}token id {id} does not fit the dataset's {}", T::DTYPE),
                )
            })?);
        }
        Ok(())
    }

    fn advance(&mut self, bytes: u64) {
        *self.done += bytes;
        (self.progress)(Progress::Bytes {
            done: *self.done,
            total: self.total,
        });
    }
}

fn kind_of(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}
