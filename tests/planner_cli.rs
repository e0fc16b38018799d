//! `dtensor plan`, the facade's binary: one composition, a search, a refusal, a bad flag.
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
    // The bytes train_gpt's receipt shows for this run (per token, all ranks).
    assert!(out.contains("2080.0 B"), "{out}");
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
