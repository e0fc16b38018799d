//! Mixture-of-experts over the `Ep` axis: routing, dispatch / combine (all-to-all-v),
//! grouped expert matmuls, capacity, the Switch aux loss, and what crosses the wire,
//! against single-rank references in f64.

mod common;

use common::on_mesh;
use dtensor::core::moe::{aux_loss, combine, dispatch, route, AuxLossLayout, AuxLossOut};
use dtensor::kernels::ops;
use dtensor::placement::{
    AddLayout, CombineLayout, CombineOut, DispatchLayout, DispatchOut, DispatchedBy, ExpertTokens,
    GroupedMatmulLayout, GroupedMatmulOut, LinearLayout, LossLayout, MatmulTLayout, MatmulTOut,
    MulLayout, MulOut, NotSplitLayout, PointwiseLayout, Select, SumLayout, SumOut,
};
use dtensor::prelude::*;
use proptest::prelude::*;
use std::sync::Arc;

type Rows = layout![Ep: Shard<0>];
type Rep = layout![Ep: Replicate];
type Experts = layout![Ep: Shard<0>];

const TOL: f64 = 1e-10;

fn close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= TOL * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

fn val(seed: u64, i: usize) -> f64 {
    let mut z = seed
        .wrapping_add(i as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z ^= z >> 29;
    (z % 2001) as f64 / 1000.0 - 1.0
}

fn ep_mesh(ep: usize) -> [(AxisKind, usize); 1] {
    [(AxisKind::Ep, ep)]
}

/// Softmax rows and top-k (ties to the lower index) as the router computes them.
fn softmax_rows(v: &[f64], e: usize) -> Vec<f64> {
    let mut p = v.to_vec();
    for row in p.chunks_mut(e) {
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let s: f64 = row.iter().map(|x| (x - m).exp()).sum();
        row.iter_mut().for_each(|x| *x = (*x - m).exp() / s);
    }
    p
}

fn top_k(s: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..s.len()).collect();
    idx.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
    idx.truncate(k);
    idx
}

// ---------------------------------------------------------------------------------------
// dispatch ∘ combine with gates 1/k is the identity, on values and gradients
// ---------------------------------------------------------------------------------------

struct Case {
    ep: usize,
    tokens: usize,
    hidden: usize,
    experts_per_rank: usize,
    k: usize,
    seed: u64,
    /// Experts favoured by a large selection bias (so others receive nothing).
    hot: Vec<usize>,
}

fn round_trip(c: &Case) -> Vec<(Vec<usize>, usize)> {
    let e = c.ep * c.experts_per_rank;
    let (t, h, k) = (c.tokens, c.hidden, c.k);
    let xg: Vec<f64> = (0..t * h).map(|i| val(c.seed, i)).collect();
    let cg: Vec<f64> = (0..t * h).map(|i| val(c.seed ^ 0xABCD, i)).collect();
    let mut bias = vec![0.0; e];
    for &x in &c.hot {
        bias[x % e] = 10.0;
    }
    let out = on_mesh(&ep_mesh(c.ep), |mesh| {
        let tape = Tape::new();
        let logits = global::<Rows>(&[t, e], mesh, |i| val(c.seed ^ 0x5555, i) * 3.0)?;
        let logits = tape.constant(logits);
        let mut cfg = RouterConfig::new(e, k);
        cfg.selection_bias = Some(bias.clone());
        let (routing, _gates) = route::<(), _, _>(&logits, &cfg)?;
        let x = tape.leaf(global::<Rows>(&[t, h], mesh, |i| xg[i])?);
        let gates = tape.leaf(global::<Rows>(&[t, k], mesh, |_| 1.0 / k as f64)?);
        let d = dispatch(&x, &routing)?;
        assert_eq!(d.var().value().placements(), &[Placement::Ragged]);
        assert_eq!(
            d.groups().iter().sum::<usize>(),
            d.var().value().local_shape()[0]
        );
        let y = combine(&d, &gates, &routing)?;
        let cv = tape.constant(global::<Rows>(&[t, h], mesh, |i| cg[i])?);
        let loss = y.mul(&cv)?.sum_dim::<1>()?.sum_dim::<0>()?;
        let yv = y.value().full_tensor()?.to_f64_vec();
        let mut g = loss.backward()?;
        let dx = g.take(&x)?.full_tensor()?.to_f64_vec();
        let dg = g.take(&gates)?.full_tensor()?.to_f64_vec();
        Ok((
            yv,
            dx,
            dg,
            routing.groups(),
            routing.send_counts().iter().sum::<usize>(),
        ))
    });
    for (yv, dx, dg, _, _) in &out {
        close(yv, &xg, "combine(dispatch(x))");
        close(dx, &cg, "d/dx");
        // d/dgate[t, s] = ⟨c_t, x_t⟩ for every (dropless) copy.
        let want: Vec<f64> = (0..t * k)
            .map(|i| {
                let r = i / k;
                (0..h).map(|j| cg[r * h + j] * xg[r * h + j]).sum()
            })
            .collect();
        close(dg, &want, "d/dgate");
    }
    out.into_iter().map(|o| (o.3, o.4)).collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn dispatch_then_combine_is_the_identity(
        ep in prop_oneof![Just(2usize), Just(4usize)],
        tokens in 0usize..11,
        hidden in 1usize..4,
        experts_per_rank in 1usize..3,
        k in 1usize..3,
        seed in any::<u64>(),
        hot in proptest::collection::vec(0usize..8, 0..3),
    ) {
        let k = k.min(ep * experts_per_rank);
        round_trip(&Case { ep, tokens, hidden, experts_per_rank, k, seed, hot });
    }
}

#[test]
fn round_trip_with_idle_experts_and_silent_ranks() {
    // 3 tokens on 4 ranks: rank 3 sends nothing; the bias sends everything to experts 0, 5.
    let c = Case {
        ep: 4,
        tokens: 3,
        hidden: 2,
        experts_per_rank: 2,
        k: 2,
        seed: 7,
        hot: vec![0, 5],
    };
    let per_rank = round_trip(&c);
    assert!(
        per_rank.iter().any(|(_, sent)| *sent == 0),
        "a rank sends nothing"
    );
    assert!(
        per_rank.iter().flat_map(|(g, _)| g).any(|&n| n == 0),
        "an expert receives nothing"
    );
}

// ---------------------------------------------------------------------------------------
// An MoE MLP, dropless: router → top-k → dispatch → w1 → gelu → w2 → combine
// ---------------------------------------------------------------------------------------

struct Mlp {
    t: usize,
    h: usize,
    f: usize,
    e: usize,
    k: usize,
    alpha: f64,
}

impl Mlp {
    /// The global x `[t, h]`, Wr `[e, h]`, W1 `[e, f, h]`, W2 `[e, h, f]` and the constant
    /// `[t, h]` the output is dotted with.
    fn inputs(&self) -> [Vec<f64>; 5] {
        let (t, h, f, e) = (self.t, self.h, self.f, self.e);
        [
            data(1, t * h, 1.0),
            data(2, e * h, 1.0),
            data(3, e * f * h, 0.5),
            data(4, e * h * f, 0.5),
            data(5, t * h, 1.0),
        ]
    }
}

fn data(seed: u64, n: usize, scale: f64) -> Vec<f64> {
    (0..n).map(|i| val(seed, i) * scale).collect()
}

/// Every rank's result: loss, output, dx, dWr, dW1, dW2 (global, f64).
type MlpOut = (f64, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>);

/// An f64 `DTensor` laid out `L` whose global element `i` is `f(i)`.
fn global<L: Layout>(
    shape: &[usize],
    mesh: &Arc<DeviceMesh>,
    f: impl Fn(usize) -> f64,
) -> Result<DTensor<L>> {
    DTensor::from_global_fn(shape, DType::F64, mesh, f)
}

/// The MoE MLP on `axes` with tokens (and the constant the output is dotted with) laid out
/// `Tok`, the router weight `Router` and the expert weights `Exp`; the aux loss (scaled by
/// `m.alpha`) joins the loss unless `alpha` is 0. `whole` turns the router's and the
/// experts' gradients into whole tensors (dWr, dW1). Every rank's result, with the
/// placements of the dispatched rows.
#[allow(clippy::type_complexity)]
fn mlp_on_mesh<Tok, Router, Exp, I1, I2, I3>(
    m: &Mlp,
    axes: &[(AxisKind, usize)],
    whole: impl Fn(DTensor<Router::Grad>, DTensor<Exp::Grad>) -> Result<(Tensor, Tensor)> + Sync,
) -> Vec<(MlpOut, Vec<Placement>)>
where
    Tok: Layout + Select<Ep, I1> + DispatchLayout<()> + MulLayout<Out<Tok, Router, Exp>>,
    <Tok as Select<Ep, I1>>::P: ExpertTokens,
    Router: MatmulTLayout<Tok>,
    Logits<Tok, Router>: Select<Ep, I2> + NotSplitLayout<1> + AuxLossLayout,
    <Logits<Tok, Router> as Select<Ep, I2>>::P: ExpertTokens,
    Aux<Tok, Router>: LinearLayout + AddLayout<Main<Tok, Router, Exp>>,
    Exp: GroupedMatmulLayout<DispatchOut<Tok, ()>> + GroupedMatmulLayout<Up<Tok, Exp>>,
    Up<Tok, Exp>: PointwiseLayout,
    Down<Tok, Exp>: Select<Ep, I3>,
    <Down<Tok, Exp> as Select<Ep, I3>>::P: DispatchedBy<()>,
    Logits<Tok, Router>: CombineLayout<Down<Tok, Exp>>,
    MulOut<Out<Tok, Router, Exp>, Tok>: SumLayout<1>,
    SumOut<MulOut<Out<Tok, Router, Exp>, Tok>, 1>: SumLayout<0>,
    Main<Tok, Router, Exp>: LossLayout,
{
    let (t, h, f, e, k) = (m.t, m.h, m.f, m.e, m.k);
    let [xg, wr, w1, w2, cg] = m.inputs();
    on_mesh(axes, |mesh| {
        let tape = Tape::new();
        let x = tape.leaf(global::<Tok>(&[t, h], mesh, |i| xg[i])?);
        let wr_v = tape.leaf(global::<Router>(&[e, h], mesh, |i| wr[i])?);
        let w1_v = tape.leaf(global::<Exp>(&[e, f, h], mesh, |i| w1[i])?);
        let w2_v = tape.leaf(global::<Exp>(&[e, h, f], mesh, |i| w2[i])?);
        let logits = x.matmul_t(&wr_v)?;
        let (routing, gates) = route::<(), _, _>(&logits, &RouterConfig::new(e, k))?;
        let d = dispatch(&x, &routing)?;
        let placements = d.var().value().placements().to_vec();
        let y = d
            .grouped_matmul_t(&w1_v)?
            .map_rows(|v| v.gelu())?
            .grouped_matmul_t(&w2_v)?;
        let out = combine(&y, &gates, &routing)?;
        let cv = tape.constant(global::<Tok>(&[t, h], mesh, |i| cg[i])?);
        let main = out.mul(&cv)?.sum_dim::<1>()?.sum_dim::<0>()?;
        let loss = if m.alpha != 0.0 {
            main.add(&aux_loss(&logits, &routing)?.scale(m.alpha)?)?
        } else {
            main
        };
        let lv = loss.value().full_tensor()?.to_f64_vec()[0];
        let ov = out.value().full_tensor()?.to_f64_vec();
        let mut g = loss.backward()?;
        let (dwr, dw1) = whole(g.take(&wr_v)?, g.take(&w1_v)?)?;
        Ok((
            (
                lv,
                ov,
                g.take(&x)?.full_tensor()?.to_f64_vec(),
                dwr.to_f64_vec(),
                dw1.to_f64_vec(),
                g.take(&w2_v)?.full_tensor()?.to_f64_vec(),
            ),
            placements,
        ))
    })
}

/// The layouts [`mlp_on_mesh`] goes through: router logits (and gates), the dispatched rows
/// after the up and the down projection, the combined output, the main loss and the aux
/// loss.
type Logits<Tok, Router> = MatmulTOut<Tok, Router>;
type Up<Tok, Exp> = GroupedMatmulOut<DispatchOut<Tok, ()>, Exp>;
type Down<Tok, Exp> = GroupedMatmulOut<Up<Tok, Exp>, Exp>;
type Out<Tok, Router, Exp> = CombineOut<Down<Tok, Exp>, Logits<Tok, Router>>;
type Main<Tok, Router, Exp> = SumOut<SumOut<MulOut<Out<Tok, Router, Exp>, Tok>, 1>, 0>;
type Aux<Tok, Router> = AuxLossOut<Logits<Tok, Router>>;

/// The dense single-rank reference: every token through each of its k experts, by hand.
fn mlp_reference(m: &Mlp) -> MlpOut {
    let (t, h, f, e, k) = (m.t, m.h, m.f, m.e, m.k);
    let [xg, wr, w1, w2, cg] = m.inputs();
    let mut logits = vec![0.0; t * e];
    for r in 0..t {
        for x in 0..e {
            logits[r * e + x] = (0..h).map(|j| xg[r * h + j] * wr[x * h + j]).sum();
        }
    }
    let p = softmax_rows(&logits, e);
    let mut out = vec![0.0; t * h];
    let (mut dx, mut dw1, mut dw2) = (vec![0.0; t * h], vec![0.0; e * f * h], vec![0.0; e * h * f]);
    let mut dp = vec![0.0; t * e];
    let mut selected = vec![0usize; e];
    let mut choices = Vec::new();
    for r in 0..t {
        let sel = top_k(&p[r * e..(r + 1) * e], k);
        for &x in &sel {
            selected[x] += 1;
            choices.push((r, x));
        }
    }
    let mut loss = 0.0;
    for &(r, x) in &choices {
        let g = p[r * e + x];
        let pre: Vec<f64> = (0..f)
            .map(|o| {
                (0..h)
                    .map(|j| w1[(x * f + o) * h + j] * xg[r * h + j])
                    .sum()
            })
            .collect();
        let pre_t = Tensor::from_f64_vec(pre.clone(), &[1, f], DType::F64).unwrap();
        let a = ops::gelu(&pre_t).unwrap().to_f64_vec();
        let y: Vec<f64> = (0..h)
            .map(|o| (0..f).map(|j| w2[(x * h + o) * f + j] * a[j]).sum())
            .collect();
        for j in 0..h {
            out[r * h + j] += g * y[j];
            loss += cg[r * h + j] * g * y[j];
        }
        // Backward.
        let dy: Vec<f64> = (0..h).map(|j| g * cg[r * h + j]).collect();
        dp[r * e + x] += (0..h).map(|j| cg[r * h + j] * y[j]).sum::<f64>();
        let mut da = vec![0.0; f];
        for o in 0..h {
            for j in 0..f {
                dw2[(x * h + o) * f + j] += dy[o] * a[j];
                da[j] += w2[(x * h + o) * f + j] * dy[o];
            }
        }
        let da_t = Tensor::from_f64_vec(da, &[1, f], DType::F64).unwrap();
        let dpre = ops::gelu_backward(&da_t, &pre_t).unwrap().to_f64_vec();
        for o in 0..f {
            for j in 0..h {
                dw1[(x * f + o) * h + j] += dpre[o] * xg[r * h + j];
                dx[r * h + j] += w1[(x * f + o) * h + j] * dpre[o];
            }
        }
    }
    // Aux loss: E · Σ f_i P_i.
    let fr: Vec<f64> = selected
        .iter()
        .map(|&c| c as f64 / (t * k) as f64)
        .collect();
    let pm: Vec<f64> = (0..e)
        .map(|x| (0..t).map(|r| p[r * e + x]).sum::<f64>() / t as f64)
        .collect();
    loss += m.alpha * e as f64 * fr.iter().zip(&pm).map(|(a, b)| a * b).sum::<f64>();
    // d logits: gates' softmax plus the aux term.
    let mut dl = vec![0.0; t * e];
    for r in 0..t {
        let pr = &p[r * e..(r + 1) * e];
        let dot: f64 = pr
            .iter()
            .zip(&dp[r * e..(r + 1) * e])
            .map(|(a, b)| a * b)
            .sum();
        let dotf: f64 = pr.iter().zip(&fr).map(|(a, b)| a * b).sum();
        for x in 0..e {
            dl[r * e + x] = pr[x] * (dp[r * e + x] - dot)
                + m.alpha * e as f64 / t as f64 * pr[x] * (fr[x] - dotf);
        }
    }
    let mut dwr = vec![0.0; e * h];
    for r in 0..t {
        for x in 0..e {
            for j in 0..h {
                dx[r * h + j] += dl[r * e + x] * wr[x * h + j];
                dwr[x * h + j] += dl[r * e + x] * xg[r * h + j];
            }
        }
    }
    (loss, out, dx, dwr, dw1, dw2)
}

#[test]
fn moe_mlp_matches_the_dense_reference_at_ep_2_and_4() {
    for (ep, k) in [(2, 2), (4, 2), (4, 1)] {
        let m = Mlp {
            t: 10,
            h: 3,
            f: 5,
            e: 8,
            k,
            alpha: 0.01,
        };
        let (loss, out, dx, dwr, dw1, dw2) = mlp_reference(&m);
        // dWr is Partial over Ep; dW1 Shard<0> over Ep: whole on the owner.
        let whole = |dwr: DTensor<layout![Ep: Partial]>, dw1: DTensor<Experts>| -> Result<_> {
            Ok((dwr.full_tensor()?, dw1.full_tensor()?))
        };
        for ((l, o, x, r, w1, w2), _) in
            mlp_on_mesh::<Rows, Rep, Experts, _, _, _>(&m, &ep_mesh(ep), whole)
        {
            close(&[l], &[loss], "loss");
            close(&o, &out, "out");
            close(&x, &dx, "dx");
            close(&r, &dwr, "d router");
            close(&w1, &dw1, "dW1");
            close(&w2, &dw2, "dW2");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Capacity: dropped copies contribute zero; stats count them
// ---------------------------------------------------------------------------------------

#[test]
fn capacity_drops_later_tokens_and_they_contribute_zero() {
    let (ep, t, h, e, k) = (2, 12, 2, 4, 2);
    let xg = data(11, t * h, 1.0);
    let res = on_mesh(&ep_mesh(ep), |mesh| {
        let tape = Tape::new();
        let logits = tape.constant(global::<Rows>(&[t, e], mesh, |i| val(12, i) * 2.0)?);
        let mut cfg = RouterConfig::new(e, k);
        cfg.capacity_factor = Some(0.5); // ⌈0.5 · 6 · 2 / 4⌉ = 2 copies per (rank, expert)
        cfg.selection_bias = Some(vec![0.5, 0.0, 0.0, 0.0]); // expert 0 over-subscribed
        let (routing, _) = route::<(), _, _>(&logits, &cfg)?;
        let x = tape.leaf(global::<Rows>(&[t, h], mesh, |i| xg[i])?);
        let gates = tape.constant(global::<Rows>(&[t, k], mesh, |_| 1.0)?);
        let d = dispatch(&x, &routing)?;
        let y = combine(&d, &gates, &routing)?;
        let stats = routing.stats()?;
        let lv = y.value().as_local().to_f64_vec();
        Ok((
            routing.choices().to_vec(),
            routing.kept().to_vec(),
            lv,
            stats,
            mesh.rank(),
        ))
    });
    let mut dropped = 0;
    for (choices, kept, out, stats, rank) in &res {
        // Rule: per (rank, expert), at most 2 copies, first in token then slot order.
        let mut used = [0usize; 4];
        for (i, &x) in choices.iter().enumerate() {
            used[x] += 1;
            assert_eq!(kept[i], used[x] <= 2, "copy {i} on rank {rank}");
        }
        dropped += kept.iter().filter(|k| !**k).count();
        let local_t = t / ep;
        for r in 0..local_t {
            let copies = (0..k).filter(|s| kept[r * k + s]).count() as f64;
            let gr = rank * local_t + r;
            let want: Vec<f64> = (0..h).map(|j| copies * xg[gr * h + j]).collect();
            close(&out[r * h..(r + 1) * h], &want, "capped output");
        }
        assert_eq!(
            stats.per_expert.iter().sum::<usize>() + stats.dropped,
            t * k
        );
        assert!(stats.max <= 2 * ep);
        println!("{stats}");
    }
    assert!(dropped > 0, "the test must drop something");
    assert_eq!(res[0].3.dropped, dropped);
}

// ---------------------------------------------------------------------------------------
// The aux loss alone, and normalized gates, against references
// ---------------------------------------------------------------------------------------

#[test]
fn aux_loss_and_normalized_gates_match_references() {
    let (ep, t, e, k) = (2, 6, 4, 2);
    let lg = data(21, t * e, 2.0);
    let wg = data(22, t * k, 1.0);
    let res = on_mesh(&ep_mesh(ep), |mesh| {
        let tape = Tape::new();
        let logits = tape.leaf(global::<Rows>(&[t, e], mesh, |i| lg[i])?);
        let mut cfg = RouterConfig::new(e, k);
        cfg.normalize_gates = true;
        let (routing, gates) = route::<(), _, _>(&logits, &cfg)?;
        let wv = tape.constant(global::<Rows>(&[t, k], mesh, |i| wg[i])?);
        let gsum = gates.mul(&wv)?.sum_dim::<1>()?.sum_dim::<0>()?;
        let loss = aux_loss(&logits, &routing)?.add(&gsum)?;
        let aux = aux_loss(&logits, &routing)?
            .value()
            .full_tensor()?
            .to_f64_vec()[0];
        let gv = gates.value().full_tensor()?.to_f64_vec();
        let mut g = loss.backward()?;
        Ok((aux, gv, g.take(&logits)?.full_tensor()?.to_f64_vec()))
    });
    let p = softmax_rows(&lg, e);
    let sel: Vec<Vec<usize>> = (0..t).map(|r| top_k(&p[r * e..(r + 1) * e], k)).collect();
    let mut fr = vec![0.0; e];
    sel.iter()
        .flatten()
        .for_each(|&x| fr[x] += 1.0 / (t * k) as f64);
    let pm: Vec<f64> = (0..e)
        .map(|x| (0..t).map(|r| p[r * e + x]).sum::<f64>() / t as f64)
        .collect();
    let aux = e as f64 * fr.iter().zip(&pm).map(|(a, b)| a * b).sum::<f64>();
    let gates: Vec<f64> = (0..t)
        .flat_map(|r| {
            let s: f64 = sel[r].iter().map(|&x| p[r * e + x]).sum();
            sel[r].iter().map(|&x| p[r * e + x] / s).collect::<Vec<_>>()
        })
        .collect();
    // d/dlogits by central differences of the same objective.
    let objective = |l: &[f64]| -> f64 {
        let p = softmax_rows(l, e);
        let pm: Vec<f64> = (0..e)
            .map(|x| (0..t).map(|r| p[r * e + x]).sum::<f64>() / t as f64)
            .collect();
        let a = e as f64 * fr.iter().zip(&pm).map(|(a, b)| a * b).sum::<f64>();
        let gsum: f64 = (0..t)
            .map(|r| {
                let s: f64 = sel[r].iter().map(|&x| p[r * e + x]).sum();
                sel[r]
                    .iter()
                    .enumerate()
                    .map(|(j, &x)| wg[r * k + j] * p[r * e + x] / s)
                    .sum::<f64>()
            })
            .sum();
        a + gsum
    };
    let h = 1e-5;
    let num: Vec<f64> = (0..t * e)
        .map(|i| {
            let (mut a, mut b) = (lg.clone(), lg.clone());
            a[i] += h;
            b[i] -= h;
            (objective(&a) - objective(&b)) / (2.0 * h)
        })
        .collect();
    for (a, gv, dl) in &res {
        close(&[*a], &[aux], "aux loss");
        close(gv, &gates, "normalized gates");
        for (i, (g, w)) in dl.iter().zip(&num).enumerate() {
            assert!((g - w).abs() < 1e-8, "d logits[{i}]: {g} vs {w}");
        }
    }
}

// ---------------------------------------------------------------------------------------
// Accounting: bytes per routed copy, checked against the Ep communicator's counters
// ---------------------------------------------------------------------------------------

#[test]
fn dispatch_and_combine_bytes_follow_the_formula() {
    let (ep, t, h, e, k) = (4, 16, 3, 8, 2);
    let xg = data(31, t * h, 1.0);
    on_mesh(&ep_mesh(ep), |mesh| {
        let comm = mesh.comm(AxisKind::Ep).unwrap().clone();
        let sent = || comm.counters().bytes_sent;
        let recvd = || comm.counters().bytes_received;
        let tape = Tape::new();
        let logits = tape.constant(global::<Rows>(&[t, e], mesh, |i| val(32, i))?);
        let (s0, r0) = (sent(), recvd());
        let (routing, gates) = route::<(), _, _>(&logits, &RouterConfig::new(e, k))?;
        // Count exchange: E/ep i64 counts to each peer.
        let counts = ((ep - 1) * (e / ep) * 8) as u64;
        assert_eq!((sent() - s0, recvd() - r0), (counts, counts));
        let row = (h * 8) as u64; // hidden · f64 bytes per routed copy
        let (out_c, in_c) = (
            routing.remote_copies_sent() as u64,
            routing.remote_copies_received() as u64,
        );
        let x = tape.leaf(global::<Rows>(&[t, h], mesh, |i| xg[i])?);
        let (s1, r1) = (sent(), recvd());
        let d = dispatch(&x, &routing)?;
        assert_eq!(sent() - s1, out_c * row, "dispatch sends");
        assert_eq!(recvd() - r1, in_c * row, "dispatch receives");
        let (s2, r2) = (sent(), recvd());
        let y = combine(&d, &gates, &routing)?;
        assert_eq!(
            sent() - s2,
            in_c * row,
            "combine sends the received copies back"
        );
        assert_eq!(recvd() - r2, out_c * row, "combine receives its copies");
        let (s3, r3) = (sent(), recvd());
        let loss = y.sum_dim::<1>()?.sum_dim::<0>()?;
        let _ = loss.backward()?;
        // Backward: combine's adjoint sends forward, dispatch's sends back.
        assert_eq!(sent() - s3, (out_c + in_c) * row, "backward sends");
        assert_eq!(recvd() - r3, (in_c + out_c) * row, "backward receives");
        println!(
            "rank {}: {out_c} copies out, {in_c} in; dispatch {} B, combine {} B, counts {counts} B",
            mesh.rank(),
            out_c * row,
            in_c * row
        );
        Ok(())
    });
}

// ---------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------

fn route_err(ep: usize, e: usize, k: usize, cols: usize) -> String {
    let res = on_mesh(&ep_mesh(ep), |mesh| {
        let tape = Tape::new();
        let logits = tape.constant(global::<Rows>(&[4, cols], mesh, |i| i as f64)?);
        Ok(route::<(), _, _>(&logits, &RouterConfig::new(e, k))
            .err()
            .map(|e| e.to_string()))
    });
    res[0].clone().expect("an error")
}

#[test]
fn bad_configurations_are_errors_naming_op_and_sizes() {
    let m = route_err(2, 3, 1, 3);
    assert!(
        m.contains("moe::route") && m.contains("3 experts") && m.contains("2 ranks"),
        "{m}"
    );
    let m = route_err(2, 2, 3, 2);
    assert!(m.contains("top-k 3") && m.contains("experts 2"), "{m}");
    let m = route_err(1, 4, 3, 4);
    assert!(m.contains("top-k must be 1 or 2, got 3"), "{m}");
    let m = route_err(2, 4, 1, 5);
    assert!(m.contains("[tokens, 4]") && m.contains("[2, 5]"), "{m}");

    // Another routing of the same brand, and tokens of the wrong count.
    let res = on_mesh(&ep_mesh(2), |mesh| {
        let tape = Tape::new();
        let logits = tape.constant(global::<Rows>(&[4, 2], mesh, |i| val(41, i))?);
        let cfg = RouterConfig::new(2, 1);
        let (r1, g1) = route::<(), _, _>(&logits, &cfg)?;
        let (r2, _) = route::<(), _, _>(&logits, &cfg)?;
        let x = tape.constant(global::<Rows>(&[4, 3], mesh, |i| i as f64)?);
        let d = dispatch(&x, &r1)?;
        let other = combine(&d, &g1, &r2).err().map(|e| e.to_string());
        let wrong = tape.constant(global::<Rows>(&[6, 3], mesh, |i| i as f64)?);
        let shape = dispatch(&wrong, &r1).err().map(|e| e.to_string());
        let w = tape.constant(global::<Experts>(&[4, 3, 3], mesh, |i| i as f64)?);
        let gm = d.grouped_matmul_t(&w).err().map(|e| e.to_string());
        Ok((other, shape, gm))
    });
    let (other, shape, gm) = &res[0];
    let other = other
        .as_ref()
        .expect("combine by another routing is an Err");
    assert!(
        other.contains("moe::combine") && other.contains("dispatched by routing #"),
        "{other}"
    );
    let shape = shape.as_ref().expect("wrong token count is an Err");
    assert!(
        shape.contains("moe::dispatch") && shape.contains("[3, 3]") && shape.contains("2 tokens"),
        "{shape}"
    );
    let gm = gm
        .as_ref()
        .expect("weights of the wrong expert count are an Err");
    assert!(
        gm.contains("grouped_matmul_t")
            && gm.contains("[2, 3, 3]")
            && gm.contains("1 local experts"),
        "{gm}"
    );
}

#[test]
fn ragged_tensors_have_no_redistribution_plan() {
    let res = on_mesh(&ep_mesh(2), |mesh| {
        let tape = Tape::new();
        let logits = tape.constant(global::<Rows>(&[4, 2], mesh, |i| val(51, i))?);
        let (r, _) = route::<(), _, _>(&logits, &RouterConfig::new(2, 1))?;
        let x = tape.constant(global::<Rows>(&[4, 3], mesh, |i| i as f64)?);
        let d = dispatch(&x, &r)?;
        Ok(d.var().value().full_tensor().err().map(|e| e.to_string()))
    });
    let m = res[0]
        .as_ref()
        .expect("full_tensor of a ragged tensor is an Err");
    assert!(m.contains("Ragged"), "{m}");
}

// ---------------------------------------------------------------------------------------
// [Dp, Ep]: Ep doubles as a data axis; expert weights are replicated over Dp, so their
// gradients are Partial over Dp (reduced there) and Shard<0> over Ep
// ---------------------------------------------------------------------------------------

#[test]
fn moe_mlp_on_a_dp_ep_mesh_matches_the_reference() {
    type Tok = layout![Dp: Shard<0>, Ep: Shard<0>];
    type Exp = layout![Dp: Replicate, Ep: Shard<0>];
    type Router = layout![Dp: Replicate, Ep: Replicate];
    type ExpGrad = layout![Dp: Partial, Ep: Shard<0>];
    let m = Mlp {
        t: 12,
        h: 3,
        f: 4,
        e: 4,
        k: 2,
        alpha: 0.0,
    };
    let (_, out, dx, dwr, dw1, dw2) = mlp_reference(&m);
    let whole = |dwr: DTensor<_>, dw1: DTensor<ExpGrad>| -> Result<_> {
        let dw1 = dw1.all_reduce(Dp)?; // over the data axis only
        Ok((dwr.full_tensor()?, dw1.full_tensor()?))
    };
    let res = mlp_on_mesh::<Tok, Router, Exp, _, _, _>(
        &m,
        &[(AxisKind::Dp, 2), (AxisKind::Ep, 2)],
        whole,
    );
    for ((_, o, x, r, a, b), placements) in &res {
        assert_eq!(placements, &[Placement::Ragged, Placement::Ragged]);
        close(o, &out, "out");
        close(x, &dx, "dx");
        close(r, &dwr, "d router");
        close(a, &dw1, "dW1");
        close(b, &dw2, "dW2");
    }
}
