//! A run's [`Composition`] applied to the model builders: the switches of the composition
//! that live in the GPT's configuration (master dtype, precision, recomputation, attention
//! over `Cp`). The pipeline schedule comes from
//! [`pipeline::for_composition`](crate::pipeline::for_composition); the data mode picks the
//! type-level marker (`Ddp`, `Zero1`, `Zero2`, `Fsdp`) the caller instantiates.
//!
//! ```
//! use dtensor_nn::GptConfig;
//! use dtensor_placement::Composition;
//! let c: Composition = "dp=2,fsdp,bf16,recompute".parse().unwrap();
//! let cfg = GptConfig::small(dtensor_kernels::DType::F64).composed(&c);
//! assert_eq!(cfg.dtype, dtensor_kernels::DType::F32);
//! assert!(cfg.recompute && cfg.precision.reshard_after_forward);
//! ```

use crate::{ContextParallel, GptConfig, Precision};
use dtensor_kernels::DType;
use dtensor_placement::{Composition, DataKind, MasterDType};

/// The dtype of `c`'s masters.
pub fn master_dtype(c: &Composition) -> DType {
    match c.dtype {
        MasterDType::F32 => DType::F32,
        MasterDType::F64 => DType::F64,
    }
}

/// `c`'s precision: bf16 compute with an f32 or bf16 reduction under `bf16`, and the FSDP
/// switches (gather again in the backward; prefetch with `overlap`), which the other data
/// modes ignore and so are set only under FSDP.
pub fn precision(c: &Composition) -> Precision {
    let base = if c.bf16 {
        let reduce = if c.reduce_bf16 {
            DType::BF16
        } else {
            DType::F32
        };
        Precision::mixed(DType::BF16, reduce)
    } else {
        Precision::default()
    };
    let fsdp = c.data == DataKind::Fsdp;
    base.resharded(fsdp && c.reshard)
        .prefetched(fsdp && c.overlap)
}

impl GptConfig {
    /// The same model with the switches `c` decides: master dtype, [`precision`],
    /// recomputation and attention over `Cp`. Shapes, seed and MoE stay as they are.
    pub fn composed(self, c: &Composition) -> GptConfig {
        GptConfig {
            dtype: master_dtype(c),
            precision: precision(c),
            recompute: c.recompute,
            context: ContextParallel {
                strategy: c.cp_strategy,
                zigzag: c.zigzag,
            },
            ..self
        }
    }
}
