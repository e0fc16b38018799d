//! The model's remaining ops on device tensors against the same ops on the host: the
//! context-parallel attention pieces, the MoE kernels and the collectives' reductions, in
//! every dtype each supports, over uneven and empty sizes, and their argument errors (the
//! host's message).
//!
//! These need a GPU (constructing a `CudaTensor` needs one, error cases included): they are
//! ignored by default and run on the GPU machine with `--include-ignored`. Each checks for a
//! driver and a device first and returns with a `SKIPPED` message when there is none.
#![cfg(feature = "cuda")]

use dtensor_kernels::cuda::Device;
use dtensor_kernels::ops::{self, AttentionMask, BlockAttention, CausalAttentionOutput};
use dtensor_kernels::{reduce, DType, Element, Error, ReduceOp, Tensor};

mod common;
use common::cuda::{assert_bits, assert_bitwise, assert_close, down, gpu, rand_vec, up};

const FLOATS: [DType; 4] = DType::FLOATS;
const ALL: [DType; 6] = DType::ALL;

fn rand(shape: &[usize], dtype: DType, seed: u64) -> Tensor {
    let n = shape.iter().product();
    let v: Vec<f64> = rand_vec(n, seed, -3.0, 3.0)
        .into_iter()
        .map(|x| {
            if dtype.is_float() {
                x
            } else {
                (x * 300.0).trunc()
            }
        })
        .collect();
    Tensor::from_f64_vec(v, shape, dtype).unwrap()
}

/// The op refuses device arguments with the message it gives for the same host arguments.
#[track_caller]
fn assert_same_error<T, U>(what: &str, gpu: Result<T, Error>, cpu: Result<U, Error>) {
    let Err(ce) = cpu else {
        panic!("{what}: the CPU op accepted its arguments")
    };
    let Err(ge) = gpu else {
        panic!("{what}: the GPU op accepted what the CPU op refused: {ce}")
    };
    assert_eq!(
        ge.to_string(),
        ce.to_string(),
        "{what}: the GPU and CPU errors differ"
    );
}

// ---- context-parallel attention pieces ----------------------------------------------

/// `(batch, heads, head_dim, q_pos, k_pos)` of one blockwise attention case.
/// `(batch, KV heads, query heads per KV head, head dim, q positions, k positions)`.
type BlockCase = (usize, usize, usize, usize, Vec<usize>, Vec<usize>);

/// Causal offsets, rows that see no key of the block (`lse = −∞`), keys no query sees, a
/// fully masked block, blocks longer than the CPU's 64-row tile, zigzag chunks, an odd head
/// dim, grouped-query (2 and 4 query heads per KV head) and multi-query blocks, and an
/// empty batch.
fn block_cases() -> Vec<BlockCase> {
    let zig_q: Vec<usize> = (0..4).chain(12..16).collect();
    let zig_k: Vec<usize> = (4..8).chain(8..12).collect();
    vec![
        (2, 3, 1, 4, (3..8).collect(), (0..8).collect()),
        (1, 2, 1, 8, zig_q.clone(), zig_k.clone()),
        (2, 1, 1, 6, zig_k.clone(), zig_q.clone()),
        (3, 2, 1, 4, vec![0, 1], vec![5, 6, 9]),
        (2, 2, 1, 16, (0..70).collect(), (0..70).collect()),
        (1, 1, 1, 2, vec![7], vec![1, 3, 5, 7, 9]),
        (2, 3, 1, 5, (2..9).collect(), (0..6).collect()),
        (2, 2, 2, 4, (3..8).collect(), (0..8).collect()),
        (1, 1, 4, 6, zig_q, zig_k),
        (2, 2, 4, 5, vec![0, 1], vec![1, 2, 5]),
        (0, 2, 1, 4, vec![0, 1, 2], vec![0, 1]),
    ]
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_masked_attention_block_matches_cpu() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        let acc = ops::acc_dtype(dt);
        for (c, (batch, heads, g, d, qp, kp)) in block_cases().into_iter().enumerate() {
            // Samples just long enough for the positions; sample b's second document
            // starts at (b + 1)/4 of it.
            let seq = qp.iter().chain(&kp).max().map_or(1, |&p| p + 1);
            let docs: Vec<u32> = (0..batch * seq)
                .map(|t| u32::from(t % seq >= (t / seq + 1) * seq / 4))
                .collect();
            let docs = &docs[..];
            for (m, mask) in [
                AttentionMask::default().documents(docs),
                AttentionMask::default().window(2),
                AttentionMask::default().documents(docs).window(3),
            ]
            .into_iter()
            .enumerate()
            {
                let cfg = BlockAttention {
                    head_dim: d,
                    q_per_kv: g,
                    scale: None,
                    q_pos: &qp,
                    k_pos: &kp,
                    mask,
                };
                let what = format!("case {c} mask {m} ({dt}, g {g}, q {qp:?}, k {kp:?})");
                let seed = 1000 + 100 * k as u64 + 10 * c as u64 + m as u64;
                let qkv = rand(&[batch * qp.len(), heads * (g + 2) * d], dt, seed);
                let kv = rand(&[batch * kp.len(), heads * 2 * d], dt, seed + 1);
                let (gq, gk) = (up(&qkv, &dev), up(&kv, &dev));
                let cpu = ops::attention_block(&qkv, &kv, &cfg).unwrap();
                let gpu = ops::attention_block(&gq, &gk, &cfg).unwrap();
                assert_close(&format!("{what}: out"), &down(&gpu.out), &cpu.out, 16.0);
                assert_close(&format!("{what}: lse"), &down(&gpu.lse), &cpu.lse, 16.0);
                let out = cpu.out.to_dtype(dt);
                let dout = rand(out.shape(), dt, seed + 2);
                let mut dq = rand(&[batch * qp.len(), heads * g * d], acc, seed + 3);
                let mut dkv = rand(kv.shape(), acc, seed + 4);
                let (mut gdq, mut gdkv) = (up(&dq, &dev), up(&dkv, &dev));
                ops::attention_block_backward(
                    &dout, &qkv, &kv, &out, &cpu.lse, &cfg, &mut dq, &mut dkv,
                )
                .unwrap();
                ops::attention_block_backward(
                    &up(&dout, &dev),
                    &gq,
                    &gk,
                    &up(&out, &dev),
                    &up(&cpu.lse, &dev),
                    &cfg,
                    &mut gdq,
                    &mut gdkv,
                )
                .unwrap();
                assert_close(&format!("{what}: dq"), &down(&gdq), &dq, 64.0);
                assert_close(&format!("{what}: dkv"), &down(&gdkv), &dkv, 64.0);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_attention_block_matches_cpu() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        let acc = ops::acc_dtype(dt);
        for (c, (batch, heads, g, d, qp, kp)) in block_cases().into_iter().enumerate() {
            let cfg = BlockAttention {
                head_dim: d,
                q_per_kv: g,
                scale: None,
                q_pos: &qp,
                k_pos: &kp,
                mask: AttentionMask::CAUSAL,
            };
            let what = format!("case {c} ({dt}, g {g}, q {qp:?}, k {kp:?})");
            let seed = 100 * k as u64 + 10 * c as u64;
            let qkv = rand(&[batch * qp.len(), heads * (g + 2) * d], dt, seed);
            let kv = rand(&[batch * kp.len(), heads * 2 * d], dt, seed + 1);
            let (gq, gk) = (up(&qkv, &dev), up(&kv, &dev));
            let cpu = ops::attention_block(&qkv, &kv, &cfg).unwrap();
            let gpu = ops::attention_block(&gq, &gk, &cfg).unwrap();
            // out and lse are in the compute dtype, from the same rounded inputs.
            assert_close(&format!("{what}: out"), &down(&gpu.out), &cpu.out, 16.0);
            assert_close(&format!("{what}: lse"), &down(&gpu.lse), &cpu.lse, 16.0);

            // The backward from this block's own result as the "final" one, adding into
            // accumulators that already hold something.
            let out = cpu.out.to_dtype(dt);
            let dout = rand(out.shape(), dt, seed + 2);
            let mut dq = rand(&[batch * qp.len(), heads * g * d], acc, seed + 3);
            let mut dkv = rand(kv.shape(), acc, seed + 4);
            let (mut gdq, mut gdkv) = (up(&dq, &dev), up(&dkv, &dev));
            ops::attention_block_backward(
                &dout, &qkv, &kv, &out, &cpu.lse, &cfg, &mut dq, &mut dkv,
            )
            .unwrap();
            ops::attention_block_backward(
                &up(&dout, &dev),
                &gq,
                &gk,
                &up(&out, &dev),
                &up(&cpu.lse, &dev),
                &cfg,
                &mut gdq,
                &mut gdkv,
            )
            .unwrap();
            assert_close(&format!("{what}: dq"), &down(&gdq), &dq, 64.0);
            assert_close(&format!("{what}: dkv"), &down(&gdkv), &dkv, 64.0);
        }

        // Errors: the CPU's checks and messages.
        let (qp, kp) = ([0usize, 1, 2], [0usize, 1]);
        let cfg = BlockAttention {
            head_dim: 4,
            q_per_kv: 1,
            scale: None,
            q_pos: &qp,
            k_pos: &kp,
            mask: AttentionMask::CAUSAL,
        };
        let qkv = rand(&[6, 24], dt, 1);
        let kv = rand(&[4, 16], dt, 2);
        let bad_kv = rand(&[4, 12], dt, 3);
        assert_same_error(
            "kv columns",
            ops::attention_block(&up(&qkv, &dev), &up(&bad_kv, &dev), &cfg),
            ops::attention_block(&qkv, &bad_kv, &cfg),
        );
        let odd = BlockAttention { head_dim: 3, ..cfg };
        assert_same_error(
            "head_dim not dividing the columns",
            ops::attention_block(&up(&qkv, &dev), &up(&kv, &dev), &odd),
            ops::attention_block(&qkv, &kv, &odd),
        );
        let unsorted = [2usize, 1, 3];
        let bad_pos = BlockAttention {
            q_pos: &unsorted,
            ..cfg
        };
        assert_same_error(
            "positions",
            ops::attention_block(&up(&qkv, &dev), &up(&kv, &dev), &bad_pos),
            ops::attention_block(&qkv, &kv, &bad_pos),
        );
        let uneven = rand(&[5, 24], dt, 4);
        assert_same_error(
            "samples",
            ops::attention_block(&up(&uneven, &dev), &up(&kv, &dev), &cfg),
            ops::attention_block(&uneven, &kv, &cfg),
        );
        let c = ops::attention_block(&qkv, &kv, &cfg).unwrap();
        let out = c.out.to_dtype(dt);
        let short = rand(&[6, 12], dt, 5);
        let (mut dq, mut dkv) = (Tensor::zeros(&[6, 8], acc), Tensor::zeros(&[4, 16], acc));
        let (mut gdq, mut gdkv) = (up(&dq, &dev), up(&dkv, &dev));
        assert_same_error(
            "dout shape",
            ops::attention_block_backward(
                &up(&short, &dev),
                &up(&qkv, &dev),
                &up(&kv, &dev),
                &up(&out, &dev),
                &up(&c.lse, &dev),
                &cfg,
                &mut gdq,
                &mut gdkv,
            ),
            ops::attention_block_backward(&short, &qkv, &kv, &out, &c.lse, &cfg, &mut dq, &mut dkv),
        );
        let mut wrong_dq = Tensor::zeros(&[6, 7], acc);
        let mut gwrong = up(&wrong_dq, &dev);
        let dout = rand(&[6, 8], dt, 6);
        assert_same_error(
            "dq shape",
            ops::attention_block_backward(
                &up(&dout, &dev),
                &up(&qkv, &dev),
                &up(&kv, &dev),
                &up(&out, &dev),
                &up(&c.lse, &dev),
                &cfg,
                &mut gwrong,
                &mut gdkv,
            ),
            ops::attention_block_backward(
                &dout,
                &qkv,
                &kv,
                &out,
                &c.lse,
                &cfg,
                &mut wrong_dq,
                &mut dkv,
            ),
        );

        // Over the shared-memory bound: a clear "not on cuda" error, no launch.
        let many: Vec<usize> = (0..20_000).collect();
        let long = BlockAttention {
            head_dim: 2,
            q_per_kv: 1,
            scale: None,
            q_pos: &many[..1],
            k_pos: &many,
            mask: AttentionMask::CAUSAL,
        };
        let e = ops::attention_block(
            &up(&Tensor::zeros(&[1, 6], dt), &dev),
            &up(&Tensor::zeros(&[20_000, 4], dt), &dev),
            &long,
        )
        .unwrap_err();
        assert!(e.to_string().contains("not on cuda"), "{e}");
    }
}

/// A partial result on the CPU: attention of random queries at `qp` to keys at `kp`.
fn partial(dt: DType, qp: &[usize], kp: &[usize], seed: u64) -> CausalAttentionOutput {
    let cfg = BlockAttention {
        head_dim: 4,
        q_per_kv: 1,
        scale: None,
        q_pos: qp,
        k_pos: kp,
        mask: AttentionMask::CAUSAL,
    };
    let qkv = rand(&[2 * qp.len(), 3 * 3 * 4], dt, seed);
    let kv = rand(&[2 * kp.len(), 3 * 2 * 4], dt, seed + 1);
    ops::attention_block(&qkv, &kv, &cfg).unwrap()
}

fn up_out(o: &CausalAttentionOutput, dev: &Device) -> CausalAttentionOutput {
    CausalAttentionOutput {
        out: up(&o.out, dev),
        lse: up(&o.lse, dev),
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_merge_attention_matches_cpu() {
    let Some(dev) = gpu() else { return };
    let qp: Vec<usize> = (4..10).collect();
    // Keys early (every row sees some), late (the first rows see none: lse = −∞ on that
    // side), and past every query (the whole part is −∞).
    let (early, late, past): (Vec<usize>, Vec<usize>, Vec<usize>) =
        ((0..4).collect(), (6..9).collect(), (20..23).collect());
    for (k, dt) in [DType::F32, DType::F64].into_iter().enumerate() {
        for (c, (a, b)) in [
            (&early, &late),
            (&late, &early),
            (&late, &late),
            (&early, &past),
            (&past, &early),
        ]
        .into_iter()
        .enumerate()
        {
            let seed = 10 * k as u64 + 2 * c as u64;
            let mut acc = partial(dt, &qp, a, seed);
            let part = partial(dt, &qp, b, seed + 500);
            let mut gacc = up_out(&acc, &dev);
            ops::merge_attention(&mut gacc, &up_out(&part, &dev)).unwrap();
            ops::merge_attention(&mut acc, &part).unwrap();
            assert_close(&format!("merge {c} out"), &down(&gacc.out), &acc.out, 4.0);
            assert_close(&format!("merge {c} lse"), &down(&gacc.lse), &acc.lse, 4.0);
        }
        // Empty rows: nothing to do, no error.
        let empty = CausalAttentionOutput {
            out: Tensor::zeros(&[0, 8], dt),
            lse: Tensor::zeros(&[0, 2], dt),
        };
        let mut ge = up_out(&empty, &dev);
        ops::merge_attention(&mut ge, &up_out(&empty, &dev)).unwrap();
    }
    // Errors: a storage dtype, mismatched shapes.
    let mut a = partial(DType::F32, &qp, &early, 1);
    let bf = CausalAttentionOutput {
        out: a.out.to_dtype(DType::BF16),
        lse: a.lse.to_dtype(DType::BF16),
    };
    let mut bf2 = CausalAttentionOutput {
        out: bf.out.clone(),
        lse: bf.lse.clone(),
    };
    assert_same_error(
        "bf16 partials",
        ops::merge_attention(&mut up_out(&bf, &dev), &up_out(&bf, &dev)),
        ops::merge_attention(&mut bf2, &bf),
    );
    let short = CausalAttentionOutput {
        out: Tensor::zeros(&[11, 12], DType::F32),
        lse: Tensor::zeros(&[11, 3], DType::F32),
    };
    assert_same_error(
        "rows",
        ops::merge_attention(&mut up_out(&a, &dev), &up_out(&short, &dev)),
        ops::merge_attention(&mut a, &short),
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_pack_kv_fuse_qkv_grad_gather_rows_match_cpu_bitwise() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        let acc = ops::acc_dtype(dt);
        // (rows, KV heads, query heads per KV head, head dim): MHA, GQA, MQA.
        for (rows, heads, g, d) in [
            (5, 3, 1, 4),
            (1, 1, 1, 2),
            (0, 2, 1, 4),
            (7, 2, 1, 6),
            (5, 2, 3, 5),
            (4, 1, 4, 4),
        ] {
            let seed = 40 * k as u64 + rows as u64;
            let qkv = rand(&[rows, heads * (g + 2) * d], dt, seed);
            assert_bitwise(
                "pack_kv",
                &down(&ops::pack_kv(&up(&qkv, &dev), d, g).unwrap()),
                &ops::pack_kv(&qkv, d, g).unwrap(),
            );
            let dq = rand(&[rows, heads * g * d], acc, seed + 1);
            let dkv = rand(&[rows, heads * 2 * d], acc, seed + 2);
            assert_bitwise(
                "fuse_qkv_grad",
                &down(&ops::fuse_qkv_grad(&up(&dq, &dev), &up(&dkv, &dev), d, g, dt).unwrap()),
                &ops::fuse_qkv_grad(&dq, &dkv, d, g, dt).unwrap(),
            );
        }
        let qkv = rand(&[4, 24], dt, 7);
        assert_same_error(
            "pack_kv head_dim",
            ops::pack_kv(&up(&qkv, &dev), 5, 1),
            ops::pack_kv(&qkv, 5, 1),
        );
        let dq = rand(&[4, 8], acc, 8);
        let dkv = rand(&[4, 12], acc, 9);
        assert_same_error(
            "fuse_qkv_grad dkv",
            ops::fuse_qkv_grad(&up(&dq, &dev), &up(&dkv, &dev), 4, 1, dt),
            ops::fuse_qkv_grad(&dq, &dkv, 4, 1, dt),
        );
    }
    let ints = rand(&[2, 12], DType::I32, 1);
    assert_same_error(
        "pack_kv of i32",
        ops::pack_kv(&up(&ints, &dev), 4, 1),
        ops::pack_kv(&ints, 4, 1),
    );
    let (dq, dkv) = (rand(&[2, 4], DType::F32, 2), rand(&[2, 8], DType::F32, 3));
    assert_same_error(
        "fuse_qkv_grad into i64",
        ops::fuse_qkv_grad(&up(&dq, &dev), &up(&dkv, &dev), 4, 1, DType::I64),
        ops::fuse_qkv_grad(&dq, &dkv, 4, 1, DType::I64),
    );
    for (k, dt) in ALL.into_iter().enumerate() {
        let t = rand(&[6, 5], dt, 60 + k as u64);
        let gt = up(&t, &dev);
        for src in [&[5usize, 0, 0, 3][..], &[], &[2, 2, 2, 2, 2, 2, 2, 1]] {
            assert_bitwise(
                &format!("gather_rows {src:?}"),
                &down(&ops::gather_rows(&gt, src).unwrap()),
                &ops::gather_rows(&t, src).unwrap(),
            );
        }
        let narrow = rand(&[3, 0], dt, 1);
        assert_bitwise(
            "gather_rows of no columns",
            &down(&ops::gather_rows(&up(&narrow, &dev), &[1, 2]).unwrap()),
            &ops::gather_rows(&narrow, &[1, 2]).unwrap(),
        );
        assert_same_error(
            "gather_rows out of range",
            ops::gather_rows(&gt, &[1, 6]),
            ops::gather_rows(&t, &[1, 6]),
        );
        let flat = rand(&[6], dt, 2);
        assert_same_error(
            "gather_rows of 1-D",
            ops::gather_rows(&up(&flat, &dev), &[0]),
            ops::gather_rows(&flat, &[0]),
        );
    }
}

// ---- mixture of experts ---------------------------------------------------------------

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_grouped_matmul_matches_cpu() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in FLOATS.into_iter().enumerate() {
        // (groups, out, in): uneven groups with empty ones, all-empty, one expert.
        let cases: [(&[usize], usize, usize); 5] = [
            (&[3, 0, 5, 1], 7, 33),
            (&[0, 4], 9, 5),
            (&[0, 0, 0], 4, 6),
            (&[17], 1, 70),
            (&[2, 3], 6, 0),
        ];
        for (c, (groups, out, inp)) in cases.into_iter().enumerate() {
            let rows: usize = groups.iter().sum();
            let seed = 500 + 20 * k as u64 + 3 * c as u64;
            let x = rand(&[rows, inp], dt, seed);
            let w = rand(&[groups.len(), out, inp], dt, seed + 1);
            let dy = rand(&[rows, out], dt, seed + 2);
            let (gx, gw) = (up(&x, &dev), up(&w, &dev));
            let what = format!("grouped_matmul_t {groups:?} out {out} in {inp} ({dt})");
            assert_close(
                &what,
                &down(&ops::grouped_matmul_t(&gx, &gw, groups).unwrap()),
                &ops::grouped_matmul_t(&x, &w, groups).unwrap(),
                8.0,
            );
            let cg = ops::grouped_matmul_t_backward(&dy, &x, &w, groups).unwrap();
            let gg = ops::grouped_matmul_t_backward(&up(&dy, &dev), &gx, &gw, groups).unwrap();
            assert_close(&format!("{what}: dx"), &down(&gg.dx), &cg.dx, 8.0);
            assert_close(&format!("{what}: dw"), &down(&gg.dw), &cg.dw, 8.0);
        }
        let x = rand(&[5, 3], dt, 1);
        let w = rand(&[2, 4, 3], dt, 2);
        let (gx, gw) = (up(&x, &dev), up(&w, &dev));
        assert_same_error(
            "groups",
            ops::grouped_matmul_t(&gx, &gw, &[2, 2]),
            ops::grouped_matmul_t(&x, &w, &[2, 2]),
        );
        let w2 = rand(&[2, 4, 2], dt, 3);
        assert_same_error(
            "in features",
            ops::grouped_matmul_t(&gx, &up(&w2, &dev), &[2, 3]),
            ops::grouped_matmul_t(&x, &w2, &[2, 3]),
        );
        let dy = rand(&[5, 3], dt, 4);
        assert_same_error(
            "dy shape",
            ops::grouped_matmul_t_backward(&up(&dy, &dev), &gx, &gw, &[2, 3]),
            ops::grouped_matmul_t_backward(&dy, &x, &w, &[2, 3]),
        );
    }
    let x = rand(&[2, 3], DType::I32, 1);
    let w = rand(&[1, 2, 3], DType::I32, 2);
    assert!(ops::grouped_matmul_t(&up(&x, &dev), &up(&w, &dev), &[2]).is_err());
    assert!(ops::grouped_matmul_t(&x, &w, &[2]).is_err());
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_scatter_add_rows_matches_cpu_bitwise() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in ALL.into_iter().enumerate() {
        // (destinations, n, hidden): repeats in any order, rows no source names, no sources,
        // no columns, no rows.
        let cases: [(&[usize], usize, usize); 5] = [
            (&[3, 0, 3, 3, 5, 0, 1], 7, 37),
            (&[2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2], 3, 300),
            (&[], 4, 5),
            (&[1, 0], 2, 0),
            (&[], 0, 3),
        ];
        for (c, (rows, n, h)) in cases.into_iter().enumerate() {
            let src = rand(&[rows.len(), h], dt, 700 + 10 * k as u64 + c as u64);
            let gs = up(&src, &dev);
            let cpu = ops::scatter_add_rows(&src, rows, n).unwrap();
            let gpu = down(&ops::scatter_add_rows(&gs, rows, n).unwrap());
            let what = format!("scatter_add_rows {rows:?} into {n} ({dt})");
            if dt == DType::F16 {
                // The f64 sums round into f16 as Tensor::to_dtype does: through f32 with
                // F16C, directly without it (one ulp apart at ties; see cuda_gpu.rs casts).
                assert_close(&what, &gpu, &cpu, 1.0);
            } else {
                assert_bitwise(&what, &gpu, &cpu);
            }
            // Deterministic: the same bits on every run.
            let again = down(&ops::scatter_add_rows(&gs, rows, n).unwrap());
            assert_bitwise(&format!("{what}, run twice"), &again, &gpu);
        }
        let src = rand(&[3, 2], dt, 1);
        let gs = up(&src, &dev);
        assert_same_error(
            "destination out of range",
            ops::scatter_add_rows(&gs, &[0, 4, 1], 4),
            ops::scatter_add_rows(&src, &[0, 4, 1], 4),
        );
        assert_same_error(
            "destination count",
            ops::scatter_add_rows(&gs, &[0, 1], 4),
            ops::scatter_add_rows(&src, &[0, 1], 4),
        );
    }
}

// ---- the collectives' reductions ----------------------------------------------------

/// `srcs` reduced on the CPU by `reduce::reduce_into` and pairwise by `reduce::combine`.
fn cpu_reduce(srcs: &[Tensor], op: ReduceOp) -> (Tensor, Tensor) {
    fn typed<T: Element + dtensor_kernels::StorageElement>(
        srcs: &[Tensor],
        op: ReduceOp,
    ) -> (Tensor, Tensor) {
        let shape = srcs[0].shape();
        let views: Vec<&[T]> = srcs.iter().map(|t| t.as_slice::<T>().unwrap()).collect();
        let mut dst = vec![T::zero(); views[0].len()];
        reduce::reduce_into(&mut dst, &views, op);
        let mut acc = views[0].to_vec();
        reduce::combine(&mut acc, views[1], op);
        (
            Tensor::from_vec(dst, shape).unwrap(),
            Tensor::from_vec(acc, shape).unwrap(),
        )
    }
    match srcs[0].dtype() {
        DType::F32 => typed::<f32>(srcs, op),
        DType::F64 => typed::<f64>(srcs, op),
        DType::BF16 => typed::<half::bf16>(srcs, op),
        DType::F16 => typed::<half::f16>(srcs, op),
        DType::I32 => typed::<i32>(srcs, op),
        DType::I64 => typed::<i64>(srcs, op),
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored on the GPU machine"]
fn gpu_reductions_match_cpu_bitwise() {
    let Some(dev) = gpu() else { return };
    for (k, dt) in ALL.into_iter().enumerate() {
        for n in [0usize, 1, 1000, 5003] {
            // Three sources; floats with NaNs, signed zeros and ties planted in them.
            let srcs: Vec<Tensor> = (0..3)
                .map(|s| {
                    let mut v = rand(&[n], dt, 900 + 10 * k as u64 + s).to_f64_vec();
                    if dt.is_float() && n >= 1000 {
                        v[7 * s as usize] = f64::NAN;
                        v[100] = if s == 0 { 0.0 } else { -0.0 };
                        v[101] = if s == 1 { 0.0 } else { -0.0 };
                        v[200] = 1.5;
                        v[300 + s as usize] = f64::INFINITY;
                        v[400] = if s == 2 { f64::NEG_INFINITY } else { 2.0 };
                    }
                    Tensor::from_f64_vec(v, &[n], dt).unwrap()
                })
                .collect();
            let gsrcs: Vec<Tensor> = srcs.iter().map(|t| up(t, &dev)).collect();
            let refs: Vec<&Tensor> = gsrcs.iter().collect();
            for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                let what = format!("{op:?} of {n} {dt}");
                // Max/Min move bits (NaN payloads included); a Sum/Avg NaN is computed.
                let arith = matches!(op, ReduceOp::Sum | ReduceOp::Avg);
                let (want, want_pair) = cpu_reduce(&srcs, op);
                let mut dst = Tensor::zeros_on(Some(&dev), &[n], dt).unwrap();
                ops::reduce_into(&mut dst, &refs, op).unwrap();
                assert_bits(&format!("reduce_into {what}"), &down(&dst), &want, arith);
                let mut acc = up(&srcs[0], &dev);
                ops::combine(&mut acc, &gsrcs[1], op).unwrap();
                assert_bits(&format!("combine {what}"), &down(&acc), &want_pair, arith);
                // One source: a copy (Avg divides by one).
                let mut one = Tensor::zeros_on(Some(&dev), &[n], dt).unwrap();
                ops::reduce_into(&mut one, &refs[..1], op).unwrap();
                let what = format!("reduce_into of one, {what}");
                assert_bits(&what, &down(&one), &srcs[0], op == ReduceOp::Avg);
            }
        }
        let a = up(&rand(&[4], dt, 1), &dev);
        let mut b = up(&rand(&[5], dt, 2), &dev);
        assert!(
            ops::combine(&mut b, &a, ReduceOp::Max).is_err(),
            "length mismatch"
        );
        assert!(
            ops::reduce_into(&mut b, &[&a], ReduceOp::Sum).is_err(),
            "length mismatch"
        );
    }
    let a = up(&rand(&[4], DType::F32, 1), &dev);
    let mut b = up(&rand(&[4], DType::F64, 2), &dev);
    assert!(
        ops::combine(&mut b, &a, ReduceOp::Sum).is_err(),
        "dtype mismatch"
    );
}
