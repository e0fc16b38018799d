//! Quickstart: the model a newcomer writes. A two-layer tensor-parallel MLP fits a
//! regression target on a `dp × tp` mesh of thread ranks, written as its forward pass only:
//!
//! ```text
//! h    = gelu(x · W1ᵀ + b1)        W1 [hidden, in]  Shard<0> over Tp (column-parallel)
//! pred = h · W2ᵀ  (+ b2)           W2 [out, hidden] Shard<1> over Tp (row-parallel)
//! loss = Σ (pred − y)² / (2·N)     tokens Shard<0> over Dp
//! ```
//!
//! Every layout is derived by the compiler: `x·W1ᵀ` is `Shard<1>` over Tp, `h·W2ᵀ` is
//! `Partial` (a pending sum: it must be all-reduced before anything non-linear), the loss is
//! `Partial` over Dp. `loss.backward()` types each gradient as its parameter's dual,
//! `Partial` over Dp, so the optimizer refuses it until this file all-reduces it over Dp.
//!
//! The same training runs on one rank too, and the losses must agree (f64), or the program
//! fails.
//!
//! `cargo run --release --example quickstart -- --mesh dp=2,tp=2 --steps 50`

use dtensor::core::Tape;
use dtensor::nn::{AdamW, Init, Optimizer, Param};
use dtensor::prelude::*;
use std::process::ExitCode;
use std::sync::Arc;

type Tokens = layout![Dp: Shard<0>, Tp: Invariant];
type W1 = layout![Dp: Replicate, Tp: Shard<0>];
type W2 = layout![Dp: Replicate, Tp: Shard<1>];
type B2 = layout![Dp: Replicate, Tp: Invariant];
/// The loss: the sum over this replica's tokens (a pending sum over Dp), the same on every
/// Tp rank.
type Loss = layout![Dp: Partial, Tp: Invariant];

const IN: usize = 8;
const HIDDEN: usize = 32;
const OUT: usize = 2;

struct Args {
    config: ParallelConfig,
    steps: usize,
    batch: usize,
    lr: f64,
}

const USAGE: &str = "usage: quickstart [--mesh dp=2,tp=2] [--steps 50] [--batch 64] [--lr 0.01]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        config: ParallelConfig::parse("dp=2,tp=2").unwrap(),
        steps: 50,
        batch: 64,
        lr: 0.01,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value\n{USAGE}"));
        match flag.as_str() {
            "--mesh" => a.config = ParallelConfig::parse(&value()?).map_err(|e| e.to_string())?,
            "--steps" => a.steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--batch" => a.batch = value()?.parse().map_err(|e| format!("--batch: {e}"))?,
            "--lr" => a.lr = value()?.parse().map_err(|e| format!("--lr: {e}"))?,
            "--help" | "-h" => return Err(USAGE.to_string()),
            other => return Err(format!("unknown flag {other}\n{USAGE}")),
        }
    }
    if a.config.pp > 1 || a.config.cp > 1 || a.config.sp {
        return Err("quickstart uses a dp×tp mesh only (no pp, cp or sp)".into());
    }
    Ok(a)
}

/// The model: parameters only. Its forward pass is [`Mlp::loss`].
struct Mlp {
    w1: Param<W1>,
    b1: Param<W1>,
    w2: Param<W2>,
    b2: Param<B2>,
}

impl Mlp {
    fn new(mesh: &Arc<DeviceMesh>) -> Result<Self> {
        /// Every rank computes its own piece of a seeded normal tensor: no communication,
        /// and the values do not depend on the mesh.
        fn normal<L: Layout>(
            mesh: &Arc<DeviceMesh>,
            std: f64,
            id: u64,
            shape: &[usize],
        ) -> Result<Param<L>> {
            let init = Init::Normal { std };
            let v =
                DTensor::from_global_fn(shape, DType::F64, mesh, |i| init.value(7, id, i as u64))?;
            Ok(Param::new(v))
        }
        Ok(Mlp {
            w1: normal(mesh, 0.5, 1, &[HIDDEN, IN])?,
            b1: normal(mesh, 0.1, 2, &[HIDDEN])?,
            w2: normal(mesh, 0.2, 3, &[OUT, HIDDEN])?,
            b2: normal(mesh, 0.1, 4, &[OUT])?,
        })
    }

    /// The forward pass, recorded on `tape`: the mean squared error over the global batch.
    fn loss<'t>(
        &self,
        tape: &'t Tape,
        x: &DTensor<Tokens>,
        y: &DTensor<Tokens>,
    ) -> Result<dtensor::core::Var<'t, Loss>> {
        let n = x.global_shape()[0] as f64;
        let x = tape.constant(x.clone()).to_replicate(Tp)?; // Megatron's f
        let h = x
            .matmul_t(&self.w1.on(tape))? // [Dp: S0, Tp: S1]
            .add_row(&self.b1.on(tape))?
            .gelu()?;
        let pred = h
            .matmul_t(&self.w2.on(tape))? // [Dp: S0, Tp: Partial]
            .all_reduce(Tp)? // Megatron's g
            .add_row(&self.b2.on(tape))?;
        let err = pred.sub(&tape.constant(y.clone()))?;
        err.mul(&err)?
            .sum_dim::<1>()?
            .sum_dim::<0>()?
            .scale(0.5 / n)
    }
}

/// Regression data: `y = sin(x·A)`, global, row `i` the same at any mesh.
fn data(batch: usize) -> (Tensor, Tensor) {
    let x = Tensor::from_fn(&[batch, IN], |i| {
        Init::Normal { std: 1.0 }.value(11, 0, i as u64)
    });
    let a = Tensor::from_fn(&[OUT, IN], |i| ((i * 37 % 11) as f64 - 5.0) / 5.0);
    let xa = dtensor::kernels::ops::matmul(
        &x,
        dtensor::kernels::ops::Transpose::No,
        &a,
        dtensor::kernels::ops::Transpose::Yes,
    )
    .expect("shapes fit");
    (x, xa.map(f64::sin))
}

/// Trains on `config`'s mesh; rank 0's losses and receipt.
fn train(config: &ParallelConfig, a: &Args) -> Result<(Vec<f64>, String), String> {
    let mesh = config
        .mesh(&[AxisKind::Dp, AxisKind::Tp])
        .map_err(|e| e.to_string())?;
    let (x, y) = data(a.batch);
    let results = threads::launch(mesh.world_size(), |world| -> Result<_> {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let mut model = Mlp::new(&dm)?;
        let src = |t: &Tensor| Some(t.clone()).filter(|_| dm.rank() == 0);
        let xs = DTensor::<Tokens>::distribute(src(&x).as_ref(), 0, &dm)?;
        let ys = DTensor::<Tokens>::distribute(src(&y).as_ref(), 0, &dm)?;
        let mut opt = AdamW::new(a.lr);
        let mut losses = Vec::with_capacity(a.steps);
        for _ in 0..a.steps {
            let tape = Tape::new();
            let loss = model.loss(&tape, &xs, &ys)?;
            losses.push(loss.value().clone().all_reduce(Dp)?.as_local().to_f64_vec()[0]);
            let mut g = loss.backward()?;
            // Each gradient is Partial over Dp (every replica saw other tokens): the optimizer
            // takes it only once all-reduced (the loss was divided by the global batch, so
            // the sum is the gradient of the mean).
            opt.begin_step();
            let gw1 = model.w1.grad(&mut g)?.all_reduce(Dp)?;
            let gb1 = model.b1.grad(&mut g)?.all_reduce(Dp)?;
            let gw2 = model.w2.grad(&mut g)?.all_reduce(Dp)?;
            let gb2 = model.b2.grad(&mut g)?.all_reduce(Dp)?;
            opt.update(&mut model.w1, &gw1)?;
            opt.update(&mut model.b1, &gb1)?;
            opt.update(&mut model.w2, &gw2)?;
            opt.update(&mut model.b2, &gb2)?;
        }
        Ok((losses, dm.receipt()))
    });
    let mut out = None;
    for (r, res) in results.into_iter().enumerate() {
        let v = res.map_err(|e| format!("rank {r}: {e}"))?;
        out.get_or_insert(v);
    }
    out.ok_or_else(|| "no ranks".to_string())
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    println!(
        "two-layer MLP ({IN} → {HIDDEN} → {OUT}), batch {}, mesh {}",
        args.batch, args.config
    );
    let (losses, receipt) = match train(&args.config, &args) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    for (step, l) in losses.iter().enumerate() {
        if step % 10 == 0 || step + 1 == losses.len() {
            println!("step {step:3}  loss {l:.6}");
        }
    }
    println!("receipt (rank 0, collectives and bytes per mesh axis):\n{receipt}");
    let one = ParallelConfig::parse("dp=1").expect("a valid config");
    let (reference, _) = match train(&one, &args) {
        Ok(v) => v,
        Err(e) => {
            eprintln!("one-rank reference: {e}");
            return ExitCode::FAILURE;
        }
    };
    let diff = losses
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f64::max);
    println!("one rank, same data and seed: max |loss difference| = {diff:.3e}");
    let (first, last) = (losses[0], *losses.last().unwrap_or(&f64::NAN));
    if diff > 1e-9 * first.abs().max(1.0) {
        eprintln!(
            "the {} run differs from one rank: a wrong gradient",
            args.config
        );
        return ExitCode::FAILURE;
    }
    if last.is_nan() || last >= 0.5 * first {
        eprintln!("the loss did not halve ({first} → {last})");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
