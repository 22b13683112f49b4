//! Engine health probes and poll robustness over real sockets: an engine whose `/health` fails
//! while `/metrics` still answers takes no traffic until it recovers; a hung `/v1/models` or a
//! hung `/metrics` neither stops the polls nor holds up shutdown.
//!
//! The fake engine is a few lines of hyper written here, serving a captured vLLM `/metrics`
//! fixture, so each behaviour (a switchable `/health`, a hanging `/v1/models`) is explicit.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

const METRICS: &str = include_str!("fixtures/vllm-0.32-dp2-metrics.txt");
const CHAT: &str = include_str!("fixtures/vllm-0.32-chat.json");

/// What the fake engine does, switchable while it runs.
#[derive(Default)]
struct Behaviour {
    health_status: AtomicU16,
    hang_models: AtomicBool,
    hang_metrics: AtomicBool,
    metrics_polls: AtomicU64,
    models_asked: AtomicU64,
    chats: AtomicU64,
}

/// A vLLM-like engine with two DP ranks, numbered from `start_rank` in its `/metrics`.
struct FakeEngine {
    url: String,
    b: Arc<Behaviour>,
    accept: JoinHandle<()>,
}

impl Drop for FakeEngine {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn answer(
    req: Request<Incoming>,
    b: Arc<Behaviour>,
    metrics: Arc<str>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let ok = |body: String| Ok(Response::new(Full::new(Bytes::from(body))));
    match req.uri().path() {
        "/health" => {
            let status = StatusCode::from_u16(b.health_status.load(Relaxed))
                .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let mut resp = Response::new(Full::new(Bytes::new()));
            *resp.status_mut() = status;
            Ok(resp)
        }
        "/metrics" => {
            b.metrics_polls.fetch_add(1, Relaxed);
            if b.hang_metrics.load(Relaxed) {
                std::future::pending::<()>().await;
            }
            ok(metrics.to_string())
        }
        "/v1/models" => {
            b.models_asked.fetch_add(1, Relaxed);
            if b.hang_models.load(Relaxed) {
                std::future::pending::<()>().await;
            }
            ok(r#"{"object":"list","data":[{"id":"tiny-llama","object":"model"}]}"#.into())
        }
        "/v1/chat/completions" => {
            b.chats.fetch_add(1, Relaxed);
            let mut resp = Response::new(Full::new(Bytes::from_static(CHAT.as_bytes())));
            resp.headers_mut()
                .insert("content-type", "application/json".parse().unwrap());
            Ok(resp)
        }
        _ => {
            let mut resp = Response::new(Full::new(Bytes::new()));
            *resp.status_mut() = StatusCode::NOT_FOUND;
            Ok(resp)
        }
    }
}

async fn fake_engine(start_rank: u32) -> FakeEngine {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    // The fixture labels its ranks "0" and "1"; a node owning ranks 2..3 labels them globally.
    let metrics: Arc<str> = METRICS
        .replace("engine=\"1\"", &format!("engine=\"{}\"", start_rank + 1))
        .replace("engine=\"0\"", &format!("engine=\"{start_rank}\""))
        .into();
    let b = Arc::new(Behaviour {
        health_status: AtomicU16::new(200),
        ..Behaviour::default()
    });
    let shared = b.clone();
    let accept = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (b, metrics) = (shared.clone(), metrics.clone());
            let svc =
                hyper::service::service_fn(move |req| answer(req, b.clone(), metrics.clone()));
            tokio::spawn(
                hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc),
            );
        }
    });
    FakeEngine { url, b, accept }
}

/// Waits (bounded) until `pred` holds on the fake engine's counters.
async fn wait_for(what: &str, pred: impl Fn() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while !pred() {
        assert!(tokio::time::Instant::now() < deadline, "never saw: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn reason(row: &Value) -> &str {
    row["reason"].as_str().unwrap_or("")
}

#[tokio::test]
async fn failing_health_takes_an_engine_out_until_it_recovers() {
    let a = fake_engine(0).await;
    let b = fake_engine(2).await;
    let r = router(
        FAST,
        &[
            engine_toml(&a.url, "vllm", 2, 0),
            engine_toml(&b.url, "vllm", 2, 2),
        ],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;

    a.b.health_status.store(503, Relaxed);
    let rows = wait_workers(&r, Duration::from_secs(10), |rows| {
        rows[..2].iter().all(|w| reason(w).starts_with("health:"))
    })
    .await;
    for row in &rows[..2] {
        assert_eq!(reason(row), "health: HTTP 503 Service Unavailable", "{row}");
        assert_eq!(row["telemetry"], "unavailable");
        assert_eq!(row["reason_kind"], "health");
        // It answered (503): reachable, as `check --probe` says, but unhealthy, so no traffic.
        assert_eq!(row["reachable"], true, "{row}");
        assert_eq!(row["health"], "unhealthy", "{row}");
        assert!(row["kv_usage"].is_null(), "{row}");
    }
    assert!(rows[2..].iter().all(|w| w["telemetry"] == "available"));
    // Its /metrics still answers: the verdict comes from /health alone.
    let scraped = a.b.metrics_polls.load(Relaxed);
    wait_for("another /metrics poll of the unhealthy engine", || {
        a.b.metrics_polls.load(Relaxed) > scraped + 2
    })
    .await;
    assert_eq!(workers(&r).await[0]["telemetry"], "unavailable");

    for _ in 0..8 {
        let reply = chat(r.addr, 1).await;
        assert_eq!(reply.status, 200);
        assert!(reply.worker().starts_with(&b.url), "{}", reply.worker());
    }
    assert_eq!(a.b.chats.load(Relaxed), 0);

    a.b.health_status.store(200, Relaxed);
    let rows = wait_state(&r, &[0, 1], "available").await;
    assert_eq!(rows[0]["reachable"], true);
    assert_eq!(rows[0]["health"], "ok");
    assert!(rows[0]["reason"].is_null(), "{}", rows[0]);
}

#[tokio::test]
async fn hung_models_endpoint_does_not_stop_polls_or_shutdown() {
    let a = fake_engine(0).await;
    a.b.hang_models.store(true, Relaxed);
    let cfg = "[telemetry]\ninterval = \"50ms\"\nstale_after = \"1s\"\ntimeout = \"300ms\"\n";
    let r = router(cfg, &[engine_toml(&a.url, "vllm", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    wait_for("a /v1/models request", || {
        a.b.models_asked.load(Relaxed) > 0
    })
    .await;

    // Polls go on at the interval while /v1/models hangs: well past stale_after, the ranks
    // still have fresh numbers.
    let scraped = a.b.metrics_polls.load(Relaxed);
    wait_for("30 more /metrics polls", || {
        a.b.metrics_polls.load(Relaxed) >= scraped + 30
    })
    .await;
    let rows = workers(&r).await;
    for row in &rows {
        assert_eq!(row["telemetry"], "available", "{row}");
        assert!(row["age_ms"].as_u64().is_some_and(|a| a < 1000), "{row}");
    }

    tokio::time::timeout(Duration::from_secs(5), r.shutdown())
        .await
        .expect("shutdown finishes while /v1/models hangs");
}

#[tokio::test]
async fn shutdown_does_not_wait_for_a_stuck_poll() {
    let a = fake_engine(0).await;
    // A poll may take up to 20 s: shutdown must not wait for it.
    let cfg = "[telemetry]\ninterval = \"50ms\"\nstale_after = \"20s\"\ntimeout = \"20s\"\n";
    let r = router(cfg, &[engine_toml(&a.url, "vllm", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    a.b.hang_metrics.store(true, Relaxed);
    let scraped = a.b.metrics_polls.load(Relaxed);
    wait_for("a /metrics poll that hangs", || {
        a.b.metrics_polls.load(Relaxed) > scraped
    })
    .await;
    tokio::time::timeout(Duration::from_secs(5), r.shutdown())
        .await
        .expect("shutdown finishes in the middle of a hung poll");
}
