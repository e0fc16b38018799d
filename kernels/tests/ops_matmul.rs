//! `ops::matmul` against a plain-loop f64 reference, every transpose pair, dtype and shape
//! kind; `Accum`; edge extents; backward (matmuls with other transposes) against finite
//! differences; errors.
//!
//! Tolerance for an output element `w` with `k` products (see `common::tol` for the rtol):
//! `rtol·|w| + k·ε·Σ_p |a_ip·b_pj|`, the classic bound of a length-k dot product computed in
//! a type with machine epsilon ε (f64 for f64, f32 otherwise); bf16/f16 add half an ulp for
//! the single rounding of the output.

mod common;

use common::*;
use dtensor_kernels::ops::{self, Accum, MatmulScratch, Parallelism, Transpose};
use dtensor_kernels::{DType, Error, Tensor};

const TRANSPOSES: [(Transpose, Transpose); 4] = [
    (Transpose::No, Transpose::No),
    (Transpose::No, Transpose::Yes),
    (Transpose::Yes, Transpose::No),
    (Transpose::Yes, Transpose::Yes),
];

/// Stored shape of an operand whose logical (after transpose) matrix is `[r, c]`.
fn stored(batch: Option<usize>, r: usize, c: usize, t: Transpose) -> Vec<usize> {
    let (r, c) = match t {
        Transpose::No => (r, c),
        Transpose::Yes => (c, r),
    };
    match batch {
        Some(b) => vec![b, r, c],
        None => vec![r, c],
    }
}

/// `(product, Σ|a·b| per element, out shape)` by the definition, from stored operands.
fn reference(
    a: &[f64],
    sa: &[usize],
    ta: Transpose,
    b: &[f64],
    sb: &[usize],
    tb: Transpose,
) -> (Vec<f64>, Vec<f64>, Vec<usize>) {
    let batch = if sa.len() == 3 { sa[0] } else { 1 };
    let (ar, ac) = (sa[sa.len() - 2], sa[sa.len() - 1]);
    let (br, bc) = (sb[sb.len() - 2], sb[sb.len() - 1]);
    let (m, k) = if ta == Transpose::No {
        (ar, ac)
    } else {
        (ac, ar)
    };
    let n = if tb == Transpose::No { bc } else { br };
    let b_shared = sb.len() == 2;
    let mut out = vec![0.0; batch * m * n];
    let mut abs = vec![0.0; batch * m * n];
    for bi in 0..batch {
        let ao = bi * ar * ac;
        let bo = if b_shared { 0 } else { bi * br * bc };
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut sabs) = (0.0, 0.0);
                for p in 0..k {
                    let av = match ta {
                        Transpose::No => a[ao + i * ac + p],
                        Transpose::Yes => a[ao + p * ac + i],
                    };
                    let bv = match tb {
                        Transpose::No => b[bo + p * bc + j],
                        Transpose::Yes => b[bo + j * bc + p],
                    };
                    s += av * bv;
                    sabs += (av * bv).abs();
                }
                out[bi * m * n + i * n + j] = s;
                abs[bi * m * n + i * n + j] = sabs;
            }
        }
    }
    let shape = if sa.len() == 3 {
        vec![batch, m, n]
    } else {
        vec![m, n]
    };
    (out, abs, shape)
}

fn bound(dtype: DType, k: usize, w: f64, abs: f64) -> f64 {
    tol(dtype).rtol * w.abs() + (k as f64 + 2.0) * acc_eps(dtype) * abs + 1e-300
}

/// Checks `matmul` on stored operands of the given shapes against the reference.
fn check(dtype: DType, sa: &[usize], ta: Transpose, sb: &[usize], tb: Transpose, seed: u64) {
    let (a, av) = input(sa, seed, 1.0, dtype);
    let (b, bv) = input(sb, seed + 1, 1.0, dtype);
    let (want, abs, shape) = reference(&av, sa, ta, &bv, sb, tb);
    let got = ops::matmul(&a, ta, &b, tb).unwrap();
    assert_eq!(got.shape(), shape.as_slice());
    let k = if ta == Transpose::No {
        sa[sa.len() - 1]
    } else {
        sa[sa.len() - 2]
    };
    let what = format!("matmul {sa:?} {ta:?} · {sb:?} {tb:?}");
    assert_close_with(&what, &got, &want, |i, w| bound(dtype, k, w, abs[i]));
}

#[test]
fn matmul_every_transpose_pair_matches_reference() {
    for dtype in ALL {
        for (m, k, n) in [(3, 5, 4), (1, 7, 2), (6, 1, 3), (17, 33, 9)] {
            for (ta, tb) in TRANSPOSES {
                let sa = stored(None, m, k, ta);
                let sb = stored(None, k, n, tb);
                check(dtype, &sa, ta, &sb, tb, 10);
            }
        }
    }
}

#[test]
fn matmul_batched_matches_reference() {
    for dtype in ALL {
        for (ta, tb) in TRANSPOSES {
            let sa = stored(Some(3), 4, 6, ta);
            let sb = stored(Some(3), 6, 5, tb);
            check(dtype, &sa, ta, &sb, tb, 20);
        }
    }
}

#[test]
fn matmul_batched_shared_rhs_matches_reference() {
    // `[b,m,k]·[k,n]`: with lhs not transposed it runs as one `[b·m,k]` gemm.
    for dtype in ALL {
        for (ta, tb) in TRANSPOSES {
            let sa = stored(Some(3), 4, 6, ta);
            let sb = stored(None, 6, 5, tb);
            check(dtype, &sa, ta, &sb, tb, 30);
        }
    }
}

#[test]
fn matmul_accum_add_adds_product_to_dst() {
    for dtype in ALL {
        for (ta, tb) in TRANSPOSES {
            for batch in [None, Some(2)] {
                let (m, k, n) = (5, 7, 3);
                let sa = stored(batch, m, k, ta);
                let sb = stored(None, k, n, tb);
                let (a, av) = input(&sa, 40, 1.0, dtype);
                let (b, bv) = input(&sb, 41, 1.0, dtype);
                let (prod, abs, shape) = reference(&av, &sa, ta, &bv, &sb, tb);
                let (mut dst, cv) = input(&shape, 42, 1.0, dtype);
                ops::matmul_into(&mut dst, &a, ta, &b, tb, Accum::Add, Parallelism::None).unwrap();
                let want: Vec<f64> = prod.iter().zip(&cv).map(|(p, c)| p + c).collect();
                assert_close_with("matmul Accum::Add", &dst, &want, |i, w| {
                    bound(dtype, k + 1, w, abs[i] + cv[i].abs())
                });
            }
        }
    }
}

#[test]
fn matmul_accum_replace_never_reads_dst() {
    for dtype in ALL {
        let (a, _) = input(&[4, 6], 50, 1.0, dtype);
        let (b, _) = input(&[6, 3], 51, 1.0, dtype);
        let fresh = ops::matmul(&a, Transpose::No, &b, Transpose::No).unwrap();
        let mut dst = make(&[f64::NAN; 12], &[4, 3], dtype).0;
        let (ta, tb) = (Transpose::No, Transpose::No);
        ops::matmul_into(&mut dst, &a, ta, &b, tb, Accum::Replace, Parallelism::None).unwrap();
        assert_eq!(dst, fresh, "{dtype}");
    }
}

#[test]
fn matmul_k_zero_replace_zeroes_and_add_keeps_dst() {
    for dtype in ALL {
        for (sa, sb, out) in [
            (vec![3, 0], vec![0, 4], vec![3, 4]),
            (vec![2, 3, 0], vec![2, 0, 4], vec![2, 3, 4]),
            (vec![2, 3, 0], vec![0, 4], vec![2, 3, 4]),
        ] {
            let a = Tensor::zeros(&sa, dtype);
            let b = Tensor::zeros(&sb, dtype);
            let (ta, tb) = (Transpose::No, Transpose::No);
            let nan = vec![f64::NAN; out.iter().product()];
            let mut dst = make(&nan, &out, dtype).0;
            ops::matmul_into(&mut dst, &a, ta, &b, tb, Accum::Replace, Parallelism::None).unwrap();
            assert_eq!(dst, Tensor::zeros(&out, dtype), "{dtype} {sa:?}");
            let (mut dst, before) = input(&out, 60, 1.0, dtype);
            ops::matmul_into(&mut dst, &a, ta, &b, tb, Accum::Add, Parallelism::None).unwrap();
            assert_eq!(dst.to_f64_vec(), before, "{dtype} {sa:?}");
        }
    }
}

#[test]
fn matmul_m_or_n_zero_gives_empty_result() {
    for dtype in ALL {
        for (sa, ta, sb, tb, out) in [
            (
                vec![0, 5],
                Transpose::No,
                vec![5, 3],
                Transpose::No,
                vec![0, 3],
            ),
            (
                vec![5, 0],
                Transpose::Yes,
                vec![5, 3],
                Transpose::No,
                vec![0, 3],
            ),
            (
                vec![4, 5],
                Transpose::No,
                vec![5, 0],
                Transpose::No,
                vec![4, 0],
            ),
            (
                vec![4, 5],
                Transpose::No,
                vec![0, 5],
                Transpose::Yes,
                vec![4, 0],
            ),
            (
                vec![0, 4, 5],
                Transpose::No,
                vec![0, 5, 3],
                Transpose::No,
                vec![0, 4, 3],
            ),
            (
                vec![0, 4, 5],
                Transpose::No,
                vec![5, 3],
                Transpose::No,
                vec![0, 4, 3],
            ),
        ] {
            let a = Tensor::zeros(&sa, dtype);
            let b = Tensor::zeros(&sb, dtype);
            let c = ops::matmul(&a, ta, &b, tb).unwrap();
            assert_eq!(c.shape(), out.as_slice(), "{dtype}");
            assert_eq!(c.numel(), 0);
        }
    }
}

#[test]
fn matmul_half_long_k_rounds_once() {
    // k = 4096 needs several of gemm's k-blocks: a kernel that rounds the accumulator to the
    // 16-bit type between blocks shows errors above half an ulp here (measured: ~1 ulp for
    // gemm's native f16 path). The bound: half an ulp plus realistic f32 noise (1e-4 on
    // outputs of magnitude ~10).
    let (m, k, n) = (4, 4096, 4);
    for dtype in [DType::BF16, DType::F16] {
        let (a, av) = input(&[m, k], 70, 1.0, dtype);
        let (b, bv) = input(&[k, n], 71, 1.0, dtype);
        let (want, _, _) = reference(&av, &[m, k], Transpose::No, &bv, &[k, n], Transpose::No);
        let got = ops::matmul(&a, Transpose::No, &b, Transpose::No).unwrap();
        assert_close_with("matmul long k", &got, &want, |_, w| {
            tol(dtype).rtol * w.abs() + 1e-4
        });
    }
}

#[test]
fn matmul_scratch_reuse_matches_fresh() {
    let mut scratch = MatmulScratch::default();
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (m, k, n) in [(9, 8, 7), (2, 3, 4), (5, 11, 6)] {
            let (a, _) = input(&[m, k], 80, 1.0, dtype);
            let (b, _) = input(&[n, k], 81, 1.0, dtype);
            let fresh = ops::matmul(&a, Transpose::No, &b, Transpose::Yes).unwrap();
            let mut dst = Tensor::zeros(&[m, n], dtype);
            ops::matmul_into_with(
                &mut dst,
                &a,
                Transpose::No,
                &b,
                Transpose::Yes,
                Accum::Replace,
                Parallelism::None,
                &mut scratch,
            )
            .unwrap();
            assert_eq!(dst, fresh, "{dtype} {m}x{k}x{n}");
        }
    }
}

#[test]
fn matmul_rayon_parallelism_matches_reference() {
    for dtype in [DType::F32, DType::BF16] {
        let (sa, sb) = ([96, 64], [80, 64]);
        let (a, av) = input(&sa, 90, 1.0, dtype);
        let (b, bv) = input(&sb, 91, 1.0, dtype);
        let (ta, tb) = (Transpose::No, Transpose::Yes);
        let (want, abs, shape) = reference(&av, &sa, ta, &bv, &sb, tb);
        let mut dst = Tensor::zeros(&shape, dtype);
        let par = Parallelism::Rayon(2);
        ops::matmul_into(&mut dst, &a, ta, &b, tb, Accum::Replace, par).unwrap();
        assert_close_with("matmul rayon", &dst, &want, |i, w| {
            bound(dtype, 64, w, abs[i])
        });
    }
}

/// The backward of `y = x·Wᵀ` (a linear layer with torch's `[out, in]` weight) is two more
/// matmuls: `dx = dy·W`, `dW = dyᵀ·x`.
fn linear_grads(dy: &Tensor, x: &Tensor, w: &Tensor) -> (Tensor, Tensor) {
    let dx = ops::matmul(dy, Transpose::No, w, Transpose::No).unwrap();
    let dw = ops::matmul(dy, Transpose::Yes, x, Transpose::No).unwrap();
    (dx, dw)
}

#[test]
fn matmul_backward_linear_grads_match_reference() {
    let (t, i, o) = (6, 5, 3);
    for dtype in ALL {
        let (x, xv) = input(&[t, i], 100, 1.0, dtype);
        let (w, wv) = input(&[o, i], 101, 1.0, dtype);
        let (dy, gv) = input(&[t, o], 102, 1.0, dtype);
        let (dx, dw) = linear_grads(&dy, &x, &w);
        let (mut want_dx, mut abs_dx) = (vec![0.0; t * i], vec![0.0; t * i]);
        let (mut want_dw, mut abs_dw) = (vec![0.0; o * i], vec![0.0; o * i]);
        for r in 0..t {
            for c in 0..i {
                for q in 0..o {
                    let p = gv[r * o + q] * wv[q * i + c];
                    want_dx[r * i + c] += p;
                    abs_dx[r * i + c] += p.abs();
                    let p = gv[r * o + q] * xv[r * i + c];
                    want_dw[q * i + c] += p;
                    abs_dw[q * i + c] += p.abs();
                }
            }
        }
        assert_close_with("linear dx", &dx, &want_dx, |e, v| {
            bound(dtype, o, v, abs_dx[e])
        });
        assert_close_with("linear dW", &dw, &want_dw, |e, v| {
            bound(dtype, t, v, abs_dw[e])
        });
    }
}

#[test]
fn matmul_backward_matches_finite_differences() {
    // L = Σ dy ⊙ (x·Wᵀ), 2-D, and L = Σ dy ⊙ (A·B) per batch, 3-D.
    let (t, i, o) = (4, 5, 3);
    let xv = values(t * i, 110);
    let wv = values(o * i, 111);
    let gv = values(t * o, 112);
    let loss = |x: &[f64], w: &[f64]| {
        let y = ops::matmul(
            &t64(x, &[t, i]),
            Transpose::No,
            &t64(w, &[o, i]),
            Transpose::Yes,
        );
        dot(&y.unwrap().to_f64_vec(), &gv)
    };
    let (dx, dw) = linear_grads(&t64(&gv, &[t, o]), &t64(&xv, &[t, i]), &t64(&wv, &[o, i]));
    assert_fd("linear dx", &dx, &fd_grad(&xv, |x| loss(x, &wv)));
    assert_fd("linear dW", &dw, &fd_grad(&wv, |w| loss(&xv, w)));

    let (b, m, k, n) = (2, 3, 4, 2);
    let av = values(b * m * k, 113);
    let bv = values(b * k * n, 114);
    let gv = values(b * m * n, 115);
    let loss = |a: &[f64], bb: &[f64]| {
        let y = ops::matmul(
            &t64(a, &[b, m, k]),
            Transpose::No,
            &t64(bb, &[b, k, n]),
            Transpose::No,
        );
        dot(&y.unwrap().to_f64_vec(), &gv)
    };
    let dy = t64(&gv, &[b, m, n]);
    let da = ops::matmul(&dy, Transpose::No, &t64(&bv, &[b, k, n]), Transpose::Yes).unwrap();
    let db = ops::matmul(&t64(&av, &[b, m, k]), Transpose::Yes, &dy, Transpose::No).unwrap();
    assert_fd("batched dA", &da, &fd_grad(&av, |a| loss(a, &bv)));
    assert_fd("batched dB", &db, &fd_grad(&bv, |bb| loss(&av, bb)));
}

#[test]
fn matmul_inner_dim_mismatch_errs_naming_op() {
    let a = Tensor::zeros(&[2, 3], DType::F32);
    let b = Tensor::zeros(&[4, 5], DType::F32);
    let e = assert_names_op(
        ops::matmul(&a, Transpose::No, &b, Transpose::No),
        "ops::matmul",
    );
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    // [2,3]ᵀ is [3,2]: inner 2 vs 4.
    let b = Tensor::zeros(&[3, 5], DType::F32);
    assert_names_op(
        ops::matmul(&a, Transpose::Yes, &b, Transpose::No),
        "ops::matmul",
    );
    // Fine without the transpose.
    assert!(ops::matmul(&a, Transpose::No, &b, Transpose::No).is_ok());
}

#[test]
fn matmul_bad_ranks_and_batches_err_naming_op() {
    let z = |s: &[usize]| Tensor::zeros(s, DType::F64);
    for (sa, sb) in [
        (vec![3], vec![3, 2]),
        (vec![2, 3], vec![3]),
        (vec![1, 2, 2, 3], vec![3, 2]),
        (vec![2, 3], vec![2, 3, 4]),
        (vec![2, 4, 3], vec![5, 3, 2]),
        (vec![], vec![]),
    ] {
        assert_names_op(
            ops::matmul(&z(&sa), Transpose::No, &z(&sb), Transpose::No),
            "ops::matmul",
        );
    }
}

#[test]
fn matmul_into_wrong_dst_errs_naming_op() {
    let a = Tensor::zeros(&[2, 3], DType::F32);
    let b = Tensor::zeros(&[3, 4], DType::F32);
    let (ta, tb, acc, par) = (
        Transpose::No,
        Transpose::No,
        Accum::Replace,
        Parallelism::None,
    );
    let mut dst = Tensor::zeros(&[4, 2], DType::F32);
    let e = assert_names_op(
        ops::matmul_into(&mut dst, &a, ta, &b, tb, acc, par),
        "ops::matmul",
    );
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e:?}");
    let mut dst = Tensor::zeros(&[2, 4], DType::F64);
    let e = assert_names_op(
        ops::matmul_into(&mut dst, &a, ta, &b, tb, acc, par),
        "ops::matmul",
    );
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e:?}");
}

#[test]
fn matmul_dtype_mismatch_and_integers_err_naming_op() {
    let a = Tensor::zeros(&[2, 3], DType::F32);
    let b = Tensor::zeros(&[3, 4], DType::BF16);
    let e = assert_names_op(
        ops::matmul(&a, Transpose::No, &b, Transpose::No),
        "ops::matmul",
    );
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e:?}");
    let a = Tensor::zeros(&[2, 3], DType::I32);
    let b = Tensor::zeros(&[3, 4], DType::I32);
    let e = assert_names_op(
        ops::matmul(&a, Transpose::No, &b, Transpose::No),
        "ops::matmul",
    );
    assert!(e.to_string().contains("i32"), "{e}");
}

/// `scripts/no-avx512.sh` runs this file under QEMU on CPU models without AVX-512, to show
/// that gemm's run-time kernel choice (its `x86-v4` feature) falls back on them. This test
/// proves the emulated CPU really lacks AVX-512 (else the other tests' passing there would
/// prove nothing); on a real machine it has nothing to check, hence ignored.
#[test]
#[ignore = "run by scripts/no-avx512.sh on an emulated CPU without AVX-512"]
#[cfg(target_arch = "x86_64")]
fn matmul_cpu_without_avx512_is_what_the_emulator_reports() {
    assert!(
        !std::arch::is_x86_feature_detected!("avx512f"),
        "this CPU reports AVX-512: run it under `qemu-x86_64 -cpu Haswell` (scripts/no-avx512.sh)"
    );
}
