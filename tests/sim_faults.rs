//! The simulated engine's fault knobs, proven over real sockets: a failing share of requests,
//! hung requests and telemetry, a failing `/health`, stalled streams, and an engine that dies
//! like `kill -9` (on demand or after N admissions).
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rankgate::proto::vllm::vllm_engine_client::VllmEngineClient;
use rankgate::proto::vllm::GetLoadsRequest;
use rankgate_sim::sim::{SimConfig, SimEngine, SimFlavor as Flavor};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

/// How long a request that should hang is given to prove it does.
const HANG: Duration = Duration::from_millis(300);
/// Bound on anything that should happen promptly.
const SOON: Duration = Duration::from_secs(5);

/// Sends a raw HTTP/1.1 request and returns the open socket, so a test controls exactly when
/// the client goes away.
async fn raw(addr: SocketAddr, method: &str, path: &str, body: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nhost: sim\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write request");
    s
}

/// Asserts that nothing at all (not even a status line) arrives on `s` within [`HANG`].
async fn assert_silent(s: &mut TcpStream, what: &str) {
    let mut buf = [0u8; 256];
    match timeout(HANG, s.read(&mut buf)).await {
        Err(_) => {}
        Ok(r) => panic!(
            "{what}: expected no answer, got {:?}",
            r.map(|n| String::from_utf8_lossy(&buf[..n]).into_owned())
        ),
    }
}

async fn get_silent(addr: SocketAddr, path: &str) {
    let mut s = raw(addr, "GET", path, "").await;
    assert_silent(&mut s, path).await;
}

fn grpc(addr: SocketAddr) -> VllmEngineClient<Client<HttpConnector, tonic::body::Body>> {
    let c = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let origin = format!("http://{addr}").parse().expect("origin");
    VllmEngineClient::with_origin(c, origin)
}

async fn refused(addr: SocketAddr) -> bool {
    matches!(
        timeout(SOON, TcpStream::connect(addr)).await,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

fn running(e: &SimEngine) -> u32 {
    e.running().iter().sum()
}

#[tokio::test]
async fn a_failing_share_is_answered_at_once_and_admits_nothing() {
    let e = engine(SimConfig {
        fail_status: 503,
        fail_percent: 100.0,
        ..sim(Flavor::Vllm, 2, 0)
    })
    .await;
    for _ in 0..3 {
        let r = chat(e.addr, 4).await;
        assert_eq!(r.status, 503);
        let err = &r.json()["error"];
        assert_eq!(err["code"], 503);
        assert_eq!(err["type"], "ServiceUnavailableError");
        assert!(err["message"].is_string(), "{err}");
    }
    assert_eq!(e.served(), [0, 0]);
    assert_eq!(e.requests_received(), 3);
    let metrics = get(e.addr, "/metrics").await;
    assert_eq!(metrics.status, 200);
    let text = String::from_utf8_lossy(&metrics.body).into_owned();
    assert!(
        text.contains("vllm:num_requests_running{engine=\"0\""),
        "{text}"
    );
    assert!(
        !text.contains("} 1\n"),
        "a failed request looked admitted:\n{text}"
    );

    // Half: exactly every second request, counted afresh from the change.
    e.set_fail(429, 50.0).unwrap();
    let mut statuses = Vec::new();
    for _ in 0..4 {
        statuses.push(chat(e.addr, 1).await.status.as_u16());
    }
    assert_eq!(statuses, [200, 429, 200, 429]);
    assert_eq!(e.served().iter().sum::<u64>(), 2);

    e.set_fail(503, 0.0).unwrap();
    assert_eq!(chat(e.addr, 1).await.status, 200);
    assert_eq!(e.requests_received(), 8);
}

#[tokio::test]
async fn bad_fault_values_are_errors_not_panics() {
    let e = engine(sim(Flavor::Vllm, 1, 0)).await;
    assert!(e.set_fail(99, 10.0).is_err());
    assert!(e.set_fail(600, 10.0).is_err());
    assert!(e.set_fail(503, 100.5).is_err());
    assert!(e.set_fail(503, -1.0).is_err());
    assert!(e.set_fail(503, f64::NAN).is_err());
    assert!(e.set_health_status(42).is_err());
    // A rejected change leaves the engine as it was.
    assert_eq!(chat(e.addr, 1).await.status, 200);
    let err = SimEngine::start(
        loopback(),
        SimConfig {
            fail_percent: 250.0,
            ..SimConfig::default()
        },
    )
    .await
    .err()
    .expect("an out-of-range fail_percent must not start");
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("percent"), "{err}");
}

#[tokio::test]
async fn hung_requests_never_answer_and_leave_nothing_behind() {
    let e = engine(sim(Flavor::Vllm, 2, 0)).await;
    e.set_hang_requests(true);
    let body = chat_body(4, true);
    let mut s = raw(e.addr, "POST", "/v1/chat/completions", &body).await;
    assert_silent(&mut s, "hung request").await;
    assert_eq!(e.requests_received(), 1);
    assert_eq!(e.open_requests(), 1);
    assert_eq!(e.served(), [0, 0], "a hung request is not admitted");
    // The rest of the engine keeps answering.
    assert_eq!(get(e.addr, "/metrics").await.status, 200);
    drop(s);
    until("the hung request is dropped with its client", SOON, || {
        e.open_requests() == 0
    })
    .await;

    e.set_hang_requests(false);
    assert_eq!(chat(e.addr, 2).await.status, 200);
}

#[tokio::test]
async fn a_graceful_shutdown_releases_hung_requests() {
    let e = engine(sim(Flavor::Vllm, 1, 0)).await;
    e.set_hang_requests(true);
    let mut s = raw(e.addr, "POST", "/v1/completions", &chat_body(4, false)).await;
    assert_silent(&mut s, "hung request").await;
    timeout(SOON, e.shutdown())
        .await
        .expect("shutdown must not wait for a request that would never end");
    let mut reply = Vec::new();
    let _ = timeout(SOON, s.read_to_end(&mut reply)).await;
    let reply = String::from_utf8_lossy(&reply);
    assert!(reply.starts_with("HTTP/1.1 503"), "{reply}");
}

#[tokio::test]
async fn hung_telemetry_and_models_are_separate_knobs() {
    let e = engine(SimConfig {
        hang_metrics: true,
        ..sim(Flavor::Sglang, 2, 0)
    })
    .await;
    get_silent(e.addr, "/metrics").await;
    get_silent(e.addr, "/v1/loads").await;
    assert_eq!(get(e.addr, "/v1/models").await.status, 200);
    assert_eq!(get(e.addr, "/health").await.status, 200);
    assert_eq!(chat(e.addr, 1).await.status, 200);

    e.set_hang_metrics(false);
    e.set_hang_models(true);
    assert_eq!(get(e.addr, "/metrics").await.status, 200);
    assert_eq!(get(e.addr, "/v1/loads").await.status, 200);
    get_silent(e.addr, "/v1/models").await;
    e.set_hang_models(false);
    assert_eq!(get(e.addr, "/v1/models").await.status, 200);
}

#[tokio::test]
async fn hung_metrics_hang_grpc_get_loads_too() {
    let e = engine(SimConfig {
        hang_metrics: true,
        ..sim(Flavor::Vllm, 2, 0)
    })
    .await;
    let g = e.start_grpc(loopback()).await.expect("start gRPC");
    let mut client = grpc(g);
    let call = client.get_loads(GetLoadsRequest::default());
    assert!(timeout(HANG, call).await.is_err(), "GetLoads answered");
    e.set_hang_metrics(false);
    let loads = timeout(SOON, client.get_loads(GetLoadsRequest::default()))
        .await
        .expect("GetLoads in time")
        .expect("GetLoads");
    assert_eq!(loads.into_inner().loads.len(), 2);
}

#[tokio::test]
async fn health_fails_while_everything_else_looks_fine() {
    let e = engine(SimConfig {
        health_status: 503,
        ..sim(Flavor::Vllm, 1, 0)
    })
    .await;
    assert_eq!(get(e.addr, "/health").await.status, 503);
    assert_eq!(get(e.addr, "/metrics").await.status, 200);
    assert_eq!(get(e.addr, "/v1/models").await.status, 200);
    assert_eq!(chat(e.addr, 1).await.status, 200);
    e.set_health_status(200).unwrap();
    assert_eq!(get(e.addr, "/health").await.status, 200);
}

#[tokio::test]
async fn a_stalled_stream_sends_k_chunks_then_nothing() {
    let e = engine(SimConfig {
        stall_after_tokens: Some(3),
        ..sim(Flavor::Vllm, 1, 0)
    })
    .await;
    let resp = stream_chat(e.addr, 20).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let mut text = String::new();
    // Bounded: at most a few frames per token, each within the stall window.
    for _ in 0..64 {
        match timeout(HANG, body.frame()).await {
            Err(_) => break,
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    text.push_str(&String::from_utf8_lossy(&d));
                }
            }
            Ok(other) => panic!("the stalled stream ended: {other:?}\n{text}"),
        }
    }
    assert_eq!(text.matches("data: {").count(), 3, "{text}");
    assert!(!text.contains("[DONE]"), "{text}");
    // The stalled request holds its KV, as a wedged one does.
    assert_eq!(running(&e), 1);
    drop(body);
    until("the stalled request ends with its client", SOON, || {
        e.open_requests() == 0 && running(&e) == 0
    })
    .await;

    e.set_stall_after_tokens(None);
    let resp = stream_chat(e.addr, 4).await;
    let all = timeout(SOON, resp.into_body().collect())
        .await
        .expect("a whole stream in time")
        .expect("stream body")
        .to_bytes();
    assert!(String::from_utf8_lossy(&all).ends_with("data: [DONE]\n\n"));
}

#[tokio::test]
async fn kill_cuts_streams_mid_body_and_refuses_connections() {
    let e = engine(SimConfig {
        decode_tokens_per_sec: 50.0,
        ..sim(Flavor::Vllm, 2, 0)
    })
    .await;
    let g = e.start_grpc(loopback()).await.expect("start gRPC");
    // A gRPC call in flight must die with the engine rather than wait out its own deadline.
    e.set_hang_metrics(true);
    let mut client = grpc(g);
    let grpc_call =
        tokio::spawn(
            async move { timeout(SOON, client.get_loads(GetLoadsRequest::default())).await },
        );
    let resp = stream_chat(e.addr, 1000).await;
    let mut body = resp.into_body();
    let first = timeout(SOON, body.frame())
        .await
        .expect("first token in time");
    assert!(matches!(first, Some(Ok(_))), "{first:?}");

    timeout(SOON, e.kill()).await.expect("kill completes");
    assert!(e.is_dead());
    let mut ended_badly = false;
    // Bounded: tokens already sent may still be buffered before the cut shows.
    for _ in 0..1000 {
        match timeout(SOON, body.frame()).await.expect("the cut in time") {
            Some(Ok(f)) => {
                let d = f.into_data().unwrap_or_default();
                assert!(!String::from_utf8_lossy(&d).contains("[DONE]"));
            }
            Some(Err(_)) => {
                ended_badly = true;
                break;
            }
            None => panic!("the stream ended cleanly after a kill"),
        }
    }
    assert!(ended_badly, "the stream was not cut");
    assert!(refused(e.addr).await, "HTTP port still accepts");
    assert!(refused(g).await, "gRPC port still accepts");
    let grpc_result = timeout(SOON, grpc_call)
        .await
        .expect("gRPC task in time")
        .expect("gRPC task");
    assert!(
        matches!(grpc_result, Ok(Err(_))),
        "the hung GetLoads did not fail at the kill: {grpc_result:?}"
    );
    until("the cut stream frees its KV", SOON, || {
        e.open_requests() == 0 && running(&e) == 0
    })
    .await;
}

#[tokio::test]
async fn die_after_n_admissions() {
    let e = engine(SimConfig {
        die_after: Some(2),
        ..sim(Flavor::Vllm, 1, 0)
    })
    .await;
    assert_eq!(chat(e.addr, 1).await.status, 200);
    assert!(!e.is_dead());
    let req = post(e.addr, "/v1/chat/completions")
        .body(Full::new(Bytes::from(chat_body(8, false))))
        .unwrap();
    let second = timeout(SOON, client().request(req))
        .await
        .expect("the second request ends in time");
    assert!(
        second.is_err(),
        "the request that killed the engine got {second:?}"
    );
    timeout(SOON, e.dead()).await.expect("dead in time");
    assert!(refused(e.addr).await);
    assert_eq!(e.requests_received(), 2);
    assert_eq!(e.served(), [2]);
}

#[tokio::test]
async fn die_after_counts_from_when_it_is_set() {
    let e = engine(sim(Flavor::Sglang, 2, 0)).await;
    for _ in 0..3 {
        assert_eq!(chat(e.addr, 1).await.status, 200);
    }
    e.die_after(Some(1));
    assert!(!e.is_dead(), "earlier admissions must not count");
    let req = post(e.addr, "/v1/completions")
        .body(Full::new(Bytes::from(chat_body(4, false))))
        .unwrap();
    let _ = timeout(SOON, client().request(req)).await;
    timeout(SOON, e.dead()).await.expect("dead in time");
    assert!(refused(e.addr).await);
}

#[tokio::test]
async fn scenario_engine_faults_and_a_kill_event_apply_mid_run() {
    let s = rankgate_sim::scenario::Scenario::parse(
        r#"
name = "kill mid-run"
[[engines]]
flavor = "vllm"
dp_size = 1
fail_percent = 100
[[engines]]
flavor = "vllm"
dp_size = 1
[workload]
rate = 20
requests = 20
duration = "2s"
prompt_tokens = 50
output_tokens = 8
[[events]]
at = "300ms"
engine = 1
kill = true
"#,
        None,
    )
    .expect("scenario");
    let run = timeout(
        Duration::from_secs(30),
        rankgate_sim::scenario::run_policy(
            &s,
            rankgate::config::Policy::RoundRobin.into(),
            1,
            false,
        ),
    )
    .await
    .expect("the run ends although an engine died under it")
    .expect("run");
    // Engine 0 fails everything from the start and engine 1 is dead after 300 ms, so whatever
    // the router does, requests after that cannot all succeed.
    assert!(
        run.report.errors() > 0,
        "no errors although no engine could serve"
    );
}

#[tokio::test]
async fn a_stalled_non_streaming_request_holds_its_kv_and_never_answers() {
    let e = engine(SimConfig {
        stall_after_tokens: Some(2),
        ..sim(Flavor::Sglang, 1, 0)
    })
    .await;
    let mut s = raw(e.addr, "POST", "/v1/chat/completions", &chat_body(8, false)).await;
    assert_silent(&mut s, "stalled request").await;
    assert_eq!(e.served(), [1], "a stalled request was admitted");
    assert_eq!(running(&e), 1);
    drop(s);
    until("the stalled request ends with its client", SOON, || {
        e.open_requests() == 0 && running(&e) == 0
    })
    .await;
}
