//! Blockwise attention (`ops::attention_block`, `merge_attention`,
//! `attention_block_backward`): cutting each sample into chunks held by `cp` "ranks"
//! (zigzag or contiguous), attending every rank's queries to every rank's keys block by
//! block and merging by lse must give the full kernel's output, lse and gradient.
//! Tolerances: f64 `1e-12` relative to the tensor's largest value; f32 `2e-5`.

mod common;

use common::*;
use dtensor_kernels::ops::{self, AttentionMask, BlockAttention, CausalAttention};
use dtensor_kernels::{DType, Tensor};

/// Positions (within a sample) rank `c` of `cp` holds.
fn positions(s: usize, cp: usize, c: usize, zigzag: bool) -> Vec<usize> {
    if zigzag {
        let n = s / (2 * cp);
        (c * n..(c + 1) * n)
            .chain((2 * cp - 1 - c) * n..(2 * cp - c) * n)
            .collect()
    } else {
        let n = s / cp;
        (c * n..(c + 1) * n).collect()
    }
}

/// Rows of the natural-order tensor rank `c` holds: its positions of every sample.
fn rows_of(batch: usize, s: usize, pos: &[usize]) -> Vec<usize> {
    (0..batch)
        .flat_map(|b| pos.iter().map(move |p| b * s + p))
        .collect()
}

fn max_rel(got: &[f64], want: &[f64]) -> f64 {
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs())).max(1e-300);
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / scale)
        .fold(0.0, f64::max)
}

/// `heads` is the KV heads, each shared by `g` query heads.
#[allow(clippy::too_many_arguments)]
fn run_grouped(
    dtype: DType,
    batch: usize,
    s: usize,
    kv_heads: usize,
    g: usize,
    d: usize,
    cp: usize,
    zigzag: bool,
) {
    run_masked(
        dtype,
        batch,
        s,
        kv_heads,
        g,
        d,
        cp,
        zigzag,
        AttentionMask::CAUSAL,
    );
}

/// [`run_grouped`] under `mask` (its document ids those of the `batch` whole samples).
#[allow(clippy::too_many_arguments)]
fn run_masked(
    dtype: DType,
    batch: usize,
    s: usize,
    kv_heads: usize,
    g: usize,
    d: usize,
    cp: usize,
    zigzag: bool,
    mask: AttentionMask,
) {
    let tol = if dtype == DType::F64 { 1e-12 } else { 2e-5 };
    let cfg = CausalAttention::new(s, d).grouped(g);
    let heads = kv_heads * g;
    let (qkv, _) = input(&[batch * s, kv_heads * (g + 2) * d], 7, 1.5, dtype);
    let (dout, _) = input(&[batch * s, heads * d], 11, 1.0, dtype);
    let full = ops::causal_attention_masked(&qkv, &cfg, &mask).unwrap();
    let dfull =
        ops::causal_attention_masked_backward(&dout, &qkv, &full.out, &full.lse, &cfg, &mask)
            .unwrap();
    // The causal mask compares positions only: an offset shared by q and k changes nothing.
    // Document ids are looked up by position, so with them the positions are the true ones.
    let offset = if mask.documents.is_some() { 0 } else { 3 };
    let pos: Vec<Vec<usize>> = (0..cp)
        .map(|c| {
            positions(s, cp, c, zigzag)
                .iter()
                .map(|p| p + offset)
                .collect()
        })
        .collect();
    let rows: Vec<Vec<usize>> = (0..cp)
        .map(|c| rows_of(batch, s, &positions(s, cp, c, zigzag)))
        .collect();
    let local: Vec<Tensor> = rows
        .iter()
        .map(|r| ops::gather_rows(&qkv, r).unwrap())
        .collect();
    let kvs: Vec<Tensor> = local
        .iter()
        .map(|t| ops::pack_kv(t, d, g).unwrap())
        .collect();
    assert_eq!(
        kvs[0].shape()[1],
        kv_heads * 2 * d,
        "only the KV heads travel"
    );
    let acc = ops::acc_dtype(dtype);
    let mut dkv: Vec<Tensor> = kvs.iter().map(|t| Tensor::zeros(t.shape(), acc)).collect();
    // Queries of rank `c` against the keys of rank `o`.
    let block = |c: usize, o: usize| BlockAttention {
        head_dim: d,
        q_per_kv: g,
        scale: None,
        q_pos: &pos[c],
        k_pos: &pos[o],
        mask,
    };
    let mut skipped = 0;
    let mut dqkv_parts = Vec::new();
    for c in 0..cp {
        let mut merged: Option<ops::CausalAttentionOutput> = None;
        for (o, kv) in kvs.iter().enumerate() {
            let b = block(c, o);
            skipped += b.fully_masked(batch) as usize;
            let part = ops::attention_block(&local[c], kv, &b).unwrap();
            match merged.as_mut() {
                None => merged = Some(part),
                Some(m) => ops::merge_attention(m, &part).unwrap(),
            }
        }
        let m = merged.unwrap();
        let out = m.out.to_dtype(dtype);
        let want_out = ops::gather_rows(&full.out, &rows[c]).unwrap().to_f64_vec();
        let want_lse = ops::gather_rows(&full.lse, &rows[c]).unwrap().to_f64_vec();
        let (eo, el) = (
            max_rel(&out.to_f64_vec(), &want_out),
            max_rel(&m.lse.to_f64_vec(), &want_lse),
        );
        assert!(
            eo <= tol && el <= tol,
            "{dtype} cp {cp} zigzag {zigzag} rank {c}: out {eo:e}, lse {el:e}"
        );
        // Backward from the full kernel's own out and lse (what a ring rank saves).
        let dout_c = ops::gather_rows(&dout, &rows[c]).unwrap();
        let out_c = ops::gather_rows(&full.out, &rows[c]).unwrap();
        let lse_c = ops::gather_rows(&full.lse, &rows[c]).unwrap();
        let mut dq = Tensor::zeros(&[rows[c].len(), heads * d], acc);
        for o in 0..cp {
            let b = block(c, o);
            ops::attention_block_backward(
                &dout_c,
                &local[c],
                &kvs[o],
                &out_c,
                &lse_c,
                &b,
                &mut dq,
                &mut dkv[o],
            )
            .unwrap();
        }
        dqkv_parts.push(dq);
    }
    if !mask.is_causal() {
        // Documents and windows skip more; `masked_blocks_are_skipped` counts them.
    } else if !zigzag {
        // Rank c's queries never see a later rank's keys.
        assert_eq!(skipped, cp * (cp - 1) / 2);
    } else {
        assert_eq!(skipped, 0);
    }
    for c in 0..cp {
        let dqkv = ops::fuse_qkv_grad(&dqkv_parts[c], &dkv[c], d, g, dtype).unwrap();
        let want = ops::gather_rows(&dfull, &rows[c]).unwrap().to_f64_vec();
        let e = max_rel(&dqkv.to_f64_vec(), &want);
        eprintln!(
            "{dtype} b{batch} s{s} kv{kv_heads} g{g} cp{cp} zigzag {zigzag} rank {c}: dqkv max rel err {e:e}"
        );
        assert!(
            e <= tol,
            "{dtype} cp {cp} zigzag {zigzag} rank {c}: dqkv {e:e}"
        );
    }
}

fn run(dtype: DType, batch: usize, s: usize, heads: usize, d: usize, cp: usize, zigzag: bool) {
    run_grouped(dtype, batch, s, heads, 1, d, cp, zigzag);
}

#[test]
fn grouped_blocks_merged_equal_the_full_kernel() {
    // GQA (2 and 4 query heads per KV head), MQA (one KV head for 4 query heads).
    for &(kv, g, d) in &[(2, 2, 4), (1, 4, 3), (2, 4, 8)] {
        for &(cp, zz) in &[(1, false), (2, true), (3, false)] {
            run_grouped(DType::F64, 2, 48, kv, g, d, cp, zz);
        }
    }
    run_grouped(DType::F32, 2, 48, 2, 2, 4, 2, true);
}

#[test]
fn blocks_merged_equal_the_full_kernel_f64() {
    for &(cp, zz) in &[
        (1, false),
        (2, true),
        (2, false),
        (4, true),
        (4, false),
        (3, true),
    ] {
        run(DType::F64, 3, 48, 2, 4, cp, zz);
    }
    // Tiles of 64 inside a block (a rank holds 80 and 160 rows per sample).
    run(DType::F64, 2, 320, 1, 8, 2, true);
    run(DType::F64, 1, 320, 1, 8, 4, false);
    // An odd head dim.
    run(DType::F64, 2, 48, 3, 5, 2, true);
}

#[test]
fn blocks_merged_equal_the_full_kernel_f32() {
    run(DType::F32, 3, 48, 2, 4, 2, true);
    run(DType::F32, 2, 320, 1, 8, 2, false);
}

/// Per token of `batch` samples of `s`, documents of the given lengths (the last one
/// runs to the sample's end), numbered per sample.
fn doc_ids(batch: usize, s: usize, lens: &[&[usize]]) -> Vec<u32> {
    (0..batch)
        .flat_map(|b| {
            let mut ids = Vec::with_capacity(s);
            for (k, &n) in lens[b].iter().enumerate() {
                ids.extend(std::iter::repeat_n(k as u32, n));
            }
            ids.resize(s, lens[b].len() as u32);
            ids
        })
        .collect()
}

#[test]
fn masked_blocks_merged_equal_the_masked_full_kernel() {
    // Documents crossing chunk edges and differing per sample, a window, both; GQA.
    let ids = doc_ids(2, 48, &[&[5, 20, 11], &[30]]);
    let masks = [
        AttentionMask::default().documents(&ids),
        AttentionMask::default().window(7),
        AttentionMask::default().documents(&ids).window(13),
    ];
    for mask in masks {
        for &(cp, zz) in &[(1, false), (2, true), (2, false), (3, true), (4, false)] {
            run_masked(DType::F64, 2, 48, 2, 1, 4, cp, zz, mask);
            run_masked(DType::F64, 2, 48, 1, 2, 3, cp, zz, mask);
        }
        run_masked(DType::F32, 2, 48, 2, 2, 4, 2, true, mask);
    }
    // Tiles of 64 inside a block.
    let long = doc_ids(1, 320, &[&[100, 150]]);
    let mask = AttentionMask::default().documents(&long).window(90);
    run_masked(DType::F64, 1, 320, 1, 1, 8, 2, true, mask);
}

fn blk<'a>(q: &'a [usize], k: &'a [usize], mask: AttentionMask<'a>) -> BlockAttention<'a> {
    BlockAttention {
        head_dim: 2,
        q_per_kv: 1,
        scale: None,
        q_pos: q,
        k_pos: k,
        mask,
    }
}

#[test]
fn masked_blocks_are_skipped() {
    // cp = 2, zigzag, 2 samples of 16: rank 0 holds positions 0..4 and 12..16, rank 1 4..12.
    let (p0, p1) = (positions(16, 2, 0, true), positions(16, 2, 1, true));
    let window = |w| AttentionMask::default().window(w);
    // Documents 0..4 and 4..16 in both samples.
    let ids = doc_ids(2, 16, &[&[4], &[4]]);
    let docs = AttentionMask::default().documents(&ids);
    // Rank 1's queries see rank 0's keys 0..4 ...
    assert!(!blk(&p1, &p0, AttentionMask::CAUSAL).fully_masked(2));
    // ... unless those lie in another document (and 12..16 are in their future).
    assert!(blk(&p1, &p0, docs).fully_masked(2));
    // Rank 0's late queries see rank 1's keys of their document.
    assert!(!blk(&p0, &p1, docs).fully_masked(2));
    // Per sample: with sample 0 one document, its queries see the keys again.
    let mixed = doc_ids(2, 16, &[&[16], &[4]]);
    assert!(!blk(&p1, &p0, AttentionMask::default().documents(&mixed)).fully_masked(2));
    // Windows: query 4 with 4 keys reaches back to 1; with 1 key, only itself. Query 12
    // with 2 keys sees 11.
    assert!(!blk(&p1, &p0, window(4)).fully_masked(2));
    assert!(blk(&p1, &p0, window(1)).fully_masked(2));
    assert!(!blk(&p0, &p1, window(2)).fully_masked(2));
    assert!(blk(&p0, &p1, window(1)).fully_masked(2));
    // A fully masked block is not computed: no tile, out 0 and lse −∞, no gradient.
    let (qkv, _) = input(&[2 * 8, 6], 5, 1.0, DType::F64);
    let (dout, _) = input(&[2 * 8, 2], 6, 1.0, DType::F64);
    let kv = ops::pack_kv(&qkv, 2, 1).unwrap();
    let masked = blk(&p1, &p0, docs);
    let t0 = ops::host_tiles_computed();
    let r = ops::attention_block(&qkv, &kv, &masked).unwrap();
    assert!(r.out.to_f64_vec().iter().all(|&x| x == 0.0));
    assert!(r.lse.to_f64_vec().iter().all(|&x| x == f64::NEG_INFINITY));
    let (mut dq, mut dkv) = (
        Tensor::zeros(&[16, 2], DType::F64),
        kv.zeros_like().unwrap(),
    );
    let out = Tensor::zeros(&[16, 2], DType::F64);
    let lse = Tensor::zeros(&[16, 1], DType::F64);
    ops::attention_block_backward(&dout, &qkv, &kv, &out, &lse, &masked, &mut dq, &mut dkv)
        .unwrap();
    assert_eq!(ops::host_tiles_computed(), t0);
    assert!(dq
        .to_f64_vec()
        .iter()
        .chain(&dkv.to_f64_vec())
        .all(|&x| x == 0.0));
    // The same block unmasked computes one tile per sample, forward and backward.
    ops::attention_block(&qkv, &kv, &blk(&p1, &p0, AttentionMask::CAUSAL)).unwrap();
    assert_eq!(ops::host_tiles_computed(), t0 + 2);
}

#[test]
fn block_masks_that_do_not_fit_are_errors() {
    let (qkv, _) = input(&[4, 6], 5, 1.0, DType::F64);
    let kv = ops::pack_kv(&qkv, 2, 1).unwrap();
    let ids = [0u32; 5];
    let pos = [0usize, 1];
    let b = BlockAttention {
        head_dim: 2,
        q_per_kv: 1,
        scale: None,
        q_pos: &pos,
        k_pos: &pos,
        mask: AttentionMask::default().documents(&ids),
    };
    // 2 samples: 5 ids are not whole samples.
    let e = assert_names_op(ops::attention_block(&qkv, &kv, &b), "ops::attention_block");
    assert!(e.to_string().contains("5 document ids"), "{e}");
    // 2 samples of 1 token: position 1 lies past them.
    let ids = [0u32; 2];
    let b = BlockAttention {
        mask: AttentionMask::default().documents(&ids),
        ..b
    };
    let e = assert_names_op(ops::attention_block(&qkv, &kv, &b), "ops::attention_block");
    assert!(e.to_string().contains("position 1"), "{e}");
    let b = BlockAttention {
        mask: AttentionMask::default().window(0),
        ..b
    };
    assert_names_op(ops::attention_block(&qkv, &kv, &b), "ops::attention_block");
}

#[test]
fn bf16_blocks_run() {
    // bf16 reads rounded inputs and computes in f32: the merged output rounds once.
    run_bf16();
}

fn run_bf16() {
    let (qkv, _) = input(&[8, 2 * 3 * 4], 3, 1.0, DType::BF16);
    let q_pos: Vec<usize> = (4..8).collect();
    let k_pos: Vec<usize> = (0..4).collect();
    let kv = ops::pack_kv(&qkv, 4, 1).unwrap();
    let b = BlockAttention {
        head_dim: 4,
        q_per_kv: 1,
        scale: None,
        q_pos: &q_pos,
        k_pos: &k_pos,
        mask: AttentionMask::CAUSAL,
    };
    let r = ops::attention_block(&qkv, &kv, &b).unwrap();
    assert_eq!(r.out.dtype(), DType::F32);
    assert!(r.lse.to_f64_vec().iter().all(|x| x.is_finite()));
}

#[test]
fn a_fully_masked_block_contributes_nothing() {
    let (qkv, _) = input(&[4, 6], 5, 1.0, DType::F64);
    let kv = ops::pack_kv(&qkv, 2, 1).unwrap();
    let (q_pos, k_pos) = ([0usize, 1], [2usize, 3]);
    let b = BlockAttention {
        head_dim: 2,
        q_per_kv: 1,
        scale: None,
        q_pos: &q_pos,
        k_pos: &k_pos,
        mask: AttentionMask::CAUSAL,
    };
    assert!(b.fully_masked(2));
    let r = ops::attention_block(&qkv, &kv, &b).unwrap();
    assert!(r.out.to_f64_vec().iter().all(|&x| x == 0.0));
    assert!(r.lse.to_f64_vec().iter().all(|&x| x == f64::NEG_INFINITY));
    // Merging it into a real result changes nothing.
    let full_b = BlockAttention { k_pos: &q_pos, ..b };
    let mut m = ops::attention_block(&qkv, &kv, &full_b).unwrap();
    let before = m.clone();
    ops::merge_attention(&mut m, &r).unwrap();
    assert_eq!(m, before);
}

#[test]
fn bad_blocks_are_errors_naming_the_op() {
    let (qkv, _) = input(&[4, 6], 5, 1.0, DType::F64);
    let kv = ops::pack_kv(&qkv, 2, 1).unwrap();
    let mk = |q: &'static [usize], k: &'static [usize]| BlockAttention {
        head_dim: 2,
        q_per_kv: 1,
        scale: None,
        q_pos: q,
        k_pos: k,
        mask: AttentionMask::CAUSAL,
    };
    assert_names_op(
        ops::attention_block(&qkv, &kv, &mk(&[1, 1], &[0, 1])),
        "ops::attention_block",
    );
    assert_names_op(
        ops::attention_block(&qkv, &kv, &mk(&[0, 1, 2], &[0, 1])),
        "ops::attention_block",
    );
    let kv_bad = Tensor::zeros(&[4, 6], DType::F64);
    assert_names_op(
        ops::attention_block(&qkv, &kv_bad, &mk(&[0, 1], &[0, 1])),
        "ops::attention_block",
    );
}

#[test]
fn overflowing_head_dims_are_errors_not_panics() {
    let (qkv, _) = input(&[4, 6], 5, 1.0, DType::F64);
    let kv = ops::pack_kv(&qkv, 2, 1).unwrap();
    // 3·head_dim does not fit a usize.
    let huge = usize::MAX - 1;
    assert_names_op(ops::pack_kv(&qkv, huge, 1), "ops::pack_kv");
    let cfg = BlockAttention {
        head_dim: huge,
        q_per_kv: 1,
        scale: None,
        q_pos: &[0, 1],
        k_pos: &[0, 1],
        mask: AttentionMask::CAUSAL,
    };
    assert_names_op(
        ops::attention_block(&qkv, &kv, &cfg),
        "ops::attention_block",
    );
    // An empty dq of so many heads that dkv's H·2·d columns, and the fused H·3·d, do not fit.
    let dq = Tensor::zeros(&[0, usize::MAX - 1], DType::F32);
    let dkv = Tensor::zeros(&[0, 2], DType::F32);
    assert_names_op(
        ops::fuse_qkv_grad(&dq, &dkv, 1, 1, DType::F32),
        "ops::fuse_qkv_grad",
    );
}
