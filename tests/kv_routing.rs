//! Exact prefix-cache routing end to end over real sockets: a simulated vLLM engine publishing
//! its KV-cache events (ZeroMQ, vLLM's framing) and tokenizing with the tiny model's real
//! tokenizer; rankgate routers subscribed to it (`routing.kv_events`, the same tokenizer in
//! `[[models]]`). Two replicas that share nothing send a conversation's turns, taken in turn,
//! to the rank its engine says holds it; a restart empties the engine's caches and the index
//! follows.

mod common;

use std::time::Duration;

use common::chat::{predicted, turn};
use common::*;
use rankgate_sim::sim::kv::KvEventsConfig;
use rankgate_sim::sim::{model, SimConfig, SimEngine, SimFlavor};
use serde_json::json;

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

async fn exact_router(e: &SimEngine) -> rankgate::app::Router {
    let dir = model::tiny_model_dir().unwrap();
    let extra = format!(
        "{FAST}[routing]\nprefix_affinity = true\nkv_events = true\n\
         [[models]]\nname = \"tiny-llama\"\ntokenizer = {:?}\n",
        dir.display().to_string()
    );
    let r = router(&extra, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    r
}

#[tokio::test]
async fn replicas_sharing_nothing_follow_the_engines_own_cache() {
    let e = engine_with_events().await;
    let (a, b) = (exact_router(&e).await, exact_router(&e).await);
    let mut messages = vec![
        json!({"role": "system", "content": "You answer questions about inference routers. ".repeat(40)}),
    ];
    let mut workers = Vec::new();
    for t in 0..8 {
        messages.push(
            json!({"role": "user", "content": format!("question {t}: what about rank {t}?")}),
        );
        // The turns alternate between the replicas, as a plain L4 balancer spreads them.
        let r = if t % 2 == 0 { &a } else { &b };
        let (worker, answer) = turn(r, &messages, 4).await;
        messages.push(json!({"role": "assistant", "content": answer}));
        workers.push(worker);
        if t == 0 {
            // Both replicas' indexes learn the first turn's blocks from the engine itself (a
            // rank that has published nothing yet stays unavailable: rankgate cannot know what
            // it held before it subscribed).
            for r in [&a, &b] {
                wait_workers(r, WAIT, |rows| {
                    rows.iter().any(|w| {
                        w["id"] == workers[0].as_str()
                            && w["kv_index"]["state"] == "available"
                            && w["kv_index"]["blocks"].as_u64() > Some(0)
                    })
                })
                .await;
            }
        }
    }
    // Every turn after the first went where the engine holds the conversation, whichever
    // replica routed it (replica b never saw turn 0: only the events told it).
    assert!(workers[1..].iter().all(|w| *w == workers[0]), "{workers:?}");
    assert!(
        predicted(&b, "events").await > 0.0,
        "b's picks were made on the engine's word"
    );
    assert_eq!(predicted(&b, "record").await, 0.0);

    // The engine restarts: its caches are empty, its events start again at 0 with
    // AllBlocksCleared; the indexes follow (exact, holding nothing).
    e.restart();
    for r in [&a, &b] {
        wait_workers(r, WAIT, |rows| {
            rows.iter().all(|w| w["kv_index"]["blocks"] == 0)
                && rows.iter().any(|w| {
                    w["id"] == workers[0].as_str()
                        && w["kv_index"]["state"] == "available"
                        && w["kv_index"]["resets"].as_u64() >= Some(1)
                })
        })
        .await;
    }
    a.shutdown().await;
    b.shutdown().await;
}

#[tokio::test]
async fn without_a_publisher_a_rank_falls_back_to_the_record_and_says_why() {
    // Events on in the router, but this engine publishes none (no /kv_event_sources).
    let e = engine(SimConfig {
        kv_usage: vec![0.1, 0.1],
        ..sim(SimFlavor::Vllm, 2, 0)
    })
    .await;
    let r = exact_router(&e).await;
    let rows = wait_workers(&r, WAIT, |rows| {
        rows.iter().all(|w| {
            w["kv_index"]["reason"]
                .as_str()
                .is_some_and(|s| s.contains("/kv_event_sources"))
        })
    })
    .await;
    // No /kv_event_sources (an engine started without --kv-events-config): none will come.
    assert_eq!(rows[0]["kv_index"]["state"], "off");
    let messages = vec![json!({"role": "user", "content": "hello ".repeat(200)})];
    let (first, _) = turn(&r, &messages, 4).await;
    let (second, _) = turn(&r, &messages, 4).await;
    assert_eq!(
        first, second,
        "rankgate's record still keeps the prompt where it went"
    );
    assert!(predicted(&r, "record").await > 0.0);
    r.shutdown().await;
}
