//! ParallelMlp (GELU and SwiGLU) and the SP-aware norms, forward and backward, against a
//! single-rank f64 reference built from the same kernels on whole tensors, at TP = 1, 2, 4,
//! SP on and off, and DP×TP. Error measure: `max |a − b| / max |b|` ≤ 1e-10.

mod common;

use common::*;
use dtensor_core::Tape;
use dtensor_kernels::ops::{self, Transpose};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::*;

const T: usize = 12;
const H: usize = 8;
const FFN: usize = 16;
const TOL: f64 = 1e-10;

fn w(id: u64, shape: &[usize], std: f64) -> Tensor {
    Init::Normal { std }.full(11, id, shape, DType::F64)
}

fn lin(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    ops::add_row(
        &ops::matmul(x, Transpose::No, w, Transpose::Yes).unwrap(),
        b,
    )
    .unwrap()
}

/// Reference MLP: returns y, dx and the gradients [w1, b1, (wu, bu), w2, b2].
fn reference_mlp(act: Activation, x: &Tensor, dy: &Tensor) -> (Tensor, Tensor, Vec<Tensor>) {
    let (w1, b1) = (w(200, &[FFN, H], 0.4), w(201, &[FFN], 0.2));
    let (wu, bu) = (w(202, &[FFN, H], 0.4), w(203, &[FFN], 0.2));
    let (w2, b2) = (w(204, &[H, FFN], 0.3), w(205, &[H], 0.2));
    let h1 = lin(x, &w1, &b1);
    let hu = lin(x, &wu, &bu);
    let a = match act {
        Activation::Gelu => ops::gelu(&h1).unwrap(),
        Activation::SwiGlu => ops::swiglu(&h1, &hu).unwrap(),
    };
    let y = lin(&a, &w2, &b2);
    let mm = |a: &Tensor, ta, b: &Tensor, tb| ops::matmul(a, ta, b, tb).unwrap();
    let da = mm(dy, Transpose::No, &w2, Transpose::No);
    let gw2 = mm(dy, Transpose::Yes, &a, Transpose::No);
    let gb2 = ops::sum_rows(dy).unwrap();
    let mut grads = Vec::new();
    let dx = match act {
        Activation::Gelu => {
            let dh = ops::gelu_backward(&da, &h1).unwrap();
            grads.push(mm(&dh, Transpose::Yes, x, Transpose::No));
            grads.push(ops::sum_rows(&dh).unwrap());
            mm(&dh, Transpose::No, &w1, Transpose::No)
        }
        Activation::SwiGlu => {
            let g = ops::swiglu_backward(&da, &h1, &hu).unwrap();
            grads.push(mm(&g.d_gate, Transpose::Yes, x, Transpose::No));
            grads.push(ops::sum_rows(&g.d_gate).unwrap());
            grads.push(mm(&g.d_up, Transpose::Yes, x, Transpose::No));
            grads.push(ops::sum_rows(&g.d_up).unwrap());
            mm(&g.d_gate, Transpose::No, &w1, Transpose::No)
                .add(&mm(&g.d_up, Transpose::No, &wu, Transpose::No))
                .unwrap()
        }
    };
    grads.push(gw2);
    grads.push(gb2);
    (y, dx, grads)
}

fn mlp_matches_reference<M: SeqMode>(act: Activation, dp: usize, tp: usize) -> f64 {
    let x = randn(21, &[T, H]);
    let dy = randn(22, &[T, H]);
    let (y_ref, dx_ref, g_ref) = reference_mlp(act, &x, &dy);
    let errs = on_mesh(dp, tp, |mesh| {
        let init = ParamInit::new(11, 200, 0.4, DType::F64).with_bias_std(0.2);
        let mlp = ParallelMlp::<M, Ddp>::new(H, FFN, act, true, init, 0.3, mesh)?;
        let tape = Tape::new();
        let xs = tape.leaf(piece::<Stream<M>>(&x, mesh)?);
        let y = mlp.forward(&tape, &xs)?;
        let y_full = y.value().full_tensor()?;
        let mut g = y.backward_with(piece(&dy, mesh)?)?;
        let mut e = assert_close("mlp y", &y_full, &y_ref, TOL);
        e = e.max(assert_close(
            "mlp dx",
            &g.take(&xs)?.full_tensor()?,
            &dx_ref,
            TOL,
        ));
        // Reduced gradients (summed over Dp): the full-batch gradients.
        let mut got = vec![
            reduced(&mlp.fc1.weight, &mut g, dp)?,
            reduced(mlp.fc1.bias.as_ref().unwrap(), &mut g, dp)?,
        ];
        if let Some(u) = &mlp.up {
            got.push(reduced(&u.weight, &mut g, dp)?);
            got.push(reduced(u.bias.as_ref().unwrap(), &mut g, dp)?);
        }
        got.push(reduced(&mlp.fc2.weight, &mut g, dp)?);
        got.push(reduced(mlp.fc2.bias.as_ref().unwrap(), &mut g, dp)?);
        for (i, (a, b)) in got.iter().zip(&g_ref).enumerate() {
            e = e.max(assert_close(&format!("mlp grad {i}"), a, b, TOL));
        }
        Ok(e)
    });
    errs.into_iter().fold(0.0, f64::max)
}

#[test]
fn parallel_mlp_gelu_and_swiglu_match_reference() {
    for act in [Activation::Gelu, Activation::SwiGlu] {
        for tp in TPS {
            let a = mlp_matches_reference::<NoSp>(act, 1, tp);
            let b = mlp_matches_reference::<Sp>(act, 1, tp);
            eprintln!("mlp {act:?} tp={tp}: max rel err {a:e} (no SP), {b:e} (SP)");
        }
        mlp_matches_reference::<Sp>(act, 2, 2);
    }
}

fn norm_matches_reference<M: SeqMode>(kind: NormKind, dp: usize, tp: usize) -> f64 {
    let x = randn(31, &[T, H]);
    let dy = randn(32, &[T, H]);
    let wt = w(300, &[H], 0.3).map(|v| v + 1.0);
    let bt = w(301, &[H], 0.2);
    let (y_ref, dx_ref, dw_ref, db_ref) = match kind {
        NormKind::Rms => {
            let o = ops::rms_norm(&x, &wt, 1e-5).unwrap();
            let g = ops::rms_norm_backward(&dy, &x, &wt, &o.rstd).unwrap();
            (o.y, g.dx, g.dweight, None)
        }
        NormKind::Layer => {
            let o = ops::layer_norm(&x, &wt, &bt, 1e-5).unwrap();
            let g = ops::layer_norm_backward(&dy, &x, &wt, &o.mean, &o.rstd).unwrap();
            (o.y, g.dx, g.dweight, Some(g.dbias))
        }
    };
    let errs = on_mesh(dp, tp, |mesh| {
        let init = ParamInit::new(11, 300, 0.3, DType::F64).with_bias_std(0.2);
        let norm = Norm::<M, Ddp>::new(kind, H, 1e-5, init, mesh)?;
        let tape = Tape::new();
        let xs = tape.leaf(piece::<Stream<M>>(&x, mesh)?);
        let y = norm.forward(&tape, &xs)?;
        let y_full = y.value().full_tensor()?;
        let mut g = y.backward_with(piece(&dy, mesh)?)?;
        let mut e = assert_close("norm y", &y_full, &y_ref, TOL);
        e = e.max(assert_close(
            "norm dx",
            &g.take(&xs)?.full_tensor()?,
            &dx_ref,
            TOL,
        ));
        // Under SP each Tp rank holds only its tokens' share of the weight gradient: the
        // raw gradient is Partial over Tp, and only the reduction makes it whole.
        let raw = norm.weight.grad(&mut g)?;
        if M::SP && tp > 1 {
            assert!(
                rel_err(raw.as_local(), &dw_ref) > 1e-3,
                "SP norm grad is partial"
            );
        }
        let dw = reduce_grad::<M::ParamTp>(raw)?.full_tensor()?;
        e = e.max(assert_close("norm dw", &dw, &dw_ref, TOL));
        if let Some(db_ref) = &db_ref {
            let db = reduced(norm.bias.as_ref().unwrap(), &mut g, dp)?;
            e = e.max(assert_close("norm db", &db, db_ref, TOL));
        }
        Ok(e)
    });
    errs.into_iter().fold(0.0, f64::max)
}

#[test]
fn rms_and_layer_norm_match_reference_with_and_without_sp() {
    for kind in [NormKind::Rms, NormKind::Layer] {
        for tp in TPS {
            let a = norm_matches_reference::<NoSp>(kind, 1, tp);
            let b = norm_matches_reference::<Sp>(kind, 1, tp);
            eprintln!("norm {kind:?} tp={tp}: max rel err {a:e} (no SP), {b:e} (SP)");
        }
        norm_matches_reference::<Sp>(kind, 2, 2);
        norm_matches_reference::<NoSp>(kind, 2, 2);
    }
}
