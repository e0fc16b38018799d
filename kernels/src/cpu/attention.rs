//! Host kernels of [`crate::ops::attention`](mod@crate::ops::attention), on host tensors. Each says
//! what it relies on and which check ensures it: the front door's, before the call, or the
//! kernel's own call of the `spec` check it shares with the device launch.

use super::{acc_dtype, exp_f32, AccFloat, Float, Parallelism};
use crate::spec::attention::*;
use crate::{Result, Tensor};
use num_traits::Float as _;

/// Queries and keys per block. A 64×64 score block of `f32` is 16 KiB: it, a q block and a
/// k/v block stay in L1/L2 at head dim 64, and the products are big enough for gemm's
/// microkernels (32 and 128 measured no faster at the bench shapes). With equal, aligned query and key blocks every row of a processed block
/// has at least one unmasked key (the first key block is always processed), so the online
/// softmax's running max is finite from the first block on.
pub(super) const BLOCK: usize = 64;

/// Host kernel of [`crate::ops::causal_attention`]: relies on `g` being
/// `spec::attention::check_qkv`'s sizes of this `qkv` and its configuration (float
/// `[batch·s, H·3·d]`), which the front door computes.
///
/// `first` is each token's first visible key position ([`AttentionMask`]'s bounds of
/// every sample, `[batch·s]`; all 0 for plain causal attention).
pub(crate) fn causal_attention(
    qkv: &Tensor,
    g: Dims,
    first: &[usize],
) -> Result<CausalAttentionOutput> {
    let mut out = Tensor::for_overwrite(&[g.tokens, g.heads * g.d], qkv.dtype());
    let mut lse = Tensor::for_overwrite(&[g.tokens, g.heads], acc_dtype(qkv.dtype()));
    dispatch_float!(OP, qkv.dtype(), |T| {
        forward::<T>(
            out.as_mut_slice()?,
            lse.as_mut_slice()?,
            qkv.as_slice()?,
            &g,
            first,
        );
        Ok(())
    })?;
    Ok(CausalAttentionOutput { out, lse })
}

/// Host kernel of [`crate::ops::causal_attention_backward`]: relies on `g` as
/// [`causal_attention`] does, on `dout` and `out` being `[tokens, H·d]` of `qkv`'s dtype and
/// `lse` `[tokens, H]` of its compute dtype (`spec::same_dtype`, `spec::check_dst`), as the
/// front door checks, and on `first` as [`causal_attention`] does.
pub(crate) fn causal_attention_backward(
    dout: &Tensor,
    qkv: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    g: Dims,
    first: &[usize],
) -> Result<Tensor> {
    let mut dqkv = Tensor::for_overwrite(qkv.shape(), qkv.dtype());
    dispatch_float!(OP_BACK, qkv.dtype(), |T| {
        backward::<T>(
            dqkv.as_mut_slice()?,
            dout.as_slice()?,
            qkv.as_slice()?,
            out.as_slice()?,
            lse.as_slice()?,
            &g,
            first,
        );
        Ok(())
    })?;
    Ok(dqkv)
}

/// One sample's q (times `1/√d`), k and v of one head, `[s, d]` each in the compute type;
/// reused across (head, sample) pairs.
struct Qkv<A> {
    q: Vec<A>,
    k: Vec<A>,
    v: Vec<A>,
}

impl<A: AccFloat> Qkv<A> {
    fn new(g: &Dims) -> Self {
        let n = g.s * g.d;
        Qkv {
            q: vec![A::ZERO; n],
            k: vec![A::ZERO; n],
            v: vec![A::ZERO; n],
        }
    }

    /// The loaded sample as [`Operands`], every row at its position in `pos` (`0..s`),
    /// each query seeing keys from `first` on.
    fn operands<'a>(&'a self, pos: &'a [usize], first: &'a [usize], d: usize) -> Operands<'a, A> {
        Operands {
            q: &self.q,
            k: &self.k,
            v: &self.v,
            q_pos: pos,
            k_pos: pos,
            q_first: first,
            d,
        }
    }

    /// Loads query head `h` of sample `b`, folding the score scale into q.
    fn load_q<T: Float<Acc = A>>(&mut self, qkv: &[T], g: &Dims, h: usize, b: usize) {
        let (s, d) = (g.s, g.d);
        let scale = A::lit(g.scale);
        let col = q_col(g, h);
        for i in 0..s {
            let row = (b * s + i) * g.cols + col;
            widen(&mut self.q[i * d..(i + 1) * d], &qkv[row..row + d], scale);
        }
    }

    /// Loads KV head `j` of sample `b`.
    fn load_kv<T: Float<Acc = A>>(&mut self, qkv: &[T], g: &Dims, j: usize, b: usize) {
        let (s, d) = (g.s, g.d);
        let col = k_col(g, j);
        for i in 0..s {
            let row = (b * s + i) * g.cols + col;
            let at = i * d..(i + 1) * d;
            widen(&mut self.k[at.clone()], &qkv[row..row + d], A::ONE);
            widen(&mut self.v[at], &qkv[row + d..row + 2 * d], A::ONE);
        }
    }
}

/// The first column of query head `h` in a grouped fused QKV row: its KV group's start,
/// then `h mod g` query heads.
fn q_col(g: &Dims, h: usize) -> usize {
    (h / g.g) * (g.g + 2) * g.d + (h % g.g) * g.d
}

/// The first column of KV head `j`'s k (its v follows) in a grouped fused QKV row.
fn k_col(g: &Dims, j: usize) -> usize {
    (j * (g.g + 2) + g.g) * g.d
}

/// `dst = mul · src` in the compute type.
pub(super) fn widen<T: Float>(dst: &mut [T::Acc], src: &[T], mul: T::Acc) {
    for (o, x) in dst.iter_mut().zip(src) {
        *o = x.to_acc() * mul;
    }
}

/// `dst = round(mul · src)` into the storage type.
fn narrow<T: Float>(dst: &mut [T], src: &[T::Acc], mul: T::Acc) {
    for (o, &x) in dst.iter_mut().zip(src) {
        *o = T::from_acc(x * mul);
    }
}

/// Rows `r0..r1` of a row-major `[_, d]` matrix, as a `[r1 − r0, d]` operand.
fn rows<A>(x: &[A], r0: usize, r1: usize, d: usize) -> Mat<'_, A> {
    Mat::new(&x[r0 * d..r1 * d], r1 - r0, d)
}

/// One (head, sample) pair's operands in the compute type, `[rows, d]` row-major each: q
/// times `1/√d`, k, v; with each row's position in the sample
/// (strictly increasing) and each query's first visible key position (never decreasing),
/// so the keys a query sees in a key block are a contiguous run of it. The
/// full kernel passes one sample's q, k, v with positions `0..s`; the blockwise kernel
/// ([`super::attention_block`]) a chunk of queries against another chunk's keys.
pub(super) struct Operands<'a, A> {
    pub q: &'a [A],
    pub k: &'a [A],
    pub v: &'a [A],
    pub q_pos: &'a [usize],
    pub k_pos: &'a [usize],
    /// Per query row, the first key position it sees ([`AttentionMask`]; 0 when causal).
    pub q_first: &'a [usize],
    pub d: usize,
}

/// The blocks `(start, end)` of `BLOCK` rows (the last one shorter) that cover `0..n`.
fn blocks(n: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(BLOCK)
        .map(move |b0| (b0, (b0 + BLOCK).min(n)))
}

/// Keys `k0..k1` visible from a query at position `qp` that sees keys from position
/// `first` on (`k_pos` increasing): the run `start..end` of them (offsets in the block).
fn live(k_pos: &[usize], k0: usize, k1: usize, first: usize, qp: usize) -> (usize, usize) {
    let keys = &k_pos[k0..k1];
    (
        keys.partition_point(|&p| p < first),
        keys.partition_point(|&p| p <= qp),
    )
}

/// Whether tile `q0..q1` × `k0..k1` of `x` is skipped ([`key_tile_masked`]); counts the
/// tiles that are not.
fn skip_tile<A>(x: &Operands<'_, A>, (q0, q1): (usize, usize), (k0, k1): (usize, usize)) -> bool {
    let masked = key_tile_masked(x.q_first[q0], x.q_pos[q1 - 1], x.k_pos[k0], x.k_pos[k1 - 1]);
    if !masked {
        TILES_COMPUTED.with(|n| n.set(n.get() + 1));
    }
    masked
}

thread_local! {
    /// Score tiles the host kernels computed on this thread (forward and backward):
    /// [`crate::ops::attention::host_tiles_computed`].
    static TILES_COMPUTED: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The number behind [`crate::ops::attention::host_tiles_computed`].
pub(crate) fn tiles_computed() -> u64 {
    TILES_COMPUTED.with(|n| n.get())
}

/// Scratch of [`forward_sample`]: one block's scores, then probabilities; the running max,
/// sum and unnormalized output of one query block.
pub(super) struct FwdScratch<A> {
    sc: Vec<A>,
    m: Vec<A>,
    l: Vec<A>,
    acc: Vec<A>,
}

impl<A: AccFloat> FwdScratch<A> {
    pub(super) fn new(d: usize, rows: usize) -> Self {
        let b = BLOCK.min(rows.max(1));
        FwdScratch {
            sc: vec![A::ZERO; b * b],
            m: vec![A::ZERO; b],
            l: vec![A::ZERO; b],
            acc: vec![A::ZERO; b * d],
        }
    }
}

/// The online-softmax forward of one (head, sample) pair: for each query row `i`, calls
/// `emit(i, acc, l, m)` with its unnormalized output `acc = Σ_j e^(s_ij − m) v_j`, the sum
/// `l = Σ_j e^(s_ij − m)` and the running max `m` over the keys it sees (`l = 0`,
/// `m = −∞` when it sees none). Key blocks no query of a query block sees are skipped
/// ([`key_tile_masked`]).
pub(super) fn forward_sample<A: ExpShifted>(
    x: &Operands<'_, A>,
    w: &mut FwdScratch<A>,
    mut emit: impl FnMut(usize, &[A], A, A),
) {
    let d = x.d;
    let (nq, nk) = (x.q_pos.len(), x.k_pos.len());
    let zero = A::ZERO;
    for (q0, q1) in blocks(nq) {
        let bq = q1 - q0;
        w.m.fill(A::neg_infinity());
        w.l.fill(zero);
        w.acc.fill(zero);
        for (k0, k1) in blocks(nk) {
            if skip_tile(x, (q0, q1), (k0, k1)) {
                continue;
            }
            let bk = k1 - k0;
            let sc = &mut w.sc[..bq * bk];
            let kv = rows(x.k, k0, k1, d);
            matmul(sc, bk, rows(x.q, q0, q1, d), kv.t(), false);
            for r in 0..bq {
                // Keys `k0 + start .. k0 + end` are visible from query `q0 + r`.
                let (start, end) = live(x.k_pos, k0, k1, x.q_first[q0 + r], x.q_pos[q0 + r]);
                let end = end.max(start);
                let row = &mut sc[r * bk..(r + 1) * bk];
                let mut mx = w.m[r];
                for &v in &row[start..end] {
                    mx = mx.max(v);
                }
                let corr = (w.m[r] - mx).exp();
                A::exp_shifted(&mut row[start..end], mx);
                let mut sum = zero;
                for &p in &row[start..end] {
                    sum += p;
                }
                row[..start].fill(zero);
                row[end..].fill(zero);
                if end > start {
                    w.l[r] = w.l[r] * corr + sum;
                    w.m[r] = mx;
                    for a in &mut w.acc[r * d..(r + 1) * d] {
                        *a *= corr;
                    }
                }
            }
            matmul(
                &mut w.acc[..bq * d],
                d,
                Mat::new(sc, bq, bk),
                rows(x.v, k0, k1, d),
                true,
            );
        }
        for r in 0..bq {
            emit(q0 + r, &w.acc[r * d..(r + 1) * d], w.l[r], w.m[r]);
        }
    }
}

/// Scratch of [`backward_sample`]: one block's P and dP (then dS).
struct BwdScratch<A> {
    p: Vec<A>,
    dp: Vec<A>,
}

impl<A: AccFloat> BwdScratch<A> {
    pub(super) fn new(rows: usize) -> Self {
        let b = BLOCK.min(rows.max(1));
        BwdScratch {
            p: vec![A::ZERO; b * b],
            dp: vec![A::ZERO; b * b],
        }
    }
}

/// One (head, sample) pair's backward buffers: its output gradient `go` (`[nq, d]`),
/// `dd_i = dout_i·out_i` and `lse_i`, and the gradients `dq` (`[nq, d]`), `dk` and `dv`
/// (`[nk, d]`) of the operands as [`Operands`] holds them.
pub(super) struct SampleGrads<A> {
    go: Vec<A>,
    dd: Vec<A>,
    ls: Vec<A>,
    pub dq: Vec<A>,
    pub dk: Vec<A>,
    pub dv: Vec<A>,
    w: BwdScratch<A>,
}

impl<A: ExpShifted> SampleGrads<A> {
    pub(super) fn new(nq: usize, nk: usize, d: usize) -> Self {
        let zero = A::ZERO;
        SampleGrads {
            go: vec![zero; nq * d],
            dd: vec![zero; nq],
            ls: vec![zero; nq],
            dq: vec![zero; nq * d],
            dk: vec![zero; nk * d],
            dv: vec![zero; nk * d],
            w: BwdScratch::new(nq.max(nk)),
        }
    }

    /// The gradients of sample `b`, head `h` (of `heads`) of `x`, from `dout` and `out`
    /// (`[batch·nq, heads·d]`) and `lse` (`[batch·nq, heads]`): `dq`, `dk`, `dv` hold them
    /// afterwards.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn compute<T: Float<Acc = A>>(
        &mut self,
        x: &Operands<'_, A>,
        dout: &[T],
        out: &[T],
        lse: &[A],
        heads: usize,
        h: usize,
        b: usize,
    ) {
        let (d, nq) = (x.d, x.q_pos.len());
        let zero = A::ZERO;
        for i in 0..nq {
            let t = b * nq + i;
            let at = t * heads * d + h * d;
            let mut dot = zero;
            for e in 0..d {
                let gv = dout[at + e].to_acc();
                self.go[i * d + e] = gv;
                dot += gv * out[at + e].to_acc();
            }
            self.dd[i] = dot;
            self.ls[i] = lse[t * heads + h];
        }
        self.dq.fill(zero);
        self.dk.fill(zero);
        self.dv.fill(zero);
        backward_sample(
            x,
            &self.go,
            &self.dd,
            &self.ls,
            &mut self.dq,
            &mut self.dk,
            &mut self.dv,
            &mut self.w,
        );
    }
}

/// The backward of one (head, sample) pair, given the output gradient `go` (`[nq, d]`),
/// `dd_i = dout_i·out_i` and the final `lse_i` of each query row: adds into `dq` (`[nq,
/// d]`), `dk` and `dv` (`[nk, d]`) the gradients with respect to the operands as
/// [`Operands`] holds them (q scaled). `P` is recomputed from `lse`,
/// so with the lse of the *whole* attention (all key blocks merged) this is one key
/// block's exact share of the gradient.
#[allow(clippy::too_many_arguments)]
fn backward_sample<A: ExpShifted>(
    x: &Operands<'_, A>,
    go: &[A],
    dd: &[A],
    ls: &[A],
    dq: &mut [A],
    dk: &mut [A],
    dv: &mut [A],
    w: &mut BwdScratch<A>,
) {
    let d = x.d;
    let (nq, nk) = (x.q_pos.len(), x.k_pos.len());
    let zero = A::ZERO;
    for (k0, k1) in blocks(nk) {
        let bk = k1 - k0;
        let (kv, vv) = (rows(x.k, k0, k1, d), rows(x.v, k0, k1, d));
        for (q0, q1) in blocks(nq) {
            if skip_tile(x, (q0, q1), (k0, k1)) {
                continue;
            }
            let bq = q1 - q0;
            let (p, dp) = (&mut w.p[..bq * bk], &mut w.dp[..bq * bk]);
            let qv = rows(x.q, q0, q1, d);
            let gv = rows(go, q0, q1, d);
            matmul(p, bk, qv, kv.t(), false);
            for r in 0..bq {
                let i = q0 + r;
                let (start, end) = live(x.k_pos, k0, k1, x.q_first[i], x.q_pos[i]);
                let end = end.max(start);
                let row = &mut p[r * bk..(r + 1) * bk];
                A::exp_shifted(&mut row[start..end], ls[i]);
                row[..start].fill(zero);
                row[end..].fill(zero);
            }
            matmul(
                &mut dv[k0 * d..k1 * d],
                d,
                Mat::new(p, bq, bk).t(),
                gv,
                true,
            );
            matmul(dp, bk, gv, vv.t(), false);
            for r in 0..bq {
                let di = dd[q0 + r];
                let rp = &p[r * bk..(r + 1) * bk];
                for (ds, &pv) in dp[r * bk..(r + 1) * bk].iter_mut().zip(rp) {
                    *ds = pv * (*ds - di);
                }
            }
            let ds = Mat::new(dp, bq, bk);
            matmul(&mut dq[q0 * d..q1 * d], d, ds, kv, true);
            matmul(&mut dk[k0 * d..k1 * d], d, ds.t(), qv, true);
        }
    }
}

fn forward<T: Float<Acc: ExpShifted>>(
    out: &mut [T],
    lse: &mut [T::Acc],
    qkv: &[T],
    g: &Dims,
    first: &[usize],
) {
    let (s, d, nh) = (g.s, g.d, g.heads);
    let mut x = Qkv::new(g);
    let pos: Vec<usize> = (0..s).collect();
    let mut w = FwdScratch::new(d, s);
    for (h, b) in head_order(g) {
        if h % g.g == 0 {
            x.load_kv(qkv, g, h / g.g, b);
        }
        x.load_q(qkv, g, h, b);
        let ops = x.operands(&pos, &first[b * s..(b + 1) * s], d);
        forward_sample(&ops, &mut w, |i, acc, l, m| {
            let t = b * s + i;
            let dst = &mut out[t * nh * d + h * d..][..d];
            for (o, &a) in dst.iter_mut().zip(acc) {
                *o = T::from_acc(a / l);
            }
            lse[t * nh + h] = m + l.ln();
        });
    }
}

#[allow(clippy::too_many_arguments)]
fn backward<T: Float<Acc: ExpShifted>>(
    dqkv: &mut [T],
    dout: &[T],
    qkv: &[T],
    out: &[T],
    lse: &[T::Acc],
    g: &Dims,
    first: &[usize],
) {
    let (s, d, nh) = (g.s, g.d, g.heads);
    let scale = T::Acc::lit(g.scale);
    let mut x = Qkv::new(g);
    let pos: Vec<usize> = (0..s).collect();
    let mut grads = SampleGrads::new(s, s, d);
    // dK and dV of the KV head, summed over its query heads in order.
    let (mut dk_sum, mut dv_sum) = (vec![T::Acc::ZERO; s * d], vec![T::Acc::ZERO; s * d]);
    for (h, b) in head_order(g) {
        let (j, first_of_group) = (h / g.g, h % g.g == 0);
        if first_of_group {
            x.load_kv(qkv, g, j, b);
            dk_sum.fill(T::Acc::ZERO);
            dv_sum.fill(T::Acc::ZERO);
        }
        x.load_q(qkv, g, h, b);
        let ops = x.operands(&pos, &first[b * s..(b + 1) * s], d);
        grads.compute(&ops, dout, out, lse, nh, h, b);
        let SampleGrads { dq, dk, dv, .. } = &grads;
        let qc = q_col(g, h);
        for i in 0..s {
            let row = (b * s + i) * g.cols + qc;
            // q was scaled on loading: the chain rule scales dq by it too.
            narrow(&mut dqkv[row..row + d], &dq[i * d..(i + 1) * d], scale);
        }
        for (acc, part) in [(&mut dk_sum, dk), (&mut dv_sum, dv)] {
            for (a, &p) in acc.iter_mut().zip(part) {
                *a += p;
            }
        }
        if h % g.g == g.g - 1 {
            let kc = k_col(g, j);
            for i in 0..s {
                let row = (b * s + i) * g.cols + kc;
                let at = i * d..(i + 1) * d;
                narrow(&mut dqkv[row..row + d], &dk_sum[at.clone()], T::Acc::ONE);
                narrow(&mut dqkv[row + d..row + 2 * d], &dv_sum[at], T::Acc::ONE);
            }
        }
    }
}

/// The (query head, sample) pairs in the order the kernels visit them: per KV head and
/// sample, its query heads one after another (their K and V loaded once).
fn head_order(g: &Dims) -> impl Iterator<Item = (usize, usize)> + '_ {
    (0..g.kv_heads)
        .flat_map(move |j| (0..g.batch).flat_map(move |b| (0..g.g).map(move |i| (j * g.g + i, b))))
}

/// `x ← exp(x − shift)` over a row of scores, in the compute type.
pub(super) trait ExpShifted: AccFloat {
    fn exp_shifted(xs: &mut [Self], shift: Self);
}

impl ExpShifted for f64 {
    fn exp_shifted(xs: &mut [f64], shift: f64) {
        for x in xs {
            *x = (*x - shift).exp();
        }
    }
}

impl ExpShifted for f32 {
    fn exp_shifted(xs: &mut [f32], shift: f32) {
        // Branch-free, so this loop vectorizes; summing is left to the caller (an ordered
        // f32 sum would keep the compiler from vectorizing it).
        for x in xs {
            *x = exp_f32(*x - shift);
        }
    }
}

/// A read-only `[rows, cols]` operand whose element `(r, c)` is `data[r·rs + c·cs]`.
#[derive(Clone, Copy)]
pub(super) struct Mat<'a, A> {
    data: &'a [A],
    rows: usize,
    cols: usize,
    rs: usize,
    cs: usize,
}

impl<'a, A> Mat<'a, A> {
    /// Row-major `[rows, cols]` over `data`.
    fn new(data: &'a [A], rows: usize, cols: usize) -> Self {
        Mat {
            data,
            rows,
            cols,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose (a stride swap).
    fn t(self) -> Self {
        Mat {
            rows: self.cols,
            cols: self.rows,
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Panics unless every element the strides address lies in `data`.
    fn check(&self) {
        if self.rows > 0 && self.cols > 0 {
            let last = (self.rows - 1) * self.rs + (self.cols - 1) * self.cs;
            assert!(last < self.data.len(), "operand out of bounds");
        }
    }
}

/// `dst = a·b` (`add = false`) or `dst += a·b`, `dst` row-major `[a.rows, b.cols]` with row
/// stride `ld`, through `gemm` on the calling thread.
pub(super) fn matmul<A: AccFloat>(
    dst: &mut [A],
    ld: usize,
    a: Mat<'_, A>,
    b: Mat<'_, A>,
    add: bool,
) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    assert_eq!(k, b.rows, "inner dims");
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        n <= ld && (m - 1) * ld + n <= dst.len(),
        "dst out of bounds"
    );
    if k == 0 {
        if !add {
            for r in 0..m {
                dst[r * ld..r * ld + n].fill(A::ZERO);
            }
        }
        return;
    }
    a.check();
    b.check();
    // SAFETY: the asserts above keep every element gemm addresses through these strides
    // (all non-negative) inside `dst`, `a.data` and `b.data`; `dst` is a unique borrow, so
    // it cannot alias the operands. gemm computes `dst = alpha·dst + 1·a·b` and reads `dst`
    // only when `add`. The `gemm` crate's entry point is raw-pointer based, hence `unsafe`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ld as isize,
            add,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            A::ONE,
            A::ONE,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

#[cfg(test)]
mod tests {
    use crate::spec::float::exp_f32;

    #[test]
    fn exp_f32_is_within_two_ulp() {
        // Every 97th f32 in [-87.3, 88), negative and positive: relative error against f64
        // (under Miri, which interprets every operation, a few hundred of them).
        let step = if cfg!(miri) { 9_700_019 } else { 97 };
        let neg = (0x8000_0000..=(-87.3f32).to_bits()).step_by(step);
        let pos = (0..88.0f32.to_bits()).step_by(step);
        let worst = neg
            .chain(pos)
            .map(f32::from_bits)
            .map(|x| {
                let want = (x as f64).exp();
                ((exp_f32(x) as f64 - want) / want).abs()
            })
            .fold(0.0f64, f64::max);
        eprintln!("exp_f32: worst relative error {worst:e}");
        assert!(
            worst < 2.0 * f32::EPSILON as f64,
            "worst relative error {worst:e}"
        );
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(-1000.0) < 1.2e-38 && exp_f32(-1000.0) >= 0.0);
        assert!(exp_f32(f32::NEG_INFINITY) < 1.2e-38);
    }
}
