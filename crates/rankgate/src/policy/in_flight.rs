//! `least_kv`'s fallback when no rank has fresh telemetry (`routing.no_telemetry =
//! "least_in_flight"`): the reachable rank with the fewest requests in flight.

use rand::Rng;

use super::avoid::{eligible, Avoid};
use super::ties::min_with_random_ties;
use crate::ix::WorkerIx;
use crate::outlier::Admit;
use crate::table::Snapshot;

/// Fewest requests in flight (and recent failures) among reachable ranks, ties at random.
pub(super) fn least_in_flight(
    snap: &Snapshot,
    avoid: &Avoid,
    rng: &mut impl Rng,
) -> Option<WorkerIx> {
    let fleet = &snap.fleet;
    let counts = (snap.ranks.indices())
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
