//! The `mpi` backend without the `mpi` feature: a stand-in whose entry points say so.
//! With the feature, the backend is tested under `mpirun` by `scripts/mpi-tests.sh`
//! (this file then checks only what needs no MPI).

use dtensor_collectives::{mpi, Error};

#[cfg(not(feature = "mpi"))]
#[test]
fn init_without_feature_not_compiled() {
    let err = mpi::init().expect_err("no MPI backend in this build");
    assert_eq!(
        err,
        Error::NotCompiled {
            backend: "mpi",
            feature: "mpi"
        }
    );
    assert_eq!(
        err.to_string(),
        "mpi backend: not compiled with the `mpi` feature"
    );
    let err = mpi::init_with(mpi::Options::default()).expect_err("no MPI backend");
    assert!(matches!(err, Error::NotCompiled { .. }));
}

#[test]
fn launch_hint_names_mpirun_and_hostfile() {
    assert!(mpi::LAUNCH_HINT.contains("mpirun -np N"));
    assert!(mpi::LAUNCH_HINT.contains("--hostfile"));
    // Cargo's test harness is not started by mpirun (unless the whole run is).
    let _ = mpi::launched_by_mpirun();
}

#[test]
fn options_default_timeout_matches_threads_backend() {
    assert_eq!(
        mpi::Options::default().timeout,
        dtensor_collectives::threads::Options::default().timeout
    );
    // `Error` stays the crate's one error type.
    let _: fn() -> Result<mpi::Mpi, Error> = mpi::init;
}
