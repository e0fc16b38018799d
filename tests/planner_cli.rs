//! `dtensor plan`, the facade's binary: one composition, a search, a refusal, bad flags and values.
use std::process::Command;

fn plan(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dtensor"))
        .arg("plan")
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn one_composition() {
    let (code, out, _) = plan(&["--model", "gpt-small", "--mesh", "dp=2,tp=2,sp"]);
    assert_eq!(code, 0);
    // The bytes train_gpt's receipt shows for this run (per token, all ranks): dp's
    // gradient all-reduce, the loss and the scored-token count (3195024 B over 3 steps of
    // 512 tokens in `train_gpt --mesh dp=2,tp=2 --sp --steps 3`: 2080.1 B).
    assert!(out.contains("2080.1 B"), "{out}");
    assert!(out.contains("5186.0 B"), "{out}");
    assert!(out.contains("fits in"), "{out}");
}

#[test]
fn search_and_refusal() {
    let (code, out, _) = plan(&["--model", "7b", "--devices", "16", "--top", "2"]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("#1 ") && out.contains("#2 "), "{out}");
    let (code, out, _) = plan(&["--model", "70b", "--devices", "8", "--top", "1"]);
    assert_eq!(code, 1);
    assert!(
        out.contains("REFUSED") && out.contains("over the 131 GiB"),
        "{out}"
    );
}

#[test]
fn usage_errors() {
    let (code, _, err) = plan(&["--model", "nope", "--devices", "2"]);
    assert_eq!(code, 2);
    assert!(err.contains("neither a preset"), "{err}");
    let (code, _, err) = plan(&["--model", "gpt-small", "--mesh", "dp=2", "--devices", "4"]);
    assert_eq!(code, 2);
    assert!(err.contains("2 ranks"), "{err}");
}

#[test]
fn composition_flags_set_switches_over_the_mesh() {
    let (code, out, err) = plan(&[
        "--model",
        "gpt-small",
        "--mesh",
        "pp=2,dp=2",
        "--zero",
        "1",
        "--schedule",
        "zb",
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("composition pp=2,dp=2,zero1,m=2,zb on 4 ranks"),
        "{out}"
    );
    // nn's ZB-H1 bubble, (p − 1)/(3m + p − 1) at p = m = 2.
    assert!(out.contains("pipeline bubble: 0.143"), "{out}");
}

#[test]
fn a_bad_value_exits_2_naming_the_flag() {
    for (flag, value) in [("--schedule", "2f2b"), ("--zero", "4"), ("--top", "many")] {
        let (code, _, err) = plan(&["--model", "gpt-small", "--mesh", "dp=2", flag, value]);
        assert_eq!(code, 2, "{flag} {value}: {err}");
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
}
