//! Fresh ranks over time: how long a rank may stay fresh (named by its engine, no load gauges
//! yet; see [`crate::table::Fresh`]) before it counts as dark, and what its requests weigh
//! meanwhile.
//!
//! A fresh rank's zeros are not a reading, so every request in flight on it is work its engine
//! has not reported: its `weight_at_poll` is 0, and the pick credits all of them. A rank that
//! finished [`SILENT_AFTER`] of this router's requests since it was first seen fresh and still
//! publishes no gauges is no longer given the benefit of the doubt: Unavailable,
//! [`Reason::Silent`]. vLLM publishes a rank's gauges with its first request's first output,
//! so a healthy rank leaves the fresh state long before that.

use std::sync::atomic::Ordering::Relaxed;

use super::report::Report;
use crate::reason::Reason;
use crate::table::{Load, RankTelemetry};
use crate::worker::Member;

/// Requests a fresh rank may finish before its silence makes it Unavailable.
pub const SILENT_AFTER: u64 = 4;

/// Per rank of one engine: this router's completed count on it when it was first seen fresh
/// (`None`: not fresh at its last poll).
#[derive(Debug, Default)]
pub struct FreshRanks {
    since: Vec<Option<u64>>,
}

impl FreshRanks {
    /// Applies the rules above to one poll's report of the engine whose workers are `members`.
    pub fn judge(&mut self, members: &[std::sync::Arc<Member>], report: &mut Report) {
        self.since.resize(report.ranks.len(), None);
        let ranks = report.ranks.iter_mut().zip(&mut report.weight_at_poll);
        for ((t, weight), (since, m)) in ranks.zip(self.since.iter_mut().zip(members)) {
            if !matches!(t, RankTelemetry::Available(Load { fresh: Some(_), .. })) {
                *since = None;
                continue;
            }
            let done = m.live.completed.load(Relaxed);
            let served = done.saturating_sub(*since.get_or_insert(done));
            if served >= SILENT_AFTER {
                *t = RankTelemetry::unavailable(Reason::Silent { served });
            } else {
                *weight = 0;
            }
        }
    }
}
