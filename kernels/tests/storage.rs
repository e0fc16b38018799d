//! The placement API of `Tensor` on host tensors, in every build: what a CPU-only machine
//! can check of `Storage::Cuda` (the device half runs in `cuda_gpu.rs` on a GPU).

use dtensor_kernels::{cuda, ops, DType, Error, Tensor};

fn iota(shape: &[usize]) -> Tensor {
    Tensor::from_fn(shape, |i| i as f32)
}

#[test]
fn host_tensor_is_on_no_device() {
    let t = iota(&[2, 3]);
    assert_eq!(t.device(), None);
    assert!(!t.is_cuda());
    let h = t.to_host().unwrap();
    assert!(
        h.shares_storage_with(&t),
        "to_host of a host tensor copies nothing"
    );
    assert_eq!(h, t);
}

#[test]
fn zeros_on_host_and_zeros_like_stay_on_the_host() {
    let z = Tensor::zeros_on(None, &[2, 2], DType::BF16).unwrap();
    assert_eq!(
        (z.shape(), z.dtype(), z.device()),
        (&[2, 2][..], DType::BF16, None)
    );
    assert!(z.to_f64_vec().iter().all(|&v| v == 0.0));
    let l = iota(&[3, 1]).zeros_like().unwrap();
    assert_eq!(
        (l.shape(), l.dtype(), l.is_cuda()),
        (&[3, 1][..], DType::F32, false)
    );
    assert_eq!(l.to_f64_vec(), vec![0.0; 3]);
    let e = Tensor::zeros_on(None, &[1 << 62], DType::F32).unwrap_err();
    assert!(e.to_string().contains("Tensor::zeros_on"), "{e}");
}

#[test]
fn device_accessors_on_a_host_tensor_err_not_on_device() {
    let mut t = iota(&[4]);
    let is = |e: Error, op: &str| {
        assert!(
            matches!(e, Error::NotOnDevice { op: o } if o == op),
            "{e:?}"
        );
        assert!(e.to_string().contains("host memory"), "{e}");
    };
    is(t.device_view().unwrap_err(), "Tensor::device_view");
    is(t.device_view_mut().unwrap_err(), "Tensor::device_view_mut");
    is(t.cuda_tensor().unwrap_err(), "Tensor::cuda_tensor");
    let back = t.clone().try_into_cuda().unwrap_err();
    assert!(
        back.shares_storage_with(&t),
        "a host tensor comes back as it was"
    );
}

#[test]
fn fallible_twins_agree_with_the_host_methods() {
    let t = iota(&[2, 3]);
    assert_eq!(t.try_scale(0.5).unwrap(), t.scale(0.5));
    assert_eq!(t.try_to_dtype(DType::F16).unwrap(), t.to_dtype(DType::F16));
    assert_eq!(t.try_map(|x| x * x).unwrap(), t.map(|x| x * x));
    let d = t.try_deep_clone().unwrap();
    assert!(!d.shares_storage_with(&t));
    assert_eq!(d, t);
    let mut m = t.clone();
    assert_eq!(t.try_as_dyn_slice().unwrap().len(), 6);
    m.try_as_dyn_slice_mut().unwrap();
    assert!(
        !m.shares_storage_with(&t),
        "a mutable slice copies a shared buffer"
    );
    assert_eq!(t.to_storage().unwrap().len(), 6);
}

#[test]
fn model_ops_run_on_the_host() {
    // The context-parallel and MoE ops dispatch like the others: host tensors, host code.
    let t = iota(&[3, 2]);
    let g = ops::gather_rows(&t, &[2, 0]).unwrap();
    assert_eq!(g.as_slice::<f32>().unwrap(), &[4., 5., 0., 1.]);
    let s = ops::scatter_add_rows(&t, &[1, 1, 0], 2).unwrap();
    assert_eq!(s.as_slice::<f32>().unwrap(), &[4., 5., 2., 4.]);
}

#[test]
fn placement_errors_read_well() {
    let e = Error::DeviceMismatch {
        op: "Tensor::add",
        lhs: "host".into(),
        rhs: "cuda:1".into(),
    };
    assert_eq!(
        e.to_string(),
        "Tensor::add: tensors on different devices: host vs cuda:1"
    );
    let e = Error::NotOnHost {
        op: "Tensor::as_slice",
        device: "cuda:0".into(),
    };
    assert_eq!(
        e.to_string(),
        "Tensor::as_slice: the tensor is on cuda:0, not in host memory (copy it with Tensor::to_host first)"
    );
}

#[test]
fn without_a_device_the_device_entry_points_err() {
    // No device can be made here (no feature, or no driver): every way to one is an Err.
    if cuda::driver_present() && cuda::device_count().is_ok_and(|n| n > 0) {
        eprintln!("SKIPPED: this machine has a GPU (cuda_gpu.rs covers it)");
        return;
    }
    let e = cuda::Device::new(0).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("not compiled with the `cuda` feature")
            || text.contains("no CUDA driver found"),
        "{text}"
    );
}
