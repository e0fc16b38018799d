//! A non-finite gradient norm skips the optimizer update: a NaN planted in one parameter
//! makes the loss and every gradient NaN, and the step leaves every other parameter, every
//! AdamW moment and the step count exactly as they were, on every rank.

mod common;

use common::*;
use dtensor_core::{DTensor, Result};
use dtensor_kernels::Tensor;
use dtensor_nn::*;

const S: usize = 4;
const T: usize = 4 * S;

/// Every parameter's master piece and optimizer state on this rank, in visiting order.
struct Snapshot(Vec<Vec<u64>>);
impl ParamVisitor for Snapshot {
    fn visit<D: DataMode, K: ParamKind>(&mut self, _: &str, w: &mut Weight<D, K>) -> Result<()> {
        let bits = |t: &Tensor| t.to_f64_vec().iter().map(|x| x.to_bits()).collect();
        self.0.push(bits(w.local()));
        for s in w.master().state() {
            self.0.push(bits(s));
        }
        Ok(())
    }
}

/// Sets the final norm's weight to `value` everywhere (keeping its optimizer state).
struct Plant(f64);
impl ParamVisitor for Plant {
    fn visit<D: DataMode, K: ParamKind>(&mut self, name: &str, w: &mut Weight<D, K>) -> Result<()> {
        if name == "norm.weight" {
            let mut planted = w.value().clone();
            let value = self.0;
            planted.update_local(|l| {
                Ok(Tensor::from_f64_vec(
                    vec![value; l.numel()],
                    l.shape(),
                    l.dtype(),
                )?)
            })?;
            let state = w.master().state().to_vec();
            w.restore(planted, state)?;
        }
        Ok(())
    }
}

#[test]
fn a_nan_gradient_skips_the_update_on_every_rank() {
    let ids = Tensor::from_vec((0..T as i64).map(|i| (i * 7 + 3) % 20).collect(), &[T]).unwrap();
    let tg = Tensor::from_vec((0..T as i64).map(|i| (i * 5 + 1) % 20).collect(), &[T]).unwrap();
    on_mesh(2, 2, |mesh| {
        let mut model = Gpt::<Sp, Ddp>::new(tiny_gpt(1, S, 3), mesh)?;
        let mut opt = AdamW::new(1e-2);
        let (i, t): (DTensor<Ids>, DTensor<Ids>) = (piece(&ids, mesh)?, piece(&tg, mesh)?);
        // One ordinary step first, so the moments and the step count are not zero.
        let first = model.train_step(&i, &t, &mut opt, 1.0)?;
        assert!(first.loss.is_finite() && first.grad_norm.is_finite());

        model.visit_params("", &mut Plant(f64::NAN))?;
        let mut before = Snapshot(Vec::new());
        model.visit_params("", &mut before)?;
        let steps = opt.steps();
        let r = model.train_step(&i, &t, &mut opt, 1.0)?;
        assert!(r.loss.is_nan() && r.grad_norm.is_nan(), "{r:?}");
        let mut after = Snapshot(Vec::new());
        model.visit_params("", &mut after)?;
        assert_eq!(
            before.0, after.0,
            "a skipped step changed a parameter or moment"
        );
        assert_eq!(
            opt.steps(),
            steps,
            "a skipped step advanced AdamW's step count"
        );

        // With the parameter finite again, training goes on.
        model.visit_params("", &mut Plant(1.0))?;
        let r = model.train_step(&i, &t, &mut opt, 1.0)?;
        assert!(r.loss.is_finite() && r.grad_norm.is_finite(), "{r:?}");
        assert_eq!(opt.steps(), steps + 1);
        Ok(())
    });
}
