//! The access log (`server.access_log = true`): one line per request, at info under the target
//! `rankgate::access`, with method, path, model, worker, status, bytes, duration, time to first
//! byte, request id and attempts; captured here as the JSON lines `--log-format json` writes.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use rankgate_sim::sim::SimConfig;
use serde_json::Value;

/// Every line the process logged, JSON, from the first call on.
fn captured() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOG: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Arc::new(Mutex::new(Vec::new()));
        let sink = log.clone();
        let subscriber = tracing_subscriber::fmt()
            .json()
            .flatten_event(true)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || Sink(sink.clone()))
            .finish();
        tracing::subscriber::set_global_default(subscriber)
            .expect("one subscriber per test binary");
        log
    })
}

struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The access lines logged so far.
fn access_lines() -> Vec<Value> {
    let log = captured().lock().unwrap();
    String::from_utf8_lossy(&log)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["target"] == "rankgate::access")
        .collect()
}

/// The access line of request `id`, once its body has ended (at most 5 s).
async fn line_of(id: &str) -> Value {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        if let Some(l) = access_lines().into_iter().find(|l| l["request_id"] == id) {
            return l;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no access line for {id}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

fn with_id(req: http::request::Builder, id: &str) -> http::request::Builder {
    req.header("x-request-id", id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_line_per_request_with_its_fields() {
    captured();
    let a = engine(SimConfig::default()).await;
    let b = engine(sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 2)).await;
    a.set_kv_usage(vec![0.0, 0.0]);
    b.set_kv_usage(vec![0.5, 0.5]);
    let r = router(
        &format!("access_log = true\n{FAST}"),
        &[
            engine_toml(&a.url(), "vllm", 2, 0),
            engine_toml(&b.url(), "vllm", 2, 2),
        ],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    // The model label needs the engines' model lists.
    wait_models(&r).await;

    // A plain request: on the idle engine A, one attempt.
    let body = Full::new(Bytes::from(chat_body(3, false)));
    let reply = send(
        with_id(post(r.addr, "/v1/chat/completions"), "plain-1")
            .body(body)
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, 200);
    let l = line_of("plain-1").await;
    assert_eq!(l["level"], "INFO");
    assert_eq!(l["method"], "POST");
    assert_eq!(l["path"], "/v1/chat/completions");
    assert_eq!(l["model"], "tiny-llama");
    assert_eq!(l["worker"], reply.worker());
    assert_eq!(l["status"], 200);
    assert_eq!(l["bytes"], reply.body.len() as u64);
    assert_eq!(l["attempts"], 1);
    assert!(l["duration_ms"].as_f64().unwrap() > 0.0, "{l}");
    assert!(
        l["ttfb_ms"].as_f64().unwrap() <= l["duration_ms"].as_f64().unwrap(),
        "{l}"
    );

    // A stream: logged when it ends, with all its bytes.
    let body = Full::new(Bytes::from(chat_body(8, true)));
    let resp = client()
        .request(
            with_id(post(r.addr, "/v1/chat/completions"), "stream-1")
                .body(body)
                .unwrap(),
        )
        .await
        .unwrap();
    let streamed = resp.into_body().collect().await.unwrap().to_bytes();
    let l = line_of("stream-1").await;
    assert_eq!(l["bytes"], streamed.len() as u64);
    assert_eq!(l["status"], 200);

    // Engine A fails everything: a 503 is its rank's failure, so the request tries A's other
    // (still idlest) rank, then B: three attempts.
    a.set_fail(503, 100.0).unwrap();
    let body = Full::new(Bytes::from(chat_body(3, false)));
    let reply = send(
        with_id(post(r.addr, "/v1/chat/completions"), "retried-1")
            .body(body)
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, 200);
    let l = line_of("retried-1").await;
    assert_eq!(l["attempts"], 3, "{l}");
    assert!(l["worker"].as_str().unwrap().starts_with(&b.url()), "{l}");

    // rankgate's own answer: no worker, no attempt.
    let req = http::Request::get(format!("http://{}/v2/nothing", r.addr))
        .header("x-request-id", "own-404")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(send(req).await.status, 404);
    let l = line_of("own-404").await;
    assert_eq!(
        (l["status"].as_u64(), l["worker"].as_str()),
        (Some(404), Some("-"))
    );
    assert_eq!(l["attempts"], 0);
    assert!(l["ttfb_ms"].is_null(), "{l}");

    // Exactly one line each.
    for id in ["plain-1", "stream-1", "retried-1", "own-404"] {
        let n = access_lines()
            .iter()
            .filter(|l| l["request_id"] == id)
            .count();
        assert_eq!(n, 1, "{id}");
    }
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_by_default() {
    captured();
    let (_e, r) = fleet(SimConfig::default()).await;
    wait_state(&r, &[0, 1], "available").await;
    let body = Full::new(Bytes::from(chat_body(2, false)));
    let reply = send(
        with_id(post(r.addr, "/v1/chat/completions"), "quiet-1")
            .body(body)
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, 200);
    r.shutdown().await;
    assert!(
        !access_lines().iter().any(|l| l["request_id"] == "quiet-1"),
        "no access line without server.access_log"
    );
}
