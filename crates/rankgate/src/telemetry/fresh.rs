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

#[cfg(test)]
mod tests {
    use tokio::time::Instant;

    use super::*;
    use crate::table::{Fresh, InFlight};
    use crate::worker::{EngineId, Fleet};

    fn report(t: RankTelemetry, engine: EngineId) -> Report {
        Report {
            engine,
            reachable: true,
            weight_at_poll: vec![5_000],
            ranks: vec![t],
            source: None,
            models: None,
            models_round: 0,
            reported: None,
        }
    }

    fn fresh() -> RankTelemetry {
        RankTelemetry::Available(Load::fresh(Fresh::Idle, None, Instant::now()))
    }

    #[test]
    fn a_fresh_rank_counts_all_in_flight_and_turns_silent_after_serving_without_gauges() {
        let fleet = Fleet::expand(vec![crate::worker::test_engine("http://e:1", 1, 0)]);
        let engine = fleet.engines.iter().next().expect("one engine");
        let (members, key) = (&engine.members, engine.key);
        let serve = |n| (0..n).for_each(|_| drop(InFlight::start(members[0].clone(), 1000)));
        let mut f = FreshRanks::default();
        serve(3); // before it was seen fresh: not counted
        let mut r = report(fresh(), key);
        f.judge(members, &mut r);
        assert_eq!(
            r.weight_at_poll[0], 0,
            "every request in flight is unreported"
        );
        serve(SILENT_AFTER - 1);
        let mut r = report(fresh(), key);
        f.judge(members, &mut r);
        assert!(matches!(&r.ranks[0], RankTelemetry::Available(_)));
        serve(1);
        let mut r = report(fresh(), key);
        f.judge(members, &mut r);
        let silent = Reason::Silent {
            served: SILENT_AFTER,
        };
        assert_eq!(r.ranks[0], RankTelemetry::unavailable(silent));
        // Its gauges appear: no longer fresh; fresh again later (a restart) starts a new count.
        let mut r = report(RankTelemetry::unavailable(Reason::NotPolled), key);
        f.judge(members, &mut r);
        assert_eq!(r.weight_at_poll[0], 5_000);
        let mut r = report(fresh(), key);
        f.judge(members, &mut r);
        assert!(matches!(&r.ranks[0], RankTelemetry::Available(_)));
    }
}
