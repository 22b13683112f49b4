//! The simulated engine's prefix cache over real sockets: a later turn of a conversation finds
//! its earlier turns' blocks on the rank that served them, `/metrics` counts queries and hits with
//! vLLM's names, and the gRPC `Generate` path shares the same cache.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use common::{engine, get, post, send, sim};
use http_body_util::Full;
use rankgate_sim::sim::{SimConfig, SimFlavor};
use serde_json::{json, Value};

fn caching(flavor: SimFlavor) -> SimConfig {
    SimConfig {
        prefix_caching: true,
        ..sim(flavor, 2, 0)
    }
}

/// A chat request pinned to `rank` (vLLM's header).
async fn chat_on(addr: std::net::SocketAddr, messages: &Value, rank: u32) -> Value {
    let body = json!({"model": "tiny-llama", "messages": messages, "max_tokens": 2});
    let r = send(
        post(addr, "/v1/chat/completions")
            .header("x-data-parallel-rank", rank.to_string())
            .body(Full::new(body.to_string().into()))
            .unwrap(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    r.json()
}

/// `name{engine="rank",...} value` from a scrape.
fn counter(metrics: &str, name: &str, rank: u32) -> f64 {
    let prefix = format!("{name}{{engine=\"{rank}\",model_name=\"tiny-llama\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no {prefix} in\n{metrics}"))
        .parse()
        .unwrap()
}

#[tokio::test]
async fn a_later_turn_hits_the_blocks_of_the_earlier_one_on_its_rank() {
    let e = engine(caching(SimFlavor::Vllm)).await;
    let system = "You are a careful assistant. ".repeat(40);
    let turn1 = json!([{"role": "system", "content": system},
        {"role": "user", "content": "first question"}]);
    chat_on(e.addr, &turn1, 0).await;
    let mut turn2 = turn1.clone();
    let history = turn2.as_array_mut().unwrap();
    history.push(json!({"role": "assistant", "content": "first answer"}));
    history.push(json!({"role": "user", "content": "second question"}));
    // The same conversation on the other rank finds nothing; back on rank 0 it hits.
    chat_on(e.addr, &turn2, 1).await;
    chat_on(e.addr, &turn2, 0).await;

    let metrics = String::from_utf8(get(e.addr, "/metrics").await.body.to_vec()).unwrap();
    assert!(metrics.contains("# TYPE vllm:prefix_cache_queries_total counter"));
    let tokens = |m: &Value| (m.to_string().len() / 4) as f64;
    let q0 = counter(&metrics, "vllm:prefix_cache_queries_total", 0);
    let h0 = counter(&metrics, "vllm:prefix_cache_hits_total", 0);
    let h1 = counter(&metrics, "vllm:prefix_cache_hits_total", 1);
    assert_eq!(q0, tokens(&turn1) + tokens(&turn2));
    assert_eq!(h1, 0.0, "rank 1 never saw the conversation");
    // Every full block of turn 1's prompt except the one its closing bracket falls in.
    let shared_blocks = ((turn1.to_string().len() - 1) / 64) as f64;
    assert!(
        h0 >= (shared_blocks - 1.0) * 16.0 && h0 <= shared_blocks * 16.0,
        "hits {h0}, turn 1 has {shared_blocks} shared full blocks"
    );
    assert_eq!(e.prefix_cache()[0], (q0 as u64, h0 as u64));
    assert_eq!(
        e.kv_usage(),
        [0.0, 0.0],
        "finished requests' blocks are idle, not used"
    );
}

#[tokio::test]
async fn without_prefix_caching_nothing_is_reported() {
    let e = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    let m = json!([{"role": "user", "content": "x".repeat(400)}]);
    chat_on(e.addr, &m, 0).await;
    chat_on(e.addr, &m, 0).await;
    let metrics = String::from_utf8(get(e.addr, "/metrics").await.body.to_vec()).unwrap();
    assert!(!metrics.contains("prefix_cache"), "{metrics}");
    assert_eq!(e.prefix_cache(), [(0, 0)]);
}

#[tokio::test]
async fn grpc_generate_shares_the_cache() {
    use rankgate::proto::vllm;
    let e = engine(caching(SimFlavor::Vllm)).await;
    let addr = e.start_grpc(common::loopback()).await.unwrap();
    let origin: http::Uri = format!("http://{addr}").parse().unwrap();
    let transport = rankgate::telemetry::grpc::transport(std::time::Duration::from_secs(2));
    let mut client = vllm::vllm_engine_client::VllmEngineClient::with_origin(transport, origin);
    for n in 0..2 {
        let mut req = common::grpc::vllm_generate(&format!("r{n}"), Some(1), 1);
        req.input = Some(vllm::generate_request::Input::Tokenized(
            vllm::TokenizedInput {
                original_text: String::new(),
                input_ids: (0..100).collect(),
            },
        ));
        let mut s = common::grpc::bounded(client.generate(req))
            .await
            .unwrap()
            .into_inner();
        // Bounded: one token, then the end of the stream.
        for _ in 0..4 {
            if common::grpc::bounded(s.message()).await.unwrap().is_none() {
                break;
            }
        }
    }
    // 100 tokens: 6 full blocks, all cached the second time.
    assert_eq!(e.prefix_cache(), [(0, 0), (200, 96)]);
}

#[tokio::test]
async fn the_answer_is_cached_for_the_next_turn_that_repeats_it() {
    let e = engine(caching(SimFlavor::Vllm)).await;
    let turn1 = json!([{"role": "user", "content": "q ".repeat(100)}]);
    let body = json!({"model": "tiny-llama", "messages": turn1, "max_tokens": 40});
    let r = send(
        post(e.addr, "/v1/chat/completions")
            .header("x-data-parallel-rank", "0")
            .body(Full::new(body.to_string().into()))
            .unwrap(),
    )
    .await;
    let answer = r.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let mut turn2 = turn1.clone();
    let history = turn2.as_array_mut().unwrap();
    history.push(json!({"role": "assistant", "content": answer}));
    history.push(json!({"role": "user", "content": "next"}));
    chat_on(e.addr, &turn2, 0).await;
    let (queries, hits) = e.prefix_cache()[0];
    let turn2_tokens = (turn2.to_string().len() / 4) as u64;
    // Everything but the last block or two (the new user message) was cached: the first turn's
    // prompt and the answer it got.
    assert!(
        hits >= turn2_tokens - 32,
        "{hits} of turn 2's {turn2_tokens} tokens cached ({queries} queried)"
    );
}
