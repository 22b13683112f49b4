//! The load client and the scenario runner, over real sockets against simulated engines.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::time::Duration;

use common::*;
use rankgate::config::Policy;
use rankgate_sim::load::{self, Api, Arrivals, Dist, ErrorKind, TraceEntry, Workload};
use rankgate_sim::scenario::{self, Scenario};
use rankgate_sim::sim::SimFlavor;

#[tokio::test]
async fn closed_loop_streaming_measures_every_token() {
    let e = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let mut w = Workload::new(e.url());
    w.arrivals = Arrivals::Closed(4);
    w.requests = 20;
    w.output_tokens = Dist::Fixed(8);
    w.duration = Duration::from_secs(30);
    let r = load::run(&w).await.unwrap();
    assert_eq!(r.outcomes.len(), 20);
    assert_eq!(r.ok().count(), 20);
    assert!(r
        .outcomes
        .iter()
        .all(|o| o.tokens == 8 && o.itl.len() == 7 && o.ttft.is_some()));
    assert_eq!(r.itl().count, 20 * 7);
    assert!(r.ttft().p50 > 0.0 && r.e2e().p99 >= r.ttft().p99);
    assert!(r.tokens_per_sec() > 0.0);
    assert_eq!(e.served().iter().sum::<u64>(), 20);
    let json = r.to_json();
    assert_eq!(json["ok"], 20);
    assert!(json["ttft_ms"]["p999"].as_f64().is_some());
}

#[tokio::test]
async fn open_loop_trace_completions_and_error_kinds() {
    let e = engine(sim(SimFlavor::Sglang, 1, 0)).await;
    let mut w = Workload::new(e.url());
    w.api = Api::Completions;
    w.stream = false;
    w.arrivals = Arrivals::Poisson(50.0);
    w.trace = Some(
        (0..6)
            .map(|i| TraceEntry {
                prompt_tokens: 10,
                output_tokens: 3 + i,
                at_ms: Some(i * 20),
                ..TraceEntry::default()
            })
            .collect(),
    );
    let r = load::run(&w).await.unwrap();
    assert_eq!(r.ok().count(), 6);
    let tokens: Vec<u64> = r.outcomes.iter().map(|o| o.tokens).collect();
    assert_eq!(
        tokens,
        [3, 4, 5, 6, 7, 8],
        "completion_tokens read from the usage block"
    );
    // Traces carry their own timestamps: the report does not claim a Poisson rate.
    assert_eq!(r.requested_rate, None);

    let port = tokio::net::TcpListener::bind(loopback())
        .await
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut dead = Workload::new(format!("http://127.0.0.1:{port}"));
    dead.requests = 3;
    dead.arrivals = Arrivals::Closed(1);
    let r = load::run(&dead).await.unwrap();
    assert_eq!(r.errors_by_kind().get(&ErrorKind::Connect), Some(&3));
}

const DARK: &str = r#"
name = "dark window"
policies = ["least_kv"]
[router]
interval = "50ms"
stale_after = "1s"
[[engines]]
flavor = "vllm"
dp_size = 2
[workload]
rate = 30
requests = 150
duration = "15s"
prompt_tokens = 100
output_tokens = 8
[[events]]
at = "1500ms"
dark = [1]
[[events]]
at = "3s"
dark = []
"#;

#[tokio::test]
async fn scenario_counts_requests_sent_while_dark() {
    let s = Scenario::parse(DARK, None).unwrap();
    let runs = scenario::run(&s, None, false).await.unwrap();
    let run = &runs[0];
    assert_eq!(run.policy, Policy::LeastKv.into());
    assert_eq!(run.replicas, 1);
    assert_eq!(run.report.ok().count(), 150);
    let rank1 = &run.ranks[1];
    assert_eq!(
        rank1.sent_while_dark, 0,
        "least_kv sent to a rank it had no telemetry for"
    );
    // The rank served before going dark and after coming back.
    let id = &rank1.id;
    let served = |from: f64, to: f64| {
        run.report
            .ok()
            .filter(|o| o.worker.as_deref() == Some(id.as_str()))
            .filter(|o| o.sent.as_secs_f64() >= from && o.sent.as_secs_f64() < to)
            .count()
    };
    assert!(served(0.0, 1.5) > 0 && served(3.2, 15.0) > 0);
    assert!(!run.kv_series.is_empty() && run.kv_series[0].1.len() == 2);
    let md = scenario::render::markdown(&s, &runs);
    assert!(md.contains("| least_kv |"));
    let svg = scenario::render::svg(&s, &runs);
    assert!(svg.starts_with("<svg") && svg.contains("<polyline"));
}

fn caching(dp_size: u32) -> rankgate_sim::sim::SimConfig {
    rankgate_sim::sim::SimConfig {
        prefix_caching: true,
        ..sim(SimFlavor::Vllm, dp_size, 0)
    }
}

#[tokio::test]
async fn sessions_repeat_their_history_and_hit_the_prefix_cache() {
    let e = engine(caching(1)).await;
    let mut w = Workload::new(e.url());
    w.arrivals = Arrivals::Closed(2);
    w.requests = 100;
    w.output_tokens = Dist::Fixed(4);
    w.sessions = Some(load::Sessions {
        count: 3,
        turns: 3,
        system_tokens: 300,
        system_prompts: 1,
        user_tokens: Dist::Fixed(20),
        think_time: Duration::ZERO,
    });
    let r = load::run(&w).await.unwrap();
    assert_eq!(r.ok().count(), 9, "{:?}", r.errors_by_kind());
    let (queries, hits) = e.prefix_cache()[0];
    // Every turn but the very first finds at least the system prompt cached; later turns their
    // whole history.
    assert!(hits as f64 > 0.5 * queries as f64, "{hits} of {queries}");

    // The request bound holds across sessions.
    w.requests = 4;
    let r = load::run(&w).await.unwrap();
    assert_eq!(r.outcomes.len(), 4);
}

#[tokio::test]
async fn a_hot_prefix_is_shared_and_other_prompts_are_not() {
    let e = engine(caching(1)).await;
    let mut w = Workload::new(e.url());
    w.arrivals = Arrivals::Closed(1);
    w.requests = 6;
    w.prompt_tokens = Dist::Fixed(100);
    w.output_tokens = Dist::Fixed(2);
    let r = load::run(&w).await.unwrap();
    assert_eq!(r.ok().count(), 6);
    assert_eq!(e.prefix_cache()[0].1, 0, "unique prompts share nothing");
    w.hot_prefix = Some(load::HotPrefix {
        share: 1.0,
        tokens: 640,
    });
    load::run(&w).await.unwrap();
    let (_, hits) = e.prefix_cache()[0];
    assert!(hits >= 5 * 600, "5 of 6 find the 640-token prefix: {hits}");
}

#[tokio::test]
async fn spread_sends_each_target_its_turn() {
    let a = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    let b = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    let mut w = Workload::new(a.url());
    w.spread = vec![b.url()];
    w.arrivals = Arrivals::Closed(2);
    w.requests = 10;
    w.output_tokens = Dist::Fixed(2);
    let r = load::run(&w).await.unwrap();
    assert_eq!(r.ok().count(), 10);
    assert_eq!((a.served(), b.served()), (vec![5], vec![5]));
}

const REPLICAS: &str = r#"
name = "replicas"
policies = ["least_kv"]
[router]
interval = "50ms"
replicas = [1, 2]
[[engines]]
flavor = "vllm"
dp_size = 2
prefill_rate = 5000
[workload]
concurrency = 4
requests = 24
duration = "20s"
output_tokens = 4
[workload.sessions]
count = 6
turns = 4
system_tokens = 400
system_prompts = 2
user_tokens = 30
"#;

#[tokio::test]
async fn scenario_runs_each_variant_per_replica_count_with_sessions() {
    let s = Scenario::parse(REPLICAS, None).unwrap();
    let runs = scenario::run(&s, None, false).await.unwrap();
    let labels: Vec<String> = runs.iter().map(|r| r.label()).collect();
    assert_eq!(labels, ["least_kv", "least_kv x2"]);
    for r in &runs {
        assert_eq!(r.report.ok().count(), 24, "{}", r.label());
        let (q, h) = r.report.prefix_cache.unwrap();
        assert!(q > 0 && h > 0, "{}: {h} of {q}", r.label());
        let per_rank: u64 = r.ranks.iter().map(|x| x.prefix_queries).sum();
        assert_eq!(per_rank, q);
    }
    let md = scenario::render::markdown(&s, &runs);
    assert!(md.contains("| least_kv x2 |"), "{md}");
}

const PD: &str = r#"
name = "pd"
policies = ["least_kv"]
also_colocated = true
[[engines]]
flavor = "vllm"
dp_size = 2
role = "prefill"
prefill_interference = true
[[engines]]
flavor = "vllm"
dp_size = 2
role = "decode"
prefill_interference = true
[workload]
rate = 20
requests = 16
duration = "20s"
prompt_tokens = 300
output_tokens = 8
"#;

/// A disaggregated scenario gives the router the engines' roles (every request's prefill leg on
/// a prefill rank, its decode leg on a decode rank, as the engines saw them), and runs the same
/// engines once more without roles, each rank then serving whole requests.
#[tokio::test]
async fn a_pd_scenario_runs_split_and_colocated_on_the_same_engines() {
    let s = Scenario::parse(PD, None).unwrap();
    let runs = scenario::run(&s, None, false).await.unwrap();
    let labels: Vec<String> = runs.iter().map(|r| r.label()).collect();
    assert_eq!(labels, ["least_kv (P/D)", "least_kv (colocated)"]);
    for r in &runs {
        assert_eq!(r.report.ok().count(), 16, "{}", r.label());
        assert!(r.report.itl().count > 0, "{}", r.label());
        let legs: usize = r.ranks.iter().map(|x| x.legs).sum();
        let served: usize = r.ranks.iter().map(|x| x.served).sum();
        assert_eq!(served, 16, "{}", r.label());
        let roles: Vec<_> = r.ranks.iter().map(|x| x.role).collect();
        if r.disaggregated {
            assert_eq!(legs, 32, "a prefill and a decode leg each");
            assert_eq!(
                roles,
                [
                    Some("prefill"),
                    Some("prefill"),
                    Some("decode"),
                    Some("decode")
                ]
            );
            assert_eq!(r.ranks[0].legs + r.ranks[1].legs, 16);
            assert_eq!(
                r.ranks[0].served + r.ranks[1].served,
                0,
                "P answers no client"
            );
        } else {
            assert_eq!(legs, 16);
            assert!(roles.iter().all(Option::is_none));
        }
    }
    let md = scenario::render::markdown(&s, &runs);
    assert!(
        md.contains("| least_kv (colocated) |") && md.contains(" prefill | "),
        "{md}"
    );
    assert!(md.contains("ITL p99 ms"), "{md}");
}

/// A killed engine's streams (`die_after`: it dies like `kill -9` after admitting N requests)
/// are errors, never ok: straight from the engine they end without `[DONE]` (cut); through
/// rankgate they end with its error event, which is counted as such and never as a token.
#[tokio::test]
async fn a_killed_engines_cut_streams_are_errors_by_kind() {
    const REQUESTS: usize = 8;
    for through_router in [false, true] {
        let mut cfg = sim(SimFlavor::Vllm, 1, 0);
        // Slow enough that every stream is still running when the engine dies.
        cfg.decode_tokens_per_sec = 20.0;
        let e = engine(cfg).await;
        let r = match through_router {
            true => Some(fleet_router(&e).await),
            false => None,
        };
        let url = match &r {
            Some(r) => format!("http://{}", r.addr),
            None => e.url(),
        };
        e.die_after(Some(REQUESTS as u64));
        let mut w = Workload::new(url);
        w.arrivals = Arrivals::Closed(REQUESTS);
        w.requests = REQUESTS;
        w.output_tokens = Dist::Fixed(200);
        w.duration = Duration::from_secs(30);
        let run = load::run(&w);
        let (report, ()) = tokio::join!(run, async {
            // The engine dies once it has admitted all of them: they were all streaming.
            tokio::time::timeout(Duration::from_secs(20), e.dead())
                .await
                .expect("engine died");
        });
        let report = report.unwrap();
        let kinds = report.errors_by_kind();
        let want = match through_router {
            true => ErrorKind::StreamErrorEvent,
            false => ErrorKind::StreamCut,
        };
        assert_eq!(
            report.ok().count(),
            0,
            "router: {through_router}: {kinds:?}"
        );
        // The last admission kills the engine, so that one may fail before its headers; every
        // other one was streaming.
        let cut: Vec<_> = report
            .outcomes
            .iter()
            .filter(|o| o.error == Some(want))
            .collect();
        assert!(
            cut.len() >= REQUESTS - 1,
            "router: {through_router}: {kinds:?}"
        );
        // Tokens are the engine's only: fewer than a full stream, none for the error event.
        assert!(cut.iter().all(|o| o.status == 200 && o.tokens < 200));
        println!("router {through_router}: {kinds:?}");
    }
}

async fn fleet_router(e: &rankgate_sim::sim::SimEngine) -> rankgate::app::Router {
    let r = router(FAST, &[engine_toml(&e.url(), "vllm", 1, 0)]).await;
    wait_state(&r, &[0], "available").await;
    r
}

/// Two tenants at once through the router: every request carries its tenant's headers to the
/// engine, and each tenant's counts are its own and add up to the run's.
#[tokio::test]
async fn tenants_send_their_headers_through_the_router_and_count_apart() {
    let e = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    let r = fleet_router(&e).await;
    let tenant = |name: &str, objective: &str, n: usize| {
        let mut w = Workload::new(format!("http://{}", r.addr));
        w.arrivals = Arrivals::Closed(2);
        w.requests = n;
        w.output_tokens = Dist::Fixed(4);
        w.duration = Duration::from_secs(20);
        let h = |k: &str, v: &str| (k.parse().unwrap(), v.parse().unwrap());
        w.headers = std::sync::Arc::from(vec![
            h(load::FAIRNESS_HEADER, name),
            h(load::OBJECTIVE_HEADER, objective),
            h(&format!("x-team-{name}"), "1"),
        ]);
        load::Tenant {
            name: name.into(),
            workload: w,
        }
    };
    let report = load::run_tenants(&[tenant("a", "interactive", 6), tenant("b", "batch", 10)])
        .await
        .unwrap();
    let stats = report.per_tenant();
    let counts: Vec<_> = (stats.iter())
        .map(|t| {
            (
                t.name.as_str(),
                t.sent,
                t.completed,
                t.tokens,
                t.demand_tokens,
            )
        })
        .collect();
    assert_eq!(counts, [("a", 6, 6, 24, 24), ("b", 10, 10, 40, 40)]);
    assert_eq!(report.outcomes.len(), 16);
    let seen = e.seen();
    let with = |name: &str| {
        (seen.iter())
            .filter(|s| s.header_names.iter().any(|h| h == name))
            .count()
    };
    assert_eq!((with("x-team-a"), with("x-team-b")), (6, 10));
    assert_eq!(with(load::FAIRNESS_HEADER), 16);
    assert_eq!(with(load::OBJECTIVE_HEADER), 16);
    assert!(report.table().contains("per tenant"), "{}", report.table());
    assert_eq!(report.to_json()["tenants"][1]["completed"], 10);
    r.shutdown().await;
}

const TENANTS: &str = r#"
name = "tenants"
policies = ["least_kv"]
[router]
interval = "50ms"
[[engines]]
flavor = "vllm"
dp_size = 2
[workload]
duration = "20s"
prompt_tokens = 50
output_tokens = 4
[[workload.tenants]]
name = "heavy"
objective = "batch"
rate = 40
requests = 20
[[workload.tenants]]
name = "light"
objective = "interactive"
concurrency = 1
requests = 4
"#;

#[tokio::test]
async fn a_scenario_reports_each_tenant() {
    let s = Scenario::parse(TENANTS, None).unwrap();
    let runs = scenario::run(&s, None, false).await.unwrap();
    let report = &runs[0].report;
    let stats = report.per_tenant();
    let sent: Vec<_> = stats.iter().map(|t| (t.name.as_str(), t.sent)).collect();
    assert_eq!(sent, [("heavy", 20), ("light", 4)]);
    assert_eq!(report.ok().count(), 24);
    assert_eq!(stats.iter().map(|t| t.completed).sum::<usize>(), 24);
    assert!(stats
        .iter()
        .all(|t| t.demand_served == 1.0 && t.ttft_ms.count > 0));
    let md = scenario::render::markdown(&s, &runs);
    assert!(
        md.contains("| least_kv | heavy | 20 | 20 | 0 | 0 | 0 |"),
        "{md}"
    );
    let json = scenario::render::to_json(&s, &runs);
    assert_eq!(json["policies"][0]["report"]["tenants"][1]["name"], "light");
}
