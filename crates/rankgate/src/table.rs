//! The routing table: ONE immutable snapshot of the fleet and its telemetry behind ONE
//! `ArcSwap`, and the per-worker live counters.
//!
//! Telemetry changes a few times a second, membership now and then, and both are read on every
//! request, so they live in an immutable [`Snapshot`] that the publisher builds aside and swaps
//! in whole: readers never see half an update, never see a worker without its telemetry, and
//! never take a lock. What changes per request (dispatched and completed counts) cannot wait for
//! the next snapshot, so it lives in atomics in each worker's [`Member`], one cache line per
//! worker so that two ranks' counters never contend.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio::time::Instant;

use crate::catalog::{Catalog, Model};
use crate::config::SourceKind;
use crate::ix::{EngineIx, IxVec, WorkerIx};
pub use crate::live::{Live, UNIT_WEIGHT};
use crate::model_routes::Routes;
pub use crate::reason::Reason;
use crate::worker::{Fleet, Member};

/// One rank's numbers, as its engine last reported them.
#[derive(Debug, Clone, PartialEq)]
pub struct Load {
    /// KV cache usage in [0, 1].
    pub kv_usage: f64,
    pub running: Option<u32>,
    pub waiting: Option<u32>,
    /// KV tokens in use and KV capacity of the rank, where the engine reports them.
    pub used_tokens: Option<u64>,
    pub capacity_tokens: Option<u64>,
    /// The engine published no per-rank series, so this is its engine-wide figure.
    pub aggregate: bool,
    /// For an upstream gateway: the entries of its rollup, annotations and all.
    pub upstream: Option<Arc<[crate::wire::RankLoad]>>,
    /// The engine's own prefix-cache counters for the rank, where it reports them (vLLM's
    /// `prefix_cache_queries_total` and `prefix_cache_hits_total`): prompt tokens looked up,
    /// and of those found cached. What affinity predicted is checked against these.
    pub prefix_cache: Option<PrefixCounters>,
    /// The rank is named by its engine but publishes no load gauges yet (see [`Fresh`]); the
    /// numbers above are then the idle rank's zeros, not a reading.
    pub fresh: Option<Fresh>,
    /// When the response carrying these numbers arrived.
    pub sampled_at: Instant,
}

/// A rank its engine names (a per-rank series, or the DP size the engine reported) that has no
/// load gauges yet: vLLM with DP publishes a rank's `kv_cache_usage_perc` and request gauges only
/// once that rank has served a request. Such a rank is fresh, not failed; routed as idle, within
/// the bounds below, until its gauges appear (the poller turns it Unavailable with
/// [`Reason::Silent`] if it serves several requests and still publishes nothing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fresh {
    /// The engine's own per-rank counters prove it never ran a request (vLLM: its
    /// `request_success_total` and `prompt_tokens_total` are all 0): idle, and while nothing
    /// is in flight on it, picked before any rank with numbers (its first request is what makes
    /// its gauges appear).
    Idle,
    /// Nothing proves it idle: it gets a trickle, at most [`FRESH_TRICKLE`] requests in flight
    /// at a time, until its gauges appear.
    Unproven,
}

/// Requests in flight at a time on a fresh rank that nothing proves idle.
pub const FRESH_TRICKLE: u64 = 2;

impl Fresh {
    pub fn as_str(self) -> &'static str {
        match self {
            Fresh::Idle => "idle",
            Fresh::Unproven => "unproven",
        }
    }
}

impl Load {
    /// A fresh rank's load: zeros in place of the gauges it does not publish yet.
    pub fn fresh(fresh: Fresh, capacity_tokens: Option<u64>, sampled_at: Instant) -> Load {
        Load {
            kv_usage: 0.0,
            running: None,
            waiting: None,
            used_tokens: None,
            capacity_tokens,
            aggregate: false,
            upstream: None,
            prefix_cache: None,
            fresh: Some(fresh),
            sampled_at,
        }
    }
}

/// An engine's prefix-cache counters for one rank, in tokens since it started.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixCounters {
    pub queries: u64,
    pub hits: u64,
}

/// A rank's telemetry state. Missing or bad numbers are a state with a reason, never zeros:
/// a router that reads "unknown" as "idle" sends traffic exactly where it knows least.
#[derive(Debug, Clone, PartialEq)]
pub enum RankTelemetry {
    Available(Load),
    Unavailable { reason: Reason },
}

impl RankTelemetry {
    pub fn unavailable(reason: Reason) -> Self {
        RankTelemetry::Unavailable { reason }
    }

    /// The load if it is available and younger than `stale_after` at `now`.
    #[inline]
    pub fn fresh(&self, now: Instant, stale_after: Duration) -> Option<&Load> {
        match self {
            RankTelemetry::Available(l)
                if now.saturating_duration_since(l.sampled_at) <= stale_after =>
            {
                Some(l)
            }
            _ => None,
        }
    }

    /// Why the rank is not routable by telemetry at `now` ([`Reason::Stale`] for an old
    /// sample), or `None` if it is.
    pub fn unavailable_reason(&self, now: Instant, stale_after: Duration) -> Option<Reason> {
        match self {
            RankTelemetry::Unavailable { reason } => Some(reason.clone()),
            RankTelemetry::Available(l) => {
                let age = now.saturating_duration_since(l.sampled_at);
                (age > stale_after).then_some(Reason::Stale { age, stale_after })
            }
        }
    }
}

/// What the router knows of one virtual worker at one point in time.
#[derive(Debug, Clone)]
pub struct RankView {
    pub telemetry: RankTelemetry,
    /// The engine answered its last poll (with usable numbers or not). Only reachable ranks take
    /// traffic when no rank has telemetry, or under the telemetry-blind policies.
    pub reachable: bool,
    /// The worker's `dispatched_weight` when the poll that produced this view began: requests
    /// sent after it are ones the engine cannot have reported yet.
    pub weight_at_poll: u64,
    /// The worker's requests in flight (by weight) when these numbers were taken in: those
    /// that end after it free KV the numbers still count (saturation reads the difference).
    pub in_flight_at_report: u64,
    /// Estimated KV fraction one more request takes on this rank.
    pub kv_per_request: f64,
    /// Which kind of telemetry source produced the numbers (`None`: none has yet).
    pub source: Option<SourceKind>,
    /// The rank has been available (numbers, or fresh) at some poll since it joined: one that
    /// never was is "not available yet" in the log, never "still unavailable".
    pub ever_available: bool,
}

impl RankView {
    pub fn initial() -> RankView {
        RankView {
            telemetry: RankTelemetry::unavailable(Reason::NotPolled),
            reachable: false,
            weight_at_poll: 0,
            in_flight_at_report: 0,
            kv_per_request: 0.0,
            source: None,
            ever_available: false,
        }
    }
}

/// A rank with fresh telemetry showing `kv` usage and nothing queued, for unit tests.
#[cfg(test)]
pub fn test_view(kv: f64, now: Instant) -> RankView {
    RankView {
        telemetry: RankTelemetry::Available(Load {
            kv_usage: kv,
            running: Some(0),
            waiting: Some(0),
            used_tokens: None,
            capacity_tokens: None,
            aggregate: false,
            upstream: None,
            prefix_cache: None,
            fresh: None,
            sampled_at: now,
        }),
        reachable: true,
        weight_at_poll: 0,
        in_flight_at_report: 0,
        kv_per_request: 0.02,
        source: None,
        ever_available: true,
    }
}

/// The immutable snapshot: the fleet, one view per worker (indexed like `fleet.workers`) and
/// the catalog (indexed like `fleet.engines`).
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub fleet: Arc<Fleet>,
    pub ranks: IxVec<WorkerIx, RankView>,
    /// The fleet's models, and which engines serve each.
    pub catalog: Arc<Catalog>,
}

/// Per engine: its models when the config fixes them, else `None` (until `/v1/models` says).
pub fn fixed_models(fleet: &Fleet) -> IxVec<EngineIx, Option<Arc<[Model]>>> {
    fleet
        .engines
        .iter()
        .map(|e| {
            e.models
                .as_ref()
                .map(|ids| ids.iter().map(|id| Model::named(id)).collect())
        })
        .collect()
}

/// The current snapshot, shared by proxy, admin and the publisher.
#[derive(Debug)]
pub struct Table {
    pub snapshot: ArcSwap<Snapshot>,
    pub stale_after: Duration,
    /// KV-event publishers refused on rankgate's bound endpoints, for `/metrics`.
    pub kv_refused: Arc<crate::kv::listen::Refusals>,
    /// Told each time telemetry publishes a snapshot (flow control's queue wakes on it).
    pub published: tokio::sync::Notify,
    /// Rounds of reading the engines' model lists again at once.
    pub recheck: crate::recheck::Recheck,
}

impl Table {
    pub fn new(fleet: Fleet, stale_after: Duration) -> Arc<Table> {
        Table::routed(fleet, stale_after, Arc::default())
    }

    /// [`Table::new`] with `[[routes]]` in its catalog from the start.
    pub fn routed(fleet: Fleet, stale_after: Duration, routes: Arc<Routes>) -> Arc<Table> {
        let mut snapshot = Snapshot::initial(fleet);
        snapshot.catalog = Arc::new(Catalog::new(fixed_models(&snapshot.fleet)).routed(routes));
        Arc::new(Table {
            snapshot: ArcSwap::from_pointee(snapshot),
            stale_after,
            kv_refused: Arc::default(),
            published: tokio::sync::Notify::new(),
            recheck: crate::recheck::Recheck::default(),
        })
    }
}

impl Snapshot {
    /// `fleet` with nothing polled yet.
    pub fn initial(fleet: Fleet) -> Snapshot {
        Snapshot {
            ranks: vec![RankView::initial(); fleet.workers.len()].into(),
            catalog: Arc::new(Catalog::new(fixed_models(&fleet))),
            fleet: Arc::new(fleet),
        }
    }
}

/// Marks one request as in flight on a worker until dropped. Held by the response body, so a
/// streaming request counts until its last chunk, or until the client goes away.
#[derive(Debug)]
pub struct InFlight {
    member: Arc<Member>,
    weight: u64,
    /// The LoRA adapter the request names, held on the rank until it ends.
    adapter: Option<Arc<str>>,
}

impl InFlight {
    pub fn start(member: Arc<Member>, weight: u64) -> InFlight {
        let live = &member.live;
        // Weight before count: a reader that sees the request counted also sees its weight.
        live.dispatched_weight.fetch_add(weight, Relaxed);
        live.dispatched.fetch_add(1, Relaxed);
        InFlight {
            member,
            weight,
            adapter: None,
        }
    }

    /// The request runs LoRA adapter `name` on its rank until it ends.
    pub fn hold_adapter(&mut self, name: &Arc<str>) {
        self.member.adapters.hold(name);
        self.adapter = Some(name.clone());
    }

    pub fn member(&self) -> &Arc<Member> {
        &self.member
    }

    /// Test fleets are one engine whose ranks start at 0: the worker's index is its rank.
    #[cfg(test)]
    pub fn worker(&self) -> usize {
        self.member.id.rank.unwrap_or(0) as usize
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let live = &self.member.live;
        live.completed.fetch_add(1, Relaxed);
        live.completed_weight.fetch_add(self.weight, Relaxed);
        if let Some(a) = &self.adapter {
            self.member.adapters.release(a);
        }
    }
}
