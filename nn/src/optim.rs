//! Parameters, gradient reduction over data parallelism, optimizers and global
//! gradient-norm clipping.
//!
//! An optimizer's [`update`](Optimizer::update) takes a parameter laid out as `L` and a
//! gradient laid out as `G` only if `G: ReducedGrad<L>`: on every mesh axis the gradient is
//! *reduced to the parameter's placement* (`Shard<D>` for `Shard<D>`, `Invariant` for
//! `Replicate` or `Invariant`). A gradient still `Partial` anywhere (not yet averaged over
//! `Dp`, or a sequence-parallel norm weight not yet reduced over `Tp`) does not compile.
//!
//! | parameter axis | raw gradient (dual) | reduce with | reduced |
//! |---|---|---|---|
//! | `Replicate` over `Dp` | `Partial` | [`dp_average`] (`all_reduce` of the terms / dp) | `Invariant` |
//! | `Shard<D>` over `Tp` | `Shard<D>` | nothing | `Shard<D>` |
//! | `Invariant` over `Tp` (no SP) | `Invariant` | nothing | `Invariant` |
//! | `Replicate` over `Tp` (SP) | `Partial` | [`SeqMode::reduce_param_grad`](crate::SeqMode::reduce_param_grad) | `Invariant` |

use crate::seq::{axis_size, DpPartial, DpReduced};
use dtensor_core::{DTensor, Error, Result};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{
    layout, AxisKind, Dp, Invariant, IsWhole, Layout, Linear, MeshAxis, On, Partial, Placement,
    PlacementType, Shard, Tp,
};

/// A gradient placement (`Self`) that is reduced to a parameter placement `P` on one axis.
#[diagnostic::on_unimplemented(
    message = "a `{Self}` gradient is not reduced to the parameter's `{P}` placement",
    label = "this gradient axis still needs its reduction",
    note = "a `Partial` gradient holds pending sums: average it over Dp (dp_average) and, for sequence-parallel norm weights and biases, reduce it over Tp (SeqMode::reduce_param_grad) before the optimizer step"
)]
pub trait ReducedPlacement<P>: PlacementType {}
impl<const D: usize> ReducedPlacement<Shard<D>> for Shard<D> {}
impl<P: IsWhole> ReducedPlacement<P> for Invariant {}

/// A gradient layout (`Self`) reduced to the placement of a parameter laid out as `P` on
/// every axis: what [`Optimizer::update`] accepts.
#[diagnostic::on_unimplemented(
    message = "the optimizer step needs a gradient reduced to the parameter's placement, got `{Self}` for a parameter laid out as `{P}`",
    label = "unreduced gradient",
    note = "a `Partial` gradient axis holds pending sums: average it over Dp (dp_average) and, for sequence-parallel norm weights and biases, reduce it over Tp (SeqMode::reduce_param_grad) first"
)]
pub trait ReducedGrad<P: Layout>: Layout {}
impl ReducedGrad<()> for () {}
impl<X: MeshAxis, P, Q, R, S> ReducedGrad<(On<X, P>, R)> for (On<X, Q>, S)
where
    P: PlacementType,
    Q: ReducedPlacement<P>,
    R: Layout,
    S: ReducedGrad<R>,
{
}

/// A trainable tensor: its value and the optimizer's per-element state (Adam's moments).
pub struct Param<L: Layout> {
    value: DTensor<L>,
    state: Vec<Tensor>,
}

impl<L: Layout> Param<L> {
    pub fn new(value: DTensor<L>) -> Self {
        Param {
            value,
            state: Vec::new(),
        }
    }
    pub fn value(&self) -> &DTensor<L> {
        &self.value
    }
    /// The local piece of the value.
    pub fn local(&self) -> &Tensor {
        self.value.as_local()
    }
    /// Replaces the local piece (same shape): the optimizers' write path.
    fn set_local(&mut self, local: Tensor) -> Result<()> {
        let global: Vec<usize> = self.value.global_shape().to_vec();
        let mesh = self.value.device_mesh().clone();
        self.value = DTensor::from_local(local, &global, &mesh)?;
        Ok(())
    }
}

/// Averages a gradient over `Dp`: `Partial` terms scaled by `1/dp`, then all-reduced.
pub fn dp_average<T: PlacementType + Linear>(
    g: DTensor<DpPartial<T>>,
) -> Result<DTensor<DpReduced<T>>> {
    let dp = axis_size(g.device_mesh(), AxisKind::Dp);
    let g = if dp > 1 { g.scale(1.0 / dp as f64)? } else { g };
    g.all_reduce(Dp)
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

fn to_dtype(v: Vec<f64>, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let t = Tensor::from_vec(v, shape)?;
    Ok(if dtype == DType::F64 {
        t
    } else {
        t.to_dtype(dtype)
    })
}

/// Plain SGD: `p -= lr·g`.
#[derive(Clone, Debug)]
pub struct Sgd {
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
        let gv = g.as_local().to_f64_vec();
        let v: Vec<f64> = p
            .local()
            .to_f64_vec()
            .iter()
            .zip(&gv)
            .map(|(w, d)| w - self.lr * d)
            .collect();
        let t = to_dtype(v, p.local().shape(), p.local().dtype())?;
        p.set_local(t)
    }
}

/// AdamW (decoupled weight decay, bias-corrected moments). The moments live in the
/// parameter, laid out like it, so a sharded parameter has sharded state.
#[derive(Clone, Debug)]
pub struct AdamW {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    step: u64,
}

impl AdamW {
    pub fn new(lr: f64) -> Self {
        AdamW {
            lr,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.01,
            step: 0,
        }
    }
    /// Steps begun so far.
    pub fn steps(&self) -> u64 {
        self.step
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
        let shape: Vec<usize> = p.local().shape().to_vec();
        let n = p.local().numel();
        if p.state.len() != 2 {
            p.state = vec![
                Tensor::zeros(&shape, DType::F64),
                Tensor::zeros(&shape, DType::F64),
            ];
        }
        let gv = g.as_local().to_f64_vec();
        let mut w = p.local().to_f64_vec();
        let (c1, c2) = (1.0 - self.beta1.powi(t), 1.0 - self.beta2.powi(t));
        let [m, v] = &mut p.state[..] else {
            unreachable!("two moments set above")
        };
        let m = m.as_mut_slice::<f64>()?;
        let v = v.as_mut_slice::<f64>()?;
        for i in 0..n {
            m[i] = self.beta1 * m[i] + (1.0 - self.beta1) * gv[i];
            v[i] = self.beta2 * v[i] + (1.0 - self.beta2) * gv[i] * gv[i];
            let upd = (m[i] / c1) / ((v[i] / c2).sqrt() + self.eps);
            w[i] -= self.lr * (upd + self.weight_decay * w[i]);
        }
        let t = to_dtype(w, &shape, p.local().dtype())?;
        p.set_local(t)
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
            self.sum_sq += g.as_local().to_f64_vec().iter().map(|x| x * x).sum::<f64>();
        }
        Ok(())
    }

    /// Collective over the `[Dp, Tp]` mesh of `like`: the global norm.
    pub fn finish<L: Layout>(&self, like: &DTensor<L>) -> Result<f64> {
        let mesh = like.device_mesh();
        let t = Tensor::from_vec(vec![self.sum_sq], &[1])?;
        let s = DTensor::<layout![Dp: Partial, Tp: Partial]>::from_local(t, &[1], mesh)?
            .all_reduce(Dp)?
            .all_reduce(Tp)?;
        Ok(s.as_local().to_f64_vec()[0].sqrt())
    }
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
