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
}

impl Dtypes {
    /// The dtypes, in the order of the `FLOATS` / `ALL_TYPES` macros of `common.cuh`.
    pub fn list(self) -> &'static [DType] {
        const ALL: [DType; 6] = [
            DType::F32,
            DType::F64,
            DType::BF16,
            DType::F16,
            DType::I32,
            DType::I64,
        ];
        match self {
            Dtypes::Float => &ALL[..4],
            Dtypes::All => &ALL,
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

use Dtypes::{All, Float};

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

pub static EMBEDDING: KernelModule = KernelModule {
    name: "embedding",
    source: include_str!("kernels/embedding.cu"),
    roots: &[
        ("embedding_i64", Float),
        ("embedding_i32", Float),
        ("embedding_backward", Float),
    ],
};

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

pub static COPY: KernelModule = KernelModule {
    name: "copy",
    source: include_str!("kernels/copy.cu"),
    roots: &[("copy_blocks", All)],
};

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

/// Every kernel module.
pub static MODULES: [&KernelModule; 9] = [
    &ELEMENTWISE,
    &ACTIVATION,
    &REDUCTION,
    &SOFTMAX,
    &NORM,
    &EMBEDDING,
    &CROSS_ENTROPY,
    &COPY,
    &ATTENTION,
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
