//! The CUDA kernels, launched: each function mirrors a CPU op (same name, same shapes and
//! dtypes, same errors for bad arguments) on [`CudaTensor`]s of one [`Device`].
//!
//! | CPU op | here | agreement with the CPU |
//! |---|---|---|
//! | `Tensor::add`, `mul`, `scale`, `ops::sub` | [`add`], [`mul`], [`scale`], [`sub`] | bitwise |
//! | `Tensor::to_dtype` | [`to_dtype`] | bitwise (into f16: ≤ 1 ulp on CPUs without F16C) |
//! | `ops::add_row`, `mul_row`, `sum_rows_into` | [`add_row`], [`mul_row`], [`sum_rows_into`] | bitwise |
//! | `ops::gelu`, `silu`, `swiglu` and backward | [`gelu`], [`gelu_backward_into`], … | bitwise for f32/bf16/f16; f64 to CUDA's `exp` |
//! | `ops::sum_dim`, `max_dim` and backward | [`sum_dim`], [`max_dim`], … | bitwise |
//! | `ops::softmax`, `log_softmax` and backward | [`softmax`], [`log_softmax`], … | to rounding (tree-ordered row sums, CUDA exp/log) |
//! | `ops::layer_norm`, `rms_norm` and backward | [`layer_norm`], [`rms_norm`], … | to rounding (row sums); dweight/dbias summed in the CPU's order |
//! | `ops::embedding(_masked)` and backward | [`embedding`], [`embedding_backward_into`] | bitwise (deterministic scatter-add, see `embedding.cu`) |
//! | `DTensor::cross_entropy` pieces (f64) | [`ce_row_max`], [`ce_sum_target`], [`ce_loss`], [`ce_grad`] | to rounding |
//! | `Tensor::pack`, `unpack`, `narrow`, `cat` | [`pack`], [`unpack`], [`narrow`], [`cat`] | bitwise |
//! | `ops::causal_attention` and backward | [`causal_attention`], [`causal_attention_backward`] | to rounding; `seq_len` bounded by shared memory |
//! | `ops::matmul`, `matmul_into` | [`matmul`], [`matmul_into`] (cuBLAS) | to rounding (cuBLAS's order) |
//! | `ops::attention_block` and backward | [`attention_block`], [`attention_block_backward`] | to rounding; block lengths bounded by shared memory |
//! | `ops::merge_attention` | [`merge_attention`] | to rounding (CUDA's exp/log) |
//! | `ops::pack_kv`, `fuse_qkv_grad`, `gather_rows` | [`pack_kv`], [`fuse_qkv_grad`], [`gather_rows`] | bitwise |
//! | `ops::grouped_matmul_t` and backward | [`grouped_matmul_t`], [`grouped_matmul_t_backward`] (cuBLAS per expert) | to rounding (cuBLAS's order) |
//! | `ops::scatter_add_rows` | [`scatter_add_rows`] | bitwise (deterministic, the CPU's order) |
//! | `reduce::combine`, `reduce::reduce_into` (Sum, Avg, Max, Min) | [`combine`], [`reduce_into`] | bitwise (a Sum/Avg NaN's payload aside) |
//!
//! Those last six rows live in the child module `model_ops` and are re-exported here.
//! Not on the GPU yet: `Tensor::map` (a host closure) and the optimizer step.
//!
//! Element counts and row counts come from the checked shapes, never from buffer lengths, so
//! a launch cannot index out of bounds. Every launch goes through `launch_kernel!`, which
//! compares the arguments it pushes (count, order, scalar types, buffers' element types and
//! read/write) with the parameters of the kernel's `extern "C"` definition
//! ([`KernelModule::params`]) and answers an `Err` instead of launching on a mismatch. Ops queue on the device's stream and return at once.

use crate::cuda::source::{self, entry, KernelModule, Param, Scalar};
use crate::cuda::{driver_err, CudaBuffer, CudaTensor, Device};
use crate::shape::check_pieces;
use crate::spec::attention::{check_qkv, CausalAttention, CausalAttentionOutput, Dims, Rope};
use crate::spec::embedding::{dy_hidden, out_shape, read_ids, table_dims, VocabShard};
use crate::spec::norm::{check_stat, norm_rows};
use crate::spec::reduction::{check_index_range, check_indices, max_split, removed, split_at};
use crate::spec::{acc_dtype, check_dst, check_row_param, rows_last, want_float, Accum};
use crate::{DType, Error, Result, Shape, Tensor};
use cudarc::driver::{LaunchArgs, LaunchConfig, PushKernelArg};

/// Threads per block; must equal `ROW_THREADS` in `common.cuh` (the block reductions assume it;
/// a unit test checks the two agree).
pub(crate) const THREADS: u32 = 256;
/// Blocks of a grid-stride launch at most (enough to fill an H200 several times over).
const MAX_BLOCKS: usize = 1 << 16;

pub(crate) fn grid_for(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(THREADS as usize).clamp(1, MAX_BLOCKS) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block per row (`rows ≥ 1`), `shared` bytes of dynamic shared memory.
pub(crate) fn per_row(op: &'static str, rows: usize, shared: u32) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows)
        .ok()
        .filter(|&b| b <= i32::MAX as u32)
        .ok_or_else(|| Error::NotOnCuda {
            op,
            detail: format!(": {rows} rows exceed one launch's grid (2^31 - 1 blocks)"),
        })?;
    Ok(LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: shared,
    })
}

/// Pushes a buffer as a `const T*` / `T*` argument.
pub(crate) fn arg<'a>(b: &mut LaunchArgs<'a>, t: &'a CudaTensor) {
    crate::cuda::tensor::with_buffer!(t.buffer(), |s| {
        b.arg(s);
    })
}
/// Copies the buffer first if another tensor shares it (copy on write), so the kernel
/// writes only this tensor's elements.
pub(crate) fn arg_mut<'a>(b: &mut LaunchArgs<'a>, t: &'a mut CudaTensor) -> Result<()> {
    crate::cuda::tensor::with_buffer!(t.buffer_mut()?, |s| {
        b.arg(s);
    });
    Ok(())
}

/// A scalar in a dtype's compute type (`float` for f32/bf16/f16, `double` for f64, the
/// integer itself for i32/i64), as the kernels' `Tr<T>::A` parameters take it.
pub(crate) enum Acc {
    F32(f32),
    F64(f64),
    I32(i32),
    I64(i64),
}

impl Acc {
    /// `v` as the compute type of `dtype`, rounded as `T::from_f64(v)` would round it into `T`
    /// first (what the CPU's `Tensor::scale` does with its factor).
    fn rounded(dtype: DType, v: f64) -> Acc {
        match dtype {
            DType::F32 => Acc::F32(v as f32),
            DType::F64 => Acc::F64(v),
            DType::BF16 => Acc::F32(half::bf16::from_f64(v).to_f32()),
            DType::F16 => Acc::F32(half::f16::from_f64(v).to_f32()),
            DType::I32 => Acc::I32(v as i32),
            DType::I64 => Acc::I64(v as i64),
        }
    }
    /// `v` rounded straight into the compute type (`A::lit(v)` on the CPU).
    pub(crate) fn lit(dtype: DType, v: f64) -> Acc {
        match dtype {
            DType::F64 => Acc::F64(v),
            _ => Acc::F32(v as f32),
        }
    }
    /// The C type it is pushed as.
    pub(crate) fn param(&self) -> Param {
        Param::Scalar(match self {
            Acc::F32(_) => Scalar::F32,
            Acc::F64(_) => Scalar::F64,
            Acc::I32(_) => Scalar::I32,
            Acc::I64(_) => Scalar::I64,
        })
    }
    pub(crate) fn push<'a>(&'a self, b: &mut LaunchArgs<'a>) {
        match self {
            Acc::F32(v) => b.arg(v),
            Acc::F64(v) => b.arg(v),
            Acc::I32(v) => b.arg(v),
            Acc::I64(v) => b.arg(v),
        };
    }
}

/// A kernel entry ready to launch: the loaded function and the parameters its `extern "C"`
/// definition declares ([`KernelModule::params`]).
pub(crate) struct Kernel {
    pub(crate) function: cudarc::driver::CudaFunction,
    name: String,
    params: &'static [Param],
}

impl Kernel {
    /// `Err` unless `pushed` is the kernel's parameter list: same count, order, scalar types
    /// and buffer element types, read-only buffers where it reads and writable where it
    /// writes. A mismatch would be undefined behaviour on the GPU.
    pub(crate) fn check(&self, op: &'static str, pushed: &[Param]) -> Result<()> {
        if pushed == self.params {
            return Ok(());
        }
        Err(Error::Cuda {
            op,
            detail: format!(
                "launch of `{}` pushes {pushed:?}, the kernel takes {:?}",
                self.name, self.params
            ),
        })
    }
}

/// Launches what `b` holds; `kernel.check` has compared the arguments with the kernel's.
pub(crate) fn launch(op: &'static str, b: &mut LaunchArgs<'_>, cfg: LaunchConfig) -> Result<()> {
    // SAFETY: [`launch_kernel!`] pushed exactly the arguments of the kernel's `extern "C"`
    // signature in `kernels/*.cu` (checked by `Kernel::check` against the signature parsed
    // from the source, which the `cuda_ptx` test checks against the PTX): in order, of those
    // types, buffers of the element types it declares; the counts come from shapes the
    // buffers were allocated for.
    unsafe { b.launch(cfg) }.map_err(|e| driver_err(op, e))?;
    Ok(())
}

/// Launches the [`Kernel`] `$k` (from [`func`]) on `$dev`'s stream with the launch config
/// `$cfg` for op `$op`, evaluating to [`launch`]'s `Result<()>`. The arguments are pushed in
/// the order written, which must be the order of the kernel's `extern "C"` parameters in
/// `kernels/*.cu`; each names the C type it is passed as:
///
/// | written | C parameter | Rust value |
/// |---|---|---|
/// | `src t` | `const E*`, `E` the tensor's dtype | `&CudaTensor` |
/// | `dst t` | `E*` | `&mut CudaTensor` |
/// | `u64 n` | `u64` | `usize` |
/// | `int v` | `int` | `i32` |
/// | `acc a` | `Tr<T>::A` | [`Acc`] |
/// | `f64 x` | `double` | `f64` |
///
/// Before launching, the pushed list is compared with the kernel's declared parameters
/// ([`Kernel::check`]): a launch that disagrees with its kernel returns an `Err` instead of
/// running.
macro_rules! launch_kernel {
    ($op:expr, $dev:expr, $k:expr, $cfg:expr; $($kind:ident $a:expr),+ $(,)?) => {{
        let k: Kernel = $k;
        let mut pushed = Vec::new();
        let mut l = $dev.stream().launch_builder(&k.function);
        $(kernel_arg!(l, pushed, $kind $a);)+
        k.check($op, &pushed)?;
        launch($op, &mut l, $cfg)
    }};
}

/// One argument of [`launch_kernel!`], recorded in `$p` as the [`Param`] it is pushed as; a
/// scalar is bound to a local that outlives the launch.
macro_rules! kernel_arg {
    ($l:ident, $p:ident, src $t:expr) => {
        let t: &CudaTensor = $t;
        $p.push(Param::Src(t.dtype()));
        arg(&mut $l, t);
    };
    ($l:ident, $p:ident, dst $t:expr) => {
        let t: &mut CudaTensor = $t;
        $p.push(Param::Dst(t.dtype()));
        arg_mut(&mut $l, t)?;
    };
    ($l:ident, $p:ident, u64 $n:expr) => {
        let v: u64 = u($n);
        $p.push(Param::Scalar(Scalar::U64));
        $l.arg(&v);
    };
    ($l:ident, $p:ident, int $v:expr) => {
        let v: i32 = $v;
        $p.push(Param::Scalar(Scalar::I32));
        $l.arg(&v);
    };
    ($l:ident, $p:ident, acc $a:expr) => {
        let v: Acc = $a;
        $p.push(v.param());
        v.push(&mut $l);
    };
    ($l:ident, $p:ident, f64 $x:expr) => {
        let v: f64 = $x;
        $p.push(Param::Scalar(Scalar::F64));
        $l.arg(&v);
    };
}

/// The kernel `root_dtype` of `module`, loaded on `dev`, with its declared parameters.
pub(crate) fn func(
    dev: &Device,
    module: &'static KernelModule,
    root: &str,
    dtype: DType,
) -> Result<Kernel> {
    let name = entry(root, dtype);
    let params = module.entry_params(&name).ok_or_else(|| Error::Cuda {
        op: "cuda::ops::func",
        detail: format!(
            "module `{}` declares no kernel `{name}` with parameters of known types",
            module.name
        ),
    })?;
    Ok(Kernel {
        function: dev.function(module, &name)?,
        name,
        params,
    })
}

pub(crate) fn u(n: usize) -> u64 {
    n as u64
}

fn accum_flag(a: Accum) -> i32 {
    match a {
        Accum::Replace => 0,
        Accum::Add => 1,
    }
}

pub(crate) fn same_device(op: &'static str, ts: &[&CudaTensor]) -> Result<()> {
    if let Some(first) = ts.first() {
        for t in &ts[1..] {
            if t.device() != first.device() {
                return Err(Error::Invalid {
                    op,
                    detail: format!("tensors on {:?} and {:?}", first.device(), t.device()),
                });
            }
        }
    }
    Ok(())
}

/// `Err` unless `a` and `b` share a device, a dtype and a shape.
pub(crate) fn same_layout(op: &'static str, a: &CudaTensor, b: &CudaTensor) -> Result<()> {
    same_device(op, &[a, b])?;
    crate::spec::same_layout(op, a, b)
}

// ---- elementwise ---------------------------------------------------------------------

fn binary(op: &'static str, root: &str, a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
    same_layout(op, a, b)?;
    let dev = a.device();
    let mut out = CudaTensor::uninit(dev, a.shape(), a.dtype())?;
    let n = a.numel();
    if n == 0 {
        return Ok(out);
    }
    let f = func(dev, &source::ELEMENTWISE, root, a.dtype())?;
    launch_kernel!(op, dev, f, grid_for(n); src a, src b, dst &mut out, u64 n)?;
    Ok(out)
}

/// `a + b` (`Tensor::add`), any dtype.
pub fn add(a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
    binary("cuda::add", "add", a, b)
}

/// `a · b` elementwise (`Tensor::mul`), any dtype.
pub fn mul(a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
    binary("cuda::mul", "mul", a, b)
}

/// `a − b` (`ops::sub`), float dtypes.
pub fn sub(a: &CudaTensor, b: &CudaTensor) -> Result<CudaTensor> {
    want_float("cuda::ops::sub", a)?;
    binary("cuda::ops::sub", "sub", a, b)
}

/// Every element times `factor` rounded into the dtype (`Tensor::scale`).
pub fn scale(a: &CudaTensor, factor: f64) -> Result<CudaTensor> {
    const OP: &str = "cuda::scale";
    let dev = a.device();
    let mut out = CudaTensor::uninit(dev, a.shape(), a.dtype())?;
    let n = a.numel();
    if n == 0 {
        return Ok(out);
    }
    let f = func(dev, &source::ELEMENTWISE, "scale", a.dtype())?;
    launch_kernel!(OP, dev, f, grid_for(n);
        src a, dst &mut out, acc Acc::rounded(a.dtype(), factor), u64 n)?;
    Ok(out)
}

/// A copy converted to `dtype` (`Tensor::to_dtype`: through f64, rounded once).
pub fn to_dtype(a: &CudaTensor, dtype: DType) -> Result<CudaTensor> {
    const OP: &str = "cuda::to_dtype";
    let dev = a.device();
    let mut out = CudaTensor::uninit(dev, a.shape(), dtype)?;
    let n = a.numel();
    if n == 0 {
        return Ok(out);
    }
    let f = func(
        dev,
        &source::ELEMENTWISE,
        &format!("cast_{}", a.dtype()),
        dtype,
    )?;
    launch_kernel!(OP, dev, f, grid_for(n); src a, dst &mut out, u64 n)?;
    Ok(out)
}

fn row_op(op: &'static str, root: &str, x: &CudaTensor, w: &CudaTensor) -> Result<CudaTensor> {
    let (rows, n) = rows_last(op, x)?;
    same_device(op, &[x, w])?;
    want_float(op, x)?;
    check_row_param(op, x, w, n)?;
    let dev = x.device();
    let mut out = CudaTensor::uninit(dev, x.shape(), x.dtype())?;
    if rows * n == 0 {
        return Ok(out);
    }
    let f = func(dev, &source::ELEMENTWISE, root, x.dtype())?;
    launch_kernel!(op, dev, f, grid_for(rows * n); src x, src w, dst &mut out, u64 rows, u64 n)?;
    Ok(out)
}

/// `x[.., j] + bias[j]` (`ops::add_row`).
pub fn add_row(x: &CudaTensor, bias: &CudaTensor) -> Result<CudaTensor> {
    row_op("cuda::ops::add_row", "add_row", x, bias)
}

/// `x[.., j] · w[j]` (`ops::mul_row`).
pub fn mul_row(x: &CudaTensor, w: &CudaTensor) -> Result<CudaTensor> {
    row_op("cuda::ops::mul_row", "mul_row", x, w)
}

/// `dst (=|+=) Σ_rows x` (`ops::sum_rows_into`), rows summed in order.
pub fn sum_rows_into(dst: &mut CudaTensor, x: &CudaTensor, accum: Accum) -> Result<()> {
    const OP: &str = "cuda::ops::sum_rows";
    let (rows, n) = rows_last(OP, x)?;
    want_float(OP, x)?;
    same_device(OP, &[dst, x])?;
    check_dst(OP, dst, &[n], x.dtype())?;
    if n == 0 {
        return Ok(());
    }
    let dev = x.device().clone();
    let f = func(&dev, &source::ELEMENTWISE, "sum_rows", x.dtype())?;
    launch_kernel!(OP, dev, f, grid_for(n); dst dst, src x, u64 rows, u64 n, int accum_flag(accum))
}

/// `Σ_rows x` (`ops::sum_rows`).
pub fn sum_rows(x: &CudaTensor) -> Result<CudaTensor> {
    let (_, n) = rows_last("cuda::ops::sum_rows", x)?;
    let mut dst = CudaTensor::zeros(x.device(), &[n], x.dtype())?;
    sum_rows_into(&mut dst, x, Accum::Replace)?;
    Ok(dst)
}

// ---- activations ---------------------------------------------------------------------

fn unary(op: &'static str, root: &str, x: &CudaTensor) -> Result<CudaTensor> {
    want_float(op, x)?;
    let dev = x.device();
    let mut out = CudaTensor::uninit(dev, x.shape(), x.dtype())?;
    let n = x.numel();
    if n == 0 {
        return Ok(out);
    }
    let f = func(dev, &source::ACTIVATION, root, x.dtype())?;
    launch_kernel!(op, dev, f, grid_for(n); src x, dst &mut out, u64 n)?;
    Ok(out)
}

fn unary_back(
    op: &'static str,
    root: &str,
    dx: &mut CudaTensor,
    dy: &CudaTensor,
    x: &CudaTensor,
    accum: Accum,
) -> Result<()> {
    want_float(op, x)?;
    same_layout(op, dy, x)?;
    same_device(op, &[dx, x])?;
    check_dst(op, dx, x.shape(), x.dtype())?;
    let n = x.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = x.device().clone();
    let f = func(&dev, &source::ACTIVATION, root, x.dtype())?;
    launch_kernel!(op, dev, f, grid_for(n); dst dx, src dy, src x, u64 n, int accum_flag(accum))
}

/// `ops::gelu` (tanh form).
pub fn gelu(x: &CudaTensor) -> Result<CudaTensor> {
    unary("cuda::ops::gelu", "gelu", x)
}
/// `ops::silu`.
pub fn silu(x: &CudaTensor) -> Result<CudaTensor> {
    unary("cuda::ops::silu", "silu", x)
}
/// `ops::gelu_backward_into`.
pub fn gelu_backward_into(
    dx: &mut CudaTensor,
    dy: &CudaTensor,
    x: &CudaTensor,
    accum: Accum,
) -> Result<()> {
    unary_back(
        "cuda::ops::gelu_backward",
        "gelu_backward",
        dx,
        dy,
        x,
        accum,
    )
}
/// `ops::silu_backward_into`.
pub fn silu_backward_into(
    dx: &mut CudaTensor,
    dy: &CudaTensor,
    x: &CudaTensor,
    accum: Accum,
) -> Result<()> {
    unary_back(
        "cuda::ops::silu_backward",
        "silu_backward",
        dx,
        dy,
        x,
        accum,
    )
}
/// `ops::gelu_backward`.
pub fn gelu_backward(dy: &CudaTensor, x: &CudaTensor) -> Result<CudaTensor> {
    let mut dx = CudaTensor::uninit(x.device(), x.shape(), x.dtype())?;
    gelu_backward_into(&mut dx, dy, x, Accum::Replace)?;
    Ok(dx)
}
/// `ops::silu_backward`.
pub fn silu_backward(dy: &CudaTensor, x: &CudaTensor) -> Result<CudaTensor> {
    let mut dx = CudaTensor::uninit(x.device(), x.shape(), x.dtype())?;
    silu_backward_into(&mut dx, dy, x, Accum::Replace)?;
    Ok(dx)
}

/// `ops::swiglu`: `silu(gate)·up`.
pub fn swiglu(gate: &CudaTensor, up: &CudaTensor) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::swiglu";
    want_float(OP, gate)?;
    same_layout(OP, gate, up)?;
    let dev = gate.device();
    let mut out = CudaTensor::uninit(dev, gate.shape(), gate.dtype())?;
    let n = gate.numel();
    if n == 0 {
        return Ok(out);
    }
    let f = func(dev, &source::ACTIVATION, "swiglu", gate.dtype())?;
    launch_kernel!(OP, dev, f, grid_for(n); src gate, src up, dst &mut out, u64 n)?;
    Ok(out)
}

/// `ops::swiglu_backward_into`.
pub fn swiglu_backward_into(
    d_gate: &mut CudaTensor,
    d_up: &mut CudaTensor,
    dy: &CudaTensor,
    gate: &CudaTensor,
    up: &CudaTensor,
    accum: Accum,
) -> Result<()> {
    const OP: &str = "cuda::ops::swiglu_backward";
    want_float(OP, gate)?;
    same_layout(OP, gate, up)?;
    same_layout(OP, gate, dy)?;
    same_device(OP, &[gate, d_gate, d_up])?;
    check_dst(OP, d_gate, gate.shape(), gate.dtype())?;
    check_dst(OP, d_up, gate.shape(), gate.dtype())?;
    let n = gate.numel();
    if n == 0 {
        return Ok(());
    }
    let dev = gate.device().clone();
    let f = func(&dev, &source::ACTIVATION, "swiglu_backward", gate.dtype())?;
    launch_kernel!(OP, dev, f, grid_for(n);
        dst d_gate, dst d_up, src dy, src gate, src up, u64 n, int accum_flag(accum))
}

// ---- reductions ----------------------------------------------------------------------

/// The CPU's restored shape, which must also fit (the CPU op's `zeros_checked` checks that
/// later, with its own message).
fn restored(op: &'static str, dy: &CudaTensor, dim: usize, extent: usize) -> Result<Shape> {
    let s = crate::spec::reduction::restored(op, dy, dim, extent)?;
    if crate::checked_numel(&s).is_none() {
        return Err(Error::Invalid {
            op,
            detail: format!("restored shape {s:?} overflows"),
        });
    }
    Ok(s)
}

/// `ops::sum_dim`: the dim is removed.
pub fn sum_dim(x: &CudaTensor, dim: usize) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::sum_dim";
    want_float(OP, x)?;
    let (outer, extent, inner) = split_at(OP, x.shape(), dim)?;
    let dev = x.device();
    let mut out = CudaTensor::uninit(dev, &removed(x.shape(), dim), x.dtype())?;
    if outer * inner == 0 {
        return Ok(out);
    }
    let f = func(dev, &source::REDUCTION, "sum_dim", x.dtype())?;
    launch_kernel!(OP, dev, f, grid_for(outer * inner);
        src x, dst &mut out, u64 outer, u64 extent, u64 inner)?;
    Ok(out)
}

/// `ops::sum_dim_backward`: `dy` broadcast along the restored dim.
pub fn sum_dim_backward(dy: &CudaTensor, dim: usize, extent: usize) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::sum_dim_backward";
    want_float(OP, dy)?;
    let shape = restored(OP, dy, dim, extent)?;
    let (outer, _, inner) = split_at(OP, &shape, dim)?;
    let dev = dy.device();
    let mut dx = CudaTensor::uninit(dev, &shape, dy.dtype())?;
    let n = outer * extent * inner;
    if n == 0 {
        return Ok(dx);
    }
    let f = func(dev, &source::REDUCTION, "sum_dim_backward", dy.dtype())?;
    launch_kernel!(OP, dev, f, grid_for(n); src dy, dst &mut dx, u64 outer, u64 extent, u64 inner)?;
    Ok(dx)
}

/// What [`max_dim`] returns: values and `i64` argmax (the first maximum; a NaN wins).
#[derive(Debug)]
pub struct MaxDim {
    /// The maxima: `x`'s dtype, `x`'s shape without `dim`.
    pub values: CudaTensor,
    /// Where along `dim` each maximum is: [`DType::I64`], the shape of `values` (what
    /// [`max_dim_backward`] takes).
    pub indices: CudaTensor,
}

/// The device [`MaxDim`] as the `Tensor` op returns it (no copy: device tensors).
impl From<MaxDim> for crate::spec::reduction::MaxDim {
    fn from(m: MaxDim) -> Self {
        crate::spec::reduction::MaxDim {
            values: m.values.into(),
            indices: m.indices.into(),
        }
    }
}

/// `ops::max_dim`.
pub fn max_dim(x: &CudaTensor, dim: usize) -> Result<MaxDim> {
    const OP: &str = "cuda::ops::max_dim";
    want_float(OP, x)?;
    let (outer, extent, inner) = max_split(OP, x.shape(), dim)?;
    let dev = x.device();
    let shape = removed(x.shape(), dim);
    let mut values = CudaTensor::uninit(dev, &shape, x.dtype())?;
    let mut indices = CudaTensor::uninit(dev, &shape, DType::I64)?;
    if outer * inner > 0 {
        let f = func(dev, &source::REDUCTION, "max_dim", x.dtype())?;
        launch_kernel!(OP, dev, f, grid_for(outer * inner);
            src x, dst &mut values, dst &mut indices, u64 outer, u64 extent, u64 inner)?;
    }
    Ok(MaxDim { values, indices })
}

/// `ops::max_dim_backward`: `dy` at the argmax, zeros elsewhere. The indices are checked on
/// the host (copied back) before the launch, as the CPU op checks them.
pub fn max_dim_backward(
    dy: &CudaTensor,
    indices: &CudaTensor,
    dim: usize,
    extent: usize,
) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::max_dim_backward";
    want_float(OP, dy)?;
    same_device(OP, &[dy, indices])?;
    let shape = restored(OP, dy, dim, extent)?;
    check_indices(OP, dy, indices)?;
    let host = indices.to_host()?;
    check_index_range(OP, host.as_slice::<i64>()?, extent)?;
    let (outer, _, inner) = split_at(OP, &shape, dim)?;
    let dev = dy.device();
    let mut dx = CudaTensor::uninit(dev, &shape, dy.dtype())?;
    let n = outer * extent * inner;
    if n == 0 {
        return Ok(dx);
    }
    let f = func(dev, &source::REDUCTION, "max_dim_backward", dy.dtype())?;
    launch_kernel!(OP, dev, f, grid_for(n);
        src dy, src indices, dst &mut dx, u64 outer, u64 extent, u64 inner)?;
    Ok(dx)
}

// ---- softmax -------------------------------------------------------------------------

fn softmax_fwd(op: &'static str, root: &str, x: &CudaTensor) -> Result<CudaTensor> {
    want_float(op, x)?;
    let (rows, n) = rows_last(op, x)?;
    let dev = x.device();
    let mut y = CudaTensor::uninit(dev, x.shape(), x.dtype())?;
    if rows * n == 0 {
        return Ok(y);
    }
    let f = func(dev, &source::SOFTMAX, root, x.dtype())?;
    launch_kernel!(op, dev, f, per_row(op, rows, 0)?; src x, dst &mut y, u64 n)?;
    Ok(y)
}

fn softmax_back(
    op: &'static str,
    root: &str,
    dx: &mut CudaTensor,
    dy: &CudaTensor,
    y: &CudaTensor,
    accum: Accum,
) -> Result<()> {
    want_float(op, y)?;
    let (rows, n) = rows_last(op, y)?;
    same_layout(op, dy, y)?;
    same_device(op, &[dx, y])?;
    check_dst(op, dx, y.shape(), y.dtype())?;
    if rows * n == 0 {
        return Ok(());
    }
    let dev = y.device().clone();
    let f = func(&dev, &source::SOFTMAX, root, y.dtype())?;
    launch_kernel!(op, dev, f, per_row(op, rows, 0)?;
        dst dx, src dy, src y, u64 n, int accum_flag(accum))
}

/// `ops::softmax` along the last dim.
pub fn softmax(x: &CudaTensor) -> Result<CudaTensor> {
    softmax_fwd("cuda::ops::softmax", "softmax", x)
}
/// `ops::log_softmax` along the last dim.
pub fn log_softmax(x: &CudaTensor) -> Result<CudaTensor> {
    softmax_fwd("cuda::ops::log_softmax", "log_softmax", x)
}
/// `ops::softmax_backward_into` (from the forward output `y`).
pub fn softmax_backward_into(
    dx: &mut CudaTensor,
    dy: &CudaTensor,
    y: &CudaTensor,
    accum: Accum,
) -> Result<()> {
    softmax_back(
        "cuda::ops::softmax_backward",
        "softmax_backward",
        dx,
        dy,
        y,
        accum,
    )
}
/// `ops::log_softmax_backward_into` (from the forward output `y`).
pub fn log_softmax_backward_into(
    dx: &mut CudaTensor,
    dy: &CudaTensor,
    y: &CudaTensor,
    accum: Accum,
) -> Result<()> {
    softmax_back(
        "cuda::ops::log_softmax_backward",
        "log_softmax_backward",
        dx,
        dy,
        y,
        accum,
    )
}

// ---- norms ---------------------------------------------------------------------------

/// `ops::layer_norm` / `ops::rms_norm` outputs: `y`, and the statistics (compute dtype,
/// `x`'s leading shape); `mean` is `None` for RMSNorm.
#[derive(Debug)]
pub struct NormOutput {
    /// The normalized output, `x`'s shape and dtype.
    pub y: CudaTensor,
    /// LayerNorm: `Some` per-row mean, shape `x.shape()[..rank-1]`, compute dtype (`f64`
    /// for `f64`, else `f32`). RMSNorm: `None`.
    pub mean: Option<CudaTensor>,
    /// Per-row `1/√(var + eps)` (LayerNorm, biased variance) or `1/√(mean x² + eps)`
    /// (RMSNorm), shape `x.shape()[..rank-1]`, compute dtype.
    pub rstd: CudaTensor,
}

/// `ops::layer_norm` / `rms_norm` gradients; `dbias` is `None` for RMSNorm.
#[derive(Debug)]
pub struct NormGrads {
    /// The input gradient, `x`'s shape and dtype.
    pub dx: CudaTensor,
    /// The weight gradient `Σ_rows dy·x̂`, `[n]` in `x`'s dtype (this rank's rows only: a
    /// partial sum under sequence parallelism).
    pub dweight: CudaTensor,
    /// LayerNorm: `Some` bias gradient `Σ_rows dy`, `[n]` in `x`'s dtype (a partial sum
    /// like `dweight`). RMSNorm: `None`.
    pub dbias: Option<CudaTensor>,
}

impl NormOutput {
    /// As `ops::layer_norm` returns it (device tensors, no copy).
    ///
    /// # Panics
    /// If `mean` is `None`: [`layer_norm`] always sets it (an internal invariant).
    pub fn into_layer(self) -> crate::spec::norm::LayerNormOutput {
        crate::spec::norm::LayerNormOutput {
            y: self.y.into(),
            mean: self.mean.expect("layer_norm sets mean").into(),
            rstd: self.rstd.into(),
        }
    }

    /// As `ops::rms_norm` returns it (device tensors, no copy).
    pub fn into_rms(self) -> crate::spec::norm::RmsNormOutput {
        crate::spec::norm::RmsNormOutput {
            y: self.y.into(),
            rstd: self.rstd.into(),
        }
    }
}

impl NormGrads {
    /// As `ops::layer_norm_backward` returns them (device tensors, no copy).
    ///
    /// # Panics
    /// If `dbias` is `None`: [`layer_norm_backward`] always sets it (an internal invariant).
    pub fn into_layer(self) -> crate::spec::norm::LayerNormGrads {
        crate::spec::norm::LayerNormGrads {
            dx: self.dx.into(),
            dweight: self.dweight.into(),
            dbias: self.dbias.expect("layer_norm_backward sets dbias").into(),
        }
    }

    /// As `ops::rms_norm_backward` returns them (device tensors, no copy).
    pub fn into_rms(self) -> crate::spec::norm::RmsNormGrads {
        crate::spec::norm::RmsNormGrads {
            dx: self.dx.into(),
            dweight: self.dweight.into(),
        }
    }
}

fn norm_input(op: &'static str, x: &CudaTensor, params: &[&CudaTensor]) -> Result<(usize, usize)> {
    want_float(op, x)?;
    let (rows, n) = norm_rows(op, x)?;
    for p in params {
        same_device(op, &[x, p])?;
        check_row_param(op, x, *p, n)?;
    }
    Ok((rows, n))
}

/// `ops::layer_norm`: `y = (x − mean)·rstd·weight + bias` over the last dim.
pub fn layer_norm(
    x: &CudaTensor,
    weight: &CudaTensor,
    bias: &CudaTensor,
    eps: f64,
) -> Result<NormOutput> {
    norm_forward("cuda::ops::layer_norm", x, weight, Some(bias), eps)
}

/// `ops::rms_norm`: `y = x·rstd·weight` over the last dim.
pub fn rms_norm(x: &CudaTensor, weight: &CudaTensor, eps: f64) -> Result<NormOutput> {
    norm_forward("cuda::ops::rms_norm", x, weight, None, eps)
}

fn norm_forward(
    op: &'static str,
    x: &CudaTensor,
    w: &CudaTensor,
    b: Option<&CudaTensor>,
    eps: f64,
) -> Result<NormOutput> {
    let mut params = vec![w];
    params.extend(b);
    let (rows, n) = norm_input(op, x, &params)?;
    let dev = x.device();
    let lead = &x.shape()[..x.rank() - 1];
    let ad = acc_dtype(x.dtype());
    let mut y = CudaTensor::uninit(dev, x.shape(), x.dtype())?;
    let mut rstd = CudaTensor::uninit(dev, lead, ad)?;
    let mut mean = match b {
        Some(_) => Some(CudaTensor::uninit(dev, lead, ad)?),
        None => None,
    };
    if rows == 0 {
        return Ok(NormOutput { y, mean, rstd });
    }
    let e = Acc::lit(x.dtype(), eps);
    let cfg = per_row(op, rows, 0)?;
    match (b, mean.as_mut()) {
        (Some(b), Some(mean)) => {
            let f = func(dev, &source::NORM, "layer_norm", x.dtype())?;
            launch_kernel!(op, dev, f, cfg;
                dst &mut y, dst mean, dst &mut rstd, src x, src w, src b, u64 n, acc e)?;
        }
        _ => {
            let f = func(dev, &source::NORM, "rms_norm", x.dtype())?;
            launch_kernel!(op, dev, f, cfg; dst &mut y, dst &mut rstd, src x, src w, u64 n, acc e)?;
        }
    }
    Ok(NormOutput { y, mean, rstd })
}

/// `ops::layer_norm_backward` from the saved `mean` and `rstd`.
pub fn layer_norm_backward(
    dy: &CudaTensor,
    x: &CudaTensor,
    weight: &CudaTensor,
    mean: &CudaTensor,
    rstd: &CudaTensor,
) -> Result<NormGrads> {
    norm_backward(
        "cuda::ops::layer_norm_backward",
        dy,
        x,
        weight,
        Some(mean),
        rstd,
    )
}

/// `ops::rms_norm_backward` from the saved `rstd`.
pub fn rms_norm_backward(
    dy: &CudaTensor,
    x: &CudaTensor,
    weight: &CudaTensor,
    rstd: &CudaTensor,
) -> Result<NormGrads> {
    norm_backward("cuda::ops::rms_norm_backward", dy, x, weight, None, rstd)
}

fn norm_backward(
    op: &'static str,
    dy: &CudaTensor,
    x: &CudaTensor,
    w: &CudaTensor,
    mean: Option<&CudaTensor>,
    rstd: &CudaTensor,
) -> Result<NormGrads> {
    let (rows, n) = norm_input(op, x, &[w])?;
    same_layout(op, dy, x)?;
    for s in mean.iter().copied().chain([rstd]) {
        same_device(op, &[x, s])?;
        check_stat(op, x, s)?;
    }
    let dev = x.device();
    let mut dx = CudaTensor::uninit(dev, x.shape(), x.dtype())?;
    let mut dw = CudaTensor::uninit(dev, &[n], x.dtype())?;
    let mut db = match mean {
        Some(_) => Some(CudaTensor::uninit(dev, &[n], x.dtype())?),
        None => None,
    };
    if rows == 0 {
        // No rows: the parameter gradients are zero sums.
        let dw = CudaTensor::zeros(dev, &[n], x.dtype())?;
        let db = match mean {
            Some(_) => Some(CudaTensor::zeros(dev, &[n], x.dtype())?),
            None => None,
        };
        return Ok(NormGrads {
            dx,
            dweight: dw,
            dbias: db,
        });
    }
    let rows_cfg = per_row(op, rows, 0)?;
    match (mean, db.as_mut()) {
        (Some(mean), Some(db)) => {
            let f = func(dev, &source::NORM, "layer_norm_backward_dx", x.dtype())?;
            launch_kernel!(op, dev, f, rows_cfg;
                dst &mut dx, src dy, src x, src w, src mean, src rstd, u64 n)?;
            let f = func(dev, &source::NORM, "layer_norm_backward_dw", x.dtype())?;
            launch_kernel!(op, dev, f, grid_for(n);
                dst &mut dw, dst db, src dy, src x, src mean, src rstd, u64 rows, u64 n)?;
        }
        _ => {
            let f = func(dev, &source::NORM, "rms_norm_backward_dx", x.dtype())?;
            launch_kernel!(op, dev, f, rows_cfg;
                dst &mut dx, src dy, src x, src w, src rstd, u64 n)?;
            let f = func(dev, &source::NORM, "rms_norm_backward_dw", x.dtype())?;
            launch_kernel!(op, dev, f, grid_for(n);
                dst &mut dw, src dy, src x, src rstd, u64 rows, u64 n)?;
        }
    }
    Ok(NormGrads {
        dx,
        dweight: dw,
        dbias: db,
    })
}

// ---- embedding -----------------------------------------------------------------------

/// `ops::embedding_masked` (and `ops::embedding` with [`VocabShard::full`]): rows of `table`
/// (`[shard.len, hidden]`) for the ids in the shard, zeros for the others. `ids` (i64 or i32)
/// live on the host, where they are checked against the vocab, and are copied to the device.
pub fn embedding(table: &CudaTensor, ids: &Tensor, shard: VocabShard) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::embedding";
    want_float(OP, table)?;
    shard.check(OP)?;
    let hidden = table_dims(OP, table, shard.len)?;
    read_ids(OP, ids, shard.vocab)?;
    let dev = table.device();
    let mut out = CudaTensor::uninit(dev, &out_shape(ids, hidden), table.dtype())?;
    let tokens = ids.numel();
    if tokens * hidden == 0 {
        return Ok(out);
    }
    let ids_dev = CudaTensor::from_host(dev, ids)?;
    let root = if ids.dtype() == DType::I64 {
        "embedding_i64"
    } else {
        "embedding_i32"
    };
    let f = func(dev, &source::EMBEDDING, root, table.dtype())?;
    launch_kernel!(OP, dev, f, grid_for(tokens * hidden);
        src table, src &ids_dev, dst &mut out, u64 tokens, u64 hidden, u64 shard.start,
        u64 shard.len)?;
    Ok(out)
}

/// `ops::embedding_masked_backward_into`: `dtable[r] (=|+=) Σ dy[p]` over the positions `p`
/// whose id is row `r` of the shard, summed in position order (deterministic, the CPU's
/// order; no atomics). `dtable` is `[shard.len, hidden]`.
pub fn embedding_backward_into(
    dtable: &mut CudaTensor,
    dy: &CudaTensor,
    ids: &Tensor,
    shard: VocabShard,
    accum: Accum,
) -> Result<()> {
    const OP: &str = "cuda::ops::embedding_backward";
    want_float(OP, dy)?;
    shard.check(OP)?;
    same_device(OP, &[dtable, dy])?;
    let hidden = dy_hidden(OP, dy, ids)?;
    check_dst(OP, dtable, &[shard.len, hidden], dy.dtype())?;
    let ids_v = read_ids(OP, ids, shard.vocab)?;
    if shard.len * hidden == 0 {
        return Ok(());
    }
    // CSR of the hits: positions grouped by local row, in position order within a row.
    let mut starts = vec![0i64; shard.len + 1];
    for &id in &ids_v {
        if let Some(r) = shard.local(id) {
            starts[r + 1] += 1;
        }
    }
    for r in 0..shard.len {
        starts[r + 1] += starts[r];
    }
    let mut fill: Vec<i64> = starts[..shard.len].to_vec();
    let mut positions = vec![0i64; (starts[shard.len] as usize).max(1)];
    for (pos, &id) in ids_v.iter().enumerate() {
        if let Some(r) = shard.local(id) {
            positions[fill[r] as usize] = pos as i64;
            fill[r] += 1;
        }
    }
    let dev = dy.device().clone();
    let starts_dev = Tensor::from_vec(starts, &[shard.len + 1])?.upload(&dev)?;
    let n_pos = positions.len();
    let pos_dev = Tensor::from_vec(positions, &[n_pos])?.upload(&dev)?;
    let f = func(&dev, &source::EMBEDDING, "embedding_backward", dy.dtype())?;
    launch_kernel!(OP, dev, f, per_row(OP, shard.len, 0)?;
        dst dtable, src dy, src &starts_dev, src &pos_dev, u64 hidden, int accum_flag(accum))
}

// ---- cross-entropy pieces ------------------------------------------------------------

fn logits_dims(op: &'static str, logits: &CudaTensor) -> Result<(usize, usize)> {
    want_float(op, logits)?;
    match *logits.shape() {
        [r, c] => Ok((r, c)),
        _ => Err(Error::Invalid {
            op,
            detail: format!("logits must be [rows, cols], got {:?}", logits.shape()),
        }),
    }
}

fn check_stat_f64(op: &'static str, t: &CudaTensor, rows: usize) -> Result<()> {
    check_dst(op, t, &[rows], DType::F64)
}

/// Targets (host, i64 or i32, one per row, each `< vocab`) copied to the device as i64.
fn targets(
    op: &'static str,
    ids: &Tensor,
    rows: usize,
    vocab: usize,
    dev: &Device,
) -> Result<CudaTensor> {
    let v = read_ids(op, ids, vocab)?;
    if v.len() != rows {
        return Err(Error::Invalid {
            op,
            detail: format!("{} targets for {rows} rows", v.len()),
        });
    }
    let v: Vec<i64> = v.into_iter().map(|i| i as i64).collect();
    Tensor::from_vec(v, &[rows])?.upload(dev)
}

/// Cross-entropy piece 1: each row's max of the local logits (`[rows, cols]`), f64 `[rows]`.
/// All-reduce it (Max) over the vocab axes before piece 2.
pub fn ce_row_max(logits: &CudaTensor) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::ce_row_max";
    let (rows, cols) = logits_dims(OP, logits)?;
    let dev = logits.device();
    if cols == 0 {
        return Tensor::from_vec(vec![f64::NEG_INFINITY; rows], &[rows])?.upload(dev);
    }
    let mut m = CudaTensor::uninit(dev, &[rows], DType::F64)?;
    if rows == 0 {
        return Ok(m);
    }
    let f = func(dev, &source::CROSS_ENTROPY, "ce_row_max", logits.dtype())?;
    launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?; src logits, dst &mut m, u64 cols)?;
    Ok(m)
}

/// Cross-entropy piece 2: `Σ_c exp(l − max)` per row and the target's `l − max` (0 where the
/// target column is on another rank), both f64 `[rows]`; all-reduce both (Sum). `col_start`
/// is the first vocab column of the local logits; `vocab` the global vocab.
pub fn ce_sum_target(
    logits: &CudaTensor,
    max: &CudaTensor,
    ids: &Tensor,
    col_start: usize,
    vocab: usize,
) -> Result<(CudaTensor, CudaTensor)> {
    const OP: &str = "cuda::ops::ce_sum_target";
    let (rows, cols) = logits_dims(OP, logits)?;
    same_device(OP, &[logits, max])?;
    check_stat_f64(OP, max, rows)?;
    let dev = logits.device();
    let ids_dev = targets(OP, ids, rows, vocab, dev)?;
    let mut s = CudaTensor::zeros(dev, &[rows], DType::F64)?;
    let mut t = CudaTensor::zeros(dev, &[rows], DType::F64)?;
    if rows == 0 || cols == 0 {
        return Ok((s, t));
    }
    let f = func(dev, &source::CROSS_ENTROPY, "ce_sum_target", logits.dtype())?;
    launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?;
        src logits, src max, src &ids_dev, dst &mut s, dst &mut t, u64 cols, u64 col_start)?;
    Ok((s, t))
}

/// Cross-entropy piece 3: `loss = ln(sum) − target` per row, rounded into `dtype`.
pub fn ce_loss(sum: &CudaTensor, target: &CudaTensor, dtype: DType) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::ce_loss";
    let rows = sum.numel();
    same_device(OP, &[sum, target])?;
    check_stat_f64(OP, sum, rows)?;
    check_stat_f64(OP, target, rows)?;
    if !dtype.is_float() {
        return Err(crate::spec::not_float(OP, dtype));
    }
    let dev = sum.device();
    let mut loss = CudaTensor::uninit(dev, &[rows], dtype)?;
    if rows == 0 {
        return Ok(loss);
    }
    let f = func(dev, &source::CROSS_ENTROPY, "ce_loss", dtype)?;
    launch_kernel!(OP, dev, f, grid_for(rows); src sum, src target, dst &mut loss, u64 rows)?;
    Ok(loss)
}

/// Cross-entropy piece 4: the logits' gradient `(softmax − onehot(target))·dy[row]`, with
/// the reduced `max` and `sum`; `dy` is `[rows]` of the logits' dtype.
pub fn ce_grad(
    logits: &CudaTensor,
    max: &CudaTensor,
    sum: &CudaTensor,
    ids: &Tensor,
    dy: &CudaTensor,
    col_start: usize,
    vocab: usize,
) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::ce_grad";
    let (rows, cols) = logits_dims(OP, logits)?;
    same_device(OP, &[logits, max, sum, dy])?;
    check_stat_f64(OP, max, rows)?;
    check_stat_f64(OP, sum, rows)?;
    check_dst(OP, dy, &[rows], logits.dtype())?;
    let dev = logits.device();
    let ids_dev = targets(OP, ids, rows, vocab, dev)?;
    let mut dl = CudaTensor::uninit(dev, logits.shape(), logits.dtype())?;
    if rows * cols == 0 {
        return Ok(dl);
    }
    let f = func(dev, &source::CROSS_ENTROPY, "ce_grad", logits.dtype())?;
    launch_kernel!(OP, dev, f, per_row(OP, rows, 0)?;
        dst &mut dl, src logits, src max, src sum, src &ids_dev, src dy, u64 cols, u64 col_start)?;
    Ok(dl)
}

// ---- data movement -------------------------------------------------------------------

/// Copies `blocks` runs of `run` elements from `src[src_off + b·src_stride ..]` to
/// `dst[dst_off + b·dst_stride ..]`; the callers derive every number from checked shapes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn copy_blocks(
    op: &'static str,
    src: &CudaTensor,
    dst: &mut CudaTensor,
    blocks: usize,
    run: usize,
    src_stride: usize,
    src_off: usize,
    dst_stride: usize,
    dst_off: usize,
) -> Result<()> {
    if blocks * run == 0 {
        return Ok(());
    }
    debug_assert!(src_off + (blocks - 1) * src_stride + run <= src.numel());
    debug_assert!(dst_off + (blocks - 1) * dst_stride + run <= dst.numel());
    let dev = src.device().clone();
    let f = func(&dev, &source::COPY, "copy_blocks", src.dtype())?;
    launch_kernel!(op, dev, f, grid_for(blocks * run);
        src src, dst dst, u64 blocks, u64 run, u64 src_stride, u64 src_off, u64 dst_stride,
        u64 dst_off)
}

/// `Tensor::pack`: the pieces of `dim` (extents `sizes`) one after another, flat.
pub fn pack(t: &CudaTensor, dim: usize, sizes: &[usize]) -> Result<CudaTensor> {
    const OP: &str = "cuda::pack";
    check_pieces(OP, t.shape(), dim, sizes)?;
    let (outer, extent, inner) = split_at(OP, t.shape(), dim)?;
    let mut out = CudaTensor::uninit(t.device(), &[t.numel()], t.dtype())?;
    let (mut base, mut start) = (0, 0);
    for &len in sizes {
        let run = len * inner;
        copy_blocks(
            OP,
            t,
            &mut out,
            outer,
            run,
            extent * inner,
            start * inner,
            run,
            base,
        )?;
        base += outer * run;
        start += len;
    }
    Ok(out)
}

/// `Tensor::unpack`: the inverse of [`pack`].
pub fn unpack(
    flat: &CudaTensor,
    shape: &[usize],
    dim: usize,
    sizes: &[usize],
) -> Result<CudaTensor> {
    const OP: &str = "cuda::unpack";
    if crate::checked_numel(shape) != Some(flat.numel()) {
        return Err(Error::Invalid {
            op: OP,
            detail: format!(
                "{} packed elements do not fill shape {shape:?}",
                flat.numel()
            ),
        });
    }
    check_pieces(OP, shape, dim, sizes)?;
    let (outer, extent, inner) = split_at(OP, shape, dim)?;
    let mut out = CudaTensor::uninit(flat.device(), shape, flat.dtype())?;
    let (mut base, mut start) = (0, 0);
    for &len in sizes {
        let run = len * inner;
        copy_blocks(
            OP,
            flat,
            &mut out,
            outer,
            run,
            run,
            base,
            extent * inner,
            start * inner,
        )?;
        base += outer * run;
        start += len;
    }
    Ok(out)
}

/// `Tensor::narrow` (a copy on the device).
pub fn narrow(t: &CudaTensor, dim: usize, start: usize, len: usize) -> Result<CudaTensor> {
    const OP: &str = "cuda::narrow";
    let (outer, extent, inner) = split_at(OP, t.shape(), dim)?;
    if start.checked_add(len).is_none_or(|e| e > extent) {
        return Err(Error::Invalid {
            op: OP,
            detail: format!("{start}+{len} exceeds extent {extent} of dim {dim}"),
        });
    }
    let mut shape: Shape = t.shape().into();
    shape[dim] = len;
    let mut out = CudaTensor::uninit(t.device(), &shape, t.dtype())?;
    copy_blocks(
        OP,
        t,
        &mut out,
        outer,
        len * inner,
        extent * inner,
        start * inner,
        len * inner,
        0,
    )?;
    Ok(out)
}

/// `Tensor::write_at`: `src` copied into `dst` from `start` along `dim` (the other extents
/// must match). A `dst` buffer shared with another tensor is copied first (copy on write).
pub fn write_at(dst: &mut CudaTensor, dim: usize, start: usize, src: &CudaTensor) -> Result<()> {
    const OP: &str = "cuda::write_at";
    same_device(OP, &[dst, src])?;
    let (outer, extent, inner) = split_at(OP, dst.shape(), dim)?;
    let len = src.shape().get(dim).copied().unwrap_or(0);
    let fits = src.rank() == dst.rank()
        && src.dtype() == dst.dtype()
        && start.checked_add(len).is_some_and(|end| end <= extent)
        && (0..dst.rank()).all(|d| d == dim || src.shape()[d] == dst.shape()[d]);
    if !fits {
        return Err(Error::ShapeMismatch {
            op: OP,
            lhs: dst.shape().into(),
            rhs: src.shape().into(),
        });
    }
    copy_blocks(
        OP,
        src,
        dst,
        outer,
        len * inner,
        len * inner,
        0,
        extent * inner,
        start * inner,
    )
}

/// `Tensor::cat` along `dim`.
pub fn cat(ts: &[&CudaTensor], dim: usize) -> Result<CudaTensor> {
    const OP: &str = "cuda::cat";
    let Some(first) = ts.first() else {
        return Err(Error::Invalid {
            op: OP,
            detail: "nothing to concatenate".into(),
        });
    };
    same_device(OP, ts)?;
    let (outer, _, inner) = split_at(OP, first.shape(), dim)?;
    let mut total = 0usize;
    for t in ts {
        let fits = t.rank() == first.rank()
            && t.dtype() == first.dtype()
            && (0..t.rank()).all(|d| d == dim || t.shape()[d] == first.shape()[d]);
        if !fits {
            return Err(Error::ShapeMismatch {
                op: OP,
                lhs: first.shape().into(),
                rhs: t.shape().into(),
            });
        }
        total += t.shape()[dim];
    }
    let mut shape: Shape = first.shape().into();
    shape[dim] = total;
    let mut out = CudaTensor::uninit(first.device(), &shape, first.dtype())?;
    let mut at = 0;
    for t in ts {
        let len = t.shape()[dim];
        copy_blocks(
            OP,
            t,
            &mut out,
            outer,
            len * inner,
            len * inner,
            0,
            total * inner,
            at * inner,
        )?;
        at += len;
    }
    Ok(out)
}

// ---- attention -----------------------------------------------------------------------

/// Bytes of shared memory one block may use without opting in (48 KiB), less what the
/// block reductions take statically (2 × 256 × 8 bytes).
pub(crate) const SHARED_BUDGET: usize = 48 * 1024 - 4096;

/// The CPU's checks of `qkv` and `cfg`, then the bound shared memory puts on `seq_len`.
fn attn_dims(op: &'static str, qkv: &CudaTensor, cfg: &CausalAttention) -> Result<Dims> {
    want_float(op, qkv)?;
    let g = check_qkv(op, qkv, cfg)?;
    let s = g.s;
    let acc = acc_dtype(qkv.dtype()).size_in_bytes();
    // The backward's dk/dv kernel keeps two values per query of the sample.
    if 2 * s * acc > SHARED_BUDGET {
        return Err(Error::NotOnCuda {
            op,
            detail: format!(
                ": seq_len {s} needs {} bytes of shared memory per block, over the {SHARED_BUDGET} this kernel uses (seq_len ≤ {} for {})",
                2 * s * acc,
                SHARED_BUDGET / (2 * acc),
                qkv.dtype()
            ),
        });
    }
    Ok(g)
}

/// RoPE's cos/sin tables `[positions, d/2]`: the CPU's (`Rope::for_positions`, in f64),
/// rounded once into the compute type and uploaded.
pub(super) fn rope_tables(
    positions: impl ExactSizeIterator<Item = usize>,
    d: usize,
    base: f64,
    dtype: DType,
    dev: &Device,
) -> Result<(CudaTensor, CudaTensor)> {
    let shape = [positions.len(), d / 2];
    let (cos, sin) = Rope::<f64>::for_positions(positions, d, base).into_tables();
    let ad = acc_dtype(dtype);
    let to = |v: Vec<f64>| -> Result<CudaTensor> {
        let t = Tensor::from_vec(v, &shape)?;
        let t = if ad == DType::F64 { t } else { t.to_dtype(ad) };
        t.upload(dev)
    };
    Ok((to(cos)?, to(sin)?))
}

/// The tables for `cfg`'s rows, at positions `pos_offset + i`.
fn rope_for(cfg: &CausalAttention, dtype: DType, dev: &Device) -> Result<(CudaTensor, CudaTensor)> {
    let positions = (0..cfg.seq_len).map(|i| cfg.pos_offset + i);
    rope_tables(positions, cfg.head_dim, cfg.rope_base, dtype, dev)
}

/// q (rotated, scaled by 1/√d), k (rotated), v, each `[H, B, s, d]` in the compute type.
fn attn_load(
    op: &'static str,
    qkv: &CudaTensor,
    g: &Dims,
    cs: &CudaTensor,
    sn: &CudaTensor,
) -> Result<[CudaTensor; 3]> {
    let dev = qkv.device();
    let ad = acc_dtype(qkv.dtype());
    let shape = [g.heads, g.batch, g.s, g.d];
    let mut q = CudaTensor::uninit(dev, &shape, ad)?;
    let mut k = CudaTensor::uninit(dev, &shape, ad)?;
    let mut v = CudaTensor::uninit(dev, &shape, ad)?;
    let scale = Acc::lit(qkv.dtype(), 1.0 / (g.d as f64).sqrt());
    let f = func(dev, &source::ATTENTION, "attn_load", qkv.dtype())?;
    launch_kernel!(op, dev, f, grid_for(g.heads * g.batch * g.s * g.d / 2);
        src qkv, src cs, src sn, dst &mut q, dst &mut k, dst &mut v, u64 g.batch, u64 g.heads,
        u64 g.s, u64 g.d, acc scale)?;
    Ok([q, k, v])
}

/// `ops::causal_attention` on the device: `out` `[tokens, H·d]` and `lse` `[tokens, H]`
/// (compute dtype). `seq_len` is bounded by shared memory (an [`Error::NotOnCuda`] above it).
pub fn causal_attention(qkv: &CudaTensor, cfg: &CausalAttention) -> Result<CudaAttentionOutput> {
    const OP: &str = "cuda::ops::causal_attention";
    let g = attn_dims(OP, qkv, cfg)?;
    let dev = qkv.device();
    let ad = acc_dtype(qkv.dtype());
    let mut out = CudaTensor::uninit(dev, &[g.tokens, g.heads * g.d], qkv.dtype())?;
    let mut lse = CudaTensor::uninit(dev, &[g.tokens, g.heads], ad)?;
    if g.tokens * g.heads == 0 {
        return Ok(CudaAttentionOutput { out, lse });
    }
    let (cs, sn) = rope_for(cfg, qkv.dtype(), dev)?;
    let [q, k, v] = attn_load(OP, qkv, &g, &cs, &sn)?;
    let smem = (g.s * ad.size_in_bytes()) as u32;
    let f = func(dev, &source::ATTENTION, "attn_forward", qkv.dtype())?;
    launch_kernel!(OP, dev, f, per_row(OP, g.heads * g.batch * g.s, smem)?;
        src &q, src &k, src &v, dst &mut out, dst &mut lse, u64 g.batch, u64 g.heads, u64 g.s,
        u64 g.d)?;
    Ok(CudaAttentionOutput { out, lse })
}

/// What [`causal_attention`] returns (as [`CausalAttentionOutput`] on the host).
#[derive(Debug)]
pub struct CudaAttentionOutput {
    /// The attention output, `[tokens, heads·head_dim]` in `qkv`'s dtype.
    pub out: CudaTensor,
    /// `[tokens, heads]`: each query row's log-sum-exp of its scaled scores (`q·k/√d`),
    /// compute dtype; [`causal_attention_backward`] takes it with `out`.
    pub lse: CudaTensor,
}

/// As `ops::causal_attention` returns it (device tensors, no copy).
impl From<CudaAttentionOutput> for CausalAttentionOutput {
    fn from(o: CudaAttentionOutput) -> Self {
        CausalAttentionOutput {
            out: o.out.into(),
            lse: o.lse.into(),
        }
    }
}

impl CudaAttentionOutput {
    /// Both tensors copied to the host.
    pub fn to_host(&self) -> Result<CausalAttentionOutput> {
        Ok(CausalAttentionOutput {
            out: self.out.to_host()?,
            lse: self.lse.to_host()?,
        })
    }
}

/// `ops::causal_attention_backward` on the device: `dqkv` in `qkv`'s fused layout.
pub fn causal_attention_backward(
    dout: &CudaTensor,
    qkv: &CudaTensor,
    out: &CudaTensor,
    lse: &CudaTensor,
    cfg: &CausalAttention,
) -> Result<CudaTensor> {
    const OP: &str = "cuda::ops::causal_attention_backward";
    let g = attn_dims(OP, qkv, cfg)?;
    same_device(OP, &[dout, qkv, out, lse])?;
    let out_shape = [g.tokens, g.heads * g.d];
    for t in [dout, out] {
        check_dst(OP, t, &out_shape, qkv.dtype())?;
    }
    let ad = acc_dtype(qkv.dtype());
    check_dst(OP, lse, &[g.tokens, g.heads], ad)?;
    let dev = qkv.device();
    let mut dqkv = CudaTensor::uninit(dev, qkv.shape(), qkv.dtype())?;
    if g.tokens * g.heads == 0 {
        return Ok(dqkv);
    }
    let (cs, sn) = rope_for(cfg, qkv.dtype(), dev)?;
    let [q, k, v] = attn_load(OP, qkv, &g, &cs, &sn)?;
    let mut dsum = CudaTensor::uninit(dev, &[g.heads, g.batch, g.s], ad)?;
    let rows = g.heads * g.batch * g.s;
    let scale = Acc::lit(qkv.dtype(), 1.0 / (g.d as f64).sqrt());
    {
        let smem = (g.s * ad.size_in_bytes()) as u32;
        let f = func(dev, &source::ATTENTION, "attn_backward_dq", qkv.dtype())?;
        launch_kernel!(OP, dev, f, per_row(OP, rows, smem)?;
            src &q, src &k, src &v, src dout, src out, src lse, dst &mut dsum, dst &mut dqkv,
            src &cs, src &sn, u64 g.batch, u64 g.heads, u64 g.s, u64 g.d, acc scale)?;
    }
    {
        let smem = (2 * g.s * ad.size_in_bytes()) as u32;
        let f = func(dev, &source::ATTENTION, "attn_backward_dkv", qkv.dtype())?;
        launch_kernel!(OP, dev, f, per_row(OP, rows, smem)?;
            src &q, src &k, src &v, src dout, src lse, src &dsum, dst &mut dqkv, src &cs, src &sn,
            u64 g.batch, u64 g.heads, u64 g.s, u64 g.d)?;
    }
    Ok(dqkv)
}

// ---- matmul (cuBLAS) -----------------------------------------------------------------

/// `ops::matmul`'s shapes: `[m,k]·[k,n]`, `[b,m,k]·[b,k,n]`, `[b,m,k]·[k,n]` (rhs shared),
/// after each operand's [`Transpose`](crate::spec::Transpose) of its last two dims.
struct GemmPlan {
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    /// Elements between batch entries of rhs (0: shared).
    b_stride: usize,
    out: Shape,
}

fn gemm_plan(
    op: &'static str,
    a: &CudaTensor,
    ta: crate::spec::Transpose,
    b: &CudaTensor,
    tb: crate::spec::Transpose,
) -> Result<GemmPlan> {
    use crate::spec::Transpose;
    let mismatch = || Error::ShapeMismatch {
        op,
        lhs: a.shape().into(),
        rhs: b.shape().into(),
    };
    same_device(op, &[a, b])?;
    want_float(op, a)?;
    if a.dtype() != b.dtype() {
        return Err(Error::DTypeMismatch {
            op,
            lhs: a.dtype(),
            rhs: b.dtype(),
        });
    }
    let last2 = |t: &CudaTensor, tr: Transpose| -> Option<(usize, usize)> {
        let s = t.shape();
        let (r, c) = match s.len() {
            2 | 3 => (s[s.len() - 2], s[s.len() - 1]),
            _ => return None,
        };
        Some(if tr == Transpose::No { (r, c) } else { (c, r) })
    };
    let ((m, k), (k2, n)) = match (last2(a, ta), last2(b, tb)) {
        (Some(x), Some(y)) => (x, y),
        _ => return Err(mismatch()),
    };
    if k != k2 {
        return Err(mismatch());
    }
    let (batch, b_stride, out): (usize, usize, Shape) = match (a.rank(), b.rank()) {
        (2, 2) => (1, 0, [m, n][..].into()),
        (3, 3) if a.shape()[0] == b.shape()[0] => {
            (a.shape()[0], k * n, [a.shape()[0], m, n][..].into())
        }
        (3, 2) => (a.shape()[0], 0, [a.shape()[0], m, n][..].into()),
        _ => return Err(mismatch()),
    };
    let fits = |v: usize| i32::try_from(v).is_ok();
    if ![batch, m, n, k].into_iter().all(fits) {
        return Err(Error::NotOnCuda {
            op,
            detail: format!(
                ": a dim of {:?}·{:?} exceeds cuBLAS's i32 sizes",
                a.shape(),
                b.shape()
            ),
        });
    }
    Ok(GemmPlan {
        batch,
        m,
        n,
        k,
        b_stride,
        out,
    })
}

/// `op(a)·op(b)` through cuBLAS (`ops::matmul`): f32 and f64 natively, bf16/f16 inputs and
/// output with f32 compute (cublasGemmEx, rounded once). Row-major products run as the
/// column-major `Cᵀ = op(b)ᵀ·op(a)ᵀ`. Batches use the strided-batched call (stride 0 for a
/// shared rhs). cuBLAS's summation order is its own: results agree with the CPU to rounding.
pub fn matmul(
    a: &CudaTensor,
    ta: crate::spec::Transpose,
    b: &CudaTensor,
    tb: crate::spec::Transpose,
) -> Result<CudaTensor> {
    let plan = gemm_plan("cuda::ops::matmul", a, ta, b, tb)?;
    let mut dst = CudaTensor::uninit(a.device(), &plan.out, a.dtype())?;
    matmul_planned(&mut dst, a, ta, b, tb, Accum::Replace, &plan)?;
    Ok(dst)
}

/// [`matmul`] into `dst`, replacing or adding to it (`ops::matmul_into`).
pub fn matmul_into(
    dst: &mut CudaTensor,
    a: &CudaTensor,
    ta: crate::spec::Transpose,
    b: &CudaTensor,
    tb: crate::spec::Transpose,
    accum: Accum,
) -> Result<()> {
    const OP: &str = "cuda::ops::matmul";
    let plan = gemm_plan(OP, a, ta, b, tb)?;
    same_device(OP, &[dst, a])?;
    check_dst(OP, dst, &plan.out, a.dtype())?;
    matmul_planned(dst, a, ta, b, tb, accum, &plan)
}

/// cuBLAS's operations and leading dimensions for the row-major `C[m, n] = op(A)[m, k] ·
/// op(B)[k, n]`, computed column-major as `C'[n, m] = op'(B)[n, k] · op'(A)[k, m]`:
/// `((transa, lda), (transb, ldb))`, cuBLAS's first operand being `B`.
pub(super) fn gemm_ops<I: Copy>(
    ta: crate::spec::Transpose,
    tb: crate::spec::Transpose,
    (m, n, k): (I, I, I),
) -> (
    (cudarc::cublas::sys::cublasOperation_t, I),
    (cudarc::cublas::sys::cublasOperation_t, I),
) {
    use crate::spec::Transpose;
    use cudarc::cublas::sys::cublasOperation_t as Op;
    let a = match tb {
        Transpose::No => (Op::CUBLAS_OP_N, n),
        Transpose::Yes => (Op::CUBLAS_OP_T, k),
    };
    let b = match ta {
        Transpose::No => (Op::CUBLAS_OP_N, k),
        Transpose::Yes => (Op::CUBLAS_OP_T, m),
    };
    (a, b)
}

fn matmul_planned(
    dst: &mut CudaTensor,
    a: &CudaTensor,
    ta: crate::spec::Transpose,
    b: &CudaTensor,
    tb: crate::spec::Transpose,
    accum: Accum,
    p: &GemmPlan,
) -> Result<()> {
    use cudarc::cublas::{Gemm, GemmConfig, StridedBatchedConfig};
    const OP: &str = "cuda::ops::matmul";
    if p.batch * p.m * p.n == 0 {
        return Ok(());
    }
    if p.k == 0 {
        // An empty sum: zeros, or nothing to add.
        if accum == Accum::Replace {
            *dst = CudaTensor::zeros(a.device(), &p.out, a.dtype())?;
        }
        return Ok(());
    }
    let blas = a.device().blas()?.clone();
    let (m, n, k) = (p.m as i32, p.n as i32, p.k as i32);
    // Column-major: C'[n, m] = op'(B)[n, k] · op'(A)[k, m], B' = b, A' = a as stored.
    let ((transa, lda), (transb, ldb)) = gemm_ops(ta, tb, (m, n, k));
    let beta = if accum == Accum::Add { 1.0 } else { 0.0 };
    let (batch, stride_a, stride_b, stride_c) = (
        p.batch as i32,
        p.b_stride as i64,
        (p.m * p.k) as i64,
        (p.m * p.n) as i64,
    );
    let err = |e: cudarc::cublas::result::CublasError| Error::Cuda {
        op: OP,
        detail: e.to_string(),
    };
    // The typed slices of a, b and dst (variant `$v` of each; the plan checked a's and b's
    // dtypes and the callers dst's, so the `Err`s are not reached).
    macro_rules! buffers {
        ($v:ident) => {{
            let (CudaBuffer::$v(sa), CudaBuffer::$v(sb)) = (a.buffer(), b.buffer()) else {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    lhs: a.dtype(),
                    rhs: b.dtype(),
                });
            };
            let dt = dst.dtype();
            let CudaBuffer::$v(sc) = dst.buffer_mut()? else {
                return Err(Error::DTypeMismatch {
                    op: OP,
                    lhs: dt,
                    rhs: a.dtype(),
                });
            };
            (sa, sb, sc)
        }};
    }
    macro_rules! run {
        ($v:ident, $one:expr, $zero_or_one:expr) => {{
            let (sa, sb, sc) = buffers!($v);
            let cfg = GemmConfig {
                transa,
                transb,
                m: n,
                n: m,
                k,
                alpha: $one,
                lda,
                ldb,
                beta: $zero_or_one,
                ldc: n,
            };
            // SAFETY: the plan checked the shapes: each buffer holds the batch·rows·cols
            // elements the leading dimensions and strides above address.
            unsafe {
                if p.batch == 1 {
                    blas.gemm(cfg, sb, sa, sc)
                } else {
                    blas.gemm_strided_batched(
                        StridedBatchedConfig {
                            gemm: cfg,
                            batch_size: batch,
                            stride_a,
                            stride_b,
                            stride_c,
                        },
                        sb,
                        sa,
                        sc,
                    )
                }
            }
            .map_err(err)
        }};
    }
    // bf16/f16: cublasGemmEx with 16-bit inputs and output, f32 compute and f32 alpha/beta
    // (rounded once into the output); the buffers hold the bits as u16.
    macro_rules! run16 {
        ($v:ident, $ty:ident) => {{
            use cudarc::cublas::{result, sys};
            use cudarc::driver::{DevicePtr, DevicePtrMut};
            let (sa, sb, sc) = buffers!($v);
            let stream = a.device().stream().clone(); // the stream Device::blas bound cuBLAS to
            let (alpha, beta) = (1.0f32, beta as f32);
            let ty = sys::cudaDataType_t::$ty;
            let compute = sys::cublasComputeType_t::CUBLAS_COMPUTE_32F;
            let algo = sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT;
            // The guards order the stream after the buffers' last writes/reads and record
            // this use; they live until the call is queued.
            let (pb, _gb) = sb.device_ptr(&stream);
            let (pa, _ga) = sa.device_ptr(&stream);
            let (pc, _gc) = sc.device_ptr_mut(&stream);
            // SAFETY: as for the typed calls above; alpha/beta are host f32 as
            // CUBLAS_COMPUTE_32F requires; the pointers are device buffers of u16 bits.
            unsafe {
                if p.batch == 1 {
                    result::gemm_ex(
                        *blas.handle(),
                        transa,
                        transb,
                        n,
                        m,
                        k,
                        (&alpha as *const f32).cast(),
                        pb as *const _,
                        ty,
                        lda,
                        pa as *const _,
                        ty,
                        ldb,
                        (&beta as *const f32).cast(),
                        pc as *mut _,
                        ty,
                        n,
                        compute,
                        algo,
                    )
                } else {
                    result::gemm_strided_batched_ex(
                        *blas.handle(),
                        transa,
                        transb,
                        n,
                        m,
                        k,
                        (&alpha as *const f32).cast(),
                        pb as *const _,
                        ty,
                        lda,
                        stride_a,
                        pa as *const _,
                        ty,
                        ldb,
                        stride_b,
                        (&beta as *const f32).cast(),
                        pc as *mut _,
                        ty,
                        n,
                        stride_c,
                        batch,
                        compute,
                        algo,
                    )
                }
            }
            .map_err(err)
        }};
    }
    match a.dtype() {
        DType::F32 => run!(F32, 1.0f32, beta as f32),
        DType::F64 => run!(F64, 1.0f64, beta),
        DType::BF16 => run16!(BF16, CUDA_R_16BF),
        DType::F16 => run16!(F16, CUDA_R_16F),
        other => Err(crate::spec::not_float(OP, other)),
    }
}

// The context-parallel attention pieces, the MoE kernels and the collectives' reductions.
mod model_ops;
pub use model_ops::*;

mod optim;
pub use optim::{adamw_state_dtype, adamw_step, AdamWStep};
