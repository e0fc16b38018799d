//! Rotary position embedding (RoPE) of q or k rows, as an op of its own, and its backward.
//!
//! `x` is `[tokens, heads·head_dim]`; row `t` sits at position `positions[t]` (any
//! `usize`: global offsets under context parallelism, a microbatch's offsets, or ids that
//! restart per packed document are the caller's to give). In each head the first `r =
//! rotary_dim` columns are rotated in `r/2` pairs, the other `head_dim − r` pass through
//! unchanged. Pair `i` (`0 ≤ i < r/2`) at position `p` turns by the angle
//! `φ = p · inv_freq[i]`, with cos and sin multiplied by the attention scaling `a`:
//!
//! ```text
//! y[j0] = x[j0]·a·cos φ − x[j1]·a·sin φ
//! y[j1] = x[j0]·a·sin φ + x[j1]·a·cos φ
//! ```
//!
//! | [`RopeStyle`] | pair `i` is `(j0, j1)` | checkpoints in this layout |
//! |---|---|---|
//! | [`Interleaved`](RopeStyle::Interleaved) | `(2i, 2i+1)` | GPT-J, Meta's original Llama release, and this crate's GPT (`dtensor_nn`'s attention layer) |
//! | [`HalfSplit`](RopeStyle::HalfSplit) | `(i, i + r/2)` ("rotate_half": `x·cos + cat(−x[r/2:], x[:r/2])·sin`) | Hugging Face Llama, Mistral, Mixtral, Qwen |
//!
//! (transformers' Llama conversion permutes Meta's q/k weight rows from the one layout to
//! the other: loading weights under the wrong style is silently wrong.)
//!
//! The inverse frequencies ([`Rope::inv_freq`]) follow transformers'
//! `ROPE_INIT_FUNCTIONS` (`modeling_rope_utils.py`), `θ` the base, `b[i] = θ^(−2i/r)`:
//!
//! | [`RopeScaling`] | `inv_freq[i]` | `a` |
//! |---|---|---|
//! | `None` (`default`) | `b[i]` | 1 |
//! | `Linear { factor: f }` | `b[i] / f` | 1 |
//! | `Llama3 { f, low, high, old }` | with `λ = 2π / b[i]`: `b[i]` if `λ < old/high`; `b[i]/f` if `λ > old/low`; else `(1 − s)·b[i]/f + s·b[i]`, `s = (old/λ − low)/(high − low)` | 1 |
//! | `Yarn { f, old, β_fast, β_slow, .. }` | `(b[i]/f)·ρ[i] + b[i]·(1 − ρ[i])`, the ramp `ρ[i] = clamp((i − lo)/(hi − lo), 0, 1)` between `lo = ⌊D(β_fast)⌋ ∨ 0` and `hi = ⌈D(β_slow)⌉ ∧ (r − 1)` (not rounded with `truncate: false`; `hi += 0.001` if they meet), `D(β) = r·ln(old/(2πβ)) / (2 ln θ)` | `attention_factor`, else `m(f, mscale)/m(f, mscale_all_dim)` when both are set and nonzero, else `m(f, 1)`; `m(s, k) = 1` for `s ≤ 1`, else `0.1·k·ln s + 1` |
//!
//! **Precision.** The frequencies, the angles `p · inv_freq[i]` and `a·cos φ`, `a·sin φ` are
//! computed in `f64` ([`Rope::tables`]) and rounded once into the compute type (`f32` for
//! `f32`/`bf16`/`f16`, `f64` for `f64`); the rotation runs in the compute type and rounds
//! once into `x`'s dtype. transformers computes the frequencies and angles in `f32` (even
//! for an `f64` model), so its numbers agree with these to about `1e-6` relative, not to
//! the last bit. The device kernel uses the same tables and expressions (no fused
//! multiply-add), so host and device agree bit for bit (`cuda_gpu.rs` checks it on a GPU).
//!
//! **Which heads.** [`Rope::heads`] ([`RotatedHeads`]) names the heads that turn: every
//! head (q rows, k rows), or the q and k heads of a fused QKV row whose v heads pass
//! through ([`Rope::on_fused_qkv`]: per KV head its query heads and its k head turn, its v
//! head does not), so a fused projection's output is rotated in one pass, with no copy of q
//! and k out and back.
//!
//! **Tables.** [`RopeTables`] holds the cos/sin tables of a list of positions, rounded into
//! the compute dtype and placed on the rows' device; [`rope_with`] and
//! [`rope_backward_with`] take them prebuilt, so a forward and its backward build them once.
//!
//! **Backward.** RoPE is linear in `x` and orthogonal per pair (up to `a`): the gradient is
//! the transposed rotation, [`rope_backward`] (`R(φ)ᵀ = R(−φ)`, the sines negated), with
//! the tail columns passed through.
//!
//! ```
//! use dtensor_kernels::ops::{self, Rope, RopeStyle};
//! use dtensor_kernels::Tensor;
//! let cfg = Rope::new(4, 10_000.0, RopeStyle::HalfSplit);
//! let x = Tensor::from_fn(&[3, 8], |i| i as f64); // 3 tokens, 2 heads of 4
//! let y = ops::rope(&x, &[0, 1, 2], &cfg).unwrap();
//! assert_eq!(y.as_slice::<f64>().unwrap()[..8], x.as_slice::<f64>().unwrap()[..8]); // position 0
//! let back = ops::rope_backward(&y, &[0, 1, 2], &cfg).unwrap(); // Rᵀ·R = I
//! for (a, b) in back.to_f64_vec().iter().zip(x.to_f64_vec()) {
//!     assert!((a - b).abs() < 1e-12);
//! }
//! ```

use crate::spec::rope::{check_positions, check_rope, Rotation, OP, OP_BACK};
pub use crate::spec::rope::{Rope, RopeScaling, RopeStyle, RopeTables, RotatedHeads};
use crate::{Result, Tensor};

/// RoPE of `x` (`[tokens, heads·head_dim]`, float) with row `t` at `positions[t]`: see the
/// [module docs](self) for the formulas. `Err` (naming the op and shapes) unless `x` is
/// 2-D of whole heads (whole runs of [`RotatedHeads::group`] of them), there is one
/// position per row, and `cfg` is valid (`rotary_dim` even, nonzero, `≤ head_dim`;
/// positive base and factors).
pub fn rope(x: &Tensor, positions: &[usize], cfg: &Rope) -> Result<Tensor> {
    check_positions(OP, x, positions, cfg)?;
    rope_with(x, &RopeTables::new(cfg, positions, x)?, cfg)
}

/// The gradient of [`rope`]: `dx = R(φ)ᵀ·dy` per pair, the tail columns and the heads
/// [`RotatedHeads`] leaves out as they are. Same arguments and checks as [`rope`].
pub fn rope_backward(dy: &Tensor, positions: &[usize], cfg: &Rope) -> Result<Tensor> {
    check_positions(OP_BACK, dy, positions, cfg)?;
    rope_backward_with(dy, &RopeTables::new(cfg, positions, dy)?, cfg)
}

/// [`rope`] by prebuilt tables (one row per row of `x`, built by [`RopeTables::new`] for
/// `cfg` and `x`'s dtype and device): a forward and its backward share one build.
pub fn rope_with(x: &Tensor, tables: &RopeTables, cfg: &Rope) -> Result<Tensor> {
    rotate(OP, x, tables, cfg, Rotation::Forward)
}

/// [`rope_backward`] by prebuilt tables, as [`rope_with`].
pub fn rope_backward_with(dy: &Tensor, tables: &RopeTables, cfg: &Rope) -> Result<Tensor> {
    rotate(OP_BACK, dy, tables, cfg, Rotation::Transpose)
}

fn rotate(
    op: &'static str,
    x: &Tensor,
    tables: &RopeTables,
    cfg: &Rope,
    rotation: Rotation,
) -> Result<Tensor> {
    let heads = check_rope(op, x, tables, cfg)?;
    let (cos, sin) = (&tables.cos, &tables.sin);
    dispatch!(op, [x, cos, sin] => device::rotate(op, &x, &cos, &sin, cfg, rotation, heads));
    crate::cpu::rope::rope(op, x, cos, sin, cfg, heads, rotation)
}

/// The device launch: one kernel for both directions (the sign of the sines), reading the
/// tables already on the device.
#[cfg(feature = "cuda")]
mod device {
    use super::{Rope, RopeStyle, Rotation};
    use crate::cuda::launch::{func, grid_for, launch_kernel, Acc};
    use crate::cuda::{source, CudaTensor};
    use crate::Result;

    /// `heads` is what the front door's `check_rope` computed; `cs` and `sn` are the
    /// checked tables.
    pub(super) fn rotate(
        op: &'static str,
        x: &CudaTensor,
        cs: &CudaTensor,
        sn: &CudaTensor,
        cfg: &Rope,
        rotation: Rotation,
        heads: usize,
    ) -> Result<CudaTensor> {
        let (dev, dt) = (x.device(), x.dtype());
        let mut y = CudaTensor::uninit(dev, x.shape(), dt)?;
        let tokens = x.shape()[0];
        let (d, r) = (cfg.head_dim, cfg.rotary_dim);
        let n = tokens * heads * (d - r / 2);
        if n == 0 {
            return Ok(y);
        }
        let half_split = i32::from(cfg.style == RopeStyle::HalfSplit);
        let (group, rotated) = (cfg.heads.group, cfg.heads.rotated);
        let f = func(dev, &source::ROPE, "rope", dt)?;
        launch_kernel!(op, dev, f, grid_for(n);
            src x, dst &mut y, src cs, src sn, u64 tokens, u64 heads, u64 d, u64 r,
            int half_split, u64 group, u64 rotated, acc Acc::lit(dt, rotation.sign()))?;
        Ok(y)
    }
}
