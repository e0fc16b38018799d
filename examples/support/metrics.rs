//! Per-step training metrics: one JSON object per line (`train_gpt --metrics`), read back
//! and drawn as a PNG (`train_gpt --plot`, `plot_metrics`). Shared by the examples and
//! `tests/metrics.rs` through `#[path]`; each uses part of it.
#![allow(dead_code)]

use plotters::prelude::*;
use std::path::Path;

/// One training step, as rank 0 writes it.
#[derive(Clone, Debug, PartialEq)]
pub struct StepMetrics {
    pub step: usize,
    pub loss: f64,
    pub grad_norm: f64,
    /// Tokens of the global batch over this step's wall time on rank 0.
    pub tokens_per_s: f64,
    /// Bytes sent during this step per mesh axis (axis name, summed over ranks).
    pub bytes_sent: Vec<(String, u64)>,
    /// The most bytes of live tensors each rank held during this step, by rank.
    pub peak_tensor_bytes: Vec<u64>,
}

/// A JSON number: finite values as Rust's shortest round-trip `{}` (`{:e}` far from 1,
/// where `{}` spells out hundreds of digits that JSON readers reject as out of range),
/// NaN and ±inf as `null`.
pub fn json_number(x: f64) -> String {
    if !x.is_finite() {
        "null".into()
    } else if x != 0.0 && !(1e-5..1e16).contains(&x.abs()) {
        format!("{x:e}")
    } else {
        format!("{x}")
    }
}

/// A JSON string literal (the trace writer's escaping).
fn json_string(s: &str) -> String {
    dtensor::collectives::trace::json_str(s)
}

/// One line of the metrics file (without the newline).
pub fn jsonl_line(m: &StepMetrics) -> String {
    let bytes: Vec<String> = m
        .bytes_sent
        .iter()
        .map(|(axis, b)| format!("{}:{b}", json_string(axis)))
        .collect();
    let peaks: Vec<String> = m.peak_tensor_bytes.iter().map(u64::to_string).collect();
    format!(
        "{{\"step\":{},\"loss\":{},\"grad_norm\":{},\"tokens_per_s\":{},\"bytes_sent\":{{{}}},\"peak_tensor_bytes\":[{}]}}",
        m.step,
        json_number(m.loss),
        json_number(m.grad_norm),
        json_number(m.tokens_per_s),
        bytes.join(","),
        peaks.join(",")
    )
}

/// The whole file: one line per step.
pub fn jsonl(steps: &[StepMetrics]) -> String {
    steps.iter().map(|m| jsonl_line(m) + "\n").collect()
}

/// The number after `"key":` in one line this module wrote (`null` reads as NaN).
fn field(line: &str, key: &str) -> Option<f64> {
    let pat = format!("\"{key}\":");
    let rest = &line[line.find(&pat)? + pat.len()..];
    let end = rest.find([',', '}']).unwrap_or(rest.len());
    match rest[..end].trim() {
        "null" => Some(f64::NAN),
        v => v.parse().ok(),
    }
}

/// One step on the plot: `(step, loss, tokens_per_s)`.
pub type Point = (f64, f64, f64);

/// The [`Point`] of every line of a metrics file (blank lines skipped).
pub fn read_series(text: &str) -> Result<Vec<Point>, String> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            let get = |k| field(l, k).ok_or(format!("line {}: no number `{k}`", i + 1));
            Ok((get("step")?, get("loss")?, get("tokens_per_s")?))
        })
        .collect()
}

/// The text's font, shipped with the examples (DejaVu Sans Mono, see fonts/LICENSE-DejaVu.txt):
/// no system fonts needed.
const FONT: &[u8] = include_bytes!("fonts/DejaVuSansMono.ttf");

/// The `[lo, hi]` of the finite values, widened a little (and when flat).
fn range(v: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = v
        .filter(|x| x.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), x| {
            (l.min(x), h.max(x))
        });
    if lo > hi {
        return (0.0, 1.0);
    }
    let pad = if hi > lo {
        (hi - lo) * 0.05
    } else {
        lo.abs().max(1.0) * 0.05
    };
    (lo - pad, hi + pad)
}

/// Draws loss (top) and tokens/s (bottom) against step into a PNG at `out`.
pub fn draw(series: &[Point], out: &Path) -> Result<(), String> {
    if series.is_empty() {
        return Err("no steps to plot".into());
    }
    plotters::style::register_font("sans-serif", FontStyle::Normal, FONT)
        .map_err(|_| "the bundled font does not load".to_string())?;
    let e = |e: &dyn std::fmt::Display| format!("{}: {e}", out.display());
    let root = BitMapBackend::new(out, (900, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let panels = root.split_evenly((2, 1));
    let (x0, x1) = range(series.iter().map(|s| s.0));
    let x1 = x1.max(x0 + 1.0);
    // Panel 0: loss; panel 1: tokens/s.
    let specs = [
        ("training loss", "loss", RED),
        ("throughput", "tokens/s", BLUE),
    ];
    for (i, (area, (title, y_desc, color))) in panels.iter().zip(specs).enumerate() {
        let pick = |p: &Point| if i == 0 { p.1 } else { p.2 };
        let (y0, y1) = range(series.iter().map(pick));
        let mut chart = ChartBuilder::on(area)
            .caption(title, ("sans-serif", 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(80)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(|x| e(&x))?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc(y_desc)
            .label_style(("sans-serif", 14))
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| {
                if (y1 - y0) >= 10.0 {
                    format!("{y:.0}")
                } else {
                    format!("{y:.2}")
                }
            })
            .draw()
            .map_err(|x| e(&x))?;
        chart
            .draw_series(LineSeries::new(
                series
                    .iter()
                    .map(|s| (s.0, pick(s)))
                    .filter(|p| p.1.is_finite()),
                color.stroke_width(2),
            ))
            .map_err(|x| e(&x))?;
    }
    root.present().map_err(|x| e(&x))?;
    Ok(())
}
