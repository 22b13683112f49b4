use std::sync::Arc;

use crate::ix::{EngineIx, Ix, WorkerIx};
use tokio::time::Instant;

use super::avoid::Avoid;
use super::dispatch::{NoRank, Selector};
use crate::config::{NoTelemetry, Policy, RoutingConfig};
use crate::outlier::Admit;
use crate::table::{InFlight, Snapshot, Table, UNIT_WEIGHT};
use crate::table::{RankTelemetry, RankView};
use crate::worker::Fleet;
use proptest::prelude::*;
use std::time::Duration;

pub(super) fn table(n: u32) -> Arc<Table> {
    let engine = crate::worker::test_engine("http://e:1", n, 0);
    Table::new(Fleet::expand(vec![engine]), Duration::from_secs(2))
}

pub(super) fn available(kv: f64, now: Instant) -> RankView {
    crate::table::test_view(kv, now)
}

pub(super) fn set(table: &Table, ranks: Vec<RankView>) {
    let snap = table.snapshot.load();
    let (fleet, catalog) = (snap.fleet.clone(), snap.catalog.clone());
    table.snapshot.store(Arc::new(Snapshot {
        fleet,
        ranks: ranks.into(),
        catalog,
    }));
}

/// Worker `w` of the current fleet.
pub(super) fn member(table: &Table, w: usize) -> Arc<crate::worker::Member> {
    table.snapshot.load().fleet.workers[WorkerIx::new(w)]
        .member
        .clone()
}

pub(super) fn routing(policy: Policy, no_telemetry: NoTelemetry) -> RoutingConfig {
    RoutingConfig {
        policy,
        no_telemetry,
        request_kv_estimate: 0.02,
        retry_after_secs: 1,
        max_attempts: 3,
        retry_buffer_bytes: 1 << 20,
        retry_budget: 0.2,
        retry_on: Vec::new(),
        eject_after: 5,
        eject_for: Duration::from_secs(10),
        hung_factor: crate::config::DEFAULT_HUNG_FACTOR,
        hung_floor: crate::config::DEFAULT_HUNG_FLOOR,
        // Exact picks, so the tests can tell which rank the credit points at.
        tie_margin: 0.0,
        prefix_affinity: false,
        adapter_affinity: true,
        affinity_margin: 0.1,
        affinity_max_kv: 0.85,
        kv_events: false,
    }
}

/// A prompt known by its chunk names only (no tokens: rankgate's record decides).
pub(super) fn chunks(names: &[u64]) -> crate::prompt::Prompt {
    crate::prompt::Prompt {
        chunks: names.to_vec(),
        tokens: None,
    }
}

pub(super) fn selector(policy: Policy, no_telemetry: NoTelemetry) -> Selector {
    Selector::new(&routing(policy, no_telemetry))
}

pub(super) fn affine(margin: f64, max_kv: f64) -> Selector {
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
        .pick_explained(&t, None, &Avoid::default(), &chunks(&prompt), None)
        .unwrap();
    assert_eq!(p.guard.worker(), 1);
    // The pick is remembered: rank 1 now holds the whole prompt.
    assert_eq!(member(&t, 1).prefixes.matched(&prompt), 4);
    // A prompt no rank holds goes by load; it is then remembered where it went.
    let fresh = [21, 22];
    let p = s
        .pick_explained(&t, None, &Avoid::default(), &chunks(&fresh), None)
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
        .pick_explained(&t, None, &Avoid::default(), &chunks(&[1, 2, 3]), None)
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
    let picks: Vec<usize> = (0..6)
        .map(|_| s.pick(&t, None, &Avoid::default()).unwrap().guard.worker())
        .collect();
    // In turn among the ranks it may use: the unreachable rank's turns do not fall to its
    // neighbour (which would take two requests in three).
    assert_eq!(picks, [0, 2, 0, 2, 0, 2]);
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
    avoid.engine(t.snapshot.load().fleet.engines[EngineIx::new(0)].key);
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
        match s.pick_explained(&t, None, &Avoid::default(), &chunks(&prompt), None) {
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
