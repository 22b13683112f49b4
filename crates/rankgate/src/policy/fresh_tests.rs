//! Fresh ranks in the pick: one proven idle goes first among the near-best while untried, one
//! unproven takes a trickle, and neither is ever a reason to pass over a rank with numbers.

use tokio::time::Instant;

use super::avoid::Avoid;
use super::dispatch::Selector;
use super::tests::{available, routing, set, table};
use crate::config::{NoTelemetry, Policy};
use crate::table::{Fresh, Load, RankTelemetry, RankView, FRESH_TRICKLE};

fn fresh(kind: Fresh, now: Instant) -> RankView {
    RankView {
        telemetry: RankTelemetry::Available(Load::fresh(kind, None, now)),
        ..available(0.0, now)
    }
}

#[test]
fn an_untried_idle_rank_goes_before_an_equal_rank_with_numbers_then_is_scored() {
    let t = table(3);
    let now = Instant::now();
    let ranks = vec![
        available(0.0, now),
        fresh(Fresh::Idle, now),
        available(0.0, now),
    ];
    set(&t, ranks);
    let mut cfg = routing(Policy::LeastKv, NoTelemetry::Reject);
    cfg.tie_margin = 0.01;
    let s = Selector::new(&cfg);
    let first = s.pick(&t, None, &Avoid::default()).unwrap();
    assert_eq!(
        first.guard.worker(),
        1,
        "the untried rank first among equals"
    );
    // With its first request in flight it is scored like any rank: 0 + that request's credit.
    let second = s.pick(&t, None, &Avoid::default()).unwrap();
    assert_ne!(second.guard.worker(), 1);
    drop((first, second));
    // An exact tie too goes to the untried rank, every time.
    cfg.tie_margin = 0.0;
    let t = table(2);
    set(&t, vec![available(0.0, now), fresh(Fresh::Idle, now)]);
    let s = Selector::new(&cfg);
    let picks = (0..20).map(|_| s.pick(&t, None, &Avoid::default()).unwrap().guard.worker());
    assert!(picks.into_iter().all(|w| w == 1));
}

#[test]
fn an_unproven_rank_takes_a_trickle_and_no_more() {
    let t = table(2);
    let now = Instant::now();
    set(&t, vec![available(0.6, now), fresh(Fresh::Unproven, now)]);
    let s = Selector::new(&routing(Policy::LeastKv, NoTelemetry::Reject));
    let held: Vec<_> = (0..8)
        .map(|_| s.pick(&t, None, &Avoid::default()).unwrap())
        .collect();
    let on_fresh = held.iter().filter(|p| p.guard.worker() == 1).count() as u64;
    assert_eq!(on_fresh, FRESH_TRICKLE);
    // Its trickle full, it is passed over, never the reason no rank is found.
    assert!(held
        .iter()
        .skip(FRESH_TRICKLE as usize)
        .all(|p| p.guard.worker() == 0));
    drop(held);
    assert_eq!(
        s.pick(&t, None, &Avoid::default()).unwrap().guard.worker(),
        1
    );
}

#[test]
fn fresh_ranks_alone_serve_a_burst_spread_over_all() {
    let t = table(8);
    let now = Instant::now();
    set(&t, (0..8).map(|_| fresh(Fresh::Idle, now)).collect());
    let s = Selector::new(&routing(Policy::LeastKv, NoTelemetry::Reject));
    let held: Vec<_> = (0..64)
        .map(|_| s.pick(&t, None, &Avoid::default()).unwrap())
        .collect();
    let mut per = [0; 8];
    held.iter().for_each(|p| per[p.guard.worker()] += 1);
    assert_eq!(per, [8; 8], "every request in flight is credited");
}
