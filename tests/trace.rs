//! The timeline recorder: a training step of the GPT on 4 thread ranks (dp = 2, tp = 2,
//! SP) recorded and written as Chrome trace-event JSON. The document parses, has one
//! process row per rank, its collective spans equal the communicators' counters (calls
//! and bytes, per mesh axis and rank, exactly), and the spans of each thread row nest.
//! (Its own test binary: recording is process-wide.)

use dtensor::collectives::trace;
use dtensor::nn::{AdamW, Gpt, GptConfig, Ids, Sp};
use dtensor::prelude::*;
use std::collections::BTreeMap;

/// A span's start, end and name.
type Interval = (f64, f64, String);

#[test]
fn a_traced_step_parses_and_matches_the_counters() {
    let cfg = GptConfig::small(DType::F32);
    let tokens = 4 * cfg.seq_len;
    let ids = Tensor::from_fn(&[tokens], |i| ((i * 7 + 3) % 256) as i64);
    let tg = Tensor::from_fn(&[tokens], |i| ((i * 7 + 10) % 256) as i64);
    let mesh = dtensor::nn::model_mesh(&"dp=2,tp=2".parse().unwrap()).unwrap();
    trace::enable();
    let counters = threads::launch(4, |world| -> Result<_, Error> {
        let dm = DeviceMesh::new(world, mesh.clone())?;
        let mut model = Gpt::<Sp>::new(cfg, &dm)?;
        let piece = |t: &Tensor| -> Result<DTensor<Ids>, Error> {
            DTensor::distribute(Some(t).filter(|_| dm.rank() == 0), 0, &dm)
        };
        let (i, t) = (piece(&ids)?, piece(&tg)?);
        let mut opt = AdamW::new(1e-3);
        model.train_step(&i, &t, &mut opt, 1.0)?;
        Ok((dm.rank(), dm.counters()))
    });
    trace::disable();
    let events = trace::take();
    let doc: serde_json::Value = serde_json::from_str(&trace::chrome_json(&events)).unwrap();
    let list = doc["traceEvents"].as_array().unwrap();

    // One process row per rank, named.
    let mut rows: Vec<i64> = list
        .iter()
        .filter(|e| e["name"] == "process_name")
        .map(|e| e["pid"].as_i64().unwrap())
        .collect();
    rows.sort_unstable();
    assert_eq!(rows, vec![0, 1, 2, 3]);

    // Collective spans per (rank, axis): calls and bytes equal the counters exactly.
    let mut seen: BTreeMap<(i64, String), (u64, u64, u64)> = BTreeMap::new();
    for e in list.iter().filter(|e| e["cat"] == "collective") {
        let key = (
            e["pid"].as_i64().unwrap(),
            e["args"]["axis"].as_str().unwrap().to_string(),
        );
        let s = seen.entry(key).or_default();
        s.0 += 1;
        s.1 += e["args"]["bytes_sent"].as_u64().unwrap();
        s.2 += e["args"]["bytes_received"].as_u64().unwrap();
        let (wait, data) = (
            e["args"]["wait_us"].as_f64().unwrap(),
            e["args"]["data_us"].as_f64().unwrap(),
        );
        assert!(wait >= 0.0 && data >= 0.0);
    }
    for r in counters {
        let (rank, per_axis) = r.unwrap();
        for (axis, c) in per_axis {
            let calls: u64 = CollectiveKind::ALL.iter().map(|&k| c.calls(k)).sum();
            let got = seen
                .get(&(rank as i64, axis.name().to_string()))
                .copied()
                .unwrap_or_default();
            assert_eq!(
                got,
                (calls, c.bytes_sent, c.bytes_received),
                "rank {rank} {axis}"
            );
            assert!(calls > 0, "rank {rank} {axis} did communicate");
        }
    }

    // Forward and backward spans of every layer, and the optimizer step, on every rank.
    for rank in 0..4 {
        let names: Vec<&str> = list
            .iter()
            .filter(|e| e["pid"] == rank && e["ph"] == "X")
            .map(|e| e["name"].as_str().unwrap())
            .collect();
        for want in [
            "embedding",
            "block.0",
            "block.1",
            "head",
            "head backward",
            "block.1 backward",
            "block.0 backward",
            "embedding backward",
            "optimizer step",
        ] {
            assert!(names.contains(&want), "rank {rank} has no `{want}` span");
        }
    }

    // On each thread row, spans nest: two spans are disjoint or one contains the other.
    let mut by_row: BTreeMap<(i64, i64), Vec<Interval>> = BTreeMap::new();
    for e in list.iter().filter(|e| e["ph"] == "X") {
        let ts = e["ts"].as_f64().unwrap();
        let end = ts + e["dur"].as_f64().unwrap();
        by_row
            .entry((e["pid"].as_i64().unwrap(), e["tid"].as_i64().unwrap()))
            .or_default()
            .push((ts, end, e["name"].as_str().unwrap().to_string()));
    }
    let eps = 0.01; // µs: the rounding of the printed timestamps
    for (row, spans) in by_row {
        for a in &spans {
            for b in &spans {
                let disjoint = a.1 <= b.0 + eps || b.1 <= a.0 + eps;
                let a_in_b = b.0 <= a.0 + eps && a.1 <= b.1 + eps;
                let b_in_a = a.0 <= b.0 + eps && b.1 <= a.1 + eps;
                assert!(
                    disjoint || a_in_b || b_in_a,
                    "row {row:?}: `{}` [{}, {}] and `{}` [{}, {}] overlap without nesting",
                    a.2,
                    a.0,
                    a.1,
                    b.2,
                    b.0,
                    b.1
                );
            }
        }
    }
}
