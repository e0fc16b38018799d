//! Compute ops on [`DTensor<L>`]: each runs its local kernel on every rank and returns a
//! tensor whose layout the *type system* derived from the operands' layouts, one mesh axis
//! at a time (the rule tables of [`dtensor_placement::rules`]). A pair of placements with no
//! rule does not compile; nothing redistributes implicitly.
//!
//! | op | layouts (per axis, see the rules) | communication |
//! |---|---|---|
//! | [`matmul`](DTensor::matmul), [`matmul_t`](DTensor::matmul_t), [`bmm`](DTensor::bmm) | [`MatmulRule`](dtensor_placement::MatmulRule) and twins | none |
//! | [`mul`](DTensor::mul), [`div`](DTensor::div) | one `Partial` factor at most | none |
//! | [`sub`](DTensor::sub) | as `add` | none |
//! | [`silu`](DTensor::silu), [`swiglu`](DTensor::swiglu) (and `gelu`) | no `Partial` | none |
//! | [`add_row`](DTensor::add_row), [`mul_row`](DTensor::mul_row) | bias / scale broadcast along the rows | none |
//! | [`sum_dim`](DTensor::sum_dim), [`mean_dim`](DTensor::mean_dim), [`max_dim`](DTensor::max_dim) | a sharded reduced dim gives `Partial` | none |
//! | [`softmax`](DTensor::softmax), [`log_softmax`](DTensor::log_softmax) | the dim whole, no `Partial` | none |
//! | [`rms_norm`](DTensor::rms_norm), [`layer_norm`](DTensor::layer_norm) | rows sharded with a `Replicate` weight, or both whole | none |
//! | [`embedding`](DTensor::embedding) | a vocab-sharded table gives `Partial` (masked lookup) | none |
//! | [`cross_entropy`](DTensor::cross_entropy) | vocab-sharded logits give an `Invariant` loss | 3 all-reduces of `[tokens]` per vocab-sharded axis |
//! | [`causal_attention`](DTensor::causal_attention) | samples or heads split, no `Partial`; not `Shard<0>` on a `Cp`-role axis | none |
//! | [`context_attention`](DTensor::context_attention) ([`context`](crate::context)) | `Shard<0>` on its `Cp` axis, the attention rule elsewhere | ring send/recv or two all-to-alls over `Cp` |
//! | [`rope`](DTensor::rope) ([`rope`](mod@crate::rope)) | rows split (positions from the global row: sequential, CP order, explicit), heads split, whole, or `Partial`; no `Ragged` | none |
//! | [`t`](DTensor::t) | `Shard<0>` ↔ `Shard<1>` | none |
//! | [`split_dim`](DTensor::split_dim), [`merge_dims`](DTensor::merge_dims) | `Shard<e>` moves with the dims (even shards of a reshaped dim) | none |
//!
//! Shapes stay run-time values: every op checks them and returns an `Err` naming itself,
//! the shapes and the placements. The result is wrapped only after its local shape was
//! checked against the derived layout, so a rule and its kernel cannot disagree silently.

use crate::any::AnyDTensor;
use crate::error::{Error, Result};
use crate::typed::DTensor;
use dtensor_collectives::ReduceOp;
use dtensor_kernels::ops::{self, CausalAttention, CausalAttentionOutput, Transpose, VocabShard};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{
    local_ranges, AddLayout, AddRowLayout, AttentionLayout, BatchedMatmulLayout, BatchedMatmulOut,
    CrossEntropyLayout, CrossEntropyOut, DivLayout, DivOut, EmbeddingLayout, EmbeddingOut, Layout,
    MatmulLayout, MatmulOut, MatmulTLayout, MatmulTOut, MaxLayout, MaxOut, MeanLayout, MeanOut,
    MergeLayout, MergeOut, MulLayout, MulOut, MulRowLayout, MulRowOut, NormLayout, NotSplitLayout,
    Placement, PointwiseLayout, SameAs, SplitLayout, SplitOut, SumLayout, SumOut, TransposeLayout,
    Transposed,
};

fn fmt_placements(p: &[Placement]) -> String {
    let v: Vec<String> = p.iter().map(|p| p.to_string()).collect();
    format!("[{}]", v.join(", "))
}

fn shape_err(op: &'static str, detail: String) -> Error {
    Error::ShapeMismatch { op, detail }
}

/// Both operands live on the same mesh (the same rank group).
fn same_mesh(op: &'static str, a: &AnyDTensor, b: &AnyDTensor) -> Result<()> {
    let (ma, mb) = (a.device_mesh(), b.device_mesh());
    if std::sync::Arc::ptr_eq(ma, mb) || (ma.mesh() == mb.mesh() && ma.rank() == mb.rank()) {
        Ok(())
    } else {
        Err(Error::MeshMismatch {
            op,
            lhs: ma.mesh().to_string(),
            rhs: mb.mesh().to_string(),
        })
    }
}

fn describe(t: &AnyDTensor) -> String {
    format!(
        "global {:?} (local {:?}) laid out as {}",
        t.global_shape(),
        t.local_shape(),
        fmt_placements(t.placements())
    )
}

fn want_rank(op: &'static str, t: &AnyDTensor, rank: usize, what: &str) -> Result<()> {
    if t.global_shape().len() != rank {
        return Err(shape_err(
            op,
            format!("{what} must be {rank}-D, got {}", describe(t)),
        ));
    }
    Ok(())
}

/// Wraps an op's local result as layout `L`; `Err` if the local shape is not the one `L`
/// gives this rank (a kernel/rule disagreement, or shards that do not line up).
pub(crate) fn output<L: Layout>(
    op: &'static str,
    local: Tensor,
    global: &[usize],
    like: &AnyDTensor,
) -> Result<DTensor<L>> {
    let any = AnyDTensor::from_local_for(op, local, global, &L::placements(), like.device_mesh())?;
    Ok(DTensor::wrap(any))
}

/// Runs `f` on the local values as f64 and rounds the result into `dtype` once.
fn via_f64(t: &Tensor, dtype: DType, f: impl FnOnce(Vec<f64>) -> Vec<f64>) -> Result<Tensor> {
    Ok(Tensor::from_f64_vec(f(t.to_f64_vec()), t.shape(), dtype)?)
}

fn ids_of(op: &'static str, t: &Tensor) -> Result<Vec<usize>> {
    // Ids are read on the host (a few per row); device ids are copied here.
    let t = &t.to_host()?;
    let v: Vec<i64> = match t.dtype() {
        DType::I64 => t.as_slice::<i64>()?.to_vec(),
        DType::I32 => t.as_slice::<i32>()?.iter().map(|&i| i as i64).collect(),
        d => return Err(shape_err(op, format!("ids must be i64 or i32, got {d}"))),
    };
    // A negative id becomes out of range, which the callers reject.
    Ok(v.into_iter()
        .map(|i| usize::try_from(i).unwrap_or(usize::MAX))
        .collect())
}

/// The rows of dim `dim` of the global tensor this rank holds.
pub(crate) fn local_range(t: &AnyDTensor, dim: usize) -> Result<std::ops::Range<usize>> {
    let m = t.device_mesh();
    Ok(local_ranges(m.mesh(), t.placements(), m.coords(), t.global_shape())?[dim].clone())
}

impl<L: Layout> DTensor<L> {
    /// `A[m,k]·B[k,n]`; the output layout follows [`MatmulRule`](dtensor_placement::MatmulRule)
    /// on every axis (a contraction sharded on both sides gives `Partial`).
    pub fn matmul<LB: MatmulLayout<L>>(
        &self,
        b: &DTensor<LB>,
    ) -> Result<DTensor<MatmulOut<L, LB>>> {
        self.product("DTensor::matmul", b.as_any(), Transpose::No)
    }

    /// `A[m,k]·W[n,k]ᵀ` (a linear layer's `[out, in]` weight, no copy of `W`); the output
    /// layout follows [`MatmulTRule`](dtensor_placement::MatmulTRule).
    pub fn matmul_t<LW: MatmulTLayout<L>>(
        &self,
        w: &DTensor<LW>,
    ) -> Result<DTensor<MatmulTOut<L, LW>>> {
        self.product("DTensor::matmul_t", w.as_any(), Transpose::Yes)
    }

    /// `A[b,m,k]·B[b,k,n]`, batch by batch; the output layout follows
    /// [`BatchedMatmulRule`](dtensor_placement::BatchedMatmulRule).
    pub fn bmm<LB: BatchedMatmulLayout<L>>(
        &self,
        b: &DTensor<LB>,
    ) -> Result<DTensor<BatchedMatmulOut<L, LB>>> {
        const OP: &str = "DTensor::bmm";
        let (a, bb) = (self.as_any(), b.as_any());
        same_mesh(OP, a, bb)?;
        want_rank(OP, a, 3, "the left operand")?;
        want_rank(OP, bb, 3, "the right operand")?;
        let (ga, gb) = (a.global_shape(), bb.global_shape());
        if ga[0] != gb[0] || ga[2] != gb[1] || a.local_shape()[2] != bb.local_shape()[1] {
            return Err(shape_err(
                OP,
                format!(
                    "{} · {}: batch or contraction dims differ",
                    describe(a),
                    describe(bb)
                ),
            ));
        }
        let local = ops::matmul(a.as_local(), Transpose::No, bb.as_local(), Transpose::No)?;
        output(OP, local, &[ga[0], ga[1], gb[2]], a)
    }

    fn product<Out: Layout>(
        &self,
        op: &'static str,
        b: &AnyDTensor,
        tb: Transpose,
    ) -> Result<DTensor<Out>> {
        let a = self.as_any();
        same_mesh(op, a, b)?;
        want_rank(op, a, 2, "the left operand")?;
        want_rank(op, b, 2, "the right operand")?;
        let (ga, gb) = (a.global_shape(), b.global_shape());
        let (kb_dim, n_dim) = match tb {
            Transpose::No => (0, 1),
            Transpose::Yes => (1, 0),
        };
        if ga[1] != gb[kb_dim] || a.local_shape()[1] != b.local_shape()[kb_dim] {
            return Err(shape_err(
                op,
                format!(
                    "{} · {}{}: the contracted dims differ",
                    describe(a),
                    describe(b),
                    if tb == Transpose::Yes { "ᵀ" } else { "" }
                ),
            ));
        }
        let local = ops::matmul(a.as_local(), Transpose::No, b.as_local(), tb)?;
        output(op, local, &[ga[0], gb[n_dim]], a)
    }

    /// Fused causal self-attention with RoPE over a `[tokens, heads·3·d]` QKV (per head: q,
    /// k, v columns together; tokens are samples of `cfg.seq_len` one after another) into
    /// `[tokens, heads·d]`, laid out as the input: a rank holds whole samples and whole heads
    /// (both checked here), so the attention is local.
    pub fn causal_attention(&self, cfg: &CausalAttention) -> Result<DTensor<L>>
    where
        L: AttentionLayout,
    {
        Ok(attention_parts(self, cfg)?.0)
    }

    /// Dim `D` (extent `n`) split into `(n / inner, inner)`: `[tokens, heads·d]` →
    /// `[tokens, heads, d]`, say. A sharded `D` shards the leading part, which must split
    /// evenly over its ranks (`torch.chunk` of the two shapes differs otherwise): checked.
    pub fn split_dim<const D: usize>(&self, inner: usize) -> Result<DTensor<SplitOut<L, D>>>
    where
        L: SplitLayout<D>,
    {
        const OP: &str = "DTensor::split_dim";
        let a = self.as_any();
        check_dim(OP, a, D)?;
        let n = a.global_shape()[D];
        if inner == 0 || !n.is_multiple_of(inner) {
            return Err(shape_err(
                OP,
                format!(
                    "dim {D} of {} does not split into pieces of {inner}",
                    describe(a)
                ),
            ));
        }
        let outer = n / inner;
        even_over_shards(OP, a, D, outer)?;
        let split = |shape: &[usize], lead: usize| -> Vec<usize> {
            let mut v = shape.to_vec();
            v.splice(D..=D, [lead, inner]);
            v
        };
        let local_lead = a.local_shape()[D] / inner;
        let local = a
            .as_local()
            .clone()
            .reshape(&split(a.local_shape(), local_lead))?;
        output(OP, local, &split(a.global_shape(), outer), a)
    }

    /// Dims `D` and `D + 1` merged into one: `[samples, seq, hidden]` → `[tokens, hidden]`.
    /// A sharded `D` must be split evenly over its ranks (checked); a sharded `D + 1` does
    /// not compile.
    pub fn merge_dims<const D: usize>(&self) -> Result<DTensor<MergeOut<L, D>>>
    where
        L: MergeLayout<D>,
    {
        const OP: &str = "DTensor::merge_dims";
        let a = self.as_any();
        check_dim(OP, a, D + 1)?;
        even_over_shards(OP, a, D, a.global_shape()[D])?;
        let merge = |shape: &[usize]| -> Vec<usize> {
            let mut v = shape.to_vec();
            let m = v[D] * v[D + 1];
            v.splice(D..=D + 1, [m]);
            v
        };
        let local = a.as_local().clone().reshape(&merge(a.local_shape()))?;
        output(OP, local, &merge(a.global_shape()), a)
    }

    /// The transpose of a 2-D tensor: `Shard<0>` and `Shard<1>` swap.
    pub fn t(&self) -> Result<DTensor<Transposed<L>>>
    where
        L: TransposeLayout,
    {
        const OP: &str = "DTensor::t";
        let a = self.as_any();
        want_rank(OP, a, 2, "the tensor")?;
        let (r, c) = (a.local_shape()[0], a.local_shape()[1]);
        let _ = (r, c);
        let local = transpose_local(a.as_local())?;
        let g = a.global_shape();
        output(OP, local, &[g[1], g[0]], a)
    }

    /// Elementwise difference; the layouts follow the same rule as [`add`](Self::add).
    pub fn sub<M>(&self, other: &DTensor<M>) -> Result<DTensor<L>>
    where
        M: Layout + AddLayout<L>,
    {
        const OP: &str = "DTensor::sub";
        let (a, b) = (self.as_any(), other.as_any());
        same_mesh(OP, a, b)?;
        same_shape(OP, a, b)?;
        output(
            OP,
            ops::sub(a.as_local(), b.as_local())?,
            a.global_shape(),
            a,
        )
    }

    /// Elementwise product; per axis equal placements, or one `Partial<Sum>` factor with a
    /// `Replicate` one.
    pub fn mul<M: MulLayout<L>>(&self, other: &DTensor<M>) -> Result<DTensor<MulOut<L, M>>> {
        const OP: &str = "DTensor::mul";
        let (a, b) = (self.as_any(), other.as_any());
        same_mesh(OP, a, b)?;
        same_shape(OP, a, b)?;
        output(OP, a.as_local().mul(b.as_local())?, a.global_shape(), a)
    }

    /// Elementwise quotient; per axis equal placements, or a `Partial<Sum>` numerator over a
    /// `Replicate` divisor. Computed in f64 and rounded once.
    pub fn div<M: DivLayout<L>>(&self, other: &DTensor<M>) -> Result<DTensor<DivOut<L, M>>> {
        const OP: &str = "DTensor::div";
        let (a, b) = (self.as_any(), other.as_any());
        same_mesh(OP, a, b)?;
        same_shape(OP, a, b)?;
        if a.dtype() != b.dtype() {
            return Err(shape_err(
                OP,
                format!("dtypes {} and {}", a.dtype(), b.dtype()),
            ));
        }
        let den = b.as_local().to_f64_vec();
        let local = via_f64(a.as_local(), a.dtype(), |mut v| {
            v.iter_mut().zip(&den).for_each(|(x, d)| *x /= d);
            v
        })?;
        output(OP, local, a.global_shape(), a)
    }

    /// SiLU `x·σ(x)`; no axis may be `Partial`.
    pub fn silu(&self) -> Result<DTensor<L>>
    where
        L: PointwiseLayout,
    {
        let a = self.as_any();
        output(
            "DTensor::silu",
            ops::silu(a.as_local())?,
            a.global_shape(),
            a,
        )
    }

    /// SwiGLU `silu(gate)⊙up` (`self` is the gate); both laid out alike, no `Partial`.
    pub fn swiglu<M: SameAs<L>>(&self, up: &DTensor<M>) -> Result<DTensor<L>>
    where
        L: PointwiseLayout,
    {
        const OP: &str = "DTensor::swiglu";
        let (a, b) = (self.as_any(), up.as_any());
        same_mesh(OP, a, b)?;
        same_shape(OP, a, b)?;
        output(
            OP,
            ops::swiglu(a.as_local(), b.as_local())?,
            a.global_shape(),
            a,
        )
    }

    /// `x[r,c] + bias[c]`, the bias broadcast along the rows: rows sharded take a
    /// `Replicate` bias, columns sharded a bias sharded alike.
    pub fn add_row<LB: AddRowLayout<L>>(&self, bias: &DTensor<LB>) -> Result<DTensor<L>> {
        const OP: &str = "DTensor::add_row";
        let (x, b) = (self.as_any(), bias.as_any());
        same_mesh(OP, x, b)?;
        want_rank(OP, x, 2, "the rows")?;
        want_rank(OP, b, 1, "the bias")?;
        if x.global_shape()[1] != b.global_shape()[0] || x.local_shape()[1] != b.local_shape()[0] {
            return Err(shape_err(
                OP,
                format!("rows {} + bias {}: widths differ", describe(x), describe(b)),
            ));
        }
        output(
            OP,
            ops::add_row(x.as_local(), b.as_local())?,
            x.global_shape(),
            x,
        )
    }

    /// `x[r,c] · w[c]`, a per-feature scale broadcast along the rows: rows sharded take a
    /// `Replicate` scale, columns sharded a scale sharded alike; one `Partial` factor at most.
    pub fn mul_row<LW: MulRowLayout<L>>(
        &self,
        w: &DTensor<LW>,
    ) -> Result<DTensor<MulRowOut<L, LW>>> {
        const OP: &str = "DTensor::mul_row";
        let (x, s) = (self.as_any(), w.as_any());
        same_mesh(OP, x, s)?;
        want_rank(OP, x, 2, "the rows")?;
        want_rank(OP, s, 1, "the scale")?;
        if x.global_shape()[1] != s.global_shape()[0] || x.local_shape()[1] != s.local_shape()[0] {
            return Err(shape_err(
                OP,
                format!(
                    "rows {} · scale {}: widths differ",
                    describe(x),
                    describe(s)
                ),
            ));
        }
        output(
            OP,
            ops::mul_row(x.as_local(), s.as_local())?,
            x.global_shape(),
            x,
        )
    }

    /// The sum over dim `D` (the dim disappears). A sharded `D` gives `Partial<Sum>`.
    pub fn sum_dim<const D: usize>(&self) -> Result<DTensor<SumOut<L, D>>>
    where
        L: SumLayout<D>,
    {
        const OP: &str = "DTensor::sum_dim";
        let a = self.as_any();
        check_dim(OP, a, D)?;
        output(
            OP,
            ops::sum_dim(a.as_local(), D)?,
            &without_dim(a.global_shape(), D),
            a,
        )
    }

    /// The mean over dim `D`. A sharded `D` gives `Partial<Avg>`, exact only when every
    /// rank holds as many rows of `D` as the others: uneven shards are an `Err`.
    pub fn mean_dim<const D: usize>(&self) -> Result<DTensor<MeanOut<L, D>>>
    where
        L: MeanLayout<D>,
    {
        const OP: &str = "DTensor::mean_dim";
        let a = self.as_any();
        check_dim(OP, a, D)?;
        let parts = shard_parts(a, D);
        let (g, l) = (a.global_shape()[D], a.local_shape()[D]);
        if l == 0 || l * parts != g {
            return Err(shape_err(
                OP,
                format!(
                    "dim {D} of {} is not split evenly over {parts} ranks: the average of the ranks' means would be biased",
                    describe(a)
                ),
            ));
        }
        let sum = ops::sum_dim(a.as_local(), D)?;
        output(
            OP,
            sum.scale(1.0 / l as f64),
            &without_dim(a.global_shape(), D),
            a,
        )
    }

    /// The max over dim `D`. A sharded `D` gives `Partial<Max>` (a rank whose shard is empty
    /// contributes `-inf`).
    pub fn max_dim<const D: usize>(&self) -> Result<DTensor<MaxOut<L, D>>>
    where
        L: MaxLayout<D>,
    {
        const OP: &str = "DTensor::max_dim";
        let a = self.as_any();
        check_dim(OP, a, D)?;
        let out_shape = without_dim(a.local_shape(), D);
        let local = if a.local_shape()[D] == 0 {
            let empty = Tensor::zeros(&out_shape, a.dtype()).map(|_| f64::NEG_INFINITY);
            crate::any::to_mesh_place(empty, a.device_mesh())?
        } else {
            ops::max_dim(a.as_local(), D)?.values
        };
        output(OP, local, &without_dim(a.global_shape(), D), a)
    }

    /// Softmax over dim `D`, which must be the last dim, whole on every rank.
    pub fn softmax<const D: usize>(&self) -> Result<DTensor<L>>
    where
        L: NotSplitLayout<D>,
    {
        const OP: &str = "DTensor::softmax";
        let a = self.as_any();
        check_last(OP, a, D)?;
        output(OP, ops::softmax(a.as_local())?, a.global_shape(), a)
    }

    /// Log-softmax over dim `D`, which must be the last dim, whole on every rank.
    pub fn log_softmax<const D: usize>(&self) -> Result<DTensor<L>>
    where
        L: NotSplitLayout<D>,
    {
        const OP: &str = "DTensor::log_softmax";
        let a = self.as_any();
        check_last(OP, a, D)?;
        output(OP, ops::log_softmax(a.as_local())?, a.global_shape(), a)
    }

    /// RMSNorm over dim `D` (the last), times `weight[D]`. Rows may be sharded (the weight
    /// is then `Replicate`: each rank normalizes its own rows), or both whole.
    pub fn rms_norm<const D: usize, LW: NormLayout<L, D>>(
        &self,
        weight: &DTensor<LW>,
        eps: f64,
    ) -> Result<DTensor<L>> {
        const OP: &str = "DTensor::rms_norm";
        let (x, w) = (self.as_any(), weight.as_any());
        check_norm(OP, x, w, D)?;
        output(
            OP,
            ops::rms_norm(x.as_local(), w.as_local(), eps)?.y,
            x.global_shape(),
            x,
        )
    }

    /// LayerNorm over dim `D` (the last), with `weight[D]` and `bias[D]` laid out alike.
    pub fn layer_norm<const D: usize, LW: NormLayout<L, D>>(
        &self,
        weight: &DTensor<LW>,
        bias: &DTensor<LW>,
        eps: f64,
    ) -> Result<DTensor<L>> {
        const OP: &str = "DTensor::layer_norm";
        let (x, w, b) = (self.as_any(), weight.as_any(), bias.as_any());
        check_norm(OP, x, w, D)?;
        check_norm(OP, x, b, D)?;
        let y = ops::layer_norm(x.as_local(), w.as_local(), b.as_local(), eps)?.y;
        output(OP, y, x.global_shape(), x)
    }

    /// `self[ids]`: rows of a `[vocab, hidden]` table for `[tokens]` ids. A table sharded
    /// over its vocab gives `Partial` (each rank looks up the ids it holds, zeros for the
    /// rest: Megatron's masked lookup).
    pub fn embedding<LI: EmbeddingLayout<L>>(
        &self,
        ids: &DTensor<LI>,
    ) -> Result<DTensor<EmbeddingOut<L, LI>>> {
        const OP: &str = "DTensor::embedding";
        let (t, i) = (self.as_any(), ids.as_any());
        same_mesh(OP, t, i)?;
        want_rank(OP, t, 2, "the table")?;
        want_rank(OP, i, 1, "the ids")?;
        let vocab = t.global_shape()[0];
        let rows = local_range(t, 0)?;
        let shard = VocabShard {
            start: rows.start,
            len: rows.len(),
            vocab,
        };
        let local = ops::embedding_masked(t.as_local(), i.as_local(), shard)?;
        output(OP, local, &[i.global_shape()[0], t.global_shape()[1]], t)
    }

    /// Per-token cross-entropy of `[tokens, vocab]` logits against `[tokens]` targets
    /// (`i64`/`i32`). Logits sharded over their vocab on an axis give an `Invariant` loss
    /// there: the row max, the sum of exponentials and the target's logit are all-reduced
    /// over that axis (`[tokens]` each, no logits gather). Computed in f64.
    pub fn cross_entropy<LT: CrossEntropyLayout<L>>(
        &self,
        targets: &DTensor<LT>,
    ) -> Result<DTensor<CrossEntropyOut<L, LT>>> {
        Ok(cross_entropy_parts(self, targets)?.0)
    }
}

/// What cross-entropy's backward needs from its forward.
pub(crate) enum CrossEntropySaved {
    /// Host logits: the probabilities of this rank's logits (normalized by the global max
    /// and sum) and each row's target column, if this rank holds it.
    Host {
        probs: Vec<f64>,
        target_col: Vec<Option<usize>>,
    },
    /// Device logits: the reduced row max and `Σ exp` (f64 `[rows]`, on the device), the
    /// targets (host), and where this rank's vocab columns start; the device kernel
    /// recomputes the probabilities from them.
    #[cfg(feature = "cuda")]
    Device {
        max: dtensor_kernels::cuda::CudaTensor,
        sum: dtensor_kernels::cuda::CudaTensor,
        ids: Tensor,
        col_start: usize,
        vocab: usize,
    },
}

/// Cross-entropy's forward, with what its backward needs ([`CrossEntropySaved`]).
pub(crate) fn cross_entropy_parts<L: Layout, LT: CrossEntropyLayout<L>>(
    logits: &DTensor<L>,
    targets: &DTensor<LT>,
) -> Result<(DTensor<CrossEntropyOut<L, LT>>, CrossEntropySaved)> {
    const OP: &str = "DTensor::cross_entropy";
    let (lg, tg) = (logits.as_any(), targets.as_any());
    same_mesh(OP, lg, tg)?;
    want_rank(OP, lg, 2, "the logits")?;
    want_rank(OP, tg, 1, "the targets")?;
    let vocab = lg.global_shape()[1];
    let (rows, cols) = (lg.local_shape()[0], lg.local_shape()[1]);
    let ids = ids_of(OP, tg.as_local())?;
    if ids.len() != rows || ids.iter().any(|&i| i >= vocab) {
        return Err(shape_err(
            OP,
            format!(
                "{} targets (each < {vocab}) for logits {}",
                ids.len(),
                describe(lg)
            ),
        ));
    }
    // The axes that split the vocab: the max, the sum and the target logit are reduced
    // over them (the same axes on every rank: they come from the type).
    let vocab_axes: Vec<usize> = lg
        .placements()
        .iter()
        .enumerate()
        .filter(|(_, p)| p.shard_dim() == Some(1))
        .map(|(a, _)| a)
        .collect();
    let all_reduce = |v: &mut Vec<f64>, op: ReduceOp| -> Result<()> {
        for &a in &vocab_axes {
            crate::transfer::all_reduce_values(&**lg.device_mesh().axis_comm(a), v, op)?;
        }
        Ok(())
    };
    let cols_here = local_range(lg, 1)?;
    #[cfg(feature = "cuda")]
    if lg.as_local().is_cuda() {
        // The device kernels in the host's order: row max, all-reduce (Max); Σ exp and the
        // target's logit, all-reduce (Sum) each; the loss. Only the ids are read on the host.
        use dtensor_kernels::cuda::{ops as cu, CudaTensor};
        let reduce = |t: CudaTensor, op: ReduceOp| -> Result<CudaTensor> {
            let mut t = Tensor::from(t);
            for &a in &vocab_axes {
                crate::transfer::all_reduce(&**lg.device_mesh().axis_comm(a), &mut t, op)?;
            }
            Ok(t.cuda_tensor()?)
        };
        let ids = tg.as_local().to_host()?;
        let x = lg.as_local().cuda_tensor()?;
        let max = reduce(cu::ce_row_max(&x)?, ReduceOp::Max)?;
        let (sum, target) = cu::ce_sum_target(&x, &max, &ids, cols_here.start, vocab)?;
        let sum = reduce(sum, ReduceOp::Sum)?;
        let target = reduce(target, ReduceOp::Sum)?;
        let loss = Tensor::from(cu::ce_loss(&sum, &target, lg.dtype())?);
        return Ok((
            output(OP, loss, &[lg.global_shape()[0]], lg)?,
            CrossEntropySaved::Device {
                max,
                sum,
                ids,
                col_start: cols_here.start,
                vocab,
            },
        ));
    }
    let l = lg.as_local().to_f64_vec();
    let mut max: Vec<f64> = (0..rows)
        .map(|r| {
            l[r * cols..(r + 1) * cols]
                .iter()
                .fold(f64::NEG_INFINITY, |m, &x| m.max(x))
        })
        .collect();
    all_reduce(&mut max, ReduceOp::Max)?;
    let mut probs = vec![0.0; rows * cols];
    let mut sum = vec![0.0; rows];
    let mut target = vec![0.0; rows];
    let mut target_col = vec![None; rows];
    for r in 0..rows {
        for c in 0..cols {
            let e = (l[r * cols + c] - max[r]).exp();
            probs[r * cols + c] = e;
            sum[r] += e;
        }
        if cols_here.contains(&ids[r]) {
            let c = ids[r] - cols_here.start;
            target_col[r] = Some(c);
            target[r] = l[r * cols + c] - max[r];
        }
    }
    all_reduce(&mut sum, ReduceOp::Sum)?;
    all_reduce(&mut target, ReduceOp::Sum)?;
    for r in 0..rows {
        probs[r * cols..(r + 1) * cols]
            .iter_mut()
            .for_each(|p| *p /= sum[r]);
    }
    let loss: Vec<f64> = (0..rows).map(|r| sum[r].ln() - target[r]).collect();
    let local = Tensor::from_f64_vec(loss, &[rows], lg.dtype())?;
    Ok((
        output(OP, local, &[lg.global_shape()[0]], lg)?,
        CrossEntropySaved::Host { probs, target_col },
    ))
}

fn same_shape(op: &'static str, a: &AnyDTensor, b: &AnyDTensor) -> Result<()> {
    if a.global_shape() != b.global_shape() || a.local_shape() != b.local_shape() {
        return Err(shape_err(
            op,
            format!("{} and {}: shapes differ", describe(a), describe(b)),
        ));
    }
    Ok(())
}

/// How many pieces dim `d` is cut into: the product of the sizes of the axes that shard it.
fn shard_parts(a: &AnyDTensor, d: usize) -> usize {
    a.placements()
        .iter()
        .enumerate()
        .filter(|(_, p)| p.shard_dim() == Some(d))
        .map(|(i, _)| a.device_mesh().mesh().size(i))
        .product()
}

/// `extent` (of dim `d`, or its leading part) divides evenly over the ranks of every axis
/// that shards `d`, so `torch.chunk` of the reshaped dim gives the same rows.
fn even_over_shards(op: &'static str, a: &AnyDTensor, d: usize, extent: usize) -> Result<()> {
    let parts = shard_parts(a, d);
    if !extent.is_multiple_of(parts) {
        return Err(shape_err(
            op,
            format!("dim {d} of {}: {extent} rows do not split evenly over {parts} ranks, so the reshaped shards would hold other rows", describe(a)),
        ));
    }
    Ok(())
}

fn check_dim(op: &'static str, a: &AnyDTensor, d: usize) -> Result<()> {
    if d >= a.global_shape().len() {
        return Err(shape_err(op, format!("dim {d} of {}", describe(a))));
    }
    Ok(())
}

fn check_last(op: &'static str, a: &AnyDTensor, d: usize) -> Result<()> {
    if a.global_shape().len() != d + 1 {
        return Err(shape_err(
            op,
            format!("dim {d} must be the last dim of {}", describe(a)),
        ));
    }
    Ok(())
}

fn check_norm(op: &'static str, x: &AnyDTensor, w: &AnyDTensor, d: usize) -> Result<()> {
    same_mesh(op, x, w)?;
    check_last(op, x, d)?;
    if w.global_shape() != [x.global_shape()[d]] || w.local_shape() != [x.local_shape()[d]] {
        return Err(shape_err(
            op,
            format!("weight {} for input {}", describe(w), describe(x)),
        ));
    }
    Ok(())
}

pub(crate) fn without_dim(shape: &[usize], d: usize) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != d)
        .map(|(_, &s)| s)
        .collect()
}

/// A `[r, c]` tensor's transpose `[c, r]`, any dtype, bit for bit.
pub(crate) fn transpose_local(t: &Tensor) -> Result<Tensor> {
    let (r, c) = (t.shape()[0], t.shape()[1]);
    if t.is_cuda() {
        // On a device: the columns packed one after another (the `pack` kernel copies, bit
        // for bit) are the rows of the transpose.
        return Ok(t.pack(1, &vec![1; c])?.reshape(&[c, r])?);
    }
    macro_rules! tr {
        ($T:ty) => {{
            let s = t.as_slice::<$T>()?;
            let v: Vec<$T> = (0..r * c).map(|i| s[(i % r) * c + i / r]).collect();
            Tensor::from_vec(v, &[c, r])?
        }};
    }
    Ok(match t.dtype() {
        DType::F32 => tr!(f32),
        DType::F64 => tr!(f64),
        DType::BF16 => tr!(half::bf16),
        DType::F16 => tr!(half::f16),
        DType::I32 => tr!(i32),
        DType::I64 => tr!(i64),
    })
}

/// Attention's forward with the kernel's saved statistics (the output and the per-row
/// log-sum-exp its backward needs).
pub(crate) fn attention_parts<L: Layout>(
    x: &DTensor<L>,
    cfg: &CausalAttention,
) -> Result<(DTensor<L>, CausalAttentionOutput)> {
    const OP: &str = "DTensor::causal_attention";
    let a = x.as_any();
    want_rank(OP, a, 2, "the QKV")?;
    let (rows, cols) = (a.local_shape()[0], a.local_shape()[1]);
    let d3 = 3 * cfg.head_dim;
    if cfg.seq_len == 0 || rows % cfg.seq_len != 0 || d3 == 0 || cols % d3 != 0 {
        return Err(shape_err(
            OP,
            format!(
                "{}: this rank's {rows} tokens × {cols} columns are not whole samples of {} tokens and whole heads of 3·{} columns (make the batch divisible by the data ranks, the heads by the tensor ranks)",
                describe(a),
                cfg.seq_len,
                cfg.head_dim
            ),
        ));
    }
    let saved = ops::causal_attention(a.as_local(), cfg)?;
    let global = [a.global_shape()[0], a.global_shape()[1] / 3];
    let y = output(OP, saved.out.clone(), &global, a)?;
    Ok((y, saved))
}
