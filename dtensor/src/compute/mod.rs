//! Compute ops on [`DTensor<L>`]: each runs its local kernel on every rank and returns a
//! tensor whose layout the *type system* derived from the operands' layouts, one mesh axis
//! at a time (the rule tables of [`dtensor_placement::rules`]). A pair of placements with no
//! rule does not compile; nothing redistributes implicitly.
//!
//! | op | layouts (per axis, see the rules) | communication |
//! |---|---|---|
//! | [`matmul`](DTensor::matmul), [`matmul_t`](DTensor::matmul_t), [`bmm`](DTensor::bmm) | [`MatmulRule`](dtensor_placement::MatmulRule) and twins | none |
//! | [`add`](DTensor::add), [`sub`](DTensor::sub) | equal layouts (a `Partial` only with the same reduction) | none |
//! | [`mul`](DTensor::mul), [`div`](DTensor::div) | one `Partial` factor at most | none |
//! | [`scale`](DTensor::scale), [`to_dtype`](DTensor::to_dtype) | any (`scale` is linear: `Partial` sum/avg too) | none |
//! | [`gelu`](DTensor::gelu), [`silu`](DTensor::silu), [`swiglu`](DTensor::swiglu), [`map`](DTensor::map) | no `Partial` | none |
//! | [`add_row`](DTensor::add_row), [`mul_row`](DTensor::mul_row) | bias / scale broadcast along the rows | none |
//! | [`sum_dim`](DTensor::sum_dim), [`mean_dim`](DTensor::mean_dim), [`max_dim`](DTensor::max_dim) | a sharded reduced dim gives `Partial` | none |
//! | [`softmax`](DTensor::softmax), [`log_softmax`](DTensor::log_softmax) | the dim whole, no `Partial` | none |
//! | [`rms_norm`](DTensor::rms_norm), [`layer_norm`](DTensor::layer_norm) | rows sharded with a `Replicate` weight, or both whole | none |
//! | [`embedding`](DTensor::embedding) | a vocab-sharded table gives `Partial` (masked lookup) | none |
//! | [`cross_entropy`](DTensor::cross_entropy), [`cross_entropy_ignoring`](DTensor::cross_entropy_ignoring) (an ignore index: loss 0, gradient 0), [`cross_entropy_with`](DTensor::cross_entropy_with) ([`CrossEntropy`] options: ignore index, z-loss) | vocab-sharded logits give an `Invariant` loss | 3 all-reduces of `[tokens]` per vocab-sharded axis |
//! | [`causal_attention`](DTensor::causal_attention), [`causal_attention_masked`](DTensor::causal_attention_masked), [`attention_over_cache`](DTensor::attention_over_cache) | samples or heads split, no `Partial`; not `Shard<0>` on a `Cp`-role axis | none |
//! | [`context_attention`](DTensor::context_attention) ([`context`](crate::context)) | `Shard<0>` on its `Cp` axis, the attention rule elsewhere | ring send/recv or two all-to-alls over `Cp` |
//! | [`rope`](DTensor::rope) ([`rope`](mod@rope)) | rows split (positions from the global row: sequential, CP order, explicit), heads split, whole, or `Partial`; no `Ragged` | none |
//! | [`t`](DTensor::t) | `Shard<0>` ↔ `Shard<1>` | none |
//! | [`split_dim`](DTensor::split_dim), [`merge_dims`](DTensor::merge_dims) | `Shard<e>` moves with the dims (even shards of a reshaped dim) | none |
//! | [`narrow`](DTensor::narrow), [`cat`](DTensor::cat) ([`view`]) | the dim whole on every axis ([`NarrowRule`](view::NarrowRule)) | none |
//! | [`swap_dims`](DTensor::swap_dims) | `Shard<A>` ↔ `Shard<B>` ([`SwapDimsRule`](view::SwapDimsRule)) | none |
//! | [`repeat_interleave`](DTensor::repeat_interleave) | any (a sharded dim in even shards: [`RepeatRule`](view::RepeatRule)) | none |
//! | [`select`](DTensor::select) (where), [`masked_fill`](DTensor::masked_fill) | the mask laid out as the values, or whole ([`WhereRule`](view::WhereRule)) | none |
//! | [`gather_rows`](DTensor::gather_rows) | the table's rows whole ([`GatherRule`](view::GatherRule)) | none |
//!
//! Shapes stay run-time values: every op checks them and returns an `Err` naming itself,
//! the shapes and the placements. The result is wrapped only after its local shape was
//! checked against the derived layout, so a rule and its kernel cannot disagree silently.
//!
//! One file per op family holds both the typed method on [`DTensor`] and its twin on the
//! tape ([`Var`](crate::Var)), which records the backward from the values its forward
//! produced: `matmul.rs`, `elementwise.rs`, `activation.rs`, `reduction.rs`, `softmax.rs`,
//! `norm.rs`, `embedding.rs`, `cross_entropy.rs`, `attention.rs`, `shape.rs`, `view.rs`. This file
//! keeps the checks and the wrapping they share.

mod activation;
pub(crate) mod attention;
mod cross_entropy;
mod elementwise;
mod embedding;
mod matmul;
mod norm;
mod reduction;
mod shape;
mod softmax;
// Public: its module docs say where a row's position comes from.
pub mod rope;
// Public: it holds the rules of its ops, which bounds in user code name.
pub mod view;

pub use cross_entropy::CrossEntropy;

use crate::any::AnyDTensor;
use crate::error::{Error, Result};
use crate::typed::DTensor;
use dtensor_kernels::Tensor;
use dtensor_placement::{local_ranges, Layout, Placement};

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

/// The rows of dim `dim` of the global tensor this rank holds.
pub(crate) fn local_range(t: &AnyDTensor, dim: usize) -> Result<std::ops::Range<usize>> {
    let m = t.device_mesh();
    Ok(local_ranges(m.mesh(), t.placements(), m.coords(), t.global_shape())?[dim].clone())
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

fn without_dim(shape: &[usize], d: usize) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .filter(|&(i, _)| i != d)
        .map(|(_, &s)| s)
        .collect()
}
