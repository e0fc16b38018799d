//! Where an op runs: on the host when its tensors are in host memory, on a GPU when they
//! are all on that GPU (feature `cuda`).
//!
//! Every op of [`crate::ops`] and every computing method of [`Tensor`] starts with one
//! `dispatch!` line (or [`host_only`] for an op without a device kernel):
//!
//! | operands | what runs |
//! |---|---|
//! | all in host memory | the host kernel, as before devices existed |
//! | all on one GPU | the op's device launch (the `device` module of its front-door file), on `CudaTensor`s sharing the tensors' buffers |
//! | host and device, or two GPUs | [`Error::DeviceMismatch`] naming the op and both places |
//! | on a GPU, op without a kernel | [`Error::NotOnCuda`] naming the op (`Tensor::map`) |
//!
//! Without the `cuda` feature no device tensor can exist, and `dispatch!` expands to nothing.

use crate::{Error, Result, Tensor};

/// `Ok(true)` if the tensors are all on one GPU, `Ok(false)` if all in host memory (or
/// there are none), [`Error::DeviceMismatch`] otherwise.
pub(crate) fn on_cuda(op: &'static str, ts: &[&Tensor]) -> Result<bool> {
    let Some(first) = ts.first() else {
        return Ok(false);
    };
    if let Some(other) = ts[1..].iter().find(|t| t.device() != first.device()) {
        return Err(Error::DeviceMismatch {
            op,
            lhs: first.place(),
            rhs: other.place(),
        });
    }
    Ok(first.is_cuda())
}

/// `Ok` if the tensors are all in host memory; [`Error::NotOnCuda`] if they are all on one
/// GPU (the op has no device kernel), [`Error::DeviceMismatch`] if they are in different
/// places.
pub(crate) fn host_only(op: &'static str, ts: &[&Tensor]) -> Result<()> {
    if on_cuda(op, ts)? {
        return Err(Error::NotOnCuda {
            op,
            detail: String::new(),
        });
    }
    Ok(())
}

/// The ids of an embedding op whose `table` (or `dy`) is `t`: `None` if `t` is in host
/// memory (and so are the ids), else the ids in host memory, where the device op reads and
/// checks them against the vocab: as they are, or copied from `t`'s device. Ids are the one
/// operand allowed to be elsewhere than the tensor they index (they are small and the
/// device kernels take them from the host); ids on a device with a host `t`, or on another
/// device, are an [`Error::DeviceMismatch`].
#[cfg(feature = "cuda")]
pub(crate) fn host_ids(op: &'static str, t: &Tensor, ids: &Tensor) -> Result<Option<Tensor>> {
    match (t.device(), ids.device()) {
        (None, None) => Ok(None),
        (Some(_), None) => Ok(Some(ids.clone())),
        (Some(a), Some(b)) if a == b => ids.to_host().map(Some),
        _ => Err(Error::DeviceMismatch {
            op,
            lhs: t.place(),
            rhs: ids.place(),
        }),
    }
}

/// Runs `f` on the [`CudaTensor`](crate::cuda::CudaTensor) that `t` (a device tensor, as the
/// caller checked) is, moved out of `t` and back, so that its buffer's reference count is
/// `t`'s own: a kernel writing through it copies the buffer only if another tensor shares it.
#[cfg(feature = "cuda")]
pub(crate) fn with_cuda_mut<R>(
    t: &mut Tensor,
    f: impl FnOnce(&mut crate::cuda::CudaTensor) -> Result<R>,
) -> Result<R> {
    let mut c = take_cuda(t);
    let r = f(&mut c);
    *t = Tensor::from(c);
    r
}

/// The [`CudaTensor`](crate::cuda::CudaTensor) a device tensor (as the caller checked) is,
/// moved out of `t` (which holds an empty host placeholder until the caller puts a tensor
/// back), so that its buffer's reference count is `t`'s own.
///
/// # Panics
/// If `t` is a host tensor (callers check first).
#[cfg(feature = "cuda")]
pub(crate) fn take_cuda(t: &mut Tensor) -> crate::cuda::CudaTensor {
    match std::mem::replace(t, Tensor::placeholder()).try_into_cuda() {
        Ok(c) => c,
        Err(host) => {
            *t = host;
            panic!("take_cuda: a device tensor was expected (callers check)");
        }
    }
}

/// `*dst = y` for an `_into` op computed out of place on the device: `dst` must already
/// have `y`'s shape and dtype (as the host op requires); its old buffer is released (other
/// tensors sharing it keep their values).
#[cfg(feature = "cuda")]
pub(crate) fn replace(
    op: &'static str,
    dst: &mut crate::cuda::CudaTensor,
    y: crate::cuda::CudaTensor,
) -> Result<()> {
    if dst.device() != y.device() {
        return Err(Error::DeviceMismatch {
            op,
            lhs: format!("cuda:{}", dst.device().ordinal()),
            rhs: format!("cuda:{}", y.device().ordinal()),
        });
    }
    crate::spec::check_dst(op, dst, y.shape(), y.dtype())?;
    *dst = y;
    Ok(())
}

/// Runs an op on the device when its operands are there, returning from the enclosing
/// function; falls through to the host code when they are in host memory.
///
/// `dispatch!(OP, [a, b] => device::add(&a, &b))`: inside the body each named `&Tensor`
/// is rebound to its `CudaTensor` (sharing the buffer, O(1)); the body's `Result` is
/// converted with `Into` into the function's result. `dispatch!(OP, mut dst, [x] => body)`
/// also binds the out-parameter `dst: &mut Tensor` as `&mut CudaTensor` (see
/// [`with_cuda_mut`]). Operands in different places return [`Error::DeviceMismatch`].
#[cfg(feature = "cuda")]
macro_rules! dispatch {
    ($op:expr, [$($t:ident),+] => $body:expr) => {
        if $crate::dispatch::on_cuda($op, &[$(&*$t),+])? {
            $(let $t = $t.cuda_tensor()?;)+
            return ($body).map(::core::convert::Into::into);
        }
    };
    ($op:expr, mut $d:ident, [$($t:ident),*] => $body:expr) => {
        if $crate::dispatch::on_cuda($op, &[&*$d $(, &*$t)*])? {
            $(let $t = $t.cuda_tensor()?;)*
            return $crate::dispatch::with_cuda_mut($d, |$d| $body);
        }
    };
}

/// Without the `cuda` feature every tensor is in host memory: nothing to dispatch. A body
/// that calls the front door's `device::` launch has its arguments borrowed, so what the
/// checks computed for it (row counts, …) counts as used in this build too.
#[cfg(not(feature = "cuda"))]
macro_rules! dispatch {
    ($op:expr, [$($t:ident),+] => device::$f:ident($($a:expr),* $(,)?)) => {
        let _ = $op;
        $(let _ = &$t;)+
        $(let _ = &$a;)*
    };
    ($op:expr, mut $d:ident, [$($t:ident),*] => device::$f:ident($($a:expr),* $(,)?)) => {
        let _ = $op;
        let _ = &$d;
        $(let _ = &$t;)*
        $(let _ = &$a;)*
    };
    ($op:expr, [$($t:ident),+] => $body:expr) => {
        let _ = $op;
        $(let _ = &$t;)+
    };
    ($op:expr, mut $d:ident, [$($t:ident),*] => $body:expr) => {
        let _ = $op;
        let _ = &$d;
        $(let _ = &$t;)*
    };
}
