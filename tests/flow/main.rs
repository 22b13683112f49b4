//! Flow control over real sockets: a simulated engine whose one rank takes one request at a
//! time (`flow.max_running = 1`), a real router in front with `[flow]` on. Requests that find
//! the rank busy wait in rankgate and leave by priority, then by the tokens their tenant has
//! cost; past their wait, or the queue's caps, they get 503 with `Retry-After` and the reason;
//! a client that goes away leaves the queue; at shutdown they are served within the drain grace
//! or answered 503; a key caps the objective its requests may claim; the tenants named on
//! `/metrics` are bounded; the gRPC front door queues the same way; and a rank whose telemetry
//! is late is judged by this router's own requests on it.
#![cfg(feature = "sim")] // the simulated engine

#[path = "../common/mod.rs"]
mod common;
mod grpc;
mod leave;
mod stale;

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use rankgate::app::Router;
use rankgate_sim::sim::{SimConfig, SimEngine, SimFlavor as Flavor};
use serde_json::Value;
use tokio::task::JoinHandle;

use common::*;

/// Objectives premium (100), the default (0) and batch (-10); one request at a time per rank.
const FLOW: &str = "[flow]\nenabled = true\nmax_running = 1\n\
    [[flow.objectives]]\nname = \"premium\"\npriority = 100\n\
    [[flow.objectives]]\nname = \"batch\"\npriority = -10\n";

/// One rank, 20 tokens a second: a request of 20 tokens holds it for a second.
fn slow() -> SimConfig {
    SimConfig {
        decode_tokens_per_sec: 20.0,
        ..sim(Flavor::Vllm, 1, 0)
    }
}

/// A slow engine behind a router with `server` keys and [`FLOW`] with `flow` keys, its rank
/// available.
async fn setup(server: &str, flow: &str) -> (SimEngine, Router) {
    let e = engine(slow()).await;
    let flow = FLOW.replacen("max_running = 1\n", &format!("max_running = 1\n{flow}"), 1);
    let r = router_with(
        server,
        &format!("{FAST}{flow}"),
        &[engine_toml(&e.url(), "vllm", 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;
    (e, r)
}

/// A chat of `max_tokens` with `x-request-id: id` and these headers, answered in a task.
fn ask(r: &Router, id: &str, headers: &[(&str, &str)], max_tokens: u64) -> JoinHandle<Reply> {
    ask_with(r, id, headers, chat_body(max_tokens, false))
}

fn ask_with(r: &Router, id: &str, headers: &[(&str, &str)], body: String) -> JoinHandle<Reply> {
    let mut req = post(r.addr, "/v1/chat/completions").header("x-request-id", id);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::from(body))).unwrap();
    tokio::spawn(send(req))
}

/// The admin `/flows` page.
async fn flows(r: &Router) -> Value {
    get(r.admin_addr, "/flows").await.json()
}

/// Waits until `n` requests wait in rankgate's queue.
async fn waiting(r: &Router, n: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let f = flows(r).await;
        if f["waiting"] == n {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "never {n} waiting: {f}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The request ids the engine received, in order.
fn arrivals(e: &SimEngine) -> Vec<String> {
    (e.seen().iter())
        .filter(|s| s.path == "/v1/chat/completions")
        .filter_map(|s| s.request_id.clone())
        .collect()
}

/// One objective's entry on `/flows`.
fn objective<'a>(f: &'a Value, name: &str) -> &'a Value {
    (f["objectives"].as_array().unwrap().iter())
        .find(|o| o["name"] == name)
        .unwrap_or_else(|| panic!("no objective {name}: {f}"))
}

/// The rank is busy with a request of `tokens` (sent and counted in flight).
async fn busy(r: &Router, tokens: u64) -> JoinHandle<Reply> {
    let blocker = ask(r, "blocker", &[], tokens);
    wait_workers(r, Duration::from_secs(5), |rows| rows[0]["in_flight"] == 1).await;
    blocker
}

/// Asserts `reply` is flow control's 503: `Retry-After`, an OpenAI error whose `code` is `why`.
fn refused(reply: &Reply, why: &str) -> Value {
    assert_eq!(
        reply.status,
        503,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert!(reply.headers.get("retry-after").is_some());
    let v = reply.json();
    assert_eq!(v["error"]["type"], "ServiceUnavailableError", "{v}");
    assert_eq!(v["error"]["code"], why, "{v}");
    v
}

const PREMIUM: (&str, &str) = ("x-gateway-inference-objective", "premium");
const BATCH: (&str, &str) = ("x-gateway-inference-objective", "batch");

#[tokio::test]
async fn a_higher_priority_overtakes_the_queue_and_each_waits_for_a_free_rank() {
    let (e, r) = setup("", "").await;
    let blocker = busy(&r, 10).await;
    let b1 = ask(&r, "batch-1", &[BATCH], 1);
    waiting(&r, 1).await;
    let b2 = ask(&r, "batch-2", &[BATCH], 1);
    waiting(&r, 2).await;
    let p = ask(&r, "premium", &[PREMIUM], 1);
    waiting(&r, 3).await;
    let f = flows(&r).await;
    assert_eq!(objective(&f, "batch")["queued"], 2, "{f}");
    assert_eq!(objective(&f, "premium")["queued"], 1, "{f}");
    for h in [blocker, b1, b2, p] {
        let reply = h.await.unwrap();
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
    }
    assert_eq!(arrivals(&e), ["blocker", "premium", "batch-1", "batch-2"]);
    let f = flows(&r).await;
    assert_eq!(objective(&f, "batch")["dispatched_after_wait"], 2, "{f}");
    // The wait is on /metrics, by objective.
    let m = String::from_utf8(get(r.admin_addr, "/metrics").await.body.to_vec()).unwrap();
    assert!(
        m.contains("rankgate_flow_wait_seconds_count{objective=\"batch\"} 2"),
        "{m}"
    );
    assert!(
        m.contains("rankgate_flow_queue_requests{objective=\"premium\"} 0"),
        "{m}"
    );
}

#[tokio::test]
async fn within_a_priority_the_tenant_that_cost_the_fewest_tokens_goes_first() {
    let (e, r) = setup("", "").await;
    let blocker = busy(&r, 10).await;
    // Heavy's prompts are 2,000 tokens each (8,000 bytes), light's a few: after one of heavy's,
    // light's three go before heavy's second (by request count, they would alternate).
    let big = serde_json::json!({
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "x".repeat(8000)}],
        "max_tokens": 1,
    })
    .to_string();
    let heavy = [("x-gateway-inference-fairness-id", "heavy")];
    let light = [("x-gateway-inference-fairness-id", "light")];
    let mut all = vec![blocker];
    for (n, id) in ["heavy-1", "heavy-2"].iter().enumerate() {
        all.push(ask_with(&r, id, &heavy, big.clone()));
        waiting(&r, n as u64 + 1).await;
    }
    for (n, id) in ["light-1", "light-2", "light-3"].iter().enumerate() {
        all.push(ask(&r, id, &light, 1));
        waiting(&r, n as u64 + 3).await;
    }
    for h in all {
        assert_eq!(h.await.unwrap().status, 200);
    }
    assert_eq!(
        arrivals(&e),
        ["blocker", "heavy-1", "light-1", "light-2", "light-3", "heavy-2"]
    );
    let f = flows(&r).await;
    let tenant = |name: &str| {
        (f["tenants"].as_array().unwrap().iter())
            .find(|t| t["tenant"] == name)
            .unwrap_or_else(|| panic!("no tenant {name}: {f}"))
            .clone()
    };
    assert!(tenant("heavy")["tokens"].as_u64().unwrap() >= 4000, "{f}");
    assert!(tenant("light")["tokens"].as_u64().unwrap() < 500, "{f}");
}

#[tokio::test]
async fn past_its_wait_or_the_caps_a_request_gets_503_with_retry_after_and_why() {
    let (_e, r) = setup("", "max_queued_per_tenant = 1\n").await;
    let blocker = busy(&r, 20).await;
    let started = tokio::time::Instant::now();
    let late = ask(&r, "late", &[("x-rankgate-max-wait-ms", "200")], 1);
    waiting(&r, 1).await;
    // The same tenant (the client's address) has its one place taken: refused at once.
    let over = ask(&r, "over", &[], 1).await.unwrap();
    refused(&over, "tenant_queue_full");
    // Refused at its deadline, while the rank was still busy (else it would have been sent).
    let v = refused(&late.await.unwrap(), "deadline");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("objective `default`"),
        "{v}"
    );
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(blocker.await.unwrap().status, 200);
    let f = flows(&r).await;
    let rejected = &objective(&f, "default")["rejected"];
    assert_eq!(
        (
            rejected["deadline"].as_u64(),
            rejected["tenant_queue_full"].as_u64()
        ),
        (Some(1), Some(1)),
        "{f}"
    );
}

#[tokio::test]
async fn a_key_binds_its_tenant_and_caps_the_objective_it_may_claim() {
    let keys = std::env::temp_dir().join(format!("rankgate-flow-keys-{}", std::process::id()));
    std::fs::write(&keys, "sk-team tenant=team-a objective=batch\nsk-open\n").unwrap();
    let server = format!("api_keys_file = {:?}", keys.display().to_string());
    let (e, r) = setup(&server, "").await;
    let auth = |k: &'static str| ("authorization", k);
    let blocker = ask(&r, "blocker", &[auth("Bearer sk-open")], 10);
    wait_workers(&r, Duration::from_secs(5), |rows| rows[0]["in_flight"] == 1).await;
    // Claims premium and another tenant: the key says batch and team-a.
    let claimed = [
        auth("Bearer sk-team"),
        PREMIUM,
        ("x-gateway-inference-fairness-id", "someone-else"),
    ];
    let team = ask(&r, "team", &claimed, 1);
    waiting(&r, 1).await;
    let open = ask(&r, "open", &[auth("Bearer sk-open")], 1);
    waiting(&r, 2).await;
    let f = flows(&r).await;
    assert_eq!(objective(&f, "batch")["queued"], 1, "{f}");
    assert!(
        f["tenants"]
            .as_array()
            .unwrap()
            .iter()
            .any(|t| t["tenant"] == "team-a"),
        "{f}"
    );
    for h in [blocker, team, open] {
        assert_eq!(h.await.unwrap().status, 200);
    }
    assert_eq!(arrivals(&e), ["blocker", "open", "team"]);
    let _ = std::fs::remove_file(&keys);
}

#[tokio::test]
async fn the_tenants_tracked_and_named_on_metrics_are_bounded() {
    let (_e, r) = setup("", "max_tenants = 3\ntenant_labels = 2\n").await;
    for i in 0..12 {
        let tenant = format!("tenant-{i}");
        let reply = ask(
            &r,
            "t",
            &[("x-gateway-inference-fairness-id", tenant.as_str())],
            1,
        );
        assert_eq!(reply.await.unwrap().status, 200);
    }
    // A tenant id that is no label value is not believed: the client's address stands in.
    let odd = ask(
        &r,
        "odd",
        &[("x-gateway-inference-fairness-id", "a\"b{c}")],
        1,
    );
    assert_eq!(odd.await.unwrap().status, 200);
    let f = flows(&r).await;
    assert!(f["tenants_tracked"].as_u64().unwrap() <= 4, "{f}");
    assert!(f["tenants"].as_array().unwrap().len() <= 2, "{f}");
    let m = String::from_utf8(get(r.admin_addr, "/metrics").await.body.to_vec()).unwrap();
    let named = m
        .lines()
        .filter(|l| l.starts_with("rankgate_flow_tenant_tokens_total{"))
        .count();
    assert!((1..=3).contains(&named), "{named} tenant series:\n{m}");
    assert!(m.contains("tenant=\"~other\""), "{m}");
    assert!(!m.contains("a\\\"b"), "{m}");
}

#[tokio::test]
async fn off_it_holds_nothing_and_says_so() {
    let e = engine(slow()).await;
    let r = router(FAST, &[engine_toml(&e.url(), "vllm", 1, 0)]).await;
    wait_state(&r, &[0], "available").await;
    assert_eq!(flows(&r).await, serde_json::json!({"enabled": false}));
    let m = String::from_utf8(get(r.admin_addr, "/metrics").await.body.to_vec()).unwrap();
    assert!(!m.contains("rankgate_flow_"), "{m}");
}

#[tokio::test]
async fn an_objectives_engine_priority_goes_to_the_engine_in_the_body() {
    // vLLM under its default FCFS policy refuses a non-zero `priority` (400): the refusal proves
    // rankgate wrote it; the same engine under `--scheduling-policy priority` serves it.
    let flow = "[[flow.objectives]]\nname = \"urgent\"\npriority = 50\nengine_priority = -5\n";
    for (policy, status) in [
        (rankgate_sim::sim::SchedulingPolicy::Fcfs, 400),
        (rankgate_sim::sim::SchedulingPolicy::Priority, 200),
    ] {
        let e = engine(SimConfig {
            scheduling_policy: policy,
            ..slow()
        })
        .await;
        let r = router(
            &format!("{FAST}{FLOW}{flow}"),
            &[engine_toml(&e.url(), "vllm", 1, 0)],
        )
        .await;
        wait_state(&r, &[0], "available").await;
        let urgent = ask(&r, "u", &[("x-gateway-inference-objective", "urgent")], 1);
        let reply = urgent.await.unwrap();
        assert_eq!(
            reply.status,
            status,
            "{policy:?}: {}",
            String::from_utf8_lossy(&reply.body)
        );
        // Without the objective, nothing is written: FCFS serves it.
        let plain = ask(&r, "p", &[], 1).await.unwrap();
        assert_eq!(
            plain.status,
            200,
            "{}",
            String::from_utf8_lossy(&plain.body)
        );
    }
}
