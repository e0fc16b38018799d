//! Rotary position embedding as an op of its own: the configuration (pair convention,
//! rotary dim, base, frequency scaling), its inverse frequencies and cos/sin scale in `f64`,
//! the tables both backends rotate by, and the checks of `x` and the positions.
//!
//! The formulas are on [`crate::ops::rope`](mod@crate::ops::rope).

use super::*;

pub(crate) const OP: &str = "ops::rope";
pub(crate) const OP_BACK: &str = "ops::rope_backward";
pub(crate) const OP_TABLES: &str = "ops::rope (RopeTables::new)";

/// Which way a call rotates: the op (`R(θ)`) or its transpose (`R(θ)ᵀ = R(−θ)`, the
/// gradient), the sign of every sine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rotation {
    Forward,
    Transpose,
}

impl Rotation {
    pub(crate) fn sign(self) -> f64 {
        match self {
            Rotation::Forward => 1.0,
            Rotation::Transpose => -1.0,
        }
    }
}

/// Which columns of a head RoPE rotates together. No default: weights trained under one
/// convention are silently wrong under the other, so a configuration names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Pair `i` is `(x[2i], x[2i+1])`: GPT-J, Meta's original Llama release, and this
    /// crate's GPT.
    Interleaved,
    /// Pair `i` is `(x[i], x[i + r/2])`, `r` the rotary dim ("rotate_half"): the Hugging
    /// Face layout of Llama, Mistral, Qwen and Mixtral checkpoints.
    HalfSplit,
}

/// How the inverse frequencies are derived from the base (transformers'
/// `rope_scaling.rope_type`); the formulas are on [`crate::ops::rope`](mod@crate::ops::rope).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub enum RopeScaling {
    /// `inv_freq[i] = θ^(−2i/r)` (transformers' `default`).
    #[default]
    None,
    /// Positions divided by `factor` (`inv_freq / factor`).
    Linear {
        /// The divisor (> 0).
        factor: f64,
    },
    /// Llama 3.1's: low frequencies divided by `factor`, high ones kept, a linear blend in
    /// between.
    Llama3 {
        /// The divisor of the low frequencies (8 in Llama 3.1).
        factor: f64,
        /// Wavelengths above `original_max_position_embeddings / low_freq_factor` are
        /// divided (1 in Llama 3.1).
        low_freq_factor: f64,
        /// Wavelengths below `original_max_position_embeddings / high_freq_factor` are
        /// kept (4 in Llama 3.1); must exceed `low_freq_factor`.
        high_freq_factor: f64,
        /// The context length of pretraining (8192 in Llama 3.1).
        original_max_position_embeddings: usize,
    },
    /// YaRN: per frequency a ramp between interpolation (`inv/factor`) and extrapolation
    /// (`inv`), and cos/sin multiplied by an attention factor.
    Yarn {
        /// The interpolation factor. (transformers derives it as `max_position_embeddings /
        /// original_max_position_embeddings` when a config leaves it out: pass that value.)
        factor: f64,
        /// The context length of pretraining.
        original_max_position_embeddings: usize,
        /// Rotations at which the ramp starts extrapolating (transformers' default 32).
        beta_fast: f64,
        /// Rotations at which the ramp ends interpolating (transformers' default 1).
        beta_slow: f64,
        /// The cos/sin multiplier; `None` derives it from `factor` (and `mscale`,
        /// `mscale_all_dim` when both are set and nonzero).
        attention_factor: Option<f64>,
        /// DeepSeek's numerator scale of the derived attention factor.
        mscale: Option<f64>,
        /// DeepSeek's denominator scale of the derived attention factor.
        mscale_all_dim: Option<f64>,
        /// Whether the ramp's ends are rounded to whole dims (transformers' default `true`).
        truncate: bool,
    },
}

impl RopeScaling {
    /// YaRN with transformers' defaults for everything but `factor` and the pretraining
    /// context (`beta_fast` 32, `beta_slow` 1, the attention factor derived, truncated ramp).
    pub fn yarn(factor: f64, original_max_position_embeddings: usize) -> RopeScaling {
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
        }
    }
}

/// Which heads of a row RoPE rotates: the row's heads in runs of `group`, and in each run
/// the first `rotated`; the others (a fused QKV's v heads) pass through unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RotatedHeads {
    /// Heads per run (≥ 1).
    pub group: usize,
    /// The leading heads of each run that are rotated (`1..=group`).
    pub rotated: usize,
}

impl RotatedHeads {
    /// Every head (rows of q, or of k).
    pub const ALL: RotatedHeads = RotatedHeads {
        group: 1,
        rotated: 1,
    };

    /// The q and k heads of a grouped fused QKV: per KV head its `q_per_kv` query heads,
    /// then its k head (all rotated), then its v head (passed through). `q_per_kv = 1` is
    /// the per-head `[q, k, v]` layout of multi-head attention.
    pub fn fused_qkv(q_per_kv: usize) -> RotatedHeads {
        RotatedHeads {
            group: q_per_kv + 2,
            rotated: q_per_kv + 1,
        }
    }

    /// Whether head `h` of a row is rotated.
    #[inline(always)]
    pub fn rotates(&self, h: usize) -> bool {
        h % self.group < self.rotated
    }
}

/// Rotary position embedding of `[tokens, heads·head_dim]` rows: each rotated head's first
/// `rotary_dim` columns are rotated in pairs by angles `position · inv_freq[i]`, the rest
/// pass through.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rope {
    /// Columns per head.
    pub head_dim: usize,
    /// The rotated leading columns of each head (even, `≤ head_dim`; transformers'
    /// `head_dim · partial_rotary_factor`).
    pub rotary_dim: usize,
    /// The base `θ` (`rope_theta`; 10000 in most models).
    pub theta: f64,
    /// Which columns pair up.
    pub style: RopeStyle,
    /// How the frequencies are scaled.
    pub scaling: RopeScaling,
    /// Which heads are rotated (every head, or the q and k heads of a fused QKV).
    pub heads: RotatedHeads,
}

impl Rope {
    /// Whole-head RoPE (`rotary_dim = head_dim`) of every head, without scaling.
    pub fn new(head_dim: usize, theta: f64, style: RopeStyle) -> Rope {
        Rope {
            head_dim,
            rotary_dim: head_dim,
            theta,
            style,
            scaling: RopeScaling::None,
            heads: RotatedHeads::ALL,
        }
    }

    /// The same rotation of the q and k heads of a grouped fused QKV row (see
    /// [`RotatedHeads::fused_qkv`]), its v heads passed through.
    pub fn on_fused_qkv(self, q_per_kv: usize) -> Rope {
        Rope {
            heads: RotatedHeads::fused_qkv(q_per_kv),
            ..self
        }
    }

    /// `Err` (naming `op`) unless the configuration is one the formulas are defined for.
    pub(crate) fn check(&self, op: &'static str) -> Result<()> {
        let bad = |detail: String| Err(Error::Invalid { op, detail });
        let (d, r) = (self.head_dim, self.rotary_dim);
        if d == 0 || r == 0 || r % 2 != 0 || r > d {
            return bad(format!(
                "rotary_dim {r} must be even, nonzero and at most head_dim {d} (RoPE rotates pairs within a head)"
            ));
        }
        let RotatedHeads { group, rotated } = self.heads;
        if group == 0 || rotated == 0 || rotated > group {
            return bad(format!(
                "rotated heads {rotated} of every {group} must be at least 1 and at most the group"
            ));
        }
        let positive = |v: f64| v.is_finite() && v > 0.0;
        if !positive(self.theta) {
            return bad(format!("theta {} must be positive and finite", self.theta));
        }
        match self.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } if !positive(factor) => {
                return bad(format!(
                    "linear scaling factor {factor} must be positive and finite"
                ))
            }
            RopeScaling::Linear { .. } => {}
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                if !(positive(factor)
                    && positive(low_freq_factor)
                    && high_freq_factor.is_finite()
                    && high_freq_factor > low_freq_factor
                    && original_max_position_embeddings > 0)
                {
                    return bad(format!(
                        "llama3 scaling needs factor > 0 ({factor}), 0 < low_freq_factor ({low_freq_factor}) < high_freq_factor ({high_freq_factor}) and original_max_position_embeddings > 0 ({original_max_position_embeddings})"
                    ));
                }
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                mscale,
                mscale_all_dim,
                ..
            } => {
                let finite = |v: Option<f64>| v.is_none_or(f64::is_finite);
                if !(positive(factor)
                    && original_max_position_embeddings > 0
                    && positive(beta_fast)
                    && positive(beta_slow)
                    && finite(attention_factor)
                    && finite(mscale)
                    && finite(mscale_all_dim))
                {
                    return bad(format!(
                        "yarn scaling needs factor > 0 ({factor}), original_max_position_embeddings > 0 ({original_max_position_embeddings}), beta_fast, beta_slow > 0 ({beta_fast}, {beta_slow}) and finite optional factors"
                    ));
                }
            }
        }
        Ok(())
    }

    /// The `rotary_dim / 2` inverse frequencies, in `f64`, scaled as
    /// [`scaling`](Self::scaling) says (the formulas are on
    /// [`crate::ops::rope`](mod@crate::ops::rope)). Meaningful for a configuration that
    /// passes the op's checks.
    pub fn inv_freq(&self) -> Vec<f64> {
        let r = self.rotary_dim;
        let base: Vec<f64> = (0..r / 2)
            .map(|i| 1.0 / self.theta.powf((2 * i) as f64 / r as f64))
            .collect();
        match self.scaling {
            RopeScaling::None => base,
            RopeScaling::Linear { factor } => base.into_iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = original_max_position_embeddings as f64;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                base.into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let s = (old / wavelen - low_freq_factor)
                                / (high_freq_factor - low_freq_factor);
                            (1.0 - s) * f / factor + s * f
                        }
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                let (rf, old) = (r as f64, original_max_position_embeddings as f64);
                // The dim at which a wavelength makes `rotations` turns over the pretraining
                // context.
                let dim_for = |rotations: f64| {
                    rf * (old / (rotations * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (dim_for(beta_fast), dim_for(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(rf - 1.0));
                if low == high {
                    high += 0.001;
                }
                base.into_iter()
                    .enumerate()
                    .map(|(i, f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (f / factor) * (1.0 - extrapolation) + f * extrapolation
                    })
                    .collect()
            }
        }
    }

    /// The multiplier of cos and sin: YaRN's attention factor, 1 for the other scalings.
    pub fn attention_scaling(&self) -> f64 {
        match self.scaling {
            RopeScaling::Yarn {
                factor,
                attention_factor,
                mscale,
                mscale_all_dim,
                ..
            } => attention_factor.unwrap_or_else(|| {
                let m = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                match (mscale, mscale_all_dim) {
                    (Some(a), Some(b)) if a != 0.0 && b != 0.0 => m(factor, a) / m(factor, b),
                    _ => m(factor, 1.0),
                }
            }),
            _ => 1.0,
        }
    }

    /// `a·cos(p·inv_freq[i])` and `a·sin(p·inv_freq[i])` for every position `p` (rows) and
    /// pair `i` (columns), `[positions, rotary_dim/2]` row-major, in `f64` (`a` the
    /// [`attention_scaling`](Self::attention_scaling)). Both backends round these once into
    /// their compute type.
    pub fn tables(&self, positions: &[usize]) -> (Vec<f64>, Vec<f64>) {
        let inv = self.inv_freq();
        let (a, half) = (self.attention_scaling(), inv.len());
        let n = positions.len() * half;
        let (mut cos, mut sin) = (Vec::with_capacity(n), Vec::with_capacity(n));
        // A batch repeats its positions once per sample: each distinct one is computed once
        // (the sines and cosines are most of the op's host time) and its row copied.
        let mut first = std::collections::HashMap::with_capacity(positions.len().min(1 << 16));
        for (t, &p) in positions.iter().enumerate() {
            if let Some(&row) = first.get(&p) {
                let at = row * half..(row + 1) * half;
                cos.extend_from_within(at.clone());
                sin.extend_from_within(at);
                continue;
            }
            first.insert(p, t);
            for f in &inv {
                let (s, c) = (p as f64 * f).sin_cos();
                cos.push(a * c);
                sin.push(a * s);
            }
        }
        (cos, sin)
    }

    /// The columns of pair `i` within a head: `(first, second)`.
    #[inline(always)]
    pub(crate) fn pair(&self, i: usize) -> (usize, usize) {
        match self.style {
            RopeStyle::Interleaved => (2 * i, 2 * i + 1),
            RopeStyle::HalfSplit => (i, i + self.rotary_dim / 2),
        }
    }
}

/// RoPE's `a·cos` and `a·sin` tables for one list of positions, `[positions, rotary_dim/2]`
/// each ([`Rope::tables`], computed in `f64`), rounded once into the compute dtype of the
/// rows they rotate and placed where those rows are. Built once, they serve a forward and
/// its backward (which rotates by the same angles).
#[derive(Clone, Debug)]
pub struct RopeTables {
    pub(crate) cos: Tensor,
    pub(crate) sin: Tensor,
}

impl RopeTables {
    /// The tables of `cfg` at `positions`, in the compute dtype of `like`'s dtype
    /// ([`acc_dtype`]) and on `like`'s device. `Err` (naming the op) unless `cfg` is valid,
    /// or if the upload fails.
    pub fn new(cfg: &Rope, positions: &[usize], like: &Tensor) -> Result<RopeTables> {
        cfg.check(OP_TABLES)?;
        want_float(OP_TABLES, like)?;
        let (cos, sin) = cfg.tables(positions);
        let shape = [positions.len(), cfg.rotary_dim / 2];
        let acc = acc_dtype(like.dtype());
        let place = |v: Vec<f64>| -> Result<Tensor> {
            let t = Tensor::from_vec(v, &shape)?;
            let t = if acc == DType::F64 {
                t
            } else {
                t.to_dtype(acc)
            };
            match like.device() {
                Some(dev) => t.to_device(dev),
                None => Ok(t),
            }
        };
        Ok(RopeTables {
            cos: place(cos)?,
            sin: place(sin)?,
        })
    }

    /// The positions (rows) the tables hold.
    pub fn len(&self) -> usize {
        self.cos.shape()[0]
    }

    /// Whether the tables hold no position.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Checks `x` (`[tokens, heads·head_dim]`, float, whole runs of
/// [`RotatedHeads::group`] heads), the tables (one row per row of `x`, `rotary_dim / 2`
/// columns, `x`'s compute dtype) and the configuration; returns the head count.
pub(crate) fn check_rope<L: Layout + ?Sized>(
    op: &'static str,
    x: &L,
    tables: &RopeTables,
    cfg: &Rope,
) -> Result<usize> {
    let bad = |detail: String| Err(Error::Invalid { op, detail });
    if x.rank() != 2 {
        return bad(format!(
            "x must be [tokens, heads·head_dim], got shape {:?}",
            x.shape()
        ));
    }
    want_float(op, x)?;
    cfg.check(op)?;
    let (tokens, cols) = (x.shape()[0], x.shape()[1]);
    if cols % cfg.head_dim != 0 {
        return bad(format!(
            "x shape {:?}: {cols} columns are not whole heads of head_dim {}",
            x.shape(),
            cfg.head_dim
        ));
    }
    let heads = cols / cfg.head_dim;
    if !heads.is_multiple_of(cfg.heads.group) {
        return bad(format!(
            "x shape {:?}: {heads} heads are not whole groups of {} (RotatedHeads)",
            x.shape(),
            cfg.heads.group
        ));
    }
    let want = [tokens, cfg.rotary_dim / 2];
    let acc = acc_dtype(x.dtype());
    for t in [&tables.cos, &tables.sin] {
        let (shape, dtype) = (t.shape(), t.dtype());
        if shape != want || dtype != acc {
            return bad(format!(
                "x shape {:?} needs RoPE tables of shape {want:?} in {acc} (one row per row of x), got {shape:?} in {dtype}",
                x.shape()
            ));
        }
    }
    Ok(heads)
}

/// What [`RopeTables::new`] would otherwise report under its own name, checked for the op
/// that builds them: `x` float, `cfg` valid, and one position per row of a 2-D `x`.
pub(crate) fn check_positions<L: Layout + ?Sized>(
    op: &'static str,
    x: &L,
    positions: &[usize],
    cfg: &Rope,
) -> Result<()> {
    want_float(op, x)?;
    cfg.check(op)?;
    match x.shape() {
        [tokens, _] if *tokens != positions.len() => Err(Error::Invalid {
            op,
            detail: format!(
                "x shape {:?} has {tokens} rows but {} positions were given (one per row)",
                x.shape(),
                positions.len()
            ),
        }),
        _ => Ok(()),
    }
}

impl Rope {
    /// `Err` unless the configuration is one the formulas are defined for (positive base
    /// and factors, an even rotary dim within the head, ordered llama3 frequency bounds): what
    /// [`rope`](fn@crate::ops::rope) checks first, for a caller that validates a model's
    /// configuration before it builds anything.
    pub fn validate(&self) -> Result<()> {
        self.check("Rope::validate")
    }
}
