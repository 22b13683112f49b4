//! Runtime membership over real sockets: engines added and removed through the admin API while
//! traffic flows, config reloads (valid and not), and the admin token guarding every change.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::admin::*;
use common::*;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate::config::Config;
use rankgate_sim::sim::{SimConfig, SimEngine};
use serde_json::{json, Value};

/// A router whose admin API takes [`TOKEN`], polling every `interval`.
async fn admin_router(interval: &str, engines: &[String]) -> Router {
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{}\
         [telemetry]\ninterval = \"{interval}\"\nstale_after = \"5s\"\n{}",
        token_env(),
        engines.concat()
    );
    let cfg = Config::from_str(&text).unwrap_or_else(|e| panic!("config: {e}\n{text}"));
    Router::start(cfg).await.expect("start router")
}

fn engine_json(e: &SimEngine, dp_size: u32, start_rank: u32) -> Value {
    json!({"url": e.url(), "flavor": "vllm", "dp_size": dp_size, "start_rank": start_rank})
}

fn ids(rows: &[Value]) -> Vec<String> {
    rows.iter()
        .map(|w| w["id"].as_str().unwrap_or("").to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_added_through_the_admin_api_takes_traffic_within_one_poll_interval() {
    let a = engine(SimConfig::default()).await;
    a.set_kv_usage(vec![0.6, 0.6]);
    let interval = Duration::from_secs(1);
    let r = admin_router("1s", &[engine_toml(&a.url(), "vllm", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;

    let b = engine(sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 2)).await;
    b.set_kv_usage(vec![0.0, 0.0]);
    let added_at = tokio::time::Instant::now();
    let reply = admin(
        &r,
        Method::POST,
        "/engines",
        Some(TOKEN),
        Some(engine_json(&b, 2, 2)),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["added"], json!([b.url()]));

    // Its poller starts with the change, so its idle ranks take the very next requests: well
    // within the one poll interval the issue allows.
    let mut landed = None;
    while added_at.elapsed() < interval {
        let reply = chat(r.addr, 4).await;
        assert_eq!(reply.status, StatusCode::OK);
        if reply.worker().starts_with(&b.url()) {
            landed = Some(added_at.elapsed());
            break;
        }
    }
    let took =
        landed.unwrap_or_else(|| panic!("no request reached {} within {interval:?}", b.url()));
    eprintln!("first request on the added engine {took:?} after POST /engines");

    let engines = admin(&r, Method::GET, "/engines", None, None).await.json();
    let urls: Vec<&str> = engines
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["url"].as_str().unwrap())
        .collect();
    assert_eq!(urls, [a.url(), b.url()]);
    assert_eq!(engines[1]["origin"], "admin");
    assert_eq!(
        engines[1]["workers"],
        json!([format!("{}@2", b.url()), format!("{}@3", b.url())])
    );
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_removed_mid_stream_finishes_its_streams_and_gets_no_new_requests() {
    let a = engine(SimConfig::default()).await;
    let b = engine(SimConfig {
        decode_tokens_per_sec: 40.0,
        ..sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 2)
    })
    .await;
    a.set_kv_usage(vec![0.8, 0.8]);
    b.set_kv_usage(vec![0.0, 0.0]);
    let r = admin_router(
        "50ms",
        &[
            engine_toml(&a.url(), "vllm", 2, 0),
            engine_toml(&b.url(), "vllm", 2, 2),
        ],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;

    // Two streams of 30 tokens at 40 tokens/s: both on B, the idle engine, for ~0.75 s.
    let mut streams = Vec::new();
    for _ in 0..2 {
        let s = stream_chat(r.addr, 30).await;
        assert_eq!(s.status(), StatusCode::OK);
        let worker = s.headers()["x-rankgate-worker"]
            .to_str()
            .unwrap()
            .to_string();
        assert!(worker.starts_with(&b.url()), "{worker}");
        streams.push(s);
    }
    let url = b.url();
    let path = format!("/engines?url={url}");
    let reply = admin(&r, Method::DELETE, &path, Some(TOKEN), None).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["removed"], json!([url]));

    // From now on: A only, however idle B looks.
    let before = b.requests_received();
    for _ in 0..20 {
        let reply = chat(r.addr, 2).await;
        assert_eq!(reply.status, StatusCode::OK);
        assert!(reply.worker().starts_with(&a.url()), "{}", reply.worker());
    }
    assert_eq!(
        b.requests_received(),
        before,
        "no new request reached the removed engine"
    );
    let rows = workers(&r).await;
    assert_eq!(
        ids(&rows),
        [format!("{}@0", a.url()), format!("{}@1", a.url())]
    );
    // Its counters left /metrics with it.
    let metrics = String::from_utf8(get(r.admin_addr, "/metrics").await.body.to_vec()).unwrap();
    assert!(!metrics.contains(&url), "{metrics}");
    assert!(metrics.contains(&format!("worker=\"{}@0\"", a.url())));

    // The streams already on it run to their end, whole.
    for s in streams {
        let body = tokio::time::timeout(Duration::from_secs(10), s.into_body().collect())
            .await
            .expect("stream ends")
            .expect("stream body")
            .to_bytes();
        let text = String::from_utf8_lossy(&body);
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(!text.contains("error"), "{text}");
        assert_eq!(text.matches("\"content\"").count(), 30, "{text}");
    }
    assert_eq!(b.open_requests(), 0);
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_applies_a_valid_file_and_an_invalid_one_changes_nothing() {
    let a = engine(SimConfig::default()).await;
    let b = engine(sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 2)).await;
    let head = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{}{FAST}",
        token_env()
    );
    let file = TempConfig::new(&format!("{head}{}", engine_toml(&a.url(), "vllm", 2, 0)));
    let cfg = Config::load(&file.0).unwrap();
    let r = Router::start_from(cfg, Some(file.0.clone())).await.unwrap();
    wait_state(&r, &[0, 1], "available").await;

    // Valid: B joins, and a changed setting that needs a restart is named.
    file.write(&format!(
        "{head}[routing]\npolicy = \"round_robin\"\n{}{}",
        engine_toml(&a.url(), "vllm", 2, 0),
        engine_toml(&b.url(), "vllm", 2, 2)
    ));
    let reply = admin(&r, Method::POST, "/reload", Some(TOKEN), None).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    let v = reply.json();
    assert_eq!(v["added"], json!([b.url()]));
    assert_eq!(v["removed"], json!([]));
    assert_eq!(v["restart_needed"], json!(["routing"]));
    let rows = wait_state(&r, &[0, 1, 2, 3], "available").await;
    assert_eq!(rows.len(), 4);

    // Invalid: the error names the problem and the fleet stays as it was.
    file.write(&format!("{head}{}", engine_toml(&a.url(), "vllm", 0, 0)));
    let reply = admin(&r, Method::POST, "/reload", Some(TOKEN), None).await;
    assert_eq!(reply.status, StatusCode::BAD_REQUEST);
    let msg = reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(msg.contains("engines[0].dp_size"), "{msg}");
    file.write("this is [not toml");
    let err = r.reload().await.unwrap_err().to_string();
    assert!(err.contains("line 1"), "{err}");
    assert_eq!(workers(&r).await.len(), 4, "nothing changed");

    // Valid again: A leaves (its ranks go), B stays with its counters.
    let served_b = b.served().iter().sum::<u64>();
    file.write(&format!("{head}{}", engine_toml(&b.url(), "vllm", 2, 2)));
    let done = r.reload().await.unwrap();
    assert_eq!(done.outcome.removed, [a.url()]);
    let rows = workers(&r).await;
    assert_eq!(
        ids(&rows),
        [format!("{}@2", b.url()), format!("{}@3", b.url())]
    );
    for _ in 0..4 {
        assert!(chat(r.addr, 2).await.worker().starts_with(&b.url()));
    }
    assert_eq!(b.served().iter().sum::<u64>(), served_b + 4);
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_need_the_admin_token_and_bad_ones_are_named() {
    let a = engine(SimConfig::default()).await;
    let b = engine(sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 2)).await;

    // Without server.admin_token_env: reading works, changing is forbidden.
    let open = router(FAST, &[engine_toml(&a.url(), "vllm", 2, 0)]).await;
    let add = engine_json(&b, 2, 2);
    for (m, p) in [
        (Method::POST, "/engines"),
        (Method::DELETE, "/engines?url=x"),
        (Method::POST, "/reload"),
    ] {
        let reply = admin(&open, m, p, Some(TOKEN), Some(add.clone())).await;
        assert_eq!(reply.status, StatusCode::FORBIDDEN, "{p}");
        assert!(String::from_utf8_lossy(&reply.body).contains("server.admin_token_env"));
    }
    assert_eq!(
        admin(&open, Method::GET, "/engines", None, None)
            .await
            .status,
        StatusCode::OK
    );
    open.shutdown().await;

    let r = admin_router("50ms", &[engine_toml(&a.url(), "vllm", 2, 0)]).await;
    for token in [None, Some("wrong"), Some("admin-secret-token-but-longer")] {
        let reply = admin(&r, Method::POST, "/engines", token, Some(add.clone())).await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED, "{token:?}");
        assert!(String::from_utf8_lossy(&reply.body).contains("admin token"));
        assert_eq!(reply.headers["www-authenticate"], "Bearer");
    }
    assert_eq!(workers(&r).await.len(), 2, "nothing was added");

    let bad = |body: Value| admin(&r, Method::POST, "/engines", Some(TOKEN), Some(body));
    let message = |reply: Reply| {
        (
            reply.status,
            reply.json()["error"]["message"]
                .as_str()
                .unwrap_or("")
                .to_string(),
        )
    };
    let (s, m) = message(bad(json!({"url": b.url(), "flavor": "vllm", "dp_szie": 2})).await);
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(m.contains("dp_szie"), "{m}");
    let (s, m) = message(bad(json!({"url": "ftp://x:1", "flavor": "vllm"})).await);
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(m.contains("POST /engines.url"), "{m}");
    let (s, m) = message(
        bad(json!({"url": a.url(), "flavor": "vllm", "dp_size": 2, "start_rank": 8})).await,
    );
    assert_eq!(s, StatusCode::CONFLICT);
    assert!(m.contains("already in the fleet (from config)"), "{m}");
    let (s, m) = message(
        bad(json!({"url": b.url(), "flavor": "vllm", "dp_size": 2, "start_rank": 1})).await,
    );
    assert_eq!(s, StatusCode::CONFLICT);
    assert!(m.contains("claim the same rank(s) of the DP group"), "{m}");
    let raw = Request::post(format!("http://{}/engines", r.admin_addr))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Full::new(Bytes::from_static(b"{not json")))
        .unwrap();
    let (s, m) = message(send(raw).await);
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(m.contains("as a JSON object"), "{m}");
    // The admin API may not name an environment variable the file does not name for a key:
    // it would send that variable's value to the engine it adds.
    let (s, m) = message(
        bad(json!({"url": b.url(), "flavor": "vllm", "dp_size": 2, "start_rank": 2, "api_key_env": "HOME"}))
            .await,
    );
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(m.contains("POST /engines.api_key_env: \"HOME\""), "{m}");
    let (s, m) = message(bad(json!({"url": "http://:8000", "flavor": "vllm"})).await);
    assert_eq!(s, StatusCode::BAD_REQUEST);
    assert!(m.contains("no host"), "{m}");
    assert!(
        m.starts_with("POST /engines.url:"),
        "a request's error names no file: {m}"
    );
    let big = json!({"url": b.url(), "flavor": "vllm", "models": vec!["x".repeat(1000); 100]});
    assert_eq!(bad(big).await.status, StatusCode::PAYLOAD_TOO_LARGE);
    let (s, m) = message(
        admin(
            &r,
            Method::DELETE,
            "/engines?url=http://127.0.0.1:1",
            Some(TOKEN),
            None,
        )
        .await,
    );
    assert_eq!(s, StatusCode::NOT_FOUND);
    assert!(m.contains("no engine http://127.0.0.1:1"), "{m}");
    let (s, _) = message(admin(&r, Method::DELETE, "/engines", Some(TOKEN), None).await);
    assert_eq!(s, StatusCode::BAD_REQUEST);
    let (s, m) = message(admin(&r, Method::POST, "/reload", Some(TOKEN), None).await);
    assert_eq!(s, StatusCode::CONFLICT, "started without a file");
    assert!(m.contains("without a config file"), "{m}");
    let reply = admin(&r, Method::PUT, "/engines", Some(TOKEN), None).await;
    assert_eq!(reply.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(reply.headers["allow"], "GET, POST, DELETE");
    assert_eq!(workers(&r).await.len(), 2, "nothing changed");
    // Serving went on throughout.
    let served = chat(r.addr, 2).await;
    assert_eq!(served.status, StatusCode::OK, "{:?}", served.body);
    r.shutdown().await;
}
