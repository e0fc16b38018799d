//! Declares one kernel module per `src/cuda/kernels/*.cu` file, so that a new `.cu` file is a
//! module (compiled by NVRTC, in `cuda::source::MODULES`, checked by `cuda_ptx`) with no
//! Rust list to keep by hand. Writes `$OUT_DIR/kernel_modules.rs`, which `cuda/source.rs`
//! includes: a `pub static <NAME>: KernelModule` per file, documented with the file's
//! header comment, and `MODULES`, every one of them in file-name order.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let manifest = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let dir = Path::new(&manifest).join("src/cuda/kernels");
    // A directory: cargo reruns this script when a file in it is added, removed or changed.
    println!("cargo:rerun-if-changed=src/cuda/kernels");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut out = String::new();
    for name in &names {
        // The static's name is the file's stem in capitals: a Rust identifier only if the
        // stem is one (lower case, digits, `_`), which the kernels' own names need anyway.
        let valid = name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        assert!(
            valid,
            "kernel file `{name}.cu`: name it in lower case, digits and `_` (it becomes the module `{}`)",
            name.to_uppercase()
        );
        let path = dir.join(format!("{name}.cu"));
        let source = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let header: Vec<&str> = source
            .lines()
            .map_while(|l| l.strip_prefix("//"))
            .map(|l| l.strip_prefix(' ').unwrap_or(l))
            .collect();
        writeln!(
            out,
            "/// The kernels of `kernels/{name}.cu`, read from its source."
        )
        .unwrap();
        if !header.is_empty() {
            // A text block: the C comment is shown as written, never parsed as Markdown.
            writeln!(out, "///\n/// ```text").unwrap();
            for line in header {
                writeln!(out, "/// {line}").unwrap();
            }
            writeln!(out, "/// ```").unwrap();
        }
        writeln!(
            out,
            "pub static {}: KernelModule = KernelModule::new({name:?}, include_str!({:?}));",
            name.to_uppercase(),
            path.display().to_string()
        )
        .unwrap();
    }
    writeln!(
        out,
        "/// Every kernel module: one per `.cu` file of `kernels/`, in file-name order."
    )
    .unwrap();
    let all: Vec<String> = names
        .iter()
        .map(|n| format!("&{}", n.to_uppercase()))
        .collect();
    writeln!(
        out,
        "pub static MODULES: [&KernelModule; {}] = [{}];",
        names.len(),
        all.join(", ")
    )
    .unwrap();
    let dest =
        Path::new(&std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("kernel_modules.rs");
    std::fs::write(&dest, out).unwrap_or_else(|e| panic!("writing {}: {e}", dest.display()));
}
