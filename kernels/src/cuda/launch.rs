//! How the front doors launch their device kernels: the launch configurations ([`grid_for`],
//! [`per_row`]), the argument pushers, [`launch_kernel!`] (which compares the pushed
//! arguments with the kernel's `extern "C"` parameters before it launches), and
//! [`copy_blocks`], the strided copy several ops are made of. Each op's own launch sits in
//! its front door (`crate::ops`), beside its checks and its host call.
//!
//! Element counts and row counts come from the checked shapes, never from buffer lengths, so
//! a launch cannot index out of bounds. Every launch goes through [`launch_kernel!`], which
//! compares the arguments it pushes (count, order, scalar types, buffers' element types and
//! read/write) with the parameters of the kernel's `extern "C"` definition
//! ([`KernelModule::params`]) and answers an `Err` instead of launching on a mismatch. Ops
//! queue on the device's stream and return at once.

use crate::cuda::source::{self, entry, KernelModule, Param, Scalar};
use crate::cuda::{driver_err, CudaBuffer, CudaTensor, Device};
use crate::{DType, Error, Result};
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
    pub(crate) fn rounded(dtype: DType, v: f64) -> Acc {
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
        let k: $crate::cuda::launch::Kernel = $k;
        let mut pushed = Vec::new();
        let mut l = $dev.stream().launch_builder(&k.function);
        $($crate::cuda::launch::kernel_arg!(l, pushed, $kind $a);)+
        k.check($op, &pushed)?;
        $crate::cuda::launch::launch($op, &mut l, $cfg)
    }};
}
pub(crate) use launch_kernel;

/// One argument of [`launch_kernel!`], recorded in `$p` as the [`Param`] it is pushed as; a
/// scalar is bound to a local that outlives the launch.
macro_rules! kernel_arg {
    ($l:ident, $p:ident, src $t:expr) => {
        let t: &$crate::cuda::CudaTensor = $t;
        $p.push($crate::cuda::source::Param::Src(t.dtype()));
        $crate::cuda::launch::arg(&mut $l, t);
    };
    ($l:ident, $p:ident, dst $t:expr) => {
        let t: &mut $crate::cuda::CudaTensor = $t;
        $p.push($crate::cuda::source::Param::Dst(t.dtype()));
        $crate::cuda::launch::arg_mut(&mut $l, t)?;
    };
    ($l:ident, $p:ident, u64 $n:expr) => {
        let v: u64 = $crate::cuda::launch::u($n);
        $p.push($crate::cuda::source::Param::Scalar(
            $crate::cuda::source::Scalar::U64,
        ));
        ::cudarc::driver::PushKernelArg::arg(&mut $l, &v);
    };
    ($l:ident, $p:ident, int $v:expr) => {
        let v: i32 = $v;
        $p.push($crate::cuda::source::Param::Scalar(
            $crate::cuda::source::Scalar::I32,
        ));
        ::cudarc::driver::PushKernelArg::arg(&mut $l, &v);
    };
    ($l:ident, $p:ident, acc $a:expr) => {
        let v: $crate::cuda::launch::Acc = $a;
        $p.push(v.param());
        v.push(&mut $l);
    };
    ($l:ident, $p:ident, f64 $x:expr) => {
        let v: f64 = $x;
        $p.push($crate::cuda::source::Param::Scalar(
            $crate::cuda::source::Scalar::F64,
        ));
        ::cudarc::driver::PushKernelArg::arg(&mut $l, &v);
    };
}
pub(crate) use kernel_arg;

/// The kernel `root_dtype` of `module`, loaded on `dev`, with its declared parameters.
pub(crate) fn func(
    dev: &Device,
    module: &'static KernelModule,
    root: &str,
    dtype: DType,
) -> Result<Kernel> {
    let name = entry(root, dtype);
    let params = module.entry_params(&name).ok_or_else(|| Error::Cuda {
        op: "cuda::launch::func",
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

/// Bytes of shared memory one block may use without opting in (48 KiB), less what the
/// block reductions take statically (2 × 256 × 8 bytes).
pub(crate) const SHARED_BUDGET: usize = 48 * 1024 - 4096;

/// `root(a[i], b[i])` for every element into a new tensor of `a`'s shape and dtype, one
/// thread per element (`elementwise.cu`): the elementwise binary ops (`Tensor::add`, `mul`,
/// `ops::sub`), whose front doors checked that `a` and `b` are laid out alike.
pub(crate) fn binary(
    op: &'static str,
    root: &str,
    a: &CudaTensor,
    b: &CudaTensor,
) -> Result<CudaTensor> {
    let dev = a.device();
    let mut out = CudaTensor::uninit(dev, a.shape(), a.dtype())?;
    let n = a.numel();
    if n > 0 {
        let f = func(dev, &source::ELEMENTWISE, root, a.dtype())?;
        launch_kernel!(op, dev, f, grid_for(n); src a, src b, dst &mut out, u64 n)?;
    }
    Ok(out)
}
