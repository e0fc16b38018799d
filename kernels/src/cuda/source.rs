//! The CUDA C sources of the kernels and the table of their entry points.
//!
//! Each module is `common.cuh` followed by one `.cu` file, compiled by NVRTC as one program.
//! Entry points are named `<root>_<dtype>` (`gelu_bf16`, `copy_blocks_i64`); the casts are
//! `cast_<from>_<to>`. [`KernelModule::entries`] lists every one, so a test can assert that the
//! compiled code has them all and a launch can never name a kernel that does not exist.

use crate::DType;

/// Prepended to every module: the 16-bit types, compute-type traits, block reductions.
pub const COMMON: &str = include_str!("kernels/common.cuh");

/// Which dtypes a kernel root is instantiated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtypes {
    /// `f32`, `f64`, `bf16`, `f16`.
    Float,
    /// The float types and `i32`, `i64`.
    All,
    /// The compute types `f32`, `f64` (kernels on partial results kept in them).
    Compute,
}

impl Dtypes {
    /// The dtypes, in the order of the `FLOATS` / `ALL_TYPES` macros of `common.cuh`.
    pub fn list(self) -> &'static [DType] {
        match self {
            Dtypes::Float => &DType::FLOATS,
            Dtypes::All => &DType::ALL,
            Dtypes::Compute => &[DType::F32, DType::F64],
        }
    }
}

/// One NVRTC program: a `.cu` source and the kernel roots it defines.
#[derive(Debug)]
pub struct KernelModule {
    /// The module's name (the `.cu` file's stem).
    pub name: &'static str,
    /// The `.cu` source (without [`COMMON`]).
    pub source: &'static str,
    /// Kernel roots and the dtypes each is instantiated for.
    pub roots: &'static [(&'static str, Dtypes)],
}

impl KernelModule {
    /// The full program text NVRTC compiles.
    pub fn program(&self) -> String {
        format!("{COMMON}\n// ---- {}.cu\n{}", self.name, self.source)
    }

    /// Every `extern "C"` entry point of the module.
    pub fn entries(&self) -> Vec<String> {
        self.roots
            .iter()
            .flat_map(|&(root, dt)| dt.list().iter().map(move |d| format!("{root}_{d}")))
            .collect()
    }
}

/// `root_dtype`, the entry name of a kernel for one dtype.
pub fn entry(root: &str, dtype: DType) -> String {
    format!("{root}_{dtype}")
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

/// The parsed definitions of every module, by module name (parsed once per process).
fn definitions(module: &KernelModule) -> Option<&'static [(String, Vec<CParam>)]> {
    use std::collections::HashMap;
    use std::sync::OnceLock;
    type Defs = HashMap<&'static str, Vec<(String, Vec<CParam>)>>;
    static DEFS: OnceLock<Defs> = OnceLock::new();
    DEFS.get_or_init(|| {
        MODULES
            .iter()
            .map(|m| (m.name, parse_entries(m.source)))
            .collect()
    })
    .get(module.name)
    .map(Vec::as_slice)
}

impl KernelModule {
    /// The parameters of the entry `root_dtype`, read from its `extern "C"` definition in the
    /// `.cu` source with the macro's type names resolved for `dtype` (`T`, `Tr<T>::A`, the
    /// casts' `S`/`D`, `AdamS<T>::S`, …). `None` when the module defines no such root for
    /// that dtype or a type is not one the launches know.
    ///
    /// Every launch compares what it pushes with this list before launching (a mismatch is
    /// an `Err`, not undefined behaviour on the GPU), and the no-GPU test `cuda_ptx` checks
    /// the list against the parameters of the compiled PTX.
    pub fn params(&self, root: &str, dtype: DType) -> Option<Vec<Param>> {
        if !self
            .roots
            .iter()
            .any(|&(r, dts)| r == root && dts.list().contains(&dtype))
        {
            return None;
        }
        // `cast_<from>` roots share the one `cast_##SN##_##DN` definition.
        let (defined, from) = match root.strip_prefix("cast_") {
            Some(f) => ("cast", DType::ALL.into_iter().find(|d| d.to_string() == f)),
            None => (root, None),
        };
        let (_, params) = definitions(self)?.iter().find(|(r, _)| r == defined)?;
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
}

impl KernelModule {
    /// [`params`](Self::params) of the entry `name` (`root_dtype`), resolved once per
    /// process for every entry of every module: each launch looks its kernel's list up here
    /// rather than resolving the source's type names again.
    pub(crate) fn entry_params(&self, name: &str) -> Option<&'static [Param]> {
        use std::collections::HashMap;
        use std::sync::OnceLock;
        type Resolved = HashMap<&'static str, HashMap<String, Vec<Param>>>;
        static RESOLVED: OnceLock<Resolved> = OnceLock::new();
        RESOLVED
            .get_or_init(|| {
                MODULES
                    .iter()
                    .map(|m| {
                        let entries = m
                            .roots
                            .iter()
                            .flat_map(|&(root, dtypes)| {
                                dtypes.list().iter().filter_map(move |&d| {
                                    Some((entry(root, d), m.params(root, d)?))
                                })
                            })
                            .collect();
                        (m.name, entries)
                    })
                    .collect()
            })
            .get(self.name)?
            .get(name)
            .map(Vec::as_slice)
    }
}

use Dtypes::{All, Compute, Float};

/// `elementwise.cu`: `add`, `mul`, `scale` (all six dtypes; integers wrap), `sub`, the bias
/// row ops `add_row` / `mul_row` and the column sums `sum_rows` (floats), and the dtype casts
/// `cast_<from>_<to>` between all six dtypes (`Tensor::to_dtype`): one grid-stride thread
/// per element (per column for `sum_rows`), rounding once as the CPU does.
pub static ELEMENTWISE: KernelModule = KernelModule {
    name: "elementwise",
    source: include_str!("kernels/elementwise.cu"),
    roots: &[
        ("add", All),
        ("mul", All),
        ("scale", All),
        ("sub", Float),
        ("add_row", Float),
        ("mul_row", Float),
        ("sum_rows", Float),
        ("cast_f32", All),
        ("cast_f64", All),
        ("cast_bf16", All),
        ("cast_f16", All),
        ("cast_i32", All),
        ("cast_i64", All),
    ],
};

/// `activation.cu`: GELU (tanh form), SiLU and SwiGLU and their backward, float dtypes,
/// with the CPU's formulas and its f32 `exp`, so f32/bf16/f16 match the CPU bit for bit.
pub static ACTIVATION: KernelModule = KernelModule {
    name: "activation",
    source: include_str!("kernels/activation.cu"),
    roots: &[
        ("gelu", Float),
        ("gelu_backward", Float),
        ("silu", Float),
        ("silu_backward", Float),
        ("swiglu", Float),
        ("swiglu_backward", Float),
    ],
};

/// `reduction.cu`: `sum_dim` and `max_dim` (value and `i64` argmax) along one dim of a tensor
/// seen as `[outer, extent, inner]`, and their backward; one thread per output element,
/// reducing in index order as the CPU does.
pub static REDUCTION: KernelModule = KernelModule {
    name: "reduction",
    source: include_str!("kernels/reduction.cu"),
    roots: &[
        ("sum_dim", Float),
        ("sum_dim_backward", Float),
        ("max_dim", Float),
        ("max_dim_backward", Float),
    ],
};

/// `softmax.cu`: softmax and log-softmax along the last dim and their backward from the
/// forward output; one block of `ROW_THREADS` per row, with fixed-order block reductions
/// (deterministic, equal to the CPU to rounding).
pub static SOFTMAX: KernelModule = KernelModule {
    name: "softmax",
    source: include_str!("kernels/softmax.cu"),
    roots: &[
        ("softmax", Float),
        ("log_softmax", Float),
        ("softmax_backward", Float),
        ("log_softmax_backward", Float),
    ],
};

/// `norm.cu`: LayerNorm and RMSNorm over the last dim: the forward (writing the per-row
/// `mean` / `rstd` in the compute type), `dx` (one block per row), and `dweight` / `dbias`
/// (one thread per column, rows summed in the CPU's order).
pub static NORM: KernelModule = KernelModule {
    name: "norm",
    source: include_str!("kernels/norm.cu"),
    roots: &[
        ("layer_norm", Float),
        ("rms_norm", Float),
        ("layer_norm_backward_dx", Float),
        ("rms_norm_backward_dx", Float),
        ("layer_norm_backward_dw", Float),
        ("rms_norm_backward_dw", Float),
    ],
};

/// `embedding.cu`: the gather of table rows by `i64` or `i32` ids (ids outside the shard
/// give zeros) and its backward, a deterministic scatter-add over host-sorted positions (one
/// block per table row, no float atomics).
pub static EMBEDDING: KernelModule = KernelModule {
    name: "embedding",
    source: include_str!("kernels/embedding.cu"),
    roots: &[
        ("embedding_i64", Float),
        ("embedding_i32", Float),
        ("embedding_backward", Float),
    ],
};

/// `cross_entropy.cu`: the per-rank pieces of the vocab-parallel cross-entropy, in `f64`:
/// row maxima (`ce_row_max`), the sums of `exp(l - max)` and the target logit
/// (`ce_sum_target`), the loss (`ce_loss`) and the logits' gradient (`ce_grad`), with the
/// all-reduces over the vocab axis done by the caller between them.
pub static CROSS_ENTROPY: KernelModule = KernelModule {
    name: "cross_entropy",
    source: include_str!("kernels/cross_entropy.cu"),
    roots: &[
        ("ce_row_max", Float),
        ("ce_sum_target", Float),
        ("ce_loss", Float),
        ("ce_grad", Float),
    ],
};

/// `copy.cu`: `copy_blocks`, a strided copy of equal runs of elements (all six dtypes,
/// bitwise), the data movement of `pack`, `unpack`, `narrow` and `cat`.
pub static COPY: KernelModule = KernelModule {
    name: "copy",
    source: include_str!("kernels/copy.cu"),
    roots: &[("copy_blocks", All)],
};

/// `attention.cu`: causal self-attention with RoPE on a fused QKV: `attn_load` (splits,
/// rotates and scales q/k/v into the compute type), `attn_forward` (output and per-row
/// log-sum-exp) and the backward `attn_backward_dq` / `attn_backward_dkv`. One block per
/// (head, sample, row), with the row's scores in dynamic shared memory.
pub static ATTENTION: KernelModule = KernelModule {
    name: "attention",
    source: include_str!("kernels/attention.cu"),
    roots: &[
        ("attn_load", Float),
        ("attn_forward", Float),
        ("attn_backward_dq", Float),
        ("attn_backward_dkv", Float),
    ],
};

/// `attention_block.cu`: the context-parallel (ring) attention pieces: blockwise attention of
/// a query block to a key/value block at given positions (`attn_block_load_q` /
/// `attn_block_load_kv` load and rotate the operands, `attn_block_forward` gives the partial
/// output and lse in the compute type, `attn_block_masked` a fully masked block's), its backward
/// share `attn_block_backward_dq` / `attn_block_backward_dkv` (added into compute-type
/// accumulators), `merge_attention` (compute types), `fuse_qkv_grad` and the bitwise row gather
/// `gather_rows` (all six dtypes). Same structure as `attention.cu`: one block per (head,
/// sample, row), scores in dynamic shared memory.
pub static ATTENTION_BLOCK: KernelModule = KernelModule {
    name: "attention_block",
    source: include_str!("kernels/attention_block.cu"),
    roots: &[
        ("attn_block_load_q", Float),
        ("attn_block_load_kv", Float),
        ("attn_block_masked", Float),
        ("attn_block_forward", Float),
        ("attn_block_backward_dq", Float),
        ("attn_block_backward_dkv", Float),
        ("fuse_qkv_grad", Float),
        ("merge_attention", Compute),
        ("gather_rows", All),
    ],
};

/// `moe.cu`: `scatter_add_rows` (all six dtypes), a deterministic scatter-add over
/// host-sorted sources summed in f64 in the CPU's order (bitwise the CPU's result). The
/// grouped products are cuBLAS calls.
pub static MOE: KernelModule = KernelModule {
    name: "moe",
    source: include_str!("kernels/moe.cu"),
    roots: &[("scatter_add_rows", All)],
};

/// `reduce_ext.cu`: the collectives' element-wise reductions on device buffers,
/// `reduce_combine` (Sum/Avg, Max, Min: one `int` op code) and `reduce_avg_div` (Avg's final
/// division), all six dtypes, bitwise the CPU's `reduce::combine` / `div_count`.
pub static REDUCE_EXT: KernelModule = KernelModule {
    name: "reduce_ext",
    source: include_str!("kernels/reduce_ext.cu"),
    roots: &[("reduce_combine", All), ("reduce_avg_div", All)],
};

/// `rope.cu`: rotary position embedding (`ops::rope`), both pair conventions and a rotary
/// dim below the head dim, forward and backward in one kernel (the sign of the sines), with
/// the CPU's expressions and its host-built `f64` tables rounded once, so results match the
/// CPU bit for bit (checked on a GPU by `cuda_gpu.rs`).
pub static ROPE: KernelModule = KernelModule {
    name: "rope",
    source: include_str!("kernels/rope.cu"),
    roots: &[("rope", Float)],
};

/// `optim.cu`: the AdamW step (`ops::adamw_step`), in place on the parameter and its
/// two moments; the host step's formula and order of operations (nn's `AdamW`).
pub static OPTIM: KernelModule = KernelModule {
    name: "optim",
    source: include_str!("kernels/optim.cu"),
    roots: &[("adamw", Float)],
};

/// Every kernel module.
pub static MODULES: [&KernelModule; 14] = [
    &ELEMENTWISE,
    &ACTIVATION,
    &REDUCTION,
    &SOFTMAX,
    &NORM,
    &EMBEDDING,
    &CROSS_ENTROPY,
    &COPY,
    &ATTENTION,
    &ATTENTION_BLOCK,
    &MOE,
    &REDUCE_EXT,
    &OPTIM,
    &ROPE,
];

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
            for &(root, dts) in m.roots {
                for &d in dts.list() {
                    let p = m.params(root, d);
                    assert!(
                        p.as_ref().is_some_and(|p| !p.is_empty()),
                        "{}: {root}_{d}: {p:?}",
                        m.name
                    );
                    // What launches look up is the same list, resolved once.
                    assert_eq!(m.entry_params(&entry(root, d)), p.as_deref());
                }
                let other = DType::ALL.into_iter().find(|d| !dts.list().contains(d));
                if let Some(d) = other {
                    assert_eq!(m.params(root, d), None, "{root}_{d} is not instantiated");
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
            [Src(DType::F64), Src(DType::F64), Dst(DType::BF16), S(U64)]
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
        let mut all: Vec<String> = MODULES.iter().flat_map(|m| m.entries()).collect();
        let n = all.len();
        assert_eq!(ELEMENTWISE.entries().len(), 3 * 6 + 4 * 4 + 6 * 6);
        assert!(ELEMENTWISE.entries().contains(&"cast_bf16_i64".to_string()));
        assert_eq!(ATTENTION_BLOCK.entries().len(), 7 * 4 + 2 + 6);
        assert!(ATTENTION_BLOCK
            .entries()
            .contains(&"merge_attention_f64".to_string()));
        assert_eq!(MOE.entries().len() + REDUCE_EXT.entries().len(), 3 * 6);
        assert_eq!(
            OPTIM.entries().len(),
            4,
            "adamw_step for the four float dtypes"
        );
        assert_eq!(ROPE.entries().len(), 4, "rope for the four float dtypes");
        assert_eq!(n, 200 + 36 + 18 + 4 + 4, "entries of all modules");
        all.sort();
        all.dedup();
        assert_eq!(all.len(), n, "duplicate kernel entry names");
        for m in MODULES {
            for e in m.entries() {
                // Every entry is defined by a macro of its .cu file: the root must appear there.
                let root = e.rsplit_once('_').unwrap().0;
                let root = root.strip_prefix("cast_").map_or(root, |_| "cast");
                assert!(m.source.contains(root), "{e}: root not in {}.cu", m.name);
            }
        }
    }
}
