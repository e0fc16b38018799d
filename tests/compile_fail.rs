//! Compile-fail tests: placement mistakes must not compile, and rustc must say why in our
//! own words.
//!
//! Each file in `tests/compile_fail/` starts with `//~ expect: <text>` and must fail to
//! compile with an error whose message contains `<text>` — text we wrote in a
//! `#[diagnostic::on_unimplemented]`, so the assertion survives compiler updates (unlike a
//! full-transcript comparison). Files in `tests/compile_fail_pass/` must compile (a
//! control that the harness does not reject everything).
//!
//! All cases are checked with one `cargo check --bins --keep-going` of a scratch crate
//! that depends on this package.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

struct Case {
    name: String,
    expect: Vec<String>,
}

fn read_cases(dir: &Path) -> Vec<(PathBuf, Case)> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let expect = text
                .lines()
                .filter_map(|l| l.strip_prefix("//~ expect: "))
                .map(str::to_string)
                .collect();
            let name = p.file_stem().unwrap().to_string_lossy().into_owned();
            (p, Case { name, expect })
        })
        .collect();
    v.sort_by(|a, b| a.1.name.cmp(&b.1.name));
    v
}

/// `dtensor::prelude::Partial<dtensor::prelude::Max>` -> `Partial<Max>`: how rustc spells a
/// type's path depends on the compiler version and on imports, so messages are compared
/// without module paths.
fn strip_paths(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    let mut word = String::new();
    let mut chars = msg.chars().peekable();
    while let Some(c) = chars.next() {
        if c.is_ascii_alphanumeric() || c == '_' {
            word.push(c);
            continue;
        }
        if c == ':'
            && chars.peek() == Some(&':')
            && word.starts_with(|w: char| w.is_ascii_lowercase())
        {
            chars.next();
            word.clear();
            continue;
        }
        out.push_str(&word);
        word.clear();
        out.push(c);
    }
    out.push_str(&word);
    out
}

#[test]
fn placement_mistakes_do_not_compile_and_say_why() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = common::target_dir();
    let krate = target.join("compile-fail").join("crate");
    let bin_dir = krate.join("src").join("bin");
    let _ = std::fs::remove_dir_all(&bin_dir);
    std::fs::create_dir_all(&bin_dir).unwrap();
    std::fs::write(
        krate.join("Cargo.toml"),
        format!(
            "[package]\nname = \"dtensor-compile-fail\"\nversion = \"0.0.0\"\nedition = \"2021\"\npublish = false\n\n\
             [dependencies]\ndtensor = {{ path = {:?} }}\n\n[workspace]\n",
            root.display().to_string()
        ),
    )
    .unwrap();
    if root.join("Cargo.lock").exists() {
        std::fs::copy(root.join("Cargo.lock"), krate.join("Cargo.lock")).unwrap();
    }

    let fail = read_cases(&root.join("tests").join("compile_fail"));
    let pass = read_cases(&root.join("tests").join("compile_fail_pass"));
    assert!(fail.len() >= 12, "only {} compile-fail cases", fail.len());
    for (path, case) in fail.iter().chain(&pass) {
        std::fs::copy(path, bin_dir.join(format!("{}.rs", case.name))).unwrap();
    }

    let out = Command::new(env!("CARGO"))
        .args([
            "check",
            "--bins",
            "--keep-going",
            "--message-format=short",
            "--color=never",
        ])
        .arg("--target-dir")
        .arg(target.join("compile-fail").join("target"))
        .current_dir(&krate)
        .env_remove("RUSTFLAGS")
        .output()
        .expect("run cargo check");
    let stderr = String::from_utf8_lossy(&out.stderr);

    // `src/bin/<case>.rs:LINE:COL: error[E0277]: <message>` -> messages per case.
    let mut errors: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in stderr.lines() {
        let Some(rest) = line.strip_prefix("src/bin/") else {
            continue;
        };
        let Some((file, msg)) = rest.split_once(".rs:") else {
            continue;
        };
        if let Some((_, m)) = msg.split_once(": error") {
            errors
                .entry(file.to_string())
                .or_default()
                .push(strip_paths(m));
        }
    }

    let mut problems = Vec::new();
    for (_, case) in &fail {
        if case.expect.is_empty() {
            problems.push(format!("{}: no `//~ expect:` line", case.name));
        }
        let got = errors.get(&case.name).cloned().unwrap_or_default();
        if got.is_empty() {
            problems.push(format!("{}: compiled, but must not", case.name));
            continue;
        }
        for want in &case.expect {
            if !got.iter().any(|m| m.contains(want.as_str())) {
                problems.push(format!(
                    "{}: no error says {want:?}; errors were:\n    {}",
                    case.name,
                    got.join("\n    ")
                ));
            }
        }
    }
    for (_, case) in &pass {
        if let Some(got) = errors.get(&case.name) {
            problems.push(format!(
                "{}: must compile, but: {}",
                case.name,
                got.join("; ")
            ));
        }
    }
    assert!(
        problems.is_empty(),
        "{} problem(s):\n{}\n--- cargo stderr ---\n{}",
        problems.len(),
        problems.join("\n"),
        stderr
    );
    println!(
        "{} compile-fail cases rejected with our messages, {} control(s) compiled",
        fail.len(),
        pass.len()
    );
}
