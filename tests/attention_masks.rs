//! Masked attention as a typed op (`DTensor::causal_attention_masked`, its tape twin):
//! on ranks that split the samples (`Dp`) and the KV groups (`Tp`), every rank reads its
//! own rows' document ids from the global ids, and the output and QKV gradient equal the
//! single-rank kernel's (`ops::causal_attention_masked`) bit for bit (each rank runs the
//! kernel on whole samples and whole heads). Context parallelism under masks is in
//! `context_parallel.rs`.

mod common;

use common::{on_mesh, values};
use dtensor::kernels::ops::{self, AttentionMask, CausalAttention};
use dtensor::prelude::*;

/// 4 samples of 10 tokens with their own documents; 2 KV groups of 2 query heads of dim 3.
const SAMPLES: usize = 4;
const SEQ: usize = 10;

fn ids() -> Vec<u32> {
    let starts: [&[usize]; SAMPLES] = [&[0, 4], &[0], &[0, 1, 9], &[0, 5, 7]];
    starts
        .iter()
        .flat_map(|s| (0..SEQ).map(move |p| s.iter().filter(|&&b| b <= p).count() as u32))
        .collect()
}

#[test]
fn masked_attention_on_dp_and_tp_shards_equals_one_rank_bit_for_bit() {
    let cfg = CausalAttention::new(SEQ, 3).grouped(2);
    let ids = ids();
    let qkv = values(&[SAMPLES * SEQ, 2 * 4 * 3], 1);
    let dout = values(&[SAMPLES * SEQ, 4 * 3], 2);
    for mask in [
        AttentionMask::default().documents(&ids),
        AttentionMask::default().window(3),
        AttentionMask::default().documents(&ids).window(4),
    ] {
        let want = ops::causal_attention_masked(&qkv, &cfg, &mask).unwrap();
        let want_dqkv =
            ops::causal_attention_masked_backward(&dout, &qkv, &want.out, &want.lse, &cfg, &mask)
                .unwrap();
        let got = on_mesh(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)], |m| {
            type L = layout![Dp: Shard<0>, Tp: Shard<1>];
            let src = |t: &Tensor| Some(t.clone()).filter(|_| m.rank() == 0);
            let x = DTensor::<L>::distribute(src(&qkv).as_ref(), 0, m)?;
            let w = DTensor::<L>::distribute(src(&dout).as_ref(), 0, m)?;
            let plain = x.causal_attention_masked(&cfg, &mask)?;
            let tape = Tape::new();
            let xv = tape.leaf(x);
            let y = xv.causal_attention_masked(&cfg, &mask)?;
            let yv = y.value().clone();
            let mut grads = y.backward_with(w)?;
            let dx = grads.take(&xv)?;
            Ok((plain.full_tensor()?, yv.full_tensor()?, dx.full_tensor()?))
        });
        for (plain, out, dx) in got {
            assert_eq!(plain, want.out, "{mask:?}");
            assert_eq!(out, want.out, "{mask:?}");
            assert_eq!(dx, want_dqkv, "{mask:?}");
        }
    }
}

#[test]
fn masks_that_do_not_fit_the_global_tokens_are_errors() {
    let cfg = CausalAttention::new(SEQ, 3);
    let qkv = values(&[SAMPLES * SEQ, 3 * 3], 3);
    let ids = ids();
    let errs = on_mesh(&[(AxisKind::Dp, 2)], |m| {
        let x = DTensor::<layout![Dp: Shard<0>]>::distribute(
            Some(&qkv).filter(|_| m.rank() == 0),
            0,
            m,
        )?;
        // The rank's own 20 ids instead of the 40 global ones.
        let local = &ids[..SEQ * 2];
        let short = x
            .causal_attention_masked(&cfg, &AttentionMask::default().documents(local))
            .unwrap_err()
            .to_string();
        let window = x
            .causal_attention_masked(&cfg, &AttentionMask::default().window(0))
            .unwrap_err()
            .to_string();
        Ok((short, window))
    });
    for (short, window) in errs {
        assert!(
            short.contains("DTensor::causal_attention_masked")
                && short.contains("20 document ids")
                && short.contains("40 global tokens"),
            "{short}"
        );
        assert!(
            window.contains("DTensor::causal_attention_masked") && window.contains("window"),
            "{window}"
        );
    }
}
