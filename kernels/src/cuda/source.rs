//! The CUDA C sources of the kernels and the table of their entry points, read from the
//! sources themselves.
//!
//! Each module is `common.cuh` followed by one `.cu` file, compiled by NVRTC as one program.
//! Every `.cu` file in `kernels/` is a module (`rope.cu` is [`ROPE`], and all are in
//! [`MODULES`]): the build script declares them from the directory, so a new file needs no
//! Rust edit. Entry points are named
//! `<root>_<dtype>` (`gelu_bf16`, `copy_blocks_i64`; the casts `cast_<from>_<to>`, root
//! `cast_<from>`) and defined by instantiation macros (`FLOATS(NORM_ENTRIES)`,
//! `ALL_TYPES(COPY_ENTRIES)`, `MERGE_ENTRIES(f32, float)`): [`KernelModule::roots`] expands
//! them as the preprocessor does, so a kernel added to a `.cu` file is in the table with no
//! edit here. A source the reader does not understand is an `Err`, never a missing kernel, and
//! the no-GPU test `cuda_ptx` checks the table against what the compiled PTX exports.

use crate::{DType, Error, Result};
use std::collections::HashMap;
use std::sync::OnceLock;

mod preprocess;

/// Prepended to every module: the 16-bit types, compute-type traits, block reductions.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// One kernel root of a module and the dtypes it is instantiated for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Root {
    /// The entry name without its dtype suffix (`gelu`, `cast_bf16`).
    pub name: String,
    /// The dtypes it has an entry for, in the order of [`DType::ALL`].
    pub dtypes: Vec<DType>,
}

/// One NVRTC program: a `.cu` source, and the table of its kernels read from it on first use.
#[derive(Debug)]
pub struct KernelModule {
    /// The module's name (the `.cu` file's stem).
    pub name: &'static str,
    /// The `.cu` source (without [`COMMON`]).
    pub source: &'static str,
    table: OnceLock<std::result::Result<Table, String>>,
}

/// What a module's source defines: its roots, and each entry's parameters.
#[derive(Debug)]
struct Table {
    roots: Vec<Root>,
    params: HashMap<String, Vec<Param>>,
}

impl KernelModule {
    /// The module `name` with the `.cu` text `source` (its table is read on first use).
    pub const fn new(name: &'static str, source: &'static str) -> Self {
        KernelModule {
            name,
            source,
            table: OnceLock::new(),
        }
    }

    /// The full program text NVRTC compiles.
    pub fn program(&self) -> String {
        format!("{COMMON}\n// ---- {}.cu\n{}", self.name, self.source)
    }

    /// The table, read from the source once per process; `Err` says what the reader could
    /// not understand.
    fn table(&self) -> std::result::Result<&Table, &str> {
        self.table
            .get_or_init(|| read_table(&self.program(), self.source))
            .as_ref()
            .map_err(String::as_str)
    }

    /// Every kernel root of the module and its dtypes, in the order the source defines them:
    /// what the instantiation macros expand to, as NVRTC sees it. `Err` when the source
    /// holds a kernel the reader cannot place: a `__global__` not written
    /// `extern "C" __global__ void name(…)`, a name not ending in a dtype, an entry macro
    /// never instantiated, a conditional directive or a malformed macro call.
    pub fn roots(&self) -> Result<&[Root]> {
        self.table()
            .map(|t| t.roots.as_slice())
            .map_err(|e| Error::Invalid {
                op: "cuda::source::KernelModule::roots",
                detail: format!("kernel module `{}`: {e}", self.name),
            })
    }

    /// Every `extern "C"` entry point of the module (`Err` as [`roots`](Self::roots)).
    pub fn entries(&self) -> Result<Vec<String>> {
        Ok(self
            .roots()?
            .iter()
            .flat_map(|r| r.dtypes.iter().map(|&d| entry(&r.name, d)))
            .collect())
    }
}

/// `root_dtype`, the entry name of a kernel for one dtype.
pub fn entry(root: &str, dtype: DType) -> String {
    format!("{root}_{dtype}")
}

/// The dtype named `name` (`"bf16"`), as entry names spell it.
fn dtype_named(name: &str) -> Option<DType> {
    DType::ALL.into_iter().find(|d| d.to_string() == name)
}

/// The table of the module whose full program is `program` and whose own `.cu` text is
/// `source`.
fn read_table(program: &str, source: &str) -> std::result::Result<Table, String> {
    let mut roots: Vec<Root> = Vec::new();
    for name in preprocess::global_functions(program)? {
        let (root, dtype) = name
            .rsplit_once('_')
            .and_then(|(root, d)| Some((root, dtype_named(d)?)))
            .ok_or_else(|| {
                format!("kernel `{name}` is not named `<root>_<dtype>`, so no launch can find it")
            })?;
        match roots.iter_mut().find(|r| r.name == root) {
            Some(r) if r.dtypes.contains(&dtype) => {
                return Err(format!("kernel `{name}` is defined twice"))
            }
            Some(r) => r.dtypes.push(dtype),
            None => roots.push(Root {
                name: root.to_string(),
                dtypes: vec![dtype],
            }),
        }
    }
    for r in &mut roots {
        r.dtypes
            .sort_by_key(|d| DType::ALL.iter().position(|a| a == d));
    }
    let definitions = parse_entries(source);
    // A definition no macro call expands is a kernel the author meant to have.
    for (defined, _) in &definitions {
        let instantiated = roots.iter().any(|r| {
            r.dtypes.iter().any(|&d| {
                let name = entry(&r.name, d);
                name == *defined
                    || name
                        .strip_prefix(defined.as_str())
                        .and_then(|rest| rest.strip_prefix('_'))
                        .is_some_and(|rest| rest.split('_').all(|d| dtype_named(d).is_some()))
            })
        });
        if !instantiated {
            return Err(format!(
                "kernel `{defined}` is defined but no macro call instantiates it \
                 (e.g. `FLOATS(ITS_ENTRIES_MACRO)`)"
            ));
        }
    }
    let params = roots
        .iter()
        .flat_map(|r| r.dtypes.iter().map(move |&d| (r, d)))
        .filter_map(|(r, d)| Some((entry(&r.name, d), resolve(&definitions, &r.name, d)?)))
        .collect();
    Ok(Table { roots, params })
}

/// A scalar kernel parameter's C type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scalar {
    /// `u64` (counts, sizes, offsets).
    U64,
    /// `int` (flags, op codes, `Tr<int>::A`).
    I32,
    /// `i64` (`Tr<i64>::A`).
    I64,
    /// `float` (`Tr<T>::A` of f32, bf16, f16).
    F32,
    /// `double` (`Tr<double>::A`, the AdamW constants).
    F64,
}

/// One parameter of a kernel entry, as its `extern "C"` signature in the `.cu` source
/// declares it (the C types resolved for the entry's dtype), or as a launch pushes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Param {
    /// `const E*`: a buffer the kernel reads, of element type `E`.
    Src(DType),
    /// `E*`: a buffer the kernel writes.
    Dst(DType),
    /// A scalar passed by value.
    Scalar(Scalar),
}

impl Param {
    /// The PTX parameter type NVRTC gives it (`.param .u64 …` for pointers).
    pub fn ptx(self) -> &'static str {
        match self {
            Param::Src(_) | Param::Dst(_) | Param::Scalar(Scalar::U64 | Scalar::I64) => ".u64",
            Param::Scalar(Scalar::I32) => ".u32",
            Param::Scalar(Scalar::F32) => ".f32",
            Param::Scalar(Scalar::F64) => ".f64",
        }
    }
}

/// The compute type `Tr<T>::A` of `common.cuh`: f32 for the 16-bit floats, else the dtype.
fn compute(dtype: DType) -> DType {
    match dtype {
        DType::BF16 | DType::F16 => DType::F32,
        d => d,
    }
}

/// One parameter as written in the source: pointer or not, `const` or not, the type's text
/// (without `const` and `*`).
#[derive(Debug)]
struct CParam {
    pointer: bool,
    constant: bool,
    ty: String,
}

/// Every `extern "C" __global__` definition of `source`: the root (the name before its first
/// `_##`, so `cast_##SN##_##DN` is `cast`) and its parameters.
fn parse_entries(source: &str) -> Vec<(String, Vec<CParam>)> {
    const START: &str = "extern \"C\" __global__ void ";
    let mut out = Vec::new();
    for (at, _) in source.match_indices(START) {
        let rest = &source[at + START.len()..];
        let Some(open) = rest.find('(') else { continue };
        let name = rest[..open].trim();
        let root = name.split("_##").next().unwrap_or(name).to_string();
        let Some(close) = rest[open..].find(')') else {
            continue;
        };
        let list = rest[open + 1..open + close].replace('\\', " ");
        let params = list
            .split(',')
            .map(|p| {
                let p = p.split_whitespace().collect::<Vec<_>>().join(" ");
                // The last identifier is the parameter's name.
                let cut = p
                    .rfind(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .map_or(0, |i| i + 1);
                let ty = &p[..cut];
                let constant = ty.starts_with("const ");
                let ty = ty.strip_prefix("const ").unwrap_or(ty);
                CParam {
                    pointer: ty.contains('*'),
                    constant,
                    ty: ty.replace('*', "").trim().to_string(),
                }
            })
            .collect();
        out.push((root, params));
    }
    out
}

/// The parameters of the entry `root_dtype`, from its definition among `definitions` with
/// the macro's type names resolved for `dtype` (`T`, `Tr<T>::A`, the casts' `S`/`D`,
/// `AdamS<T>::S`, …). `None` when no definition is that root's or a type is not one the
/// launches know.
fn resolve(definitions: &[(String, Vec<CParam>)], root: &str, dtype: DType) -> Option<Vec<Param>> {
    // A root is its definition's name (`gelu` of `gelu_##N`), or that name and a first dtype
    // (`cast_bf16` of `cast_##SN##_##DN`), which the definition's `S` stands for.
    let exact = definitions
        .iter()
        .find(|(defined, _)| defined == root || *defined == entry(root, dtype))
        .map(|(_, params)| (params, None));
    let (params, from) = exact.or_else(|| {
        definitions.iter().find_map(|(defined, params)| {
            let from = root.strip_prefix(defined.as_str())?.strip_prefix('_')?;
            Some((params, Some(dtype_named(from)?)))
        })
    })?;
    let elem = |ty: &str| -> Option<DType> {
        Some(match ty {
            "T" => dtype,
            "Tr<T>::A" | "A" => compute(dtype),
            "AdamS<T>::S" if dtype == DType::F32 => DType::F32,
            "AdamS<T>::S" => DType::F64,
            "S" => from?,
            "D" if from.is_some() => dtype,
            "i64" => DType::I64,
            "int" => DType::I32,
            "float" => DType::F32,
            "double" => DType::F64,
            _ => return None,
        })
    };
    params
        .iter()
        .map(|p| {
            if p.pointer {
                let e = elem(&p.ty)?;
                return Some(if p.constant {
                    Param::Src(e)
                } else {
                    Param::Dst(e)
                });
            }
            let s = match p.ty.as_str() {
                "u64" => Scalar::U64,
                other => match elem(other)? {
                    DType::I32 => Scalar::I32,
                    DType::I64 => Scalar::I64,
                    DType::F32 => Scalar::F32,
                    DType::F64 => Scalar::F64,
                    DType::BF16 | DType::F16 => return None,
                },
            };
            Some(Param::Scalar(s))
        })
        .collect()
}

impl KernelModule {
    /// The parameters of the entry `root_dtype`, read from its `extern "C"` definition in the
    /// `.cu` source with the macro's type names resolved for `dtype` (`T`, `Tr<T>::A`, the
    /// casts' `S`/`D`, `AdamS<T>::S`, …). `None` when the module defines no such root for
    /// that dtype, a type is not one the launches know, or the source cannot be read
    /// ([`roots`](Self::roots) says why).
    ///
    /// Every launch compares what it pushes with this list before launching (a mismatch is
    /// an `Err`, not undefined behaviour on the GPU), and the no-GPU test `cuda_ptx` checks
    /// the list against the parameters of the compiled PTX.
    pub fn params(&self, root: &str, dtype: DType) -> Option<Vec<Param>> {
        self.table().ok()?.params.get(&entry(root, dtype)).cloned()
    }

    /// [`params`](Self::params) of the entry `name` (`root_dtype`), resolved once per
    /// process with the rest of the module's table: each launch looks its kernel's list up
    /// here rather than resolving the source's type names again.
    pub(crate) fn entry_params(&'static self, name: &str) -> Option<&'static [Param]> {
        self.table().ok()?.params.get(name).map(Vec::as_slice)
    }
}

// One `pub static <NAME>: KernelModule` per `kernels/*.cu` file (`ROPE` for `rope.cu`) and
// `MODULES`, every one of them, written by `kernels/build.rs` from the directory's files.
include!(concat!(env!("OUT_DIR"), "/kernel_modules.rs"));

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_size_matches_the_kernels() {
        let define = format!("#define ROW_THREADS {}", crate::cuda::launch::THREADS);
        assert!(COMMON.contains(&define), "common.cuh must say `{define}`");
    }

    #[test]
    fn every_entry_has_its_parameters_read_from_the_source() {
        for m in MODULES {
            for r in m.roots().unwrap() {
                for &d in &r.dtypes {
                    let p = m.params(&r.name, d);
                    assert!(
                        p.as_ref().is_some_and(|p| !p.is_empty()),
                        "{}: {}_{d}: {p:?}",
                        m.name,
                        r.name
                    );
                    // What launches look up is the same list.
                    assert_eq!(m.entry_params(&entry(&r.name, d)), p.as_deref());
                }
                let other = DType::ALL.into_iter().find(|d| !r.dtypes.contains(d));
                if let Some(d) = other {
                    assert_eq!(
                        m.params(&r.name, d),
                        None,
                        "{}_{d} is not instantiated",
                        r.name
                    );
                }
            }
        }
        assert_eq!(ELEMENTWISE.params("nope", DType::F32), None);
    }

    #[test]
    fn parameters_resolve_the_macro_types_for_the_dtype() {
        use Param::{Dst, Scalar as S, Src};
        use Scalar::*;
        assert_eq!(
            ELEMENTWISE.params("scale", DType::BF16).unwrap(),
            [Src(DType::BF16), Dst(DType::BF16), S(F32), S(U64)]
        );
        assert_eq!(
            ELEMENTWISE.params("scale", DType::I64).unwrap(),
            [Src(DType::I64), Dst(DType::I64), S(I64), S(U64)]
        );
        assert_eq!(
            ELEMENTWISE.params("cast_f16", DType::I32).unwrap(),
            [Src(DType::F16), Dst(DType::I32), S(U64)]
        );
        assert_eq!(
            ELEMENTWISE.params("sum_rows", DType::F64).unwrap(),
            [Dst(DType::F64), Src(DType::F64), S(U64), S(U64), S(I32)]
        );
        assert_eq!(
            NORM.params("layer_norm", DType::F16).unwrap(),
            [
                Dst(DType::F16),
                Dst(DType::F32),
                Dst(DType::F32),
                Src(DType::F16),
                Src(DType::F16),
                Src(DType::F16),
                S(U64),
                S(F32)
            ]
        );
        assert_eq!(
            EMBEDDING.params("embedding_i32", DType::BF16).unwrap()[1],
            Src(DType::I32)
        );
        assert_eq!(
            CROSS_ENTROPY.params("ce_loss", DType::BF16).unwrap(),
            [
                Src(DType::F64),
                Src(DType::F64),
                Src(DType::F64),
                Dst(DType::BF16),
                S(F64),
                S(U64)
            ]
        );
        assert_eq!(
            ATTENTION_BLOCK
                .params("merge_attention", DType::F64)
                .unwrap(),
            [
                Dst(DType::F64),
                Dst(DType::F64),
                Src(DType::F64),
                Src(DType::F64),
                S(U64),
                S(U64)
            ]
        );
        let adam = |d| OPTIM.params("adamw", d).unwrap();
        assert_eq!(adam(DType::F32)[2], Dst(DType::F32));
        assert_eq!(
            adam(DType::BF16)[..4],
            [
                Dst(DType::BF16),
                Src(DType::BF16),
                Dst(DType::F64),
                Dst(DType::F64)
            ]
        );
        assert_eq!(
            adam(DType::F16)[4..],
            [
                S(F64),
                S(F64),
                S(F64),
                S(F64),
                S(F64),
                S(F64),
                S(F64),
                S(U64)
            ]
        );
    }

    #[test]
    fn entries_are_unique_and_named_by_dtype() {
        let entries = |m: &KernelModule| m.entries().unwrap();
        let mut all: Vec<String> = MODULES.iter().flat_map(|m| entries(m)).collect();
        let n = all.len();
        assert!(entries(&ELEMENTWISE).contains(&"cast_bf16_i64".to_string()));
        assert!(entries(&ATTENTION_BLOCK).contains(&"merge_attention_f64".to_string()));
        assert!(
            n >= 200 + 36 + 18 + 4,
            "{n} entries in all: fewer than ever"
        );
        assert!(entries(&ROPE).contains(&"rope_bf16".to_string()));
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "duplicate kernel entry names");
    }

    type RootsAndDtypes = &'static [(&'static str, &'static [DType])];

    /// The table as it was written by hand in this file before it was read from the
    /// sources: `(module, root, dtypes)` for every root, in source order. Kernels and modules
    /// added since are in the sources only (`cuda_ptx` checks those against the compiled
    /// code): this is a record of what the reader must still find, not a list to extend.
    #[rustfmt::skip]
    const HAND_WRITTEN: &[(&str, RootsAndDtypes)] = {
        use DType::{F32, F64};
        const FLOAT: &[DType] = &DType::FLOATS;
        const ALL: &[DType] = &DType::ALL;
        const COMPUTE: &[DType] = &[F32, F64];
        &[
            ("elementwise", &[
                ("add", ALL), ("mul", ALL), ("scale", ALL), ("sub", FLOAT),
                ("add_row", FLOAT), ("mul_row", FLOAT), ("sum_rows", FLOAT),
                ("cast_f32", ALL), ("cast_f64", ALL), ("cast_bf16", ALL),
                ("cast_f16", ALL), ("cast_i32", ALL), ("cast_i64", ALL),
            ]),
            ("activation", &[
                ("gelu", FLOAT), ("gelu_backward", FLOAT), ("silu", FLOAT),
                ("silu_backward", FLOAT), ("swiglu", FLOAT), ("swiglu_backward", FLOAT),
            ]),
            ("reduction", &[
                ("sum_dim", FLOAT), ("sum_dim_backward", FLOAT), ("max_dim", FLOAT),
                ("max_dim_backward", FLOAT),
            ]),
            ("softmax", &[
                ("softmax", FLOAT), ("log_softmax", FLOAT), ("softmax_backward", FLOAT),
                ("log_softmax_backward", FLOAT),
            ]),
            ("norm", &[
                ("layer_norm", FLOAT), ("rms_norm", FLOAT), ("layer_norm_backward_dx", FLOAT),
                ("rms_norm_backward_dx", FLOAT), ("layer_norm_backward_dw", FLOAT),
                ("rms_norm_backward_dw", FLOAT),
            ]),
            ("embedding", &[
                ("embedding_i64", FLOAT), ("embedding_i32", FLOAT),
                ("embedding_backward", FLOAT),
            ]),
            ("cross_entropy", &[
                ("ce_row_max", FLOAT), ("ce_sum_target", FLOAT), ("ce_loss", FLOAT),
                ("ce_grad", FLOAT),
            ]),
            ("copy", &[("copy_blocks", ALL)]),
            ("attention", &[
                ("attn_load_q", FLOAT), ("attn_load_kv", FLOAT), ("attn_forward", FLOAT),
                ("attn_backward_dq", FLOAT), ("attn_backward_dkv", FLOAT),
                ("attn_backward_kv_sum", FLOAT),
            ]),
            ("attention_block", &[
                ("attn_block_load_q", FLOAT), ("attn_block_load_kv", FLOAT),
                ("attn_block_masked", FLOAT), ("attn_block_forward", FLOAT),
                ("attn_block_backward_dq", FLOAT), ("attn_block_backward_dkv", FLOAT),
                ("attn_block_kv_add", FLOAT), ("fuse_qkv_grad", FLOAT), ("merge_attention", COMPUTE), ("gather_rows", ALL),
            ]),
            ("moe", &[("scatter_add_rows", ALL)]),
            ("reduce_ext", &[("reduce_combine", ALL), ("reduce_avg_div", ALL)]),
            ("optim", &[("adamw", FLOAT)]),
            ("rope", &[("rope", FLOAT)]),
        ]
    };

    #[test]
    fn roots_read_from_the_sources_equal_the_hand_written_table() {
        for &(name, roots) in HAND_WRITTEN {
            let m = MODULES
                .iter()
                .find(|m| m.name == name)
                .unwrap_or_else(|| panic!("module {name} (kernels/{name}.cu) is gone"));
            let expected: Vec<Root> = roots
                .iter()
                .map(|&(name, dtypes)| Root {
                    name: name.into(),
                    dtypes: dtypes.to_vec(),
                })
                .collect();
            let read: Vec<Root> = m
                .roots()
                .unwrap()
                .iter()
                .filter(|r| roots.iter().any(|&(name, _)| name == r.name))
                .cloned()
                .collect();
            assert_eq!(read, expected, "module {}", m.name);
        }
    }

    #[test]
    fn every_cu_file_is_a_module() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/cuda/kernels");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| {
                let name = e.unwrap().file_name().into_string().unwrap();
                Some(name.strip_suffix(".cu")?.to_string())
            })
            .collect();
        files.sort();
        let mut names: Vec<&str> = MODULES.iter().map(|m| m.name).collect();
        names.sort();
        assert_eq!(
            files, names,
            "MODULES is not the .cu files of kernels/ (kernels/build.rs declares them)"
        );
    }

    #[test]
    fn a_kernel_the_reader_cannot_place_is_an_error() {
        let err = |source: &'static str| {
            let m = Box::leak(Box::new(KernelModule::new("bad", source)));
            let e = m.roots().unwrap_err().to_string();
            assert_eq!(m.entries().unwrap_err().to_string(), e);
            assert_eq!(m.params("k", DType::F32), None);
            assert!(e.contains("kernel module `bad`"), "{e}");
            e
        };
        // Defined, never instantiated: the author forgot `FLOATS(K_ENTRIES)`.
        let e = err("#define K_ENTRIES(N, T) extern \"C\" __global__ void k_##N(T* x) {}\n");
        assert!(
            e.contains("`k` is defined but no macro call instantiates it"),
            "{e}"
        );
        let e = err("extern \"C\" __global__ void k_f8(float* x) {}");
        assert!(e.contains("`k_f8` is not named `<root>_<dtype>`"), "{e}");
        let e = err("#if 1\nextern \"C\" __global__ void k_f32(float* x) {}\n#endif");
        assert!(e.contains("`#if`"), "{e}");
        let e = err("__global__ void k_f32(float* x) {}");
        assert!(e.contains("extern"), "{e}");
        let e = err(
            "#define K(N, T) extern \"C\" __global__ void k_##N(T* x) {}\nK(f32) K(f32, float)",
        );
        assert!(e.contains("takes 2 arguments, given 1"), "{e}");
        let e = err("#define K(N, T) extern \"C\" __global__ void k_##N(T* x) {}\nK(f32, float) K(f32, float)");
        assert!(e.contains("`k_f32` is defined twice"), "{e}");
        // Instantiated from the source, one root per macro, for the dtypes the macro is called with.
        let m = Box::leak(Box::new(KernelModule::new(
            "good",
            "#define K(N, T) extern \"C\" __global__ void k_##N(T* x, u64 n) {}\nK(f64, double) K(i32, int) K(f32, float)",
        )));
        assert_eq!(
            m.roots().unwrap(),
            [Root {
                name: "k".into(),
                dtypes: vec![DType::F32, DType::F64, DType::I32]
            }]
        );
        assert_eq!(
            m.params("k", DType::I32).unwrap(),
            [Param::Dst(DType::I32), Param::Scalar(Scalar::U64)]
        );
    }
}
