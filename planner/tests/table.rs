//! The background notes' "communication cost per token" table against the planner.
//!
//! The table (transformer block, hidden `h`, TP degree `t`, bf16) says, per token:
//!
//! | strategy | table | planner (dtensor) | verdict |
//! |---|---|---|---|
//! | TP | `~4h(t−1)/t` per block | forward: 2 all-reduces × `2(t−1)/t·h` = `4h(t−1)/t` **elements**; a step (forward + backward) sends twice that, and in bf16 bytes twice again: `16h(t−1)/t` B | the table counts elements of the forward pass only |
//! | PP | `2h` per boundary | activation + gradient, `h` each: `2h` elements with SP; **without SP every TP rank sends its replica**: `2h·t` | table right for one copy; dtensor without SP sends `t` copies |
//! | DP | `2 × params × bytes` per step | ring all-reduce `2(d−1)/d × params × bytes` per rank | the table is the `d → ∞` limit |
//! | FSDP | `~2 × params_per_layer × bytes` per layer per step | gather + reduce-scatter `2(d−1)/d × P_layer × bytes` (reshard: 3×) per microbatch | table is the limit, without reshard, one microbatch |
//! | EP | `2·top_k·h` per MoE layer | dispatch + combine forward, uniform routing: `2·top_k·h·(ep−1)/ep` (the copies routed to the own rank stay) | table ignores local experts; the backward doubles it |
//! | CP | `2h · seq_shard` per ring step | ring forward per layer: `(cp−1)` steps of K,V = `2h·seq_shard` each | equal (backward adds K,V again and dK,dV for `cp` hops) |
//!
//! Elements below; multiply by 2 for the table's bf16 bytes.
use dtensor_planner::{plan, Axis, Composition, Model};

fn item(p: &dtensor_planner::Plan, what: &str) -> u64 {
    p.items
        .iter()
        .filter(|i| i.what == what)
        .map(|i| i.bytes)
        .sum()
}

#[test]
fn tp_per_token_per_block() {
    for (model, t, table) in [
        ("7b", 8u64, 14336.0),
        ("70b", 8, 28672.0),
        ("7b", 4, 12288.0),
    ] {
        let m = Model::preset(model).unwrap();
        let c: Composition = format!("tp={t},bf16").parse().unwrap();
        let p = plan(&m, &c).unwrap();
        let bytes = item(&p, "blocks: attention + MLP entries/exits") as f64;
        // Per rank, per token it holds (every TP rank holds all its group's tokens), per
        // block, in elements (bf16: 2 B).
        let per = bytes / t as f64 / p.tokens as f64 / m.layers as f64 / 2.0;
        // Forward is half of forward + backward.
        assert_eq!(per / 2.0, table, "{model} t={t}");
        // SP moves the same (all-gather + reduce-scatter for each all-reduce).
        let sp = plan(&m, &format!("tp={t},sp,bf16").parse().unwrap()).unwrap();
        let key = "blocks: attention + MLP entries/exits";
        assert_eq!(item(&sp, key), item(&p, key));
        assert!(sp.axis_bytes(Axis::Tp) > p.axis_bytes(Axis::Tp)); // + norm gradients
    }
}

#[test]
fn pp_per_token_per_boundary() {
    let m = Model::preset("7b").unwrap();
    for (spec, copies) in [("pp=4,tp=2,sp,m=8,bf16", 1.0), ("pp=4,tp=2,m=8,bf16", 2.0)] {
        let p = plan(&m, &spec.parse().unwrap()).unwrap();
        let hops = item(&p, "stage hops (activation + gradient)") as f64;
        let per = hops / 3.0 / p.tokens as f64 / 2.0; // 3 boundaries, bf16
        assert_eq!(per, 2.0 * 4096.0 * copies, "{spec}");
    }
}

#[test]
fn dp_per_step() {
    // "a 70B model is about 140 GB of gradient traffic every step" (bf16 gradients).
    let m = Model::preset("70b").unwrap();
    let params = m.parameters() as f64;
    assert!((params / 70e9 - 1.0).abs() < 0.01, "{params}");
    assert!((params * 2.0 / 140e9 - 1.0).abs() < 0.01);
    // Ring all-reduce: table 2 × params × bytes per rank; the planner 2(d−1)/d of it.
    let small = Model::preset("7b").unwrap();
    for d in [2u64, 8, 64] {
        let c: Composition = format!("dp={d},reduce-bf16").parse().unwrap();
        let mut mm = small.clone();
        mm.global_batch = 64 * 8;
        let p = plan(&mm, &c).unwrap();
        let per_rank = item(&p, "gradient all-reduce") as f64 / d as f64;
        let table = 2.0 * mm.parameters() as f64 * 2.0;
        assert!(
            (per_rank / table - (d - 1) as f64 / d as f64).abs() < 1e-12,
            "d={d}"
        );
    }
}

#[test]
fn fsdp_per_layer() {
    let m = Model::preset("7b").unwrap();
    let d = 8u64;
    let p = plan(
        &m,
        &format!("dp={d},fsdp,no-reshard,reduce-bf16")
            .parse()
            .unwrap(),
    )
    .unwrap();
    let moved =
        (item(&p, "parameter all-gather") + item(&p, "gradient reduce-scatter")) as f64 / d as f64;
    // Everything but the embedding, head and final norm is in the blocks.
    let table = 2.0 * m.parameters() as f64 * 2.0;
    assert!((moved / table - 7.0 / 8.0).abs() < 1e-12);
    let re = plan(&m, &format!("dp={d},fsdp,reduce-bf16").parse().unwrap()).unwrap();
    let moved_re = (item(&re, "parameter all-gather") + item(&re, "gradient reduce-scatter"))
        as f64
        / d as f64;
    assert!((moved_re / moved - 1.5).abs() < 1e-12);
}

#[test]
fn ep_per_token_per_moe_layer() {
    // The notes' exercise: top_k = 2, hidden 8192, EP = 8: 2·2·8192 = 32768 elements.
    let m = Model {
        hidden: 8192,
        heads: 64,
        layers: 4,
        ffn: 8192,
        moe: Some(dtensor_planner::Moe {
            experts: 8,
            top_k: 2,
        }),
        global_batch: 8,
        ..Model::preset("moe-8x7b").unwrap()
    };
    let p = plan(&m, &"ep=8,bf16".parse().unwrap()).unwrap();
    let per = item(&p, dtensor_planner::MOE_DISPATCH) as f64 / p.tokens as f64 / 4.0 / 2.0;
    // Forward and backward: 2 × the forward's 2·k·h·(ep−1)/ep.
    assert_eq!(per / 2.0, 32768.0 * 7.0 / 8.0);
}

#[test]
fn cp_per_ring_step() {
    let m = Model::preset("7b").unwrap();
    let cp = 8u64;
    let p = plan(&m, &format!("cp={cp},bf16").parse().unwrap()).unwrap();
    let attn = item(&p, "attention (ring K/V or all-to-all)") as f64;
    // Per rank per layer: forward (cp−1)·2h·T, backward (cp−1)·2h·T + cp·2h·T with dK,dV
    // in f32 (twice the bytes): in bf16 elements (2·(cp−1) + 2·cp)·2h·T
    let t = p.tokens as f64 / cp as f64;
    let per_rank_layer = attn / cp as f64 / m.layers as f64 / 2.0;
    let step = 2.0 * 4096.0 * t; // 2h · seq_shard elements, all samples of the rank
    assert_eq!(
        per_rank_layer,
        step * (2.0 * (cp - 1) as f64 + 2.0 * cp as f64)
    );
}
