//! CUDA (feature `cuda`): a [`Device`] handle per GPU, kernels in CUDA C compiled by NVRTC at
//! run time, and device tensors: a [`Tensor`](crate::Tensor) whose storage is
//! `Storage::Cuda`, or the [`CudaTensor`] the kernels take (the same buffer). The ops
//! themselves are the front door's ([`crate::ops`]): each op's file launches its own
//! kernels, through the launch helpers of `cuda/launch.rs`.
//!
//! Nothing CUDA is linked: cudarc loads `libcuda.so.1`, `libnvrtc.so.13` (or `.12`) and
//! `libcublas` with `dlopen` on first use, so a build with the feature compiles and runs on a
//! machine without CUDA. Every entry point checks that the library it needs is present first
//! ([`driver_present`], [`nvrtc_present`], [`cublas_present`], each cached for the process) and
//! returns an [`Error`] naming what is missing (`"no CUDA driver found: …"`); it never panics.
//!
//! Kernels ([`source::MODULES`]) are compiled once per process and architecture: for a device,
//! straight to SASS (`--gpu-architecture=sm_XY` of the device, loaded as a cubin, so the
//! driver's PTX version ceiling never applies); for the no-GPU check in CI, to PTX for
//! `compute_90` ([`compile`]), which `ptxas` then assembles. Options: `--std=c++17
//! --fmad=false` (no fused multiply-add, so products and sums round like the CPU kernels).
//! No CUDA headers are used (the 16-bit types are converted by hand), so NVRTC needs no include
//! path.
//!
//! | what | library | found through |
//! |---|---|---|
//! | driver | `libcuda.so.1` | the NVIDIA driver install |
//! | NVRTC | `libnvrtc.so.13` (+ `libnvrtc-builtins`) | `LD_LIBRARY_PATH`, e.g. the `nvidia-cuda-nvrtc` wheel's `nvidia/cu13/lib` (`scripts/cuda-tools.sh`) |
//! | cuBLAS | `libcublas.so.13` | `LD_LIBRARY_PATH` |
//!
//! ```no_run
//! # fn main() -> dtensor_kernels::Result<()> {
//! use dtensor_kernels::{cuda, Tensor};
//! let dev = cuda::Device::new(0)?; // Err, not a panic, without a driver or GPU
//! let x = Tensor::from_fn(&[2, 3], |i| i as f32).to_device(&dev)?;
//! // The ops dispatch on where their operands are: this runs on `dev`.
//! let y = dtensor_kernels::ops::gelu(&x)?;
//! assert_eq!(y.device(), Some(&dev));
//! // The same buffer as a `CudaTensor` (no copy), e.g. for a device collective.
//! let c = y.cuda_tensor()?;
//! assert_eq!(c.to_host()?, y.to_host()?);
//! # Ok(()) }
//! ```

//! ## Running on a GPU machine
//!
//! Build the test binaries here (`cargo test -p dtensor-kernels --features cuda --no-run`),
//! strip them, and run them there with `--include-ignored`, with NVRTC (and cuBLAS for
//! `matmul`) on `LD_LIBRARY_PATH`: e.g. the `nvidia/cu13/lib` of a CUDA 13 `nvidia-cuda-nvrtc`
//! wheel. Kernels are loaded as cubins, so the driver's limit on the PTX version does not
//! apply.
//!
//! ## One tensor type: `Storage::Cuda`
//!
//! `Storage::Cuda(`[`CudaStorage`]`)` sits beside `Storage::Cpu`: a reference-counted
//! [`CudaBuffer`] and its [`Device`]. A device [`Tensor`](crate::Tensor) always starts at
//! element 0 of its buffer, so it converts to and from a [`CudaTensor`] in O(1)
//! (`Tensor::cuda_tensor`, `Tensor::try_into_cuda`, `Tensor::from`). Every op of
//! [`crate::ops`] and every computing `Tensor` method matches on where its operands are
//! (`kernels/src/dispatch.rs`): all on the host runs the CPU code, all on one device runs the
//! op's device launch, operands in different places are [`Error::DeviceMismatch`], and an op
//! without a kernel answers [`Error::NotOnCuda`]. Host accessors (`as_slice`,
//! `as_mut_slice`, `try_as_dyn_slice`, `to_storage`) answer [`Error::NotOnHost`], so code that
//! reads elements directly fails with an error instead of copying silently;
//! `Tensor::to_device` / `to_host` copy. A kernel writing into a buffer another tensor shares
//! copies it first on the device (copy on write), as the host does.
//!
//! The collectives take device memory as [`DeviceView`] / [`DeviceViewMut`]
//! (`Tensor::device_view`/`device_view_mut`, or views of a [`CudaBuffer`] range or a
//! [`CudaTensor`]) through the `*_device` methods of `dtensor-collectives`' `Communicator`,
//! which only the NCCL backend implements; the thread and MPI backends keep host slices.

pub(crate) mod launch;
pub mod source;
mod tensor;
mod view;

pub use tensor::{CudaBuffer, CudaStorage, CudaTensor};
pub use view::{DeviceView, DeviceViewMut};

use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use source::KernelModule;

/// Each `is_culib_present` dlopens every candidate name: checked once per process.
fn cached(cell: &'static OnceLock<bool>, check: fn() -> bool) -> bool {
    *cell.get_or_init(check)
}

/// Whether the CUDA driver library (`libcuda.so.1`) can be loaded.
pub fn driver_present() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the candidate names and drops what it opened.
    cached(&P, || unsafe { cudarc::driver::sys::is_culib_present() })
}

/// Whether NVRTC (`libnvrtc.so.13` or `.12`) can be loaded.
pub fn nvrtc_present() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    // SAFETY: as in `driver_present`.
    cached(&P, || unsafe { cudarc::nvrtc::sys::is_culib_present() })
}

/// Whether cuBLAS can be loaded.
pub fn cublas_present() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    // SAFETY: as in `driver_present`.
    cached(&P, || unsafe { cudarc::cublas::sys::is_culib_present() })
}

fn candidates(lib: &str) -> String {
    let names = cudarc::get_lib_name_candidates(lib);
    let so: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| n.starts_with("lib") && n.contains(".so"))
        .collect();
    so.join(", ")
}

/// `Ok` when the driver library loads; else [`Error::NoCudaDriver`] naming it.
pub fn require_driver(op: &'static str) -> Result<()> {
    if driver_present() {
        return Ok(());
    }
    Err(Error::NoCudaDriver {
        op,
        detail: format!(
            "libcuda.so.1 not loadable (no NVIDIA driver on this machine, or not on the loader path; searched {})",
            candidates("cuda")
        ),
    })
}

/// `Ok` when NVRTC loads; else [`Error::CudaLibraryMissing`] naming it.
pub fn require_nvrtc(op: &'static str) -> Result<()> {
    if nvrtc_present() {
        return Ok(());
    }
    Err(Error::CudaLibraryMissing {
        op,
        library: "NVRTC",
        detail: format!(
            "libnvrtc not loadable (install the nvidia-cuda-nvrtc wheel, 13.0.x, and put its nvidia/cu13/lib on LD_LIBRARY_PATH; searched {})",
            candidates("nvrtc")
        ),
    })
}

/// `Ok` when cuBLAS loads; else [`Error::CudaLibraryMissing`] naming it.
pub fn require_cublas(op: &'static str) -> Result<()> {
    if cublas_present() {
        return Ok(());
    }
    Err(Error::CudaLibraryMissing {
        op,
        library: "cuBLAS",
        detail: format!(
            "libcublas not loadable (put the CUDA 13 cuBLAS library on LD_LIBRARY_PATH; searched {})",
            candidates("cublas")
        ),
    })
}

pub(crate) fn driver_err(op: &'static str, e: cudarc::driver::DriverError) -> Error {
    Error::Cuda {
        op,
        detail: e.to_string(),
    }
}

/// The number of CUDA devices; `Err` (never a panic) without a driver.
pub fn device_count() -> Result<usize> {
    const OP: &str = "cuda::device_count";
    require_driver(OP)?;
    let n = CudaContext::device_count().map_err(|e| Error::NoCudaDriver {
        op: OP,
        detail: format!("cuInit/cuDeviceGetCount failed: {e}"),
    })?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// What NVRTC produces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// PTX for a virtual architecture, e.g. `"compute_90"` (what the no-GPU check assembles
    /// with `ptxas`).
    Ptx(&'static str),
    /// SASS for a real architecture `sm_{0}{1}` (what a device loads).
    Cubin(i32, i32),
}

/// The NVRTC options every module is compiled with, plus the architecture.
fn options(target: Target) -> Vec<String> {
    let arch = match target {
        Target::Ptx(a) => a.to_string(),
        Target::Cubin(maj, min) => format!("sm_{maj}{min}"),
    };
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "--fmad=false".into(),
    ]
}

/// Compiles one kernel module with NVRTC: PTX text as bytes for [`Target::Ptx`], a cubin for
/// [`Target::Cubin`]. Cached per process (module, target). A compile error is
/// [`Error::CudaCompile`] with NVRTC's log.
pub fn compile(module: &'static KernelModule, target: Target) -> Result<Arc<Vec<u8>>> {
    const OP: &str = "cuda::compile";
    type Cache = Mutex<HashMap<(&'static str, Target), Arc<Vec<u8>>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    require_nvrtc(OP)?;
    let cache = CACHE.get_or_init(Default::default);
    if let Some(hit) = lock(cache).get(&(module.name, target)) {
        return Ok(hit.clone());
    }
    let image = Arc::new(nvrtc_compile(OP, module, target)?);
    lock(cache).insert((module.name, target), image.clone());
    Ok(image)
}

/// A poisoned lock only means another thread panicked while holding a cache: the map is
/// still consistent (entries are inserted whole).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn nvrtc_compile(
    op: &'static str,
    module: &'static KernelModule,
    target: Target,
) -> Result<Vec<u8>> {
    use cudarc::nvrtc::{result, sys};
    use std::ffi::CString;
    let fail = |what: &str, e: result::NvrtcError| Error::Cuda {
        op,
        detail: format!("NVRTC {what} failed for module `{}`: {e:?}", module.name),
    };
    let src = CString::new(module.program()).map_err(|_| Error::Invalid {
        op,
        detail: format!("module `{}` source holds a NUL byte", module.name),
    })?;
    let name = CString::new(format!("{}.cu", module.name)).expect("module names hold no NUL");
    let prog = result::create_program(&src, Some(&name)).map_err(|e| fail("create", e))?;
    // Destroys the program on every path out.
    struct Prog(sys::nvrtcProgram);
    impl Drop for Prog {
        fn drop(&mut self) {
            // SAFETY: created above, destroyed once; a failure here leaks it, no more.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let prog = Prog(prog);
    let opts = options(target);
    // SAFETY: `prog` is a live program; the options are plain strings.
    if let Err(e) = unsafe { result::compile_program(prog.0, &opts) } {
        // SAFETY: as above.
        let log = unsafe { result::get_program_log(prog.0) }
            .map(|raw| {
                let bytes: Vec<u8> = raw
                    .iter()
                    .map(|&c| c as u8)
                    .take_while(|&b| b != 0)
                    .collect();
                String::from_utf8_lossy(&bytes).into_owned()
            })
            .unwrap_or_else(|le| format!("(no log: {le:?})"));
        return Err(Error::CudaCompile {
            op,
            module: module.name,
            options: format!("{} ({e:?})", opts.join(" ")),
            log,
        });
    }
    match target {
        Target::Ptx(_) => {
            // SAFETY: compiled program.
            let ptx = unsafe { result::get_ptx(prog.0) }.map_err(|e| fail("get PTX", e))?;
            Ok(ptx
                .iter()
                .map(|&c| c as u8)
                .take_while(|&b| b != 0)
                .collect())
        }
        Target::Cubin(..) => {
            let mut size = 0usize;
            // SAFETY: compiled program; `size` is a valid out pointer.
            unsafe { sys::nvrtcGetCUBINSize(prog.0, &mut size) }
                .result()
                .map_err(|e| fail("get cubin size", e))?;
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` has the `size` bytes NVRTC reported.
            unsafe { sys::nvrtcGetCUBIN(prog.0, cubin.as_mut_ptr().cast()) }
                .result()
                .map_err(|e| fail("get cubin", e))?;
            Ok(cubin)
        }
    }
}

/// A device's default memory pool (owned by the driver, valid as long as the context).
struct PoolHandle(cudarc::driver::sys::CUmemoryPool);

// SAFETY: a CUmemoryPool is a driver handle usable from any thread.
unsafe impl Send for PoolHandle {}
// SAFETY: as above; the driver synchronizes access to the pool.
unsafe impl Sync for PoolHandle {}

/// The caching allocator: cudarc allocates with `cuMemAllocAsync` from the device's default
/// memory pool and frees with `cuMemFreeAsync`. By default the pool hands freed memory back to
/// the driver at every synchronization (release threshold 0), so steady-state ops would keep
/// paying for fresh allocations; with the threshold at `u64::MAX` freed blocks stay cached and
/// are reused by later allocations on the stream, as PyTorch's caching allocator does.
/// [`Device::trim`] gives the cache back.
fn keep_freed_memory(op: &'static str, dev: cudarc::driver::sys::CUdevice) -> Result<PoolHandle> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: `dev` is a valid device of an initialized driver; `pool` is an out pointer.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, dev) }
        .result()
        .map_err(|e| driver_err(op, e))?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the release threshold is a u64 attribute read through the pointer.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()
    .map_err(|e| driver_err(op, e))?;
    Ok(PoolHandle(pool))
}

/// One GPU: its context, stream, lazily created cuBLAS handle and lazily loaded kernel
/// modules. Cheap to clone (shared); [`Device::new`] returns the same handle for the same
/// ordinal within a process. Work is queued on one stream in call order.
///
/// Memory: allocations come from the device's default stream-ordered memory pool (cudarc's
/// `CudaStream::alloc` calls `cuMemAllocAsync` when the device supports it, and frees with
/// `cuMemFreeAsync`). [`Device::new`] sets that pool's release threshold to `u64::MAX`, which
/// makes it a caching allocator: freed blocks stay with the pool and later allocations on the
/// stream reuse them, so ops in a steady state do not call the driver for memory.
/// [`Device::pool_reserved_bytes`] reports what it holds, [`Device::trim`] gives the cached
/// blocks back. On a device without memory pools ([`Device::has_memory_pool`] false) each
/// allocation is a `cuMemAlloc`.
#[derive(Clone)]
pub struct Device {
    inner: Arc<Inner>,
}

struct Inner {
    ordinal: usize,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: (i32, i32),
    /// The device's default stream-ordered memory pool, when the device has one.
    pool: Option<PoolHandle>,
    blas: OnceLock<Arc<cudarc::cublas::CudaBlas>>,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Device(cuda:{}, sm_{}{})",
            self.inner.ordinal, self.inner.arch.0, self.inner.arch.1
        )
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

impl Device {
    /// The device `ordinal` (cached per process). `Err` without a driver, NVRTC, or such a
    /// device; never a panic.
    pub fn new(ordinal: usize) -> Result<Device> {
        const OP: &str = "cuda::Device::new";
        static DEVICES: OnceLock<Mutex<HashMap<usize, Device>>> = OnceLock::new();
        require_driver(OP)?;
        let devices = DEVICES.get_or_init(Default::default);
        let mut map = lock(devices);
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let n = device_count()?;
        if ordinal >= n {
            return Err(Error::NoCudaDriver {
                op: OP,
                detail: format!("no CUDA device {ordinal}: the driver reports {n} device(s)"),
            });
        }
        // Kernels cannot be loaded without NVRTC: refuse now rather than at the first op.
        require_nvrtc(OP)?;
        let ctx = CudaContext::new(ordinal).map_err(|e| driver_err(OP, e))?;
        let arch = ctx.compute_capability().map_err(|e| driver_err(OP, e))?;
        let stream = ctx.default_stream();
        let pool = if ctx.has_async_alloc() {
            Some(keep_freed_memory(OP, ctx.cu_device())?)
        } else {
            None
        };
        let dev = Device {
            inner: Arc::new(Inner {
                ordinal,
                ctx,
                stream,
                arch,
                pool,
                blas: OnceLock::new(),
                modules: Mutex::new(HashMap::new()),
            }),
        };
        map.insert(ordinal, dev.clone());
        Ok(dev)
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.ordinal
    }

    /// The compute capability `(major, minor)` (`(9, 0)` on an H100/H200).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.inner.arch
    }

    /// The stream every op of this device is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.inner.stream
    }

    /// Waits for every queued op.
    pub fn synchronize(&self) -> Result<()> {
        self.inner
            .stream
            .synchronize()
            .map_err(|e| driver_err("cuda::Device::synchronize", e))
    }

    /// Whether allocations come from the driver's stream-ordered pool (the caching
    /// allocator); false on devices without memory pools, where each allocation is a
    /// `cuMemAlloc`.
    pub fn has_memory_pool(&self) -> bool {
        self.inner.pool.is_some()
    }

    /// Bytes the device's memory pool holds (in use or cached for reuse); 0 when the device
    /// has no stream-ordered pool.
    pub fn pool_reserved_bytes(&self) -> Result<usize> {
        use cudarc::driver::sys;
        let Some(pool) = &self.inner.pool else {
            return Ok(0);
        };
        let mut v: u64 = 0;
        // SAFETY: a live pool of this device; the attribute is a u64 written through `v`.
        unsafe {
            sys::cuMemPoolGetAttribute(
                pool.0,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT,
                (&mut v as *mut u64).cast(),
            )
        }
        .result()
        .map_err(|e| driver_err("cuda::Device::pool_reserved_bytes", e))?;
        Ok(v as usize)
    }

    /// Returns the pool's cached, unused memory to the driver (after the queued work ends).
    pub fn trim(&self) -> Result<()> {
        const OP: &str = "cuda::Device::trim";
        let Some(pool) = &self.inner.pool else {
            return Ok(());
        };
        self.synchronize()?;
        // SAFETY: a live pool of this device.
        unsafe { cudarc::driver::sys::cuMemPoolTrimTo(pool.0, 0) }
            .result()
            .map_err(|e| driver_err(OP, e))
    }

    /// The cuBLAS handle (created on first use, bound to the stream).
    pub fn blas(&self) -> Result<&Arc<cudarc::cublas::CudaBlas>> {
        const OP: &str = "cuda::Device::blas";
        if let Some(b) = self.inner.blas.get() {
            return Ok(b);
        }
        require_cublas(OP)?;
        // One handle per device, created under a lock: a handle created in a lost race would
        // be dropped, and cublasDestroy synchronizes the whole device, which never returns
        // while another rank on this GPU sits in an NCCL kernel waiting for this thread's
        // rank. (Creation is rare: one lock for all devices is enough.)
        static CREATE: Mutex<()> = Mutex::new(());
        let _creating = lock(&CREATE);
        if let Some(b) = self.inner.blas.get() {
            return Ok(b);
        }
        let b =
            cudarc::cublas::CudaBlas::new(self.inner.stream.clone()).map_err(|e| Error::Cuda {
                op: OP,
                detail: e.to_string(),
            })?;
        Ok(self.inner.blas.get_or_init(|| Arc::new(b)))
    }

    /// The kernel `name` of `module`, compiling (once per process) and loading (once per
    /// device) the module on first use.
    pub fn function(&self, module: &'static KernelModule, name: &str) -> Result<CudaFunction> {
        const OP: &str = "cuda::Device::function";
        let loaded = {
            let mut mods = lock(&self.inner.modules);
            match mods.get(module.name) {
                Some(m) => m.clone(),
                None => {
                    let (maj, min) = self.inner.arch;
                    let cubin = compile(module, Target::Cubin(maj, min))?;
                    let m = self
                        .inner
                        .ctx
                        .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.to_vec()))
                        .map_err(|e| driver_err(OP, e))?;
                    mods.insert(module.name, m.clone());
                    m
                }
            }
        };
        loaded.load_function(name).map_err(|e| Error::Cuda {
            op: OP,
            detail: format!("kernel `{name}` of module `{}`: {e}", module.name),
        })
    }
}
