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

/// `optim.cu`: the AdamW step (`cuda::ops::adamw_step`), in place on the parameter and its
/// two moments; the host step's formula and order of operations (nn's `AdamW`).
pub static OPTIM: KernelModule = KernelModule {
    name: "optim",
    source: include_str!("kernels/optim.cu"),
    roots: &[("adamw", Float)],
};

/// Every kernel module.
pub static MODULES: [&KernelModule; 13] = [
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
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_size_matches_the_kernels() {
        let define = format!("#define ROW_THREADS {}", crate::cuda::ops::THREADS);
        assert!(COMMON.contains(&define), "common.cuh must say `{define}`");
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
        assert_eq!(n, 200 + 36 + 18 + 4, "entries of all modules");
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
