//! Column- and row-parallel linear layers, forward and the tape's backward, against a single-rank
//! f64 reference (`x·Wᵀ + b`, `dx = dy·W`, `dW = dyᵀ·x`, `db = Σ rows dy`) at TP = 1, 2, 4,
//! SP on and off, and DP×TP. Error measure: `max |a − b| / max |b|` ≤ 1e-10.

mod common;

use common::*;
use dtensor_core::{DTensor, Tape, Var};
use dtensor_kernels::ops::{self, Transpose};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::*;

const T: usize = 12;
/// Tokens that do not divide by tp = 4: SP shards them 3, 3, 3, 1 (`torch.chunk`).
const T_UNEVEN: usize = 10;
const H: usize = 6;
const F: usize = 8;
const TOL: f64 = 1e-10;

fn reference_linear(x: &Tensor, w: &Tensor, b: &Tensor, dy: &Tensor) -> [Tensor; 4] {
    let y = ops::add_row(
        &ops::matmul(x, Transpose::No, w, Transpose::Yes).unwrap(),
        b,
    )
    .unwrap();
    let dx = ops::matmul(dy, Transpose::No, w, Transpose::No).unwrap();
    let dw = ops::matmul(dy, Transpose::Yes, x, Transpose::No).unwrap();
    let db = ops::sum_rows(dy).unwrap();
    [y, dx, dw, db]
}

fn init() -> ParamInit {
    ParamInit::new(7, 100, 0.5, DType::F64).with_bias_std(0.3)
}

fn column_matches_reference<M: SeqMode>(dp: usize, tp: usize) -> f64 {
    column_matches_reference_with::<M>(T, dp, tp)
}

fn column_matches_reference_with<M: SeqMode>(t: usize, dp: usize, tp: usize) -> f64 {
    let x = randn(1, &[t, H]);
    let dy = randn(2, &[t, F]);
    let w = Init::Normal { std: 0.5 }.full(7, 100, &[F, H], DType::F64);
    let b = Init::Normal { std: 0.3 }.full(7, 101, &[F], DType::F64);
    let [y_ref, dx_ref, dw_ref, db_ref] = reference_linear(&x, &w, &b, &dy);
    let errs = on_mesh(dp, tp, |mesh| {
        let layer = ColumnParallelLinear::<Ddp>::new(H, F, true, init(), mesh)?;
        let tape = Tape::new();
        let xs = tape.leaf(piece::<Stream<M>>(&x, mesh)?);
        let y = layer.forward::<M>(&tape, &xs)?;
        let y_full = y.value().full_tensor()?;
        let mut g = y.backward_with(piece::<ColOut>(&dy, mesh)?)?;
        let dx: DTensor<Stream<M>> = g.take(&xs)?;
        let gw = layer.weight.grad(&mut g)?;
        let gb = layer.bias.as_ref().unwrap().grad(&mut g)?;
        let mut e = assert_close("column y", &y_full, &y_ref, TOL);
        e = e.max(assert_close("column dx", &dx.full_tensor()?, &dx_ref, TOL));
        e = e.max(assert_close("column dW", &gw.full_tensor()?, &dw_ref, TOL));
        e = e.max(assert_close("column db", &gb.full_tensor()?, &db_ref, TOL));
        Ok(e)
    });
    errs.into_iter().fold(0.0, f64::max)
}

fn row_matches_reference<M: SeqMode>(dp: usize, tp: usize) -> f64 {
    row_matches_reference_with::<M>(T, dp, tp)
}

fn row_matches_reference_with<M: SeqMode>(t: usize, dp: usize, tp: usize) -> f64 {
    let x = randn(3, &[t, F]);
    let dy = randn(4, &[t, H]);
    let w = Init::Normal { std: 0.5 }.full(7, 100, &[H, F], DType::F64);
    let b = Init::Normal { std: 0.3 }.full(7, 101, &[H], DType::F64);
    let [y_ref, dx_ref, dw_ref, db_ref] = reference_linear(&x, &w, &b, &dy);
    let errs = on_mesh(dp, tp, |mesh| {
        let layer = RowParallelLinear::<M, Ddp>::new(F, H, true, init(), mesh)?;
        let tape = Tape::new();
        let xs = tape.leaf(piece::<ColOut>(&x, mesh)?);
        let y: Var<Stream<M>> = layer.forward(&tape, &xs)?;
        let y_full = y.value().full_tensor()?;
        let mut g = y.backward_with(piece::<Stream<M>>(&dy, mesh)?)?;
        let dx: DTensor<ColOut> = g.take(&xs)?;
        let gw = layer.weight.grad(&mut g)?;
        let mut e = assert_close("row y", &y_full, &y_ref, TOL);
        e = e.max(assert_close("row dx", &dx.full_tensor()?, &dx_ref, TOL));
        e = e.max(assert_close("row dW", &gw.full_tensor()?, &dw_ref, TOL));
        // The bias gradient is Partial over Tp under SP: full_tensor reduces it, and so
        // does the typed reduction the optimizer path takes (a sum over Dp and Tp).
        let gb = layer.bias.as_ref().unwrap().grad(&mut g)?;
        e = e.max(assert_close("row db", &gb.full_tensor()?, &db_ref, TOL));
        let reduced = reduce_grad::<M::ParamTp>(gb)?;
        e = e.max(assert_close(
            "row db reduced",
            &reduced.full_tensor()?,
            &db_ref,
            TOL,
        ));
        Ok(e)
    });
    errs.into_iter().fold(0.0, f64::max)
}

#[test]
fn column_parallel_linear_matches_reference_at_every_tp() {
    for tp in TPS {
        let a = column_matches_reference::<NoSp>(1, tp);
        let b = column_matches_reference::<Sp>(1, tp);
        eprintln!("column tp={tp}: max rel err {a:e} (no SP), {b:e} (SP)");
    }
    column_matches_reference::<Sp>(2, 2);
    column_matches_reference::<NoSp>(2, 2);
    column_matches_reference_with::<Sp>(T_UNEVEN, 1, 4);
    column_matches_reference_with::<Sp>(T_UNEVEN, 2, 2);
}

#[test]
fn row_parallel_linear_matches_reference_at_every_tp() {
    for tp in TPS {
        let a = row_matches_reference::<NoSp>(1, tp);
        let b = row_matches_reference::<Sp>(1, tp);
        eprintln!("row tp={tp}: max rel err {a:e} (no SP), {b:e} (SP)");
    }
    row_matches_reference::<Sp>(2, 2);
    row_matches_reference::<NoSp>(2, 2);
    row_matches_reference_with::<Sp>(T_UNEVEN, 1, 4);
    row_matches_reference_with::<Sp>(T_UNEVEN, 2, 2);
}

#[test]
fn init_at_tp_k_is_the_slice_of_tp_1() {
    let full = Init::Normal { std: 0.5 }.full(7, 100, &[F, H], DType::F64);
    for tp in TPS {
        on_mesh(1, tp, |mesh| {
            let col = ColumnParallelLinear::<Ddp>::new(H, F, false, init(), mesh)?;
            let want: DTensor<ColWeight> = piece(&full, mesh)?;
            assert_eq!(col.weight.local(), want.as_local());
            let row = RowParallelLinear::<NoSp, Ddp>::new(H, F, false, init(), mesh)?;
            let want: DTensor<RowWeight> = piece(&full, mesh)?;
            assert_eq!(row.weight.local(), want.as_local());
            Ok(())
        });
    }
}

#[test]
fn init_of_a_partial_layout_is_an_error() {
    on_mesh(1, 2, |mesh| {
        let r = Init::Normal { std: 1.0 }.param::<Grad<ColWeight>>(1, 0, &[4, 4], DType::F64, mesh);
        assert!(r
            .unwrap_err()
            .to_string()
            .contains("DTensor::from_global_fn"));
        Ok(())
    });
}
