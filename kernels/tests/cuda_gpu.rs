//! Every CUDA kernel against the CPU kernel it mirrors, on random inputs, in every dtype it
//! supports: bitwise where the CUDA ops table says so (copies, casts, gathers, elementwise,
//! activations, column sums), within a tolerance per dtype where the summation order differs
//! (row reductions, attention).
//!
//! These need a GPU: they are ignored by default and run on the GPU machine with
//! `--include-ignored --test-threads=1` (one at a time: `gpu_pool_reuses_freed_memory` reads
//! the device's pool-wide counters; `scripts/cuda-gpu-bundle.sh` builds a runner that does
//! this). Each checks for a driver and a device first and returns with a message when there
//! is none.
#![cfg(feature = "cuda")]

use dtensor_kernels::cuda::Device;
use dtensor_kernels::ops::{
    self, Accum, AttentionMask, CausalAttention, CrossEntropyTargets, VocabShard,
};
use dtensor_kernels::{DType, Tensor};

mod common;
use common::cuda::{assert_bitwise, assert_close, down, gpu, rand_vec, up};

const FLOATS: [DType; 4] = DType::FLOATS;
const ALL: [DType; 6] = DType::ALL;

fn rand(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let n = shape.iter().product();
    let (lo, hi) = if dtype.is_float() {
        (-3.0, 3.0)
    } else {
        (-1000.0, 1000.0)
    };
    let v: Vec<f64> = rand_vec(n, seed, lo, hi)
        .into_iter()
        .map(|x| if dtype.is_float() { x } else { x.trunc() })
        .collect();
    Tensor::from_f64_vec(v, shape, dtype).unwrap()
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_device_roundtrip_is_bitwise() {
    let Some(dev) = gpu() else { return };
    assert_eq!(
        Device::new(0).unwrap(),
        dev,
        "Device::new is cached per ordinal"
    );
    println!("{dev:?}");
    for (k, dt) in ALL.into_iter().enumerate() {
        for shape in [&[0usize, 3][..], &[1], &[7, 33]] {
            let x = rand(shape, dt, k as u64);
            assert_bitwise("to_device/to_host", &down(&up(&x, &dev)), &x);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_elementwise_matches_cpu_bitwise() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in ALL.into_iter().enumerate() {
        let (a, b) = (
            rand(&[5, 77], dt, 10 + k as u64),
            rand(&[5, 77], dt, 20 + k as u64),
        );
        let (ga, gb) = (up(&a, &dev), up(&b, &dev));
        assert_bitwise("add", &down(&ga.add(&gb).unwrap()), &a.add(&b).unwrap());
        assert_bitwise("mul", &down(&ga.mul(&gb).unwrap()), &a.mul(&b).unwrap());
        assert_bitwise("scale", &down(&ga.try_scale(0.3).unwrap()), &a.scale(0.3));
        if dt.is_float() {
            assert_bitwise(
                "sub",
                &down(&ops::sub(&ga, &gb).unwrap()),
                &ops::sub(&a, &b).unwrap(),
            );
            let w = rand(&[77], dt, 30 + k as u64);
            let gw = up(&w, &dev);
            assert_bitwise(
                "add_row",
                &down(&ops::add_row(&ga, &gw).unwrap()),
                &ops::add_row(&a, &w).unwrap(),
            );
            assert_bitwise(
                "mul_row",
                &down(&ops::mul_row(&ga, &gw).unwrap()),
                &ops::mul_row(&a, &w).unwrap(),
            );
            assert_bitwise(
                "sum_rows",
                &down(&ops::sum_rows(&ga).unwrap()),
                &ops::sum_rows(&a).unwrap(),
            );
            let mut gd = up(&w, &dev);
            ops::sum_rows_into(&mut gd, &ga, Accum::Add).unwrap();
            let mut cd = w.clone();
            ops::sum_rows_into(&mut cd, &a, Accum::Add).unwrap();
            assert_bitwise("sum_rows_into(Add)", &down(&gd), &cd);
        } else {
            assert!(ops::sub(&ga, &gb).is_err(), "sub of {dt} must be refused");
        }
        let c = rand(&[5, 76], dt, 1);
        assert!(
            ga.add(&up(&c, &dev)).is_err(),
            "shape mismatch must be an Err"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_cast_matches_cpu_to_dtype() {
    let Some(dev) = gpu() else { return };
    for (k, from) in ALL.into_iter().enumerate() {
        // Values around the f16/bf16 range edges too (overflow to inf, subnormals).
        let mut v = rand_vec(300, 40 + k as u64, -70000.0, 70000.0);
        v.extend(rand_vec(300, 50 + k as u64, -1e-6, 1e-6));
        v.extend(rand_vec(300, 60 + k as u64, -3.0, 3.0));
        let v: Vec<f64> = v
            .into_iter()
            .map(|x| if from.is_float() { x } else { x.trunc() })
            .collect();
        let x = Tensor::from_f64_vec(v, &[900], from).unwrap();
        let gx = up(&x, &dev);
        for to in ALL {
            let gpu = down(&gx.try_to_dtype(to).unwrap());
            let cpu = x.to_dtype(to);
            if to == DType::F16 && matches!(from, DType::F64 | DType::F32) {
                // half's f64 -> f16 rounds through f32 with F16C and directly without it;
                // they differ at rounding ties only, by one unit in the last place.
                assert_close("cast", &gpu, &cpu, 1.0);
            } else {
                assert_bitwise(&format!("cast {from} -> {to}"), &gpu, &cpu);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_activations_match_cpu() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        let mut x = rand(&[3, 129], dt, 70 + k as u64);
        // Large magnitudes exercise the saturated branches.
        x = Tensor::cat(&[x, rand(&[1, 129], dt, 80).scale(20.0)], 0).unwrap();
        let dy = rand(x.shape(), dt, 90 + k as u64);
        let up_ = rand(x.shape(), dt, 95 + k as u64);
        let (gx, gdy, gup) = (up(&x, &dev), up(&dy, &dev), up(&up_, &dev));
        let check = |what: &str, gpu: &Tensor, cpu: &Tensor| {
            if dt == DType::F64 {
                assert_close(what, gpu, cpu, 1.0); // CUDA's exp vs libm's
            } else {
                assert_bitwise(what, gpu, cpu); // the CPU's exp_f32, operation for operation
            }
        };
        check(
            "gelu",
            &down(&ops::gelu(&gx).unwrap()),
            &ops::gelu(&x).unwrap(),
        );
        check(
            "silu",
            &down(&ops::silu(&gx).unwrap()),
            &ops::silu(&x).unwrap(),
        );
        check(
            "gelu_backward",
            &down(&ops::gelu_backward(&gdy, &gx).unwrap()),
            &ops::gelu_backward(&dy, &x).unwrap(),
        );
        check(
            "silu_backward",
            &down(&ops::silu_backward(&gdy, &gx).unwrap()),
            &ops::silu_backward(&dy, &x).unwrap(),
        );
        check(
            "swiglu",
            &down(&ops::swiglu(&gx, &gup).unwrap()),
            &ops::swiglu(&x, &up_).unwrap(),
        );
        // Accum::Add into an existing gradient.
        let (mut gdg, mut gdu) = (up(&dy, &dev), up(&up_, &dev));
        ops::swiglu_backward_into(&mut gdg, &mut gdu, &gdy, &gx, &gup, Accum::Add).unwrap();
        let (mut cdg, mut cdu) = (dy.clone(), up_.clone());
        ops::swiglu_backward_into(&mut cdg, &mut cdu, &dy, &x, &up_, Accum::Add).unwrap();
        check("swiglu_backward d_gate", &down(&gdg), &cdg);
        check("swiglu_backward d_up", &down(&gdu), &cdu);
        let mut gd = up(&dy, &dev);
        ops::gelu_backward_into(&mut gd, &gdy, &gx, Accum::Add).unwrap();
        let mut cd = dy.clone();
        ops::gelu_backward_into(&mut cd, &dy, &x, Accum::Add).unwrap();
        check("gelu_backward_into(Add)", &down(&gd), &cd);
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_reductions_match_cpu_bitwise() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        let x = rand(&[3, 5, 7], dt, 100 + k as u64);
        let gx = up(&x, &dev);
        for dim in 0..3 {
            let s = ops::sum_dim(&x, dim).unwrap();
            assert_bitwise("sum_dim", &down(&ops::sum_dim(&gx, dim).unwrap()), &s);
            let gs = up(&s, &dev);
            assert_bitwise(
                "sum_dim_backward",
                &down(&ops::sum_dim_backward(&gs, dim, x.shape()[dim]).unwrap()),
                &ops::sum_dim_backward(&s, dim, x.shape()[dim]).unwrap(),
            );
            let m = ops::max_dim(&x, dim).unwrap();
            let gm = ops::max_dim(&gx, dim).unwrap();
            assert_bitwise("max_dim values", &down(&gm.values), &m.values);
            assert_bitwise("max_dim indices", &down(&gm.indices), &m.indices);
            let dy = rand(m.values.shape(), dt, 110 + k as u64);
            assert_bitwise(
                "max_dim_backward",
                &down(
                    &ops::max_dim_backward(&up(&dy, &dev), &gm.indices, dim, x.shape()[dim])
                        .unwrap(),
                ),
                &ops::max_dim_backward(&dy, &m.indices, dim, x.shape()[dim]).unwrap(),
            );
        }
        assert!(ops::sum_dim(&gx, 3).is_err());
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_softmax_matches_cpu() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        // 1000 columns: several elements per thread of the 256-thread block.
        for n in [1, 7, 1000] {
            let x = rand(&[4, n], dt, 120 + k as u64).scale(3.0);
            let dy = rand(&[4, n], dt, 130 + k as u64);
            let (gx, gdy) = (up(&x, &dev), up(&dy, &dev));
            let y = ops::softmax(&x).unwrap();
            assert_close("softmax", &down(&ops::softmax(&gx).unwrap()), &y, 4.0);
            let ly = ops::log_softmax(&x).unwrap();
            assert_close(
                "log_softmax",
                &down(&ops::log_softmax(&gx).unwrap()),
                &ly,
                4.0,
            );
            let mut gdx = Tensor::zeros_on(Some(&dev), x.shape(), dt).unwrap();
            ops::softmax_backward_into(&mut gdx, &gdy, &up(&y, &dev), Accum::Replace).unwrap();
            assert_close(
                "softmax_backward",
                &down(&gdx),
                &ops::softmax_backward(&dy, &y).unwrap(),
                8.0,
            );
            let mut gdx = up(&dy, &dev);
            ops::log_softmax_backward_into(&mut gdx, &gdy, &up(&ly, &dev), Accum::Add).unwrap();
            let mut cdx = dy.clone();
            ops::log_softmax_backward_into(&mut cdx, &dy, &ly, Accum::Add).unwrap();
            assert_close("log_softmax_backward(Add)", &down(&gdx), &cdx, 16.0);
        }
        // Masks and NaN: -inf gets probability 0, a NaN row is NaN.
        let v = vec![0.5, f64::NEG_INFINITY, 1.0, 2.0, f64::NAN, 1.0, 0.0, 0.0];
        let x = Tensor::from_f64_vec(v, &[2, 4], dt).unwrap();
        let y = down(&ops::softmax(&up(&x, &dev)).unwrap()).to_f64_vec();
        assert_eq!(y[1], 0.0);
        assert!(y[4..].iter().all(|v| v.is_nan()), "{y:?}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_norms_match_cpu() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        for n in [3, 300] {
            let x = rand(&[2, 3, n], dt, 140 + k as u64);
            let w = rand(&[n], dt, 150 + k as u64);
            let b = rand(&[n], dt, 160 + k as u64);
            let dy = rand(x.shape(), dt, 170 + k as u64);
            let (gx, gw, gb, gdy) = (up(&x, &dev), up(&w, &dev), up(&b, &dev), up(&dy, &dev));
            let c = ops::layer_norm(&x, &w, &b, 1e-5).unwrap();
            let o = ops::layer_norm(&gx, &gw, &gb, 1e-5).unwrap();
            assert_close("layer_norm y", &down(&o.y), &c.y, 4.0);
            assert_close("layer_norm mean", &down(&o.mean), &c.mean, 4.0);
            assert_close("layer_norm rstd", &down(&o.rstd), &c.rstd, 4.0);
            // Backward from the CPU's statistics, so only the backward's own order differs.
            let cg = ops::layer_norm_backward(&dy, &x, &w, &c.mean, &c.rstd).unwrap();
            let gg =
                ops::layer_norm_backward(&gdy, &gx, &gw, &up(&c.mean, &dev), &up(&c.rstd, &dev))
                    .unwrap();
            assert_close("layer_norm dx", &down(&gg.dx), &cg.dx, 16.0);
            assert_bitwise("layer_norm dweight", &down(&gg.dweight), &cg.dweight);
            assert_bitwise("layer_norm dbias", &down(&gg.dbias), &cg.dbias);
            let c = ops::rms_norm(&x, &w, 1e-6).unwrap();
            let o = ops::rms_norm(&gx, &gw, 1e-6).unwrap();
            assert_close("rms_norm y", &down(&o.y), &c.y, 4.0);
            assert_close("rms_norm rstd", &down(&o.rstd), &c.rstd, 4.0);
            let cg = ops::rms_norm_backward(&dy, &x, &w, &c.rstd).unwrap();
            let gg = ops::rms_norm_backward(&gdy, &gx, &gw, &up(&c.rstd, &dev)).unwrap();
            assert_close("rms_norm dx", &down(&gg.dx), &cg.dx, 16.0);
            assert_bitwise("rms_norm dweight", &down(&gg.dweight), &cg.dweight);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_embedding_matches_cpu_bitwise() {
    let Some(dev) = gpu() else { return };
    let vocab = 50;
    for (k, dt) in FLOATS.into_iter().enumerate() {
        // Repeated ids: the scatter-add sums several positions into one row.
        let raw: Vec<i64> = rand_vec(3 * 40, 180 + k as u64, 0.0, vocab as f64)
            .into_iter()
            .map(|v| v as i64)
            .collect();
        for ids in [
            Tensor::from_vec(raw.clone(), &[3, 40]).unwrap(),
            Tensor::from_vec(raw.iter().map(|&i| i as i32).collect::<Vec<_>>(), &[3, 40]).unwrap(),
        ] {
            for shard in [
                VocabShard::full(vocab),
                VocabShard {
                    start: 20,
                    len: 17,
                    vocab,
                },
            ] {
                let table = rand(&[shard.len, 33], dt, 190 + k as u64);
                let gt = up(&table, &dev);
                assert_bitwise(
                    "embedding",
                    &down(&ops::embedding_masked(&gt, &ids, shard).unwrap()),
                    &ops::embedding_masked(&table, &ids, shard).unwrap(),
                );
                let dy = rand(&[3, 40, 33], dt, 200 + k as u64);
                let gdy = up(&dy, &dev);
                for accum in [Accum::Replace, Accum::Add] {
                    let init = rand(&[shard.len, 33], dt, 210);
                    let mut gd = up(&init, &dev);
                    ops::embedding_masked_backward_into(&mut gd, &gdy, &ids, shard, accum).unwrap();
                    let mut cd = init.clone();
                    ops::embedding_masked_backward_into(&mut cd, &dy, &ids, shard, accum).unwrap();
                    assert_bitwise("embedding_backward", &down(&gd), &cd);
                }
            }
        }
        let bad = Tensor::from_vec(vec![vocab as i64], &[1]).unwrap();
        let gt = up(&rand(&[vocab, 4], dt, 1), &dev);
        assert!(ops::embedding_masked(&gt, &bad, VocabShard::full(vocab)).is_err());
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_cross_entropy_pieces_match_an_f64_reference() {
    let Some(dev) = gpu() else { return };
    let (rows, vocab) = (6, 300);
    // Without and with a z-loss (and then with the ids on the device, read once by
    // ce_targets).
    for (k, (dt, z)) in FLOATS
        .into_iter()
        .flat_map(|dt| [(dt, 0.0), (dt, 0.05)])
        .enumerate()
    {
        let logits = rand(&[rows, vocab], dt, 220 + k as u64).scale(2.0);
        // Rows 1 and 4 ignored (loss 0, gradient row 0).
        let ignored = |r: usize| r % 3 == 1;
        let ids_v: Vec<i64> = (0..rows)
            .map(|r| match ignored(r) {
                true => ops::IGNORE_INDEX,
                false => (r as i64 * 47) % vocab as i64,
            })
            .collect();
        let ids = Tensor::from_vec(ids_v.clone(), &[rows]).unwrap();
        let ids = if z == 0.0 { ids } else { up(&ids, &dev) };
        let targets = CrossEntropyTargets::new(&ids, vocab).ignoring(ops::IGNORE_INDEX);
        let dy = rand(&[rows], dt, 230 + k as u64);
        // The reference: lse − l[t] + z·lse², its gradient (p − onehot + 2z·lse·p)·dy.
        let l = logits.to_f64_vec();
        let (mut loss, mut grad) = (vec![0.0; rows], vec![0.0; rows * vocab]);
        for r in (0..rows).filter(|&r| !ignored(r)) {
            let row = &l[r * vocab..(r + 1) * vocab];
            let m = row.iter().fold(f64::NEG_INFINITY, |a, &x| a.max(x));
            let s: f64 = row.iter().map(|x| (x - m).exp()).sum();
            let lse = m + s.ln();
            loss[r] = lse - row[ids_v[r] as usize] + z * lse * lse;
            for c in 0..vocab {
                let p = (row[c] - m).exp() / s;
                let onehot = if c == ids_v[r] as usize { 1.0 } else { 0.0 };
                grad[r * vocab + c] = (p - onehot + 2.0 * z * lse * p) * dy.to_f64_vec()[r];
            }
        }
        let loss = Tensor::from_f64_vec(loss, &[rows], dt).unwrap();
        let grad = Tensor::from_f64_vec(grad, &[rows, vocab], dt).unwrap();
        // Two vocab shards, combined by hand as the all-reduces would.
        let halves = [(0, 170), (170, 130)];
        let parts: Vec<_> = halves
            .iter()
            .map(|&(c0, n)| up(&logits.narrow(1, c0, n).unwrap(), &dev))
            .collect();
        let checked = ops::ce_targets(&parts[0], &targets).unwrap();
        let maxes: Vec<Vec<f64>> = parts
            .iter()
            .map(|p| down(&ops::ce_row_max(p).unwrap()).to_f64_vec())
            .collect();
        let m: Vec<f64> = (0..rows).map(|r| maxes[0][r].max(maxes[1][r])).collect();
        let gm = up(&Tensor::from_vec(m, &[rows]).unwrap(), &dev);
        let (mut s, mut t) = (vec![0.0; rows], vec![0.0; rows]);
        for (p, &(c0, _)) in parts.iter().zip(&halves) {
            let (ps, pt) = ops::ce_sum_target(p, &gm, &checked, c0).unwrap();
            for r in 0..rows {
                s[r] += down(&ps).to_f64_vec()[r];
                t[r] += down(&pt).to_f64_vec()[r];
            }
        }
        let (gs, gt) = (
            up(&Tensor::from_vec(s, &[rows]).unwrap(), &dev),
            up(&Tensor::from_vec(t, &[rows]).unwrap(), &dev),
        );
        let got_loss = down(&ops::ce_loss(&gm, &gs, &gt, z, dt).unwrap());
        assert_close("ce_loss", &got_loss, &loss, 4.0);
        let gdy = up(&dy, &dev);
        let pieces: Vec<Tensor> = parts
            .iter()
            .zip(&halves)
            .map(|(p, &(c0, _))| down(&ops::ce_grad(p, &gm, &gs, &checked, &gdy, c0, z).unwrap()))
            .collect();
        let got_grad = Tensor::cat(&pieces, 1).unwrap();
        assert_close("ce_grad", &got_grad, &grad, 4.0);
        let (lv, gv) = (got_loss.to_f64_vec(), got_grad.to_f64_vec());
        for r in (0..rows).filter(|&r| ignored(r)) {
            assert_eq!(lv[r].to_bits(), 0, "{dt}: loss of ignored row {r}");
            let row = &gv[r * vocab..(r + 1) * vocab];
            assert!(
                row.iter().all(|g| g.to_bits() == 0),
                "{dt}: grad of ignored row {r}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_pack_unpack_narrow_cat_match_cpu_bitwise() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in ALL.into_iter().enumerate() {
        let x = rand(&[4, 7, 5], dt, 240 + k as u64);
        let gx = up(&x, &dev);
        for dim in 0..3 {
            let e = x.shape()[dim];
            let sizes = dtensor_kernels::chunk_sizes(e, 3);
            let packed = x.pack(dim, &sizes).unwrap();
            let gp = gx.pack(dim, &sizes).unwrap();
            assert_bitwise("pack", &down(&gp), &packed);
            assert_bitwise(
                "unpack",
                &down(&Tensor::unpack(&gp, x.shape(), dim, &sizes).unwrap()),
                &Tensor::unpack(&packed, x.shape(), dim, &sizes).unwrap(),
            );
            let n = x.narrow(dim, 1, e - 2).unwrap();
            let gn = gx.narrow(dim, 1, e - 2).unwrap();
            assert_bitwise("narrow", &down(&gn), &n);
            let parts = x.chunk(dim, 3).unwrap();
            let gparts: Vec<Tensor> = parts.iter().map(|p| up(p, &dev)).collect();
            assert_bitwise("cat", &down(&Tensor::cat(&gparts, dim).unwrap()), &x);
        }
        assert!(
            gx.pack(0, &[1, 2]).is_err(),
            "sizes not adding up must be an Err"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_causal_attention_matches_cpu() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        // seq_len 70 crosses the CPU's 64-row block; two samples, three heads.
        // An odd head dim too: q and k come in rotated, nothing pairs columns.
        for (s, d) in [(5, 4), (70, 16), (9, 5)] {
            let cfg = CausalAttention {
                seq_len: s,
                head_dim: d,
                q_per_kv: 1,
                scale: None,
            };
            let heads = 3;
            let qkv = rand(&[2 * s, heads * 3 * d], dt, 250 + k as u64);
            let gq = up(&qkv, &dev);
            let c = ops::causal_attention(&qkv, &cfg).unwrap();
            let o = ops::causal_attention(&gq, &cfg).unwrap();
            assert_close("attention out", &down(&o.out), &c.out, 4.0);
            assert_close("attention lse", &down(&o.lse), &c.lse, 4.0);
            let dout = rand(c.out.shape(), dt, 260 + k as u64);
            let cd = ops::causal_attention_backward(&dout, &qkv, &c.out, &c.lse, &cfg).unwrap();
            let gd = ops::causal_attention_backward(
                &up(&dout, &dev),
                &gq,
                &up(&c.out, &dev),
                &up(&c.lse, &dev),
                &cfg,
            )
            .unwrap();
            assert_close("attention dqkv", &down(&gd), &cd, 16.0);
        }
        // Over the shared-memory bound: a clear "not on cuda" error, no launch.
        let cfg = CausalAttention {
            seq_len: 100_000,
            head_dim: 2,
            q_per_kv: 1,
            scale: None,
        };
        let e =
            ops::causal_attention(&up(&Tensor::zeros(&[100_000, 6], dt), &dev), &cfg).unwrap_err();
        assert!(e.to_string().contains("not on cuda"), "{e}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_masked_attention_matches_cpu() {
    let Some(dev) = gpu() else { return };
    // Two samples of 70 (past the CPU's 64-row tiles), documents differing per sample.
    let s = 70;
    let ids: Vec<u32> = (0..2 * s as u32)
        .map(|t| {
            if t < 70 {
                u32::from(t >= 23)
            } else {
                u32::from(t >= 120) + 5
            }
        })
        .collect();
    let masks = [
        AttentionMask::default().documents(&ids),
        AttentionMask::default().window(9),
        AttentionMask::default().documents(&ids).window(30),
    ];
    for (k, dt) in FLOATS.into_iter().enumerate() {
        for (m, mask) in masks.iter().enumerate() {
            let cfg = CausalAttention::new(s, 4).grouped(2);
            let qkv = rand(&[2 * s, 2 * 4 * 4], dt, 270 + 10 * k as u64 + m as u64);
            let gq = up(&qkv, &dev);
            let c = ops::causal_attention_masked(&qkv, &cfg, mask).unwrap();
            let o = ops::causal_attention_masked(&gq, &cfg, mask).unwrap();
            assert_close("masked attention out", &down(&o.out), &c.out, 4.0);
            assert_close("masked attention lse", &down(&o.lse), &c.lse, 4.0);
            let dout = rand(c.out.shape(), dt, 290 + 10 * k as u64 + m as u64);
            let cd = ops::causal_attention_masked_backward(&dout, &qkv, &c.out, &c.lse, &cfg, mask)
                .unwrap();
            let gd = ops::causal_attention_masked_backward(
                &up(&dout, &dev),
                &gq,
                &up(&c.out, &dev),
                &up(&c.lse, &dev),
                &cfg,
                mask,
            )
            .unwrap();
            assert_close("masked attention dqkv", &down(&gd), &cd, 16.0);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_matmul_matches_cpu() {
    use dtensor_kernels::ops::Transpose::{No, Yes};
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        let seed = 300 + 10 * k as u64;
        // (lhs shape, ta, rhs shape, tb): 2-D, batched, shared rhs, every transpose.
        let cases: [(&[usize], _, &[usize], _); 6] = [
            (&[5, 37], No, &[37, 9], No),
            (&[37, 5], Yes, &[37, 9], No),
            (&[5, 37], No, &[9, 37], Yes),
            (&[37, 5], Yes, &[9, 37], Yes),
            (&[3, 5, 37], No, &[3, 37, 9], No),
            (&[3, 37, 5], Yes, &[9, 37], Yes),
        ];
        for (i, (sa, ta, sb, tb)) in cases.into_iter().enumerate() {
            let a = rand(sa, dt, seed + i as u64);
            let b = rand(sb, dt, seed + 100 + i as u64);
            let c = ops::matmul(&a, ta, &b, tb).unwrap();
            let (ga, gb) = (up(&a, &dev), up(&b, &dev));
            let what = format!("matmul {sa:?}{ta:?}·{sb:?}{tb:?}");
            assert_close(
                &what,
                &down(&ops::matmul(&ga, ta, &gb, tb).unwrap()),
                &c,
                8.0,
            );
            // Accum::Add on top of an existing dst.
            let init = rand(c.shape(), dt, seed + 200);
            let mut gd = up(&init, &dev);
            ops::matmul_into(
                &mut gd,
                &ga,
                ta,
                &gb,
                tb,
                Accum::Add,
                ops::Parallelism::None,
            )
            .unwrap();
            let mut cd = init.clone();
            ops::matmul_into(&mut cd, &a, ta, &b, tb, Accum::Add, ops::Parallelism::None).unwrap();
            assert_close(&format!("{what} (Add)"), &down(&gd), &cd, 8.0);
        }
        let a = up(&rand(&[5, 4], dt, 1), &dev);
        assert!(
            ops::matmul(&a, No, &a, No).is_err(),
            "k mismatch must be an Err"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_pool_reuses_freed_memory() {
    let Some(dev) = gpu() else { return };
    if !dev.has_memory_pool() {
        eprintln!(
            "SKIPPED: {dev:?} has no stream-ordered memory pool (each allocation is cuMemAlloc)"
        );
        return;
    }
    let x = Tensor::zeros_on(Some(&dev), &[1 << 22], DType::F32).unwrap();
    drop(ops::gelu(&x).unwrap());
    dev.synchronize().unwrap();
    let warm = dev.pool_reserved_bytes().unwrap();
    assert!(
        warm >= 2 * (4 << 22),
        "the pool holds x and the freed output: {warm} bytes"
    );
    for _ in 0..50 {
        drop(ops::gelu(&x).unwrap());
    }
    dev.synchronize().unwrap();
    assert_eq!(
        dev.pool_reserved_bytes().unwrap(),
        warm,
        "steady state: freed blocks are reused, none added"
    );
    drop(x);
    dev.trim().unwrap();
    assert_eq!(
        dev.pool_reserved_bytes().unwrap(),
        0,
        "trim gives every cached block back"
    );
}

// ---- one Tensor type: the dispatched ops on device tensors ----------------------------

/// How a dispatched op's device result must agree with the host result.
#[derive(Clone, Copy, Debug)]
enum Agree {
    /// Same bits (data movement: the device copies what the host copies).
    Bitwise,
    /// Within [`tol`] times this factor (arithmetic: CUDA's order and `exp`).
    Close(f64),
}

/// An op on plain `Tensor`s: the same call runs on the host inputs and on their device
/// copies; `dispatch!` picks the kernels.
type TensorOp = fn(&[Tensor]) -> dtensor_kernels::Result<Tensor>;

/// The inputs every case draws from: `[a, b, row, rhs, qkv, ids]` with `a`, `b` `[6, 40]`,
/// `row` `[40]`, `rhs` `[40, 24]`, `qkv` `[8, 24]` (2 samples × 4 tokens, 2 heads of 4),
/// `ids` i64 `[5]` in `0..6` (row ids of `a` as an embedding table).
fn dispatch_inputs(dt: DType, seed: u64) -> Vec<Tensor> {
    let ids = Tensor::from_vec(vec![3i64, 0, 5, 3, 1], &[5]).unwrap();
    vec![
        rand(&[6, 40], dt, seed),
        rand(&[6, 40], dt, seed + 1),
        rand(&[40], dt, seed + 2),
        rand(&[40, 24], dt, seed + 3),
        rand(&[8, 24], dt, seed + 4),
        ids,
    ]
}

const ATTN: CausalAttention = CausalAttention {
    seq_len: 4,
    head_dim: 4,
    q_per_kv: 1,
    scale: None,
};

/// The table of dispatched ops: name, agreement, the call.
fn dispatch_cases() -> Vec<(&'static str, Agree, TensorOp)> {
    use dtensor_kernels::ops::Transpose::No;
    use Agree::{Bitwise, Close};
    vec![
        ("clone", Bitwise, |t| Ok(t[0].clone())),
        ("deep_clone", Bitwise, |t| t[0].try_deep_clone()),
        ("reshape", Bitwise, |t| t[0].clone().reshape(&[40, 6])),
        ("narrow dim 0", Bitwise, |t| t[0].narrow(0, 1, 3)),
        ("narrow dim 1", Bitwise, |t| t[0].narrow(1, 5, 20)),
        ("chunk dim 1", Bitwise, |t| Ok(t[0].chunk(1, 3)?.remove(2))),
        ("split dim 0", Bitwise, |t| {
            Ok(t[0].split(0, &[4, 2])?.remove(1))
        }),
        ("cat dim 0", Bitwise, |t| {
            Tensor::cat(&[t[0].clone(), t[1].clone()], 0)
        }),
        ("cat dim 1", Bitwise, |t| {
            Tensor::cat(&[t[0].clone(), t[1].clone()], 1)
        }),
        ("pack dim 1", Bitwise, |t| t[0].pack(1, &[14, 14, 12])),
        ("unpack dim 1", Bitwise, |t| {
            Tensor::unpack(&t[1].clone().reshape(&[240])?, &[6, 40], 1, &[14, 14, 12])
        }),
        ("write_at dim 1", Bitwise, |t| {
            let mut d = t[0].clone();
            d.write_at(1, 7, &t[1].narrow(1, 0, 9)?)?;
            Ok(d)
        }),
        ("to_dtype f64", Bitwise, |t| t[0].try_to_dtype(DType::F64)),
        ("to_dtype f32", Bitwise, |t| t[0].try_to_dtype(DType::F32)),
        ("add", Close(1.0), |t| t[0].add(&t[1])),
        ("add_assign", Close(1.0), |t| {
            let mut d = t[0].clone();
            d.add_assign(&t[1])?;
            Ok(d)
        }),
        ("mul", Close(1.0), |t| t[0].mul(&t[1])),
        ("scale", Close(1.0), |t| t[0].try_scale(0.37)),
        ("ops::sub", Close(1.0), |t| ops::sub(&t[0], &t[1])),
        ("ops::add_row", Close(1.0), |t| ops::add_row(&t[0], &t[2])),
        ("ops::add_row_assign", Close(1.0), |t| {
            let mut d = t[0].clone();
            ops::add_row_assign(&mut d, &t[2])?;
            Ok(d)
        }),
        ("ops::mul_row", Close(1.0), |t| ops::mul_row(&t[0], &t[2])),
        ("ops::sum_rows", Close(4.0), |t| ops::sum_rows(&t[0])),
        ("ops::sum_rows_into Add", Close(4.0), |t| {
            let mut d = t[2].clone();
            ops::sum_rows_into(&mut d, &t[0], Accum::Add)?;
            Ok(d)
        }),
        ("ops::gelu", Close(2.0), |t| ops::gelu(&t[0])),
        ("ops::gelu_into", Close(2.0), |t| {
            let mut d = t[1].clone();
            ops::gelu_into(&mut d, &t[0])?;
            Ok(d)
        }),
        ("ops::silu", Close(2.0), |t| ops::silu(&t[0])),
        ("ops::gelu_backward", Close(4.0), |t| {
            ops::gelu_backward(&t[1], &t[0])
        }),
        ("ops::silu_backward_into Add", Close(4.0), |t| {
            let mut d = t[0].clone();
            ops::silu_backward_into(&mut d, &t[1], &t[0], Accum::Add)?;
            Ok(d)
        }),
        ("ops::swiglu", Close(2.0), |t| ops::swiglu(&t[0], &t[1])),
        ("ops::swiglu_backward d_gate", Close(4.0), |t| {
            Ok(ops::swiglu_backward(
                &t[2].clone().reshape(&[1, 40])?,
                &t[0].narrow(0, 0, 1)?,
                &t[1].narrow(0, 0, 1)?,
            )?
            .d_gate)
        }),
        ("ops::sum_dim 0", Close(4.0), |t| ops::sum_dim(&t[0], 0)),
        ("ops::sum_dim_backward", Bitwise, |t| {
            ops::sum_dim_backward(&t[2], 0, 3)
        }),
        ("ops::max_dim values", Bitwise, |t| {
            Ok(ops::max_dim(&t[0], 1)?.values)
        }),
        ("ops::max_dim indices", Bitwise, |t| {
            Ok(ops::max_dim(&t[0], 1)?.indices)
        }),
        ("ops::softmax", Close(4.0), |t| ops::softmax(&t[0])),
        ("ops::log_softmax_into", Close(4.0), |t| {
            let mut d = t[1].clone();
            ops::log_softmax_into(&mut d, &t[0])?;
            Ok(d)
        }),
        ("ops::softmax_backward", Close(8.0), |t| {
            ops::softmax_backward(&t[1], &ops::softmax(&t[0])?)
        }),
        ("ops::layer_norm y", Close(8.0), |t| {
            Ok(ops::layer_norm(&t[0], &t[2], &t[2], 1e-5)?.y)
        }),
        ("ops::rms_norm_backward dx", Close(16.0), |t| {
            let f = ops::rms_norm(&t[0], &t[2], 1e-5)?;
            Ok(ops::rms_norm_backward(&t[1], &t[0], &t[2], &f.rstd)?.dx)
        }),
        ("ops::matmul", Close(8.0), |t| {
            ops::matmul(&t[0], No, &t[3], No)
        }),
        ("ops::matmul_into Add", Close(8.0), |t| {
            let mut d = ops::matmul(&t[1], No, &t[3], No)?;
            ops::matmul_into(
                &mut d,
                &t[0],
                No,
                &t[3],
                No,
                Accum::Add,
                ops::Parallelism::None,
            )?;
            Ok(d)
        }),
        ("ops::embedding (host ids)", Bitwise, |t| {
            ops::embedding(&t[0], &t[5])
        }),
        ("ops::embedding_backward", Bitwise, |t| {
            ops::embedding_backward(&t[1].narrow(0, 0, 5)?, &t[5], 6)
        }),
        ("ops::gather_rows", Bitwise, |t| {
            ops::gather_rows(&t[0], &[5, 0, 3, 5])
        }),
        ("ops::scatter_add_rows", Close(4.0), |t| {
            ops::scatter_add_rows(&t[0], &[1, 0, 1, 2, 0, 1], 3)
        }),
        ("ops::pack_kv", Bitwise, |t| ops::pack_kv(&t[4], 4, 1)),
        ("ops::grouped_matmul_t", Close(8.0), |t| {
            ops::grouped_matmul_t(&t[0], &t[3].clone().reshape(&[2, 12, 40])?, &[4, 2])
        }),
        ("ops::causal_attention out", Close(4.0), |t| {
            Ok(ops::causal_attention(&t[4], &ATTN)?.out)
        }),
    ]
}

/// The table's calls are valid on the host (what the GPU test compares against), for every
/// float dtype: checked on any machine.
#[test]
fn dispatch_cases_run_on_the_host() {
    for (k, dt) in FLOATS.into_iter().enumerate() {
        let host = dispatch_inputs(dt, 400 + 10 * k as u64);
        for (name, _, op) in dispatch_cases() {
            let r = op(&host).unwrap_or_else(|e| panic!("{name} ({dt}): {e}"));
            assert!(!r.is_cuda(), "{name}: host inputs give a host result");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_tensor_ops_on_device_match_the_host() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        let host = dispatch_inputs(dt, 400 + 10 * k as u64);
        // The ids stay on the host: the embedding ops take them there.
        let device: Vec<Tensor> = host
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if i == 5 {
                    t.clone()
                } else {
                    t.to_device(&dev).unwrap()
                }
            })
            .collect();
        for (name, agree, op) in dispatch_cases() {
            let what = format!("{name} ({dt})");
            let c = op(&host).unwrap_or_else(|e| panic!("{what} on the host: {e}"));
            let g = op(&device).unwrap_or_else(|e| panic!("{what} on the device: {e}"));
            assert_eq!(
                g.device(),
                Some(&dev),
                "{what}: the result stays on the device"
            );
            assert!(!c.is_cuda(), "{what}: the host result stays on the host");
            let g = g.to_host().unwrap();
            match agree {
                Agree::Bitwise => assert_bitwise(&what, &g, &c),
                Agree::Close(s) => assert_close(&what, &g, &c, s),
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_tensor_ops_mixed_places_err_naming_both() {
    use dtensor_kernels::Error;
    let Some(dev) = gpu() else { return };
    let h = rand(&[4, 8], DType::F32, 1);
    let d = h.to_device(&dev).unwrap();
    let is_mismatch = |r: dtensor_kernels::Result<Tensor>, op: &str| match r {
        Err(Error::DeviceMismatch { op: o, lhs, rhs }) => {
            assert_eq!(o, op);
            let places = [lhs.as_str(), rhs.as_str()];
            assert!(
                places.contains(&"host") && places.contains(&"cuda:0"),
                "{places:?}"
            );
        }
        other => panic!("{op}: expected DeviceMismatch, got {other:?}"),
    };
    is_mismatch(h.add(&d), "Tensor::add");
    is_mismatch(d.mul(&h), "Tensor::mul");
    is_mismatch(Tensor::cat(&[d.clone(), h.clone()], 0), "Tensor::cat");
    is_mismatch(ops::sub(&d, &h), "ops::sub");
    is_mismatch(
        ops::matmul(&d, ops::Transpose::No, &h, ops::Transpose::Yes),
        "ops::matmul",
    );
    // An out-parameter in the other place than the input.
    let mut dst = h.clone();
    let e = ops::gelu_into(&mut dst, &d).unwrap_err();
    assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    assert_eq!(dst, h, "nothing was written");
    let mut dst = d.clone();
    let e = ops::sum_rows_into(&mut dst, &h, Accum::Replace).unwrap_err();
    assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    assert!(
        dst.is_cuda(),
        "the out-parameter keeps its place after an error"
    );
    // Ids on the device with a host table.
    let ids = Tensor::from_vec(vec![0i64, 1], &[2])
        .unwrap()
        .to_device(&dev)
        .unwrap();
    let e = ops::embedding(&h, &ids).unwrap_err();
    assert!(matches!(e, Error::DeviceMismatch { .. }), "{e}");
    // A host closure cannot run on the device.
    let e = d.try_map(|x| x + 1.0).unwrap_err();
    assert!(
        matches!(
            e,
            Error::NotOnCuda {
                op: "Tensor::map",
                ..
            }
        ),
        "{e}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_tensor_writes_copy_a_shared_device_buffer() {
    let Some(dev) = gpu() else { return };
    let x = rand(&[4, 6], DType::F32, 7);
    let t = x.to_device(&dev).unwrap();
    assert!(
        t.to_device(&dev).unwrap().shares_storage_with(&t),
        "same device: no copy"
    );
    assert_eq!(t.to_host().unwrap(), x);
    // write_at into a clone: the clone's buffer is copied first, `t` keeps its values.
    let mut v = t.clone();
    assert!(v.shares_storage_with(&t));
    let z = Tensor::zeros_on(Some(&dev), &[4, 2], DType::F32).unwrap();
    v.write_at(1, 3, &z).unwrap();
    assert!(
        !v.shares_storage_with(&t),
        "the write copied the shared buffer"
    );
    assert_eq!(t.to_host().unwrap(), x, "the other tensor keeps its values");
    let mut expect = x.clone();
    expect
        .write_at(1, 3, &Tensor::zeros(&[4, 2], DType::F32))
        .unwrap();
    assert_eq!(v.to_host().unwrap(), expect);
    // A tensor whose buffer is its own is written where it is.
    let mut w = v;
    w.write_at(
        0,
        0,
        &Tensor::zeros_on(Some(&dev), &[1, 6], DType::F32).unwrap(),
    )
    .unwrap();
    expect
        .write_at(0, 0, &Tensor::zeros(&[1, 6], DType::F32))
        .unwrap();
    assert_eq!(w.to_host().unwrap(), expect);
    // device_view_mut on a shared tensor copies too.
    let mut u = t.clone();
    {
        let view = u.device_view_mut().unwrap();
        assert_eq!(view.len(), 24);
    }
    assert!(!u.shares_storage_with(&t));
    // An _into op writing into a clone.
    let mut s = t.clone();
    ops::gelu_backward_into(&mut s, &t, &t, Accum::Add).unwrap();
    assert_eq!(
        t.to_host().unwrap(),
        x,
        "an _into op does not write through a shared buffer"
    );
    let mut cs = x.clone();
    ops::gelu_backward_into(&mut cs, &x, &x, Accum::Add).unwrap();
    assert_close(
        "gelu_backward_into on a clone",
        &s.to_host().unwrap(),
        &cs,
        4.0,
    );
    // add_assign on a clone.
    let mut a = t.clone();
    a.add_assign(&t).unwrap();
    assert_eq!(t.to_host().unwrap(), x);
    assert_eq!(a.to_host().unwrap(), x.add(&x).unwrap());
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_tensor_host_accessors_refuse_device_tensors() {
    use dtensor_kernels::Error;
    let Some(dev) = gpu() else { return };
    let x = rand(&[3, 5], DType::F32, 9);
    let mut t = x.to_device(&dev).unwrap();
    assert!(t.is_cuda());
    assert_eq!(t.device(), Some(&dev));
    let not_on_host = |e: Error, op: &str| {
        assert!(
            matches!(&e, Error::NotOnHost { op: o, device } if *o == op && device == "cuda:0"),
            "{e:?}"
        );
        let text = e.to_string();
        assert!(text.contains(op) && text.contains("cuda:0"), "{text}");
    };
    not_on_host(t.as_slice::<f32>().unwrap_err(), "Tensor::as_slice");
    not_on_host(t.as_mut_slice::<f32>().unwrap_err(), "Tensor::as_mut_slice");
    not_on_host(t.to_storage().unwrap_err(), "Tensor::to_storage");
    not_on_host(
        t.try_as_dyn_slice().unwrap_err(),
        "Tensor::try_as_dyn_slice",
    );
    not_on_host(
        t.try_as_dyn_slice_mut().unwrap_err(),
        "Tensor::try_as_dyn_slice_mut",
    );
    let panic = std::panic::catch_unwind(|| {
        let _ = t.as_dyn_slice();
    })
    .expect_err("as_dyn_slice panics on a device tensor");
    let text = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        text.contains("Tensor::as_dyn_slice") && text.contains("cuda:0"),
        "{text}"
    );
    // What is allowed: copies to the host for tests and metrics, and the device views.
    assert_eq!(t.to_f64_vec(), x.to_f64_vec());
    assert_eq!(t, x, "PartialEq compares values wherever they are");
    assert_eq!(t.device_view().unwrap().len(), 15);
    assert_eq!(t.cuda_tensor().unwrap().shape(), &[3, 5]);
    assert_eq!(t.zeros_like().unwrap().device(), Some(&dev));
    let back = Tensor::from(t.clone().try_into_cuda().unwrap());
    assert!(back.shares_storage_with(&t));
    assert!(t.try_into_buffer().is_err(), "host buffers only");
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_rope_matches_cpu_bitwise() {
    use ops::{Rope, RopeScaling, RopeStyle, RopeTables, RotatedHeads};
    let Some(dev) = gpu() else { return };
    let positions = [7, 0, 1, 2, 4093, 64];
    for style in [RopeStyle::Interleaved, RopeStyle::HalfSplit] {
        // Every head, and the q and k heads of a fused QKV (3 heads: q, k, v).
        for (rotary_dim, scaling, heads) in [
            (16, RopeScaling::None, RotatedHeads::ALL),
            (10, RopeScaling::yarn(4.0, 32), RotatedHeads::ALL),
            (16, RopeScaling::None, RotatedHeads::fused_qkv(1)),
        ] {
            let cfg = Rope {
                rotary_dim,
                scaling,
                heads,
                ..Rope::new(16, 10_000.0, style)
            };
            for (k, dt) in FLOATS.into_iter().enumerate() {
                let x = rand(&[positions.len(), 3 * 16], dt, 300 + k as u64);
                let xd = up(&x, &dev);
                // The same host tables and expressions, no fused multiply-add: same bits.
                for (what, gpu, cpu) in [
                    (
                        "rope",
                        ops::rope(&xd, &positions, &cfg),
                        ops::rope(&x, &positions, &cfg),
                    ),
                    (
                        "rope_backward",
                        ops::rope_backward(&xd, &positions, &cfg),
                        ops::rope_backward(&x, &positions, &cfg),
                    ),
                    (
                        "rope_backward_with",
                        RopeTables::new(&cfg, &positions, &xd)
                            .and_then(|t| ops::rope_backward_with(&xd, &t, &cfg)),
                        ops::rope_backward(&x, &positions, &cfg),
                    ),
                ] {
                    let gpu = gpu.unwrap();
                    assert!(gpu.is_cuda(), "{what} ran on the device");
                    let what = format!("{what} {style:?} r={rotary_dim} {heads:?} {dt}");
                    assert_bitwise(&what, &gpu.to_host().unwrap(), &cpu.unwrap());
                }
            }
        }
    }
}
