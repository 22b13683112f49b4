//! Rank selection: which virtual worker takes the next request.
//!
//! `least_kv` scores each rank with fresh telemetry by its reported KV usage plus the KV that
//! work not yet visible in that report will take: its waiting queue, and the requests this router
//! sent it since the poll began (capped by what is still in flight, so nothing the engine already
//! reports, and nothing already finished, is counted twice). That credit is what spreads a burst
//! between two polls instead of herding it onto the rank that looked idle. Each request is
//! credited by its size relative to the typical request (its Content-Length against a running
//! mean, no body read), so a 1500-token prompt weighs like several short ones. A rank without
//! fresh, valid telemetry is never scored: unknown is not idle.
//!
//! Every policy passes over ejected ranks (see [`crate::outlier`]) and the ranks a retry must
//! avoid; `least_kv` also weighs each rank's consecutive failures, so a rank that fails fast
//! never looks like the idlest one.
//!
//! The pick is one `ArcSwap` load plus relaxed atomic reads: no lock on the request path.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use rand::Rng;
use tokio::time::Instant;

use crate::config::{NoTelemetry, Policy, RoutingConfig};
use crate::outlier::{Admit, FAILURE_WEIGHT};
use crate::table::{InFlight, RankView, Snapshot, Table, UNIT_WEIGHT};
use crate::worker::{Engine, EngineEntry, EngineId, Flavor, Fleet, Member, Seat, WorkerId};

mod explain;

use explain::explain_pick;
pub use explain::{By, Candidate, Explanation, Skipped};

/// Why no rank was picked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum NoRank {
    #[error("no rank has fresh telemetry and the router is set to reject (routing.no_telemetry = \"reject\")")]
    NoTelemetry,
    #[error("no rank is reachable: every rank is ejected after failures, failed its last telemetry poll, or has not been polled yet")]
    NoneReachable,
    #[error("the fleet has no engine to serve this: none configured, added or discovered (yet)")]
    NoEngine,
    /// Engines that could serve it exist, but none has said its flavor and DP size yet.
    #[error("no engine that could serve this has said what it is yet (flavor, DP size): each is asked until it answers; GET /workers on the admin listener says why for each")]
    ShapeUnknown,
}

/// A successful pick.
#[derive(Debug)]
pub struct Picked {
    pub guard: InFlight,
    /// The engine of the picked worker.
    pub engine: Arc<EngineEntry>,
    /// At least one rank was passed over because its telemetry was missing, stale or invalid.
    pub skipped_unavailable: bool,
    /// The request is the trial of a rank whose ejection ran out.
    pub trial: bool,
}

/// Ranks a request must not go to: those of engines that do not serve its front door, model or
/// route, and on a retry the ranks that failed it (every rank of an engine that failed at the
/// transport level). Engines and workers are named by their stable ids, so an `Avoid` made
/// against one version of the fleet means the same against the next. Empty (and
/// allocation-free) for the usual request.
#[derive(Debug, Clone, Default)]
pub struct Avoid {
    front: Front,
    /// When set, the only engines that may serve the request (sorted): those serving its model
    /// and route. An engine that joined after they were chosen is not among them.
    only: Option<Vec<EngineId>>,
    /// A few at most: one per failed attempt.
    workers: Vec<WorkerId>,
    engines: Vec<EngineId>,
    /// The request's model, when no known model list has it (only engines whose list is
    /// unknown may serve it): a failed pick then says so, naming the model.
    pub unlisted_model: Option<Arc<str>>,
}

/// The front door a request came through; only engines serving it may take the request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Front {
    /// The OpenAI HTTP API (every engine with a `url`).
    #[default]
    Http,
    /// The gRPC service of this flavor (engines of the flavor with a `grpc_url`).
    Grpc(Flavor),
}

impl Front {
    pub fn served_by(self, e: &Engine) -> bool {
        match self {
            Front::Http => e.http,
            Front::Grpc(f) => e.grpc.is_some() && e.flavor == f,
        }
    }
}

impl Avoid {
    pub fn front(front: Front) -> Avoid {
        Avoid {
            front,
            ..Avoid::default()
        }
    }

    pub fn worker(&mut self, w: WorkerId) {
        self.workers.push(w);
    }

    pub fn engine(&mut self, e: EngineId) {
        self.engines.push(e);
    }

    /// Only these engines may serve the request.
    pub fn only(&mut self, mut engines: Vec<EngineId>) {
        engines.sort_unstable();
        self.only = Some(engines);
    }

    /// Whether every rank of `e` is ruled out.
    pub fn has_engine(&self, e: &EngineEntry) -> bool {
        !self.may_serve(e) || self.engines.contains(&e.key)
    }

    /// Whether `e` is of the engines the request may go to at all (its front door, model and
    /// route), failures aside.
    fn may_serve(&self, e: &EngineEntry) -> bool {
        self.front.served_by(e)
            && (self.only.as_ref()).is_none_or(|o| o.binary_search(&e.key).is_ok())
    }

    #[inline]
    fn blocks(&self, fleet: &Fleet, w: &Seat) -> bool {
        self.workers.contains(&w.key) || self.has_engine(&fleet.engines[w.engine])
    }
}

/// Whether worker `w` may be picked at all: not ejected (or due for its trial), not avoided.
#[inline]
fn eligible(fleet: &Fleet, w: &Seat, avoid: &Avoid) -> bool {
    w.live.outlier.admit() != Admit::No && !avoid.blocks(fleet, w)
}

/// Chooses ranks according to the configured policy.
#[derive(Debug)]
pub struct Selector {
    policy: Policy,
    no_telemetry: NoTelemetry,
    rr: AtomicU64,
    sizer: RequestSizer,
    /// `least_kv` picks at random among ranks scoring within this of the best.
    tie_margin: f64,
    /// `routing.prefix_affinity`: `(affinity_margin, affinity_max_kv)`.
    affinity: Option<(f64, f64)>,
}

/// Weighs requests by body size against a running mean of recent sizes.
#[derive(Debug, Default)]
pub struct RequestSizer {
    /// Exponentially weighted mean of Content-Length, in sixteenths of a byte; 0 = none seen.
    mean_x16: AtomicU64,
}

impl RequestSizer {
    /// A request's weight in thousandths of a typical one: within [1/4, 32], and exactly one
    /// when its size is unknown (no Content-Length) or nothing has been seen yet.
    pub fn weight(&self, content_length: Option<u64>) -> u64 {
        let Some(len) = content_length.filter(|l| *l > 0) else {
            return UNIT_WEIGHT;
        };
        let x = len.saturating_mul(16);
        let mean = self.mean_x16.load(Relaxed);
        // Mean over roughly the last 32 requests. Load-then-store can lose an update under
        // contention; for an estimate that is cheaper than a compare-and-swap loop and harmless.
        let next = if mean == 0 {
            x
        } else {
            mean - mean / 32 + x / 32
        };
        self.mean_x16.store(next.max(1), Relaxed);
        if mean == 0 {
            return UNIT_WEIGHT;
        }
        (x.saturating_mul(UNIT_WEIGHT) / mean).clamp(UNIT_WEIGHT / 4, 32 * UNIT_WEIGHT)
    }
}

impl Selector {
    pub fn new(cfg: &RoutingConfig) -> Selector {
        Selector {
            policy: cfg.policy,
            no_telemetry: cfg.no_telemetry,
            rr: AtomicU64::new(0),
            sizer: RequestSizer::default(),
            tie_margin: cfg.tie_margin,
            affinity: cfg
                .prefix_affinity
                .then_some((cfg.affinity_margin, cfg.affinity_max_kv)),
        }
    }

    /// Whether picks weigh prompt prefixes (then `pick` layer reads them from the body).
    pub fn affinity(&self) -> bool {
        self.affinity.is_some()
    }

    /// True when [`Selector::pick`] would find a rank now (the admin `/ready`).
    pub fn any_routable(&self, table: &Table, avoid: &Avoid) -> bool {
        let snap = table.snapshot.load();
        let now = Instant::now();
        let ok = |w: usize| eligible(&snap.fleet, &snap.fleet.workers[w], avoid);
        let reachable = (0..snap.ranks.len()).any(|w| ok(w) && snap.ranks[w].reachable);
        let fresh = || {
            (0..snap.ranks.len()).any(|w| {
                ok(w)
                    && snap.ranks[w]
                        .telemetry
                        .fresh(now, table.stale_after)
                        .is_some()
            })
        };
        match (self.policy, self.no_telemetry) {
            (Policy::LeastKv, NoTelemetry::Reject) => fresh(),
            (Policy::LeastKv, NoTelemetry::LeastInFlight) => reachable || fresh(),
            _ => reachable,
        }
    }

    /// Whether a request through some front door could be routed now: the OpenAI one, or with
    /// `grpc` the gRPC one (for either flavor). A fleet of gRPC-only engines is ready through
    /// the gRPC front door alone.
    pub fn any_front_routable(&self, table: &Table, grpc: bool) -> bool {
        self.any_routable(table, &Avoid::default())
            || (grpc
                && [Flavor::Vllm, Flavor::Sglang]
                    .into_iter()
                    .any(|f| self.any_routable(table, &Avoid::front(Front::Grpc(f)))))
    }

    /// Picks a worker, not one of `avoid`'s, and marks one request, of this body size if known,
    /// in flight on it.
    pub fn pick(
        &self,
        table: &Arc<Table>,
        content_length: Option<u64>,
        avoid: &Avoid,
    ) -> Result<Picked, NoRank> {
        self.pick_explained(table, content_length, avoid, &[], None)
    }

    /// [`Selector::pick`] for a prompt whose chunk names are `prompt` (see [`crate::prefix`];
    /// empty when unknown or affinity is off), writing why it went where it did (or nowhere)
    /// to `explain` when given: from the same snapshot and instant the pick used.
    pub fn pick_explained(
        &self,
        table: &Arc<Table>,
        content_length: Option<u64>,
        avoid: &Avoid,
        prompt: &[u64],
        mut explain: Option<&mut Explanation>,
    ) -> Result<Picked, NoRank> {
        let snap = table.snapshot.load();
        let now = Instant::now();
        if !(snap.fleet.engines.iter()).any(|e| avoid.may_serve(e) && !e.members.is_empty()) {
            if let Some(x) = explain {
                *x = Explanation::new(self.policy, By::Kv);
                x.not_serving = snap.ranks.len();
            }
            let unshaped = (snap.fleet.engines.iter()).any(|e| avoid.may_serve(e));
            return Err(match unshaped {
                true => NoRank::ShapeUnknown,
                false => NoRank::NoEngine,
            });
        }
        let mut rng = rand::rng();
        let fleet = &snap.fleet;
        let usable =
            |w: usize| snap.ranks[w].reachable && eligible(fleet, &fleet.workers[w], avoid);
        let (choice, by) = match self.policy {
            Policy::LeastKv => match self.least_kv(table, &snap, now, avoid, prompt, &mut rng) {
                Some((w, skipped)) => (Ok((w, skipped)), By::Kv),
                None => match self.no_telemetry {
                    NoTelemetry::Reject => (Err(NoRank::NoTelemetry), By::Kv),
                    NoTelemetry::LeastInFlight => (
                        least_in_flight(&snap, avoid, &mut rng)
                            .map(|w| (w, true))
                            .ok_or(NoRank::NoneReachable),
                        By::InFlight,
                    ),
                },
            },
            Policy::RoundRobin => {
                let n = snap.ranks.len();
                let start = self.rr.fetch_add(1, Relaxed) as usize;
                let w = (0..n).map(|i| (start + i) % n).find(|&w| usable(w));
                (
                    w.map(|w| (w, false)).ok_or(NoRank::NoneReachable),
                    By::Reachable,
                )
            }
            Policy::Random => {
                let count = (0..snap.ranks.len()).filter(|&w| usable(w)).count();
                let w = (count > 0)
                    .then(|| rng.random_range(0..count))
                    .and_then(|k| (0..snap.ranks.len()).filter(|&w| usable(w)).nth(k));
                (
                    w.map(|w| (w, false)).ok_or(NoRank::NoneReachable),
                    By::Reachable,
                )
            }
        };
        if let Some(x) = explain.as_deref_mut() {
            let affinity = self.affinity.map(|a| (a, prompt));
            *x = explain_pick(table, &snap, now, avoid, self.policy, by, affinity);
            x.set_picked(
                (choice.as_ref().ok()).map(|(w, _)| fleet.workers[*w].id_text.to_string()),
            );
        }
        let (choice, skipped) = choice?;
        let member = &fleet.workers[choice].member;
        let outlier = &member.live.outlier;
        let trial = match outlier.admit() {
            Admit::Yes => false,
            Admit::Trial if outlier.start_trial() => true,
            // Another request claimed its trial (or ejected it again) since it was chosen: it
            // takes nothing else, so pick again without it. Each round avoids one more rank.
            Admit::Trial | Admit::No => {
                let mut again = avoid.clone();
                again.worker(member.key);
                return self.pick_explained(table, content_length, &again, prompt, explain);
            }
        };
        if self.affinity.is_some() && !prompt.is_empty() {
            let capacity = match &snap.ranks[choice].telemetry {
                crate::table::RankTelemetry::Available(l) => l.capacity_tokens,
                _ => None,
            };
            let budget = crate::prefix::budget(capacity, snap.ranks.len());
            (member.prefixes).record(crate::prefix::recorded(prompt, budget), budget);
        }
        Ok(Picked {
            guard: InFlight::start(member.clone(), self.sizer.weight(content_length)),
            engine: fleet.engines[fleet.workers[choice].engine].clone(),
            skipped_unavailable: skipped,
            trial,
        })
    }
}

/// The score `least_kv` ranks by, or `None` when the rank has no fresh telemetry.
#[inline]
pub fn score(table: &Table, snap: &Snapshot, w: usize, now: Instant) -> Option<f64> {
    let member = &snap.fleet.workers[w].member;
    score_of(
        table,
        &snap.ranks[w],
        member,
        member.live.outlier.admit(),
        now,
    )
}

/// [`score`] of a rank whose view, worker and admission are at hand.
#[inline]
fn score_of(
    table: &Table,
    view: &RankView,
    member: &Member,
    admit: Admit,
    now: Instant,
) -> Option<f64> {
    let load = view.telemetry.fresh(now, table.stale_after)?;
    let live = &member.live;
    let since_poll = live
        .dispatched_weight
        .load(Relaxed)
        .saturating_sub(view.weight_at_poll);
    let unreported = since_poll.min(live.in_flight_weight()) as f64 / UNIT_WEIGHT as f64;
    let queued = load.waiting.unwrap_or(0) as f64;
    Some(load.kv_usage + (queued + unreported) * view.kv_per_request + failing(member, admit))
}

/// The penalty for a rank's recent consecutive failures. It steers traffic off a rank that fails
/// before it is ejected, and fades (see [`crate::outlier::State::recent_failures`]), since only a
/// success resets the count and a rank kept off by its penalty gets no request to succeed with.
/// An ejected rank has no penalty: its trial is what decides.
#[inline]
fn failing(member: &Member, admit: Admit) -> f64 {
    let outlier = &member.live.outlier;
    match admit {
        Admit::Yes => outlier.recent_failures() * FAILURE_WEIGHT,
        Admit::Trial | Admit::No => 0.0,
    }
}

thread_local! {
    /// `least_kv`'s scores, kept between picks: no allocation per pick.
    static SCORES: std::cell::RefCell<Vec<(usize, f64)>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Selector {
    /// The pick among ranks with fresh telemetry: a rank due for its trial first; else, with
    /// affinity and a prompt, the rank holding the longest prefix of it among those scoring
    /// within `affinity_margin` of the best and below `affinity_max_kv`; else one at random
    /// among those within `tie_margin` of the best. Returns the worker and whether an
    /// unavailable rank was passed over.
    fn least_kv(
        &self,
        table: &Table,
        snap: &Snapshot,
        now: Instant,
        avoid: &Avoid,
        prompt: &[u64],
        rng: &mut impl Rng,
    ) -> Option<(usize, bool)> {
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            scores.clear();
            let mut skipped = false;
            let fleet = &snap.fleet;
            // An engine's ranks are consecutive: its verdict is looked up once per engine.
            let mut engine_ok = (usize::MAX, false);
            for (w, (seat, view)) in fleet.workers.iter().zip(&snap.ranks).enumerate() {
                if engine_ok.0 != seat.engine {
                    engine_ok = (seat.engine, !avoid.has_engine(&fleet.engines[seat.engine]));
                }
                let admit = seat.live.outlier.admit();
                if !engine_ok.1 || admit == Admit::No || avoid.workers.contains(&seat.key) {
                    continue;
                }
                match score_of(table, view, seat, admit, now) {
                    None => skipped = true,
                    // A rank due for its ejection trial goes first: its failures would
                    // otherwise keep its score above every healthy rank's, and it would never
                    // get the one request that decides.
                    Some(_) if admit == Admit::Trial => scores.push((w, f64::NEG_INFINITY)),
                    Some(s) => scores.push((w, s)),
                }
            }
            let best = scores.iter().map(|c| c.1).fold(f64::INFINITY, f64::min);
            if scores.is_empty() {
                return None;
            }
            if best == f64::NEG_INFINITY {
                return random_at_most(&scores, best, rng).map(|w| (w, skipped));
            }
            if let (Some((margin, max_kv)), false) = (self.affinity, prompt.is_empty()) {
                if let Some(w) = longest_prefix(fleet, &scores, prompt, best + margin, max_kv) {
                    return Some((w, skipped));
                }
            }
            // Scores are sums of floats: within 1e-9 they are the same load.
            let within = best + self.tie_margin.max(1e-9);
            random_at_most(&scores, within, rng).map(|w| (w, skipped))
        })
    }
}

/// Among `scores` at most `limit` and below `max_kv`, the rank holding the longest leading run
/// of `prompt`'s chunks (the lower score between equal runs); `None` when none holds any.
fn longest_prefix(
    fleet: &Fleet,
    scores: &[(usize, f64)],
    prompt: &[u64],
    limit: f64,
    max_kv: f64,
) -> Option<usize> {
    let mut best: Option<(usize, usize, f64)> = None;
    for &(w, s) in scores {
        if s > limit || s >= max_kv {
            continue;
        }
        let run = fleet.workers[w].prefixes.matched(prompt);
        let better = match best {
            None => run > 0,
            Some((_, r, bs)) => run > r || (run == r && s < bs),
        };
        if better {
            best = Some((w, run, s));
        }
    }
    best.map(|(w, _, _)| w)
}

/// A rank chosen uniformly among `scores` at most `limit` (one pass, reservoir sampling).
fn random_at_most(scores: &[(usize, f64)], limit: f64, rng: &mut impl Rng) -> Option<usize> {
    let mut chosen = None;
    let mut seen = 0u32;
    for &(w, s) in scores {
        if s <= limit {
            seen += 1;
            if rng.random_range(0..seen) == 0 {
                chosen = Some(w);
            }
        }
    }
    chosen
}

/// Fewest requests in flight (and recent failures) among reachable ranks, ties at random.
fn least_in_flight(snap: &Snapshot, avoid: &Avoid, rng: &mut impl Rng) -> Option<usize> {
    let fleet = &snap.fleet;
    let counts = (0..snap.ranks.len())
        .filter(|&w| snap.ranks[w].reachable && eligible(fleet, &fleet.workers[w], avoid))
        .map(|w| {
            let live = &fleet.workers[w].live;
            let key = match live.outlier.admit() {
                Admit::Trial => f64::NEG_INFINITY,
                _ => live.in_flight() as f64 + live.outlier.recent_failures(),
            };
            (w, key)
        });
    min_with_random_ties(counts, 0.0, rng)
}

/// The candidate with the lowest key; keys within `tie` of the lowest share the pick uniformly at
/// random (reservoir sampling over the tied, so one pass and no allocation).
fn min_with_random_ties(
    cands: impl Iterator<Item = (usize, f64)>,
    tie: f64,
    rng: &mut impl Rng,
) -> Option<usize> {
    let mut best: Option<(usize, f64)> = None;
    let mut ties = 0u32;
    for (w, key) in cands {
        match best {
            Some((_, b)) if key > b + tie => {}
            Some((_, b)) if key >= b - tie => {
                ties += 1;
                if rng.random_range(0..ties) == 0 {
                    best = Some((w, b));
                }
            }
            _ => {
                best = Some((w, key));
                ties = 1;
            }
        }
    }
    best.map(|(w, _)| w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::{RankTelemetry, RankView};
    use crate::worker::Fleet;
    use proptest::prelude::*;
    use std::time::Duration;

    fn table(n: u32) -> Arc<Table> {
        let engine = crate::worker::test_engine("http://e:1", n, 0);
        Table::new(Fleet::expand(vec![engine]), Duration::from_secs(2))
    }

    fn available(kv: f64, now: Instant) -> RankView {
        crate::table::test_view(kv, now)
    }

    fn set(table: &Table, ranks: Vec<RankView>) {
        let snap = table.snapshot.load();
        let (fleet, catalog) = (snap.fleet.clone(), snap.catalog.clone());
        table.snapshot.store(Arc::new(Snapshot {
            fleet,
            ranks,
            catalog,
        }));
    }

    /// Worker `w` of the current fleet.
    fn member(table: &Table, w: usize) -> Arc<crate::worker::Member> {
        table.snapshot.load().fleet.workers[w].member.clone()
    }

    fn routing(policy: Policy, no_telemetry: NoTelemetry) -> RoutingConfig {
        RoutingConfig {
            policy,
            no_telemetry,
            request_kv_estimate: 0.02,
            retry_after_secs: 1,
            max_attempts: 3,
            retry_buffer_bytes: 1 << 20,
            retry_budget: 0.2,
            eject_after: 5,
            eject_for: Duration::from_secs(10),
            // Exact picks, so the tests can tell which rank the credit points at.
            tie_margin: 0.0,
            prefix_affinity: false,
            affinity_margin: 0.1,
            affinity_max_kv: 0.85,
        }
    }

    fn selector(policy: Policy, no_telemetry: NoTelemetry) -> Selector {
        Selector::new(&routing(policy, no_telemetry))
    }

    fn affine(margin: f64, max_kv: f64) -> Selector {
        Selector::new(&RoutingConfig {
            prefix_affinity: true,
            affinity_margin: margin,
            affinity_max_kv: max_kv,
            ..routing(Policy::LeastKv, NoTelemetry::Reject)
        })
    }

    #[test]
    fn near_minimum_picks_spread_within_the_tie_margin() {
        let t = table(3);
        let now = Instant::now();
        set(
            &t,
            vec![
                available(0.30, now),
                available(0.31, now),
                available(0.50, now),
            ],
        );
        let s = Selector::new(&RoutingConfig {
            tie_margin: 0.02,
            ..routing(Policy::LeastKv, NoTelemetry::Reject)
        });
        let mut counts = [0; 3];
        for _ in 0..200 {
            // Dropped at once: no credit builds up, only the margin spreads the picks.
            counts[s.pick(&t, None, &Avoid::default()).unwrap().guard.worker()] += 1;
        }
        assert!(counts[0] > 40 && counts[1] > 40, "{counts:?}");
        assert_eq!(counts[2], 0, "outside the margin: {counts:?}");
    }

    #[test]
    fn affinity_prefers_the_longest_prefix_within_the_margin_only() {
        let t = table(3);
        let now = Instant::now();
        set(
            &t,
            vec![
                available(0.20, now),
                available(0.25, now),
                available(0.60, now),
            ],
        );
        let prompt = [11, 12, 13, 14];
        member(&t, 1).prefixes.record(&prompt[..3], 100);
        member(&t, 2).prefixes.record(&prompt, 100);
        let s = affine(0.1, 0.85);
        // Rank 2 holds the whole prompt but is 0.40 above the best; rank 1 holds three chunks
        // within the margin.
        let p = s
            .pick_explained(&t, None, &Avoid::default(), &prompt, None)
            .unwrap();
        assert_eq!(p.guard.worker(), 1);
        // The pick is remembered: rank 1 now holds the whole prompt.
        assert_eq!(member(&t, 1).prefixes.matched(&prompt), 4);
        // A prompt no rank holds goes by load; it is then remembered where it went.
        let fresh = [21, 22];
        let p = s
            .pick_explained(&t, None, &Avoid::default(), &fresh, None)
            .unwrap();
        assert_eq!(p.guard.worker(), 0);
        assert_eq!(member(&t, 0).prefixes.matched(&fresh), 2);
    }

    #[test]
    fn affinity_never_takes_a_rank_at_the_kv_ceiling() {
        let t = table(2);
        let now = Instant::now();
        set(&t, vec![available(0.84, now), available(0.86, now)]);
        member(&t, 1).prefixes.record(&[1, 2, 3], 100);
        let p = affine(0.1, 0.85)
            .pick_explained(&t, None, &Avoid::default(), &[1, 2, 3], None)
            .unwrap();
        assert_eq!(
            p.guard.worker(),
            0,
            "rank 1 is within the margin but at the ceiling"
        );
    }

    #[test]
    fn picks_least_kv_and_credits_unreported_work() {
        let t = table(2);
        let now = Instant::now();
        set(&t, vec![available(0.30, now), available(0.10, now)]);
        let s = selector(Policy::LeastKv, NoTelemetry::LeastInFlight);
        let mut guards = Vec::new();
        // Rank 1 starts 0.20 lower; at 0.02 per request it takes ten before rank 0 ties.
        for _ in 0..10 {
            let p = s.pick(&t, None, &Avoid::default()).unwrap();
            assert_eq!(p.guard.worker(), 1);
            guards.push(p);
        }
        let mut counts = [0; 2];
        for _ in 0..20 {
            let p = s.pick(&t, None, &Avoid::default()).unwrap();
            counts[p.guard.worker()] += 1;
            guards.push(p);
        }
        assert!(
            counts[0] >= 9 && counts[1] >= 9,
            "burst must spread once credited: {counts:?}"
        );
    }

    #[test]
    fn a_large_request_weighs_like_several_typical_ones() {
        let t = table(2);
        let now = Instant::now();
        set(&t, vec![available(0.10, now), available(0.10, now)]);
        let s = selector(Policy::LeastKv, NoTelemetry::LeastInFlight);
        // Typical requests of 800 bytes set the mean; then one of 8000 bytes lands somewhere.
        for _ in 0..40 {
            s.sizer.weight(Some(800));
        }
        let big = s.pick(&t, Some(8000), &Avoid::default()).unwrap();
        let other = 1 - big.guard.worker();
        // Its rank now carries about ten typical requests: the next nine go to the other one.
        let mut guards = Vec::new();
        for _ in 0..9 {
            let p = s.pick(&t, Some(800), &Avoid::default()).unwrap();
            assert_eq!(p.guard.worker(), other);
            guards.push(p);
        }
        assert_eq!(s.sizer.weight(None), UNIT_WEIGHT);
        assert_eq!(s.sizer.weight(Some(1)), UNIT_WEIGHT / 4);
        assert_eq!(s.sizer.weight(Some(10_000_000)), 32 * UNIT_WEIGHT);
    }

    #[tokio::test(start_paused = true)]
    async fn an_ejected_rank_gets_its_trial_however_many_failures_it_had() {
        use crate::outlier::{Cause, Policy as Eject};
        let t = table(2);
        let now = Instant::now();
        // The healthy rank is busy; the failing one looked idle.
        set(&t, vec![available(0.0, now), available(0.9, now)]);
        let s = selector(Policy::LeastKv, NoTelemetry::LeastInFlight);
        let eject = Eject {
            after: 5,
            base: Duration::from_millis(100),
        };
        for _ in 0..5 {
            member(&t, 0)
                .live
                .outlier
                .failure(Cause::Status(503), eject);
        }
        assert_eq!(member(&t, 0).live.outlier.admit(), Admit::No);
        // Refreshed telemetry, so the paused clock does not make it stale.
        tokio::time::advance(Duration::from_millis(101)).await;
        let now = Instant::now();
        set(&t, vec![available(0.0, now), available(0.9, now)]);
        assert_eq!(member(&t, 0).live.outlier.admit(), Admit::Trial);
        // Five failures weigh 1.25, more than any KV usage: the trial must not wait on them.
        let p = s.pick(&t, None, &Avoid::default()).unwrap();
        assert_eq!(p.guard.worker(), 0);
        assert!(p.trial);
        // One trial at a time: the next request goes elsewhere.
        let q = s.pick(&t, None, &Avoid::default()).unwrap();
        assert_eq!(q.guard.worker(), 1);
    }

    #[test]
    fn finished_requests_stop_counting() {
        let t = table(2);
        let now = Instant::now();
        set(&t, vec![available(0.30, now), available(0.10, now)]);
        let s = selector(Policy::LeastKv, NoTelemetry::LeastInFlight);
        for _ in 0..50 {
            let p = s.pick(&t, None, &Avoid::default()).unwrap();
            assert_eq!(p.guard.worker(), 1, "completed work must not be credited");
        }
    }

    #[test]
    fn stale_rank_is_skipped_and_reject_mode_rejects() {
        let t = table(2);
        let now = Instant::now();
        let mut old = available(0.0, now);
        if let RankTelemetry::Available(l) = &mut old.telemetry {
            l.sampled_at = now.checked_sub(Duration::from_secs(5)).unwrap();
        }
        set(&t, vec![old.clone(), available(0.9, now)]);
        let s = selector(Policy::LeastKv, NoTelemetry::Reject);
        let p = s.pick(&t, None, &Avoid::default()).unwrap();
        assert_eq!(p.guard.worker(), 1);
        assert!(p.skipped_unavailable);
        set(&t, vec![old.clone(), old]);
        assert_eq!(
            s.pick(&t, None, &Avoid::default()).unwrap_err(),
            NoRank::NoTelemetry
        );
    }

    #[test]
    fn no_telemetry_falls_back_to_least_in_flight_among_reachable() {
        let t = table(3);
        let mut views = vec![RankView::initial(); 3];
        views[1].reachable = true;
        views[2].reachable = true;
        set(&t, views);
        let s = selector(Policy::LeastKv, NoTelemetry::LeastInFlight);
        let a = s.pick(&t, None, &Avoid::default()).unwrap();
        let b = s.pick(&t, None, &Avoid::default()).unwrap();
        let mut got = [a.guard.worker(), b.guard.worker()];
        got.sort();
        assert_eq!(got, [1, 2]);
        set(&t, vec![RankView::initial(); 3]);
        assert_eq!(
            s.pick(&t, None, &Avoid::default()).unwrap_err(),
            NoRank::NoneReachable
        );
    }

    #[test]
    fn round_robin_cycles_reachable_ranks() {
        let t = table(3);
        let now = Instant::now();
        let mut views = vec![available(0.5, now); 3];
        views[1].reachable = false;
        set(&t, views);
        let s = selector(Policy::RoundRobin, NoTelemetry::LeastInFlight);
        let picks: Vec<usize> = (0..4)
            .map(|_| s.pick(&t, None, &Avoid::default()).unwrap().guard.worker())
            .collect();
        assert_eq!(picks, [0, 2, 2, 0]);
    }

    #[test]
    fn ejected_and_avoided_ranks_are_passed_over_by_every_policy() {
        let t = table(3);
        let now = Instant::now();
        set(
            &t,
            vec![
                available(0.0, now),
                available(0.5, now),
                available(0.9, now),
            ],
        );
        let policy = crate::outlier::Policy {
            after: 1,
            base: Duration::from_secs(60),
        };
        member(&t, 0)
            .live
            .outlier
            .failure(crate::outlier::Cause::Status(503), policy);
        let mut avoid = Avoid::default();
        avoid.worker(member(&t, 1).key);
        for p in [Policy::LeastKv, Policy::RoundRobin, Policy::Random] {
            let s = selector(p, NoTelemetry::LeastInFlight);
            for _ in 0..10 {
                assert_eq!(s.pick(&t, None, &avoid).unwrap().guard.worker(), 2, "{p:?}");
            }
        }
        avoid.engine(t.snapshot.load().fleet.engines[0].key);
        let s = selector(Policy::LeastKv, NoTelemetry::LeastInFlight);
        assert_eq!(s.pick(&t, None, &avoid).unwrap_err(), NoRank::NoneReachable);
    }

    #[tokio::test(start_paused = true)]
    async fn a_rank_due_for_its_trial_gets_the_next_request_and_only_that_one() {
        let t = table(2);
        let now = Instant::now();
        set(&t, vec![available(0.0, now), available(0.0, now)]);
        let policy = crate::outlier::Policy {
            after: 3,
            base: Duration::from_millis(100),
        };
        for _ in 0..3 {
            member(&t, 0)
                .live
                .outlier
                .failure(crate::outlier::Cause::Status(503), policy);
        }
        let s = selector(Policy::LeastKv, NoTelemetry::LeastInFlight);
        let none = Avoid::default();
        assert_eq!(s.pick(&t, None, &none).unwrap().guard.worker(), 1);
        tokio::time::advance(Duration::from_millis(101)).await;
        // Fresh telemetry again, after the clock moved.
        set(
            &t,
            vec![
                available(0.0, Instant::now()),
                available(0.0, Instant::now()),
            ],
        );
        let trial = s.pick(&t, None, &none).unwrap();
        assert_eq!(trial.guard.worker(), 0);
        assert!(trial.trial);
        for _ in 0..5 {
            assert_eq!(
                s.pick(&t, None, &none).unwrap().guard.worker(),
                1,
                "one trial at a time"
            );
        }
    }

    proptest! {
        /// Affinity only ever chooses among ranks with fresh telemetry scoring within the margin
        /// of the best and below the ceiling; when it chooses nothing, the pick is least_kv's.
        #[test]
        fn affinity_stays_within_the_margin_and_off_unknown_ranks(
            views in proptest::collection::vec((proptest::option::of(0.0f64..=1.0), 0usize..5), 1..10),
            margin in 0.0f64..0.3,
            max_kv in 0.3f64..1.0,
        ) {
            let t = table(views.len() as u32);
            let now = Instant::now();
            let prompt = [1u64, 2, 3, 4];
            let ranks: Vec<RankView> = views.iter().map(|(kv, _)| match kv {
                Some(kv) => available(*kv, now),
                None => RankView { reachable: true, ..RankView::initial() },
            }).collect();
            for (w, (_, held)) in views.iter().enumerate() {
                member(&t, w).prefixes.record(&prompt[..*held], 100);
            }
            set(&t, ranks);
            let s = affine(margin, max_kv);
            let best = views.iter().filter_map(|(kv, _)| *kv).fold(f64::INFINITY, f64::min);
            match s.pick_explained(&t, None, &Avoid::default(), &prompt, None) {
                Ok(p) => {
                    let w = p.guard.worker();
                    let kv = views[w].0;
                    prop_assert!(kv.is_some(), "picked rank {w} without telemetry");
                    let kv = kv.unwrap();
                    let by_load = kv <= best + 1e-9;
                    let by_affinity = kv <= best + margin + 1e-9 && kv < max_kv;
                    prop_assert!(by_load || by_affinity, "rank {w} at {kv}: best {best}, margin {margin}, max {max_kv}");
                }
                Err(e) => prop_assert!(best.is_infinite(), "{e} with a rank at {best}"),
            }
        }
    }

    fn arb_view() -> impl Strategy<Value = (Option<f64>, bool, u8)> {
        (proptest::option::of(0.0f64..=1.0), any::<bool>(), 0u8..4)
    }

    proptest! {
        /// The selector never picks an Unavailable rank while an Available one exists.
        #[test]
        fn never_picks_unavailable_while_available_exists(
            views in proptest::collection::vec(arb_view(), 1..12),
            picks in 1usize..40,
        ) {
            let t = table(views.len() as u32);
            let now = Instant::now();
            let ranks: Vec<RankView> = views.iter().map(|(kv, stale, _)| match kv {
                Some(kv) => {
                    let mut v = available(*kv, now);
                    if *stale {
                        if let RankTelemetry::Available(l) = &mut v.telemetry {
                            l.sampled_at = now.checked_sub(Duration::from_secs(3)).unwrap();
                        }
                    }
                    v
                }
                None => RankView { reachable: true, ..RankView::initial() },
            }).collect();
            let usable: Vec<bool> = views.iter().map(|(kv, stale, _)| kv.is_some() && !stale).collect();
            set(&t, ranks);
            // Some requests already in flight, to exercise the credit path.
            let mut guards = Vec::new();
            for (w, (_, _, n)) in views.iter().enumerate() {
                for _ in 0..*n { guards.push(InFlight::start(member(&t, w), UNIT_WEIGHT)); }
            }
            let s = selector(Policy::LeastKv, NoTelemetry::LeastInFlight);
            for _ in 0..picks {
                let p = s.pick(&t, None, &Avoid::default()).unwrap();
                if usable.iter().any(|u| *u) {
                    prop_assert!(usable[p.guard.worker()], "picked unavailable rank {}", p.guard.worker());
                }
                guards.push(p.guard);
            }
        }
    }
}
