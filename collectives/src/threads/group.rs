//! Shared state of the thread backend: the world (which ranks have departed, every group
//! ever created) and each group (its barrier, post table, poison and mailboxes).
//!
//! Lock order: a group's mutex, then the world's mutex (split creates and registers groups
//! while holding its parent's mutex). Departure takes the world mutex alone, releases it,
//! then takes each affected group's mutex alone.
//!
//! # Protocol invariants the data phase relies on
//!
//! During a data phase every rank reads its peers' buffers through the raw addresses they
//! posted (`view.rs`). That is sound only because a poster cannot return, and so free or
//! reuse its buffers, while a peer may still read them. These invariants guarantee it.
//! Each is also stated at the code that keeps it.
//!
//! 1. **A post is in the table only while its owner waits in `join`.** Every way out of
//!    `join` except success withdraws the post: timeout and poison alike. So the table
//!    never holds the address of a buffer its owner has already released. A completed join
//!    hands the posts to every member at once, in `Joined`.
//! 2. **Poison is permanent.** Once set, `poison` is never cleared and no join can complete
//!    on the group again. A late member fails at the top of `join` without posting. So a
//!    rank that left with an error can never be the missing member of a join that others
//!    complete.
//! 3. **`sync` has no timeout and no poison check.** Once a join completes, every member
//!    has passed the same `call::check` and runs the same data phases, which only copy and
//!    reduce memory: nothing in them blocks, waits for another rank, or calls user code.
//!    So every member reaches each barrier. A timeout there could only let a rank return
//!    while its peers still read its buffers.
//! 4. **A data-phase panic unwinds to the barrier, not past it.** `ThreadComm::guarded`
//!    catches it, `record_fault` makes the coming barrier fail on every rank, and the
//!    panicking rank resumes the panic only after that barrier. (With `panic = "abort"`
//!    the process ends instead, which is also safe.)
//! 5. **Stale addresses are never dereferenced.** After a collective, `Inner.joined` and
//!    each rank's `Joined.posts` still hold the addresses. Only a `View` dereferences
//!    them, and a view lives inside one data phase (`ThreadComm::data_phase`). The next
//!    join replaces `Inner.joined`.

use super::call::Call;
use super::view::Post;
use super::Options;
use crate::Error;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

/// How long a waiter polls the generation before blocking on the condvar, as (busy spins,
/// then yields). Back-to-back collectives usually complete within a few microseconds, and
/// a condvar wake-up costs about as much again. With a core per rank, spinning wins; with
/// more ranks than cores, a spinning rank steals the core its peer needs, so mostly yield.
const SPIN_DEDICATED: (u32, u32) = (1024, 64);
const SPIN_SHARED: (u32, u32) = (0, 16);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Nothing panics while holding these mutexes; if something did, the state it guards is
    // still consistent (every update is a single assignment), so keep going.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// All ranks of one `launch`.
pub(super) struct World {
    pub(super) options: Options,
    spin: (u32, u32),
    state: Mutex<WorldState>,
}

struct WorldState {
    /// Per world rank: why it left, once its closure has ended.
    departed: Vec<Option<String>>,
    /// Every group created in this world, so a departure reaches all that contain the rank.
    groups: Vec<Weak<Group>>,
}

impl World {
    pub(super) fn new(size: usize, options: Options) -> Arc<World> {
        let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
        Arc::new(World {
            options,
            spin: if size <= cores {
                SPIN_DEDICATED
            } else {
                SPIN_SHARED
            },
            state: Mutex::new(WorldState {
                departed: vec![None; size],
                groups: Vec::new(),
            }),
        })
    }

    /// World rank `rank`'s closure ended: every group containing it fails its pending and
    /// later collectives with `RankFailed`.
    pub(super) fn depart(&self, rank: usize, reason: String) {
        let groups: Vec<Arc<Group>> = {
            let mut st = lock(&self.state);
            st.departed[rank] = Some(reason.clone());
            st.groups.retain(|g| g.strong_count() > 0);
            st.groups
                .iter()
                .filter_map(Weak::upgrade)
                .filter(|g| g.members.contains(&rank))
                .collect()
        };
        for g in groups {
            g.member_departed(rank, &reason);
        }
    }
}

/// Why a group can no longer run collectives. The first cause wins and stays.
#[derive(Clone, Debug)]
enum Poison {
    Departed {
        rank: usize,
        reason: String,
    },
    TimedOut {
        waited: Duration,
        missing: Vec<usize>,
    },
}

impl Poison {
    fn error(&self, op: &'static str) -> Error {
        match self {
            Poison::Departed { rank, reason } => Error::RankFailed {
                rank: *rank,
                op,
                reason: reason.clone(),
            },
            Poison::TimedOut { waited, missing } => Error::Timeout {
                op,
                waited: *waited,
                missing: missing.clone(),
            },
        }
    }
}

/// A buffered point-to-point message.
pub(super) struct Message {
    pub(super) dtype: dtensor_kernels::DType,
    pub(super) len: usize,
    pub(super) bytes: Vec<u8>,
}

/// What a rank gets back from a completed join.
pub(super) struct Joined {
    /// Every rank's post, indexed by group rank. The addresses in them may be dereferenced
    /// only through a `View`, in a data phase of this same collective (invariant 5).
    pub(super) posts: Vec<Post>,
    /// For `split`: the new group this rank belongs to.
    pub(super) split: Option<Arc<Group>>,
}

/// The state one group of ranks shares. A handle (`ThreadComm`) is one member's end of it.
///
/// Invariants: `inner.arrived` counts the members waiting in the current barrier (join,
/// middle or leave: ranks never mix them, because every rank takes the same path through a
/// collective); `inner.generation` advances exactly when a barrier completes, and only then
/// are `inner.joined` / `inner.split_out` replaced.
pub(super) struct Group {
    pub(super) world: Arc<World>,
    /// World rank of each group rank.
    pub(super) members: Vec<usize>,
    inner: Mutex<Inner>,
    /// Barrier waiters.
    cv: Condvar,
    /// `recv` waiters.
    mail_cv: Condvar,
    /// Mirror of `inner.generation`, written under the mutex, read by spinning waiters.
    generation: AtomicU64,
    /// Set once any rank faulted inside a data phase (see [`Group::record_fault`]).
    faulted: AtomicBool,
}

struct Inner {
    generation: u64,
    arrived: usize,
    /// The posts of the members waiting in the current join. A post is here only while its
    /// owner waits in `join` (invariant 1).
    posts: Vec<Option<Post>>,
    /// The posts of the last completed join. Kept only so late wakers can copy them, and
    /// never dereferenced from here (invariant 5).
    joined: Vec<Post>,
    split_out: Vec<Option<Arc<Group>>>,
    /// Set once and never cleared (invariant 2).
    poison: Option<Poison>,
    /// A rank panicked inside a data phase: (generation of the barrier it went on to,
    /// world rank, message).
    fault: Option<(u64, usize, String)>,
    /// Per group rank: why it departed.
    departed: Vec<Option<String>>,
    /// FIFO per (src, dst, tag), group ranks.
    mail: HashMap<(usize, usize, u32), VecDeque<Message>>,
}

impl Group {
    /// Creates a group of the given world ranks and registers it with the world, so that
    /// departures reach it (including departures that already happened).
    pub(super) fn create(world: &Arc<World>, members: Vec<usize>) -> Arc<Group> {
        let n = members.len();
        let group = Arc::new(Group {
            world: world.clone(),
            members,
            inner: Mutex::new(Inner {
                generation: 0,
                arrived: 0,
                posts: vec![None; n],
                joined: Vec::new(),
                split_out: vec![None; n],
                poison: None,
                fault: None,
                departed: vec![None; n],
                mail: HashMap::new(),
            }),
            cv: Condvar::new(),
            mail_cv: Condvar::new(),
            generation: AtomicU64::new(0),
            faulted: AtomicBool::new(false),
        });
        let gone: Vec<(usize, String)> = {
            let mut st = lock(&world.state);
            st.groups.retain(|g| g.strong_count() > 0);
            st.groups.push(Arc::downgrade(&group));
            group
                .members
                .iter()
                .filter_map(|&w| st.departed[w].clone().map(|r| (w, r)))
                .collect()
        };
        for (w, reason) in gone {
            group.member_departed(w, &reason);
        }
        group
    }

    pub(super) fn size(&self) -> usize {
        self.members.len()
    }

    fn member_departed(&self, world_rank: usize, reason: &str) {
        let Some(r) = self.members.iter().position(|&w| w == world_rank) else {
            return;
        };
        let mut g = lock(&self.inner);
        if g.departed[r].is_none() {
            g.departed[r] = Some(reason.to_string());
        }
        if g.poison.is_none() {
            g.poison = Some(Poison::Departed {
                rank: world_rank,
                reason: reason.to_string(),
            });
        }
        drop(g);
        self.cv.notify_all();
        self.mail_cv.notify_all();
    }

    /// Completes the current barrier; the caller holds the mutex and is the last arrival.
    fn complete(&self, g: &mut Inner) {
        g.arrived = 0;
        g.generation += 1;
        self.generation.store(g.generation, Ordering::Release);
        self.cv.notify_all();
    }

    /// Spins briefly for the generation to move past `gen`.
    fn spin(&self, gen: u64) -> bool {
        let (spins, yields) = self.world.spin;
        for i in 0..spins + yields {
            if self.generation.load(Ordering::Acquire) != gen {
                return true;
            }
            if i < spins {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        false
    }

    /// Posts `post` as rank `me` and waits (up to the world's timeout) until every member
    /// has posted; returns everyone's posts. Fails if the group is or becomes poisoned. On
    /// timeout, withdraws this rank's post and poisons the group, so a late peer fails
    /// instead of reading a buffer that no longer exists. On poison it withdraws its post
    /// too: its caller returns and releases the buffer, so the address must not stay in
    /// the table (invariant 1).
    pub(super) fn join(&self, me: usize, post: Post, op: &'static str) -> Result<Joined, Error> {
        let n = self.size();
        let arrived_at = Instant::now();
        let mut g = lock(&self.inner);
        if let Some(p) = &g.poison {
            return Err(p.error(op));
        }
        debug_assert!(g.posts[me].is_none(), "one collective at a time per handle");
        g.posts[me] = Some(post);
        g.arrived += 1;
        if g.arrived == n {
            let posts: Vec<Post> = g.posts.iter_mut().filter_map(Option::take).collect();
            if posts.iter().all(|p| matches!(p.call, Call::Split { .. })) {
                self.create_splits(&mut g, &posts);
            }
            g.joined = posts;
            self.complete(&mut g);
            return Ok(Joined {
                posts: g.joined.clone(),
                split: g.split_out[me].take(),
            });
        }
        let gen = g.generation;
        drop(g);
        self.spin(gen);
        let mut g = lock(&self.inner);
        let deadline = arrived_at + self.world.options.timeout;
        loop {
            // A completed join stands even if the group is poisoned right after it.
            if g.generation != gen {
                return Ok(Joined {
                    posts: g.joined.clone(),
                    split: g.split_out[me].take(),
                });
            }
            if let Some(p) = &g.poison {
                let err = p.error(op);
                // Withdraw, as on timeout: the caller is about to release the buffer. No
                // join can complete on a poisoned group (invariant 2), so nobody would read
                // the post. But the table must not hold an address whose buffer is gone.
                g.posts[me] = None;
                g.arrived -= 1;
                return Err(err);
            }
            let now = Instant::now();
            if now >= deadline {
                g.posts[me] = None;
                g.arrived -= 1;
                let missing: Vec<usize> = (0..n)
                    .filter(|&r| r != me && g.posts[r].is_none())
                    .map(|r| self.members[r])
                    .collect();
                let waited = now - arrived_at;
                g.poison = Some(Poison::TimedOut {
                    waited,
                    missing: missing.clone(),
                });
                drop(g);
                self.cv.notify_all();
                self.mail_cv.notify_all();
                return Err(Error::Timeout {
                    op,
                    waited,
                    missing,
                });
            }
            g = self
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }

    /// The barrier between the phases of a joined collective (middle, leave). No timeout
    /// and no poison: every member has joined, and between join and leave a rank only
    /// copies memory, so every member reaches it. Fails on every rank alike if a member
    /// faulted in the phase before it.
    ///
    /// This is invariant 3 of the module docs. The barrier is what keeps the posted
    /// buffers alive while peers read them. A timeout or a poison check here would let one
    /// rank return (and free its buffers) while the others still read them. Do not add
    /// either. Anything that can block between join and leave (a callback, a device
    /// stream) needs a new argument for why every member still arrives.
    pub(super) fn sync(&self, op: &'static str) -> Result<(), Error> {
        let n = self.size();
        let mut g = lock(&self.inner);
        g.arrived += 1;
        let gen = g.generation;
        if g.arrived == n {
            self.complete(&mut g);
            return fault_error(&g, gen, op);
        }
        drop(g);
        if self.spin(gen) && !self.faulted.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut g = lock(&self.inner);
        while g.generation == gen {
            g = self.cv.wait(g).unwrap_or_else(PoisonError::into_inner);
        }
        fault_error(&g, gen, op)
    }

    /// Rank `me` panicked inside a data phase (a broken internal invariant): the coming
    /// barrier fails on every rank and the group stays poisoned.
    pub(super) fn record_fault(&self, me: usize, message: String) {
        let mut g = lock(&self.inner);
        let rank = self.members[me];
        let reason = format!("panicked inside a collective: {message}");
        if g.fault.is_none() {
            g.fault = Some((g.generation, rank, reason.clone()));
        }
        if g.poison.is_none() {
            g.poison = Some(Poison::Departed { rank, reason });
        }
        self.faulted.store(true, Ordering::Release);
    }

    /// For a split whose join just completed: creates the new groups (one per color,
    /// members ordered by `(key, parent rank)`) and hands each parent rank its group.
    fn create_splits(&self, g: &mut Inner, posts: &[Post]) {
        let mut by_color: BTreeMap<usize, Vec<(usize, usize)>> = BTreeMap::new();
        for (r, p) in posts.iter().enumerate() {
            if let Call::Split { color, key } = p.call {
                by_color.entry(color).or_default().push((key, r));
            }
        }
        for (_, mut ranks) in by_color {
            ranks.sort_unstable();
            let members = ranks.iter().map(|&(_, r)| self.members[r]).collect();
            let group = Group::create(&self.world, members);
            for &(_, r) in &ranks {
                g.split_out[r] = Some(group.clone());
            }
        }
    }

    /// Queues a message from `src` to `dst`.
    pub(super) fn post_message(
        &self,
        src: usize,
        dst: usize,
        tag: u32,
        msg: Message,
    ) -> Result<(), Error> {
        let mut g = lock(&self.inner);
        if let Some(reason) = &g.departed[dst] {
            return Err(Error::RankFailed {
                rank: self.members[dst],
                op: "send",
                reason: reason.clone(),
            });
        }
        g.mail.entry((src, dst, tag)).or_default().push_back(msg);
        drop(g);
        self.mail_cv.notify_all();
        Ok(())
    }

    /// Takes the oldest message from `src` to `dst` with `tag` if `accept` agrees with its
    /// dtype and length (else leaves it queued and returns accept's error); waits up to the
    /// world's timeout, and fails if `src` departs with nothing queued.
    pub(super) fn take_message(
        &self,
        src: usize,
        dst: usize,
        tag: u32,
        accept: impl Fn(&Message) -> Result<(), Error>,
    ) -> Result<Message, Error> {
        let start = Instant::now();
        let deadline = start + self.world.options.timeout;
        let mut g = lock(&self.inner);
        loop {
            if let Some(queue) = g.mail.get_mut(&(src, dst, tag)) {
                if let Some(front) = queue.front() {
                    accept(front)?;
                    let msg = queue.pop_front().expect("front exists");
                    if queue.is_empty() {
                        g.mail.remove(&(src, dst, tag));
                    }
                    return Ok(msg);
                }
            }
            if let Some(reason) = &g.departed[src] {
                return Err(Error::RankFailed {
                    rank: self.members[src],
                    op: "recv",
                    reason: reason.clone(),
                });
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    op: "recv",
                    waited: now - start,
                    missing: vec![self.members[src]],
                });
            }
            g = self
                .mail_cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

fn fault_error(g: &Inner, gen: u64, op: &'static str) -> Result<(), Error> {
    match &g.fault {
        Some((fault_gen, rank, reason)) if *fault_gen == gen => Err(Error::RankFailed {
            rank: *rank,
            op,
            reason: reason.clone(),
        }),
        _ => Ok(()),
    }
}

#[cfg(test)]
impl Group {
    /// (posts in the table, members counted as arrived), for tests of invariant 1.
    fn table(&self) -> (usize, usize) {
        let g = lock(&self.inner);
        (g.posts.iter().filter(|p| p.is_some()).count(), g.arrived)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::threads::view::RawBuf;

    fn barrier_post() -> Post {
        Post {
            call: Call::Barrier,
            dtype: None,
            send: RawBuf::null(),
            recv: RawBuf::null(),
            invalid: None,
        }
    }

    /// Rank 0 joins alone and waits; `leave` makes its join fail (poison or timeout).
    /// Returns its error and the table afterwards.
    fn lone_join(timeout: Duration, leave: impl FnOnce(&World)) -> (Error, (usize, usize)) {
        let world = World::new(2, Options { timeout });
        let group = Group::create(&world, vec![0, 1]);
        let err = std::thread::scope(|s| {
            let waiter = s.spawn(|| group.join(0, barrier_post(), "barrier").map(drop));
            // Only once rank 0's post is in the table does `leave` hit a waiting join (a
            // short timeout may end the join first).
            while group.table() != (1, 1) && !waiter.is_finished() {
                std::thread::yield_now();
            }
            leave(&world);
            waiter.join().expect("join does not panic")
        });
        (err.expect_err("rank 1 never joins"), group.table())
    }

    #[test]
    fn join_poisoned_while_waiting_withdraws_its_post() {
        let (err, table) = lone_join(Duration::from_secs(600), |world| {
            world.depart(1, "closure returned".into())
        });
        assert!(matches!(err, Error::RankFailed { rank: 1, .. }), "{err:?}");
        assert_eq!(
            table,
            (0, 0),
            "the poisoned join left its post (posts, arrived)"
        );
    }

    #[test]
    fn join_timed_out_withdraws_its_post() {
        let (err, table) = lone_join(Duration::from_millis(50), |_| {});
        assert!(matches!(err, Error::Timeout { .. }), "{err:?}");
        assert_eq!(
            table,
            (0, 0),
            "the timed-out join left its post (posts, arrived)"
        );
    }
}
