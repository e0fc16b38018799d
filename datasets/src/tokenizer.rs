//! Tokenizers: a Hugging Face `tokenizer.json` (with its special tokens) through the
//! `tokenizers` crate, and training a byte-level BPE on a corpus with the same crate.
//!
//! Whether encoding adds a beginning-of-sequence token is the tokenizer's own post-processor
//! (a Llama 3 `tokenizer.json` prepends `<|begin_of_text|>`; a GPT-2 one adds nothing), as
//! in transformers: [`Tokenizer::encode`] with `add_special_tokens` does what
//! `tokenizer(text)` does there. The names of the BOS and EOS tokens come from
//! `tokenizer_config.json` (`bos_token`, `eos_token`) when the directory has one, and
//! from the trainer's settings for a tokenizer trained here.

use crate::{Error, Result};
use std::path::{Path, PathBuf};
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::AddedToken;

/// A tokenizer with its special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    /// Where it was read from (errors name it).
    source: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("source", &self.source)
            .field("vocab_size", &self.vocab_size())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn err(file: &Path, detail: impl std::fmt::Display) -> Error {
    Error::Tokenizer {
        file: file.to_path_buf(),
        detail: detail.to_string(),
    }
}

/// How [`Tokenizer::train_bpe`] builds a byte-level BPE.
#[derive(Clone, Debug, PartialEq)]
pub struct BpeSettings {
    /// The vocabulary size, special tokens included (at least 256 + specials: every byte
    /// is a token of its own).
    pub vocab_size: usize,
    /// Pairs seen fewer times than this are not merged.
    pub min_frequency: u64,
    /// The beginning-of-sequence token, prepended by encoding with special tokens (Llama
    /// 3 style), or `None` (GPT-2 style).
    pub bos: Option<String>,
    /// The end-of-sequence (end of document) token.
    pub eos: String,
}

impl Default for BpeSettings {
    fn default() -> Self {
        BpeSettings {
            vocab_size: 1024,
            min_frequency: 2,
            bos: Some("<|begin_of_text|>".into()),
            eos: "<|end_of_text|>".into(),
        }
    }
}

impl Tokenizer {
    /// Reads `dir/tokenizer.json`, and the BOS/EOS token names from
    /// `dir/tokenizer_config.json` when present.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer> {
        let mut t = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
        let config = dir.join("tokenizer_config.json");
        if config.exists() {
            let text = std::fs::read_to_string(&config).map_err(|e| err(&config, e))?;
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| err(&config, format!("not JSON: {e}")))?;
            t.bos = t.special(&config, &v, "bos_token")?.or(t.bos);
            t.eos = t.special(&config, &v, "eos_token")?.or(t.eos);
        }
        Ok(t)
    }

    /// Reads a `tokenizer.json`; no BOS/EOS is known until [`from_dir`](Self::from_dir)
    /// reads them or [`with_specials`](Self::with_specials) names them.
    pub fn from_file(file: &Path) -> Result<Tokenizer> {
        let inner = tokenizers::Tokenizer::from_file(file).map_err(|e| err(file, e))?;
        Ok(Tokenizer {
            inner,
            bos: None,
            eos: None,
            source: file.to_path_buf(),
        })
    }

    /// Names the BOS and EOS tokens; `Err` if one is not in the vocabulary.
    pub fn with_specials(mut self, bos: Option<&str>, eos: Option<&str>) -> Result<Tokenizer> {
        let id = |name: &str| {
            self.inner.token_to_id(name).ok_or_else(|| {
                err(
                    &self.source,
                    format!("special token {name:?} is not in the vocabulary"),
                )
            })
        };
        let bos = bos.map(id).transpose()?;
        let eos = eos.map(id).transpose()?;
        self.bos = bos;
        self.eos = eos;
        Ok(self)
    }

    /// The id of the special token `field` of `tokenizer_config.json` names (a string,
    /// or an object with its `content`), `None` when the field is absent or null.
    fn special(&self, file: &Path, v: &serde_json::Value, field: &str) -> Result<Option<u32>> {
        let name = match v.get(field) {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.as_str(),
            Some(o) => o.get("content").and_then(|c| c.as_str()).ok_or_else(|| {
                err(
                    file,
                    format!("{field} is neither a string nor {{\"content\": …}}"),
                )
            })?,
        };
        self.inner.token_to_id(name).map(Some).ok_or_else(|| {
            err(
                file,
                format!(
                    "{field} {name:?} is not in the vocabulary of {}",
                    self.source.display()
                ),
            )
        })
    }

    /// Trains a byte-level BPE (GPT-2's pre-tokenizer; every byte a token, so any text
    /// encodes) on the text `files`, with the special tokens of `settings`.
    pub fn train_bpe(files: &[PathBuf], settings: &BpeSettings) -> Result<Tokenizer> {
        let here = files.first().cloned().unwrap_or_default();
        let specials: Vec<String> = settings
            .bos
            .iter()
            .chain([&settings.eos])
            .cloned()
            .collect();
        let floor = ByteLevel::alphabet().len() + specials.len();
        if settings.vocab_size < floor {
            return Err(err(
                &here,
                format!(
                    "vocab_size {} is below the {floor} tokens every byte and special token need",
                    settings.vocab_size
                ),
            ));
        }
        let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
            .vocab_size(settings.vocab_size)
            .min_frequency(settings.min_frequency)
            .show_progress(false)
            .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
            .special_tokens(
                specials
                    .iter()
                    .map(|s| AddedToken::from(s.clone(), true))
                    .collect(),
            )
            .build()
            .into();
        let byte_level = ByteLevel::default()
            .add_prefix_space(false)
            .trim_offsets(false);
        let mut tok = tokenizers::Tokenizer::new(BPE::default());
        tok.with_pre_tokenizer(Some(byte_level));
        tok.with_decoder(Some(byte_level));
        let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
        tok.train_from_files(&mut trainer, names)
            .map_err(|e| err(&here, e))?;
        if let Some(bos) = &settings.bos {
            let id = tok
                .token_to_id(bos)
                .ok_or_else(|| err(&here, format!("{bos:?} missing after training")))?;
            let template = TemplateProcessing::builder()
                .try_single(format!("{bos} $A"))
                .and_then(|b| b.try_pair(format!("{bos} $A {bos} $B")))
                .map_err(|e| err(&here, e))?
                .special_tokens(vec![(bos.clone(), id)])
                .build()
                .map_err(|e| err(&here, e))?;
            tok.with_post_processor(Some(template));
        }
        let bos = settings.bos.as_deref();
        Tokenizer {
            inner: tok,
            bos: None,
            eos: None,
            source: here.clone(),
        }
        .with_specials(bos, Some(&settings.eos))
    }

    /// Writes the tokenizer as a `tokenizer.json` any Hugging Face tokenizer reads.
    pub fn save(&self, file: &Path) -> Result<()> {
        self.inner.save(file, true).map_err(|e| err(file, e))
    }

    /// The token ids of `text`; with `add_special_tokens`, what the tokenizer's
    /// post-processor adds (a BOS for Llama-style tokenizers), as transformers'
    /// `tokenizer(text)` does.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| err(&self.source, e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// The text of `ids`, special tokens left out when `skip_special_tokens`.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| err(&self.source, e))
    }

    /// Tokens in the vocabulary, added (special) tokens included: the embedding needs at
    /// least this many rows.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The beginning-of-sequence token, when known.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token, when known.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// The id of a token, `None` when it is not in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}
