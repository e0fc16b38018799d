//! Deterministic, layout-independent initialisation.
//!
//! Every element of a parameter is a pure function of `(seed, parameter id, global flat
//! index)` (a counter-based generator: splitmix64 of the three, Box-Muller for normals).
//! So a rank computes only its own slice, nothing is communicated, and a parameter built
//! at `tp = k` equals the matching slice of the one built at `tp = 1` with the same seed.
//!
//! [`ParamInit`] is what a layer's constructor takes: the seed, the id of its first
//! parameter, the standard deviations and the masters' dtype and precision.

use crate::data::Precision;
use dtensor_core::{DTensor, DeviceMesh, Result};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::Layout;
use std::sync::Arc;

/// How a parameter's elements are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Normal with mean 0 and this standard deviation.
    Normal {
        /// The standard deviation (0 gives zeros).
        std: f64,
    },
    /// Uniform on `[-bound, bound]`.
    Uniform {
        /// Half the interval's width.
        bound: f64,
    },
    /// Every element this value (norm weights: 1, biases: 0).
    Constant(f64),
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform draw in `(0, 1)` for the counter `(seed, id, i)`.
fn unit(seed: u64, id: u64, i: u64) -> f64 {
    let h = splitmix64(splitmix64(splitmix64(seed) ^ id) ^ i);
    ((h >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

impl Init {
    /// The element at global flat index `i` of parameter `id` under `seed`.
    pub fn value(self, seed: u64, id: u64, i: u64) -> f64 {
        match self {
            Init::Normal { std } => {
                let (u1, u2) = (unit(seed, id, 2 * i), unit(seed, id, 2 * i + 1));
                std * (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
            }
            Init::Uniform { bound } => bound * (2.0 * unit(seed, id, i) - 1.0),
            Init::Constant(c) => c,
        }
    }

    /// The whole tensor of `shape` (what one rank holds at `tp = dp = 1`).
    pub fn full(self, seed: u64, id: u64, shape: &[usize], dtype: DType) -> Tensor {
        let t = Tensor::from_fn(shape, |i| self.value(seed, id, i as u64));
        if dtype == DType::F64 {
            t
        } else {
            t.to_dtype(dtype)
        }
    }

    /// This rank's piece of a parameter of `global_shape` laid out as `L` (no `Partial`
    /// axis), computed locally.
    pub fn param<L: Layout>(
        self,
        seed: u64,
        id: u64,
        global_shape: &[usize],
        dtype: DType,
        mesh: &Arc<DeviceMesh>,
    ) -> Result<DTensor<L>> {
        DTensor::from_global_fn(global_shape, dtype, mesh, |i| {
            self.value(seed, id, i as u64)
        })
    }
}

/// Where a layer's parameters come from: a seed, the id of the layer's first parameter
/// (each parameter takes the next id), and the weights' standard deviation.
#[derive(Clone, Copy, Debug)]
pub struct ParamInit {
    /// The model's seed: every element is a function of it, the parameter id and the
    /// element's global index.
    pub seed: u64,
    /// The id of the layer's first parameter.
    pub id: u64,
    /// Weights' standard deviation (drawn `Normal(0, std)`).
    pub std: f64,
    /// Biases' standard deviation (0: zeros, as Megatron initialises them).
    pub bias_std: f64,
    /// The masters' dtype.
    pub dtype: DType,
    /// Compute and reduction dtypes, FSDP's reshard flag.
    pub precision: Precision,
}

impl ParamInit {
    /// Weights `Normal(0, std)` and zero biases in `dtype`, ids from `id`, the default
    /// [`Precision`] (compute and reduce in the masters' dtype).
    pub fn new(seed: u64, id: u64, std: f64, dtype: DType) -> Self {
        ParamInit {
            seed,
            id,
            std,
            bias_std: 0.0,
            dtype,
            precision: Precision::default(),
        }
    }
    /// The same init with these dtypes and flags for the parameters.
    pub fn with_precision(self, precision: Precision) -> Self {
        ParamInit { precision, ..self }
    }
    /// The same init for the parameter ids starting at `id`.
    pub fn with_id(self, id: u64) -> Self {
        ParamInit { id, ..self }
    }
    /// The same init with biases drawn `Normal(0, bias_std)`.
    pub fn with_bias_std(self, bias_std: f64) -> Self {
        ParamInit { bias_std, ..self }
    }
    /// The bias init.
    pub fn bias(&self) -> Init {
        Init::Normal { std: self.bias_std }
    }
}
