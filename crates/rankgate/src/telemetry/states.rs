//! The publisher's log of rank states: one line when a rank's telemetry changes state (lost,
//! back, a new reason, fresh), one when its last sample ages past `stale_after` and one when
//! fresh numbers return; never one per poll.

use crate::ix::{IxVec, WorkerIx};
use crate::table::{RankTelemetry, RankView, Table};
use crate::worker::Fleet;

/// One log line when a rank's last sample ages past `stale_after`, one when fresh numbers return.
pub(super) fn log_staleness(
    table: &Table,
    fleet: &Fleet,
    views: &IxVec<WorkerIx, RankView>,
    stale: &mut IxVec<WorkerIx, bool>,
) {
    let now = tokio::time::Instant::now();
    for (w, v) in views.iter_enumerated() {
        let RankTelemetry::Available(l) = &v.telemetry else {
            stale[w] = false;
            continue;
        };
        let is_stale = now.saturating_duration_since(l.sampled_at) > table.stale_after;
        if is_stale != stale[w] {
            let id = &fleet.workers[w].id_text;
            if is_stale {
                tracing::warn!(worker = %id, stale_after_ms = table.stale_after.as_millis() as u64, "telemetry stale");
            } else {
                tracing::info!(worker = %id, "telemetry fresh again");
            }
            stale[w] = is_stale;
        }
    }
}

/// One log line per state change of a rank, not one per poll.
pub(super) fn log_change(fleet: &Fleet, w: WorkerIx, was: &RankView, new: &RankTelemetry) {
    let id = &fleet.workers[w].id_text;
    let old = &was.telemetry;
    match (old, new) {
        (RankTelemetry::Available(_), RankTelemetry::Unavailable { reason }) => {
            tracing::warn!(worker = %id, %reason, "telemetry unavailable");
        }
        // A rank that never had numbers: "still" would say it lost them.
        (RankTelemetry::Unavailable { reason: a }, RankTelemetry::Unavailable { reason: b })
            if !was.ever_available && !a.same_kind(b) =>
        {
            tracing::warn!(worker = %id, reason = %b, "telemetry not available yet");
        }
        (RankTelemetry::Unavailable { reason: a }, RankTelemetry::Unavailable { reason: b })
            if !a.same_kind(b) =>
        {
            tracing::warn!(worker = %id, reason = %b, "telemetry still unavailable, new reason");
        }
        (_, RankTelemetry::Available(l)) if l.fresh.is_some() => {
            let was_fresh = matches!(old, RankTelemetry::Available(o) if o.fresh.is_some());
            if !was_fresh {
                let fresh = l.fresh.map_or("", |f| f.as_str());
                tracing::info!(worker = %id, fresh, "rank fresh: its engine names it but publishes no load gauges for it yet; routed as such until they appear");
            }
        }
        (RankTelemetry::Unavailable { .. }, RankTelemetry::Available(l)) => {
            tracing::info!(worker = %id, kv_usage = l.kv_usage, "telemetry available");
        }
        (RankTelemetry::Available(o), RankTelemetry::Available(l)) if o.fresh.is_some() => {
            tracing::info!(worker = %id, kv_usage = l.kv_usage, "telemetry available: the fresh rank's load gauges appeared");
        }
        _ => {}
    }
}
