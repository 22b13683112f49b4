//! Each verdict of an explained pick, over tables set by hand: affinity's winner and the
//! holders it passed over (outside the margin, at the ceiling), ties, trials, the fallback and
//! the policies that take turns.

use tokio::time::Instant;

use super::avoid::Avoid;
use super::explain::{By, Explanation};
use super::rule::{Rule, Skip};
use super::tests::{affine, available, chunks, member, selector, set, table};
use crate::config::{NoTelemetry, Policy};
use crate::ix::{Ix, WorkerIx};
use crate::table::{RankView, Table};

/// The id of worker `w`.
fn id(t: &Table, w: usize) -> String {
    t.snapshot.load().fleet.workers[WorkerIx::new(w)]
        .id_text
        .to_string()
}

/// The rule and words for worker `w` in `x`.
fn verdict(x: &Explanation, t: &Table, w: usize) -> (Rule, String) {
    let id = id(t, w);
    let c = (x.candidates.iter()).find(|c| c.worker == id);
    let c = c.unwrap_or_else(|| panic!("{id} is no candidate: {x:?}"));
    (c.rule, c.why.clone())
}

#[test]
fn affinity_names_its_winner_and_each_holder_it_passed_over() {
    let t = table(4);
    let now = Instant::now();
    let kv = [0.20, 0.25, 0.60, 0.90];
    set(&t, kv.iter().map(|&k| available(k, now)).collect());
    let prompt = [11, 12, 13, 14];
    member(&t, 1).prefixes.record(&prompt[..3], 100);
    member(&t, 2).prefixes.record(&prompt, 100);
    member(&t, 3).prefixes.record(&prompt, 100);
    let mut x = Explanation::default();
    let s = affine(0.1, 0.85);
    let p = s
        .pick_explained(&t, None, &Avoid::default(), &chunks(&prompt), Some(&mut x))
        .unwrap();
    assert_eq!(p.guard.worker(), 1);
    assert_eq!(x.by, By::Affinity);
    assert_eq!(x.picked.as_deref(), Some(id(&t, 1).as_str()));
    let (rule, why) = verdict(&x, &t, 1);
    assert_eq!(rule, Rule::Affinity, "{why}");
    assert!(
        why.contains("holds 192 of the prompt's leading tokens (by record)"),
        "{why}"
    );
    let (rule, why) = verdict(&x, &t, 0);
    assert_eq!(rule, Rule::HoldsLess, "{why}");
    assert!(why.contains("fewer than the 192"), "{why}");
    let (rule, why) = verdict(&x, &t, 2);
    assert_eq!(rule, Rule::OutsideMargin, "{why}");
    assert!(
        why.contains("score 0.6 is more than affinity_margin 0.1 above the best 0.2 (at most 0.3)"),
        "{why}"
    );
    let (rule, why) = verdict(&x, &t, 3);
    assert_eq!(rule, Rule::AboveMaxKv, "{why}");
    assert!(
        why.contains("affinity_max_kv 0.85, and more than affinity_margin"),
        "{why}"
    );
    let limits = x.affinity.expect("the limits compared");
    assert!(
        (limits.limit - 0.3).abs() < 1e-9 && limits.max_kv == 0.85,
        "{limits:?}"
    );
    // As JSON: the names a client matches on.
    let json: serde_json::Value = serde_json::from_str(&x.to_json(4096)).unwrap();
    assert_eq!(json["by"], "affinity");
    assert_eq!(json["candidates"][0]["rule"], "affinity");
}

#[test]
fn without_a_holder_in_the_limits_load_decides_and_says_so() {
    let t = table(2);
    let now = Instant::now();
    set(&t, vec![available(0.84, now), available(0.86, now)]);
    member(&t, 1).prefixes.record(&[1, 2, 3], 100);
    let mut x = Explanation::default();
    let p = affine(0.1, 0.85)
        .pick_explained(
            &t,
            None,
            &Avoid::default(),
            &chunks(&[1, 2, 3]),
            Some(&mut x),
        )
        .unwrap();
    assert_eq!(p.guard.worker(), 0);
    assert_eq!(x.by, By::Kv);
    let (rule, why) = verdict(&x, &t, 0);
    assert_eq!(rule, Rule::LeastLoad, "{why}");
    assert!(
        why.contains("no rank within the affinity limits holds any"),
        "{why}"
    );
    let (rule, why) = verdict(&x, &t, 1);
    assert_eq!(rule, Rule::AboveMaxKv, "{why}");
    assert!(
        why.contains("score 0.86 is at or above affinity_max_kv 0.85"),
        "{why}"
    );
}

#[test]
fn equal_scores_are_a_draw_and_the_loser_says_so() {
    let t = table(3);
    let now = Instant::now();
    set(
        &t,
        vec![
            available(0.3, now),
            available(0.3, now),
            available(0.5, now),
        ],
    );
    let mut x = Explanation::default();
    let s = selector(Policy::LeastKv, NoTelemetry::Reject);
    let w = s
        .pick_explained(&t, None, &Avoid::default(), &chunks(&[]), Some(&mut x))
        .unwrap()
        .guard
        .worker();
    let other = 1 - w;
    let (rule, why) = verdict(&x, &t, w);
    assert_eq!(rule, Rule::LeastLoad, "{why}");
    assert!(why.contains("drawn at random among 2"), "{why}");
    assert_eq!(verdict(&x, &t, other).0, Rule::Tie);
    let (rule, why) = verdict(&x, &t, 2);
    assert_eq!(rule, Rule::HigherLoad, "{why}");
    assert!(
        why.contains("score 0.5, above the picked rank's 0.3"),
        "{why}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_trial_goes_first_and_everyone_else_says_so() {
    use crate::outlier::{Cause, Policy as Eject};
    let t = table(2);
    let now = Instant::now();
    set(&t, vec![available(0.9, now), available(0.1, now)]);
    let eject = Eject {
        after: 5,
        base: std::time::Duration::from_millis(100),
    };
    for _ in 0..5 {
        member(&t, 0)
            .live
            .outlier
            .failure(Cause::Status(503), eject);
    }
    tokio::time::advance(std::time::Duration::from_millis(101)).await;
    set(
        &t,
        vec![
            available(0.9, Instant::now()),
            available(0.1, Instant::now()),
        ],
    );
    let mut x = Explanation::default();
    let s = selector(Policy::LeastKv, NoTelemetry::Reject);
    let p = s
        .pick_explained(&t, None, &Avoid::default(), &chunks(&[]), Some(&mut x))
        .unwrap();
    assert!(p.trial, "{x:?}");
    assert_eq!(verdict(&x, &t, 0).0, Rule::Trial);
    assert_eq!(verdict(&x, &t, 1).0, Rule::TrialFirst);
}

#[test]
fn the_fallback_and_turn_taking_policies_name_their_rules() {
    let t = table(3);
    let mut views = vec![RankView::initial(); 3];
    views[1].reachable = true;
    views[2].reachable = true;
    set(&t, views);
    let mut x = Explanation::default();
    let s = selector(Policy::LeastKv, NoTelemetry::LeastInFlight);
    let w = s
        .pick_explained(&t, None, &Avoid::default(), &chunks(&[]), Some(&mut x))
        .unwrap()
        .guard
        .worker();
    assert_eq!(x.by, By::InFlight);
    assert_eq!(verdict(&x, &t, w).0, Rule::FewestInFlight);
    assert_eq!(verdict(&x, &t, 3 - w).0, Rule::Tie);
    assert_eq!(x.skipped.len(), 1);
    assert_eq!(x.skipped[0].rule, Skip::Unreachable);

    let now = Instant::now();
    set(&t, vec![available(0.5, now); 3]);
    let s = selector(Policy::RoundRobin, NoTelemetry::Reject);
    let w = s
        .pick_explained(&t, None, &Avoid::default(), &chunks(&[]), Some(&mut x))
        .unwrap()
        .guard
        .worker();
    let (rule, why) = verdict(&x, &t, w);
    assert_eq!(rule, Rule::Turn, "{why}");
    assert!(
        why.contains("round_robin's turn among the 3 reachable ranks"),
        "{why}"
    );
    let others: Vec<Rule> = (0..3)
        .filter(|&o| o != w)
        .map(|o| verdict(&x, &t, o).0)
        .collect();
    assert_eq!(others, [Rule::NotItsTurn, Rule::NotItsTurn]);
}
