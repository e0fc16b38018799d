//! The compute rule tables close under duality, and that is checked when `dtensor-placement`
//! builds: adding a rule whose backward does not give the dual placements breaks the build.
//! The crate's `_check-rule-closure-fails` feature adds one (`S0·I→S0`: the `Invariant`
//! operand's gradient would come out `Partial`); this test builds the crate with and without
//! it.

mod common;

use std::path::PathBuf;
use std::process::Command;

fn check_placement(features: &[&str]) -> (bool, String) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = common::target_dir();
    let mut cmd = Command::new(env!("CARGO"));
    cmd.args([
        "check",
        "-p",
        "dtensor-placement",
        "--color=never",
        "--message-format=short",
    ])
    .arg("--target-dir")
    .arg(target.join("rule-closure"))
    .current_dir(&root)
    .env_remove("RUSTFLAGS");
    for f in features {
        cmd.args(["--features", f]);
    }
    let out = cmd.output().expect("run cargo check");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_rule_that_does_not_close_under_duality_breaks_the_build() {
    let (ok, stderr) = check_placement(&[]);
    assert!(ok, "the rule tables must build as they are:\n{stderr}");

    let (ok, stderr) = check_placement(&["_check-rule-closure-fails"]);
    assert!(!ok, "a bogus rule (S0·I→S0) must break the build");
    // dB = Aᵀ·dC = Shard<1>·Shard<0> gives Partial, but Invariant's dual is Invariant.
    assert!(
        stderr.contains("MatmulRule<Shard<1>>>::Out == Invariant"),
        "the failure must be the closure check of the bogus rule:\n{stderr}"
    );
}
