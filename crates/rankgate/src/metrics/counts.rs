//! Counters that live with what they count: a worker's in its [`crate::worker::Member`], an
//! engine's polls in its [`crate::worker::EngineEntry`]. They leave `/metrics` when the worker
//! or engine leaves the fleet, since the collector only reads the fleet of the current
//! snapshot; a request still on a departed worker keeps counting into a struct nobody scrapes.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, PoisonError};

use arc_swap::ArcSwap;
use prometheus_client::metrics::counter::Counter;

use super::labels::RequestLabels;
use crate::config::SourceKind;

/// One series of the requests counters: the request's labels and its status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestKey {
    pub labels: RequestLabels,
    pub status: u16,
}

impl Hash for RequestKey {
    /// The three `u16`s as one word, for [`KeyHasher`].
    fn hash<H: Hasher>(&self, state: &mut H) {
        let RequestLabels { model, route } = self.labels;
        state.write_u64((model.0 as u64) << 32 | (route.0 as u64) << 16 | self.status as u64);
    }
}

/// The hash of a [`RequestKey`]: its word multiplied by a 64-bit odd constant and the 128-bit
/// product folded (as foldhash does), so that every bit of the key reaches the low bits
/// hashbrown indexes by and the high bits it tags with. SipHash would resist keys chosen to
/// collide, which these are not (they are small indices and a status), at several times the
/// cost on every request.
#[derive(Debug, Default, Clone, Copy)]
pub struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u64(*b as u64);
        }
    }

    #[inline]
    fn write_u64(&mut self, x: u64) {
        let full = ((self.0 ^ x) as u128) * 0x9E37_79B9_7F4A_7C15u128;
        self.0 = (full as u64) ^ ((full >> 64) as u64);
    }

    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }
}

type Series = HashMap<RequestKey, Counter, BuildHasherDefault<KeyHasher>>;

/// Requests by model, route and status. Which combinations occur is only known as requests come,
/// so the series are a map; it is read on every request and written once per new combination,
/// so it is copied on write and swapped whole (as the snapshot is): a request takes no lock and
/// allocates nothing once its combination has been seen.
#[derive(Debug, Default)]
pub struct RequestCounts {
    series: ArcSwap<Series>,
    grow: Mutex<()>,
}

impl RequestCounts {
    #[inline]
    pub fn inc(&self, key: RequestKey) {
        match self.series.load().get(&key) {
            Some(c) => {
                c.inc();
            }
            None => self.add(key),
        }
    }

    #[cold]
    fn add(&self, key: RequestKey) {
        let _grow = self.grow.lock().unwrap_or_else(PoisonError::into_inner);
        let cur = self.series.load();
        if let Some(c) = cur.get(&key) {
            c.inc();
            return;
        }
        // The counters are shared handles: one bumped through the old map after the copy is
        // the same counter in the new one.
        let mut next = HashMap::clone(&cur);
        let c = Counter::default();
        c.inc();
        next.insert(key, c);
        self.series.store(Arc::new(next));
    }

    /// Every series so far.
    pub fn snapshot(&self) -> Arc<Series> {
        self.series.load_full()
    }

    /// Requests so far, all series.
    pub fn total(&self) -> u64 {
        self.series.load().values().map(Counter::get).sum()
    }
}

/// How one upstream attempt ended, as `observe` saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The engine answered with a status below 500.
    Answered,
    /// The engine answered 5xx.
    ServerError,
    /// Connecting failed, or the connection broke before the response headers.
    Transport,
    /// No response headers within `server.response_timeout`.
    Timeout,
    /// Every connection slot to the engine stayed busy.
    Busy,
    /// Anything else: the client's body broke, the rank pin could not be applied.
    Other,
}

impl Attempt {
    pub const ALL: [Attempt; 6] = [
        Attempt::Answered,
        Attempt::ServerError,
        Attempt::Transport,
        Attempt::Timeout,
        Attempt::Busy,
        Attempt::Other,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Attempt::Answered => "answered",
            Attempt::ServerError => "server_error",
            Attempt::Transport => "transport_error",
            Attempt::Timeout => "timeout",
            Attempt::Busy => "busy",
            Attempt::Other => "other",
        }
    }
}

/// One worker's counters.
#[derive(Debug, Default)]
pub struct WorkerCounters {
    /// Requests answered on this worker (by the engine, or by rankgate for it).
    pub requests: RequestCounts,
    /// Upstream attempts by [`Attempt`] (in [`Attempt::ALL`] order).
    pub attempts: [AtomicU64; Attempt::ALL.len()],
    pub ejections: AtomicU64,
    /// Requests whose client left: `[before_first_byte, mid_stream]`.
    pub abandoned: [AtomicU64; 2],
    /// Requests that waited for their first byte past the fleet's bound.
    pub hung: AtomicU64,
    /// Prompt tokens prefix affinity expected the worker to hold for the requests sent to it:
    /// `[by rankgate's record, by its engine's KV events]`.
    pub predicted_hit_tokens: [AtomicU64; 2],
    /// Legs of disaggregated requests sent here: `[prefill, decode]`.
    pub pd_legs: [AtomicU64; 2],
    /// Whether its last disaggregated legs failed, and how (`/workers`' `pd`).
    pub pd_health: super::pd::RankPdHealth,
}

impl WorkerCounters {
    /// A request sent here with `tokens` of its prompt expected cached.
    #[inline]
    pub fn predicted(&self, exact: bool, tokens: u64) {
        self.predicted_hit_tokens[exact as usize].fetch_add(tokens, Relaxed);
    }

    #[inline]
    pub fn attempt(&self, a: Attempt) {
        self.attempts[a as usize].fetch_add(1, Relaxed);
    }
}

/// How one read of one telemetry source ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollResult {
    Ok,
    /// It answered with an error, or could not be reached or read.
    Error,
    /// No answer within `telemetry.timeout`.
    Timeout,
    /// Left out of the poll: it failed recently and is probed in the background.
    Skipped,
}

impl PollResult {
    pub const ALL: [PollResult; 4] = [
        PollResult::Ok,
        PollResult::Error,
        PollResult::Timeout,
        PollResult::Skipped,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PollResult::Ok => "ok",
            PollResult::Error => "error",
            PollResult::Timeout => "timeout",
            PollResult::Skipped => "skipped",
        }
    }
}

/// One engine's telemetry counters.
#[derive(Debug, Default)]
pub struct PollCounters {
    /// Reads by source (in [`SourceKind::ALL`] order) and result (in [`PollResult::ALL`] order).
    reads: [[AtomicU64; PollResult::ALL.len()]; SourceKind::ALL.len()],
    /// Polls in which no source answered.
    pub failed: AtomicU64,
    /// Lines of a Prometheus scrape that could not be parsed.
    pub bad_lines: AtomicU64,
    /// Load entries naming a rank outside the engine's managed set.
    pub unmanaged_entries: AtomicU64,
}

impl PollCounters {
    /// One read of a source of kind `source`.
    pub fn read(&self, source: SourceKind, result: PollResult) {
        self.reads[source.index()][result as usize].fetch_add(1, Relaxed);
    }

    pub fn reads(&self, source: SourceKind, result: PollResult) -> u64 {
        self.reads[source.index()][result as usize].load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::labels::ModelIdx;
    use crate::metrics::routes::Routes;

    #[test]
    fn a_series_counts_across_the_copy_that_adds_another() {
        let routes = Routes::new(&[]);
        let key = |status| RequestKey {
            labels: RequestLabels {
                model: ModelIdx::UNKNOWN,
                route: routes.of(false, "/v1/completions"),
            },
            status,
        };
        let counts = RequestCounts::default();
        counts.inc(key(200));
        let old = counts.snapshot();
        counts.inc(key(503));
        // A request that read the map before the copy counts in the new one too.
        old[&key(200)].inc();
        counts.inc(key(200));
        let now = counts.snapshot();
        assert_eq!(now[&key(200)].get(), 3);
        assert_eq!(now[&key(503)].get(), 1);
        assert_eq!(counts.total(), 4);
    }
}
