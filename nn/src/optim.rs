//! Optimizers, global gradient-norm clipping, and the optimizer step over a module.
//!
//! An optimizer's [`update`](Optimizer::update) takes a parameter laid out as `L` and a
//! gradient laid out as `G` only if `G: ReducedGrad<L>`: on every mesh axis the gradient is
//! *reduced to the parameter's placement* (`Shard<D>` for `Shard<D>`, `Invariant` for
//! `Replicate` or `Invariant`). A gradient still `Partial` anywhere (not yet averaged over
//! `Dp`, or a sequence-parallel norm weight not yet reduced over `Tp`) does not compile.
//!
//! | parameter axis | raw gradient (dual) | reduce with | reduced |
//! |---|---|---|---|
//! | `Replicate` over `Dp` (DDP) | `Partial` | `all_reduce` over `Dp` ([`reduce_grad`](crate::reduce_grad)) | `Invariant` |
//! | `Shard<F>` over `Dp`, compute copy `Replicate` (ZeRO) | `Partial` | `reduce_scatter` over `Dp` | `Shard<F>` |
//! | `Shard<F>` over `Dp`, gathered for use (FSDP) | `Shard<F>` (the gather's adjoint reduce-scattered it) | nothing | `Shard<F>` |
//! | `Shard<D>` over `Tp` | `Shard<D>` | nothing | `Shard<D>` |
//! | `Invariant` over `Tp` (no SP) | `Invariant` | nothing | `Invariant` |
//! | `Replicate` over `Tp` (SP) | `Partial` | [`TpParam::reduce_over_tp`](crate::TpParam::reduce_over_tp) (`all_reduce` over `Tp`) | `Invariant` |
//!
//! Every parameter of the layers is a [`Weight`] (in [`params`](crate::params), the floor
//! below this one): its master laid out as the data mode says, computed with as
//! [`ParamLayout<T>`](crate::ParamLayout) (`Replicate` over `Dp`, `T` over `Tp`),
//! enumerable through [`Module::visit_params`] (name, layout, value). [`step`] is one
//! optimizer step over a module: reduce every gradient, clip by the global norm, update;
//! [`GradAccumulator`] and [`step_accumulated`] do the same over microbatches.

use crate::data::{DataMode, MasterLayout, ParamKind, ReducedLayout};
use crate::params::{GradAccumulator, Module, Param, ParamVisitor, Weight};
use crate::seq::ReducedGrad;
use dtensor_collectives::ReduceOp;
use dtensor_core::{DTensor, Error, Gradients, Result};
use dtensor_kernels::{ops, Tensor};
use dtensor_placement::{Layout, Placement};

/// Collective: one optimizer step over every parameter of `m` from one backward's
/// gradients: [`step_accumulated`] of a [`GradAccumulator`] holding just them.
pub fn step<O: Optimizer>(
    m: &mut impl Module,
    grads: &mut Gradients,
    opt: &mut O,
    max_norm: f64,
) -> Result<f64> {
    let mut acc = GradAccumulator::new();
    acc.add(m, grads)?;
    step_accumulated(m, acc, opt, max_norm)
}

/// Collective: one optimizer step over every parameter of `m`. Reduces each accumulated
/// gradient to its master's placement (over `Dp` as the data mode says, over `Tp` for
/// sequence-parallel parameters), clips them all to a global norm of `max_norm` (across
/// pipeline stages too), begins the optimizer's step and updates (rebuilding the compute
/// copies). Returns the global norm before clipping. A non-finite norm (an inf or NaN in
/// any gradient) skips the update: no parameter, moment or step count changes, the same
/// on every rank (the norm is reduced over all of them).
pub fn step_accumulated<O: Optimizer>(
    m: &mut impl Module,
    mut acc: GradAccumulator,
    opt: &mut O,
    max_norm: f64,
) -> Result<f64> {
    let _span = dtensor_collectives::trace::span("optimizer step", "optimizer");
    // Every gradient is reduced before any update, because clipping needs the global norm;
    // each weight keeps its own reduced gradient in between.
    struct Reduce<'g> {
        acc: &'g mut GradAccumulator,
        norm: GradNorm,
        mesh: Option<std::sync::Arc<dtensor_core::DeviceMesh>>,
    }
    impl ParamVisitor for Reduce<'_> {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            name: &str,
            w: &mut Weight<D, K>,
        ) -> Result<()> {
            let g = self.acc.take_reduced(name, w)?;
            self.norm.add(&g)?;
            self.mesh.get_or_insert_with(|| g.device_mesh().clone());
            w.set_step_grad(g);
            Ok(())
        }
    }
    // `opt: None` drops the gradients without updating (a skipped step).
    struct Update<'o, O> {
        opt: Option<&'o O>,
        scale: f64,
    }
    impl<O: Optimizer> ParamVisitor for Update<'_, O> {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            name: &str,
            w: &mut Weight<D, K>,
        ) -> Result<()> {
            let g = w.take_step_grad();
            let Some(opt) = self.opt else {
                return Ok(());
            };
            let g = g.ok_or_else(|| Error::InvalidUse {
                op: "optim::step",
                detail: format!("parameter {name} was not visited when the gradients were reduced"),
            })?;
            let g = if self.scale < 1.0 {
                g.scale(self.scale)?
            } else {
                g
            };
            opt.update_weight(w, &g)
        }
    }
    let mut r = Reduce {
        acc: &mut acc,
        norm: GradNorm::new(),
        mesh: None,
    };
    m.visit_params("", &mut r)?;
    let norm = match &r.mesh {
        Some(mesh) => r.norm.finish(mesh)?,
        None => 0.0,
    };
    if !norm.is_finite() {
        // An inf or NaN anywhere: skip the update (as Megatron-LM does) so the parameters
        // and optimizer state stay as they were; the caller sees it in the norm.
        m.visit_params(
            "",
            &mut Update::<O> {
                opt: None,
                scale: 1.0,
            },
        )?;
        return Ok(norm);
    }
    let scale = clip_coefficient(norm, max_norm);
    opt.begin_step();
    m.visit_params(
        "",
        &mut Update {
            opt: Some(&*opt),
            scale,
        },
    )?;
    Ok(norm)
}

/// Something that updates a parameter from its reduced gradient.
pub trait Optimizer {
    /// Call once per training step, before the updates of that step.
    fn begin_step(&mut self);
    /// Updates `p` from `g`, which must be reduced to `p`'s placement.
    fn update<L, G>(&self, p: &mut Param<L>, g: &DTensor<G>) -> Result<()>
    where
        L: Layout,
        G: Layout + ReducedGrad<L>;

    /// Updates `w`'s master from its reduced gradient and rebuilds the compute copy (for
    /// ZeRO an all-gather over `Dp` of the updated shard).
    fn update_weight<D: DataMode, K: ParamKind>(
        &self,
        w: &mut Weight<D, K>,
        g: &DTensor<ReducedLayout<D, K>>,
    ) -> Result<()> {
        w.update_master(|p: &mut Param<MasterLayout<D, K>>| self.update(p, g))
    }
}

fn check_grad<L: Layout, G: Layout>(op: &'static str, p: &Param<L>, g: &DTensor<G>) -> Result<()> {
    if p.local().shape() != g.local_shape() || p.local().dtype() != g.as_local().dtype() {
        return Err(Error::ShapeMismatch {
            op,
            detail: format!(
                "parameter local {:?} {} but gradient local {:?} {}",
                p.local().shape(),
                p.local().dtype(),
                g.local_shape(),
                g.as_local().dtype()
            ),
        });
    }
    Ok(())
}

/// Plain SGD: `p -= lr·g`.
#[derive(Clone, Debug)]
pub struct Sgd {
    /// Learning rate.
    pub lr: f64,
}

impl Optimizer for Sgd {
    fn begin_step(&mut self) {}

    fn update<L, G>(&self, p: &mut Param<L>, g: &DTensor<G>) -> Result<()>
    where
        L: Layout,
        G: Layout + ReducedGrad<L>,
    {
        check_grad("Sgd::update", p, g)?;
        if p.local().is_cuda() {
            // On a device: `w + (−lr·g)`, each rounded in the dtype (the host rounds once
            // from f64).
            let t = p.local().add(&g.as_local().try_scale(-self.lr)?)?;
            return p.set_local(t);
        }
        let gv = g.as_local().to_f64_vec();
        let v: Vec<f64> = p
            .local()
            .to_f64_vec()
            .iter()
            .zip(&gv)
            .map(|(w, d)| w - self.lr * d)
            .collect();
        let t = Tensor::from_f64_vec(v, p.local().shape(), p.local().dtype())?;
        p.set_local(t)
    }
}

/// AdamW (decoupled weight decay, bias-corrected moments). The moments live in the
/// parameter, laid out like it, so a sharded parameter has sharded state.
#[derive(Clone, Debug)]
pub struct AdamW {
    /// Learning rate.
    pub lr: f64,
    /// Decay rate of the first moment (the gradients' running mean).
    pub beta1: f64,
    /// Decay rate of the second moment (the squared gradients' running mean).
    pub beta2: f64,
    /// Added to the bias-corrected second moment's square root before dividing.
    pub eps: f64,
    /// Decoupled weight decay, applied to matrices (weights, embedding tables) only.
    pub weight_decay: f64,
    /// Decay vectors too (biases, norm weights). Off by default, as in nanoGPT and
    /// Megatron's parameter groups.
    pub decay_vectors: bool,
    step: u64,
}

impl AdamW {
    /// AdamW at learning rate `lr` with `beta1 = 0.9`, `beta2 = 0.95`, `eps = 1e-8`, weight
    /// decay 0.01 on matrices only, no steps taken.
    pub fn new(lr: f64) -> Self {
        AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            decay_vectors: false,
            step: 0,
        }
    }
    /// Steps begun so far.
    pub fn steps(&self) -> u64 {
        self.step
    }
    /// Sets the steps begun so far (resuming from a checkpoint: the bias corrections
    /// continue from there).
    pub fn set_steps(&mut self, steps: u64) {
        self.step = steps;
    }
}

impl Optimizer for AdamW {
    fn begin_step(&mut self) {
        self.step += 1;
    }

    fn update<L, G>(&self, p: &mut Param<L>, g: &DTensor<G>) -> Result<()>
    where
        L: Layout,
        G: Layout + ReducedGrad<L>,
    {
        check_grad("AdamW::update", p, g)?;
        let t = self.step.max(1) as i32;
        let decay = if p.value().global_shape().len() >= 2 || self.decay_vectors {
            self.weight_decay
        } else {
            0.0
        };
        let h = ops::AdamWStep {
            lr: self.lr,
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            decay,
            c1: 1.0 - self.beta1.powi(t),
            c2: 1.0 - self.beta2.powi(t),
        };
        // The moments live in the parameter's dtype for f32 and f64 (as PyTorch keeps them),
        // in f64 for the 16-bit dtypes.
        let state_dtype = ops::adamw_state_dtype(p.local().dtype());
        let place = p.local().device().cloned();
        let (value, state) = p.value_and_state_mut();
        if state.len() != 2
            || state[0].dtype() != state_dtype
            || state[0].device() != place.as_ref()
        {
            let shape = value.local_shape().to_vec();
            *state = vec![
                Tensor::zeros_on(place.as_ref(), &shape, state_dtype)?,
                Tensor::zeros_on(place.as_ref(), &shape, state_dtype)?,
            ];
        }
        let [m, v] = &mut state[..] else {
            unreachable!("two moments set above")
        };
        // The kernels' AdamW, where the parameter is: f32 arithmetic for f32, f64 for f64 and
        // for 16-bit parameters (rounded into them once); the device kernel keeps the host's
        // order of operations.
        value.update_local_in_place(|w| Ok(ops::adamw_step(w, g.as_local(), m, v, &h)?))
    }
}

/// The squared global norm of a set of gradients, each element counted once: a rank adds
/// its local sum of squares only if it is coordinate 0 on every axis where the gradient is
/// not sharded (the other coordinates hold copies), and the sum is then reduced over every
/// axis.
#[derive(Clone, Debug, Default)]
pub struct GradNorm {
    sum_sq: f64,
}

impl GradNorm {
    /// An empty sum: norm 0 until gradients are added.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one reduced gradient (no `Partial` axis).
    pub fn add<G: Layout>(&mut self, g: &DTensor<G>) -> Result<()> {
        let mesh = g.device_mesh();
        let mut counted = true;
        for (a, p) in G::placements().iter().enumerate() {
            match p {
                Placement::Shard(_) => {}
                Placement::Partial(_) => {
                    return Err(Error::PlacementMismatch {
                        op: "GradNorm::add",
                        axis: mesh.mesh().axes()[a].0,
                        placements: G::placements(),
                        detail: "reduce the gradient before taking its norm".into(),
                    })
                }
                _ => counted &= mesh.coords()[a] == 0,
            }
        }
        if counted {
            self.sum_sq += sum_of_squares(g.as_local())?;
        }
        Ok(())
    }

    /// Collective over every rank of `mesh`'s root world (a pipeline stage's sub-mesh sums
    /// over the other stages too, whose parameters are their own): the global norm.
    pub fn finish(&self, mesh: &dtensor_core::DeviceMesh) -> Result<f64> {
        let mut s = [self.sum_sq];
        dtensor_core::transfer::all_reduce_values(&**mesh.root_world(), &mut s, ReduceOp::Sum)?;
        Ok(s[0].sqrt())
    }
}

/// `Σ x²` over a gradient's local piece: in f64 on the host; on a device, squared and
/// summed there (in the dtype's accumulator) and only the scalar copied back.
fn sum_of_squares(t: &Tensor) -> Result<f64> {
    if t.is_cuda() {
        // `sum_rows` gives a thread to each column: `cols` partial sums (each over n/cols
        // rows, in the dtype's accumulator) come back and are added in f64.
        let n = t.numel();
        let cols = [1024, 256, 64, 16, 4, 1]
            .into_iter()
            .find(|c| n.is_multiple_of(*c))
            .unwrap_or(1);
        let sq = t.mul(t)?.reshape(&[n / cols, cols])?;
        let s = dtensor_kernels::ops::sum_rows(&sq)?;
        return Ok(s.to_host()?.to_f64_vec().iter().sum());
    }
    Ok(t.to_f64_vec().iter().map(|x| x * x).sum::<f64>())
}

/// The factor clipping scales gradients by so that their global norm is at most `max_norm`
/// (1 when it already is).
pub fn clip_coefficient(norm: f64, max_norm: f64) -> f64 {
    if norm > max_norm {
        max_norm / (norm + 1e-6)
    } else {
        1.0
    }
}
