use super::*;
use crate::worker::test_engine;

fn urls(p: &Plan) -> Vec<(Origin, String)> {
    p.engines
        .iter()
        .map(|(o, e)| (*o, e.url.to_string()))
        .collect()
}

/// a (file), b (admin), d (discovery 0).
fn three() -> Sources {
    let mut s = Sources::new(vec![test_engine("http://a:1", 2, 0)]);
    s.admin.push(test_engine("http://b:1", 2, 2));
    s.found.insert(0, vec![test_engine("http://d:1", 2, 0)]);
    s
}

#[test]
fn sources_keep_their_own_engines_in_fleet_order() {
    let cur = three();
    // A reload that drops a and adds c leaves b and d alone.
    let p = plan(
        &cur,
        Change::Replace {
            origin: Origin::Config,
            engines: vec![test_engine("http://c:1", 2, 4)],
        },
    )
    .unwrap();
    assert_eq!(
        urls(&p),
        [
            (Origin::Config, "http://c:1".into()),
            (Origin::Admin, "http://b:1".into()),
            (Origin::Discovery(0), "http://d:1".into())
        ]
    );
    assert_eq!(p.outcome.added, ["http://c:1"]);
    assert_eq!(p.outcome.removed, ["http://a:1"]);
    // Discovery may not take over an address the file names; its own others stay.
    let p = plan(
        &cur,
        Change::Replace {
            origin: Origin::Discovery(0),
            engines: vec![
                test_engine("http://a:1", 2, 0),
                test_engine("http://e:1", 2, 0),
            ],
        },
    )
    .unwrap();
    assert_eq!(p.outcome.added, ["http://e:1"]);
    assert_eq!(p.outcome.removed, ["http://d:1"]);
    assert_eq!(p.outcome.skipped.len(), 1);
}

#[test]
fn an_address_the_file_takes_over_returns_to_its_source_when_the_file_lets_go() {
    let mut cur = three();
    cur.found.insert(
        0,
        vec![
            test_engine("http://d:1", 2, 0),
            test_engine("http://e:1", 2, 4),
        ],
    );
    let take = |s: &Sources, engines| {
        plan(
            s,
            Change::Replace {
                origin: Origin::Config,
                engines,
            },
        )
        .unwrap()
    };
    // The file names b (admin's) and e (discovery's): both become the file's, unchanged.
    let p = take(
        &cur,
        vec![
            test_engine("http://a:1", 2, 0),
            test_engine("http://b:1", 2, 2),
            test_engine("http://e:1", 2, 4),
        ],
    );
    assert_eq!(urls(&p)[1], (Origin::Config, "http://b:1".into()));
    assert_eq!(p.outcome.changed, ["http://b:1", "http://e:1"]);
    assert!(p.outcome.added.is_empty() && p.outcome.removed.is_empty());
    // The file lets them go: back to the admin API and to discovery.
    let p = take(&p.sources, vec![test_engine("http://a:1", 2, 0)]);
    assert_eq!(
        urls(&p),
        [
            (Origin::Config, "http://a:1".into()),
            (Origin::Admin, "http://b:1".into()),
            (Origin::Discovery(0), "http://d:1".into()),
            (Origin::Discovery(0), "http://e:1".into())
        ]
    );
    assert_eq!(p.outcome.changed, ["http://b:1", "http://e:1"]);
}

#[test]
fn the_fleet_stays_within_the_worker_cap() {
    let per = 4096u32;
    let n = crate::config::MAX_WORKERS as u32 / per;
    let full: Vec<Engine> = (0..n)
        .map(|i| test_engine(&format!("http://e{i}:1"), per, i * per))
        .collect();
    let cur = Sources::new(full);
    let err = plan(&cur, Change::Add(test_engine("http://more:1", 1, n * per))).unwrap_err();
    assert!(
        matches!(err, MembershipError::TooManyWorkers { workers, .. } if workers == crate::config::MAX_WORKERS + 1),
        "{err}"
    );
    assert!(err.to_string().contains("at most 65536"), "{err}");
}

#[test]
fn admin_changes_are_checked() {
    let mut cur = Sources::new(vec![test_engine("http://a:1", 2, 0)]);
    cur.found.insert(0, vec![test_engine("http://d:1", 2, 0)]);
    assert!(matches!(
        plan(&cur, Change::Add(test_engine("http://a:1", 1, 9))),
        Err(MembershipError::Exists {
            origin: Origin::Config,
            ..
        })
    ));
    let err = plan(&cur, Change::Add(test_engine("http://b:1", 2, 1))).unwrap_err();
    assert!(
        err.to_string()
            .contains("http://b:1 (ranks 1-2) and http://a:1 (ranks 0-1)"),
        "{err}"
    );
    // Discovered engines number their own ranks: no overlap with them.
    let p = plan(&cur, Change::Add(test_engine("http://b:1", 2, 2))).unwrap();
    assert_eq!(urls(&p)[1], (Origin::Admin, "http://b:1".into()));
    assert!(matches!(
        plan(
            &cur,
            Change::Remove {
                url: "http://x:1".into()
            }
        ),
        Err(MembershipError::NotFound { .. })
    ));
    let p = plan(
        &cur,
        Change::Remove {
            url: "http://d:1/".into(),
        },
    )
    .unwrap();
    assert_eq!(p.outcome.removed, ["http://d:1"]);
    assert_eq!(p.engines.len(), 1);
}

/// A change that brings a second name of a server already in the fleet is applied with a
/// warning naming both; one that brings nothing new checks nothing.
#[tokio::test]
async fn a_second_name_of_one_server_is_warned_about() {
    let cur = Sources::new(vec![test_engine("http://127.0.0.1:18000", 1, 0)]);
    let p = plan(
        &cur,
        Change::Add(test_engine("http://localhost:18000", 1, 1)),
    )
    .unwrap();
    assert_eq!(p.outcome.check.len(), 2);
    assert!(!p.outcome.check[0].concerned && p.outcome.check[1].concerned);
    let mut outcome = p.outcome;
    outcome.check_addresses().await;
    assert_eq!(outcome.warnings.len(), 1, "{:?}", outcome.warnings);
    let w = &outcome.warnings[0];
    assert!(
        w.contains("http://127.0.0.1:18000 (from config)")
            && w.contains("http://localhost:18000 (from admin)")
            && w.contains("counted twice"),
        "{w}"
    );
    let json = serde_json::to_value(&outcome).unwrap();
    assert_eq!(json["warnings"][0], w.as_str());
    assert!(json.get("check").is_none(), "{json}");
    // A reload naming the same engines again brings nothing: nothing to check.
    let again = plan(
        &p.sources,
        Change::Replace {
            origin: Origin::Config,
            engines: vec![test_engine("http://127.0.0.1:18000", 1, 0)],
        },
    )
    .unwrap();
    assert!(again.outcome.check.is_empty());
    // Discovery finding the same server by another name is warned about too.
    let found = plan(
        &cur,
        Change::Replace {
            origin: Origin::Discovery(0),
            engines: vec![test_engine("http://localhost:18000", 1, 0)],
        },
    )
    .unwrap();
    let mut outcome = found.outcome;
    outcome.check_addresses().await;
    assert!(
        outcome.warnings.len() == 1 && outcome.warnings[0].contains("(from discovery[0])"),
        "{:?}",
        outcome.warnings
    );
}

/// One rule for every source: independent engines never conflict; members of a named group
/// are checked whoever found them.
#[test]
fn groups_are_checked_across_sources_and_independent_engines_never() {
    let own = |url: &str| {
        let mut e = test_engine(url, 2, 0);
        e.deployment = crate::worker::Deployment::Own;
        e
    };
    let member = |url: &str, start: u32| {
        let mut e = test_engine(url, 2, start);
        e.deployment = crate::worker::Deployment::Member {
            group: Some("big".into()),
        };
        e
    };
    let mut cur = Sources::new(vec![own("http://a:1"), member("http://m:1", 0)]);
    cur = plan(&cur, Change::Add(own("http://b:1"))).unwrap().sources;
    let found = vec![own("http://c:1"), member("http://n:1", 2)];
    let p = plan(
        &cur,
        Change::Replace {
            origin: Origin::Discovery(0),
            engines: found,
        },
    )
    .unwrap();
    assert_eq!(p.engines.len(), 5);
    let clash = vec![member("http://o:1", 1)];
    let err = plan(
        &p.sources,
        Change::Replace {
            origin: Origin::Discovery(0),
            engines: clash,
        },
    )
    .unwrap_err();
    assert!(
        err.to_string().contains("http://o:1") && err.to_string().contains("DP group \"big\""),
        "{err}"
    );
}
