//! The load client's per-worker report lists every rank of the fleet, over real sockets: a
//! router whose `least_kv` keeps every request off one rank (its telemetry dark) and the
//! fleet read from its admin `/workers`, so the rank that got nothing is in the table with 0.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::time::Duration;

use common::*;
use rankgate_sim::load::{self, Arrivals, Dist, Workload};
use rankgate_sim::sim::{SimConfig, SimFlavor};

#[tokio::test]
async fn a_rank_that_got_nothing_is_listed_with_0() {
    // Rank 1's series are left out of /metrics: least_kv never sends to a rank it cannot see.
    let e = engine(SimConfig {
        dark_ranks: vec![1],
        kv_usage: vec![0.1, 0.1],
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    let r = router(FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_state(&r, &[0], "available").await;
    wait_state(&r, &[1], "unavailable").await;
    let (busy, dark) = (format!("{}@0", e.url()), format!("{}@1", e.url()));

    let mut w = Workload::new(format!("http://{}", r.addr));
    w.arrivals = Arrivals::Closed(2);
    w.requests = 12;
    w.output_tokens = Dist::Fixed(2);
    w.duration = Duration::from_secs(30);
    let mut report = load::run(&w).await.unwrap();
    assert_eq!(report.ok().count(), 12);

    // Without the fleet, only the workers some answer named can be listed.
    assert!(!report.table().contains(&dark), "{}", report.table());

    report.fleet = load::fleet::ranks(&format!("http://{}", r.admin_addr), None)
        .await
        .unwrap();
    assert_eq!(report.fleet, [busy.clone(), dark.clone()]);
    let table = report.table();
    let line = |id: &str| {
        (table.lines().find(|l| l.trim_start().starts_with(id)))
            .unwrap_or_else(|| panic!("{id} missing:\n{table}"))
            .to_string()
    };
    let words = |l: String| -> Vec<String> { l.split_whitespace().map(String::from).collect() };
    assert_eq!(
        words(line(&dark))[1..],
        ["0", "requests", "0.0%"],
        "{table}"
    );
    assert_eq!(
        words(line(&busy))[1..],
        ["12", "requests", "100.0%"],
        "{table}"
    );
    assert!(table.contains("every rank of the fleet"), "{table}");
    let json = report.to_json();
    assert_eq!(json["per_worker"][&dark], 0, "{json}");
    assert_eq!(json["per_worker"][&busy], 12, "{json}");

    // An admin that is not one is an error naming it.
    let err = load::fleet::ranks(&format!("http://{}", r.addr), None)
        .await
        .unwrap_err();
    assert!(err.contains("/workers"), "{err}");
    r.shutdown().await;
}

/// Under the default `expose_worker = "none"`, `rankgate load --admin` with the admin token
/// counts each request on the rank that served it (it asks with `x-rankgate-debug`); without
/// the token its table says the router hides the rank instead of crediting nobody.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_names_the_rank_under_expose_worker_none() {
    use common::admin::{token_env, TOKEN};
    let e = engine(SimConfig {
        dark_ranks: vec![1],
        kv_usage: vec![0.1, 0.1],
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    let server = format!("expose_worker = \"none\"\n{}", token_env());
    let r = router_with(&server, FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_state(&r, &[0], "available").await;
    let admin = format!("http://{}", r.admin_addr);
    let (busy, dark) = (format!("{}@0", e.url()), format!("{}@1", e.url()));
    let workload = |token: Option<&str>| {
        let mut w = Workload::new(format!("http://{}", r.addr));
        w.arrivals = Arrivals::Closed(2);
        w.requests = 6;
        w.output_tokens = Dist::Fixed(2);
        w.duration = Duration::from_secs(30);
        w.admin_token = token.map(Into::into);
        w
    };

    let mut report = load::run(&workload(Some(TOKEN))).await.unwrap();
    assert_eq!(report.ok().count(), 6);
    report.fleet = load::fleet::ranks(&admin, Some(TOKEN)).await.unwrap();
    let per = report.per_worker();
    assert_eq!(per.get(&busy), Some(&6), "{per:?}");
    assert_eq!(per.get(&dark), Some(&0), "{per:?}");
    assert_eq!(per.len(), 2, "{per:?}");

    let mut report = load::run(&workload(None)).await.unwrap();
    report.fleet = load::fleet::ranks(&admin, None).await.unwrap();
    let per = report.per_worker();
    assert_eq!(per.get(load::HIDDEN), Some(&6), "{per:?}");
    // The fleet's ranks are not listed with a 0 no one counted.
    assert_eq!(per.len(), 1, "{per:?}");
    assert!(
        report.table().contains("hidden by the router"),
        "{}",
        report.table()
    );
    r.shutdown().await;
}
