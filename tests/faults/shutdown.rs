//! A rollout's shutdown, over real sockets: the real binary under SIGTERM with streams in flight
//! (`/ready` 503, streams finish, exit 0, new connections refused after `shutdown_delay`), a
//! second signal (exit 130 at once), and [`Router::shutdown`] in process (waits for streams,
//! cuts the ones that outlive `drain_grace`).
//!
//! [`Rankgate`] (in `common::binary`) runs the binary.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::BodyExt;
use tokio::time::{timeout, Instant};

use crate::common::binary::Rankgate;
use crate::common::*;
use rankgate_sim::sim::SimConfig;

/// GET `path` with a bound: `None` when no answer came (refused, reset, timed out).
pub async fn try_get(addr: SocketAddr, path: &str, limit: Duration) -> Option<(u16, String)> {
    let req = http::Request::get(format!("http://{addr}{path}"))
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    let resp = timeout(limit, client().request(req)).await.ok()?.ok()?;
    let status = resp.status().as_u16();
    let body = timeout(limit, resp.into_body().collect())
        .await
        .ok()?
        .ok()?
        .to_bytes();
    Some((status, String::from_utf8_lossy(&body).into_owned()))
}

/// Polls `path` until it answers `status` (bounded); each check is a real request.
pub async fn wait_status(addr: SocketAddr, path: &str, status: u16, limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut last = None;
    while Instant::now() < deadline {
        last = try_get(addr, path, Duration::from_secs(1)).await;
        if last.as_ref().is_some_and(|(s, _)| *s == status) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{addr}{path} did not answer {status} within {limit:?}; last: {last:?}");
}

/// A simulated engine decoding `tps` tokens a second whatever its batch, for streams of a known
/// length.
pub async fn slow_engine(tps: f64) -> rankgate_sim::sim::SimEngine {
    engine(SimConfig {
        decode_tokens_per_sec: tps,
        batch_slowdown: 0.0,
        ..SimConfig::default()
    })
    .await
}

/// What a streamed chat came to: its text, and the error that cut it, if any.
pub struct Streamed {
    pub text: String,
    pub error: Option<String>,
    pub ended: Instant,
}

impl Streamed {
    pub fn done(&self) -> bool {
        self.error.is_none() && self.text.trim_end().ends_with("data: [DONE]")
    }

    /// The stream ended cleanly with rankgate's shutdown error event as its last event (what
    /// the README promises a cut stream ends with).
    pub fn assert_cut_with_shutdown_event(&self) {
        assert!(
            self.error.is_none(),
            "cut as a transport error: {:?}",
            self.error
        );
        let events: Vec<&str> = self.text.split("\n\n").filter(|e| !e.is_empty()).collect();
        let last = events.last().expect("events");
        let json: serde_json::Value = serde_json::from_str(
            last.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("last event: {last}")),
        )
        .unwrap_or_else(|e| panic!("last event {last}: {e}"));
        assert_eq!(json["error"]["type"], "ShuttingDown", "{last}");
        assert_eq!(json["error"]["code"], 503, "{last}");
    }
}

/// Opens a streaming chat, waits for its response head (so it is in flight), and returns a task
/// reading it to the end, bounded by `limit`.
pub async fn open_stream(
    addr: SocketAddr,
    max_tokens: u64,
    limit: Duration,
) -> tokio::task::JoinHandle<Streamed> {
    let resp = timeout(Duration::from_secs(10), stream_chat(addr, max_tokens))
        .await
        .expect("stream head within 10 s");
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    tokio::spawn(async move {
        let mut text = Vec::new();
        let deadline = Instant::now() + limit;
        let error = loop {
            match tokio::time::timeout_at(deadline, body.frame()).await {
                Err(_) => break Some(format!("not ended within {limit:?}")),
                Ok(None) => break None,
                Ok(Some(Err(e))) => break Some(e.to_string()),
                Ok(Some(Ok(f))) => {
                    if let Ok(d) = f.into_data() {
                        text.extend_from_slice(&d);
                    }
                }
            }
        };
        Streamed {
            text: String::from_utf8_lossy(&text).into_owned(),
            error,
            ended: Instant::now(),
        }
    })
}

fn binary_config(engine_url: &str, server: &str) -> String {
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{server}\n{FAST}\n{}",
        engine_toml(engine_url, "vllm", 2, 0)
    )
}

/// SIGTERM with 20 streams in flight: `/ready` turns 503 at once, a request during
/// `shutdown_delay` is still served, new connections are refused after it, every stream ends
/// with `[DONE]`, and the process exits 0 right after the last one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_twenty_streams_then_exits_0() {
    // 40 tokens at 16 tokens/s: each stream lasts 2.5 s.
    let e = slow_engine(16.0).await;
    let mut rg = Rankgate::start(
        "sigterm",
        &binary_config(&e.url(), "shutdown_delay = \"1s\"\ndrain_grace = \"20s\"\n"),
        None,
    )
    .await;
    wait_status(rg.admin_addr, "/ready", 200, Duration::from_secs(10)).await;

    let mut streams = Vec::new();
    for _ in 0..20 {
        streams.push(open_stream(rg.addr, 40, Duration::from_secs(15)).await);
    }
    let opened = Instant::now();
    rg.signal(libc::SIGTERM);
    let term = Instant::now();

    // /ready is 503 during the drain (polled: the signal is handled asynchronously).
    wait_status(rg.admin_addr, "/ready", 503, Duration::from_secs(2)).await;
    let ready_503 = term.elapsed();
    // Still inside shutdown_delay: a new client on a new connection is served.
    let served = timeout(Duration::from_secs(2), chat(rg.addr, 2))
        .await
        .expect("request during shutdown_delay");
    let served_at = term.elapsed();
    assert_eq!(served.status, 200, "{:?}", served.body);
    assert!(
        served_at < Duration::from_secs(1),
        "the check request came too late ({served_at:?}) to prove serving during shutdown_delay"
    );

    // After the delay the listener is gone: connecting is refused (bounded poll).
    let refused_at = {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            match tokio::net::TcpStream::connect(rg.addr).await {
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    break term.elapsed()
                }
                Err(e) => panic!("connect: {e}"),
                Ok(_) => {}
            }
            assert!(
                Instant::now() < deadline,
                "still accepting 5 s after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    assert!(
        refused_at >= Duration::from_millis(950),
        "stopped accepting after {refused_at:?}, before shutdown_delay (1 s)"
    );
    // The admin listener still answers while streams drain.
    let r = try_get(rg.admin_addr, "/ready", Duration::from_secs(1)).await;
    assert_eq!(r.map(|r| r.0), Some(503));

    let mut last_end = opened;
    for (i, s) in streams.into_iter().enumerate() {
        let s = s.await.unwrap();
        assert!(
            s.done(),
            "stream {i} did not end with [DONE]: error {:?}, tail {:?}",
            s.error,
            &s.text[s.text.len().saturating_sub(200)..]
        );
        last_end = last_end.max(s.ended);
    }
    let status = rg
        .wait_exit(Duration::from_secs(5))
        .await
        .expect("rankgate exits after the drain");
    let exit_after_last = last_end.elapsed();
    assert_eq!(status.code(), Some(0), "{}", rg.log().join("\n"));
    assert!(
        exit_after_last < Duration::from_secs(2),
        "exited {exit_after_last:?} after the last stream ended"
    );
    // The reader thread may not have passed on the last lines yet.
    rg.wait_log("drained; exiting", Duration::from_secs(2))
        .await;
    eprintln!(
        "sigterm: /ready 503 after {ready_503:?}; served during delay at {served_at:?}; \
         refused from {refused_at:?}; 20 streams [DONE], last {:?} after SIGTERM; \
         exit 0 {exit_after_last:?} after it",
        last_end - term
    );
}

/// A second signal ends the drain at once: exit 130 with a stream still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_signal_exits_130_at_once() {
    // 200 tokens at 10 tokens/s: 20 s, far longer than the test.
    let e = slow_engine(10.0).await;
    let mut rg = Rankgate::start(
        "second-signal",
        &binary_config(&e.url(), "drain_grace = \"60s\"\n"),
        None,
    )
    .await;
    wait_status(rg.admin_addr, "/ready", 200, Duration::from_secs(10)).await;
    let stream = open_stream(rg.addr, 200, Duration::from_secs(10)).await;
    rg.signal(libc::SIGTERM);
    rg.wait_log("shutting down", Duration::from_secs(5)).await;
    // Draining, with the stream still going.
    assert!(!stream.is_finished());
    let second = Instant::now();
    rg.signal(libc::SIGINT);
    let status = rg
        .wait_exit(Duration::from_secs(3))
        .await
        .expect("exit soon after the second signal");
    let took = second.elapsed();
    assert_eq!(status.code(), Some(130), "{}", rg.log().join("\n"));
    assert!(took < Duration::from_secs(1), "exit took {took:?}");
    let s = stream.await.unwrap();
    assert!(!s.done(), "the stream cannot have finished: {}", s.text);
    s.assert_cut_with_shutdown_event();
    eprintln!(
        "second signal: exit 130 {took:?} after it; the open stream was cut ({:?})",
        s.error
    );
}

/// An engine and `rankgate serve` before it, returned as soon as rankgate has logged that its
/// signal handlers are in place, before any port binds.
async fn starting(name: &str) -> (rankgate_sim::sim::SimEngine, Rankgate) {
    let e = slow_engine(16.0).await;
    let rg = Rankgate::start_until(
        name,
        &binary_config(&e.url(), ""),
        None,
        Some("SIGHUP reloads; starting"),
    )
    .await;
    (e, rg)
}

/// Signals sent while rankgate starts (its handlers are in place before any port binds): a SIGHUP
/// neither kills it nor is lost (the reload follows once it serves), and a SIGTERM then drains
/// and exits 0 rather than dying of the signal's default action.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_sent_while_starting_are_acted_on_once_serving() {
    let (_e, mut rg) = starting("early-signals").await;
    rg.signal(libc::SIGHUP);
    rg.serving().await;
    rg.wait_log("SIGHUP: config reloaded", Duration::from_secs(10))
        .await;
    wait_status(rg.admin_addr, "/ready", 200, Duration::from_secs(10)).await;
    rg.signal(libc::SIGTERM);
    let status = rg
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("exit after the drain");
    assert_eq!(status.code(), Some(0), "{}", rg.log().join("\n"));
    assert_eq!(rg.count("shutting down"), 1, "{}", rg.log().join("\n"));
}

/// A SIGTERM sent while rankgate starts: it serves, then drains at once and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sigterm_while_starting_drains_and_exits_0() {
    let (_e, mut rg) = starting("early-term").await;
    rg.signal(libc::SIGTERM);
    let status = rg
        .wait_exit(Duration::from_secs(10))
        .await
        .expect("exit after the drain");
    assert_eq!(status.code(), Some(0), "{}", rg.log().join("\n"));
    assert_eq!(rg.count("rankgate serving"), 1, "{}", rg.log().join("\n"));
    assert_eq!(rg.count("drained; exiting"), 1, "{}", rg.log().join("\n"));
}

/// In process: `Router::shutdown` waits for streams in flight, and one longer than
/// `drain_grace` is cut when the grace expires.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn router_shutdown_waits_for_streams_and_cuts_at_grace() {
    let e = slow_engine(16.0).await;
    let engines = [engine_toml(&e.url(), "vllm", 2, 0)];

    // Streams shorter than the grace: shutdown returns once they have ended, not before.
    let r = router(&format!("drain_grace = \"5s\"\n{FAST}"), &engines).await;
    wait_state(&r, &[0, 1], "available").await;
    let mut streams = Vec::new();
    for _ in 0..5 {
        // 24 tokens at 16 tokens/s: 1.5 s.
        streams.push(open_stream(r.addr, 24, Duration::from_secs(10)).await);
    }
    let t0 = Instant::now();
    timeout(Duration::from_secs(8), r.shutdown())
        .await
        .expect("shutdown within the grace");
    let returned = Instant::now();
    let mut last_end = t0;
    for (i, s) in streams.into_iter().enumerate() {
        let s = s.await.unwrap();
        assert!(s.done(), "stream {i}: {:?} {}", s.error, s.text);
        last_end = last_end.max(s.ended);
    }
    assert!(
        returned + Duration::from_millis(100) >= last_end,
        "shutdown returned {:?} before the last stream ended",
        last_end - returned
    );
    assert!(
        returned - last_end < Duration::from_secs(1),
        "shutdown returned {:?} after the last stream ended",
        returned - last_end
    );
    let waited = returned - t0;

    // A stream longer than the grace: shutdown returns at the grace, and the stream is cut.
    let r = router(&format!("drain_grace = \"1s\"\n{FAST}"), &engines).await;
    wait_state(&r, &[0, 1], "available").await;
    // 160 tokens at 16 tokens/s: 10 s.
    let long = open_stream(r.addr, 160, Duration::from_secs(15)).await;
    let t0 = Instant::now();
    timeout(Duration::from_secs(5), r.shutdown())
        .await
        .expect("shutdown within ~drain_grace");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(950) && took < Duration::from_millis(2000),
        "shutdown with a 1 s grace took {took:?}"
    );
    let s = timeout(Duration::from_secs(2), long)
        .await
        .expect("the stream outliving the grace is cut when shutdown returns")
        .unwrap();
    assert!(!s.done(), "the long stream cannot have finished");
    s.assert_cut_with_shutdown_event();
    let cut_after = s.ended - t0;
    assert!(
        cut_after < Duration::from_millis(1500),
        "stream cut {cut_after:?} after shutdown began (grace 1 s)"
    );
    eprintln!(
        "Router::shutdown: waited {waited:?} for 5 streams; with a 1 s grace returned after \
         {took:?}, the 10 s stream cut at {cut_after:?} ({:?})",
        s.error
    );
}
