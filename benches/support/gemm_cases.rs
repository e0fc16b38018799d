//! Transformer-shaped matmuls for `benches/gemm.rs` and `examples/bench_report.rs`: our
//! wrapper (`ops::matmul_into`) against the `gemm` crate called directly on the same
//! buffers, single-threaded.

use dtensor::kernels::ops::{matmul_into, Accum, Parallelism, Transpose};
use dtensor::prelude::{DType, Tensor};

/// `(name, m, n, k, transpose a, transpose b)`: tokens × hidden 1024 MLP and projection
/// shapes, forward and the weight-gradient form (`dW = dyᵀ·x`).
pub const CASES: [(&str, usize, usize, usize, bool, bool); 4] = [
    ("qkv_fwd 2048x3072x1024", 2048, 3072, 1024, false, true),
    ("mlp_up_fwd 2048x4096x1024", 2048, 4096, 1024, false, true),
    ("mlp_down_fwd 2048x1024x4096", 2048, 1024, 4096, false, true),
    ("mlp_up_dw 4096x1024x2048", 4096, 1024, 2048, true, false),
];

pub struct GemmCase {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    ta: bool,
    tb: bool,
    a: Tensor,
    b: Tensor,
    dst: Tensor,
}

impl GemmCase {
    pub fn new(m: usize, n: usize, k: usize, ta: bool, tb: bool) -> GemmCase {
        let a_shape = if ta { [k, m] } else { [m, k] };
        let b_shape = if tb { [n, k] } else { [k, n] };
        GemmCase {
            m,
            n,
            k,
            ta,
            tb,
            a: Tensor::from_fn(&a_shape, |i| ((i % 97) as f32 - 48.0) / 64.0),
            b: Tensor::from_fn(&b_shape, |i| ((i % 89) as f32 - 44.0) / 64.0),
            dst: Tensor::zeros(&[m, n], DType::F32),
        }
    }

    pub fn flops(&self) -> u64 {
        2 * (self.m * self.n * self.k) as u64
    }

    /// Through our wrapper.
    pub fn run_ours(&mut self) {
        let t = |x| if x { Transpose::Yes } else { Transpose::No };
        matmul_into(
            &mut self.dst,
            &self.a,
            t(self.ta),
            &self.b,
            t(self.tb),
            Accum::Replace,
            Parallelism::None,
        )
        .expect("matmul");
    }

    /// The `gemm` crate directly, same buffers, same strides.
    pub fn run_direct(&mut self) {
        let (m, n, k) = (self.m, self.n, self.k);
        // Row-major `[r, c]` read as is: column stride 1, row stride c; read transposed:
        // the two swap.
        let (a_cs, a_rs) = if self.ta {
            (m as isize, 1)
        } else {
            (1, k as isize)
        };
        let (b_cs, b_rs) = if self.tb {
            (k as isize, 1)
        } else {
            (1, n as isize)
        };
        let a = self.a.as_slice::<f32>().unwrap().as_ptr();
        let b = self.b.as_slice::<f32>().unwrap().as_ptr();
        let d = self.dst.as_mut_slice::<f32>().unwrap().as_mut_ptr();
        // SAFETY: the buffers hold exactly the m·k, k·n and m·n elements these strides
        // address; `d` is uniquely borrowed and does not alias `a` or `b`.
        unsafe {
            gemm::gemm(
                m,
                n,
                k,
                d,
                1,
                n as isize,
                false,
                a,
                a_cs,
                a_rs,
                b,
                b_cs,
                b_rs,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
    }
}
