//! Per-communicator accounting: how many collectives of each kind, and how many bytes this
//! rank sent to and received from its peers. Bytes count what crosses between ranks (a
//! rank's own piece staying in place counts nothing), with the direct exchange pattern:
//!
//! | collective (n ranks) | sent by rank r | received by rank r |
//! |---|---|---|
//! | all_gather(v) | own piece × (n−1) | Σ peers' pieces |
//! | reduce_scatter(v) | Σ blocks for peers | own block × (n−1) |
//! | all_reduce (len L, own block b_r of a `chunk_sizes(L, n)` split) | (L − b_r) + b_r·(n−1) | b_r·(n−1) + (L − b_r) |
//! | all_to_all(v) | Σ blocks for peers | Σ blocks from peers |
//! | broadcast (len L) | root: L·(n−1), others 0 | root 0, others L |
//! | send / recv | L | L |

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

/// The kinds of call a communicator counts. `v` variants count under their base kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CollectiveKind {
    /// [`all_reduce`](crate::Communicator::all_reduce) (and its asynchronous start).
    AllReduce,
    /// `all_gather`, `all_gatherv`, `all_gatherv_in_place` and `all_gather_cols`.
    AllGather,
    /// `reduce_scatter`, `reduce_scatterv`, `reduce_scatterv_in_place` and
    /// `reduce_scatter_cols`.
    ReduceScatter,
    /// `all_to_all`, `all_to_allv` and `all_to_all_cols`.
    AllToAll,
    /// [`broadcast`](crate::Communicator::broadcast) from a root rank.
    Broadcast,
    /// A point-to-point [`send`](crate::Communicator::send); counts bytes sent only.
    Send,
    /// A point-to-point [`recv`](crate::Communicator::recv); counts bytes received only.
    Recv,
    /// [`barrier`](crate::Communicator::barrier): a call, no bytes.
    Barrier,
    /// [`split`](crate::Communicator::split) into sub-groups: a call, no bytes.
    Split,
}

impl CollectiveKind {
    /// Every kind, in declaration order (the order [`CounterSnapshot`]'s `Display` lists
    /// them).
    pub const ALL: [CollectiveKind; 9] = [
        CollectiveKind::AllReduce,
        CollectiveKind::AllGather,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllToAll,
        CollectiveKind::Broadcast,
        CollectiveKind::Send,
        CollectiveKind::Recv,
        CollectiveKind::Barrier,
        CollectiveKind::Split,
    ];
    /// The method's name in snake case (`"all_reduce"`, `"send"`, …), as receipts and the
    /// [`trace`](crate::trace) timeline print it.
    pub fn name(self) -> &'static str {
        match self {
            CollectiveKind::AllReduce => "all_reduce",
            CollectiveKind::AllGather => "all_gather",
            CollectiveKind::ReduceScatter => "reduce_scatter",
            CollectiveKind::AllToAll => "all_to_all",
            CollectiveKind::Broadcast => "broadcast",
            CollectiveKind::Send => "send",
            CollectiveKind::Recv => "recv",
            CollectiveKind::Barrier => "barrier",
            CollectiveKind::Split => "split",
        }
    }
}

/// Live counters, shared by a communicator handle (lock-free).
#[derive(Debug, Default)]
pub struct Counters {
    calls: [AtomicU64; 9],
    bytes_sent: AtomicU64,
    bytes_received: AtomicU64,
    /// What the communicator carries (a mesh axis), for the timeline.
    label: std::sync::OnceLock<&'static str>,
}

impl Counters {
    /// Records one successful call of `kind` that moved the given bytes.
    pub fn record(&self, kind: CollectiveKind, sent: u64, received: u64) {
        self.calls[kind as usize].fetch_add(1, Ordering::Relaxed);
        self.bytes_sent.fetch_add(sent, Ordering::Relaxed);
        self.bytes_received.fetch_add(received, Ordering::Relaxed);
    }
    /// [`record`](Self::record), and the collective's span on the timeline when
    /// [`trace`](crate::trace) is on: it started at `start`, every peer had arrived at
    /// `arrived`, and it ends now.
    pub fn record_timed(
        &self,
        kind: CollectiveKind,
        sent: u64,
        received: u64,
        start: std::time::Instant,
        arrived: std::time::Instant,
    ) {
        self.record(kind, sent, received);
        crate::trace::collective(
            kind.name(),
            self.label(),
            start,
            arrived,
            std::time::Instant::now(),
            sent,
            received,
        );
    }

    /// Names what the communicator carries (the first name given sticks).
    pub fn set_label(&self, label: &'static str) {
        let _ = self.label.set(label);
    }

    /// The communicator's label, `world` if none was given.
    pub fn label(&self) -> &'static str {
        self.label.get().copied().unwrap_or("world")
    }

    /// A copy of the counts so far (each counter read on its own: a call recorded
    /// concurrently may be half in it).
    pub fn snapshot(&self) -> CounterSnapshot {
        CounterSnapshot {
            calls: std::array::from_fn(|i| self.calls[i].load(Ordering::Relaxed)),
            bytes_sent: self.bytes_sent.load(Ordering::Relaxed),
            bytes_received: self.bytes_received.load(Ordering::Relaxed),
        }
    }
}

/// A copy of a communicator's counters at one moment. Subtract two to measure a span.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CounterSnapshot {
    calls: [u64; 9],
    /// Bytes this rank sent to its peers (its own piece staying in place not counted;
    /// the per-collective rule is in the module table).
    pub bytes_sent: u64,
    /// Bytes this rank received from its peers.
    pub bytes_received: u64,
}

impl CounterSnapshot {
    /// Calls of one kind.
    pub fn calls(&self, kind: CollectiveKind) -> u64 {
        self.calls[kind as usize]
    }
    /// Data-moving collectives (all kinds but barrier and split).
    pub fn collectives(&self) -> u64 {
        CollectiveKind::ALL
            .iter()
            .filter(|k| !matches!(k, CollectiveKind::Barrier | CollectiveKind::Split))
            .map(|&k| self.calls(k))
            .sum()
    }
    /// Counts since `earlier`.
    pub fn since(&self, earlier: &CounterSnapshot) -> CounterSnapshot {
        CounterSnapshot {
            calls: std::array::from_fn(|i| self.calls[i] - earlier.calls[i]),
            bytes_sent: self.bytes_sent - earlier.bytes_sent,
            bytes_received: self.bytes_received - earlier.bytes_received,
        }
    }
    /// Element-wise sum (to total several communicators).
    pub fn plus(&self, other: &CounterSnapshot) -> CounterSnapshot {
        CounterSnapshot {
            calls: std::array::from_fn(|i| self.calls[i] + other.calls[i]),
            bytes_sent: self.bytes_sent + other.bytes_sent,
            bytes_received: self.bytes_received + other.bytes_received,
        }
    }
}

impl fmt::Display for CounterSnapshot {
    /// `all_gather=2 reduce_scatter=1 sent=1024B received=1024B` (kinds with zero calls omitted).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for k in CollectiveKind::ALL {
            let c = self.calls(k);
            if c > 0 {
                write!(f, "{}={} ", k.name(), c)?;
            }
        }
        write!(
            f,
            "sent={}B received={}B",
            self.bytes_sent, self.bytes_received
        )
    }
}
