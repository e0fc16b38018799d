//! The loader: packing across documents (segment and position ids against each token's
//! own document and offset), the validation split, blends by weight, and the sampler
//! (disjoint ranks covering the epoch, resume equal to an uninterrupted run).

use dtensor_datasets::indexed::IndexedDatasetBuilder;
use dtensor_datasets::loader::{
    Batch, Blend, DataLoader, Holdout, PackedDataset, Packing, SampleSource, Sampler, SamplerState,
    Split,
};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dtensor-loader-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Token `t` of document `d` is `base + 1000·d + t`, so every token names its document and
/// its offset. Document lengths vary from 1 to 57; document 6 is empty; document 9 is two
/// sequences.
fn write_docs(prefix: &Path, documents: u32, base: i32) -> Vec<usize> {
    let mut b = IndexedDatasetBuilder::<i32>::create(prefix).unwrap();
    let mut lens = Vec::new();
    for d in 0..documents {
        let len = if d == 6 {
            0
        } else {
            1 + (d as usize * 37) % 57
        };
        let toks: Vec<i32> = (0..len as i32)
            .map(|t| base + 1000 * d as i32 + t)
            .collect();
        if d == 9 {
            b.add_sequence(&toks[..len / 2]).unwrap();
            b.add_sequence(&toks[len / 2..]).unwrap();
            b.end_document().unwrap();
        } else {
            b.add_document(&toks).unwrap();
        }
        lens.push(len);
    }
    b.finish().unwrap();
    lens
}

fn doc_of(t: u32) -> u32 {
    (t % 100_000) / 1000
}

fn offset_of(t: u32) -> u32 {
    t % 1000
}

fn all_samples(p: &impl SampleSource) -> Batch {
    let mut b = Batch::default();
    for i in 0..p.len_samples() {
        p.sample_into(i, &mut b).unwrap();
    }
    b
}

#[test]
fn packed_document_masks_ids_follow_each_tokens_document() {
    let dir = scratch("packing");
    let prefix = dir.join("docs");
    let lens = write_docs(&prefix, 40, 0);
    let ids: Vec<u64> = (0..40).collect();
    let seq = 16;
    let p = PackedDataset::open(&prefix, &ids, seq, Packing::DocumentMasks, 3).unwrap();
    let total: usize = lens.iter().sum();
    assert_eq!(p.tokens(), total as u64);
    assert_eq!(p.documents(), 39, "the empty document is left out");
    assert_eq!(p.len_samples(), (total as u64 - 1) / seq as u64);
    let b = all_samples(&p);
    let row = seq + 1;
    assert_eq!(b.tokens.len(), row * p.len_samples() as usize);
    let mut stream: Vec<u32> = Vec::new();
    for r in 0..p.len_samples() as usize {
        let toks = &b.tokens[r * row..(r + 1) * row];
        let segs = &b.segment_ids[r * row..(r + 1) * row];
        let pos = &b.position_ids[r * row..(r + 1) * row];
        assert_eq!(segs[0], 0);
        assert_eq!(pos[0], 0);
        let first_offset = offset_of(toks[0]);
        for t in 1..row {
            let same_doc = doc_of(toks[t]) == doc_of(toks[t - 1]);
            assert_eq!(
                segs[t],
                segs[t - 1] + u32::from(!same_doc),
                "row {r} token {t}"
            );
            let want = if segs[t] == 0 {
                offset_of(toks[t]) - first_offset
            } else {
                offset_of(toks[t])
            };
            assert_eq!(pos[t], want, "row {r} token {t}");
            if !same_doc {
                assert_eq!(
                    offset_of(toks[t]),
                    0,
                    "a new document starts at its beginning"
                );
            }
        }
        // Consecutive rows overlap by one token (the last target is the next first input).
        if r > 0 {
            assert_eq!(*stream.last().unwrap(), toks[0]);
            stream.extend(&toks[1..]);
        } else {
            stream.extend(toks);
        }
    }
    // The stream is every document whole, each once, in the packing order (the tail of
    // fewer than seq_len tokens after the last sample excepted).
    let mut seen = BTreeMap::new();
    for (k, &t) in stream.iter().enumerate() {
        let d = doc_of(t);
        let e = seen.entry(d).or_insert((k, 0u32));
        assert_eq!(offset_of(t), e.1, "document {d} is contiguous and in order");
        e.1 += 1;
    }
    let whole = seen
        .iter()
        .filter(|(&d, &(_, n))| n as usize == lens[d as usize])
        .count();
    assert!(whole >= 39 - 1 - seq, "{whole} whole documents");
    assert!(total - stream.len() < seq);
    // Plain packing: the same tokens, no ids.
    let plain = PackedDataset::open(&prefix, &ids, seq, Packing::Plain, 3).unwrap();
    let pb = all_samples(&plain);
    assert_eq!(pb.tokens, b.tokens);
    assert!(pb.segment_ids.is_empty() && pb.position_ids.is_empty());
    // Another seed packs in another order.
    let other = PackedDataset::open(&prefix, &ids, seq, Packing::Plain, 4).unwrap();
    assert_ne!(all_samples(&other).tokens, b.tokens);
    assert!(p
        .sample_into(p.len_samples(), &mut Batch::default())
        .is_err());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn split_validation_is_disjoint_from_training() {
    let dir = scratch("split");
    let prefix = dir.join("docs");
    write_docs(&prefix, 40, 0);
    let s = Split::new(40, Holdout::Fraction(0.1), 11).unwrap();
    assert_eq!(s.validation.len(), 4);
    assert_eq!(s, Split::new(40, Holdout::Fraction(0.1), 11).unwrap());
    assert_ne!(s, Split::new(40, Holdout::Fraction(0.1), 12).unwrap());
    let train: BTreeSet<u64> = s.train.iter().copied().collect();
    let val: BTreeSet<u64> = s.validation.iter().copied().collect();
    assert!(train.is_disjoint(&val));
    assert_eq!(train.union(&val).count(), 40);
    assert_eq!(
        Split::new(40, Holdout::Count(7), 1)
            .unwrap()
            .validation
            .len(),
        7
    );
    assert_eq!(Split::new(40, Holdout::None, 1).unwrap().train.len(), 40);
    assert_eq!(
        Split::new(41, Holdout::Fraction(0.01), 1)
            .unwrap()
            .validation
            .len(),
        1
    );
    for bad in [
        Holdout::Fraction(1.0),
        Holdout::Fraction(f64::NAN),
        Holdout::Count(40),
    ] {
        let e = Split::new(40, bad, 1).unwrap_err().to_string();
        assert!(e.contains("fraction") || e.contains("none to train"), "{e}");
    }
    // Samples of each side hold tokens of that side's documents only.
    let tp = PackedDataset::open(&prefix, &s.train, 8, Packing::Plain, 1).unwrap();
    let vp = PackedDataset::open(&prefix, &s.validation, 8, Packing::Plain, 1).unwrap();
    let docs = |b: Batch| -> BTreeSet<u64> { b.tokens.iter().map(|&t| doc_of(t) as u64).collect() };
    assert!(docs(all_samples(&tp)).is_subset(&train));
    let vd = docs(all_samples(&vp));
    assert!(!vd.is_empty() && vd.is_subset(&val));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn sampler_ranks_are_disjoint_and_cover_the_epoch() {
    for samples in [4u64, 10, 13, 16, 1000] {
        let mut previous_epoch = None;
        for world in 1..=4usize {
            if samples < world as u64 {
                continue;
            }
            let mut samplers: Vec<Sampler> = (0..world)
                .map(|r| Sampler::new(samples, 5, r, world).unwrap())
                .collect();
            let per = samplers[0].per_rank();
            assert_eq!(per, samples / world as u64);
            for epoch in 0..3 {
                let mut seen = BTreeSet::new();
                let mut order = Vec::new();
                for _ in 0..per {
                    for s in samplers.iter_mut() {
                        let i = s.next_index();
                        assert_eq!(s.epoch(), epoch);
                        assert!(i < samples);
                        assert!(
                            seen.insert(i),
                            "sample {i} twice in epoch {epoch}, world {world}"
                        );
                        order.push(i);
                    }
                }
                assert_eq!(seen.len() as u64, samples - samples % world as u64);
                if world == 1 {
                    assert_eq!(seen.len() as u64, samples, "one rank sees every sample");
                    if samples > 4 {
                        assert_ne!(previous_epoch.as_ref(), Some(&order), "epochs reshuffle");
                    }
                    previous_epoch = Some(order);
                }
            }
        }
    }
    // The sequential sampler deals in index order.
    let mut s = Sampler::sequential(7, 1, 3).unwrap();
    let got: Vec<u64> = (0..4).map(|_| s.next_index()).collect();
    assert_eq!(got, [1, 4, 1, 4]);
    assert!(Sampler::new(3, 0, 0, 4).is_err());
    assert!(Sampler::new(10, 0, 4, 4).is_err());
}

#[test]
fn sampler_resume_equals_uninterrupted_run() {
    let dir = scratch("resume");
    let prefix = dir.join("docs");
    write_docs(&prefix, 40, 0);
    let ids: Vec<u64> = (0..40).collect();
    let open = || PackedDataset::open(&prefix, &ids, 12, Packing::DocumentMasks, 9).unwrap();
    let samples = open().len_samples();
    for world in 1..=3 {
        for rank in 0..world {
            let loader =
                |s| DataLoader::new(open(), Sampler::new(samples, s, rank, world).unwrap());
            let mut whole = loader(21);
            // Past an epoch's end: 3 rows a batch.
            let steps = (samples as usize / world) * 2 / 3 + 2;
            let want: Vec<Batch> = (0..steps).map(|_| whole.next_batch(3).unwrap()).collect();
            for stop in [0, 1, steps / 2, steps - 1] {
                let mut first = loader(21);
                for w in &want[..stop] {
                    assert_eq!(&first.next_batch(3).unwrap(), w);
                }
                let saved = serde_json::to_string(&first.state()).unwrap();
                let state: SamplerState = serde_json::from_str(&saved).unwrap();
                let mut second = loader(21);
                second.resume(state).unwrap();
                for w in &want[stop..] {
                    assert_eq!(
                        &second.next_batch(3).unwrap(),
                        w,
                        "world {world} stop {stop}"
                    );
                }
            }
            assert!(loader(22).resume(whole.state()).is_err(), "another seed");
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn blend_proportions_stay_within_one_sample_of_the_weights() {
    let dir = scratch("blend");
    let weights = [5.0, 3.0, 2.0, 0.0];
    let parts: Vec<(Box<dyn SampleSource + Send + Sync>, f64)> = weights
        .iter()
        .enumerate()
        .map(|(k, &w)| {
            let prefix = dir.join(format!("part{k}"));
            write_docs(&prefix, 30 + 10 * k as u32, 100_000 * k as i32);
            let ids: Vec<u64> = (0..30 + 10 * k as u64).collect();
            let p = PackedDataset::open(&prefix, &ids, 8, Packing::Plain, k as u64).unwrap();
            (Box::new(p) as Box<dyn SampleSource + Send + Sync>, w)
        })
        .collect();
    let lens: Vec<u64> = parts.iter().map(|(p, _)| p.len_samples()).collect();
    let blend = Blend::new(parts, None).unwrap();
    assert_eq!(blend.weights(), &[0.5, 0.3, 0.2, 0.0]);
    // The longest blend in which no part repeats.
    let n = blend.len_samples();
    assert_eq!(
        n,
        (0..3)
            .map(|k| (lens[k] as f64 / blend.weights()[k]) as u64)
            .min()
            .unwrap()
    );
    let mut counts = [0f64; 4];
    let mut b = Batch::default();
    for i in 0..n {
        let k = blend.source_of(i);
        counts[k] += 1.0;
        for (d, c) in counts.iter().enumerate() {
            let off = (c - blend.weights()[d] * (i + 1) as f64).abs();
            assert!(off <= 1.0, "dataset {d} after {} samples: {c}", i + 1);
        }
        b.tokens.clear();
        blend.sample_into(i, &mut b).unwrap();
        assert!(
            b.tokens.iter().all(|&t| t / 100_000 == k as u32),
            "sample {i}"
        );
        assert_eq!(*b.samples.last().unwrap(), i);
    }
    assert_eq!(counts[3], 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn blend_and_loader_settings_that_cannot_work_are_refused() {
    let dir = scratch("refused");
    let prefix = dir.join("docs");
    write_docs(&prefix, 10, 0);
    let ids: Vec<u64> = (0..10).collect();
    let part = |seq| -> Box<dyn SampleSource + Send + Sync> {
        Box::new(PackedDataset::open(&prefix, &ids, seq, Packing::Plain, 0).unwrap())
    };
    for (parts, want) in [
        (vec![(part(8), -1.0)], "weight -1"),
        (vec![(part(8), f64::NAN)], "weight NaN"),
        (vec![(part(8), 0.0)], "sum to 0"),
        (vec![(part(8), 1.0), (part(9), 1.0)], "share both"),
        (vec![], "no datasets"),
    ] {
        let e = Blend::new(parts, None).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    let e = PackedDataset::open(&prefix, &ids, 0, Packing::Plain, 0).unwrap_err();
    assert!(e.to_string().contains("seq_len 0"), "{e}");
    let e = PackedDataset::open(&prefix, &[10], 8, Packing::Plain, 0).unwrap_err();
    assert!(e.to_string().contains("document 10"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
