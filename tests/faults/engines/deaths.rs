//! Engines that die or hang, over real sockets: killed under streaming load, hung (504 after
//! `response_timeout`), stalled mid-stream (an error event after `stream_idle_timeout`, and a rank
//! ejected when its streams keep stalling), and a hung `/v1/models` that blocks nothing.

use std::time::Duration;

use http_body_util::BodyExt;
use rankgate_sim::sim::SimConfig;
use serde_json::Value;
use tokio::time::{timeout, Instant};

use super::helpers::*;
use crate::common::*;

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
