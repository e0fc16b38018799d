//! CUDA stand-ins (this build has no `cuda` feature): the entry points of the real module,
//! each answering [`Error::CudaNotCompiled`], so code that reaches for a GPU compiles on a
//! CPU-only build and says why it cannot run.

use crate::{Error, Result, Tensor};

fn not_compiled(op: &'static str) -> Error {
    Error::CudaNotCompiled { op }
}

/// Always false: this build does not load CUDA.
pub fn driver_present() -> bool {
    false
}

/// Always false: this build does not load CUDA.
pub fn nvrtc_present() -> bool {
    false
}

/// Always false: this build does not load CUDA.
pub fn cublas_present() -> bool {
    false
}

/// Always [`Error::CudaNotCompiled`].
pub fn device_count() -> Result<usize> {
    Err(not_compiled("cuda::device_count"))
}

/// A GPU handle; none can exist in this build ([`Device::new`] always fails).
#[derive(Clone, Debug, PartialEq)]
pub struct Device {
    never: std::convert::Infallible,
}

impl Device {
    /// Always [`Error::CudaNotCompiled`].
    pub fn new(_ordinal: usize) -> Result<Device> {
        Err(not_compiled("cuda::Device::new"))
    }

    /// The device's ordinal in the real module; here it cannot be called, since no
    /// [`Device`] value can exist.
    pub fn ordinal(&self) -> usize {
        match self.never {}
    }

    /// Proof that this code is not reached: no [`Device`] exists in this build.
    pub(crate) fn unreachable(&self) -> ! {
        match self.never {}
    }
}

/// A view of device memory (what the device collectives take); none can exist in this
/// build ([`Tensor::device_view`] answers [`Error::NotOnDevice`]).
#[derive(Debug)]
pub struct DeviceView<'a> {
    never: std::convert::Infallible,
    _life: std::marker::PhantomData<&'a ()>,
}

impl DeviceView<'_> {
    /// The number of elements in the real module; here it cannot be called.
    pub fn len(&self) -> usize {
        match self.never {}
    }

    /// Whether the view is empty in the real module; here it cannot be called.
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
}

/// A mutable view of device memory; none can exist in this build.
#[derive(Debug)]
pub struct DeviceViewMut<'a> {
    never: std::convert::Infallible,
    _life: std::marker::PhantomData<&'a ()>,
}

impl DeviceViewMut<'_> {
    /// The number of elements in the real module; here it cannot be called.
    pub fn len(&self) -> usize {
        match self.never {}
    }

    /// Whether the view is empty in the real module; here it cannot be called.
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
}

/// A device tensor; none can exist in this build.
#[derive(Debug)]
pub struct CudaTensor {
    never: std::convert::Infallible,
}

impl CudaTensor {
    /// Copies the tensor back to the host in the real module; here it cannot be called,
    /// since no [`CudaTensor`] value can exist.
    pub fn to_host(&self) -> Result<Tensor> {
        match self.never {}
    }

    /// The tensor's dimensions in the real module; here it cannot be called, since no
    /// [`CudaTensor`] value can exist.
    pub fn shape(&self) -> &[usize] {
        match self.never {}
    }

    /// Proof that this code is not reached: no [`CudaTensor`] exists in this build.
    pub(crate) fn unreachable(&self) -> ! {
        match self.never {}
    }
}
