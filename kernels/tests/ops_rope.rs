//! RoPE as its own op: forward against a plain f64 reference written from the formulas
//! (both pair conventions, a rotary dim below the head dim, every scaling), the backward
//! against finite differences and as the transpose, half precision rounded once, the
//! argument errors, and golden numbers from Hugging Face transformers
//! (`data/rope_golden.rs`, written by `data/rope_golden.py`).
//!
//! Tolerances: `common::tol` against the f64 reference (the kernel computes in the compute
//! type with tables rounded once from f64). transformers computes its frequencies and
//! angles in f32, so its goldens are met to 1e-6 relative (frequencies; measured 3.3e-7 at
//! most) and 2e-6 absolute (rotated values of magnitude ≤ 1 at positions up to 31; measured
//! 7e-7 at most), and our f64 reference is held to the same.

mod common;

use common::*;
use dtensor_kernels::ops::{self, Rope, RopeScaling, RopeStyle, RopeTables, RotatedHeads};
use dtensor_kernels::{DType, Tensor};
use std::f64::consts::PI;

/// The inverse frequencies from the formulas of `ops::rope`'s docs (an independent
/// transcription of transformers' initializers).
fn ref_inv_freq(cfg: &Rope) -> Vec<f64> {
    let r = cfg.rotary_dim as f64;
    let b: Vec<f64> = (0..cfg.rotary_dim / 2)
        .map(|i| cfg.theta.powf(-(2.0 * i as f64) / r))
        .collect();
    match cfg.scaling {
        RopeScaling::None => b,
        RopeScaling::Linear { factor } => b.iter().map(|v| v / factor).collect(),
        RopeScaling::Llama3 {
            factor: f,
            low_freq_factor: lo,
            high_freq_factor: hi,
            original_max_position_embeddings: old,
        } => b
            .iter()
            .map(|&v| {
                let (old, wl) = (old as f64, 2.0 * PI / v);
                match wl {
                    _ if wl < old / hi => v,
                    _ if wl > old / lo => v / f,
                    _ => {
                        let s = (old / wl - lo) / (hi - lo);
                        (1.0 - s) * v / f + s * v
                    }
                }
            })
            .collect(),
        RopeScaling::Yarn {
            factor: f,
            original_max_position_embeddings: old,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => {
            let d = |beta: f64| r * (old as f64 / (2.0 * PI * beta)).ln() / (2.0 * cfg.theta.ln());
            let (lo, hi) = if truncate {
                (d(beta_fast).floor(), d(beta_slow).ceil())
            } else {
                (d(beta_fast), d(beta_slow))
            };
            let (lo, hi) = (lo.max(0.0), hi.min(r - 1.0));
            let hi = if lo == hi { hi + 0.001 } else { hi };
            b.iter()
                .enumerate()
                .map(|(i, &v)| {
                    let rho = ((i as f64 - lo) / (hi - lo)).clamp(0.0, 1.0);
                    v / f * rho + v * (1.0 - rho)
                })
                .collect()
        }
    }
}

fn ref_scaling(cfg: &Rope) -> f64 {
    let m = |s: f64, k: f64| {
        if s <= 1.0 {
            1.0
        } else {
            0.1 * k * s.ln() + 1.0
        }
    };
    match cfg.scaling {
        RopeScaling::Yarn {
            factor,
            attention_factor: Some(a),
            ..
        } => {
            let _ = factor;
            a
        }
        RopeScaling::Yarn {
            factor,
            mscale: Some(a),
            mscale_all_dim: Some(b),
            ..
        } if a != 0.0 && b != 0.0 => m(factor, a) / m(factor, b),
        RopeScaling::Yarn { factor, .. } => m(factor, 1.0),
        _ => 1.0,
    }
}

/// RoPE in f64 as transformers writes it: per head, `x·cos + rotate(x)·sin` over the first
/// `r` columns (`rotate_half` / `rotate_every_two`), the rest as is.
fn ref_rope(x: &[f64], positions: &[usize], cfg: &Rope, sign: f64) -> Vec<f64> {
    let (d, r) = (cfg.head_dim, cfg.rotary_dim);
    let (inv, a) = (ref_inv_freq(cfg), ref_scaling(cfg));
    let mut y = x.to_vec();
    let width = x.len() / positions.len();
    for (t, &p) in positions.iter().enumerate() {
        for h in 0..width / d {
            let head = &x[t * width + h * d..][..d];
            let out = &mut y[t * width + h * d..][..d];
            for j in 0..r {
                // The frequency of column j, its partner, and the partner's sign in rotate().
                let (i, partner, s) = match cfg.style {
                    RopeStyle::HalfSplit if j < r / 2 => (j, j + r / 2, -1.0),
                    RopeStyle::HalfSplit => (j - r / 2, j - r / 2, 1.0),
                    RopeStyle::Interleaved if j % 2 == 0 => (j / 2, j + 1, -1.0),
                    RopeStyle::Interleaved => (j / 2, j - 1, 1.0),
                };
                let phi = p as f64 * inv[i];
                out[j] = head[j] * a * phi.cos() + s * head[partner] * a * sign * phi.sin();
            }
        }
    }
    y
}

const STYLES: [RopeStyle; 2] = [RopeStyle::Interleaved, RopeStyle::HalfSplit];

fn scalings() -> Vec<RopeScaling> {
    vec![
        RopeScaling::None,
        RopeScaling::Linear { factor: 4.0 },
        // A short pretraining context, so all three llama3 bands occur at head dim 16.
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 64,
        },
        RopeScaling::yarn(4.0, 32),
        RopeScaling::Yarn {
            factor: 8.0,
            original_max_position_embeddings: 64,
            beta_fast: 8.0,
            beta_slow: 0.5,
            attention_factor: None,
            mscale: Some(1.0),
            mscale_all_dim: Some(0.5),
            truncate: false,
        },
    ]
}

/// Positions that are neither sorted nor start at 0 (packed documents restart, CP chunks
/// jump), up to 1000 so the f64 angles matter.
const POS: [usize; 7] = [5, 0, 1, 2, 977, 64, 3];

fn configs() -> Vec<Rope> {
    let mut v = Vec::new();
    for style in STYLES {
        for scaling in scalings() {
            for rotary_dim in [16, 10] {
                v.push(Rope {
                    head_dim: 16,
                    rotary_dim,
                    theta: 10_000.0,
                    style,
                    scaling,
                    heads: RotatedHeads::ALL,
                });
            }
        }
    }
    v
}

#[test]
fn inv_freq_follows_the_formulas() {
    for cfg in configs() {
        let (got, want) = (cfg.inv_freq(), ref_inv_freq(&cfg));
        assert_eq!(got.len(), cfg.rotary_dim / 2);
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-15 * w.abs(), "{cfg:?}: {g} vs {w}");
        }
        assert!((cfg.attention_scaling() - ref_scaling(&cfg)).abs() < 1e-15);
    }
    // Llama3's three bands all occur in the configs above.
    let cfg = Rope {
        scaling: scalings()[2],
        ..Rope::new(16, 10_000.0, RopeStyle::HalfSplit)
    };
    let base = Rope::new(16, 10_000.0, RopeStyle::HalfSplit).inv_freq();
    let ratio: Vec<f64> = cfg
        .inv_freq()
        .iter()
        .zip(&base)
        .map(|(s, b)| b / s)
        .collect();
    assert_eq!(ratio[0], 1.0, "kept");
    assert!((ratio[7] - 8.0).abs() < 1e-12, "divided: {ratio:?}");
    assert!(
        ratio.iter().any(|&q| q > 1.0 + 1e-9 && q < 8.0 - 1e-9),
        "blended: {ratio:?}"
    );
}

#[test]
fn tables_of_repeated_positions_are_each_position_s_own_row() {
    for cfg in configs() {
        let positions = [3, 977, 3, 0, 977, 3];
        let (cos, sin) = cfg.tables(&positions);
        let half = cfg.rotary_dim / 2;
        assert_eq!(cos.len(), positions.len() * half);
        for (t, &p) in positions.iter().enumerate() {
            let (c1, s1) = cfg.tables(&[p]);
            assert_eq!(cos[t * half..(t + 1) * half], c1, "{cfg:?}: row {t}");
            assert_eq!(sin[t * half..(t + 1) * half], s1, "{cfg:?}: row {t}");
        }
    }
}

#[test]
fn rope_every_style_and_scaling_matches_the_reference() {
    for cfg in configs() {
        for dtype in ALL {
            let (x, xv) = input(&[POS.len(), 3 * 16], 7, 1.5, dtype);
            let y = ops::rope(&x, &POS, &cfg).unwrap();
            assert_eq!((y.shape(), y.dtype()), (x.shape(), dtype));
            let want = ref_rope(&xv, &POS, &cfg, 1.0);
            // YaRN's factor multiplies the values: the tolerance scales with it.
            let a = cfg.attention_scaling();
            let t = tol(dtype);
            let tol = Tol {
                rtol: t.rtol,
                atol: t.atol * a,
            };
            assert_close(&format!("rope {cfg:?}"), &y, &want, tol);
            let back = ops::rope_backward(&x, &POS, &cfg).unwrap();
            let want = ref_rope(&xv, &POS, &cfg, -1.0);
            assert_close(&format!("rope_backward {cfg:?}"), &back, &want, tol);
        }
    }
}

#[test]
fn rope_partial_rotary_dim_leaves_the_tail_untouched() {
    for style in STYLES {
        let cfg = Rope {
            rotary_dim: 6,
            ..Rope::new(16, 10_000.0, style)
        };
        for dtype in ALL {
            let (x, _) = input(&[POS.len(), 2 * 16], 3, 1.0, dtype);
            for y in [
                ops::rope(&x, &POS, &cfg).unwrap(),
                ops::rope_backward(&x, &POS, &cfg).unwrap(),
            ] {
                let (xs, ys) = (x.to_f64_vec(), y.to_f64_vec());
                for (i, (a, b)) in xs.iter().zip(&ys).enumerate() {
                    if i % 16 >= 6 {
                        assert_eq!(a.to_bits(), b.to_bits(), "{style:?} {dtype}: column {i}");
                    }
                }
                // ... and the rotary part does move (position 5 is the first row's).
                assert_ne!(xs[..6], ys[..6]);
            }
        }
    }
}

#[test]
fn rope_at_position_zero_is_the_identity_times_the_attention_factor() {
    for cfg in configs() {
        let (x, xv) = input(&[2, 32], 11, 1.0, DType::F64);
        let y = ops::rope(&x, &[0, 0], &cfg).unwrap().to_f64_vec();
        let a = cfg.attention_scaling();
        for (i, (g, v)) in y.iter().zip(&xv).enumerate() {
            let w = if i % 16 < cfg.rotary_dim { v * a } else { *v };
            assert!(
                (g - w).abs() <= 1e-15 * w.abs().max(1.0),
                "{cfg:?}: {g} vs {w}"
            );
        }
    }
}

#[test]
fn rope_backward_matches_finite_differences_and_is_the_transpose() {
    for cfg in configs() {
        let shape = [POS.len(), 2 * 16];
        let (x, xv) = input(&shape, 5, 1.0, DType::F64);
        let (w, wv) = input(&shape, 6, 1.0, DType::F64);
        let loss = |v: &[f64]| {
            dot(
                &ops::rope(&t64(v, &shape), &POS, &cfg).unwrap().to_f64_vec(),
                &wv,
            )
        };
        let dx = ops::rope_backward(&w, &POS, &cfg).unwrap();
        assert_fd(&format!("rope {cfg:?}"), &dx, &fd_grad(&xv, loss));
        // <R x, w> = <x, Rᵀ w>.
        let lhs = dot(&ops::rope(&x, &POS, &cfg).unwrap().to_f64_vec(), &wv);
        let rhs = dot(&xv, &dx.to_f64_vec());
        assert!(
            (lhs - rhs).abs() < 1e-12 * lhs.abs().max(1.0),
            "{lhs} vs {rhs}"
        );
    }
}

/// A backward with the wrong sign (the forward rotation again) is caught by the finite
/// differences: the check above can fail.
#[test]
fn rope_wrong_backward_fails_the_finite_difference_check() {
    let cfg = Rope::new(8, 10_000.0, RopeStyle::HalfSplit);
    let shape = [POS.len(), 16];
    let (_, xv) = input(&shape, 5, 1.0, DType::F64);
    let (w, wv) = input(&shape, 6, 1.0, DType::F64);
    let loss = |v: &[f64]| {
        dot(
            &ops::rope(&t64(v, &shape), &POS, &cfg).unwrap().to_f64_vec(),
            &wv,
        )
    };
    let wrong = ops::rope(&w, &POS, &cfg).unwrap();
    let caught = std::panic::catch_unwind(|| assert_fd("wrong", &wrong, &fd_grad(&xv, loss)));
    assert!(caught.is_err(), "a wrong-sign backward must fail the check");
}

#[test]
fn rope_half_precision_rounds_once_from_f32() {
    for cfg in configs() {
        for dtype in [DType::BF16, DType::F16] {
            let (x, _) = input(&[POS.len(), 32], 9, 2.0, dtype);
            let x32 = x.to_dtype(DType::F32);
            for (got, wide) in [
                (ops::rope(&x, &POS, &cfg), ops::rope(&x32, &POS, &cfg)),
                (
                    ops::rope_backward(&x, &POS, &cfg),
                    ops::rope_backward(&x32, &POS, &cfg),
                ),
            ] {
                assert_eq!(
                    got.unwrap(),
                    wide.unwrap().to_dtype(dtype),
                    "{cfg:?} {dtype}"
                );
            }
        }
    }
}

// The q and k heads of a grouped fused QKV row turn exactly as the same heads alone; the
// v heads come through bit for bit, forward and backward.
#[test]
fn rope_on_fused_qkv_rotates_the_q_and_k_heads_only() {
    let (d, pos) = (6, [3usize, 0, 17, 4]);
    for q_per_kv in [1, 2, 4] {
        let group = q_per_kv + 2;
        let kv_heads = 2;
        let heads = kv_heads * group;
        let plain = Rope::new(d, 10_000.0, RopeStyle::HalfSplit);
        let fused = plain.on_fused_qkv(q_per_kv);
        for dtype in [DType::F64, DType::F32, DType::BF16] {
            let (x, xv) = input(&[pos.len(), heads * d], 5, 1.0, dtype);
            let all = ops::rope(&x, &pos, &plain).unwrap().to_f64_vec();
            for (y, what) in [
                (ops::rope(&x, &pos, &fused).unwrap(), "rope"),
                (
                    ops::rope_backward(&x, &pos, &fused).unwrap(),
                    "rope_backward",
                ),
            ] {
                let back = what == "rope_backward";
                let all = if back {
                    ops::rope_backward(&x, &pos, &plain).unwrap().to_f64_vec()
                } else {
                    all.clone()
                };
                let y = y.to_f64_vec();
                for (i, ((&got, &turned), &orig)) in y.iter().zip(&all).zip(&xv).enumerate() {
                    let h = (i % (heads * d)) / d;
                    let want = if h % group < q_per_kv + 1 {
                        turned
                    } else {
                        orig
                    };
                    assert_eq!(
                        got, want,
                        "{what} g={q_per_kv} {dtype} element {i} (head {h})"
                    );
                }
            }
        }
    }
}

// Prebuilt tables give the same bits as the op building its own, both directions; tables
// for other rows, of another width or dtype are errors naming the op.
#[test]
fn rope_with_prebuilt_tables_matches_and_checks_them() {
    let cfg = Rope::new(8, 10_000.0, RopeStyle::Interleaved).on_fused_qkv(2);
    let pos = [5usize, 1, 9];
    for dtype in ALL {
        let (x, _) = input(&[pos.len(), 8 * 8], 6, 1.0, dtype);
        let tables = RopeTables::new(&cfg, &pos, &x).unwrap();
        assert_eq!(tables.len(), pos.len());
        assert_eq!(
            ops::rope_with(&x, &tables, &cfg).unwrap(),
            ops::rope(&x, &pos, &cfg).unwrap()
        );
        assert_eq!(
            ops::rope_backward_with(&x, &tables, &cfg).unwrap(),
            ops::rope_backward(&x, &pos, &cfg).unwrap()
        );
    }
    let x = Tensor::zeros(&[3, 64], DType::F32);
    let short = RopeTables::new(&cfg, &[0, 1], &x).unwrap();
    let narrow = RopeTables::new(
        &Rope {
            rotary_dim: 4,
            ..cfg
        },
        &pos,
        &x,
    )
    .unwrap();
    let wide = RopeTables::new(&cfg, &pos, &Tensor::zeros(&[3, 64], DType::F64)).unwrap();
    for bad in [&short, &narrow, &wide] {
        let e = assert_names_op(ops::rope_with(&x, bad, &cfg), "ops::rope").to_string();
        assert!(e.contains("tables"), "{e}");
    }
    // A fused row of 8 heads is not whole groups of 3 (1 query head per KV head).
    let e = assert_names_op(ops::rope(&x, &pos, &cfg.on_fused_qkv(1)), "ops::rope");
    assert!(e.to_string().contains("groups"), "{e}");
}

#[test]
fn rope_bad_arguments_name_the_op_and_shapes() {
    let cfg = Rope::new(8, 10_000.0, RopeStyle::Interleaved);
    let x = Tensor::zeros(&[3, 16], DType::F32);
    let p = [0, 1, 2];
    let msg = |r: dtensor_kernels::Result<Tensor>, op: &str| assert_names_op(r, op).to_string();
    assert!(msg(
        ops::rope(&Tensor::zeros(&[16], DType::F32), &[0], &cfg),
        "ops::rope"
    )
    .contains("[16]"));
    assert!(msg(
        ops::rope(&Tensor::zeros(&[3, 12], DType::F32), &p, &cfg),
        "ops::rope"
    )
    .contains("[3, 12]"));
    assert!(msg(ops::rope(&x, &[0, 1], &cfg), "ops::rope").contains("2 positions"));
    assert!(msg(ops::rope_backward(&x, &[0, 1], &cfg), "ops::rope_backward").contains("[3, 16]"));
    assert!(msg(
        ops::rope(&Tensor::zeros(&[3, 16], DType::I64), &p, &cfg),
        "ops::rope"
    )
    .contains("i64"));
    for bad in [
        Rope {
            rotary_dim: 7,
            ..cfg
        },
        Rope {
            rotary_dim: 10,
            ..cfg
        },
        Rope {
            rotary_dim: 0,
            ..cfg
        },
    ] {
        assert!(msg(ops::rope(&x, &p, &bad), "ops::rope").contains("rotary_dim"));
    }
    for scaling in [
        RopeScaling::Linear { factor: 0.0 },
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 4.0,
            high_freq_factor: 1.0,
            original_max_position_embeddings: 8192,
        },
        RopeScaling::yarn(f64::NAN, 4096),
    ] {
        assert_names_op(ops::rope(&x, &p, &Rope { scaling, ..cfg }), "ops::rope");
    }
    assert_names_op(ops::rope(&x, &p, &Rope { theta: -1.0, ..cfg }), "ops::rope");
    // No rows: nothing to rotate, no error.
    let empty = Tensor::zeros(&[0, 16], DType::F32);
    assert_eq!(ops::rope(&empty, &[], &cfg).unwrap().shape(), &[0, 16]);
}

struct FreqCase {
    name: &'static str,
    rope: Rope,
    inv_freq: &'static [f64],
    attention_scaling: f64,
}

struct ApplyCase {
    name: &'static str,
    rope: Rope,
    x: &'static [f64],
    y: &'static [f64],
}

include!("data/rope_golden.rs");

#[test]
fn rope_frequencies_match_transformers() {
    let mut worst = 0f64;
    for case in FREQ_CASES {
        let got = case.rope.inv_freq();
        assert_eq!(got.len(), case.inv_freq.len(), "{}", case.name);
        for (g, w) in got.iter().zip(case.inv_freq) {
            let rel = (g - w).abs() / w.abs();
            worst = worst.max(rel);
            assert!(
                rel < 1e-6,
                "{}: inv_freq {g} vs transformers' {w}",
                case.name
            );
        }
        let a = case.rope.attention_scaling();
        assert!(
            (a - case.attention_scaling).abs() < 1e-12,
            "{}: attention scaling {a} vs {}",
            case.name,
            case.attention_scaling
        );
    }
    // transformers' frequencies are f32 (measured: at most 3.3e-7 relative, YaRN's blend),
    // ours f64: they differ, in the last f32 bits.
    assert!(worst > 0.0, "worst relative difference {worst:e}");
}

#[test]
fn rope_rotated_q_matches_transformers() {
    assert!(FREQ_CASES.len() >= 8 && APPLY_CASES.len() >= 7);
    for case in APPLY_CASES {
        let tokens = APPLY_POSITIONS.len();
        let x = t64(case.x, &[tokens, case.x.len() / tokens]);
        let y = ops::rope(&x, APPLY_POSITIONS, &case.rope).unwrap();
        assert_close(
            case.name,
            &y,
            case.y,
            Tol {
                rtol: 1e-6,
                atol: 2e-6,
            },
        );
        // transformers' own f32 rounding is what separates us, not a formula: the f64
        // reference lands just as close.
        let reference = ref_rope(case.x, APPLY_POSITIONS, &case.rope, 1.0);
        assert_close(
            &format!("{} (reference)", case.name),
            &t64(&reference, x.shape()),
            case.y,
            Tol {
                rtol: 1e-6,
                atol: 2e-6,
            },
        );
    }
}
