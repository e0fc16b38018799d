//! [`launch`]: thread ranks sharing one `ncclUniqueId`; the presence check for libnccl.

use super::comm::{spawn, Departures, Init, BACKEND};
use super::{NcclComm, Options};
use crate::{Error, Result};
use cudarc::nccl::sys;
use std::any::Any;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, OnceLock};

/// Whether libnccl can be loaded (checked once per process, without calling anything
/// that panics: cudarc's loader panics on a missing library).
pub fn library_present() -> bool {
    static P: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen the candidate names and drops what it opened.
    *P.get_or_init(|| unsafe { sys::is_culib_present() })
}

/// The oldest NCCL this backend can drive: `ncclCommSplit` (2.18) is the newest function it
/// calls (`ncclCommInitRankConfig` / `ncclCommFinalize` came in 2.14, `ncclBfloat16` in 2.10).
const MIN_VERSION: i32 = 21800;

/// `ncclGetVersion`'s code as `major.minor.patch` (`X*10000 + Y*100 + Z` since 2.9,
/// `X*1000 + Y*100 + Z` before).
fn version_name(code: i32) -> String {
    let (major, rest) = if code >= 10000 {
        (code / 10000, code % 10000)
    } else {
        (code / 1000, code % 1000)
    };
    format!("{major}.{}.{}", rest / 100, rest % 100)
}

/// The loaded libnccl's version code (checked once per process); `None` if it cannot be
/// loaded or does not answer.
fn loaded_version() -> Option<i32> {
    static V: OnceLock<Option<i32>> = OnceLock::new();
    *V.get_or_init(|| {
        if !library_present() {
            return None;
        }
        let mut v = 0;
        // SAFETY: a valid out-pointer; the library loads (checked above) and every NCCL 2
        // exports ncclGetVersion.
        (unsafe { sys::ncclGetVersion(&mut v) } == sys::ncclResult_t::ncclSuccess).then_some(v)
    })
}

/// `Ok` when libnccl loads and is NCCL 2.18 or newer; else [`Error::Unavailable`] saying how
/// to provide it. (cudarc resolves each NCCL function at its first call and panics when the
/// library lacks it, so an older library is refused here, before any call.)
pub fn require_library() -> Result<()> {
    if library_present() {
        return match loaded_version() {
            Some(v) if v >= MIN_VERSION => Ok(()),
            Some(v) => Err(Error::Unavailable {
                backend: BACKEND,
                detail: format!(
                    "libnccl {} is too old: this backend needs NCCL {} or newer \
                     (ncclCommSplit, non-blocking communicators)",
                    version_name(v),
                    version_name(MIN_VERSION)
                ),
            }),
            None => Err(Error::Unavailable {
                backend: BACKEND,
                detail: "libnccl loads but ncclGetVersion failed".into(),
            }),
        };
    }
    let names = cudarc::get_lib_name_candidates("nccl");
    let so: Vec<&str> = names
        .iter()
        .map(String::as_str)
        .filter(|n| n.starts_with("lib") && n.contains(".so"))
        .collect();
    Err(Error::Unavailable {
        backend: BACKEND,
        detail: format!(
            "libnccl not found: searched {} (cudarc looks for libnccl.so; NCCL wheels ship \
             libnccl.so.2: add a libnccl.so symlink on LD_LIBRARY_PATH)",
            so.join(", ")
        ),
    })
}

/// Runs `f` on `world_size` thread ranks with the default [`Options`]; see
/// [`launch_with`].
pub fn launch<T, E, F>(world_size: usize, f: F) -> Vec<Result<T, E>>
where
    F: Fn(Arc<NcclComm>) -> Result<T, E> + Sync,
    T: Send,
    E: From<Error> + std::fmt::Display + Send,
{
    launch_with(world_size, Options::default(), f)
}

/// Runs `f` on `world_size` ranks, each a thread (`rank-<r>`) on GPU
/// `r % device_count`, and returns each rank's result in rank order.
///
/// Every rank gets the same error, without starting any thread, when libnccl or the CUDA
/// driver cannot be loaded, no GPU is found, or the unique id cannot be made
/// ([`Error::Unavailable`] / [`Error::Library`]); a rank whose communicator cannot be
/// created gets that error (and its peers a `Timeout` or `RankFailed`). A rank that
/// panics gets [`Error::RankFailed`] naming itself with the panic message. When a rank's
/// closure ends its peers' pending and later calls fail with `RankFailed` (see the
/// module docs).
pub fn launch_with<T, E, F>(world_size: usize, options: Options, f: F) -> Vec<Result<T, E>>
where
    F: Fn(Arc<NcclComm>) -> Result<T, E> + Sync,
    T: Send,
    E: From<Error> + std::fmt::Display + Send,
{
    const OP: &str = "nccl::launch";
    if world_size == 0 {
        return Vec::new();
    }
    let everyone = |e: Error| -> Vec<Result<T, E>> {
        (0..world_size).map(|_| Err(E::from(e.clone()))).collect()
    };
    if let Err(e) = require_library() {
        return everyone(e);
    }
    let gpus = match dtensor_kernels::cuda::device_count() {
        Ok(0) => {
            return everyone(Error::Unavailable {
                backend: BACKEND,
                detail: "no CUDA device found".into(),
            })
        }
        Ok(n) => n,
        Err(e) => {
            return everyone(Error::Unavailable {
                backend: BACKEND,
                detail: e.to_string(),
            })
        }
    };
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: a valid out-pointer; the library is present (checked above).
    let r = unsafe { sys::ncclGetUniqueId(&mut id) };
    if r != sys::ncclResult_t::ncclSuccess {
        return everyone(Error::Library {
            op: OP,
            backend: BACKEND,
            detail: format!("ncclGetUniqueId failed: {r:?}"),
        });
    }
    let departures = Arc::new(Departures::new(world_size));
    let (f, departures, options) = (&f, &departures, &options);
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                std::thread::Builder::new()
                    .name(format!("rank-{rank}"))
                    .spawn_scoped(scope, move || {
                        run_rank(rank, world_size, gpus, id, options, departures, f)
                    })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| match h {
                Ok(h) => h.join().unwrap_or_else(|p| {
                    Err(E::from(Error::RankFailed {
                        rank,
                        op: OP,
                        reason: format!("panicked: {}", panic_message(p.as_ref())),
                    }))
                }),
                Err(e) => {
                    departures.depart(rank, format!("could not start its thread: {e}"));
                    Err(E::from(Error::Library {
                        op: OP,
                        backend: BACKEND,
                        detail: format!("could not start rank {rank}'s thread: {e}"),
                    }))
                }
            })
            .collect()
    })
}

/// One rank: its device, its worker and communicator, the closure; then it departs
/// (before its communicator is destroyed, so peers waiting for it learn why).
fn run_rank<T, E, F>(
    rank: usize,
    size: usize,
    gpus: usize,
    id: sys::ncclUniqueId,
    options: &Options,
    departures: &Arc<Departures>,
    f: &F,
) -> Result<T, E>
where
    F: Fn(Arc<NcclComm>) -> Result<T, E>,
    E: From<Error> + std::fmt::Display,
{
    const OP: &str = "nccl::launch";
    let comm = dtensor_kernels::cuda::Device::new(rank % gpus)
        .map_err(|e| Error::Unavailable {
            backend: BACKEND,
            detail: e.to_string(),
        })
        .and_then(|device| {
            spawn(Init {
                device,
                rank,
                size,
                id,
                options: options.clone(),
                departures: Some(departures.clone()),
                // More ranks than GPUs: some share one (and its CUDA context).
                shared_gpu: size > gpus,
            })
        });
    let comm = match comm {
        Ok(c) => Arc::new(c),
        Err(e) => {
            departures.depart(rank, format!("could not create its communicator: {e}"));
            return Err(E::from(e));
        }
    };
    let (result, reason) = match catch_unwind(AssertUnwindSafe(|| f(comm.clone()))) {
        Ok(Ok(v)) => (Ok(v), "returned before joining".to_string()),
        Ok(Err(e)) => {
            let reason = format!("returned an error: {e}");
            (Err(e), reason)
        }
        Err(payload) => {
            let msg = panic_message(payload.as_ref());
            let reason = format!("panicked: {msg}");
            (
                Err(E::from(Error::RankFailed {
                    rank,
                    op: OP,
                    reason: reason.clone(),
                })),
                reason,
            )
        }
    };
    departures.depart(rank, reason);
    drop(comm);
    result
}

/// The message of a panic payload.
fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "<non-string panic payload>".to_string()
    }
}

/// Creates this rank's NCCL communicator for the ranks of `host`, a host-memory
/// communicator over the same ranks (MPI's world: `nccl::from_host(&*mpi.world(), …)`, or a
/// threads group): rank 0 makes the `ncclUniqueId` and broadcasts it over `host`, and every
/// rank joins with the GPU `local_rank % device_count`, where the local rank is the
/// launcher's (`OMPI_COMM_WORLD_LOCAL_RANK`, `MPI_LOCALRANKID`, `SLURM_LOCALID`) or else the
/// rank in `host`.
///
/// Collective over `host`. Every rank gets an error instead of a communicator when libnccl,
/// the driver or a GPU is missing on it, or when rank 0 could not make the id. Without
/// [`launch`]'s shared bookkeeping, a peer that fails is noticed only through NCCL (an
/// asynchronous error, or the timeout), not at once.
pub fn from_host(host: &dyn crate::Communicator, options: Options) -> Result<NcclComm> {
    const OP: &str = "nccl::from_host";
    let (rank, size) = (host.rank(), host.size());
    // [made (1) or not (0), then the id's 128 bytes in 16 words].
    let mut words = [0i64; 17];
    if rank == 0 && require_library().is_ok() {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        // SAFETY: a valid out-pointer; the library is present and recent enough.
        if unsafe { sys::ncclGetUniqueId(&mut id) } == sys::ncclResult_t::ncclSuccess {
            words[0] = 1;
            words[1..].copy_from_slice(&id_words(&id));
        }
    }
    crate::CommunicatorExt::broadcast_in_place(host, &mut words, 0)?;
    require_library()?;
    if words[0] != 1 {
        return Err(Error::Library {
            op: OP,
            backend: BACKEND,
            detail: "rank 0 could not make an NCCL unique id (ncclGetUniqueId failed there, \
                     or libnccl is missing or older than 2.18 there)"
                .into(),
        });
    }
    let id = id_from_words(&words[1..]);
    let gpus = match dtensor_kernels::cuda::device_count() {
        Ok(0) => {
            return Err(Error::Unavailable {
                backend: BACKEND,
                detail: "no CUDA device found".into(),
            })
        }
        Ok(n) => n,
        Err(e) => {
            return Err(Error::Unavailable {
                backend: BACKEND,
                detail: e.to_string(),
            })
        }
    };
    let local = [
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "MPI_LOCALRANKID",
        "SLURM_LOCALID",
    ]
    .iter()
    .find_map(|v| std::env::var(v).ok()?.trim().parse::<usize>().ok())
    .unwrap_or(rank);
    let device =
        dtensor_kernels::cuda::Device::new(local % gpus).map_err(|e| Error::Unavailable {
            backend: BACKEND,
            detail: e.to_string(),
        })?;
    spawn(Init {
        device,
        rank,
        size,
        id,
        options,
        departures: None,
        // Ranks of one process (threads over a threads group) may share a GPU, which NCCL
        // allows only with this variable set; ranks in separate processes have separate
        // CUDA contexts and need no preloading.
        shared_gpu: std::env::var(super::MULTI_RANK_GPU_ENV).is_ok_and(|v| v.trim() == "1"),
    })
}

/// An `ncclUniqueId`'s 128 bytes as 16 little-endian words (what `from_host` broadcasts).
fn id_words(id: &sys::ncclUniqueId) -> [i64; 16] {
    let mut words = [0i64; 16];
    for (w, chunk) in words.iter_mut().zip(id.internal.chunks(8)) {
        let mut bytes = [0u8; 8];
        for (b, &c) in bytes.iter_mut().zip(chunk) {
            *b = c as u8;
        }
        *w = i64::from_le_bytes(bytes);
    }
    words
}

/// The inverse of [`id_words`] (missing words read as zeros).
fn id_from_words(words: &[i64]) -> sys::ncclUniqueId {
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    for (chunk, w) in id.internal.chunks_mut(8).zip(words) {
        for (c, b) in chunk.iter_mut().zip(w.to_le_bytes()) {
            *c = b as std::ffi::c_char;
        }
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unique_id_survives_its_word_form_every_byte_value() {
        let mut id = sys::ncclUniqueId { internal: [0; 128] };
        for (i, c) in id.internal.iter_mut().enumerate() {
            // Even bytes below 128, then odd ones from 129 (negative as a signed c_char).
            *c = (i as u8).wrapping_mul(2).wrapping_add((i / 64) as u8) as std::ffi::c_char;
        }
        let back = id_from_words(&id_words(&id));
        assert_eq!(back.internal, id.internal);
        assert_eq!(
            id_words(&id)[0] & 0xff,
            0,
            "byte 0 is the low byte of word 0"
        );
        assert_eq!((id_words(&id)[0] >> 8) & 0xff, 2);
    }

    #[test]
    fn version_codes_decode_in_both_encodings() {
        assert_eq!(version_name(21800), "2.18.0");
        assert_eq!(version_name(23007), "2.30.7");
        assert_eq!(version_name(2804), "2.8.4");
        assert_eq!(version_name(MIN_VERSION), "2.18.0");
    }
}
