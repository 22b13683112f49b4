//! Shared helpers for the integration tests (tests/): simulated engines and routers on
//! 127.0.0.1:0, a small HTTP client, gRPC clients, recorded vLLM answers, and bounded waits on
//! observable state. A crate of its own, built once for every test target (as a `mod common` of
//! each target it was compiled again some fifty times); tests/common adds what only a target of
//! the binary's package can have (the `rankgate` binary's path).

pub mod admin;
pub mod chat;
pub mod grpc;
pub mod headers;
pub mod recorded;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate::config::Config;
use rankgate_sim::sim::{SimConfig, SimEngine};
use serde_json::Value;

pub fn loopback() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

pub async fn engine(cfg: SimConfig) -> SimEngine {
    SimEngine::start(loopback(), cfg)
        .await
        .expect("start simulated engine")
}

/// Telemetry polled every 50 ms, fresh for 2 s: tests see changes quickly.
pub const FAST: &str = "[telemetry]\ninterval = \"50ms\"\nstale_after = \"2s\"\n";

/// One simulated engine behind a router that polls it with [`FAST`] telemetry.
pub async fn fleet(cfg: SimConfig) -> (SimEngine, Router) {
    let (flavor, dp_size, start_rank) = (cfg.flavor, cfg.dp_size, cfg.start_rank);
    let e = engine(cfg).await;
    let r = router(
        FAST,
        &[engine_toml(&e.url(), flavor.as_str(), dp_size, start_rank)],
    )
    .await;
    (e, r)
}

/// One `[[engines]]` table.
pub fn engine_toml(url: &str, flavor: &str, dp_size: u32, start_rank: u32) -> String {
    format!("[[engines]]\nurl = \"{url}\"\nflavor = \"{flavor}\"\ndp_size = {dp_size}\nstart_rank = {start_rank}\n")
}

/// A router on ephemeral ports with the given extra config (routing/telemetry tables) and engines.
pub async fn router(extra: &str, engines: &[String]) -> Router {
    router_with("", extra, engines).await
}

/// [`router`] with more `[server]` keys (`server`, one per line). The tests read which rank
/// served from `x-rankgate-worker`, so the router names it (`expose_worker = "url"`) unless
/// `server` sets `expose_worker` itself.
pub async fn router_with(server: &str, extra: &str, engines: &[String]) -> Router {
    let expose = match server.contains("expose_worker") {
        true => "",
        false => "expose_worker = \"url\"\n",
    };
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{expose}{server}\n{extra}\n{}",
        engines.concat()
    );
    let cfg = Config::from_str(&text).unwrap_or_else(|e| panic!("config: {e}\n{text}"));
    Router::start(cfg).await.expect("start router")
}

/// Polls `check` every 10 ms until it holds, at most `limit`.
pub async fn until(what: &str, limit: Duration, check: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + limit;
    while !check() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {limit:?}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The OpenAI error shape: `{"error": {"message", "type", "code"}}` with `code` the status, a
/// message, and `type` the given `kind` (any string when `None`). Returns the parsed body.
pub fn assert_openai_error(body: &[u8], status: u16, kind: Option<&str>) -> Value {
    let v: Value = serde_json::from_slice(body)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(body)));
    assert_eq!(v["error"]["code"], status, "{v}");
    match kind {
        Some(kind) => assert_eq!(v["error"]["type"], kind, "{v}"),
        None => assert!(v["error"]["type"].is_string(), "{v}"),
    }
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    v
}

pub fn client() -> rankgate::http::HttpClient<Full<Bytes>> {
    rankgate::http::client(Duration::from_secs(2))
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    /// Asserts the reply is `status` with an OpenAI-shaped error body
    /// ([`assert_openai_error`]); returns the body.
    pub fn assert_openai_error(&self, status: u16, kind: Option<&str>) -> Value {
        assert_eq!(
            self.status,
            status,
            "{}",
            String::from_utf8_lossy(&self.body)
        );
        assert_openai_error(&self.body, status, kind)
    }

    pub fn worker(&self) -> String {
        self.headers
            .get("x-rankgate-worker")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_string()
    }
}

pub async fn send(req: Request<Full<Bytes>>) -> Reply {
    let resp = client().request(req).await.expect("request");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    let req = Request::get(format!("http://{addr}{path}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    send(req).await
}

pub fn chat_body(max_tokens: u64, stream: bool) -> String {
    serde_json::json!({
        "model": "tiny-llama",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": max_tokens,
        "stream": stream,
    })
    .to_string()
}

pub fn post(addr: SocketAddr, path: &str) -> http::request::Builder {
    Request::builder()
        .method(Method::POST)
        .uri(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
}

/// POSTs `body` as JSON to `path` and returns the reply.
pub async fn post_json(addr: SocketAddr, path: &str, body: Value) -> Reply {
    send(
        post(addr, path)
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap(),
    )
    .await
}

/// POSTs a chat completion and returns the reply.
pub async fn chat(addr: SocketAddr, max_tokens: u64) -> Reply {
    let body = chat_body(max_tokens, false);
    send(
        post(addr, "/v1/chat/completions")
            .body(Full::new(Bytes::from(body)))
            .unwrap(),
    )
    .await
}

/// Opens a streaming chat completion and returns the response once its headers arrive.
pub async fn stream_chat(
    addr: SocketAddr,
    max_tokens: u64,
) -> http::Response<hyper::body::Incoming> {
    let body = Full::new(Bytes::from(chat_body(max_tokens, true)));
    client()
        .request(post(addr, "/v1/chat/completions").body(body).unwrap())
        .await
        .expect("streaming request")
}

/// `/workers` from the admin listener.
pub async fn workers(router: &Router) -> Vec<Value> {
    match get(router.admin_addr, "/workers").await.json() {
        Value::Array(v) => v,
        other => panic!("/workers is not an array: {other}"),
    }
}

/// Polls `/workers` until `pred` holds, at most `limit`; panics with the last rows otherwise.
/// Each check is a real request, and the loop is bounded in time.
pub async fn wait_workers(
    router: &Router,
    limit: Duration,
    pred: impl Fn(&[Value]) -> bool,
) -> Vec<Value> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        let rows = workers(router).await;
        if pred(&rows) {
            return rows;
        }
        if tokio::time::Instant::now() > deadline {
            panic!(
                "condition not met within {limit:?}; /workers = {}",
                serde_json::to_string_pretty(&rows).unwrap()
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until every listed worker index reports telemetry `state` ("available"/"unavailable").
pub async fn wait_state(router: &Router, idx: &[usize], state: &str) -> Vec<Value> {
    wait_workers(router, Duration::from_secs(10), |rows| {
        idx.iter().all(|&i| rows[i]["telemetry"] == state)
    })
    .await
}

/// Waits until every worker's engine has told its model list.
pub async fn wait_models(router: &Router) -> Vec<Value> {
    wait_workers(router, Duration::from_secs(10), |rows| {
        rows.iter()
            .all(|w| w["models"].as_array().is_some_and(|m| !m.is_empty()))
    })
    .await
}

pub fn serving(models: &[&str], dp_size: u32, start_rank: u32) -> SimConfig {
    SimConfig {
        models: models.iter().map(|m| m.to_string()).collect(),
        ..sim(rankgate_sim::sim::SimFlavor::Vllm, dp_size, start_rank)
    }
}

/// Engine A serves model-a on ranks 0-1, engine B model-b on ranks 2-3. A's rank 1 is the least
/// loaded rank of the whole fleet.
pub async fn two_models() -> (SimEngine, SimEngine, Router) {
    let a = engine(serving(&["model-a"], 2, 0)).await;
    let b = engine(serving(&["model-b"], 2, 2)).await;
    a.set_kv_usage(vec![0.7, 0.05]);
    b.set_kv_usage(vec![0.3, 0.6]);
    let r = router(
        FAST,
        &[
            engine_toml(&a.url(), "vllm", 2, 0),
            engine_toml(&b.url(), "vllm", 2, 2),
        ],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    wait_models(&r).await;
    (a, b, r)
}

pub fn sim(flavor: rankgate_sim::sim::SimFlavor, dp_size: u32, start_rank: u32) -> SimConfig {
    SimConfig {
        flavor,
        dp_size,
        start_rank,
        ..SimConfig::default()
    }
}

/// An "engine" that accepts connections on 127.0.0.1:0 and never answers (they are held open,
/// never read): its URL, and the task to abort when done.
pub async fn mute_engine() -> (String, tokio::task::JoinHandle<()>) {
    let mute = tokio::net::TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}", mute.local_addr().unwrap());
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((tcp, _)) = mute.accept().await {
            open.push(tcp);
        }
    });
    (url, held)
}

/// Two simulated engines on one port, at 127.0.0.2 and 127.0.0.3 (all of 127/8 is loopback), as
/// the pods behind one Service share their port: for discovery, which knows one port per entry.
pub async fn engines_on_one_port() -> (SimEngine, SimEngine, u16) {
    for _ in 0..20 {
        let a = SimEngine::start(([127, 0, 0, 2], 0).into(), SimConfig::default())
            .await
            .expect("start simulated engine");
        let port: u16 = a.url().rsplit(':').next().unwrap().parse().unwrap();
        // The same port on the other address may be taken: then try another pair.
        if let Ok(b) = SimEngine::start(([127, 0, 0, 3], port).into(), SimConfig::default()).await {
            return (a, b, port);
        }
    }
    panic!("no port free on both 127.0.0.2 and 127.0.0.3");
}

/// The ids of the workers with telemetry available, once `want` holds of them (at most 10 s).
pub async fn wait_available(router: &Router, want: impl Fn(&[String]) -> bool) -> Vec<String> {
    let available = |rows: &[Value]| -> Vec<String> {
        rows.iter()
            .filter(|r| r["telemetry"] == "available")
            .map(|r| r["id"].as_str().unwrap_or("").to_string())
            .collect()
    };
    let rows = wait_workers(router, Duration::from_secs(10), |rows| {
        want(&available(rows))
    })
    .await;
    available(&rows)
}
