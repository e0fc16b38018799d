//! Attention of a query block against another block's keys (context parallelism): its
//! configuration and the checks of its operands, its merge and its gradient fusion.

use super::attention::AttentionMask;
use super::*;

pub(crate) const OP: &str = "ops::attention_block";
pub(crate) const OP_BACK: &str = "ops::attention_block_backward";
pub(crate) const OP_MERGE: &str = "ops::merge_attention";
pub(crate) const OP_PACK: &str = "ops::pack_kv";
pub(crate) const OP_FUSE: &str = "ops::fuse_qkv_grad";
pub(crate) const OP_ROWS: &str = "ops::gather_rows";

/// The shape parameters of one [`attention_block`](fn@crate::ops::attention_block) call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BlockAttention<'a> {
    /// The head dim `d`.
    pub head_dim: usize,
    /// Query heads per KV head (the grouped fused layout of
    /// [`CausalAttention::q_per_kv`](crate::ops::CausalAttention::q_per_kv)).
    pub q_per_kv: usize,
    /// The score scale; `None` is `1/√head_dim`.
    pub scale: Option<f64>,
    /// Each query row's position in its sample (for the mask), strictly increasing; the
    /// same for every sample of the block.
    pub q_pos: &'a [usize],
    /// Each key row's position in its sample, strictly increasing.
    pub k_pos: &'a [usize],
    /// Documents and window besides causality ([`AttentionMask`]). Its document ids are
    /// those of the block's *whole* samples (one per token of each sample, samples one
    /// after another, natural order): a query row's document may start in a chunk another
    /// rank holds, so each block looks its rows up by position.
    pub mask: AttentionMask<'a>,
}

impl BlockAttention<'_> {
    /// Whether no query of the block's `samples` samples sees any of its keys (nothing to
    /// compute). An inconsistent mask (the operation's checks report it) counts as not
    /// masked.
    pub fn fully_masked(&self, samples: usize) -> bool {
        let (Some(&q_last), Some(&k_first)) = (self.q_pos.last(), self.k_pos.first()) else {
            return true;
        };
        if k_first > q_last {
            return true;
        }
        if self.mask.is_causal() {
            return false;
        }
        let Ok(first) = self.first_keys(OP, samples) else {
            return false;
        };
        let nq = self.q_pos.len();
        first.chunks(nq.max(1)).all(|firsts| {
            firsts.iter().zip(self.q_pos).all(|(&lo, &qp)| {
                self.k_pos.partition_point(|&p| p <= qp) <= self.k_pos.partition_point(|&p| p < lo)
            })
        })
    }

    /// Each query row's first visible key position ([`AttentionMask`]), `samples · nq`
    /// values sample by sample; `Err` (naming `op`) for a mask that does not fit: ids not
    /// one per token of `samples` whole samples, positions past a sample, a window of 0.
    pub(crate) fn first_keys(&self, op: &'static str, samples: usize) -> Result<Vec<usize>> {
        let last = self
            .q_pos
            .iter()
            .chain(self.k_pos)
            .copied()
            .max()
            .unwrap_or(0);
        let seq_len = match self.mask.documents {
            None => last + 1,
            Some([]) if samples == 0 => last + 1,
            Some(ids) if samples > 0 && ids.len().is_multiple_of(samples) => ids.len() / samples,
            Some(ids) => {
                return Err(Error::Invalid {
                    op,
                    detail: format!(
                    "{} document ids are not one per token of the block's {samples} whole samples",
                    ids.len()
                ),
                })
            }
        };
        if last >= seq_len {
            return Err(Error::Invalid {
                op,
                detail: format!(
                    "position {last} lies past the samples of {seq_len} tokens the {} document ids cover",
                    self.mask.documents.map_or(0, <[u32]>::len)
                ),
            });
        }
        self.mask.first_keys(op, samples, seq_len, self.q_pos)
    }
}

/// Validated sizes of one blockwise call.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    /// Query heads, `kv_heads · g`.
    pub(crate) heads: usize,
    pub(crate) kv_heads: usize,
    /// Query heads per KV head.
    pub(crate) g: usize,
    /// The score scale.
    pub(crate) scale: f64,
    pub(crate) d: usize,
    pub(crate) batch: usize,
    pub(crate) nq: usize,
    pub(crate) nk: usize,
}

impl Dims {
    /// Columns of the fused QKV.
    pub(crate) fn qcols(&self) -> usize {
        self.kv_heads * (self.g + 2) * self.d
    }
    /// Columns of a packed KV block.
    pub(crate) fn kvcols(&self) -> usize {
        self.kv_heads * 2 * self.d
    }
    /// The first column of query head `h` in a fused QKV row.
    pub(crate) fn q_col(&self, h: usize) -> usize {
        (h / self.g) * (self.g + 2) * self.d + (h % self.g) * self.d
    }
}

pub(crate) fn increasing(p: &[usize]) -> bool {
    !p.is_empty() && p.windows(2).all(|w| w[0] < w[1])
}

pub(crate) fn check_block<L: Layout + ?Sized>(
    op: &'static str,
    qkv: &L,
    kv: &L,
    cfg: &BlockAttention,
) -> Result<Dims> {
    let bad = |detail: String| Err(Error::Invalid { op, detail });
    if qkv.rank() != 2 || kv.rank() != 2 {
        return bad(format!(
            "qkv must be [tokens, kv_heads·(q_per_kv+2)·head_dim] and kv [tokens, kv_heads·2·head_dim], got shapes {:?} and {:?}",
            qkv.shape(),
            kv.shape()
        ));
    }
    if !qkv.dtype().is_float() {
        return Err(super::not_float(op, qkv.dtype()));
    }
    same_dtype(op, qkv, kv)?;
    let d = cfg.head_dim;
    if d == 0 {
        return bad("head_dim must be nonzero".into());
    }
    if !increasing(cfg.q_pos) || !increasing(cfg.k_pos) {
        return bad(format!(
            "q and k positions must be non-empty and strictly increasing, got {} and {} positions",
            cfg.q_pos.len(),
            cfg.k_pos.len()
        ));
    }
    let cols = qkv.shape()[1];
    let g = cfg.q_per_kv;
    if g == 0 {
        return bad("q_per_kv must be at least 1".into());
    }
    let Some(group_cols) = g.checked_add(2).and_then(|n| n.checked_mul(d)) else {
        return bad(format!(
            "(q_per_kv + 2)·head_dim overflows usize (q_per_kv {g}, head_dim {d})"
        ));
    };
    if !cols.is_multiple_of(group_cols) {
        return bad(format!(
            "{cols} qkv columns are not whole KV groups of (q_per_kv + 2)·head_dim = {group_cols}"
        ));
    }
    let kv_heads = cols / group_cols;
    if kv.shape()[1] != kv_heads * 2 * d {
        return bad(format!(
            "kv has {} columns, want kv_heads·2·head_dim = {} for qkv's {kv_heads} KV heads",
            kv.shape()[1],
            kv_heads * 2 * d
        ));
    }
    let scale = cfg.scale.unwrap_or_else(|| 1.0 / (d as f64).sqrt());
    if !scale.is_finite() {
        return bad(format!("score scale {scale} must be finite"));
    }
    let (nq, nk) = (cfg.q_pos.len(), cfg.k_pos.len());
    let (rq, rk) = (qkv.shape()[0], kv.shape()[0]);
    if rq % nq != 0 || rk % nk != 0 || rq / nq != rk / nk {
        return bad(format!(
            "{rq} query rows in samples of {nq} and {rk} key rows in samples of {nk} are not the same whole number of samples"
        ));
    }
    Ok(Dims {
        heads: kv_heads * g,
        kv_heads,
        g,
        scale,
        d,
        batch: rq / nq,
        nq,
        nk,
    })
}

/// The sizes of a blockwise backward: [`check_block`]'s, then `dout` and `out` (`[rows_q,
/// H·d]` in `qkv`'s dtype), `lse` (`[rows_q, H]`) and the accumulators `dq` (`[rows_q,
/// H·d]`) and `dkv` (`[rows_k, H·2·d]`) in the compute dtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_block_backward<L: Layout + ?Sized>(
    op: &'static str,
    dout: &L,
    qkv: &L,
    kv: &L,
    out: &L,
    lse: &L,
    cfg: &BlockAttention,
    dq: &L,
    dkv: &L,
) -> Result<Dims> {
    let g = check_block(op, qkv, kv, cfg)?;
    same_dtype(op, dout, qkv)?;
    same_dtype(op, out, qkv)?;
    let rq = g.batch * g.nq;
    let acc = acc_dtype(qkv.dtype());
    for t in [dout, out] {
        if t.shape() != [rq, g.heads * g.d] {
            return Err(Error::ShapeMismatch {
                op,
                lhs: t.shape().into(),
                rhs: [rq, g.heads * g.d].as_slice().into(),
            });
        }
    }
    check_dst(op, lse, &[rq, g.heads], acc)?;
    check_dst(op, dq, &[rq, g.heads * g.d], acc)?;
    check_dst(op, dkv, &[g.batch * g.nk, g.kvcols()], acc)?;
    Ok(g)
}

/// `(rows, heads, out columns)` of a merge of `part` into `acc` (each `(out, lse)`), or the
/// error for arguments that cannot be merged: the CPU op and its device twin check alike.
pub(crate) fn check_merge<L: Layout + ?Sized>(
    op: &'static str,
    acc: (&L, &L),
    part: (&L, &L),
) -> Result<(usize, usize, usize)> {
    let ((acc_out, acc_lse), (part_out, part_lse)) = (acc, part);
    let (rows, heads) = match acc_lse.shape() {
        &[r, h] => (r, h),
        s => {
            return Err(Error::Invalid {
                op,
                detail: format!("lse must be [tokens, heads], got {s:?}"),
            })
        }
    };
    let dt = acc_lse.dtype();
    if !matches!(dt, DType::F32 | DType::F64) {
        return Err(Error::Invalid {
            op,
            detail: format!("partial results are in a compute dtype (f32 or f64), got {dt}"),
        });
    }
    check_dst(op, part_lse, &[rows, heads], dt)?;
    let ocols = acc_out.shape().get(1).copied().unwrap_or(0);
    if heads == 0 || ocols % heads != 0 {
        return Err(Error::Invalid {
            op,
            detail: format!("out {:?} is not [tokens, heads·d]", acc_out.shape()),
        });
    }
    check_dst(op, acc_out, &[rows, ocols], dt)?;
    check_dst(op, part_out, &[rows, ocols], dt)?;
    Ok((rows, heads, ocols))
}

/// `(rows, kv_heads)` of a grouped fused `[tokens, K·(g+2)·d]` QKV whose k and v columns
/// `pack_kv` copies out, or the error for a QKV that is not whole KV groups: the CPU op and
/// its device twin check alike.
pub(crate) fn check_pack_kv<L: Layout + ?Sized>(
    op: &'static str,
    qkv: &L,
    d: usize,
    g: usize,
) -> Result<(usize, usize)> {
    let group_cols = g
        .checked_add(2)
        .and_then(|n| n.checked_mul(d))
        .filter(|&c| c > 0 && g > 0);
    match (qkv.shape(), group_cols) {
        (&[rows, cols], Some(c)) if cols.is_multiple_of(c) => Ok((rows, cols / c)),
        _ => Err(Error::Invalid {
            op,
            detail: format!(
                "qkv of shape {:?} is not [tokens, kv_heads·({g}+2)·{d}] (q_per_kv {g}, head_dim {d})",
                qkv.shape()
            ),
        }),
    }
}

/// `(rows, kv_heads)` of a grouped QKV gradient fused from `dq` and `dkv`, or the error for
/// parts that are not `[tokens, K·g·d]` and `[tokens, K·2·d]` in `dtype`'s compute dtype:
/// the CPU op and its device twin check alike.
pub(crate) fn check_fuse_qkv_grad<L: Layout + ?Sized>(
    op: &'static str,
    dq: &L,
    dkv: &L,
    d: usize,
    g: usize,
    dtype: DType,
) -> Result<(usize, usize)> {
    let acc = acc_dtype(dtype);
    let group_q = d.checked_mul(g).filter(|&c| c > 0);
    let (rows, qc, gq) = match (dq.shape(), group_q) {
        (&[r, c], Some(gq)) if c % gq == 0 => (r, c, gq),
        (s, _) => {
            return Err(Error::Invalid {
                op,
                detail: format!("dq of shape {s:?} is not [tokens, kv_heads·{g}·{d}]"),
            })
        }
    };
    let kv_heads = qc / gq;
    // The fused result has K·(g+2)·d columns; dkv's K·2·d are fewer.
    let fused = kv_heads
        .checked_mul(2)
        .and_then(|n| n.checked_mul(d))
        .and_then(|n| qc.checked_add(n));
    if fused.is_none() {
        return Err(Error::Invalid {
            op,
            detail: format!(
                "dq of shape {:?} has {kv_heads} KV groups of {g} heads of {d}: their fused K·(g+2)·d columns overflow usize",
                dq.shape()
            ),
        });
    }
    check_dst(op, dq, &[rows, qc], acc)?;
    check_dst(op, dkv, &[rows, kv_heads * 2 * d], acc)?;
    Ok((rows, kv_heads))
}

/// `cols` of a 2-D `t` whose rows `src` picks, or the error for a tensor that is not 2-D or
/// an index past its rows: the CPU op and its device twin check alike.
pub(crate) fn check_gather_rows<L: Layout + ?Sized>(
    op: &'static str,
    t: &L,
    src: &[usize],
) -> Result<usize> {
    let (rows, cols) = match *t.shape() {
        [r, c] => (r, c),
        ref s => {
            return Err(Error::Invalid {
                op,
                detail: format!("a 2-D tensor, got shape {s:?}"),
            })
        }
    };
    if let Some(&bad) = src.iter().find(|&&i| i >= rows) {
        return Err(Error::Invalid {
            op,
            detail: format!("row {bad} of a tensor of {rows} rows"),
        });
    }
    Ok(cols)
}
