//! The metrics lines `train_gpt --metrics` writes, and the plot `--plot` / `plot_metrics`
//! draw (the shared code of `examples/support/metrics.rs`).
//!
//! The whole path by hand (a few seconds in release):
//! `cargo run --release --example train_gpt -- --mesh dp=2,tp=2 --steps 20 --metrics m.jsonl --plot m.png`
//! `cargo run --release --example plot_metrics -- m.jsonl m2.png`

#[path = "../examples/support/metrics.rs"]
mod metrics;

use metrics::{json_number, jsonl, jsonl_line, read_series, StepMetrics};
use serde_json::Value;

fn sample(step: usize, loss: f64) -> StepMetrics {
    StepMetrics {
        step,
        loss,
        grad_norm: 0.75,
        tokens_per_s: 12345.5,
        bytes_sent: vec![("dp".into(), 1064976), ("tp".into(), 2646016)],
        peak_tensor_bytes: vec![3241988, 3241990],
    }
}

#[test]
fn numbers_round_trip_and_non_finite_is_null() {
    for x in [
        0.0,
        -1.5,
        1e-300,
        5.539355278015137,
        1e21,
        f64::MAX,
        f64::MIN_POSITIVE,
        123456.75,
    ] {
        let s = json_number(x);
        let back: f64 = serde_json::from_str::<Value>(&s).unwrap().as_f64().unwrap();
        assert_eq!(back, x, "{s}");
    }
    assert_eq!(json_number(2.5), "2.5");
    assert_eq!(json_number(1e-300), "1e-300");
    for x in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        assert_eq!(json_number(x), "null");
    }
}

#[test]
fn each_line_is_json_with_the_fields() {
    let steps = [sample(0, 5.25), sample(1, f64::NAN)];
    let text = jsonl(&steps);
    assert_eq!(text.lines().count(), 2);
    assert!(text.ends_with('\n'));
    for (line, m) in text.lines().zip(&steps) {
        assert_eq!(line, jsonl_line(m));
        let v: Value = serde_json::from_str(line).unwrap_or_else(|e| panic!("{line}: {e}"));
        let o = v.as_object().unwrap();
        let keys: Vec<&str> = o.keys().map(String::as_str).collect();
        for k in [
            "step",
            "loss",
            "grad_norm",
            "tokens_per_s",
            "bytes_sent",
            "peak_tensor_bytes",
        ] {
            assert!(keys.contains(&k), "{k} missing in {line}");
        }
        assert_eq!(v["step"].as_u64(), Some(m.step as u64));
        assert_eq!(v["grad_norm"].as_f64(), Some(0.75));
        assert_eq!(v["tokens_per_s"].as_f64(), Some(12345.5));
        assert_eq!(v["bytes_sent"]["dp"].as_u64(), Some(1064976));
        assert_eq!(v["bytes_sent"]["tp"].as_u64(), Some(2646016));
        let peaks: Vec<u64> = v["peak_tensor_bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p.as_u64().unwrap())
            .collect();
        assert_eq!(peaks, m.peak_tensor_bytes);
    }
    let v: Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert_eq!(v["loss"].as_f64(), Some(5.25));
    let v: Value = serde_json::from_str(text.lines().nth(1).unwrap()).unwrap();
    assert!(v["loss"].is_null(), "NaN loss is written as null");
}

#[test]
fn axis_names_are_escaped() {
    let mut m = sample(3, 1.0);
    m.bytes_sent = vec![("a\"b\\c\n".into(), 7)];
    let v: Value = serde_json::from_str(&jsonl_line(&m)).unwrap();
    assert_eq!(v["bytes_sent"]["a\"b\\c\n"].as_u64(), Some(7));
}

#[test]
fn series_read_back_and_plot_is_a_png() {
    let steps: Vec<StepMetrics> = (0..6)
        .map(|s| {
            sample(
                s,
                if s == 4 {
                    f64::NAN
                } else {
                    5.0 - s as f64 * 0.5
                },
            )
        })
        .collect();
    let series = read_series(&(jsonl(&steps) + "\n")).unwrap();
    assert_eq!(series.len(), 6);
    assert_eq!(series[2], (2.0, 4.0, 12345.5));
    assert!(series[4].1.is_nan());
    assert!(read_series("{\"step\":0}").is_err());

    // Text through the bundled font: no system fonts needed.
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("metrics_plot_test.png");
    metrics::draw(&series, &out).unwrap();
    let png = std::fs::read(&out).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"));
    assert!(
        png.len() > 10_000,
        "a 900x700 plot with text: {} bytes",
        png.len()
    );
    assert!(metrics::draw(&[], &out).is_err());
}
