//! Transformer-shaped matmuls for `benches/gemm.rs` and `examples/bench_report.rs`: our
//! wrapper (`ops::matmul_into`) against the `gemm` crate called directly on the same
//! buffers, single-threaded.

use dtensor::kernels::ops::{matmul_into, Accum, Parallelism, Transpose};
use dtensor::prelude::{DType, Tensor};

/// `(name, m, n, k, transpose a, transpose b)`: a square 1024³ product (the figure usually
/// quoted for a CPU's matmul rate), then tokens × hidden 1024 MLP and projection shapes,
/// forward and the weight-gradient form (`dW = dyᵀ·x`).
pub const CASES: [(&str, usize, usize, usize, bool, bool); 5] = [
    ("square 1024x1024x1024", 1024, 1024, 1024, false, false),
    ("qkv_fwd 2048x3072x1024", 2048, 3072, 1024, false, true),
    ("mlp_up_fwd 2048x4096x1024", 2048, 4096, 1024, false, true),
    ("mlp_down_fwd 2048x1024x4096", 2048, 1024, 4096, false, true),
    ("mlp_up_dw 4096x1024x2048", 4096, 1024, 2048, true, false),
];

/// One product and its buffers. The dimensions are not stored but read off the tensors'
/// shapes: [`GemmCase::run_direct`] hands gemm raw pointers, so `m`, `n`, `k` must be the
/// ones the buffers were made for, and no field may be edited to disagree with them.
pub struct GemmCase {
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
            ta,
            tb,
            a: Tensor::from_fn(&a_shape, |i| ((i % 97) as f32 - 48.0) / 64.0),
            b: Tensor::from_fn(&b_shape, |i| ((i % 89) as f32 - 44.0) / 64.0),
            dst: Tensor::zeros(&[m, n], DType::F32),
        }
    }

    /// `(m, n, k)`, from the operands' shapes.
    ///
    /// # Panics
    /// If the operands' inner dimensions differ.
    pub fn dims(&self) -> (usize, usize, usize) {
        let (a, b) = (self.a.shape(), self.b.shape());
        let (m, k) = if self.ta { (a[1], a[0]) } else { (a[0], a[1]) };
        let (k2, n) = if self.tb { (b[1], b[0]) } else { (b[0], b[1]) };
        assert_eq!(
            k, k2,
            "gemm case: inner dimensions of {a:?} and {b:?} differ"
        );
        (m, n, k)
    }

    pub fn flops(&self) -> u64 {
        let (m, n, k) = self.dims();
        2 * (m as u64) * (n as u64) * (k as u64)
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
    ///
    /// # Panics
    /// If the buffers do not hold exactly the `m·k`, `k·n` and `m·n` elements of the
    /// product (checked before gemm sees a pointer).
    pub fn run_direct(&mut self) {
        let (m, n, k) = self.dims();
        assert_eq!(
            self.dst.shape(),
            &[m, n],
            "gemm case: dst does not have the product's shape"
        );
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
        let a = self.a.as_slice::<f32>().unwrap();
        let b = self.b.as_slice::<f32>().unwrap();
        let d = self.dst.as_mut_slice::<f32>().unwrap();
        assert!(
            a.len() == m * k && b.len() == k * n && d.len() == m * n,
            "gemm case: buffer lengths do not match m={m}, n={n}, k={k}"
        );
        let (a, b, d) = (a.as_ptr(), b.as_ptr(), d.as_mut_ptr());
        // SAFETY: the buffers hold exactly the m·k, k·n and m·n elements these strides
        // address (asserted above, with m, n, k read off the same tensors); `d` is uniquely
        // borrowed and does not alias `a` or `b`.
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

#[cfg(test)]
mod tests {
    // Run by `tests/gemm_cases.rs`. A bench target (no test harness) is also built with
    // `cfg(test)` by `clippy --all-targets`, and drops the `#[test]` fns: the import is
    // unused there.
    #[allow(unused_imports)]
    use super::*;

    #[test]
    fn run_direct_small_cases_match_run_ours() {
        for (ta, tb) in [(false, false), (false, true), (true, false), (true, true)] {
            let mut case = GemmCase::new(5, 3, 4, ta, tb);
            case.run_ours();
            let ours = case.dst.as_slice::<f32>().unwrap().to_vec();
            case.dst = Tensor::zeros(&[5, 3], DType::F32);
            case.run_direct();
            assert_eq!(
                case.dst.as_slice::<f32>().unwrap(),
                ours,
                "ta={ta}, tb={tb}"
            );
        }
    }

    #[test]
    #[should_panic(expected = "dst does not have the product's shape")]
    fn run_direct_dst_too_small_panics() {
        // The audit's case: dimensions for 48 rows over buffers made for 32. Only a `dst`
        // of another shape can express that now, and gemm must never see it.
        let mut case = GemmCase::new(32, 32, 32, false, false);
        case.dst = Tensor::zeros(&[32, 16], DType::F32);
        case.run_direct();
    }

    #[test]
    #[should_panic(expected = "inner dimensions")]
    fn run_direct_operands_mismatched_panics() {
        let mut case = GemmCase::new(32, 32, 32, false, false);
        case.a = Tensor::zeros(&[48, 16], DType::F32);
        case.run_direct();
    }
}
