//! `rankgate mock-engine`'s defaults are a real deployment (a 7-8B model on one 80 GB GPU under
//! vLLM, `rankgate_sim::sim::deployment`), end to end over real sockets: the engine the command
//! builds with no capacity flags and KV events on, two DP ranks, behind a router with exact
//! prefix-cache routing whose `[[models]]` points at the tokenizer files the repository ships
//! (`configs/tokenizers/tiny-llama`). A 1k-token conversation on that idle fleet is a sliver of
//! a rank, so every turn stays where the engine holds it. (With `--capacity-tokens 4096`, the
//! tests' small ranks, the same chat is a quarter of a rank and load moves turns off it: this
//! test fails then, in every run tried.)
//!
//! Its ranks are also fresh, as a real vLLM's with DP: no load gauges for a rank before its first
//! request (counters at 0 from the start). A fresh DP=8 server behind the router takes a burst
//! on every rank, and a restart makes its ranks fresh again.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use common::chat::{predicted, turn};
use common::*;
use rankgate::tokenize::ChatTokenizer;
use rankgate_sim::sim::kv::KvEventsConfig;
use rankgate_sim::sim::{cli, deployment, model, SimEngine};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(10);
const TURNS: usize = 8;

/// The shipped tokenizer directory, as a user's `[[models]]` names it.
fn shipped_tokenizer() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(model::SHIPPED_DIR)
}

/// `rankgate mock-engine --listen 127.0.0.1:0 --flavor vllm --dp-size 2 --kv-events-config ...`:
/// the command's own defaults for everything else.
async fn default_engine() -> SimEngine {
    let (mut cfg, listen, grpc) = cli::parse([
        "--listen",
        "127.0.0.1:0",
        "--flavor",
        "vllm",
        "--dp-size",
        "2",
        "--kv-events-config",
        r#"{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0", "topic": "kv"}"#,
    ])
    .expect("mock-engine's flags");
    assert!(grpc.is_none());
    assert_eq!(cfg.capacity_tokens, deployment::CAPACITY_TOKENS);
    assert!(
        cfg.prefix_caching && cfg.tokenizer.is_some(),
        "events bring both"
    );
    // `tcp://*:0` binds every interface; tests bind loopback only. The endpoint is the only
    // thing taken from elsewhere: each rank still gets a free port, topic "kv".
    let events = cfg.kv_events.as_mut().expect("events on");
    assert_eq!(events.topic, "kv");
    events.endpoint = KvEventsConfig::bind_local().endpoint;
    SimEngine::start(listen, cfg)
        .await
        .expect("start mock-engine's engine")
}

#[tokio::test]
async fn a_1k_token_conversation_on_an_idle_default_fleet_stays_on_its_rank() {
    let e = default_engine().await;
    let extra = format!(
        "{FAST}[routing]\nprefix_affinity = true\nkv_events = true\n\
         [[models]]\nname = \"tiny-llama\"\ntokenizer = {:?}\n",
        shipped_tokenizer().display().to_string()
    );
    let r = router(&extra, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    // Fresh (no gauges before their first request), and routed: the first turn goes to either,
    // the rest follow it though the other stays untried.
    wait_state(&r, &[0, 1], "fresh").await;

    let tokenizer = ChatTokenizer::from_dir(&shipped_tokenizer()).expect("shipped tokenizer");
    let mut messages = vec![json!({
        "role": "system",
        "content": "You answer questions about routing inference requests across data-parallel ranks. "
            .repeat(30),
    })];
    let mut workers = Vec::new();
    for t in 0..TURNS {
        messages.push(json!({"role": "user", "content": format!("Turn {t}: and what then?")}));
        if t == 0 {
            let body = json!({"model": "tiny-llama", "messages": messages});
            let ids = tokenizer
                .chat(&serde_json::to_vec(&body).unwrap())
                .expect("tokenize the first turn")
                .ids;
            assert!(
                (1000..1500).contains(&ids.len()),
                "the first turn is a 1k-token prompt: {} tokens",
                ids.len()
            );
        }
        let (worker, answer) = turn(&r, &messages, 32).await;
        messages.push(json!({"role": "assistant", "content": answer}));
        workers.push(worker);
        if t == 0 {
            // The router's index learns the first turn's blocks from the engine's own events.
            wait_workers(&r, WAIT, |rows| {
                rows.iter().any(|w| {
                    w["id"] == workers[0].as_str()
                        && w["kv_index"]["state"] == "available"
                        && w["kv_index"]["blocks"].as_u64() > Some(0)
                })
            })
            .await;
        }
    }
    assert!(workers.iter().all(|w| *w == workers[0]), "{workers:?}");
    assert!(
        predicted(&r, "events").await > 0.0,
        "the turns were placed on the engine's word (its KV events)"
    );
    r.shutdown().await;
    e.shutdown().await;
}

/// `rankgate mock-engine --flavor vllm --dp-size 8` with the tests' small, slow ranks: its
/// defaults otherwise, fresh ranks included.
async fn fresh_engine(dp_size: u32) -> SimEngine {
    let dp = dp_size.to_string();
    let args = [
        "--listen",
        "127.0.0.1:0",
        "--flavor",
        "vllm",
        "--dp-size",
        &dp,
    ];
    let (cfg, listen, _) =
        cli::parse(args.into_iter().chain(["--decode-rate", "100"])).expect("mock-engine's flags");
    assert!(cfg.gauges_after_first_request, "on by default for vLLM");
    SimEngine::start(listen, cfg)
        .await
        .expect("start mock-engine")
}

#[tokio::test]
async fn a_fresh_dp8_server_spreads_a_burst_over_every_rank_and_is_fresh_again_after_a_restart() {
    let e = fresh_engine(8).await;
    let r = router(FAST, &[engine_toml(&e.url(), "vllm", 8, 0)]).await;
    let all: Vec<usize> = (0..8).collect();
    let rows = wait_state(&r, &all, "fresh").await;
    assert!(
        rows.iter()
            .all(|w| w["fresh"] == "idle" && w["kv_usage"].is_null()),
        "{rows:?}"
    );
    // Nothing was sent to it: the engine's /metrics names each rank by its counters alone.
    let addr = r.addr;
    let burst: Vec<_> = (0..64).map(|_| tokio::spawn(chat(addr, 16))).collect();
    for reply in burst {
        assert_eq!(reply.await.expect("request task").status, 200);
    }
    let served = e.served();
    assert!(
        served.iter().all(|&n| n >= 4),
        "64 requests over 8 fresh ranks: {served:?}"
    );
    // Each rank served: its gauges appeared, and its numbers replace the fresh state.
    wait_state(&r, &all, "available").await;
    e.restart();
    wait_state(&r, &all, "fresh").await;
    r.shutdown().await;
    e.shutdown().await;
}
