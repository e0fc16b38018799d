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

/// A real run: 3 steps of the GPT on 4 thread ranks (dp = 2, tp = 2), measured per step as
/// `train_gpt --metrics` measures them, written as a metrics file: one valid line per step,
/// whose bytes per axis add up to the communicators' counters.
#[test]
fn a_run_writes_one_valid_line_per_step() {
    use dtensor::kernels::memory;
    use dtensor::nn::{AdamW, Gpt, GptConfig, Ids, NoSp};
    use dtensor::prelude::*;
    let cfg = GptConfig::small(DType::F32);
    let tokens = 4 * cfg.seq_len;
    let ids = Tensor::from_fn(&[tokens], |i| ((i * 5 + 1) % 256) as i64);
    let tg = Tensor::from_fn(&[tokens], |i| ((i * 5 + 6) % 256) as i64);
    let mesh = dtensor::nn::model_mesh(&"dp=2,tp=2".parse().unwrap()).unwrap();
    let ranks = threads::launch(4, |world| -> Result<_, Error> {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let mut model = Gpt::<NoSp>::new(cfg, &dm)?;
        let piece = |t: &Tensor| -> Result<DTensor<Ids>, Error> {
            DTensor::distribute(Some(t).filter(|_| dm.rank() == 0), 0, &dm)
        };
        let (i, t) = (piece(&ids)?, piece(&tg)?);
        let mut opt = AdamW::new(1e-3);
        let mut steps = Vec::new();
        for _ in 0..3 {
            memory::reset_peak();
            let before = dm.counters();
            let start = std::time::Instant::now();
            let r = model.train_step(&i, &t, &mut opt, 1.0)?;
            let secs = start.elapsed().as_secs_f64();
            let bytes: Vec<(String, u64)> = dm
                .counters()
                .into_iter()
                .zip(before)
                .map(|((k, c), (_, b))| (k.name().to_string(), c.since(&b).bytes_sent))
                .collect();
            steps.push((
                r.loss,
                r.grad_norm,
                tokens as f64 / secs,
                bytes,
                memory::peak_bytes(),
            ));
        }
        Ok(steps)
    });
    let ranks: Vec<_> = ranks.into_iter().map(|r| r.unwrap()).collect();
    let lines: Vec<StepMetrics> = (0..3)
        .map(|s| {
            let (loss, grad_norm, tps, _, _) = &ranks[0][s];
            let mut bytes = ranks[0][s].3.clone();
            for r in &ranks[1..] {
                for (b, (_, theirs)) in bytes.iter_mut().zip(&r[s].3) {
                    b.1 += theirs;
                }
            }
            StepMetrics {
                step: s,
                loss: *loss,
                grad_norm: *grad_norm,
                tokens_per_s: *tps,
                bytes_sent: bytes,
                peak_tensor_bytes: ranks.iter().map(|r| r[s].4 as u64).collect(),
            }
        })
        .collect();
    let path = std::env::temp_dir().join(format!("dtensor-metrics-{}.jsonl", std::process::id()));
    std::fs::write(&path, jsonl(&lines)).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    let parsed: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("every line is JSON"))
        .collect();
    assert_eq!(parsed.len(), 3, "one line per step");
    for (s, v) in parsed.iter().enumerate() {
        assert_eq!(v["step"], s as u64);
        assert!(v["loss"].as_f64().unwrap() > 0.0);
        assert!(v["grad_norm"].as_f64().unwrap() > 0.0);
        assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(v["bytes_sent"]["dp"].as_u64().unwrap() > 0);
        assert!(v["bytes_sent"]["tp"].as_u64().unwrap() > 0);
        let peaks = v["peak_tensor_bytes"].as_array().unwrap();
        assert_eq!(peaks.len(), 4, "one peak per rank");
        assert!(peaks.iter().all(|p| p.as_u64().unwrap() > 0));
    }
    // Every step of one model moves the same bytes.
    assert_eq!(parsed[1]["bytes_sent"], parsed[2]["bytes_sent"]);
}
