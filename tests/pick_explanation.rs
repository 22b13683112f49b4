//! The pick explanation (`x-rankgate-debug`) names the rule that decided every candidate, over
//! real sockets: a simulated vLLM engine of two ranks publishing its KV-cache events and
//! tokenizing with the tiny model's real tokenizer, a router subscribed to them with prefix
//! affinity. A conversation is served once, so one rank's engine says it holds the prompt; then
//! the ranks' reported KV is set so that affinity picks that holder, or the holder loses for being
//! above `affinity_max_kv`, or for being outside `affinity_margin`, and the explanation says
//! which, with the figures. A fresh router's very first request counts its prompt's tokens, and
//! the ranks of an engine serving another model are listed as not serving it.

mod common;

use std::time::Duration;

use common::admin::{token_env, TOKEN};
use common::*;
use rankgate_sim::sim::kv::KvEventsConfig;
use rankgate_sim::sim::{model, SimConfig, SimEngine, SimFlavor};
use serde_json::{json, Value};

const WAIT: Duration = Duration::from_secs(10);

async fn engine_with_events() -> SimEngine {
    let dir = model::tiny_model_dir().unwrap();
    engine(SimConfig {
        kv_usage: vec![0.1, 0.1],
        prefix_caching: true,
        kv_events: Some(KvEventsConfig::bind_local()),
        tokenizer: Some(model::tokenizer(&dir).unwrap()),
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await
}

/// A router with exact prefix routing over `e`, these affinity settings, and an admin token
/// (debugging needs it).
async fn exact_router(e: &SimEngine, margin: f64, max_kv: f64) -> rankgate::app::Router {
    let dir = model::tiny_model_dir().unwrap();
    let extra = format!(
        "{FAST}[routing]\nprefix_affinity = true\nkv_events = true\ntie_margin = 0.0\n\
         affinity_margin = {margin}\naffinity_max_kv = {max_kv}\n\
         [[models]]\nname = \"tiny-llama\"\ntokenizer = {:?}\n",
        dir.display().to_string()
    );
    let r = router_with(&token_env(), &extra, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    r
}

fn conversation() -> Vec<Value> {
    vec![
        json!({"role": "system", "content": "You answer questions about inference routers. ".repeat(40)}),
        json!({"role": "user", "content": "which rank holds this conversation?"}),
    ]
}

/// One chat turn asking for the pick explanation; returns the worker and the explanation.
async fn debug_turn(r: &rankgate::app::Router, messages: &[Value]) -> (String, Value) {
    let body = json!({"model": "tiny-llama", "messages": messages, "max_tokens": 4});
    let req = post(r.addr, "/v1/chat/completions")
        .header("x-rankgate-debug", "1")
        .header("x-rankgate-admin-token", TOKEN)
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let reply = send(req).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    let picks: Vec<Value> = (reply.headers.get_all("x-rankgate-pick").iter())
        .map(|v| serde_json::from_slice(v.as_bytes()).expect("x-rankgate-pick is JSON"))
        .collect();
    assert_eq!(picks.len(), 1, "{picks:?}");
    (reply.worker(), picks[0].clone())
}

/// The candidate entry of `worker` in explanation `x`.
fn candidate<'a>(x: &'a Value, worker: &str) -> &'a Value {
    (x["candidates"].as_array().unwrap().iter())
        .find(|c| c["worker"] == worker)
        .unwrap_or_else(|| panic!("{worker} is no candidate: {x}"))
}

/// Serves the conversation once (on the less loaded rank), waits until the router's index of
/// that rank holds it from the engine's own events, and returns that rank and the other.
async fn hold_the_prompt(e: &SimEngine, r: &rankgate::app::Router) -> (String, String) {
    e.set_kv_usage(vec![0.3, 0.1]);
    let (a, b) = (format!("{}@0", e.url()), format!("{}@1", e.url()));
    wait_workers(r, WAIT, |rows| {
        rows[0]["kv_usage"] == 0.3 && rows[1]["kv_usage"] == 0.1
    })
    .await;
    let (holder, x) = debug_turn(r, &conversation()).await;
    assert_eq!(holder, b, "the least loaded rank: {x}");
    wait_workers(r, WAIT, |rows| {
        rows.iter().any(|w| {
            w["id"] == holder.as_str()
                && w["kv_index"]["state"] == "available"
                && w["kv_index"]["blocks"].as_u64() > Some(0)
        })
    })
    .await;
    (holder, a)
}

/// Sets the reported KV of the holder and of the other rank, and waits until the router sees it.
async fn set_kv(e: &SimEngine, r: &rankgate::app::Router, holder: f64, other: f64) {
    // The holder is rank 1 (see `hold_the_prompt`).
    e.set_kv_usage(vec![other, holder]);
    wait_workers(r, WAIT, |rows| {
        rows[0]["kv_usage"] == other && rows[1]["kv_usage"] == holder
    })
    .await;
}

#[tokio::test]
async fn affinity_picking_the_holder_says_so() {
    let e = engine_with_events().await;
    let r = exact_router(&e, 0.1, 0.85).await;
    let (holder, other) = hold_the_prompt(&e, &r).await;
    // The holder is busier, but within the margin of the best: affinity takes it.
    set_kv(&e, &r, 0.15, 0.1).await;
    let (worker, x) = debug_turn(&r, &conversation()).await;
    assert_eq!(worker, holder, "{x}");
    assert_eq!(x["by"], "affinity", "{x}");
    assert_eq!(x["picked"], holder.as_str(), "{x}");
    let won = candidate(&x, &holder);
    assert_eq!(won["rule"], "affinity", "{x}");
    assert_eq!(won["cached_by"], "events", "{x}");
    assert!(won["cached_tokens"].as_u64() > Some(0), "{x}");
    let why = won["why"].as_str().unwrap();
    assert!(
        why.contains("affinity_margin 0.1") && why.contains("affinity_max_kv 0.85"),
        "{why}"
    );
    let lost = candidate(&x, &other);
    assert_eq!(lost["rule"], "holds_less", "{x}");
    assert_eq!(x["affinity"]["margin"], 0.1, "{x}");
    assert!(
        (x["affinity"]["best"].as_f64().unwrap() - 0.1).abs() < 1e-9,
        "{x}"
    );
    r.shutdown().await;
}

#[tokio::test]
async fn a_holder_above_affinity_max_kv_loses_and_says_so() {
    let e = engine_with_events().await;
    // A margin wide enough that only the ceiling can rule the holder out.
    let r = exact_router(&e, 1.0, 0.85).await;
    let (holder, other) = hold_the_prompt(&e, &r).await;
    set_kv(&e, &r, 0.9, 0.1).await;
    let (worker, x) = debug_turn(&r, &conversation()).await;
    assert_eq!(worker, other, "{x}");
    assert_eq!(x["by"], "kv", "{x}");
    assert_eq!(candidate(&x, &other)["rule"], "least_load", "{x}");
    let lost = candidate(&x, &holder);
    assert_eq!(lost["rule"], "above_max_kv", "{x}");
    assert!(lost["cached_tokens"].as_u64() > Some(0), "{x}");
    let why = lost["why"].as_str().unwrap();
    assert!(
        why.contains("score 0.9 ") && why.contains("affinity_max_kv 0.85"),
        "{why}"
    );
    r.shutdown().await;
}

#[tokio::test]
async fn a_holder_outside_affinity_margin_loses_and_says_so() {
    let e = engine_with_events().await;
    let r = exact_router(&e, 0.1, 0.95).await;
    let (holder, other) = hold_the_prompt(&e, &r).await;
    set_kv(&e, &r, 0.5, 0.1).await;
    let (worker, x) = debug_turn(&r, &conversation()).await;
    assert_eq!(worker, other, "{x}");
    assert_eq!(x["by"], "kv", "{x}");
    let lost = candidate(&x, &holder);
    assert_eq!(lost["rule"], "outside_margin", "{x}");
    let why = lost["why"].as_str().unwrap();
    assert!(
        why.contains("score 0.5 ")
            && why.contains("affinity_margin 0.1")
            && why.contains("best 0.1"),
        "{why}"
    );
    assert!(
        (x["affinity"]["limit"].as_f64().unwrap() - 0.2).abs() < 1e-9,
        "{x}"
    );
    r.shutdown().await;
}

#[tokio::test]
async fn the_first_request_of_a_fresh_router_counts_its_prompt_tokens() {
    // No engine has published anything yet: no rank's index can be asked.
    let e = engine_with_events().await;
    let r = exact_router(&e, 0.1, 0.85).await;
    let rows = workers(&r).await;
    assert!(
        rows.iter().all(|w| w["kv_index"]["state"] != "available"),
        "{rows:?}"
    );
    let (_, x) = debug_turn(&r, &conversation()).await;
    let tokens = x["prompt_tokens"].as_u64();
    assert!(tokens > Some(100), "the prompt was tokenized: {x}");
    // Every candidate is judged by rankgate's record (no index yet), and says what decided it.
    for c in x["candidates"].as_array().unwrap() {
        assert_eq!(c["cached_by"], "record", "{x}");
        assert!(
            c["rule"].is_string() && c["why"].as_str().is_some_and(|w| !w.is_empty()),
            "{x}"
        );
    }
    r.shutdown().await;
}

#[tokio::test]
async fn every_rank_is_accounted_for_those_serving_another_model_last() {
    // Engine A serves model-a on ranks 0-1, engine B model-b on ranks 2-3.
    let a = engine(serving(&["model-a"], 2, 0)).await;
    let b = engine(serving(&["model-b"], 2, 2)).await;
    a.set_kv_usage(vec![0.7, 0.05]);
    b.set_kv_usage(vec![0.3, 0.6]);
    let engines = [
        engine_toml(&a.url(), "vllm", 2, 0),
        engine_toml(&b.url(), "vllm", 2, 2),
    ];
    let r = router_with(&token_env(), FAST, &engines).await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    wait_models(&r).await;
    let body = json!({"model": "model-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
    let req = post(r.addr, "/v1/chat/completions")
        .header("x-rankgate-debug", "1")
        .header("x-rankgate-admin-token", TOKEN)
        .body(http_body_util::Full::new(bytes::Bytes::from(
            body.to_string(),
        )))
        .unwrap();
    let reply = send(req).await;
    assert_eq!(reply.status, 200);
    let x: Value = serde_json::from_slice(reply.headers["x-rankgate-pick"].as_bytes()).unwrap();
    let (a0, a1) = (format!("{}@0", a.url()), format!("{}@1", a.url()));
    assert_eq!(x["picked"], a1.as_str(), "{x}");
    assert_eq!(candidate(&x, &a1)["rule"], "least_load", "{x}");
    let lost = candidate(&x, &a0);
    assert_eq!(lost["rule"], "higher_load", "{x}");
    assert!(lost["why"].as_str().unwrap().contains("score 0.7"), "{x}");
    // B's ranks are no candidates: listed, each with why, and counted.
    assert_eq!(x["not_serving"], 2, "{x}");
    let skipped = x["skipped"].as_array().unwrap();
    assert_eq!(skipped.len(), 2, "{x}");
    for s in skipped {
        assert!(s["worker"].as_str().unwrap().starts_with(&b.url()), "{x}");
        assert_eq!(s["rule"], "not_serving", "{x}");
        assert!(s["why"].as_str().unwrap().contains("model"), "{x}");
    }
    r.shutdown().await;
}
