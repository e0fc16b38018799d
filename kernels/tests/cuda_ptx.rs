//! The no-GPU check of the CUDA kernels (feature `cuda`), run in CI: every kernel module is
//! compiled by NVRTC to PTX for `compute_90`; its entries must be exactly the kernel table read
//! from its `.cu` source (`KernelModule::roots`), each with the parameters the launches push
//! (`KernelModule::params`: count, order, and each one's PTX type, so an `int` for a `u64` or
//! a `double` for a `float` fails here); and `ptxas` assembles it for `sm_90` (the
//! H100/H200), reporting registers and spills per kernel. Plus the error paths without a
//! driver.
//!
//! Needs NVRTC on the loader path and `PTXAS` (see `scripts/cuda-tools.sh`). Without them the
//! test prints `SKIPPED: <reason>`; with `CUDA_TOOLS_REQUIRED=1` (CI) it fails instead.
#![cfg(feature = "cuda")]

use dtensor_kernels::cuda::{self, source, Target};
use std::path::PathBuf;
use std::process::Command;

fn required() -> bool {
    std::env::var("CUDA_TOOLS_REQUIRED").is_ok_and(|v| v == "1")
}

/// Prints why the test cannot run, or fails when CI promised the tools.
fn skip(reason: &str) {
    assert!(!required(), "CUDA_TOOLS_REQUIRED=1 but {reason}");
    eprintln!("SKIPPED: {reason}");
}

fn ptxas() -> Option<PathBuf> {
    std::env::var_os("PTXAS")
        .map(PathBuf::from)
        .filter(|p| p.exists())
}

/// Kernels simple enough that a spill means something went wrong.
fn may_spill(kernel: &str) -> bool {
    kernel.starts_with("attn_")
}

/// Static shared memory a kernel launched with dynamic shared memory may declare: those
/// launches (the `attn_` kernels) take up to `SHARED_BUDGET` = 48 KiB − 4096 bytes
/// (`kernels/src/cuda/launch.rs`), and a block may use 48 KiB in all without the opt-in
/// attribute, so their block reductions' arrays must fit in 4096 bytes or the longest
/// sequences fail at launch. (The other kernels take no dynamic shared memory.)
const STATIC_SMEM_MAX: u32 = 4096;

/// Kernels launched with dynamic shared memory (the scores of a row).
fn takes_dynamic_smem(kernel: &str) -> bool {
    kernel.starts_with("attn_")
}

/// `(kernel, bytes of static shared memory)` from `ptxas -v` output.
fn parse_smem(log: &str) -> Vec<(String, u32)> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest.split('\'').next().map(str::to_string);
        }
        if line.contains("Used ") {
            let smem = line
                .split(',')
                .find(|p| p.contains("bytes smem"))
                .and_then(|p| p.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            if let Some(k) = current.take() {
                out.push((k, smem));
            }
        }
    }
    out
}

/// `(kernel, registers, spill store bytes, spill load bytes)` from `ptxas -v` output.
fn parse_ptxas(log: &str) -> Vec<(String, u32, u32, u32)> {
    let mut out = Vec::new();
    let mut current: Option<String> = None;
    let mut spills = (0, 0);
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            current = rest.split('\'').next().map(str::to_string);
        }
        if line.contains("bytes spill stores") {
            let num = |key: &str| -> u32 {
                line.split(',')
                    .find(|p| p.contains(key))
                    .and_then(|p| p.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or(0)
            };
            spills = (num("spill stores"), num("spill loads"));
        }
        if let Some(rest) = line.split("Used ").nth(1) {
            let regs: u32 = rest
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(0);
            if let Some(k) = current.take() {
                out.push((k, regs, spills.0, spills.1));
            }
        }
    }
    out
}

/// The names of every `.entry name(` of `ptx`.
fn ptx_entries(ptx: &str) -> Vec<String> {
    ptx.split(".entry ")
        .skip(1)
        .filter_map(|rest| Some(rest[..rest.find('(')?].trim().to_string()))
        .collect()
}

/// The parameter types (`.u64`, `.u32`, `.f32`, `.f64`, …) of `.entry name(…)` in `ptx`.
fn ptx_params<'a>(ptx: &'a str, name: &str) -> Vec<&'a str> {
    let head = format!(".entry {name}(");
    let Some(at) = ptx.find(&head) else {
        return Vec::new();
    };
    let rest = &ptx[at + head.len()..];
    let list = &rest[..rest.find(')').unwrap_or(rest.len())];
    list.split(',')
        .filter_map(|p| {
            let mut words = p.split_whitespace();
            (words.next() == Some(".param"))
                .then(|| words.next())
                .flatten()
        })
        .collect()
}

#[test]
fn kernels_compile_to_ptx_and_assemble_for_sm90() {
    if !cuda::nvrtc_present() {
        return skip(
            "libnvrtc not found (run scripts/cuda-tools.sh and export what it prints: LD_LIBRARY_PATH)",
        );
    }
    let ptxas = ptxas();
    if ptxas.is_none() {
        skip(
            "ptxas not found (set PTXAS=…/nvidia/cu13/bin/ptxas; scripts/cuda-tools.sh prints it)",
        );
    }
    let dir = std::env::temp_dir().join(format!("dtensor-cuda-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (mut entries, mut bad) = (0, Vec::new());
    for m in source::MODULES {
        let t0 = std::time::Instant::now();
        let ptx = cuda::compile(m, Target::Ptx("compute_90")).unwrap_or_else(|e| panic!("{e}"));
        let text = String::from_utf8(ptx.to_vec()).unwrap();
        assert!(text.contains(".target sm_90"), "{}: not sm_90 PTX", m.name);
        // The table read from the source is exactly what the compiled code exports.
        let want = m.entries().unwrap_or_else(|e| panic!("{e}"));
        let mut table = want.clone();
        table.sort();
        let mut exported = ptx_entries(&text);
        exported.sort();
        assert_eq!(
            table, exported,
            "module {}: the kernel table read from {0}.cu (left) differs from the PTX's entries (right)",
            m.name
        );
        for r in m.roots().unwrap_or_else(|e| panic!("{e}")) {
            for &d in &r.dtypes {
                let e = source::entry(&r.name, d);
                let want: Vec<&str> = m
                    .params(&r.name, d)
                    .unwrap_or_else(|| panic!("{e}: no parameters read from {}.cu", m.name))
                    .into_iter()
                    .map(|p| p.ptx())
                    .collect();
                let got = ptx_params(&text, &e);
                if got != want {
                    bad.push(format!(
                        "{e}: the PTX takes {got:?}, the launches push (read from the .cu) {want:?}"
                    ));
                }
            }
        }
        entries += exported.len();
        let compile = t0.elapsed();
        let Some(ptxas) = &ptxas else { continue };
        let f = dir.join(format!("{}.ptx", m.name));
        std::fs::write(&f, &text).unwrap();
        let out = Command::new(ptxas)
            .args(["-arch=sm_90", "-v", "-o"])
            .arg(dir.join(format!("{}.cubin", m.name)))
            .arg(&f)
            .output()
            .unwrap();
        let log = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "ptxas failed on module {}:\n{log}",
            m.name
        );
        let stats = parse_ptxas(&log);
        assert_eq!(
            stats.len(),
            want.len(),
            "module {}: ptxas reported {} kernels:\n{log}",
            m.name,
            stats.len()
        );
        let smem = parse_smem(&log);
        assert_eq!(
            smem.len(),
            want.len(),
            "module {}: smem lines:\n{log}",
            m.name
        );
        for (k, bytes) in &smem {
            if takes_dynamic_smem(k) && *bytes > STATIC_SMEM_MAX {
                bad.push(format!(
                    "{k}: {bytes} bytes of static shared memory (> {STATIC_SMEM_MAX})"
                ));
            }
        }
        let max_smem = smem.iter().map(|s| s.1).max().unwrap_or(0);
        let max_regs = stats.iter().map(|s| s.1).max().unwrap_or(0);
        println!(
            "module {:<14} {:>3} kernels, NVRTC {:>5} ms, {:>7} bytes of PTX, registers ≤ {max_regs}, static smem ≤ {max_smem}",
            m.name,
            want.len(),
            compile.as_millis(),
            text.len()
        );
        for (k, regs, st, ld) in &stats {
            if *st > 0 || *ld > 0 {
                println!("  spills: {k}: {regs} registers, {st} bytes spill stores, {ld} bytes spill loads");
                if !may_spill(k) {
                    bad.push(format!("{k}: {st} bytes spill stores"));
                }
            }
        }
    }
    println!(
        "{entries} kernel entries compiled for compute_90{}",
        if ptxas.is_some() {
            " and assembled for sm_90 by ptxas"
        } else {
            ""
        }
    );
    std::fs::remove_dir_all(&dir).ok();
    assert!(
        bad.is_empty(),
        "kernel parameters differ from the launches', simple kernels spill, or static shared memory is over budget: {bad:?}"
    );
}

#[test]
fn compile_error_carries_the_nvrtc_log() {
    if !cuda::nvrtc_present() {
        return skip("libnvrtc not found");
    }
    static BROKEN: source::KernelModule = source::KernelModule::new(
        "broken",
        "extern \"C\" __global__ void broken_f32(float* x) { x[0] = undefined_name; }",
    );
    let e = cuda::compile(&BROKEN, Target::Ptx("compute_90")).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("broken") && msg.contains("undefined_name"),
        "{msg}"
    );
}

#[test]
fn no_driver_gives_an_error_not_a_panic() {
    if cuda::driver_present() {
        eprintln!("SKIPPED: a CUDA driver is present on this machine (this test checks the no-driver path)");
        return;
    }
    let e = cuda::Device::new(0).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("no CUDA driver found") && msg.contains("libcuda.so.1"),
        "{msg}"
    );
    let e = cuda::device_count().unwrap_err();
    assert!(e.to_string().contains("no CUDA driver found"), "{e}");
}
