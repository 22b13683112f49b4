//! The `least_kv` pick: every eligible rank with fresh telemetry scored, a rank due for its
//! trial first, then adapter affinity's choice for a LoRA adapter, then prefix affinity's, then
//! one at random among the near-best.

use rand::Rng;
use tokio::time::Instant;

use super::adapters::adapter_pick;
use super::affinity::{longest_prefix, Holdings};
use super::avoid::Avoid;
use super::dispatch::Selector;
use super::explain::By;
use super::saturation::{room_of, SATURATED};
use super::scoring::{score_of, untried as is_untried};
use super::ties::random_at_most;
use crate::ix::WorkerIx;
use crate::outlier::Admit;
use crate::table::{Snapshot, Table};

thread_local! {
    /// `least_kv`'s scores, kept between picks: no allocation per pick.
    static SCORES: std::cell::RefCell<Vec<(WorkerIx, f64)>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl Selector {
    /// The pick among ranks with fresh telemetry: a rank due for its trial first; else, with
    /// affinity and a prompt, the rank holding the longest prefix of it among those scoring
    /// within `affinity_margin` of the best and below `affinity_max_kv`; else one at random
    /// among those within `tie_margin` of the best. Returns the worker, whether an
    /// unavailable rank was passed over, and what decided ([`By::Affinity`] or [`By::Kv`]:
    /// the explanation reports the pick's own verdict rather than guessing it again).
    pub(super) fn least_kv(
        &self,
        table: &Table,
        snap: &Snapshot,
        now: Instant,
        avoid: &Avoid,
        prompt: &mut Holdings,
        rng: &mut impl Rng,
    ) -> Option<(WorkerIx, bool, By)> {
        SCORES.with(|scores| {
            let mut scores = scores.borrow_mut();
            scores.clear();
            let mut skipped = false;
            // Fresh ranks proven idle and untried (rare: allocates only when there are some).
            let mut untried = Vec::new();
            let fleet = &snap.fleet;
            // An engine's ranks are consecutive: its verdict is looked up once per engine.
            let mut engine_ok = (None, false);
            for ((w, seat), view) in fleet.workers.iter_enumerated().zip(&snap.ranks) {
                if engine_ok.0 != Some(seat.engine) {
                    let ok = !avoid.has_engine(&fleet.engines[seat.engine]);
                    engine_ok = (Some(seat.engine), ok);
                }
                let admit = seat.live.outlier.admit();
                if !engine_ok.1 || admit == Admit::No || avoid.workers.contains(&seat.key) {
                    continue;
                }
                match score_of(table, view, seat, admit, now, avoid.leg) {
                    None => skipped = true,
                    // A rank due for its ejection trial goes first: its failures would
                    // otherwise keep its score above every healthy rank's, and it would never
                    // get the one request that decides.
                    Some(_) if admit == Admit::Trial => scores.push((w, f64::NEG_INFINITY)),
                    Some(mut s) => {
                        let full = |sat| room_of(table, view, seat, now, sat) == Some(0);
                        if self.saturation.as_ref().is_some_and(full) {
                            s += SATURATED;
                        }
                        scores.push((w, s));
                        if is_untried(view, seat) {
                            untried.push((w, s));
                        }
                    }
                }
            }
            let best = scores.iter().map(|c| c.1).fold(f64::INFINITY, f64::min);
            if scores.is_empty() {
                return None;
            }
            if best == f64::NEG_INFINITY {
                return random_at_most(&scores, best, rng).map(|w| (w, skipped, By::Kv));
            }
            if let (Some(margin), Some(adapter)) = (self.adapter_margin, &avoid.adapter) {
                if let Some(w) = adapter_pick(fleet, &scores, adapter, best + margin) {
                    return Some((w, skipped, By::Adapter));
                }
            }
            if let (Some((margin, max_kv)), false) = (self.affinity, prompt.is_empty()) {
                if let Some((w, _)) = longest_prefix(fleet, &scores, prompt, best + margin, max_kv)
                {
                    return Some((w, skipped, By::Affinity));
                }
            }
            // Scores are sums of floats: within 1e-9 they are the same load.
            let within = best + self.tie_margin.max(1e-9);
            random_at_most(&untried, within, rng)
                .or_else(|| random_at_most(&scores, within, rng))
                .map(|w| (w, skipped, By::Kv))
        })
    }
}
