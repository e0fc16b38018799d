//! The planner against the implementation: a few real training steps of the GPT on thread
//! ranks per composition, and the bytes each mesh axis's communicator counted (summed over
//! ranks, one steady step) and the peak per-rank tensor memory compared with
//! [`dtensor_planner::plan`].
use dtensor_collectives::threads;
use dtensor_core::{DTensor, DeviceMesh, Error};
use dtensor_kernels::{memory, DType, Tensor};
use dtensor_nn::pipeline::{self, microbatches, Pipeline};
use dtensor_nn::{
    to_stream_order, AdamW, ContextParallel, DataMode, Ddp, Fsdp, GptConfig, Ids, NoSp, Precision,
    SeqMode, Sp, Zero1, Zero2,
};
use dtensor_placement::AxisKind;
use dtensor_planner::{plan, Axis, Composition, DataKind, Model};

const TEXT: &[u8] = include_bytes!("../../data/tiny_corpus.txt");

/// What one steady step measured: bytes sent per axis (summed over ranks) and the largest
/// per-rank peak of live tensor bytes.
#[derive(Debug, Clone)]
struct Measured {
    bytes: Vec<(Axis, u64)>,
    peak: u64,
}

fn axis_of(k: AxisKind) -> Axis {
    match k {
        AxisKind::Pp => Axis::Pp,
        AxisKind::Dp => Axis::Dp,
        AxisKind::Ep => Axis::Ep,
        AxisKind::Cp => Axis::Cp,
        AxisKind::Tp => Axis::Tp,
        other => panic!("unexpected axis {other:?}"),
    }
}

fn gpt_config(model: &Model, c: &Composition) -> GptConfig {
    let precision = if c.bf16 {
        Precision::mixed(DType::BF16, DType::F32)
    } else {
        Precision::default()
    };
    GptConfig {
        vocab: model.vocab,
        hidden: model.hidden,
        heads: model.heads,
        kv_heads: Some(model.kv_heads),
        layers: model.layers,
        ffn: model.ffn,
        seq_len: model.seq_len,
        precision: precision.resharded(c.data == DataKind::Fsdp && c.reshard),
        recompute: c.recompute,
        context: ContextParallel {
            strategy: c.cp_strategy,
            zigzag: c.zigzag,
        },
        moe: model
            .moe
            .map(|m| dtensor_nn::MoeConfig::new(m.experts, m.top_k)),
        ..GptConfig::small(DType::F32)
    }
}

fn batch(model: &Model, step: usize) -> (Tensor, Tensor) {
    let (b, s) = (model.global_batch, model.seq_len);
    let span = TEXT.len() - s - 1;
    let (mut ids, mut tg) = (Vec::new(), Vec::new());
    for i in 0..b {
        let start = ((step * b + i) * 7919 + i * 131) % span;
        ids.extend(TEXT[start..start + s].iter().map(|&c| c as i64));
        tg.extend(TEXT[start + 1..start + s + 1].iter().map(|&c| c as i64));
    }
    (
        Tensor::from_vec(ids, &[b * s]).unwrap(),
        Tensor::from_vec(tg, &[b * s]).unwrap(),
    )
}

fn run<M: SeqMode, D: DataMode>(model: &Model, c: &Composition, steps: usize) -> Measured {
    let mesh = dtensor_nn::model_mesh(&c.degrees).unwrap();
    let cfg = gpt_config(model, c);
    let results = threads::launch(mesh.world_size(), |world| -> Result<_, Error> {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let sched = pipeline::for_composition(c)?;
        let mut model_ = Pipeline::<M, D>::new(cfg, sched, &dm)?;
        let sm = model_.stage_mesh().clone();
        let mut opt = AdamW::new(1e-3);
        let mut last = (Vec::new(), 0u64);
        for step in 0..steps {
            let (ids, tg) = batch(model, step);
            let split = |t: &Tensor| -> Result<Vec<DTensor<Ids>>, Error> {
                microbatches(t, c.microbatches, model.seq_len)?
                    .iter()
                    .map(|mb| {
                        DTensor::<Ids>::from_global(
                            &to_stream_order(mb, model.seq_len, &cfg.context, &sm)?,
                            &sm,
                        )
                    })
                    .collect()
            };
            let (ids, tg) = (split(&ids)?, split(&tg)?);
            let before = dm.counters();
            memory::reset_peak();
            model_.train_step(&ids, &tg, &mut opt, 1.0)?;
            let bytes = dm
                .counters()
                .iter()
                .zip(&before)
                .map(|((k, now), (_, then))| (axis_of(*k), now.since(then).bytes_sent))
                .collect();
            last = (bytes, memory::peak_bytes() as u64);
        }
        Ok(last)
    });
    let mut bytes: Vec<(Axis, u64)> = Vec::new();
    let mut peak = 0;
    for r in results {
        let (b, p) = r.unwrap_or_else(|e| panic!("{e}"));
        peak = peak.max(p);
        for (a, n) in b {
            match bytes.iter_mut().find(|(x, _)| *x == a) {
                Some(e) => e.1 += n,
                None => bytes.push((a, n)),
            }
        }
    }
    Measured { bytes, peak }
}

fn measure(model: &Model, c: &Composition) -> Measured {
    fn d<M: SeqMode>(model: &Model, c: &Composition) -> Measured {
        match c.data {
            DataKind::Ddp => run::<M, Ddp>(model, c, 2),
            DataKind::Zero1 => run::<M, Zero1>(model, c, 2),
            DataKind::Zero2 => run::<M, Zero2>(model, c, 2),
            DataKind::Fsdp => run::<M, Fsdp>(model, c, 2),
        }
    }
    if c.degrees.sp {
        d::<Sp>(model, c)
    } else {
        d::<NoSp>(model, c)
    }
}

/// Whether the peak-memory comparison is asserted (the byte comparison always is).
const MEMORY_CHECKED: bool = true;

/// Runs `spec` (a `--mesh`-style composition) and compares: bytes per axis within 1%,
/// peak memory within `mem_tol`.
fn check(spec: &str) {
    check_layers(spec, 2)
}

/// [`check`] with `layers` blocks (an interleaved schedule needs `pp·v` of them).
fn check_layers(spec: &str, layers: usize) {
    let mut model = Model::preset("gpt-small").unwrap();
    model.layers = layers;
    check_model(spec, &model)
}

/// [`check`] on `model`. For a MoE model the `Ep` bytes include the dispatch and combine
/// all-to-alls, whose size depends on where the router sends the tokens: the plan's
/// uniform-routing expectation is held to 5% there (and the router's statistics
/// all-reduces are not modelled), every other axis to 1%; its peak memory (routing-
/// dependent expert buffers, not modelled) is printed, not asserted.
fn check_model(spec: &str, model: &Model) {
    let model = model.clone();
    let c: Composition = spec.parse().unwrap();
    let got = measure(&model, &c);
    let p = plan(&model, &c).unwrap();
    let mut report = format!("{spec}:\n");
    let mut worst: f64 = 0.0;
    for (a, n) in &got.bytes {
        let want = p.axis_bytes(*a);
        let dev = if *n == 0 && want == 0 {
            0.0
        } else {
            (want as f64 - *n as f64).abs() / (*n).max(1) as f64
        };
        if model.moe.is_some() && *a == Axis::Ep {
            assert!(dev <= 0.05, "{spec}: ep off by {:.2}% (> 5%)", 100.0 * dev);
        } else {
            worst = worst.max(dev);
        }
        report += &format!(
            "  {:>2}: measured {n:>10}  planned {want:>10}  dev {:.4}%\n",
            a.name(),
            100.0 * dev
        );
    }
    let mem_dev = (p.peak_bytes() as f64 - got.peak as f64).abs() / got.peak as f64;
    report += &format!(
        "  peak memory: measured {}  planned {}  dev {:.2}%\n",
        got.peak,
        p.peak_bytes(),
        100.0 * mem_dev
    );
    println!("{report}");
    assert!(worst <= 0.01, "bytes off by more than 1%:\n{report}");
    if MEMORY_CHECKED && model.moe.is_none() {
        assert!(
            mem_dev <= 0.10,
            "peak memory off by more than 10%:\n{report}"
        );
    }
}

macro_rules! reality {
    ($($name:ident: $spec:expr;)*) => {$(
        #[test]
        fn $name() {
            check($spec);
        }
    )*};
}

reality! {
    dp_tp: "dp=2,tp=2";
    dp_tp_sp: "dp=2,tp=2,sp";
    tp_sp_recompute: "dp=2,tp=2,sp,recompute";
    zero1: "dp=2,tp=2,zero1";
    zero2_microbatches: "dp=2,tp=2,sp,zero2,m=2";
    fsdp: "dp=2,tp=2,sp,fsdp";
    fsdp_no_reshard: "dp=4,fsdp,no-reshard";
    fsdp_recompute: "dp=2,tp=2,fsdp,recompute";
    pp2_1f1b: "pp=2,dp=2,m=4";
    pp2_gpipe_sp: "pp=2,tp=2,sp,m=2,gpipe";
    pp2_zero_bubble_tp: "pp=2,tp=2,m=4,zb";
    cp2_ring: "cp=2,dp=2";
    cp2_ring_recompute_fsdp: "cp=2,dp=2,fsdp,recompute";
    cp2_a2a: "cp=2,tp=2,a2a";
    cp2_ring_tp_sp: "cp=2,tp=2,sp";
    bf16_dp_tp: "dp=2,tp=2,sp,bf16";
    bf16_fsdp: "dp=4,fsdp,bf16";
}

#[test]
fn pp2_interleaved_zero1() {
    check_layers("pp=2,dp=2,m=2,interleaved,v=2,zero1", 4);
}

/// Grouped-query attention (2 KV heads for 4 query heads): the narrower fused QKV's
/// gradients and activations, and ring attention sending only the KV heads.
#[test]
fn gqa_dp_tp_and_cp() {
    let mut model = Model::preset("gpt-small").unwrap();
    model.kv_heads = 2;
    check_model("dp=2,tp=2,sp", &model);
    check_model("cp=2,dp=2", &model);
    check_model("cp=2,tp=2,sp", &model);
    check_model("dp=2,zero1,m=2", &model);
}

#[test]
fn moe_ep2_dp2() {
    let mut model = Model::preset("gpt-small").unwrap();
    model.moe = Some(dtensor_planner::Moe {
        experts: 4,
        top_k: 2,
    });
    check_model("ep=2,dp=2", &model);
    check_model("ep=2,tp=2,sp", &model);
}
