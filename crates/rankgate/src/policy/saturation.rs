//! Saturation per rank (`[flow]`): how many more requests a rank takes before it is saturated,
//! judged from the telemetry rankgate already has. Flow control holds a request while every
//! rank it may use has no room, and the pick prefers a rank with room.
//!
//! A rank is saturated when
//! - its engine's waiting queue, at the last poll, was longer than `flow.max_waiting` (the
//!   engine queues: whatever rankgate sent now would wait there, where it can neither move to
//!   a rank that frees first nor be overtaken by more urgent work);
//! - its KV usage, with the work rankgate sent it since that poll, reaches `flow.max_kv`
//!   (vLLM queues once its KV is full);
//! - or this router has `flow.max_running` requests in flight on it (the engine's
//!   `--max-num-seqs`, when it is the rank's only client: known at once, no poll behind).
//!
//! A rank without fresh telemetry has no room to judge: it is not counted (unknown is never
//! idle), and a request none of whose ranks has fresh telemetry is not held (the pick then
//! decides, as `routing.no_telemetry` says).

use std::sync::atomic::Ordering::Relaxed;

use tokio::time::Instant;

use super::avoid::{eligible, Avoid};
use super::dispatch::Selector;
use crate::config::Saturation;
use crate::table::{Fresh, RankView, Table, FRESH_TRICKLE, UNIT_WEIGHT};
use crate::worker::Member;

/// Added to a saturated rank's score: it is picked only when every rank is saturated (a
/// request the queue let through as the last room was taken by another).
pub(super) const SATURATED: f64 = 1.0e6;

/// The requests `member`'s rank takes before it is saturated; `None`: its telemetry is not
/// fresh.
#[inline]
pub(super) fn room_of(
    table: &Table,
    view: &RankView,
    member: &Member,
    now: Instant,
    sat: &Saturation,
) -> Option<u64> {
    let load = view.telemetry.fresh(now, table.stale_after)?;
    let live = &member.live;
    let in_flight = live.in_flight() as u64;
    if load.fresh == Some(Fresh::Unproven) {
        // A rank with no gauges yet takes a trickle until they appear.
        return Some((FRESH_TRICKLE as u64).saturating_sub(in_flight));
    }
    if load.waiting.unwrap_or(0) > sat.max_waiting {
        return Some(0);
    }
    let since_poll = live
        .dispatched_weight
        .load(Relaxed)
        .saturating_sub(view.weight_at_poll);
    let unreported = since_poll.min(live.in_flight_weight()) as f64 / UNIT_WEIGHT as f64;
    let kv = load.kv_usage + unreported * view.kv_per_request;
    let mut room = match view.kv_per_request > 0.0 {
        // Rounded up: a rank below the limit takes one more.
        true => ((sat.max_kv - kv) / view.kv_per_request).ceil().max(0.0) as u64,
        false if kv < sat.max_kv => u64::MAX,
        false => 0,
    };
    if let Some(max) = sat.max_running {
        room = room.min((max as u64).saturating_sub(in_flight));
    }
    Some(room)
}

impl Selector {
    /// The room (see [`room_of`]) of every rank `avoid` allows, summed; `None` when none of
    /// them has fresh telemetry, or saturation is not judged (`[flow]` off).
    pub fn room(&self, table: &Table, avoid: &Avoid) -> Option<u64> {
        let sat = self.saturation.as_ref()?;
        let snap = table.snapshot.load();
        let now = Instant::now();
        let fleet = &snap.fleet;
        let mut total: Option<u64> = None;
        for (seat, view) in fleet.workers.iter().zip(snap.ranks.iter()) {
            if !eligible(fleet, seat, avoid) {
                continue;
            }
            if let Some(r) = room_of(table, view, &seat.member, now, sat) {
                total = Some(total.unwrap_or(0).saturating_add(r));
            }
        }
        total
    }

    /// Whether the pick judges saturation (`[flow]` is on).
    pub fn judges_saturation(&self) -> bool {
        self.saturation.is_some()
    }
}
