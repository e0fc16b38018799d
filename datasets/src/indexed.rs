//! Megatron-LM's indexed dataset: token ids in `PREFIX.bin`, their layout in `PREFIX.idx`.
//!
//! `.bin` holds the token ids of every sequence, concatenated, in one element type. `.idx`
//! is little-endian:
//!
//! | offset | field | type |
//! |---|---|---|
//! | 0 | magic `MMIDIDX\x00\x00` | 9 bytes |
//! | 9 | version, 1 | u64 |
//! | 17 | dtype code (table below) | u8 |
//! | 18 | sequence count `S` | u64 |
//! | 26 | document count `D + 1` (the length of the document indices) | u64 |
//! | 34 | sequence lengths, in elements | i32 × `S` |
//! | 34 + 4`S` | sequence pointers, byte offsets into `.bin` | i64 × `S` |
//! | 34 + 12`S` | document indices: the first sequence of each document, from 0, ending with `S` | i64 × (`D + 1`) |
//!
//! | code | dtype | | code | dtype |
//! |---|---|---|---|---|
//! | 1 | u8 | | 5 | i64 |
//! | 2 | i8 | | 6 | f64 |
//! | 3 | i16 | | 7 | f32 |
//! | 4 | i32 | | 8 | u16 |
//!
//! Token files use u16 when the vocabulary has fewer than 65 500 ids and i32 otherwise
//! ([`TokenDType::for_vocab`]), as Megatron-LM's `preprocess_data.py` chooses.
//!
//! A document is one or more sequences (Megatron-LM's BERT data keeps one sentence per
//! sequence; GPT data one document per sequence). [`IndexedDatasetBuilder`] writes both
//! shapes; [`IndexedDataset`] maps both files and hands out each sequence as a slice of the
//! map: nothing is read until it is touched, so a dataset larger than memory costs only the
//! pages in use. Opening checks the whole `.idx` (every length, pointer and document index)
//! against the `.bin`'s size, so a damaged file fails there, naming the file and the field,
//! and never later in the middle of a run.

use crate::{Error, Result};
use memmap2::Mmap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

/// The 9 bytes every `.idx` file starts with.
pub const MAGIC: &[u8; 9] = b"MMIDIDX\x00\x00";
/// The only version of the format.
pub const VERSION: u64 = 1;
/// Bytes before the sequence lengths: magic, version, dtype code and the two counts.
pub const HEADER_BYTES: usize = 9 + 8 + 1 + 8 + 8;

/// The element types of the format, by their code in the `.idx` header.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenDType {
    /// Code 1.
    U8,
    /// Code 2.
    I8,
    /// Code 3.
    I16,
    /// Code 4.
    I32,
    /// Code 5.
    I64,
    /// Code 6.
    F64,
    /// Code 7.
    F32,
    /// Code 8.
    U16,
}

impl TokenDType {
    /// The code written in the `.idx` header.
    pub fn code(self) -> u8 {
        match self {
            TokenDType::U8 => 1,
            TokenDType::I8 => 2,
            TokenDType::I16 => 3,
            TokenDType::I32 => 4,
            TokenDType::I64 => 5,
            TokenDType::F64 => 6,
            TokenDType::F32 => 7,
            TokenDType::U16 => 8,
        }
    }

    /// The dtype of a header code, or `None` for a code the format does not define.
    pub fn from_code(code: u8) -> Option<TokenDType> {
        Some(match code {
            1 => TokenDType::U8,
            2 => TokenDType::I8,
            3 => TokenDType::I16,
            4 => TokenDType::I32,
            5 => TokenDType::I64,
            6 => TokenDType::F64,
            7 => TokenDType::F32,
            8 => TokenDType::U16,
            _ => return None,
        })
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            TokenDType::U8 | TokenDType::I8 => 1,
            TokenDType::I16 | TokenDType::U16 => 2,
            TokenDType::I32 | TokenDType::F32 => 4,
            TokenDType::I64 | TokenDType::F64 => 8,
        }
    }

    /// The dtype Megatron-LM stores token ids of a vocabulary this large in: u16 below
    /// 65 500 ids, i32 otherwise.
    pub fn for_vocab(vocab_size: usize) -> TokenDType {
        if vocab_size < 65_500 {
            TokenDType::U16
        } else {
            TokenDType::I32
        }
    }
}

impl std::fmt::Display for TokenDType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let name = match self {
            TokenDType::U8 => "u8",
            TokenDType::I8 => "i8",
            TokenDType::I16 => "i16",
            TokenDType::I32 => "i32",
            TokenDType::I64 => "i64",
            TokenDType::F64 => "f64",
            TokenDType::F32 => "f32",
            TokenDType::U16 => "u16",
        };
        write!(f, "{name} (code {})", self.code())
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A Rust type that is one of the format's element types.
pub trait Element: bytemuck::Pod + sealed::Sealed + std::fmt::Debug {
    /// Its dtype in the header.
    const DTYPE: TokenDType;
    /// The element as a token id, or `None` where it is not one (negative, fractional or
    /// past `u32`).
    fn to_token(self) -> Option<u32>;
    /// A token id as this element, or `None` where it does not fit.
    fn from_token(id: u32) -> Option<Self>;
}

macro_rules! integer_element {
    ($t:ty, $d:ident) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: TokenDType = TokenDType::$d;
            fn to_token(self) -> Option<u32> {
                u32::try_from(self).ok()
            }
            fn from_token(id: u32) -> Option<Self> {
                <$t>::try_from(id).ok()
            }
        }
    };
}
integer_element!(u8, U8);
integer_element!(i8, I8);
integer_element!(i16, I16);
integer_element!(i32, I32);
integer_element!(i64, I64);
integer_element!(u16, U16);

macro_rules! float_element {
    ($t:ty, $d:ident) => {
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: TokenDType = TokenDType::$d;
            fn to_token(self) -> Option<u32> {
                let whole = self >= 0.0 && self.fract() == 0.0 && self <= u32::MAX as $t;
                whole.then_some(self as u32)
            }
            fn from_token(id: u32) -> Option<Self> {
                let x = id as $t;
                (x as u32 == id).then_some(x)
            }
        }
    };
}
float_element!(f32, F32);
float_element!(f64, F64);

/// `PREFIX.bin` and `PREFIX.idx` of a prefix (an extension on the prefix is kept:
/// `data/web` gives `data/web.bin`).
pub fn paths(prefix: &Path) -> (PathBuf, PathBuf) {
    let with = |ext: &str| {
        let mut p = prefix.as_os_str().to_owned();
        p.push(ext);
        PathBuf::from(p)
    };
    (with(".bin"), with(".idx"))
}

fn io_err(file: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io {
        file: file.to_path_buf(),
        detail: e.to_string(),
    }
}

fn format_err(file: &Path, detail: impl std::fmt::Display) -> Error {
    Error::Format {
        file: file.to_path_buf(),
        detail: detail.to_string(),
    }
}

/// What [`IndexedDatasetBuilder::finish`] wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BuildSummary {
    /// Sequences written.
    pub sequences: u64,
    /// Documents written.
    pub documents: u64,
    /// Elements (tokens) written.
    pub tokens: u64,
}

/// Writes an indexed dataset: token ids stream into `PREFIX.bin` as they are added; the
/// lengths, pointers and document boundaries are kept (12 bytes a sequence) and written to
/// `PREFIX.idx` by [`finish`](Self::finish). Until `finish` returns there is no `.idx`, so
/// a run that stops half way leaves no file a reader would take for a dataset.
///
/// ```
/// use dtensor_datasets::indexed::{IndexedDataset, IndexedDatasetBuilder};
/// # let dir = std::env::temp_dir().join(format!("dtensor-builder-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir).unwrap();
/// let prefix = dir.join("sentences");
/// let mut b = IndexedDatasetBuilder::<i32>::create(&prefix).unwrap();
/// b.add_document(&[5, 6, 7]).unwrap();     // one sequence, one document
/// b.add_sequence(&[1, 2]).unwrap();        // a document of two sequences
/// b.add_sequence(&[3]).unwrap();
/// b.end_document().unwrap();
/// b.finish().unwrap();
/// let d = IndexedDataset::<i32>::open(&prefix).unwrap();
/// assert_eq!((d.len(), d.documents()), (3, 2));
/// assert_eq!(d.document_sequences(1), 1..3);
/// assert_eq!(d.get(2), &[3]);
/// # std::fs::remove_dir_all(&dir).unwrap();
/// ```
#[derive(Debug)]
pub struct IndexedDatasetBuilder<T: Element> {
    bin: BufWriter<File>,
    bin_path: PathBuf,
    idx_path: PathBuf,
    lengths: Vec<i32>,
    pointers: Vec<i64>,
    document_indices: Vec<i64>,
    bytes: i64,
    element: PhantomData<T>,
}

impl<T: Element> IndexedDatasetBuilder<T> {
    /// Starts `PREFIX.bin` (replacing any file there) and removes a stale `PREFIX.idx`.
    pub fn create(prefix: &Path) -> Result<Self> {
        let (bin_path, idx_path) = paths(prefix);
        let bin = File::create(&bin_path).map_err(|e| io_err(&bin_path, e))?;
        match std::fs::remove_file(&idx_path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&idx_path, e)),
        }
        Ok(IndexedDatasetBuilder {
            bin: BufWriter::with_capacity(1 << 20, bin),
            bin_path,
            idx_path,
            lengths: Vec::new(),
            pointers: Vec::new(),
            document_indices: vec![0],
            bytes: 0,
            element: PhantomData,
        })
    }

    /// Appends one sequence to the open document.
    pub fn add_sequence(&mut self, tokens: &[T]) -> Result<()> {
        let len = i32::try_from(tokens.len()).map_err(|_| {
            format_err(
                &self.bin_path,
                format!(
                    "a sequence of {} elements: lengths are i32 in the format",
                    tokens.len()
                ),
            )
        })?;
        self.bin
            .write_all(bytemuck::cast_slice(tokens))
            .map_err(|e| io_err(&self.bin_path, e))?;
        self.lengths.push(len);
        self.pointers.push(self.bytes);
        self.bytes += (tokens.len() * T::DTYPE.size()) as i64;
        Ok(())
    }

    /// Closes the open document after the sequences added since the last boundary (an
    /// empty document when none were).
    pub fn end_document(&mut self) -> Result<()> {
        self.document_indices.push(self.lengths.len() as i64);
        Ok(())
    }

    /// A document of one sequence: [`add_sequence`](Self::add_sequence), then
    /// [`end_document`](Self::end_document).
    pub fn add_document(&mut self, tokens: &[T]) -> Result<()> {
        self.add_sequence(tokens)?;
        self.end_document()
    }

    /// Sequences added so far.
    pub fn sequences(&self) -> u64 {
        self.lengths.len() as u64
    }

    /// Elements added so far.
    pub fn tokens(&self) -> u64 {
        self.bytes as u64 / T::DTYPE.size() as u64
    }

    /// Flushes `.bin` and writes `.idx`. Sequences added after the last
    /// [`end_document`](Self::end_document) are closed into a final document first, so no
    /// sequence is left outside every document.
    pub fn finish(mut self) -> Result<BuildSummary> {
        if *self.document_indices.last().expect("starts with 0") != self.lengths.len() as i64 {
            self.end_document()?;
        }
        self.bin.flush().map_err(|e| io_err(&self.bin_path, e))?;
        let sequences = self.lengths.len();
        let mut idx =
            Vec::with_capacity(HEADER_BYTES + 12 * sequences + 8 * self.document_indices.len());
        idx.extend_from_slice(MAGIC);
        idx.extend_from_slice(&VERSION.to_le_bytes());
        idx.push(T::DTYPE.code());
        idx.extend_from_slice(&(sequences as u64).to_le_bytes());
        idx.extend_from_slice(&(self.document_indices.len() as u64).to_le_bytes());
        for l in &self.lengths {
            idx.extend_from_slice(&l.to_le_bytes());
        }
        for p in &self.pointers {
            idx.extend_from_slice(&p.to_le_bytes());
        }
        for d in &self.document_indices {
            idx.extend_from_slice(&d.to_le_bytes());
        }
        std::fs::write(&self.idx_path, &idx).map_err(|e| io_err(&self.idx_path, e))?;
        Ok(BuildSummary {
            sequences: sequences as u64,
            documents: self.document_indices.len() as u64 - 1,
            tokens: self.tokens(),
        })
    }
}

/// The header of a `.idx` file, read and checked by [`read_header`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    /// The element type.
    pub dtype: TokenDType,
    /// Sequences.
    pub sequences: u64,
    /// Documents (the header's count minus one).
    pub documents: u64,
}

/// Reads the header of `PREFIX.idx`: what a caller needs to pick the element type before
/// [`IndexedDataset::open`].
pub fn read_header(prefix: &Path) -> Result<Header> {
    let (_, idx_path) = paths(prefix);
    let mut buf = [0u8; HEADER_BYTES];
    let mut f = File::open(&idx_path).map_err(|e| io_err(&idx_path, e))?;
    let mut got = 0;
    while got < HEADER_BYTES {
        match std::io::Read::read(&mut f, &mut buf[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) => return Err(io_err(&idx_path, e)),
        }
    }
    parse_header(&idx_path, &buf[..got])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn i64_at(b: &[u8], at: usize) -> i64 {
    i64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn i32_at(b: &[u8], at: usize) -> i32 {
    i32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn parse_header(idx_path: &Path, b: &[u8]) -> Result<Header> {
    if b.len() < MAGIC.len() || &b[..MAGIC.len()] != MAGIC {
        let start = &b[..b.len().min(MAGIC.len())];
        return Err(format_err(
            idx_path,
            format!("bad magic {start:?}: an indexed dataset's .idx starts with {MAGIC:?}"),
        ));
    }
    if b.len() < HEADER_BYTES {
        return Err(format_err(
            idx_path,
            format!(
                "truncated: {} bytes, the header alone is {HEADER_BYTES}",
                b.len()
            ),
        ));
    }
    let version = u64_at(b, 9);
    if version != VERSION {
        return Err(format_err(
            idx_path,
            format!("version {version}, only version {VERSION} exists"),
        ));
    }
    let dtype = TokenDType::from_code(b[17]).ok_or_else(|| {
        format_err(
            idx_path,
            format!("dtype code {}: the format defines codes 1 to 8", b[17]),
        )
    })?;
    let sequences = u64_at(b, 18);
    let document_count = u64_at(b, 26);
    if document_count == 0 {
        return Err(format_err(
            idx_path,
            "document count 0: the document indices hold at least the leading 0",
        ));
    }
    Ok(Header {
        dtype,
        sequences,
        documents: document_count - 1,
    })
}

fn map(file: &Path) -> Result<Option<Mmap>> {
    let f = File::open(file).map_err(|e| io_err(file, e))?;
    let len = f.metadata().map_err(|e| io_err(file, e))?.len();
    if len == 0 {
        // An empty file cannot be mapped (mmap rejects length 0); it has nothing to read.
        return Ok(None);
    }
    // SAFETY: the map is read-only and private to this process. Another process truncating
    // or rewriting the file while it is mapped is outside what this type can guard against
    // (as for every memory-mapped reader, Megatron-LM's included); the format's files are
    // written once and then only read.
    let m = unsafe { Mmap::map(&f) }.map_err(|e| io_err(file, e))?;
    Ok(Some(m))
}

/// A memory-mapped indexed dataset of element type `T`.
///
/// Invariants (checked by [`open`](Self::open)): every sequence's bytes lie inside `.bin`
/// at an offset aligned to `T`; the document indices start at 0, never decrease and end at
/// the sequence count. So [`get`](Self::get) never fails and never copies.
pub struct IndexedDataset<T: Element> {
    bin: Option<Mmap>,
    idx: Mmap,
    bin_path: PathBuf,
    sequences: usize,
    documents: usize,
    element: PhantomData<T>,
}

impl<T: Element> std::fmt::Debug for IndexedDataset<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexedDataset")
            .field("bin", &self.bin_path)
            .field("dtype", &T::DTYPE)
            .field("sequences", &self.sequences)
            .field("documents", &self.documents)
            .finish()
    }
}

impl<T: Element> IndexedDataset<T> {
    /// Maps `PREFIX.idx` and `PREFIX.bin` and checks them (header, sizes, every pointer and
    /// document index); the dtype code must be `T`'s.
    pub fn open(prefix: &Path) -> Result<Self> {
        if cfg!(target_endian = "big") {
            return Err(format_err(
                prefix,
                "the format is little-endian and its tokens are handed out in place: a \
                 big-endian host cannot read them",
            ));
        }
        let (bin_path, idx_path) = paths(prefix);
        let idx = map(&idx_path)?.ok_or_else(|| format_err(&idx_path, "empty file"))?;
        let header = parse_header(&idx_path, &idx)?;
        if header.dtype != T::DTYPE {
            return Err(format_err(
                &idx_path,
                format!(
                    "dtype {}, read as {}: open it with the element type of its code",
                    header.dtype,
                    T::DTYPE
                ),
            ));
        }
        let too_many = || format_err(&idx_path, "counts in the header overflow the address space");
        let sequences = usize::try_from(header.sequences).map_err(|_| too_many())?;
        let documents = usize::try_from(header.documents).map_err(|_| too_many())?;
        let want = sequences
            .checked_mul(12)
            .and_then(|s| {
                (documents + 1)
                    .checked_mul(8)
                    .and_then(|d| s.checked_add(d))
            })
            .and_then(|x| x.checked_add(HEADER_BYTES))
            .ok_or_else(too_many)?;
        if idx.len() != want {
            let what = if idx.len() < want {
                "truncated"
            } else {
                "trailing bytes"
            };
            return Err(format_err(
                &idx_path,
                format!(
                    "{what}: {} bytes, the header's {sequences} sequences and {} document \
                     indices take {want}",
                    idx.len(),
                    documents + 1
                ),
            ));
        }
        let bin = map(&bin_path)?;
        let d = IndexedDataset {
            bin,
            idx,
            bin_path,
            sequences,
            documents,
            element: PhantomData,
        };
        d.check(&idx_path)?;
        Ok(d)
    }

    fn check(&self, idx_path: &Path) -> Result<()> {
        let bin_len = self.bin.as_ref().map_or(0, |m| m.len()) as u64;
        let size = T::DTYPE.size() as u64;
        for i in 0..self.sequences {
            let (len, ptr) = self.raw(i);
            if len < 0 || ptr < 0 {
                return Err(format_err(
                    idx_path,
                    format!("sequence {i}: length {len}, pointer {ptr} (negative)"),
                ));
            }
            let (len, ptr) = (len as u64, ptr as u64);
            if ptr % size != 0 {
                return Err(format_err(
                    idx_path,
                    format!(
                        "sequence {i}: pointer {ptr} is not a multiple of the {size}-byte element"
                    ),
                ));
            }
            if ptr + len * size > bin_len {
                return Err(format_err(
                    &self.bin_path,
                    format!(
                        "truncated: sequence {i} ends at byte {}, the file has {bin_len}",
                        ptr + len * size
                    ),
                ));
            }
        }
        let mut prev = 0i64;
        for k in 0..=self.documents {
            let at = self.document_index(k);
            let bad = if k == 0 {
                at != 0
            } else {
                at < prev || at > self.sequences as i64
            };
            if bad || (k == self.documents && at != self.sequences as i64) {
                return Err(format_err(
                    idx_path,
                    format!(
                        "document index {k} is {at}: they run from 0 up to the sequence count {}",
                        self.sequences
                    ),
                ));
            }
            prev = at;
        }
        Ok(())
    }

    fn raw(&self, i: usize) -> (i32, i64) {
        let len = i32_at(&self.idx, HEADER_BYTES + 4 * i);
        let ptr = i64_at(&self.idx, HEADER_BYTES + 4 * self.sequences + 8 * i);
        (len, ptr)
    }

    fn document_index(&self, k: usize) -> i64 {
        i64_at(&self.idx, HEADER_BYTES + 12 * self.sequences + 8 * k)
    }

    /// Sequences.
    pub fn len(&self) -> usize {
        self.sequences
    }

    /// Whether there are no sequences.
    pub fn is_empty(&self) -> bool {
        self.sequences == 0
    }

    /// Documents.
    pub fn documents(&self) -> usize {
        self.documents
    }

    /// Elements in sequence `i`. Panics when `i >= len()`.
    pub fn sequence_len(&self, i: usize) -> usize {
        assert!(i < self.sequences, "sequence {i} of {}", self.sequences);
        self.raw(i).0 as usize
    }

    /// Sequence `i`, in place in the map. Panics when `i >= len()`.
    pub fn get(&self, i: usize) -> &[T] {
        assert!(i < self.sequences, "sequence {i} of {}", self.sequences);
        let (len, ptr) = self.raw(i);
        let Some(bin) = &self.bin else {
            return &[];
        };
        let start = ptr as usize;
        let bytes = &bin[start..start + len as usize * T::DTYPE.size()];
        // `open` checked the bounds and the alignment (the map starts on a page).
        bytemuck::cast_slice(bytes)
    }

    /// The sequences of document `d`. Panics when `d >= documents()`.
    pub fn document_sequences(&self, d: usize) -> std::ops::Range<usize> {
        assert!(d < self.documents, "document {d} of {}", self.documents);
        self.document_index(d) as usize..self.document_index(d + 1) as usize
    }

    /// Elements in document `d` (its sequences together). Panics when `d >= documents()`.
    pub fn document_len(&self, d: usize) -> usize {
        self.document_sequences(d)
            .map(|s| self.sequence_len(s))
            .sum()
    }

    /// The document indices as the file holds them (`documents() + 1` values).
    pub fn document_indices(&self) -> Vec<u64> {
        (0..=self.documents)
            .map(|k| self.document_index(k) as u64)
            .collect()
    }

    /// The `.bin` file.
    pub fn bin_path(&self) -> &Path {
        &self.bin_path
    }
}

impl<T: Element> IndexedDataset<T> {
    /// Appends `take` token ids of document `d`, from its `skip`-th element on (across its
    /// sequences), to `out`. Fails, naming the file, on an element that is not a token id
    /// (negative, or a fraction in a float file).
    pub fn document_tokens_into(
        &self,
        d: usize,
        mut skip: usize,
        mut take: usize,
        out: &mut Vec<u32>,
    ) -> Result<()> {
        for s in self.document_sequences(d) {
            if take == 0 {
                break;
            }
            let seq = self.get(s);
            if skip >= seq.len() {
                skip -= seq.len();
                continue;
            }
            let start = skip;
            let part = &seq[start..seq.len().min(start + take)];
            skip = 0;
            take -= part.len();
            for (k, &x) in part.iter().enumerate() {
                out.push(x.to_token().ok_or_else(|| {
                    format_err(
                        &self.bin_path,
                        format!(
                            "sequence {s}, element {}: {x:?} is not a token id",
                            start + k
                        ),
                    )
                })?);
            }
        }
        Ok(())
    }
}
