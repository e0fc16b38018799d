//! Hugging Face models on thread ranks: what `dtensor hf-parity` runs.
//!
//! [`parity_on_threads`] opens a model directory, builds its decoder on the composition
//! given (one thread per rank), loads the weights into it (each rank its own slices) and
//! measures what transformers prints for the same ids ([`Parity`]).

use crate::checkpoint::hf::{parity, HfModel};
pub use crate::checkpoint::hf::parity::Parity;
use crate::collectives::threads;
use crate::core::DeviceMesh;
use crate::kernels::DType;
use crate::nn::{ContextParallel, DataMode, Ddp, Fsdp, NoSp, SeqMode, Sp, Zero1, Zero2};
use crate::placement::{AxisKind, Composition, DataKind, MasterDType};
use std::path::Path;

/// The token ids of a parity file: `{"input_ids": [[...], ...]}`, samples of one length.
pub fn read_ids(file: &Path) -> Result<Vec<Vec<u32>>, String> {
    let text =
        std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    #[derive(serde::Deserialize)]
    struct Ids {
        input_ids: Vec<Vec<u32>>,
    }
    let ids: Ids = serde_json::from_str(&text)
        .map_err(|e| format!("{}: expected {{\"input_ids\": [[...], ...]}}: {e}", file.display()))?;
    Ok(ids.input_ids)
}

/// The parity numbers of the model in `dir` on `ids`, run on `comp` with one thread per
/// rank (`pp` must be 1), in f64 when `comp`'s dtype is f64 (the default here would be
/// f32: pass `dtype=f64` for a tight comparison). Every rank computes the same numbers;
/// rank 0's are returned. `Err` with every failing rank's message.
pub fn parity_on_threads(dir: &Path, ids: &[Vec<u32>], comp: &Composition) -> Result<Parity, String> {
    let d = comp.degrees;
    if d.pp > 1 {
        return Err(format!(
            "hf-parity runs one pipeline stage (pp=1); got pp={}",
            d.pp
        ));
    }
    let model = HfModel::open(dir).map_err(|e| e.to_string())?;
    let mesh = d
        .mesh(&[AxisKind::Dp, AxisKind::Ep, AxisKind::Cp, AxisKind::Tp])
        .map_err(|e| e.to_string())?;
    let dtype = match comp.dtype {
        MasterDType::F32 => DType::F32,
        MasterDType::F64 => DType::F64,
    };
    let context = ContextParallel {
        strategy: comp.cp_strategy,
        zigzag: comp.zigzag,
    };
    let run = |world: std::sync::Arc<dyn crate::collectives::Communicator>| {
        let dm = DeviceMesh::new(world.clone(), mesh.clone()).map_err(|e| e.to_string())?;
        fn go<M: SeqMode, D: DataMode>(
            model: &HfModel,
            world: &std::sync::Arc<dyn crate::collectives::Communicator>,
            dm: &std::sync::Arc<DeviceMesh>,
            ids: &[Vec<u32>],
            dtype: DType,
            context: ContextParallel,
        ) -> Result<Parity, String> {
            parity::run::<M, D>(model, world, dm, ids, dtype, context).map_err(|e| e.to_string())
        }
        fn pick_d<M: SeqMode>(
            data: DataKind,
            args: (&HfModel, &std::sync::Arc<dyn crate::collectives::Communicator>, &std::sync::Arc<DeviceMesh>, &[Vec<u32>], DType, ContextParallel),
        ) -> Result<Parity, String> {
            let (m, w, dm, ids, dt, cx) = args;
            match data {
                DataKind::Ddp => go::<M, Ddp>(m, w, dm, ids, dt, cx),
                DataKind::Zero1 => go::<M, Zero1>(m, w, dm, ids, dt, cx),
                DataKind::Zero2 => go::<M, Zero2>(m, w, dm, ids, dt, cx),
                DataKind::Fsdp => go::<M, Fsdp>(m, w, dm, ids, dt, cx),
            }
        }
        let args = (&model, &world, &dm, ids, dtype, context);
        if d.sp {
            pick_d::<Sp>(comp.data, args)
        } else {
            pick_d::<NoSp>(comp.data, args)
        }
    };
    let results = threads::launch(mesh.world_size(), run);
    let mut first = None;
    let mut errors = Vec::new();
    for (r, res) in results.into_iter().enumerate() {
        match res {
            Ok(p) => {
                first.get_or_insert(p);
            }
            Err(e) => errors.push(format!("rank {r}: {e}")),
        }
    }
    match (errors.is_empty(), first) {
        (true, Some(p)) => Ok(p),
        _ => Err(errors.join("\n")),
    }
}
