//! The bench helper that calls gemm with raw pointers (`benches/support/gemm_cases.rs`),
//! built here so its own tests run with `cargo test`.

#[path = "../benches/support/gemm_cases.rs"]
#[allow(dead_code)]
mod gemm_cases;
