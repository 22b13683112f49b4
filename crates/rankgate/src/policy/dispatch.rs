//! The [`Selector`]: the configured policy applied to one snapshot, the pick's outcome
//! ([`Picked`], or why none: [`NoRank`]), the trial of an ejected rank, and affinity's record
//! of what was sent where. `round_robin` and `random` are here whole; `least_kv` is its own
//! module.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use rand::Rng;
use tokio::time::Instant;

use super::affinity::Holdings;
use super::avoid::{eligible, Avoid, Front};
use super::explain::{explain_pick, By, Explanation, Rules};
use super::in_flight::least_in_flight;
use super::sizing::RequestSizer;
use super::verdict::judge;
use crate::config::{NoTelemetry, Policy, RoutingConfig};
use crate::ix::WorkerIx;
use crate::outlier::Admit;
use crate::prompt::Prompt;
use crate::table::{InFlight, Table};
use crate::worker::{EngineEntry, Flavor};

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

/// Chooses ranks according to the configured policy.
#[derive(Debug)]
pub struct Selector {
    pub(super) policy: Policy,
    pub(super) no_telemetry: NoTelemetry,
    /// `round_robin`'s turns, one count per leg (whole requests, prefill legs, decode legs):
    /// with one count, the two legs of each request would take alternate turns, and each side
    /// only every other rank.
    rr: [AtomicU64; 3],
    pub(super) sizer: RequestSizer,
    /// `least_kv` picks at random among ranks scoring within this of the best.
    pub(super) tie_margin: f64,
    /// `routing.prefix_affinity`: `(affinity_margin, affinity_max_kv)`.
    pub(super) affinity: Option<(f64, f64)>,
    /// `routing.adapter_affinity`: the margin within which a LoRA adapter's request prefers
    /// a rank running it or with a free slot (`affinity_margin`).
    pub(super) adapter_margin: Option<f64>,
    /// `[flow]`'s limits while flow control is on: a saturated rank is picked last.
    pub(super) saturation: Option<crate::config::Saturation>,
}

impl Selector {
    pub fn new(cfg: &RoutingConfig) -> Selector {
        Selector {
            policy: cfg.policy,
            no_telemetry: cfg.no_telemetry,
            rr: Default::default(),
            sizer: RequestSizer::default(),
            tie_margin: cfg.tie_margin,
            affinity: cfg
                .prefix_affinity
                .then_some((cfg.affinity_margin, cfg.affinity_max_kv)),
            adapter_margin: cfg.adapter_affinity.then_some(cfg.affinity_margin),
            saturation: None,
        }
    }

    /// The selector judging saturation by `limits` (flow control on).
    pub fn judging(mut self, limits: Option<crate::config::Saturation>) -> Selector {
        self.saturation = limits;
        self
    }

    /// Whether picks weigh prompt prefixes (then `pick` layer reads them from the body).
    pub fn affinity(&self) -> bool {
        self.affinity.is_some()
    }

    /// True when [`Selector::pick`] would find a rank now (the admin `/ready`).
    pub fn any_routable(&self, table: &Table, avoid: &Avoid) -> bool {
        let snap = table.snapshot.load();
        let now = Instant::now();
        let ok = |w: WorkerIx| eligible(&snap.fleet, &snap.fleet.workers[w], avoid);
        let reachable = (snap.ranks.indices()).any(|w| ok(w) && snap.ranks[w].reachable);
        let fresh = || {
            (snap.ranks.indices()).any(|w| {
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
        self.pick_explained(table, content_length, avoid, &Prompt::default(), None)
    }

    /// [`Selector::pick`] for `prompt` (see [`crate::prompt`]; empty when unknown or affinity
    /// is off), writing why it went where it did (or nowhere) to `explain` when given: from the
    /// same snapshot and instant the pick used.
    pub fn pick_explained(
        &self,
        table: &Arc<Table>,
        content_length: Option<u64>,
        avoid: &Avoid,
        prompt: &Prompt,
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
        let mut holdings = Holdings::new(prompt);
        let fleet = &snap.fleet;
        let usable =
            |w: WorkerIx| snap.ranks[w].reachable && eligible(fleet, &fleet.workers[w], avoid);
        let (choice, by) = match self.policy {
            Policy::LeastKv => {
                match self.least_kv(table, &snap, now, avoid, &mut holdings, &mut rng) {
                    Some((w, skipped, by)) => (Ok((w, skipped)), by),
                    None => match self.no_telemetry {
                        NoTelemetry::Reject => (Err(NoRank::NoTelemetry), By::Kv),
                        NoTelemetry::LeastInFlight => (
                            least_in_flight(&snap, avoid, &mut rng)
                                .map(|w| (w, true))
                                .ok_or(NoRank::NoneReachable),
                            By::InFlight,
                        ),
                    },
                }
            }
            Policy::RoundRobin => {
                // The turn goes round the ranks this request may use: counted over the whole
                // fleet, every turn that fell on a rank it may not use would land on the first
                // one it may (one side of a disaggregated fleet, a model only some serve).
                let count = (snap.ranks.indices()).filter(|&w| usable(w)).count();
                let turn = self.rr[avoid.leg as usize].fetch_add(1, Relaxed) as usize;
                let w = (count > 0)
                    .then(|| turn % count)
                    .and_then(|k| (snap.ranks.indices()).filter(|&w| usable(w)).nth(k));
                (
                    w.map(|w| (w, false)).ok_or(NoRank::NoneReachable),
                    By::Reachable,
                )
            }
            Policy::Random => {
                let count = (snap.ranks.indices()).filter(|&w| usable(w)).count();
                let w = (count > 0)
                    .then(|| rng.random_range(0..count))
                    .and_then(|k| (snap.ranks.indices()).filter(|&w| usable(w)).nth(k));
                (
                    w.map(|w| (w, false)).ok_or(NoRank::NoneReachable),
                    By::Reachable,
                )
            }
        };
        if let Some(x) = explain.as_deref_mut() {
            let rules = Rules {
                policy: self.policy,
                by,
                tie_margin: self.tie_margin,
                affinity: self.affinity,
            };
            let picked = choice.as_ref().ok().map(|(w, _)| *w);
            *x = explain_pick(table, &snap, now, avoid, &rules, &mut holdings, picked);
            judge(x, &rules);
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
            // What the pick expects the rank to hold, for checking against what its engine
            // reports it found.
            let held = holdings.of(member);
            member.counters.predicted(held.exact, held.tokens);
            let capacity = match &snap.ranks[choice].telemetry {
                crate::table::RankTelemetry::Available(l) => l.capacity_tokens,
                _ => None,
            };
            let budget = crate::prefix::budget(capacity, snap.ranks.len());
            let chunks = &prompt.chunks;
            (member.prefixes).record(crate::prefix::recorded(chunks, budget), budget);
        }
        let mut guard = InFlight::start(member.clone(), self.sizer.weight(content_length));
        if let Some(a) = &avoid.adapter {
            guard.hold_adapter(a);
        }
        Ok(Picked {
            guard,
            engine: fleet.engines[fleet.workers[choice].engine].clone(),
            skipped_unavailable: skipped,
            trial,
        })
    }
}
