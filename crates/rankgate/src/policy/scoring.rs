//! `least_kv`'s score of one rank: its reported KV plus the work it was sent since its poll,
//! plus a penalty for its recent failures. Read by the pick and by its explanation alike.
//!
//! A prefill server's rank (the prefill leg of a disaggregated request) also counts the requests
//! it is running: each is prefill work that delays the next one's first token, whatever KV it
//! holds, where a decode rank's running requests are already in its KV usage.

use std::sync::atomic::Ordering::Relaxed;

use tokio::time::Instant;

use super::avoid::Leg;
use crate::ix::WorkerIx;
use crate::outlier::{Admit, FAILURE_WEIGHT};
use crate::table::{Fresh, RankTelemetry, RankView, Snapshot, Table, FRESH_TRICKLE, UNIT_WEIGHT};
use crate::worker::Member;

/// Whether a rank is fresh, proven idle, with nothing of this router's in flight: among ranks
/// as good as the best it goes first, since its first request is what makes its gauges appear.
#[inline]
pub(super) fn untried(view: &RankView, member: &Member) -> bool {
    matches!(&view.telemetry, RankTelemetry::Available(l) if l.fresh == Some(Fresh::Idle))
        && member.live.in_flight() == 0
}

/// Whether a fresh rank that nothing proves idle has its trickle full: it takes no more until
/// one of its requests ends (or its gauges appear).
pub(super) fn trickle_full(view: &RankView, member: &Member) -> bool {
    matches!(&view.telemetry, RankTelemetry::Available(l) if l.fresh == Some(Fresh::Unproven))
        && member.live.in_flight() >= FRESH_TRICKLE
}

/// The score `least_kv` ranks by, or `None` when the rank has no fresh telemetry (or is a fresh
/// rank whose trickle is full: see [`crate::table::Fresh`]).
#[inline]
pub fn score(table: &Table, snap: &Snapshot, w: WorkerIx, now: Instant, leg: Leg) -> Option<f64> {
    let member = &snap.fleet.workers[w].member;
    score_of(
        table,
        &snap.ranks[w],
        member,
        member.live.outlier.admit(),
        now,
        leg,
    )
}

/// [`score`] of a rank whose view, worker and admission are at hand.
#[inline]
pub(super) fn score_of(
    table: &Table,
    view: &RankView,
    member: &Member,
    admit: Admit,
    now: Instant,
    leg: Leg,
) -> Option<f64> {
    let load = view.telemetry.fresh(now, table.stale_after)?;
    let live = &member.live;
    if load.fresh == Some(Fresh::Unproven) && live.in_flight() >= FRESH_TRICKLE {
        return None;
    }
    let since_poll = live
        .dispatched_weight
        .load(Relaxed)
        .saturating_sub(view.weight_at_poll);
    let unreported = since_poll.min(live.in_flight_weight()) as f64 / UNIT_WEIGHT as f64;
    let mut queued = load.waiting.unwrap_or(0) as f64;
    if leg == Leg::Prefill {
        queued += load.running.unwrap_or(0) as f64;
    }
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
