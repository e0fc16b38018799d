//! Save and load throughput of a distributed checkpoint against this machine's sequential
//! file write and read speed, measured in the same run, and checkpoint size against the
//! model's bytes.
//!
//! `cargo run --release -p dtensor-checkpoint --example checkpoint_bench -- [MiB] [dir]`
//!
//! 4 thread ranks on `[Dp=2, Tp=2]` save a model of `MiB` (default 256) f32 bytes: half
//! the matrices FSDP-like (`[S(0), S(1)]`), half DDP-like (`[R, S(0)]`, one replica
//! written); then load it back at the same layout and resharded to `tp=4`. Reads after a
//! write usually hit the page cache, for the baseline and the load alike.

use dtensor_checkpoint::{load_with, save, LoadOptions, Target};
use dtensor_collectives::threads;
use dtensor_core::{AnyDTensor, DeviceMesh};
use dtensor_kernels::{DType, Tensor};
use dtensor_placement::{local_ranges, AxisKind, Mesh, Placement};
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::Path;
use std::time::Instant;

use Placement::{Replicate as R, Shard as S};

const SIDE: usize = 2048; // 2048 x 2048 f32 = 16 MiB per matrix

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

/// One stream: write `bytes` to `path` in 8 MiB chunks, synced; then read it back.
fn sequential(path: &Path, bytes: u64) -> (f64, f64) {
    let chunk = vec![0x5Au8; 8 << 20];
    let t = Instant::now();
    let mut f = std::fs::File::create(path).unwrap();
    let mut left = bytes;
    while left > 0 {
        let n = left.min(chunk.len() as u64) as usize;
        f.write_all(&chunk[..n]).unwrap();
        left -= n as u64;
    }
    f.sync_all().unwrap();
    drop(f);
    let w = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let mut f = std::fs::File::open(path).unwrap();
    let mut buf = vec![0u8; 8 << 20];
    while f.read(&mut buf).unwrap() > 0 {}
    let r = t.elapsed().as_secs_f64();
    std::fs::remove_file(path).unwrap();
    (gbps(bytes, w), gbps(bytes, r))
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map_or(256, |s| s.parse().expect("MiB"));
    let dir = args
        .next()
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join(format!("ckpt-bench-{}", std::process::id())));
    std::fs::create_dir_all(&dir).unwrap();
    let count = (mib / 16).max(2);
    let model_bytes = (count * SIDE * SIDE * 4) as u64;
    let layouts: Vec<Vec<Placement>> = (0..count)
        .map(|i| {
            if i % 2 == 0 {
                vec![S(0), S(1)]
            } else {
                vec![R, S(0)]
            }
        })
        .collect();
    let names: Vec<String> = (0..count).map(|i| format!("layer{i}.weight")).collect();

    let (seq_w, seq_r) = sequential(&dir.join("sequential.bin"), model_bytes);

    let mesh = Mesh::new(&[(AxisKind::Dp, 2), (AxisKind::Tp, 2)]).unwrap();
    let ck = dir.join("ckpt");
    let out = threads::launch(
        4,
        |world| -> Result<(f64, u64, u64), dtensor_checkpoint::Error> {
            let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
            let ts: Vec<AnyDTensor> = layouts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let r = local_ranges(dm.mesh(), p, dm.coords(), &[SIDE, SIDE]).unwrap();
                    let local =
                        Tensor::from_fn(&[r[0].len(), r[1].len()], |k| (i * 7 + k) as f32 * 1e-3);
                    AnyDTensor::from_local(local, &[SIDE, SIDE], p, &dm).unwrap()
                })
                .collect();
            let named: Vec<(&str, &AnyDTensor)> =
                names.iter().map(|n| n.as_str()).zip(&ts).collect();
            world.barrier()?;
            let t = Instant::now();
            let rep = save(&ck, &world, &named, &BTreeMap::new())?;
            world.barrier()?;
            Ok((
                t.elapsed().as_secs_f64(),
                rep.total_bytes,
                rep.payload_bytes,
            ))
        },
    );
    let (save_s, file_bytes, payload) = out.into_iter().next().unwrap().unwrap();
    let index_bytes = std::fs::metadata(ck.join("index.json")).unwrap().len();

    let mut loads = Vec::new();
    for (label, mesh, lay) in [
        ("same layout [Dp=2, Tp=2]", mesh.clone(), layouts.clone()),
        (
            "resharded to tp=4 [S(1)]",
            Mesh::new(&[(AxisKind::Tp, 4)]).unwrap(),
            vec![vec![S(1)]; count],
        ),
    ] {
        let out = threads::launch(
            4,
            |world| -> Result<(f64, u64), dtensor_checkpoint::Error> {
                let dm = DeviceMesh::new(world.clone(), mesh.clone())?;
                let targets: Vec<Target> = names
                    .iter()
                    .zip(&lay)
                    .map(|(n, p)| Target {
                        name: n,
                        shape: &[SIDE, SIDE],
                        dtype: DType::F32,
                        placements: p,
                        mesh: &dm,
                    })
                    .collect();
                world.barrier()?;
                let t = Instant::now();
                let (_, stats) = load_with(&ck, &world, &targets, &LoadOptions::default())?;
                world.barrier()?;
                Ok((t.elapsed().as_secs_f64(), stats.bytes_read))
            },
        );
        let res: Vec<(f64, u64)> = out.into_iter().map(|r| r.unwrap()).collect();
        let secs = res[0].0;
        let read: u64 = res.iter().map(|r| r.1).sum();
        loads.push((label, secs, read));
    }
    println!(
        "checkpoint bench: {count} f32 matrices {SIDE}x{SIDE}, 4 thread ranks, dir {}",
        dir.display()
    );
    println!(
        "  model bytes            {:>12} ({:.1} MiB)",
        model_bytes,
        model_bytes as f64 / (1 << 20) as f64
    );
    println!(
        "  checkpoint data files  {:>12} ({:.4}x model; payload {:.4}x, headers {} B), index {} B",
        file_bytes,
        file_bytes as f64 / model_bytes as f64,
        payload as f64 / model_bytes as f64,
        file_bytes - payload,
        index_bytes
    );
    println!("  sequential write (1 stream, synced) {:6.2} GB/s", seq_w);
    println!("  sequential read  (1 stream)         {:6.2} GB/s", seq_r);
    println!(
        "  save (4 ranks, synced, CRC-32)      {:6.2} GB/s of model bytes  = {:.2}x sequential write ({:.3}s)",
        gbps(model_bytes, save_s),
        gbps(model_bytes, save_s) / seq_w,
        save_s
    );
    for (label, secs, read) in loads {
        println!(
            "  load {label}: {:6.2} GB/s of model bytes = {:.2}x sequential read ({:.3}s, {:.3}x model bytes read)",
            gbps(model_bytes, secs),
            gbps(model_bytes, secs) / seq_r,
            secs,
            read as f64 / model_bytes as f64
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
