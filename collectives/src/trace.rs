//! A timeline recorder for any program on the library: spans with a name, a category,
//! a start, a duration and arguments, one row per rank, written in the Chrome
//! trace-event format (Perfetto and `chrome://tracing` open it).
//!
//! Off by default, and then free: every recording point checks one relaxed atomic and
//! does nothing else. [`enable`] turns it on for the process. Each thread says which rank
//! it records for ([`set_row`]; a `DeviceMesh` does it for its rank, a communicator's
//! progress worker for its own), and the events go into one process-wide buffer that
//! [`take`] drains, ready for [`chrome_json`].
//!
//! The communicators record every collective they complete (category `collective`):
//! kind, the communicator's label (the mesh axis, set by `DeviceMesh`), bytes sent and
//! received, and the time spent waiting for the peers to arrive (`wait_us`) apart from the
//! time moving data (`data_us`), as two nested spans.

use std::borrow::Cow;
use std::cell::{Cell, RefCell};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

static ENABLED: AtomicBool = AtomicBool::new(false);
static EVENTS: Mutex<Vec<Event>> = Mutex::new(Vec::new());

thread_local! {
    /// (rank, thread row) this thread records for.
    static ROW: Cell<(usize, usize)> = const { Cell::new((0, 0)) };
    /// This thread's events, moved to [`EVENTS`] when the thread ends or calls [`take`]:
    /// recording takes no lock.
    static LOCAL: Local = const { Local(RefCell::new(Vec::new())) };
}

struct Local(RefCell<Vec<Event>>);

impl Drop for Local {
    fn drop(&mut self) {
        let mine = std::mem::take(&mut *self.0.borrow_mut());
        if !mine.is_empty() {
            EVENTS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .extend(mine);
        }
    }
}

/// One recorded span.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// What the span shows as its title: the collective's kind (`"all_reduce"`), `"wait"`,
    /// or the name given to [`span`] / [`record`].
    pub name: Cow<'static, str>,
    /// The category, for filtering in the viewer: `"collective"`, `"collective.wait"`, or
    /// the one given to [`span`] / [`record`].
    pub cat: &'static str,
    /// The rank (one process row per rank in the viewer).
    pub rank: usize,
    /// The thread row within the rank: 0 its own thread, 1 its communicators' progress
    /// workers.
    pub tid: usize,
    /// Start, microseconds since midnight UTC (comparable across processes of one
    /// machine; see [`micros`]).
    pub ts_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
    /// Named values shown with the span (a collective's `axis`, `bytes_sent`,
    /// `bytes_received`, `wait_us`, `data_us`), in the order they were added.
    pub args: Vec<(&'static str, Arg)>,
}

/// An argument's value.
#[derive(Clone, Debug, PartialEq)]
pub enum Arg {
    /// An unsigned integer (a collective's byte counts).
    Int(u64),
    /// A real number (a collective's wait and data times in microseconds); a non-finite
    /// one is written as JSON `null`.
    Float(f64),
    /// Text (a collective's mesh axis label).
    Str(Cow<'static, str>),
}

/// Turns recording on for this process.
pub fn enable() {
    ENABLED.store(true, Ordering::Relaxed);
}

/// Turns recording off (what is recorded stays until [`take`]).
pub fn disable() {
    ENABLED.store(false, Ordering::Relaxed);
}

/// Whether recording is on.
#[inline]
pub fn is_enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// This thread records for `rank`, on thread row `tid` (0: the rank's own thread).
pub fn set_row(rank: usize, tid: usize) {
    ROW.with(|r| r.set((rank, tid)));
}

/// Drains every event recorded so far in this process by threads that have ended, and by
/// this one.
pub fn take() -> Vec<Event> {
    let mut all = std::mem::take(&mut *EVENTS.lock().unwrap_or_else(|e| e.into_inner()));
    let _ = LOCAL.try_with(|l| all.append(&mut l.0.borrow_mut()));
    all
}

/// Microseconds of `t` since midnight (UTC) of the day this process started recording,
/// measured on the monotonic clock from one anchor per process: processes of one machine
/// share the time base, and the values stay small enough for an f64 to keep their
/// nanoseconds (microseconds since 1970 would not).
pub fn micros(t: Instant) -> f64 {
    static ANCHOR: OnceLock<(Instant, f64)> = OnceLock::new();
    let (i0, s0) = *ANCHOR.get_or_init(|| {
        let since_epoch = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let in_day = since_epoch.as_micros() % 86_400_000_000;
        (Instant::now(), in_day as f64)
    });
    if t >= i0 {
        s0 + (t - i0).as_secs_f64() * 1e6
    } else {
        s0 - (i0 - t).as_secs_f64() * 1e6
    }
}

/// Records a span that started at `start` and lasted `dur_us`, if recording is on.
pub fn record(
    name: impl Into<Cow<'static, str>>,
    cat: &'static str,
    start: Instant,
    dur_us: f64,
    args: Vec<(&'static str, Arg)>,
) {
    if !is_enabled() {
        return;
    }
    let (rank, tid) = ROW.with(Cell::get);
    let e = Event {
        name: name.into(),
        cat,
        rank,
        tid,
        ts_us: micros(start),
        dur_us,
        args,
    };
    let mut e = Some(e);
    let _ = LOCAL.try_with(|l| l.0.borrow_mut().extend(e.take()));
    if let Some(e) = e {
        // This thread's storage is being torn down: straight to the shared buffer.
        EVENTS.lock().unwrap_or_else(|x| x.into_inner()).push(e);
    }
}

/// A span from its creation to its drop (nothing at all when recording is off).
#[must_use = "the span ends when this guard drops"]
pub struct Span {
    open: Option<Open>,
}

/// A span's name, category, start and arguments while it runs.
type Open = (
    Cow<'static, str>,
    &'static str,
    Instant,
    Vec<(&'static str, Arg)>,
);

/// [`span`] whose name is only built when recording is on.
#[inline]
pub fn span_with(name: impl FnOnce() -> String, cat: &'static str) -> Span {
    Span {
        open: is_enabled().then(|| (Cow::Owned(name()), cat, Instant::now(), Vec::new())),
    }
}

/// Starts a span named `name` in category `cat`.
#[inline]
pub fn span(name: impl Into<Cow<'static, str>>, cat: &'static str) -> Span {
    Span {
        open: is_enabled().then(|| (name.into(), cat, Instant::now(), Vec::new())),
    }
}

impl Span {
    /// Adds an argument shown with the span.
    pub fn arg(&mut self, key: &'static str, value: Arg) {
        if let Some(o) = &mut self.open {
            o.3.push((key, value));
        }
    }
}

impl Drop for Span {
    fn drop(&mut self) {
        if let Some((name, cat, start, args)) = self.open.take() {
            record(name, cat, start, start.elapsed().as_secs_f64() * 1e6, args);
        }
    }
}

/// The Chrome trace-event JSON of `events`: complete events (`"ph": "X"`), one process
/// per rank (named `rank N`), threads named `compute` and `progress`.
pub fn chrome_json(events: &[Event]) -> String {
    wrap(&[chrome_lines(events)])
}

/// A trace document from the [`chrome_lines`] of several processes (MPI ranks each
/// render their own and rank 0 joins them).
pub fn wrap(parts: &[String]) -> String {
    let body: Vec<&str> = parts
        .iter()
        .map(|p| p.as_str())
        .filter(|p| !p.is_empty())
        .collect();
    format!("{{\"traceEvents\":[\n{}\n]}}\n", body.join(",\n"))
}

/// `events` and their rows' names as trace-event objects, one per line, without the
/// document around them.
pub fn chrome_lines(events: &[Event]) -> String {
    let mut out = String::new();
    let mut ranks: Vec<(usize, usize)> = events.iter().map(|e| (e.rank, e.tid)).collect();
    ranks.sort_unstable();
    ranks.dedup();
    let mut first = true;
    let mut sep = |out: &mut String| {
        if !first {
            out.push_str(",\n");
        }
        first = false;
    };
    let mut named = Vec::new();
    for &(rank, tid) in &ranks {
        if !named.contains(&rank) {
            named.push(rank);
            sep(&mut out);
            let _ = write!(
                out,
                "{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{rank},\"tid\":0,\"args\":{{\"name\":\"rank {rank}\"}}}}"
            );
        }
        sep(&mut out);
        let thread = if tid == 0 { "compute" } else { "progress" };
        let _ = write!(
            out,
            "{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{rank},\"tid\":{tid},\"args\":{{\"name\":\"{thread}\"}}}}"
        );
    }
    for e in events {
        sep(&mut out);
        let _ = write!(
            out,
            "{{\"ph\":\"X\",\"name\":{},\"cat\":{},\"pid\":{},\"tid\":{},\"ts\":{:.3},\"dur\":{:.3},\"args\":{{",
            json_str(&e.name),
            json_str(e.cat),
            e.rank,
            e.tid,
            e.ts_us,
            e.dur_us.max(0.0)
        );
        for (i, (k, v)) in e.args.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            let v = match v {
                Arg::Int(n) => n.to_string(),
                Arg::Float(x) if x.is_finite() => format!("{x}"),
                Arg::Float(_) => "null".into(),
                Arg::Str(s) => json_str(s),
            };
            let _ = write!(out, "{}:{v}", json_str(k));
        }
        out.push_str("}}");
    }
    out
}

/// `s` as a JSON string literal.
pub fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

/// Records one collective: a span for the whole call with its kind, label (mesh axis),
/// bytes and the wait and data times, and inside it a `wait` span (peers arriving).
pub(crate) fn collective(
    kind: &'static str,
    label: &'static str,
    start: Instant,
    joined: Instant,
    end: Instant,
    sent: u64,
    received: u64,
) {
    if !is_enabled() {
        return;
    }
    let us = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e6;
    let (wait, data) = (us(start, joined), us(joined, end));
    record(
        kind,
        "collective",
        start,
        us(start, end),
        vec![
            ("axis", Arg::Str(Cow::Borrowed(label))),
            ("bytes_sent", Arg::Int(sent)),
            ("bytes_received", Arg::Int(received)),
            ("wait_us", Arg::Float(wait)),
            ("data_us", Arg::Float(data)),
        ],
    );
    // The wait for the peers as a slice of its own inside the call, so a timeline shows
    // it apart from the data movement (the rest of the call).
    record("wait", "collective.wait", start, wait, Vec::new());
}
