//! A model's training state: every parameter's master (named by
//! [`Module::visit_params`]), its AdamW moments (`<name>#adam.m`, `<name>#adam.v`, laid out
//! like the master, so a sharded master has sharded moments) and the optimizer's step count
//! (`extra["optim.steps"]`), next to the caller's `extra` (data position, RNG state), and
//! the layers' non-parameter state (named by [`Module::visit_state`]: an MoE layer's
//! `<layer>.expert_bias`), each a replicated `[n]` f64 tensor.
//! Loading into a model built on another mesh or data mode reshards every tensor to the
//! layout the new model holds it in.
//!
//! On a device mesh the masters and AdamW moments live in GPU memory: a save copies the
//! shards this rank writes to the host once; a load builds masters and moments on the
//! mesh's GPU (so AdamW's device kernel continues from them) and copies the small layer
//! state back into the layers' host values.

use crate::{load, read_index, save, Result, SaveReport, Target};
use dtensor_collectives::Communicator;
use dtensor_core::{AnyDTensor, DTensor, DeviceMesh};
use dtensor_kernels::{DType, Tensor};
use dtensor_nn::{AdamW, DataMode, Module, ParamKind, ParamVisitor, StateVisitor, Weight};
use dtensor_placement::Placement;
use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

/// The extra key holding the optimizer's step count.
pub const STEPS_KEY: &str = "optim.steps";

fn moment_names(name: &str) -> [String; 2] {
    [format!("{name}#adam.m"), format!("{name}#adam.v")]
}

/// The dtype AdamW keeps a master's moments in.
fn moment_dtype(master: DType) -> DType {
    match master {
        DType::F32 => DType::F32,
        _ => DType::F64,
    }
}

/// Layer state `value` as a tensor replicated over `mesh` (one copy is written).
fn state_tensor(mesh: &Arc<DeviceMesh>, value: &[f64]) -> dtensor_core::Result<AnyDTensor> {
    let n = value.len();
    let placements = vec![Placement::Replicate; mesh.mesh().ndim()];
    AnyDTensor::from_local(
        Tensor::from_vec(value.to_vec(), &[n])?,
        &[n],
        &placements,
        mesh,
    )
}

/// Collective over `world` (the root world, for a pipeline): saves `m`'s masters, `opt`'s
/// moments and step count, `m`'s non-parameter state ([`Module::visit_state`]) and `extra`.
pub fn save_model(
    dir: &Path,
    world: &Arc<dyn Communicator>,
    m: &mut impl Module,
    opt: &AdamW,
    extra: &BTreeMap<String, String>,
) -> Result<SaveReport> {
    struct Collect(Vec<(String, AnyDTensor)>);
    impl ParamVisitor for Collect {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            name: &str,
            w: &mut Weight<D, K>,
        ) -> dtensor_core::Result<()> {
            let v = w.value().as_any();
            self.0.push((name.to_string(), v.clone()));
            if let [m, s] = w.master().state() {
                for (n, t) in moment_names(name).into_iter().zip([m, s]) {
                    let t = AnyDTensor::from_local(
                        t.clone(),
                        v.global_shape(),
                        v.placements(),
                        v.device_mesh(),
                    )?;
                    self.0.push((n, t));
                }
            }
            Ok(())
        }
    }
    impl StateVisitor for Collect {
        fn visit(
            &mut self,
            name: &str,
            mesh: &Arc<DeviceMesh>,
            value: &mut [f64],
        ) -> dtensor_core::Result<()> {
            self.0.push((name.to_string(), state_tensor(mesh, value)?));
            Ok(())
        }
    }
    let mut c = Collect(Vec::new());
    m.visit_params("", &mut c)?;
    m.visit_state("", &mut c)?;
    let named: Vec<(&str, &AnyDTensor)> = c.0.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut extra = extra.clone();
    extra.insert(STEPS_KEY.into(), opt.steps().to_string());
    save(dir, world, &named, &extra)
}

/// Collective over `world`: loads `m`'s masters and `opt`'s moments and step count from
/// `dir`, resharded to the layouts `m` holds them in, and `m`'s non-parameter state (each
/// piece the checkpoint holds; one it lacks, from a run without it, keeps its current
/// value); returns the checkpoint's `extra`. Every rank either restores everything or
/// returns an `Err` with `m` and `opt` untouched.
pub fn load_model(
    dir: &Path,
    world: &Arc<dyn Communicator>,
    m: &mut impl Module,
    opt: &mut AdamW,
) -> Result<BTreeMap<String, String>> {
    // What the checkpoint holds decides whether moments are loaded; an unreadable index
    // fails inside `load` below, on every rank together.
    let index = read_index(dir).ok();
    let has = |n: &str| index.as_ref().is_some_and(|i| i.tensors.contains_key(n));

    // The model's current tensors: the targets' shapes, dtypes and layouts.
    struct Collect<'a> {
        targets: Vec<(String, AnyDTensor, DType)>,
        has: &'a dyn Fn(&str) -> bool,
        moments: Vec<bool>,
    }
    impl ParamVisitor for Collect<'_> {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            name: &str,
            w: &mut Weight<D, K>,
        ) -> dtensor_core::Result<()> {
            let v = w.value().as_any().clone();
            let [mn, vn] = moment_names(name);
            let moments = (self.has)(&mn) && (self.has)(&vn);
            self.moments.push(moments);
            let md = moment_dtype(v.dtype());
            self.targets.push((name.to_string(), v.clone(), v.dtype()));
            if moments {
                self.targets.push((mn, v.clone(), md));
                self.targets.push((vn, v, md));
            }
            Ok(())
        }
    }
    let mut c = Collect {
        targets: Vec::new(),
        has: &has,
        moments: Vec::new(),
    };
    m.visit_params("", &mut c)?;
    let n_params = c.targets.len();
    // Non-parameter state the checkpoint holds, after the parameters.
    struct State<'a> {
        targets: &'a mut Vec<(String, AnyDTensor, DType)>,
        has: &'a dyn Fn(&str) -> bool,
        loaded: Vec<bool>,
    }
    impl StateVisitor for State<'_> {
        fn visit(
            &mut self,
            name: &str,
            mesh: &Arc<DeviceMesh>,
            value: &mut [f64],
        ) -> dtensor_core::Result<()> {
            let here = (self.has)(name);
            self.loaded.push(here);
            if here {
                let t = state_tensor(mesh, value)?;
                self.targets.push((name.to_string(), t, DType::F64));
            }
            Ok(())
        }
    }
    let mut st = State {
        targets: &mut c.targets,
        has: &has,
        loaded: Vec::new(),
    };
    m.visit_state("", &mut st)?;
    let state_loaded = st.loaded;
    let targets: Vec<Target> = c
        .targets
        .iter()
        .map(|(n, t, d)| Target {
            name: n,
            shape: t.global_shape(),
            dtype: *d,
            placements: t.placements(),
            mesh: t.device_mesh(),
        })
        .collect();
    let mut loaded = load(dir, world, &targets)?;
    let state = loaded.split_off(n_params);
    let extra = index.as_ref().map(|i| i.extra.clone()).unwrap_or_default();
    let steps = extra
        .get(STEPS_KEY)
        .map(|s| s.parse::<u64>())
        .transpose()
        .map_err(|e| crate::Error::Format {
            file: dir.join(crate::index::INDEX_FILE),
            detail: format!("extra {STEPS_KEY}: {e}"),
        });
    let steps = crate::agree(world, "load", steps)?;

    // Everything is read and agreed: commit.
    struct Apply {
        loaded: std::vec::IntoIter<AnyDTensor>,
        moments: std::vec::IntoIter<bool>,
    }
    impl ParamVisitor for Apply {
        fn visit<D: DataMode, K: ParamKind>(
            &mut self,
            _name: &str,
            w: &mut Weight<D, K>,
        ) -> dtensor_core::Result<()> {
            let value = DTensor::try_from_any(self.loaded.next().expect("one per parameter"))?;
            let state: Vec<Tensor> = if self.moments.next().expect("one per parameter") {
                (0..2)
                    .map(|_| self.loaded.next().expect("two moments").into_local())
                    .collect()
            } else {
                Vec::new()
            };
            w.restore(value, state)
        }
    }
    let moments = c.moments;
    m.visit_params(
        "",
        &mut Apply {
            loaded: loaded.into_iter(),
            moments: moments.into_iter(),
        },
    )?;
    struct ApplyState {
        loaded: std::vec::IntoIter<bool>,
        values: std::vec::IntoIter<AnyDTensor>,
    }
    impl StateVisitor for ApplyState {
        fn visit(
            &mut self,
            _name: &str,
            _mesh: &Arc<DeviceMesh>,
            value: &mut [f64],
        ) -> dtensor_core::Result<()> {
            if self.loaded.next().expect("one per state") {
                let t = self
                    .values
                    .next()
                    .expect("one per loaded state")
                    .into_local();
                value.copy_from_slice(&t.to_f64_vec());
            }
            Ok(())
        }
    }
    m.visit_state(
        "",
        &mut ApplyState {
            loaded: state_loaded.into_iter(),
            values: state.into_iter(),
        },
    )?;
    if let Some(s) = steps {
        opt.set_steps(s);
    }
    Ok(extra)
}
