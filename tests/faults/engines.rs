//! Engines on a bad day, over real sockets: killed under streaming load, hung, stalled mid-stream,
//! answering 503 while their `/metrics` look fine, failing `/health`, hanging `/v1/models`, a
//! fleet that fails everywhere (the retry budget), clients whose bodies break, admission, and
//! which failures count against a rank (transport: the whole engine; 4xx: never).
//!
//! Every wait is on observable state and bounded in time; timings worth quoting are printed
//! (`cargo test --test faults -- --nocapture`).

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::BodyExt;
use rankgate::app::Router;
use rankgate_sim::sim::{SimConfig, SimEngine, SimFlavor as Flavor};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{timeout, Instant};

use crate::common::*;

/// Bound on anything that should happen promptly.
const SOON: Duration = Duration::from_secs(5);

/// How a proxied SSE stream ended.
#[derive(Debug, Clone, PartialEq)]
enum End {
    /// `data: [DONE]` and a clean end.
    Done,
    /// A final `data: {"error": ...}` event, then a clean end.
    ErrorEvent(Value),
    /// The body ended (or failed) without either: a silent cut.
    Cut(String),
}

struct Stream {
    status: u16,
    worker: String,
    /// `data: {...}` events carrying tokens (choices), in order.
    tokens: usize,
    end: End,
    /// When the request was sent (set by the caller).
    sent_at: Instant,
}

/// Reads a streaming response to its end (bounded by `limit`), classifying how it ended.
async fn read_stream(resp: http::Response<hyper::body::Incoming>, limit: Duration) -> Stream {
    let sent_at = Instant::now();
    let status = resp.status().as_u16();
    let worker = resp
        .headers()
        .get("x-rankgate-worker")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    let mut body = resp.into_body();
    let mut text = String::new();
    let deadline = Instant::now() + limit;
    let broken = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match timeout(left, body.frame()).await {
            Err(_) => panic!("stream did not end within {limit:?} (a hang): {text}"),
            Ok(None) => break None,
            Ok(Some(Err(e))) => break Some(e.to_string()),
            Ok(Some(Ok(f))) => {
                if let Ok(d) = f.into_data() {
                    text.push_str(&String::from_utf8_lossy(&d));
                }
            }
        }
    };
    let events: Vec<&str> = text
        .split("\n\n")
        .map(str::trim)
        .filter(|e| !e.is_empty())
        .collect();
    let tokens = events
        .iter()
        .filter_map(|e| e.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str::<Value>(d).ok())
        .filter(|v| v["choices"].as_array().is_some_and(|c| !c.is_empty()))
        .count();
    let last = events.last().and_then(|e| e.strip_prefix("data: "));
    let end = match (broken, last) {
        (None, Some("[DONE]")) => End::Done,
        (None, Some(d)) => match serde_json::from_str::<Value>(d) {
            Ok(v) if v.get("error").is_some() => End::ErrorEvent(v),
            _ => End::Cut(text.clone()),
        },
        (b, _) => End::Cut(format!("{b:?}: {text}")),
    };
    Stream {
        status,
        worker,
        tokens,
        end,
        sent_at,
    }
}

/// A sample from the admin `/metrics` (0 when absent).
async fn metric(r: &Router, series: &str) -> f64 {
    let text = String::from_utf8_lossy(&get(r.admin_addr, "/metrics").await.body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Rows of `/workers` whose engine is `e`.
fn rows_of<'a>(rows: &'a [Value], e: &SimEngine) -> Vec<&'a Value> {
    let url = e.url();
    rows.iter()
        .filter(|r| r["engine"] == url.as_str())
        .collect()
}

fn is_on(worker: &str, e: &SimEngine) -> bool {
    worker.starts_with(&format!("{}@", e.url()))
}

fn reason(row: &Value) -> &str {
    row["reason"].as_str().unwrap_or("")
}

/// A vLLM sim hosting global ranks `start..start + dp`.
fn vllm(dp: u32, start: u32) -> SimConfig {
    sim(Flavor::Vllm, dp, start)
}

/// The `[[engines]]` table of a vLLM sim built with [`vllm`]`(dp, start)`.
fn toml_of(e: &SimEngine, dp: u32, start: u32) -> String {
    engine_toml(&e.url(), "vllm", dp, start)
}

/// 1. An engine killed under steady streaming load: streams already flowing from it end with a
/// final SSE error event, everything else (including requests that reach the dead engine before
/// telemetry notices) succeeds on the other engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_killed_under_streaming_load() {
    let cfg = SimConfig {
        decode_tokens_per_sec: 100.0,
        ..vllm(2, 0)
    };
    let doomed = engine(cfg.clone()).await;
    let survivor = engine(SimConfig {
        start_rank: 2,
        ..cfg
    })
    .await;
    // Slow polls: after the kill there is a window in which the dead engine still looks fine.
    let r = router(
        "[telemetry]\ninterval = \"1s\"\nstale_after = \"5s\"\n",
        &[toml_of(&doomed, 2, 0), toml_of(&survivor, 2, 2)],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    // The survivor looks busier, so the doomed engine takes the streams until it dies.
    survivor.set_kv_usage(vec![0.3, 0.3]);
    wait_workers(&r, SOON, |rows| rows[2]["kv_usage"] == 0.3).await;

    const CLIENTS: usize = 6;
    const ROUNDS: usize = 3;
    let addr = r.addr;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            tokio::spawn(async move {
                let mut out = Vec::new();
                for _ in 0..ROUNDS {
                    let sent_at = Instant::now();
                    let resp = timeout(SOON, stream_chat(addr, 30))
                        .await
                        .expect("stream headers in time");
                    let mut s = read_stream(resp, SOON).await;
                    s.sent_at = sent_at;
                    out.push(s);
                }
                out
            })
        })
        .collect();
    until("streams flowing on the doomed engine", SOON, || {
        doomed.running().iter().sum::<u32>() >= 3
    })
    .await;
    timeout(SOON, doomed.kill()).await.expect("kill completes");
    let killed_at = Instant::now();

    // Sequential requests right after the kill, long before the next poll (1 s) notices it.
    let mut after_kill = Vec::new();
    for _ in 0..8 {
        let reply = chat(r.addr, 1).await;
        after_kill.push((reply.status.as_u16(), reply.worker()));
    }
    let burst = killed_at.elapsed();
    assert!(
        after_kill
            .iter()
            .all(|(s, w)| *s == 200 && is_on(w, &survivor)),
        "{after_kill:?}"
    );

    let mut streams = Vec::new();
    for t in tasks {
        streams.extend(timeout(SOON * 3, t).await.expect("clients end").unwrap());
    }
    let (mut done, mut cut) = (0, 0);
    for s in &streams {
        assert_eq!(s.status, 200, "a stream failed before its first byte");
        match &s.end {
            End::Done => done += 1,
            End::ErrorEvent(v) => {
                cut += 1;
                assert!(is_on(&s.worker, &doomed), "cut on {}", s.worker);
                assert_eq!(v["error"]["code"], 502, "{v}");
                assert!(v["error"]["message"].is_string(), "{v}");
            }
            End::Cut(text) => panic!("silent cut on {}: {text}", s.worker),
        }
    }
    assert_eq!(done + cut, CLIENTS * ROUNDS);
    assert!(cut >= 3, "the kill cut {cut} streams");
    // Everything sent after the kill went to the survivor and completed.
    let after: Vec<_> = streams.iter().filter(|s| s.sent_at > killed_at).collect();
    assert!(!after.is_empty());
    for s in &after {
        assert!(
            is_on(&s.worker, &survivor) && s.end == End::Done,
            "{} {:?}",
            s.worker,
            s.end
        );
    }
    let on_survivor = after.len();
    println!(
        "kill: {cut} streams cut with an error event, {done} completed ({on_survivor} on the \
         survivor); 8 requests after the kill all 200 within {burst:?}; retries {}",
        r.metrics.retries_total()
    );
    let rows = wait_workers(&r, SOON, |rows| rows.iter().all(|w| w["in_flight"] == 0)).await;
    assert!(rows_of(&rows, &doomed)
        .iter()
        .all(|w| w["telemetry"] == "unavailable"));
}

/// 2. A hung engine: 504 in the OpenAI shape after about `response_timeout`, nothing left in
/// flight, and the engine's request closed.
#[tokio::test]
async fn hung_engine_gets_504_after_response_timeout() {
    let e = engine(vllm(2, 0)).await;
    let r = router(
        &format!("response_timeout = \"500ms\"\n{FAST}"),
        &[toml_of(&e, 2, 0)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    e.set_hang_requests(true);
    let started = Instant::now();
    let reply = timeout(SOON, chat(r.addr, 4)).await.expect("no hang");
    let took = started.elapsed();
    assert_eq!(reply.status, 504);
    assert_openai_error(&reply.body, 504, Some("GatewayTimeoutError"));
    assert!(
        took >= Duration::from_millis(480) && took < Duration::from_millis(1500),
        "504 after {took:?}"
    );
    // Not retried: a timeout already spent the client's wait.
    assert_eq!(e.requests_received(), 1);
    let rows = wait_workers(&r, SOON, |rows| rows.iter().all(|w| w["in_flight"] == 0)).await;
    let failures: u64 = rows
        .iter()
        .map(|w| w["consecutive_failures"].as_u64().unwrap())
        .sum();
    assert_eq!(failures, 1, "the timeout counts once against its rank");
    assert_eq!(
        metric(
            &r,
            &format!(
                "rankgate_rank_in_flight_requests{{worker=\"{}@0\"}}",
                e.url()
            )
        )
        .await,
        0.0
    );
    until("the engine sees its request closed", SOON, || {
        e.open_requests() == 0
    })
    .await;
    println!("hung engine: 504 after {took:?} (response_timeout 500ms)");
}

/// 3. A stream that stalls after k tokens: the client gets the k tokens, then a final SSE
/// error event about `stream_idle_timeout` later, then the end of the stream.
#[tokio::test]
async fn stalled_stream_ends_with_error_event_after_idle_timeout() {
    let e = engine(vllm(1, 0)).await;
    let r = router(
        &format!("stream_idle_timeout = \"300ms\"\n{FAST}"),
        &[toml_of(&e, 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;
    e.set_stall_after_tokens(Some(3));
    let resp = timeout(SOON, stream_chat(r.addr, 20)).await.unwrap();
    // Frame timing: the error frame comes `stream_idle_timeout` after the last token.
    let mut body = resp.into_body();
    let mut events = Vec::new();
    let mut last_token_at = Instant::now();
    let mut ended = false;
    for _ in 0..64 {
        match timeout(SOON, body.frame()).await.expect("no hang") {
            None => {
                ended = true;
                break;
            }
            Some(Ok(f)) => {
                let d = f.into_data().unwrap_or_default();
                let s = String::from_utf8_lossy(&d).into_owned();
                for ev in s.split("\n\n").filter(|x| !x.trim().is_empty()) {
                    if !ev.contains("\"error\"") {
                        last_token_at = Instant::now();
                    }
                    events.push((ev.to_string(), Instant::now()));
                }
            }
            Some(Err(err)) => panic!("stream failed instead of an error event: {err}"),
        }
    }
    assert!(ended, "the stream never ended: {events:?}");
    assert_eq!(events.len(), 4, "{events:?}");
    assert!(events[..3]
        .iter()
        .all(|(e, _)| e.contains("chat.completion.chunk")));
    let (last, at) = &events[3];
    let v: Value = serde_json::from_str(last.trim().strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(v["error"]["code"], 504, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("stream_idle_timeout"),
        "{v}"
    );
    let gap = at.duration_since(last_token_at);
    assert!(
        gap >= Duration::from_millis(280) && gap < Duration::from_millis(1200),
        "error event {gap:?} after the last token"
    );
    let rows = wait_workers(&r, SOON, |rows| rows[0]["in_flight"] == 0).await;
    assert_eq!(rows[0]["consecutive_failures"], 1);
    assert_eq!(
        metric(&r, "rankgate_streams_cut_total{reason=\"idle\"}").await,
        1.0,
        "the cut stream is counted"
    );
    until("the engine's stalled request is closed", SOON, || {
        e.open_requests() == 0
    })
    .await;
    println!("stalled stream: error event {gap:?} after token 3 (stream_idle_timeout 300ms)");
}

/// 3b. Streams that keep stalling eject their rank: each stall counts as a failure, and the next
/// stream's response headers must not wipe that count (the engine sends headers at once); nor
/// may a trial stream re-admit the rank on its headers alone.
#[tokio::test]
async fn streams_that_keep_stalling_eject_the_rank() {
    let e = engine(vllm(1, 0)).await;
    let r = router(
        &format!(
            "stream_idle_timeout = \"200ms\"\n[routing]\neject_after = 2\n\
             eject_for = \"300ms\"\n{FAST}"
        ),
        &[toml_of(&e, 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;
    e.set_stall_after_tokens(Some(1));
    for i in 0..2 {
        let resp = timeout(SOON, stream_chat(r.addr, 20)).await.unwrap();
        let s = read_stream(resp, SOON).await;
        assert!(
            matches!(s.end, End::ErrorEvent(_)),
            "stream {i}: {:?}",
            s.end
        );
        assert_eq!(s.tokens, 1);
    }
    let rows = workers(&r).await;
    assert_eq!(rows[0]["reason_kind"], "ejected", "{:#}", rows[0]);
    assert!(
        reason(&rows[0]).starts_with("ejected: 2 consecutive timeouts (for 300 ms"),
        "{}",
        rows[0]
    );
    // While ejected the only rank takes nothing (503 from rankgate); then one trial stream, which
    // stalls too: ejected again, for twice as long.
    let mut refused = 0;
    let trial = loop {
        let resp = timeout(SOON, stream_chat(r.addr, 20)).await.unwrap();
        if resp.status() == 503 {
            refused += 1;
            assert!(refused < 100, "no trial within ~2 s");
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        }
        break read_stream(resp, SOON).await;
    };
    assert!(matches!(trial.end, End::ErrorEvent(_)), "{:?}", trial.end);
    let rows = workers(&r).await;
    assert!(
        reason(&rows[0]).starts_with("ejected: 3 consecutive timeouts (for 600 ms"),
        "a stalled trial re-admitted the rank: {}",
        rows[0]
    );
    assert_eq!(
        e.requests_received(),
        3,
        "only the trial reached the engine"
    );
}

/// 4. An engine answering 503 to everything while its `/metrics` look idle: clients still
/// succeed (failover), its ranks are ejected, and once it recovers a trial re-admits them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_engine_is_ejected_then_readmitted() {
    let (bad, good) = (engine(vllm(2, 0)).await, engine(vllm(2, 2)).await);
    let r = router(
        &format!("[routing]\neject_after = 3\neject_for = \"300ms\"\n{FAST}"),
        &[toml_of(&bad, 2, 0), toml_of(&good, 2, 2)],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    // The good engine looks busy, the bad one idle: least_kv prefers the bad one.
    good.set_kv_usage(vec![0.9, 0.9]);
    wait_workers(&r, SOON, |rows| rows[2]["kv_usage"] == 0.9).await;
    bad.set_fail(503, 100.0).unwrap();
    let started = Instant::now();
    let mut sent = 0;
    let ejected = |rows: &[Value]| rows[..2].iter().all(|w| w["reason_kind"] == "ejected");
    let rows = loop {
        let reply = chat(r.addr, 1).await;
        sent += 1;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert!(is_on(&reply.worker(), &good), "{}", reply.worker());
        let rows = workers(&r).await;
        if ejected(&rows) {
            break rows;
        }
        assert!(sent < 20, "not ejected after {sent} requests: {rows:#?}");
    };
    let to_eject = started.elapsed();
    for w in rows_of(&rows, &bad) {
        assert_eq!(w["telemetry"], "unavailable");
        assert!(
            reason(w).starts_with("ejected: 3 consecutive 503 (for 300 ms"),
            "{w}"
        );
        let id = w["id"].as_str().unwrap();
        assert_eq!(
            metric(&r, &format!("rankgate_rank_ejected{{worker=\"{id}\"}}")).await,
            1.0
        );
        assert_eq!(
            metric(&r, &format!("rankgate_ejections_total{{worker=\"{id}\"}}")).await,
            1.0
        );
    }
    assert_eq!(bad.requests_received(), 6, "3 failures per rank, no more");
    let retries = r.metrics.retries_total();

    // Still failing when the ejection runs out: the trial fails and the next ejection doubles.
    let mut sent_more = 0;
    loop {
        assert_eq!(chat(r.addr, 1).await.status, 200);
        sent_more += 1;
        let rows = workers(&r).await;
        if rows[..2].iter().all(|w| reason(w).contains("(for 600 ms")) {
            break;
        }
        assert!(sent_more < 400, "no doubled ejection: {rows:#?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    // Mended: the next trial re-admits each rank and it takes traffic again.
    bad.set_fail(503, 0.0).unwrap();
    let mended = Instant::now();
    let served_before: u64 = bad.served().iter().sum();
    let mut sent_recover = 0;
    loop {
        assert_eq!(chat(r.addr, 1).await.status, 200);
        sent_recover += 1;
        let rows = workers(&r).await;
        if rows[..2]
            .iter()
            .all(|w| w["telemetry"] == "available" && w["consecutive_failures"] == 0)
            && bad.served().iter().all(|n| *n > 0)
        {
            break;
        }
        assert!(sent_recover < 400, "not re-admitted: {rows:#?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let to_recover = mended.elapsed();
    assert!(bad.served().iter().sum::<u64>() > served_before);
    for w in ["0", "1"] {
        let s = format!("rankgate_rank_ejected{{worker=\"{}@{w}\"}}", bad.url());
        assert_eq!(metric(&r, &s).await, 0.0);
    }
    // Traffic flows to it again (it looks idle next to the busy good engine).
    let before: u64 = bad.served().iter().sum();
    for _ in 0..4 {
        assert!(is_on(&chat(r.addr, 1).await.worker(), &bad));
    }
    assert_eq!(bad.served().iter().sum::<u64>(), before + 4);
    println!(
        "503 engine: ejected after {sent} client requests in {to_eject:?} ({retries} retries, \
         all clients 200); doubled after {sent_more} more; re-admitted {to_recover:?} after \
         mending ({sent_recover} requests)"
    );
}

/// 5. `/health` answering 503 while `/metrics` look healthy: no traffic reaches the engine and its
/// ranks say why; when health returns, so does traffic.
#[tokio::test]
async fn unhealthy_engine_gets_no_traffic() {
    let sick = engine(SimConfig {
        health_status: 503,
        ..vllm(2, 0)
    })
    .await;
    let well = engine(vllm(2, 2)).await;
    let r = router(FAST, &[toml_of(&sick, 2, 0), toml_of(&well, 2, 2)]).await;
    let rows = wait_workers(&r, SOON, |rows| {
        rows[..2].iter().all(|w| w["reason_kind"] == "health")
            && rows[2..].iter().all(|w| w["telemetry"] == "available")
    })
    .await;
    for w in &rows[..2] {
        assert!(reason(w).starts_with("health: HTTP 503"), "{w}");
        assert_eq!(w["reachable"], false, "{w}");
    }
    for _ in 0..12 {
        let reply = chat(r.addr, 1).await;
        assert_eq!(reply.status, 200);
        assert!(is_on(&reply.worker(), &well));
    }
    assert_eq!(sick.requests_received(), 0);
    assert_eq!(sick.served(), [0, 0]);
    assert!(sick.telemetry_requests() > 0, "its /metrics kept answering");

    sick.set_health_status(200).unwrap();
    wait_state(&r, &[0, 1], "available").await;
    let mut n = 0;
    while sick.served().iter().sum::<u64>() == 0 {
        assert_eq!(chat(r.addr, 1).await.status, 200);
        n += 1;
        assert!(n < 40, "a healthy engine again got no traffic");
    }
}

/// 6. A hung `/v1/models`: telemetry and traffic go on (the hung engine's ranks stay available
/// via `/metrics`; requests for the model go to the engine known to serve it), and shutdown
/// does not wait for the hung call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_models_endpoint_blocks_nothing() {
    let hung = engine(SimConfig {
        hang_models: true,
        ..vllm(2, 0)
    })
    .await;
    let fine = engine(vllm(2, 2)).await;
    let r = router(FAST, &[toml_of(&hung, 2, 0), toml_of(&fine, 2, 2)]).await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    // Ten more polls of the hung engine while its /v1/models call hangs: polling goes on.
    let polls = hung.telemetry_requests();
    until("polls of the hung engine go on", SOON, || {
        hung.telemetry_requests() >= polls + 10
    })
    .await;
    let rows = workers(&r).await;
    assert!(
        rows.iter().all(|w| w["telemetry"] == "available"),
        "{rows:#?}"
    );
    assert_eq!(rows[2]["models"][0], "tiny-llama", "{}", rows[2]);
    // Traffic goes on, to the engine known to serve the model: one whose model list never
    // came is not assumed to serve it (unknown is never capable), and gets none.
    for _ in 0..24 {
        let reply = chat(r.addr, 1).await;
        assert_eq!(reply.status, 200);
        assert!(!is_on(&reply.worker(), &hung), "{}", reply.worker());
    }
    let started = Instant::now();
    timeout(Duration::from_secs(2), r.shutdown())
        .await
        .expect("shutdown waited on the hung /v1/models");
    println!("hung /v1/models: shutdown took {:?}", started.elapsed());
}

/// 7. A fleet answering 503 everywhere gets at most the budgeted extra load, and clients get
/// the engines' own 503 at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_budget_caps_extra_load_when_everything_fails() {
    let cfg = SimConfig {
        fail_percent: 100.0,
        ..vllm(2, 0)
    };
    let a = engine(cfg.clone()).await;
    let b = engine(SimConfig {
        start_rank: 2,
        ..cfg
    })
    .await;
    let r = router(
        &format!("[routing]\neject_after = 0\n{FAST}"),
        &[toml_of(&a, 2, 0), toml_of(&b, 2, 2)],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    const N: usize = 100;
    const CLIENTS: usize = 4;
    let started = Instant::now();
    let addr = r.addr;
    let tasks: Vec<_> = (0..CLIENTS)
        .map(|_| {
            tokio::spawn(async move {
                let mut statuses = Vec::new();
                for _ in 0..N / CLIENTS {
                    let reply = timeout(SOON, chat(addr, 1)).await.expect("no hang");
                    assert_openai_error(&reply.body, 503, Some("ServiceUnavailableError"));
                    let msg = reply.json()["error"]["message"].to_string();
                    assert!(msg.contains("simulated failure"), "not the engine's: {msg}");
                    statuses.push(reply.status.as_u16());
                }
                statuses
            })
        })
        .collect();
    for t in tasks {
        let statuses = t.await.unwrap();
        assert!(statuses.iter().all(|s| *s == 503));
    }
    let took = started.elapsed();
    let received = a.requests_received() + b.requests_received();
    let extra = received - N as u64;
    let refused = metric(&r, "rankgate_retries_refused_total").await;
    let retries = metric(&r, "rankgate_retries_total").await;
    // The budget: 20% of the requests, plus a reserve of 2/s over its 10 s window (20 retries,
    // available at once), for a test well under 10 s.
    assert!(took < Duration::from_secs(9), "{took:?}");
    let allowed = (N as f64 * 0.2) as u64 + 20;
    assert!(extra <= allowed + 2, "extra load {extra} > {allowed} (+2)");
    assert!(extra > 0, "no retry at all");
    assert_eq!(
        retries, extra as f64,
        "every retry is one extra engine request"
    );
    assert!(refused > 0.0);
    // Without the budget each request would make 3 attempts: 2N extra.
    println!(
        "retry budget: {N} requests -> {received} at the engines (+{extra}, cap {allowed}, \
         unbudgeted would be +{}); {refused} retries refused; {took:?}",
        2 * N
    );
}

/// Writes `head` then `body` on a raw connection, optionally closes the write side, and returns
/// what comes back until the server closes or a whole response with a Content-Length arrived.
async fn raw_exchange(addr: SocketAddr, head: &str, body: &[u8], half_close: bool) -> String {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    if half_close {
        s.shutdown().await.unwrap();
    }
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + SOON;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match timeout(left, s.read(&mut buf)).await {
            Err(_) => panic!(
                "no answer within {SOON:?}: {}",
                String::from_utf8_lossy(&got)
            ),
            Ok(Ok(0)) | Ok(Err(_)) => break,
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
        let text = String::from_utf8_lossy(&got);
        if let Some((h, b)) = text.split_once("\r\n\r\n") {
            let len = h.lines().find_map(|l| {
                l.to_ascii_lowercase()
                    .strip_prefix("content-length:")
                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
            });
            if len.is_some_and(|n| b.len() >= n) {
                break;
            }
        }
    }
    String::from_utf8_lossy(&got).into_owned()
}

/// A 400 in the OpenAI shape, or nothing at all (the client is gone); never 502.
fn assert_client_fault(answer: &str, what: &str) -> bool {
    if answer.is_empty() {
        return false;
    }
    assert!(
        answer.starts_with("HTTP/1.1 400"),
        "{what}: expected 400, got {answer}"
    );
    let body = answer.split_once("\r\n\r\n").unwrap().1;
    assert_openai_error(body.as_bytes(), 400, Some("BadRequestError"));
    true
}

/// 8. A client body broken mid-way is the client's fault: 400 (or a closed connection), never
/// 502, and no failure counted against any rank, whether the body was kept for retries or
/// streamed to the engine.
#[tokio::test]
async fn broken_client_body_is_400_and_never_counts_against_the_engine() {
    let e = engine(vllm(2, 0)).await;
    let r = router(
        &format!("[routing]\nretry_buffer_bytes = 1024\neject_after = 1\n{FAST}"),
        &[toml_of(&e, 2, 0)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    let head = |extra: &str| {
        format!("POST /v1/chat/completions HTTP/1.1\r\nhost: rankgate\r\ncontent-type: application/json\r\n{extra}\r\n")
    };
    let mut answered = 0;
    // Cut short, small enough to be read whole before any rank is picked.
    let a = raw_exchange(
        r.addr,
        &head("content-length: 500\r\n"),
        br#"{"model": "tiny"#,
        true,
    )
    .await;
    answered += assert_client_fault(&a, "short body, kept") as u32;
    // Invalid chunked encoding: the connection stays open, so the 400 must arrive.
    let b = raw_exchange(
        r.addr,
        &head("transfer-encoding: chunked\r\n"),
        b"10\r\n{\"model\": \"tiny\"\r\nZZ\r\n",
        false,
    )
    .await;
    assert!(
        assert_client_fault(&b, "bad chunking"),
        "no answer to bad chunking"
    );
    answered += 1;
    // Larger than retry_buffer_bytes: it streams to the engine and breaks on the way.
    let big = vec![b' '; 4000];
    let c = raw_exchange(r.addr, &head("content-length: 100000\r\n"), &big, true).await;
    answered += assert_client_fault(&c, "short body, streamed") as u32;
    let d = raw_exchange(
        r.addr,
        &head("transfer-encoding: chunked\r\n"),
        &[b"FA0\r\n".as_slice(), &big, b"\r\nnope\r\n"].concat(),
        false,
    )
    .await;
    assert!(assert_client_fault(&d, "bad chunking, streamed"));
    answered += 1;

    let rows = workers(&r).await;
    for w in &rows {
        assert_eq!(w["consecutive_failures"], 0, "{w}");
        assert_eq!(w["telemetry"], "available", "{w}");
    }
    assert_eq!(metric(&r, "rankgate_retries_total").await, 0.0);
    // The engine still serves (nothing was ejected with eject_after = 1).
    assert_eq!(chat(r.addr, 1).await.status, 200);
    println!("broken client bodies: {answered}/4 answered 400, the rest closed");
}

/// 9. Admission: past `max_in_flight` a request gets 429 with Retry-After at once, and nothing
/// reaches an engine; a slot frees when a stream ends.
#[tokio::test]
async fn admission_refuses_past_max_in_flight() {
    let e = engine(SimConfig {
        decode_tokens_per_sec: 20.0,
        ..vllm(2, 0)
    })
    .await;
    let r = router(&format!("max_in_flight = 2\n{FAST}"), &[toml_of(&e, 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    let s1 = timeout(SOON, stream_chat(r.addr, 200)).await.unwrap();
    let s2 = timeout(SOON, stream_chat(r.addr, 200)).await.unwrap();
    assert_eq!((s1.status().as_u16(), s2.status().as_u16()), (200, 200));
    let started = Instant::now();
    let third = chat(r.addr, 1).await;
    assert_eq!(third.status, 429);
    assert!(started.elapsed() < Duration::from_millis(500));
    assert_eq!(third.headers["retry-after"], "1");
    assert_openai_error(&third.body, 429, Some("RateLimitError"));
    assert_eq!(e.requests_received(), 2);
    drop((s1, s2));
    let mut n = 0;
    loop {
        let reply = chat(r.addr, 1).await;
        if reply.status == 200 {
            break;
        }
        assert_eq!(reply.status, 429);
        n += 1;
        assert!(n < 100, "admission slots never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// 10. A transport failure counts against every rank of its engine: refused connections eject
/// the whole engine, each request failing over to another engine meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transport_failures_eject_the_whole_engine() {
    let dead = engine(vllm(2, 0)).await;
    let alive = engine(SimConfig {
        kv_usage: vec![0.85, 0.85],
        ..vllm(2, 2)
    })
    .await;
    // Polls far apart: the dead engine still looks fine when the requests meet it.
    let r = router(
        "[routing]\neject_after = 3\neject_for = \"5s\"\n\
         [telemetry]\ninterval = \"3s\"\nstale_after = \"6s\"\n",
        &[toml_of(&dead, 2, 0), toml_of(&alive, 2, 2)],
    )
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    // Pinned before the first poll ends: `alive` looks busier, so least_kv picks `dead` first.
    assert_eq!(workers(&r).await[2]["kv_usage"], 0.85);
    timeout(SOON, dead.kill()).await.unwrap();
    let killed = Instant::now();
    // Only the next poll (3 s away) would see the kill; the front door finds out by itself.
    let rows = workers(&r).await;
    assert!(rows[..2].iter().all(|w| w["telemetry"] == "available"));
    let mut n = 0;
    let rows = loop {
        let reply = chat(r.addr, 1).await;
        n += 1;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert!(is_on(&reply.worker(), &alive), "{}", reply.worker());
        let rows = workers(&r).await;
        // Engine-wide: both ranks of the dead engine count every refused connection.
        assert_eq!(rows[0]["consecutive_failures"], n.min(3));
        assert_eq!(rows[1]["consecutive_failures"], n.min(3));
        if rows[..2].iter().all(|w| w["reason_kind"] == "ejected") {
            break rows;
        }
        assert!(n < 10, "not ejected: {rows:#?}");
    };
    let to_eject = killed.elapsed();
    for w in &rows[..2] {
        assert!(
            reason(w).starts_with("ejected: 3 consecutive transport errors"),
            "{w}"
        );
    }
    assert_eq!(
        n, 3,
        "one refused connection per request, each against both ranks"
    );
    assert_eq!(
        r.metrics.retries_total(),
        3,
        "each refused request failed over once, to the other engine"
    );
    assert!(rows[2..].iter().all(|w| w["consecutive_failures"] == 0));
    println!("dead engine: both ranks ejected after {n} requests, {to_eject:?} after the kill");
}

/// 10b. An engine's 4xx is the client's business: passed through as the engine wrote it, never
/// retried, never counted against the rank.
#[tokio::test]
async fn engine_4xx_never_counts() {
    let picky = engine(sim(Flavor::Sglang, 2, 4)).await;
    let r = router(
        &format!("[routing]\neject_after = 1\n{FAST}"),
        &[engine_toml(&picky.url(), "sglang", 2, 4)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    for (status, kind) in [(400, "BadRequestError"), (429, "RateLimitError")] {
        picky.set_fail(status, 100.0).unwrap();
        for _ in 0..4 {
            let reply = chat(r.addr, 1).await;
            assert_eq!(reply.status, status);
            let v = assert_openai_error(&reply.body, status, Some(kind));
            assert!(v["error"]["message"]
                .as_str()
                .unwrap()
                .contains("simulated"));
        }
    }
    assert_eq!(picky.requests_received(), 8, "a 4xx is never retried");
    let rows = workers(&r).await;
    for w in &rows {
        assert_eq!(w["consecutive_failures"], 0, "{w}");
        assert_eq!(w["reason"], Value::Null, "{w}");
    }
    assert_eq!(r.metrics.retries_total(), 0);
    picky.set_fail(400, 0.0).unwrap();
    assert_eq!(chat(r.addr, 1).await.status, 200);
}

/// Engine connections outlive their requests: requests one after another ride one
/// connection; a stream the client abandons does not hand its connection (still busy with
/// the stream) to the next request; and after the engine restarts on its port, which kills
/// every kept connection, the next requests are served on a new one rather than failed on
/// a dead one.
#[tokio::test]
async fn engine_connections_are_reused_and_dead_ones_replaced() {
    let cfg = SimConfig {
        decode_tokens_per_sec: 50.0,
        ..vllm(1, 0)
    };
    let e = engine(cfg.clone()).await;
    // One runtime: each core keeps its own connections (thread-per-core, the default), and
    // which core a client connection lands on is the kernel's choice.
    let one_core = format!("thread_per_core = false\n{FAST}");
    let r = router(&one_core, &[toml_of(&e, 1, 0)]).await;
    wait_state(&r, &[0], "available").await;
    let chats = |e: &SimEngine| -> Vec<SocketAddr> {
        (e.seen().into_iter())
            .filter(|s| s.path == "/v1/chat/completions")
            .map(|s| s.peer.expect("the sim records the connection"))
            .collect()
    };
    for _ in 0..10 {
        assert_eq!(timeout(SOON, chat(r.addr, 2)).await.unwrap().status, 200);
    }
    let peers = chats(&e);
    assert_eq!(peers.len(), 10);
    assert!(
        peers.iter().all(|p| *p == peers[0]),
        "ten requests in turn, one engine connection: {peers:?}"
    );

    // A stream left after its first bytes: its connection is still carrying it.
    let mut abandoned = timeout(SOON, stream_chat(r.addr, 100)).await.unwrap();
    let first = timeout(SOON, abandoned.body_mut().frame()).await.unwrap();
    assert!(first.is_some_and(|f| f.is_ok()), "the stream started");
    drop(abandoned);
    let reply = timeout(SOON, chat(r.addr, 2))
        .await
        .expect("not stuck behind the stream");
    assert_eq!(reply.status, 200);
    let peers = chats(&e);
    assert_ne!(
        peers[peers.len() - 1],
        peers[peers.len() - 2],
        "the request after the abandoned stream took another connection"
    );

    // Restarted on the same port: every connection kept to it is dead.
    let addr: SocketAddr = e.url().trim_start_matches("http://").parse().unwrap();
    e.kill().await;
    let e = SimEngine::start(addr, cfg)
        .await
        .expect("restart on its port");
    wait_state(&r, &[0], "available").await;
    for _ in 0..5 {
        let reply = timeout(SOON, chat(r.addr, 2)).await.unwrap();
        assert_eq!(
            reply.status, 200,
            "served after the restart: {:?}",
            reply.body
        );
    }
    let peers = chats(&e);
    assert_eq!(peers.len(), 5, "each request reached the engine once");
    assert!(peers.iter().all(|p| *p == peers[0]), "{peers:?}");
    let rows = workers(&r).await;
    assert_eq!(
        rows[0]["consecutive_failures"], 0,
        "no request failed on a dead connection"
    );
}

/// `server.max_engine_connections` bounds the sockets to an engine, not only the requests in
/// flight: with every core keeping its own idle connections, a core with none takes another
/// core's once the engine has its limit open. Requests beyond the limit wait for a slot and
/// are all served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn engine_sockets_stay_within_max_engine_connections() {
    let e = engine(vllm(1, 0)).await;
    let r = router(
        &format!("max_engine_connections = 2\n{FAST}"),
        &[toml_of(&e, 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;
    for _ in 0..5 {
        let replies = futures_join(r.addr, 8).await;
        assert!(replies.iter().all(|s| *s == 200), "{replies:?}");
    }
    let peers: std::collections::HashSet<_> = (e.seen().into_iter())
        .filter(|s| s.path == "/v1/chat/completions")
        .map(|s| s.peer)
        .collect();
    assert_eq!(e.requests_received(), 40);
    assert!(
        peers.len() <= 2,
        "{} engine connections: {peers:?}",
        peers.len()
    );
}

/// `n` chat completions at once, each on a client connection of its own; their statuses.
async fn futures_join(addr: SocketAddr, n: usize) -> Vec<u16> {
    let tasks: Vec<_> = (0..n)
        .map(|_| tokio::spawn(async move { timeout(SOON, chat(addr, 2)).await }))
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap().map_or(0, |r| r.status.as_u16()));
    }
    out
}

/// The next request on a fake engine's connection, read whole (head and Content-Length body)
/// and taken out of `got`: its head, lowercased; `None` once the client is gone.
async fn next_request(s: &mut TcpStream, got: &mut Vec<u8>) -> Option<String> {
    let end = loop {
        if let Some(p) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
        read_more(s, got).await?;
    };
    let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
    let length: usize = (head.lines())
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse().unwrap_or(0));
    while got.len() < end + length {
        read_more(s, got).await?;
    }
    got.drain(..end + length);
    Some(head)
}

/// Reads what the client sent next onto `got`; `None` once it is gone.
async fn read_more(s: &mut TcpStream, got: &mut Vec<u8>) -> Option<()> {
    let mut buf = [0u8; 8192];
    let n = s.read(&mut buf).await.ok().filter(|&n| n > 0)?;
    got.extend_from_slice(&buf[..n]);
    Some(())
}

/// What a fake engine answers to telemetry and model-list requests: the real vLLM DP=2
/// captures (content type, body); `None` for anything else.
fn captured(head: &str) -> Option<(&'static str, &'static str)> {
    if head.starts_with("get /metrics") {
        Some((
            "text/plain",
            include_str!("../fixtures/vllm-0.32-dp2-metrics.txt"),
        ))
    } else if head.starts_with("get /v1/models") {
        Some((
            "application/json",
            include_str!("../fixtures/vllm-0.32-models.json"),
        ))
    } else {
        None
    }
}

/// An engine that closes each connection right after its answer without saying so (no
/// `Connection: close`; HTTP/1.1 lets a server close an idle connection at any time): chat
/// completions get vLLM's captured answer, `/metrics` the DP=2 capture, `/v1/models` the
/// model list. Returns its address and how many chat completions it answered.
async fn engine_closing_after_each_answer(
) -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let chats = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = chats.clone();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let chats = counted.clone();
            tokio::spawn(async move {
                let Some(head) = next_request(&mut s, &mut Vec::new()).await else {
                    return;
                };
                let (kind, body) = captured(&head).unwrap_or_else(|| {
                    if head.starts_with("post /v1/chat/completions") {
                        chats.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    }
                    (
                        "application/json",
                        include_str!("../fixtures/vllm-0.32-chat.json"),
                    )
                });
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
                // Closed here, with nothing said about it.
            });
        }
    });
    (addr, chats)
}

/// An engine whose answers are in two pieces, the second a while after the first and
/// beginning with the bytes of an HTTP 431 status line (model output can say anything).
async fn engine_with_a_431_inside_its_answer() -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut got = Vec::new();
                while let Some(head) = next_request(&mut s, &mut got).await {
                    let (kind, first, second) = match captured(&head) {
                        Some((kind, body)) => (kind, body, ""),
                        None => (
                            "text/plain",
                            "the engine says: ",
                            "HTTP/1.1 431 Request Header Fields Too Large\r\nand more text",
                        ),
                    };
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\n\r\n{first}",
                        first.len() + second.len()
                    );
                    if s.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                    if !second.is_empty() {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        if s.write_all(second.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                }
            });
        }
    });
    addr
}

/// The bytes of a 431 status line inside an engine's answer are the answer's: the client gets
/// all of it, and the next request on the connection is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_holding_a_431_status_line_reaches_the_client_whole() {
    let addr = engine_with_a_431_inside_its_answer().await;
    let r = router(
        FAST,
        &[engine_toml(&format!("http://{addr}"), "vllm", 2, 0)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    let mut s = TcpStream::connect(r.addr).await.unwrap();
    let body = chat_body(2, false);
    for _ in 0..3 {
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: rankgate\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let whole = timeout(SOON, async {
            loop {
                let n = s.read(&mut buf).await.unwrap();
                assert!(n > 0, "closed: {}", String::from_utf8_lossy(&got));
                got.extend_from_slice(&buf[..n]);
                if got.ends_with(b"and more text") {
                    return;
                }
            }
        })
        .await;
        let text = String::from_utf8_lossy(&got);
        assert!(whole.is_ok(), "the answer stopped short: {text}");
        assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
    }
}

/// Against such an engine every request is served: one that goes out on a kept connection the
/// engine had already closed is sent again on a new one (the engine never had it), and the
/// engine is not counted as failing for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_closing_kept_connections_unannounced_loses_no_request() {
    // Two such engines: a request whose kept connection was reset (the engine had closed it
    // before reading) is sent again, on any of them, as no retry; one that found a plain close
    // after it went out (the engine might have read it) is a transport failure, retried on the
    // other engine as any such failure is.
    let (a, a_chats) = engine_closing_after_each_answer().await;
    let (b, b_chats) = engine_closing_after_each_answer().await;
    // Each its own DP deployment (no start_rank).
    let own =
        |addr| format!("[[engines]]\nurl = \"http://{addr}\"\nflavor = \"vllm\"\ndp_size = 2\n");
    let engines = [own(a), own(b)];
    let r = router(&format!("thread_per_core = false\n{FAST}"), &engines).await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    let mut statuses = Vec::new();
    // The race (a kept connection taken just before the engine's close arrives) is hit a few
    // times in a few hundred requests.
    for _ in 0..80 {
        statuses.extend(futures_join(r.addr, 10).await);
    }
    let failed: Vec<_> = statuses.iter().filter(|s| **s != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of 800 failed: {failed:?}",
        failed.len()
    );
    let reached = a_chats.load(std::sync::atomic::Ordering::SeqCst)
        + b_chats.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(reached, 800, "each reached an engine once");
}
