//! Without the `nccl` feature, the NCCL entry points compile and say so on every rank.
#![cfg(not(feature = "nccl"))]

use dtensor_collectives::{nccl, Error};

#[test]
fn launch_without_feature_not_compiled_on_every_rank() {
    let results = nccl::launch(2, |_comm| -> Result<(), Error> {
        panic!("the closure must not run without the nccl feature")
    });
    assert_eq!(results.len(), 2);
    for r in results {
        let e = r.unwrap_err();
        assert_eq!(
            e,
            Error::NotCompiled {
                backend: "nccl",
                feature: "nccl"
            }
        );
        assert_eq!(
            e.to_string(),
            "nccl backend: not compiled with the `nccl` feature"
        );
    }
    assert!(!nccl::library_present());
    assert!(nccl::require_library().is_err());
}

#[test]
fn from_host_without_feature_not_compiled() {
    let results = dtensor_collectives::threads::launch(2, |host| {
        nccl::from_host(&*host, nccl::Options::default()).map(|_| ())
    });
    for r in results {
        assert!(matches!(
            r,
            Err(dtensor_collectives::threads::RankError::Returned(
                Error::NotCompiled { .. }
            ))
        ));
    }
}
