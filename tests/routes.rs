//! Every route of the table reaches an engine of a flavor that serves it, pinned to the rank
//! rankgate chose: the simulated engine answers each on the rank the pin names (`x-sim-rank`),
//! which must be the rank in `x-rankgate-worker`.

mod common;

use bytes::Bytes;
use http_body_util::Full;
use rankgate_sim::sim::{SimConfig, SimFlavor};
use serde_json::json;

use common::*;

/// A body every JSON endpoint of the simulated engines accepts.
fn body() -> Bytes {
    Bytes::from(
        json!({
            "model": "tiny-llama",
            "messages": [{"role": "user", "content": "hi"}],
            "prompt": "hi", "input": "hi", "text": "hi",
            "query": "q", "documents": ["d"], "text_1": "a", "text_2": "b",
            "tokens": [1, 2], "max_tokens": 2, "sampling_params": {"max_new_tokens": 2},
        })
        .to_string(),
    )
}

fn form() -> (String, Bytes) {
    let b = "rgboundary";
    let body = format!(
        "--{b}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\nContent-Type: audio/wav\r\n\r\nRIFF....\r\n\
         --{b}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\ntiny-llama\r\n--{b}--\r\n"
    );
    (
        format!("multipart/form-data; boundary={b}"),
        Bytes::from(body),
    )
}

async fn each_route_is_pinned(flavor: SimFlavor, posts: &[&str], gets: &[&str]) {
    let e = engine(sim(flavor, 2, 0)).await;
    // Rank 1 is the least loaded: every pick goes there, and the engine must say so.
    e.set_kv_usage(vec![0.6, 0.1]);
    let r = router(FAST, &[engine_toml(&e.url(), flavor.as_str(), 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    for path in posts.iter().chain(gets) {
        let req = if gets.contains(path) {
            http::Request::get(format!("http://{}{path}", r.addr)).body(Full::new(Bytes::new()))
        } else if path.starts_with("/v1/audio/") {
            let (ct, b) = form();
            http::Request::post(format!("http://{}{path}", r.addr))
                .header("content-type", ct)
                .body(Full::new(b))
        } else {
            post(r.addr, path).body(Full::new(body()))
        };
        let reply = send(req.unwrap()).await;
        assert_eq!(
            reply.status,
            200,
            "{path}: {}",
            String::from_utf8_lossy(&reply.body)
        );
        let worker = reply.worker();
        assert!(worker.ends_with("@1"), "{path}: served by {worker}");
        let rank = reply
            .headers
            .get("x-sim-rank")
            .map(|v| v.to_str().unwrap().to_string());
        assert_eq!(
            rank.as_deref(),
            Some("1"),
            "{path}: the engine served another rank"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_vllm_route_reaches_the_chosen_rank() {
    each_route_is_pinned(
        SimFlavor::Vllm,
        &[
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/embeddings",
            "/v1/responses",
            "/v1/rerank",
            "/v1/score",
            "/classify",
            "/tokenize",
            "/detokenize",
            "/rerank",
            "/v2/rerank",
            "/score",
            "/pooling",
            "/v1/messages",
            "/v1/audio/transcriptions",
            "/v1/audio/translations",
        ],
        &[],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sglang_route_reaches_the_chosen_rank() {
    each_route_is_pinned(
        SimFlavor::Sglang,
        &[
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/embeddings",
            "/v1/responses",
            "/v1/rerank",
            "/v1/score",
            "/classify",
            "/tokenize",
            "/detokenize",
            "/generate",
            "/encode",
            "/v1/classify",
            "/v1/tokenize",
            "/v1/detokenize",
        ],
        &[],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglang_info_routes_are_answered_and_stored_responses_refused() {
    let e = engine(sim(SimFlavor::Sglang, 2, 0)).await;
    let r = router(FAST, &[engine_toml(&e.url(), "sglang", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    for path in ["/get_model_info", "/get_server_info", "/server_info"] {
        let reply = get(r.addr, path).await;
        assert_eq!(
            reply.status,
            200,
            "{path}: {}",
            String::from_utf8_lossy(&reply.body)
        );
    }
    assert_eq!(get(r.addr, "/server_info").await.json()["dp_size"], 2);
    let stored = get(r.addr, "/v1/responses/resp_123").await;
    assert_eq!(stored.status, 400);
    assert!(String::from_utf8_lossy(&stored.body).contains("store"));
    let follow_up = send(
        post(r.addr, "/v1/responses")
            .body(Full::new(Bytes::from(
                json!({"model": "tiny-llama", "input": "and then?", "previous_response_id": "resp_1"})
                    .to_string(),
            )))
            .unwrap(),
    )
    .await;
    assert_eq!(
        follow_up.status, 400,
        "a follow-up of a stored response is refused"
    );
    assert!(e.seen().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_goes_only_to_engines_of_a_flavor_that_serves_it() {
    let v = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    let s = engine(SimConfig {
        ..sim(SimFlavor::Sglang, 1, 1)
    })
    .await;
    let r = router(
        FAST,
        &[
            engine_toml(&v.url(), "vllm", 1, 0),
            engine_toml(&s.url(), "sglang", 1, 1),
        ],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    for _ in 0..10 {
        let reply = send(post(r.addr, "/generate").body(Full::new(body())).unwrap()).await;
        assert_eq!(reply.status, 200);
        assert!(reply.worker().starts_with(&s.url()), "{}", reply.worker());
        let reply = send(post(r.addr, "/pooling").body(Full::new(body())).unwrap()).await;
        assert_eq!(reply.status, 200);
        assert!(reply.worker().starts_with(&v.url()), "{}", reply.worker());
    }
    // A route no engine of this fleet serves, and one nobody serves.
    let only_sglang = engine(sim(SimFlavor::Vllm, 1, 0)).await;
    let r2 = router(FAST, &[engine_toml(&only_sglang.url(), "vllm", 1, 0)]).await;
    assert_eq!(get(r2.addr, "/get_server_info").await.status, 404);
    assert_eq!(get(r2.addr, "/flush_cache").await.status, 404);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extra_routes_are_proxied_to_every_engine() {
    let e = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let cfg = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\nextra_routes = [\"/v1/custom\"]\n{FAST}{}",
        engine_toml(&e.url(), "vllm", 2, 0)
    );
    let r = rankgate::app::Router::start(rankgate::config::Config::from_str(&cfg).unwrap())
        .await
        .unwrap();
    wait_state(&r, &[0, 1], "available").await;
    // The engine has no such path: its own 404 comes back through a pinned rank, where a path
    // rankgate does not route gets rankgate's 404 and reaches no engine.
    let reply = send(post(r.addr, "/v1/custom").body(Full::new(body())).unwrap()).await;
    assert_eq!(reply.status, 404);
    assert!(
        reply.worker().starts_with(&e.url()),
        "proxied: {:?}",
        reply.headers
    );
    let other = send(post(r.addr, "/v1/other").body(Full::new(body())).unwrap()).await;
    assert_eq!(other.status, 404);
    assert!(other.headers.get("x-rankgate-worker").is_none());
}
