//! Training samples from indexed datasets: packing, a validation split, blends, and the
//! sampler that deals samples to the data ranks.
//!
//! - [`Split`]: a held-out validation set of whole documents (a fraction or a count), chosen
//!   by the seed; the two sets are disjoint and together every document.
//! - [`PackedDataset`]: the documents of one split, in an order shuffled once by the seed,
//!   read as one stream of tokens cut into samples of `seq_len + 1` tokens (inputs and the
//!   targets shifted by one; sample `i` starts at token `i · seq_len`, so consecutive
//!   samples share one token, as in Megatron-LM's GPT dataset). With
//!   [`Packing::DocumentMasks`] each token also carries its segment id (which document of
//!   the sample it belongs to, from 0) and its position id (restarting at 0 where a
//!   document starts, and at the sample's first token), what a document mask and RoPE
//!   need to keep packed documents apart; [`Packing::Plain`] gives tokens alone.
//! - [`Blend`]: several datasets mixed by weight (normalised), sample by sample, the way
//!   Megatron-LM's `BlendedDataset` does: sample `i` goes to the dataset furthest behind
//!   its share, so after any `n` samples every dataset has its share of `n` within one
//!   sample.
//! - [`Sampler`]: a permutation of the sample indices per epoch (a function of the seed and
//!   the epoch), dealt round-robin to `world` data ranks: rank `r` takes positions `r`,
//!   `r + world`, … of the order. Ranks see disjoint samples; an epoch is the order's first
//!   `samples − samples mod world` positions, every rank the same count, and the samples
//!   left over differ each epoch. Its [`SamplerState`] (seed, sample count, epoch, samples
//!   consumed by all ranks) serializes with serde, so a checkpoint stores it and
//!   [`Sampler::resume`] continues where the run stopped, bit for bit; the state does not
//!   depend on the world size, so a run may resume on another number of data ranks.
//!
//! The data ranks are the ranks that see different tokens: `rank` and `world` count the
//! product of the axes that shard the batch (`Dp`, and `Ep` where experts shard tokens
//! like `Dp` outside the MoE blocks). Ranks of a context-parallel group take the same
//! samples and each keeps its own chunk of the sequence.

use crate::indexed::{read_header, IndexedDataset, TokenDType};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

fn loader_err(detail: impl std::fmt::Display) -> Error {
    Error::Loader {
        detail: detail.to_string(),
    }
}

/// SplitMix64: a seeded stream of 64-bit words, the same on every platform, so every rank
/// derives the same order from the same seed with nothing exchanged.
#[derive(Clone, Debug)]
struct Stream(u64);

impl Stream {
    fn new(seed: u64, purpose: u64) -> Stream {
        Stream(mix(seed ^ mix(purpose)))
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// A value below `n` (multiply-high: the bias is at most n / 2⁶⁴).
    fn below(&mut self, n: u64) -> u64 {
        ((self.next() as u128 * n as u128) >> 64) as u64
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

// What each seeded stream is for: one seed gives unrelated orders to each use.
const SPLIT_STREAM: u64 = 1;
const PACK_STREAM: u64 = 2;
const EPOCH_STREAM: u64 = 3;

/// A random permutation of `0..n` evaluated at one point at a time, in O(1) memory: a
/// four-round Feistel network over the smallest even power of two ≥ n, walked until the
/// value falls below n (a permutation of the larger domain restricted this way is a
/// permutation of `0..n`; fewer than four steps on average). The sampler's order for an
/// epoch of a billion samples thus costs nothing to build or to resume into.
#[derive(Clone, Copy, Debug)]
struct Permutation {
    n: u64,
    half_bits: u32,
    keys: [u64; 4],
}

impl Permutation {
    fn new(n: u64, seed: u64, epoch: u64) -> Permutation {
        let bits = (64 - n.saturating_sub(1).leading_zeros()).max(2);
        let half_bits = bits.div_ceil(2);
        let mut s = Stream::new(seed ^ mix(epoch), EPOCH_STREAM);
        Permutation {
            n,
            half_bits,
            keys: [s.next(), s.next(), s.next(), s.next()],
        }
    }

    fn apply(&self, i: u64) -> u64 {
        debug_assert!(i < self.n);
        let mask = (1u64 << self.half_bits) - 1;
        let mut x = i;
        loop {
            let (mut l, mut r) = (x >> self.half_bits, x & mask);
            for k in self.keys {
                let f = mix(r ^ k) & mask;
                (l, r) = (r, l ^ f);
            }
            x = (l << self.half_bits) | r;
            if x < self.n {
                return x;
            }
        }
    }
}

/// How many documents [`Split::new`] holds out for validation.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub enum Holdout {
    /// None: every document trains.
    None,
    /// This fraction of the documents, rounded up (in `[0, 1)`).
    Fraction(f64),
    /// This many documents.
    Count(u64),
}

/// Document ids of a dataset cut into training and validation, deterministically from a
/// seed: the same seed gives the same split on every rank and every run. Both lists are
/// sorted, disjoint, and together `0..documents`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
    /// Documents to train on.
    pub train: Vec<u64>,
    /// Documents held out.
    pub validation: Vec<u64>,
}

impl Split {
    /// Holds out `holdout` of `documents` documents, chosen by `seed`. At least one
    /// document must remain to train on.
    pub fn new(documents: u64, holdout: Holdout, seed: u64) -> Result<Split> {
        let held = match holdout {
            Holdout::None => 0,
            Holdout::Fraction(f) => {
                if !(0.0..1.0).contains(&f) {
                    return Err(loader_err(format!(
                        "validation fraction {f}: it must lie in [0, 1)"
                    )));
                }
                (f * documents as f64).ceil() as u64
            }
            Holdout::Count(c) => c,
        };
        if held >= documents {
            return Err(loader_err(format!(
                "holding out {held} of {documents} documents leaves none to train on"
            )));
        }
        let mut ids: Vec<u64> = (0..documents).collect();
        Stream::new(seed, SPLIT_STREAM).shuffle(&mut ids);
        let mut validation = ids[..held as usize].to_vec();
        let mut train = ids[held as usize..].to_vec();
        validation.sort_unstable();
        train.sort_unstable();
        Ok(Split { train, validation })
    }
}

/// Whether samples carry segment and position ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Packing {
    /// Tokens only: attention runs across document boundaries inside a sample.
    Plain,
    /// Tokens with per-token segment ids (document within the sample) and position ids
    /// (restarting per document), for a document mask.
    DocumentMasks,
}

/// Samples, concatenated: `samples.len()` rows of `seq_len + 1` values each. Input `t` of a
/// row is `tokens[t]` and its target `tokens[t + 1]`; `segment_ids` and `position_ids` are
/// empty under [`Packing::Plain`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Batch {
    /// The sample indices, one per row (in the dataset that made them).
    pub samples: Vec<u64>,
    /// Token ids, `seq_len + 1` per row.
    pub tokens: Vec<u32>,
    /// Per token, the index of its document within the row (from 0).
    pub segment_ids: Vec<u32>,
    /// Per token, its position within its document, counted from the row's start for the
    /// document the row starts inside.
    pub position_ids: Vec<u32>,
}

impl Batch {
    fn clear(&mut self) {
        self.samples.clear();
        self.tokens.clear();
        self.segment_ids.clear();
        self.position_ids.clear();
    }
}

/// Anything that makes samples by index: a [`PackedDataset`] or a [`Blend`].
pub trait SampleSource {
    /// Samples (one epoch).
    fn len_samples(&self) -> u64;
    /// Tokens per sample, less the one shifted target: rows hold `seq_len + 1`.
    fn seq_len(&self) -> usize;
    /// Whether rows carry ids.
    fn packing(&self) -> Packing;
    /// Appends sample `i` (below [`len_samples`](Self::len_samples)) as one row of `out`.
    fn sample_into(&self, i: u64, out: &mut Batch) -> Result<()>;
}

/// An indexed dataset of any integer element type, picked from its header.
#[derive(Debug)]
enum TokenFile {
    U8(IndexedDataset<u8>),
    I8(IndexedDataset<i8>),
    I16(IndexedDataset<i16>),
    I32(IndexedDataset<i32>),
    I64(IndexedDataset<i64>),
    U16(IndexedDataset<u16>),
}

macro_rules! each_file {
    ($f:expr, $d:ident => $body:expr) => {
        match $f {
            TokenFile::U8($d) => $body,
            TokenFile::I8($d) => $body,
            TokenFile::I16($d) => $body,
            TokenFile::I32($d) => $body,
            TokenFile::I64($d) => $body,
            TokenFile::U16($d) => $body,
        }
    };
}

impl TokenFile {
    fn open(prefix: &Path) -> Result<TokenFile> {
        let header = read_header(prefix)?;
        Ok(match header.dtype {
            TokenDType::U8 => TokenFile::U8(IndexedDataset::open(prefix)?),
            TokenDType::I8 => TokenFile::I8(IndexedDataset::open(prefix)?),
            TokenDType::I16 => TokenFile::I16(IndexedDataset::open(prefix)?),
            TokenDType::I32 => TokenFile::I32(IndexedDataset::open(prefix)?),
            TokenDType::I64 => TokenFile::I64(IndexedDataset::open(prefix)?),
            TokenDType::U16 => TokenFile::U16(IndexedDataset::open(prefix)?),
            TokenDType::F32 | TokenDType::F64 => {
                return Err(Error::Format {
                    file: crate::indexed::paths(prefix).1,
                    detail: format!("dtype {}: token ids are integers", header.dtype),
                })
            }
        })
    }

    fn documents(&self) -> usize {
        each_file!(self, d => d.documents())
    }

    fn document_len(&self, doc: usize) -> usize {
        each_file!(self, d => d.document_len(doc))
    }

    fn tokens_into(&self, doc: usize, skip: usize, take: usize, out: &mut Vec<u32>) -> Result<()> {
        each_file!(self, d => d.document_tokens_into(doc, skip, take, out))
    }
}

/// The documents of one split of an indexed dataset, packed into samples of `seq_len + 1`
/// tokens (see the [module docs](self)). Holds the packing order and each document's end
/// in the token stream (16 bytes a document); tokens are read from the map per sample.
#[derive(Debug)]
pub struct PackedDataset {
    file: TokenFile,
    prefix: PathBuf,
    order: Vec<u64>,
    ends: Vec<u64>,
    seq_len: usize,
    packing: Packing,
}

impl PackedDataset {
    /// Opens `PREFIX.bin/.idx` and packs `documents` (ids, e.g. one side of a [`Split`]) in
    /// an order shuffled by `seed`. Empty documents are left out.
    pub fn open(
        prefix: &Path,
        documents: &[u64],
        seq_len: usize,
        packing: Packing,
        seed: u64,
    ) -> Result<PackedDataset> {
        if seq_len == 0 {
            return Err(loader_err(
                "seq_len 0: a sample needs at least one input token",
            ));
        }
        let file = TokenFile::open(prefix)?;
        let n = file.documents() as u64;
        if let Some(bad) = documents.iter().find(|&&d| d >= n) {
            return Err(loader_err(format!(
                "document {bad} of {}: it has {n}",
                prefix.display()
            )));
        }
        let mut order = documents.to_vec();
        Stream::new(seed, PACK_STREAM).shuffle(&mut order);
        order.retain(|&d| file.document_len(d as usize) > 0);
        let mut total = 0u64;
        let ends = order
            .iter()
            .map(|&d| {
                total += file.document_len(d as usize) as u64;
                total
            })
            .collect();
        Ok(PackedDataset {
            file,
            prefix: prefix.to_path_buf(),
            order,
            ends,
            seq_len,
            packing,
        })
    }

    /// Tokens in the packed stream.
    pub fn tokens(&self) -> u64 {
        self.ends.last().copied().unwrap_or(0)
    }

    /// Documents packed (non-empty ones).
    pub fn documents(&self) -> usize {
        self.order.len()
    }

    /// The dataset's prefix.
    pub fn prefix(&self) -> &Path {
        &self.prefix
    }
}

impl SampleSource for PackedDataset {
    fn len_samples(&self) -> u64 {
        self.tokens().saturating_sub(1) / self.seq_len as u64
    }

    fn seq_len(&self) -> usize {
        self.seq_len
    }

    fn packing(&self) -> Packing {
        self.packing
    }

    fn sample_into(&self, i: u64, out: &mut Batch) -> Result<()> {
        if i >= self.len_samples() {
            return Err(loader_err(format!(
                "sample {i} of {} ({} has {} samples of {} tokens)",
                self.len_samples(),
                self.prefix.display(),
                self.len_samples(),
                self.seq_len + 1
            )));
        }
        let mut pos = i * self.seq_len as u64;
        let mut left = self.seq_len + 1;
        // The first document ending after `pos` holds it.
        let mut k = self.ends.partition_point(|&e| e <= pos);
        let mut segment = 0u32;
        while left > 0 {
            let start = if k == 0 { 0 } else { self.ends[k - 1] };
            let skip = (pos - start) as usize;
            let take = ((self.ends[k] - pos) as usize).min(left);
            self.file
                .tokens_into(self.order[k] as usize, skip, take, &mut out.tokens)?;
            if self.packing == Packing::DocumentMasks {
                out.segment_ids.extend(std::iter::repeat_n(segment, take));
                out.position_ids.extend(0..take as u32);
            }
            segment += 1;
            pos += take as u64;
            left -= take;
            k += 1;
        }
        out.samples.push(i);
        Ok(())
    }
}

/// Several sources mixed by weight, as Megatron-LM's `BlendedDataset`: blended sample `i`
/// comes from the source whose count so far falls furthest below its share of `i + 1`
/// (ties to the first), and is that source's next sample (its samples in order, wrapping
/// around when a small source is drawn more often than it has samples).
pub struct Blend {
    parts: Vec<Box<dyn SampleSource + Send + Sync>>,
    weights: Vec<f64>,
    picks: Vec<(u32, u64)>,
}

impl std::fmt::Debug for Blend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blend")
            .field("weights", &self.weights)
            .field("samples", &self.picks.len())
            .finish()
    }
}

impl Blend {
    /// Blends `parts` by `weights` (finite, non-negative, not all zero; normalised here).
    /// All parts must share `seq_len` and packing. `samples`: the blend's length; `None`
    /// takes the longest blend in which no part wraps around.
    pub fn new(
        parts: Vec<(Box<dyn SampleSource + Send + Sync>, f64)>,
        samples: Option<u64>,
    ) -> Result<Blend> {
        let Some((first, _)) = parts.first() else {
            return Err(loader_err("a blend of no datasets"));
        };
        let (seq_len, packing) = (first.seq_len(), first.packing());
        let sum: f64 = parts.iter().map(|(_, w)| w).sum();
        for (k, (p, w)) in parts.iter().enumerate() {
            if !w.is_finite() || *w < 0.0 {
                return Err(loader_err(format!(
                    "weight {w} of dataset {k}: weights are finite and non-negative"
                )));
            }
            if p.seq_len() != seq_len || p.packing() != packing {
                return Err(loader_err(format!(
                    "dataset {k} packs {} tokens {:?}, dataset 0 {} tokens {:?}: a blend's \
                     datasets share both",
                    p.seq_len(),
                    p.packing(),
                    seq_len,
                    packing
                )));
            }
            if *w > 0.0 && p.len_samples() == 0 {
                return Err(loader_err(format!(
                    "dataset {k} has weight {w} and no sample of {} tokens",
                    seq_len + 1
                )));
            }
        }
        if !(sum > 0.0 && sum.is_finite()) {
            return Err(loader_err(format!(
                "weights sum to {sum}: at least one must be positive"
            )));
        }
        let weights: Vec<f64> = parts.iter().map(|(_, w)| w / sum).collect();
        let samples = samples.unwrap_or_else(|| {
            parts
                .iter()
                .zip(&weights)
                .filter(|(_, &w)| w > 0.0)
                .map(|((p, _), &w)| (p.len_samples() as f64 / w).floor() as u64)
                .min()
                .unwrap_or(0)
        });
        let mut counts = vec![0u64; parts.len()];
        let mut picks = Vec::with_capacity(samples as usize);
        for i in 0..samples {
            let target = (i + 1) as f64;
            let mut best = 0;
            let mut best_deficit = f64::NEG_INFINITY;
            for (k, &w) in weights.iter().enumerate() {
                let deficit = w * target - counts[k] as f64;
                if w > 0.0 && deficit > best_deficit {
                    (best, best_deficit) = (k, deficit);
                }
            }
            picks.push((best as u32, counts[best]));
            counts[best] += 1;
        }
        Ok(Blend {
            parts: parts.into_iter().map(|(p, _)| p).collect(),
            weights,
            picks,
        })
    }

    /// The normalised weights.
    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// Which source blended sample `i` comes from.
    pub fn source_of(&self, i: u64) -> usize {
        self.picks[i as usize].0 as usize
    }
}

impl SampleSource for Blend {
    fn len_samples(&self) -> u64 {
        self.picks.len() as u64
    }

    fn seq_len(&self) -> usize {
        self.parts[0].seq_len()
    }

    fn packing(&self) -> Packing {
        self.parts[0].packing()
    }

    fn sample_into(&self, i: u64, out: &mut Batch) -> Result<()> {
        let &(k, j) = self
            .picks
            .get(i as usize)
            .ok_or_else(|| loader_err(format!("blended sample {i} of {}", self.picks.len())))?;
        let part = &self.parts[k as usize];
        part.sample_into(j % part.len_samples(), out)?;
        // The row names the blended index, not the part's.
        *out.samples.last_mut().expect("just pushed") = i;
        Ok(())
    }
}

/// Where a [`Sampler`] stands: what a checkpoint stores. Independent of the rank and of
/// the world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerState {
    /// The seed of the epoch orders.
    pub seed: u64,
    /// Samples per epoch of the dataset it sampled (checked on resume).
    pub samples: u64,
    /// Whether epochs are shuffled.
    pub shuffle: bool,
    /// The epoch in progress, from 0.
    pub epoch: u64,
    /// Positions of the epoch's order consumed by all ranks together.
    pub consumed: u64,
}

/// Deals sample indices to one data rank, epoch after epoch (see the
/// [module docs](self)). Every rank builds its own with the same seed; nothing is
/// exchanged.
#[derive(Clone, Debug)]
pub struct Sampler {
    samples: u64,
    seed: u64,
    shuffle: bool,
    rank: u64,
    world: u64,
    epoch: u64,
    consumed: u64,
    order: Permutation,
}

impl Sampler {
    /// A shuffling sampler over `samples` for data rank `rank` of `world`.
    pub fn new(samples: u64, seed: u64, rank: usize, world: usize) -> Result<Sampler> {
        Sampler::build(samples, seed, true, rank, world)
    }

    /// A sampler in index order (validation: every rank's share of the same samples each
    /// time, rank `r` taking `r`, `r + world`, …).
    pub fn sequential(samples: u64, rank: usize, world: usize) -> Result<Sampler> {
        Sampler::build(samples, 0, false, rank, world)
    }

    fn build(samples: u64, seed: u64, shuffle: bool, rank: usize, world: usize) -> Result<Sampler> {
        if world == 0 || rank >= world {
            return Err(loader_err(format!(
                "data rank {rank} of {world}: the rank must be below a positive world size"
            )));
        }
        if samples < world as u64 {
            return Err(loader_err(format!(
                "{samples} samples for {world} data ranks: every rank needs at least one"
            )));
        }
        Ok(Sampler {
            samples,
            seed,
            shuffle,
            rank: rank as u64,
            world: world as u64,
            epoch: 0,
            consumed: 0,
            order: Permutation::new(samples, seed, 0),
        })
    }

    /// Samples per epoch for each rank (`samples / world`, rounded down).
    pub fn per_rank(&self) -> u64 {
        self.samples / self.world
    }

    /// The epoch in progress.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// This rank's next sample index; past the epoch's end, the next epoch's first.
    pub fn next_index(&mut self) -> u64 {
        let usable = self.samples - self.samples % self.world;
        if self.consumed + self.world > usable {
            self.epoch += 1;
            self.consumed = 0;
            self.order = Permutation::new(self.samples, self.seed, self.epoch);
        }
        let at = self.consumed + self.rank;
        self.consumed += self.world;
        if self.shuffle {
            self.order.apply(at)
        } else {
            at
        }
    }

    /// Where the sampler stands.
    pub fn state(&self) -> SamplerState {
        SamplerState {
            seed: self.seed,
            samples: self.samples,
            shuffle: self.shuffle,
            epoch: self.epoch,
            consumed: self.consumed,
        }
    }

    /// Continues from `state`, which must come from a sampler of the same dataset (sample
    /// count), seed and shuffling; the world size may differ.
    pub fn resume(&mut self, state: SamplerState) -> Result<()> {
        if (state.seed, state.samples, state.shuffle) != (self.seed, self.samples, self.shuffle) {
            return Err(loader_err(format!(
                "sampler state of seed {}, {} samples, shuffle {}; this sampler has seed {}, \
                 {} samples, shuffle {}",
                state.seed, state.samples, state.shuffle, self.seed, self.samples, self.shuffle
            )));
        }
        if state.consumed > state.samples {
            return Err(loader_err(format!(
                "sampler state consumed {} of an epoch of {} samples",
                state.consumed, state.samples
            )));
        }
        self.epoch = state.epoch;
        self.consumed = state.consumed;
        self.order = Permutation::new(self.samples, self.seed, self.epoch);
        Ok(())
    }
}

/// A source read through a sampler: one data rank's batches.
#[derive(Debug)]
pub struct DataLoader<S: SampleSource> {
    source: S,
    sampler: Sampler,
}

impl<S: SampleSource> DataLoader<S> {
    /// Reads `source` in `sampler`'s order (built over `source.len_samples()`).
    pub fn new(source: S, sampler: Sampler) -> DataLoader<S> {
        DataLoader { source, sampler }
    }

    /// The next `rows` samples of this rank.
    pub fn next_batch(&mut self, rows: usize) -> Result<Batch> {
        let mut b = Batch::default();
        self.next_batch_into(rows, &mut b)?;
        Ok(b)
    }

    /// The next `rows` samples of this rank into `out` (cleared first; its buffers are
    /// reused).
    pub fn next_batch_into(&mut self, rows: usize, out: &mut Batch) -> Result<()> {
        out.clear();
        for _ in 0..rows {
            let i = self.sampler.next_index();
            self.source.sample_into(i, out)?;
        }
        Ok(())
    }

    /// The sampler's state (for a checkpoint).
    pub fn state(&self) -> SamplerState {
        self.sampler.state()
    }

    /// Continues from a checkpoint's state.
    pub fn resume(&mut self, state: SamplerState) -> Result<()> {
        self.sampler.resume(state)
    }

    /// The source.
    pub fn source(&self) -> &S {
        &self.source
    }

    /// The sampler.
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// The source, to read again through another sampler.
    pub fn into_source(self) -> S {
        self.source
    }
}
