//! The `cuda` module without the `cuda` feature: a stand-in whose entry points say so.
//! `scripts/test.sh` tests the workspace with the feature on (it compiles on any machine:
//! CUDA is loaded at run time), then runs this file without it.

#[cfg(not(feature = "cuda"))]
#[test]
fn entry_points_say_the_feature_is_off() {
    use dtensor_kernels::{cuda, Error};
    let expected = "not compiled with the `cuda` feature";
    let err = cuda::Device::new(0).expect_err("no CUDA in this build");
    assert!(matches!(err, Error::CudaNotCompiled { .. }), "{err:?}");
    assert!(err.to_string().contains(expected), "{err}");
    let err = cuda::device_count().expect_err("no CUDA in this build");
    assert!(err.to_string().contains(expected), "{err}");
    assert!(!cuda::driver_present() && !cuda::nvrtc_present() && !cuda::cublas_present());
}

#[cfg(feature = "cuda")]
#[test]
fn presence_checks_answer_without_panicking() {
    // With the feature, the same entry points load CUDA at run time: on a machine without a
    // driver they must return `Err`, never panic.
    use dtensor_kernels::cuda;
    if !cuda::driver_present() {
        let err = cuda::Device::new(0).expect_err("no driver on this machine");
        assert!(err.to_string().contains("no CUDA driver found"), "{err}");
    }
}
