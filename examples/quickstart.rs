//! Quickstart: a small model trained by gradient descent on a 2-D mesh of thread ranks,
//! with every placement change written out and typed.
//!
//! The model is a parameter vector θ (length `--features`) sharded over Tp and replicated
//! over Dp. Each Dp replica sees its own batch of targets `t`; the loss is the mean over
//! replicas of ½‖θ − t‖². Per replica the gradient term is `(θ − t) / dp`: `Partial` over
//! Dp, so the type makes us all-reduce it before the update, exactly the step a
//! data-parallel trainer must not forget.
//!
//! `cargo run --release --example quickstart -- --mesh dp=2,tp=2 --steps 50`

use dtensor::prelude::*;
use std::process::ExitCode;

type Param = layout![Dp: Replicate, Tp: Shard<0>];
type Grad = layout![Dp: Partial, Tp: Shard<0>];

struct Args {
    config: ParallelConfig,
    steps: usize,
    features: usize,
    lr: f64,
}

const USAGE: &str = "usage: quickstart [--mesh dp=2,tp=2] [--steps 50] [--features 64] [--lr 0.5]";

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        config: ParallelConfig::parse("dp=2,tp=2").unwrap(),
        steps: 50,
        features: 64,
        lr: 0.5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value\n{USAGE}"));
        match flag.as_str() {
            "--mesh" => a.config = ParallelConfig::parse(&value()?).map_err(|e| e.to_string())?,
            "--steps" => a.steps = value()?.parse().map_err(|e| format!("--steps: {e}"))?,
            "--features" => {
                a.features = value()?.parse().map_err(|e| format!("--features: {e}"))?
            }
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

/// Replica `r`'s targets: the same pattern shifted per replica, so the optimum (their mean)
/// is known in closed form.
fn targets(features: usize, replica: usize) -> Tensor {
    Tensor::from_fn(&[features], |i| (i as f64 * 0.1).sin() + replica as f64)
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let mesh = match args.config.mesh(&[AxisKind::Dp, AxisKind::Tp]) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let dp = args.config.dp;
    println!(
        "training θ ∈ R^{} on mesh {mesh} ({} thread ranks)",
        args.features,
        mesh.world_size()
    );

    let results = threads::launch(
        mesh.world_size(),
        |world| -> Result<(f64, f64, String), Error> {
            let dm = DeviceMesh::new(world, mesh.clone())?;
            let f = args.features;
            let zeros = Tensor::zeros(&[f], DType::F64);
            let mut theta =
                DTensor::<Param>::distribute((dm.rank() == 0).then_some(&zeros), 0, &dm)?;
            // This replica's targets, sliced like θ's shard over Tp.
            let t_full = targets(f, dm.coords()[0]);
            let mine = dtensor_placement::chunk_range(f, dm.mesh().size(1), dm.coords()[1]);
            let t_local = t_full.narrow(0, mine.start, mine.len())?;
            let mut loss = f64::NAN;
            for step in 0..args.steps {
                // Gradient term of this replica: (θ − t) / dp, Partial over Dp.
                let diff = theta.as_local().add(&t_local.scale(-1.0))?;
                // The loss: this rank's term is Partial over both axes (its shard, its replica).
                let term = diff.to_f64_vec().iter().map(|d| 0.5 * d * d).sum::<f64>() / dp as f64;
                let term = Tensor::from_vec(vec![term], &[1])?;
                loss = DTensor::<layout![Dp: Partial, Tp: Partial]>::from_local(term, &[1], &dm)?
                    .full_tensor()?
                    .to_f64_vec()[0];
                let g = DTensor::<Grad>::from_local(diff.scale(1.0 / dp as f64), &[f], &dm)?;
                // The optimizer needs the gradient reduced to θ's placement: all-reduce over
                // Dp (Partial → Invariant), then Invariant → Replicate.
                let g = g.all_reduce(Dp)?.to_replicate(Dp)?;
                theta = theta.add(&g.scale(-args.lr)?)?;
                if dm.rank() == 0 && (step % 10 == 0 || step + 1 == args.steps) {
                    println!("step {step:3}  loss {loss:.6}");
                }
            }
            let full = theta.full_tensor()?;
            let optimum: Vec<f64> = (0..f)
                .map(|i| (i as f64 * 0.1).sin() + (dp as f64 - 1.0) / 2.0)
                .collect();
            let err = full
                .to_f64_vec()
                .iter()
                .zip(&optimum)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f64::max);
            Ok((err, loss, dm.receipt()))
        },
    );

    let mut worst = 0.0f64;
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok((err, loss, receipt)) => {
                worst = worst.max(err);
                if r == 0 {
                    println!("final loss {loss:.6} (the optimum's loss is the targets' spread)");
                    println!("receipt (rank 0, collectives and bytes per mesh axis):\n{receipt}");
                }
            }
            Err(e) => {
                eprintln!("rank {r}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    // Gradient descent on this loss contracts θ − optimum by |1 − lr| per step, from
    // θ = 0: the error after `steps` steps is known, up to rounding.
    let start_err = (0..args.features)
        .map(|i| ((i as f64 * 0.1).sin() + (dp as f64 - 1.0) / 2.0).abs())
        .fold(0.0, f64::max);
    let bound = start_err * (1.0 - args.lr).abs().powi(args.steps as i32) + 1e-9;
    println!(
        "composition {}: max |θ − optimum| = {worst:.3e} (gradient descent predicts ≤ {bound:.3e})",
        args.config
    );
    if worst > bound {
        eprintln!("θ is farther from the optimum than gradient descent allows: a wrong gradient");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
