//! Clients that stop reading: a client that takes nothing of its streamed answer for
//! `send_timeout` is cut, and its engine request with it (the engine frees its KV), counted as
//! `rankgate_streams_cut_total{reason="send_timeout"}`; a slow client that keeps reading is
//! not; one address's streams stop at `max_streams_per_client` (429) while another address is
//! served; and one address holds at most half of an engine's connection slots.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::{timeout, Instant};

use rankgate::app::Router;
use rankgate_sim::sim::{SimConfig, SimEngine};

use crate::common::*;

const CUT: &str = "rankgate_streams_cut_total{reason=\"send_timeout\"}";

/// The value of one series of rankgate's `/metrics`.
fn metric(r: &Router, series: &str) -> u64 {
    let page = r.metrics.render();
    (page.lines())
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{series} not in /metrics:\n{page}"))
}

/// An engine that decodes as fast as it can, with room for very long answers: a client that
/// reads nothing fills its socket at once.
async fn fast_engine() -> SimEngine {
    engine(SimConfig {
        decode_tokens_per_sec: 100_000.0,
        capacity_tokens: 4_000_000,
        ..SimConfig::default()
    })
    .await
}

async fn router_for(e: &SimEngine, server: &str) -> Router {
    let r = router_with(server, FAST, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    r
}

/// A streamed chat of `max_tokens` sent from `127.0.0.<from>` over a socket with a 4 KB receive
/// buffer; the caller reads it (or never does).
async fn stream_from(from: u8, to: SocketAddr, max_tokens: u64) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let src = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, from)), 0);
    socket.bind(src).expect("bind a loopback source address");
    let mut s = timeout(SOON, socket.connect(to))
        .await
        .expect("connect in time")
        .expect("connect");
    let body = format!(
        r#"{{"model":"tiny-llama","messages":[{{"role":"user","content":"hi"}}],"stream":true,"max_tokens":{max_tokens}}}"#
    );
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: rankgate\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("send the request");
    s
}

/// Reads `s` until `done` holds for what came, the connection ends, or `limit` passes; what came.
async fn read_until(
    s: &mut TcpStream,
    limit: Duration,
    pace: Option<Duration>,
    done: impl Fn(&[u8]) -> bool,
) -> Vec<u8> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let deadline = Instant::now() + limit;
    while !done(&got) && Instant::now() < deadline {
        match tokio::time::timeout_at(deadline, s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => break,
        }
        if let Some(p) = pace {
            tokio::time::sleep(p).await;
        }
    }
    got
}

const SOON: Duration = Duration::from_secs(5);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_and_its_engine_request_ends() {
    let e = fast_engine().await;
    let r = router_for(&e, "send_timeout = \"1s\"").await;
    // A stream of a million tokens (10 s at the engine's pace), never read.
    let mut s = stream_from(2, r.addr, 1_000_000).await;
    until("the engine runs the request", SOON, || {
        e.running().iter().sum::<u32>() == 1
    })
    .await;
    let started = Instant::now();
    until(
        "the stream is cut for send_timeout",
        Duration::from_secs(8),
        || metric(&r, CUT) == 1,
    )
    .await;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(900),
        "cut after {took:?}, before send_timeout"
    );
    until("the engine's request ends", SOON, || {
        e.running().iter().sum::<u32>() == 0
    })
    .await;
    until("the engine's KV is released", SOON, || {
        e.kv_usage().iter().all(|&k| k == 0.0)
    })
    .await;
    // What the kernel held for the client still comes, then the end: no `[DONE]`.
    let got = read_until(&mut s, SOON, None, |_| false).await;
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got[..got.len().min(200)])
    );
    assert!(
        !got.windows(6).any(|w| w == b"[DONE]"),
        "a cut stream never ends as complete"
    );
    // Not a client that left: rankgate cut it.
    let abandoned = r.metrics.render();
    assert!(
        !(abandoned.lines()).any(|l| l.starts_with("rankgate_requests_abandoned_total")
            && l.contains("mid_stream")
            && !l.ends_with(" 0")),
        "counted as send_timeout, not as abandoned:\n{abandoned}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_client_that_keeps_reading_is_not_cut() {
    let e = fast_engine().await;
    let r = router_for(&e, "send_timeout = \"1s\"").await;
    // About 70 KB of events, read 4 KB at a time every 50 ms: the writes wait, never for 1 s.
    let mut s = stream_from(3, r.addr, 400).await;
    let got = read_until(
        &mut s,
        Duration::from_secs(20),
        Some(Duration::from_millis(50)),
        |g| g.windows(6).any(|w| w == b"[DONE]"),
    )
    .await;
    assert!(
        got.windows(6).any(|w| w == b"[DONE]"),
        "the slow reader got its whole answer"
    );
    assert!(
        got.len() > 40_000,
        "{} bytes: enough for its writes to wait on it",
        got.len()
    );
    assert_eq!(metric(&r, CUT), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_past_max_streams_per_client_gets_429_while_another_is_served() {
    let e = fast_engine().await;
    let r = router_for(&e, "max_streams_per_client = 2").await;
    let _held = [
        stream_from(4, r.addr, 1_000_000).await,
        stream_from(4, r.addr, 1_000_000).await,
    ];
    until("both streams run", SOON, || {
        e.running().iter().sum::<u32>() == 2
    })
    .await;
    let mut third = stream_from(4, r.addr, 10).await;
    let got = read_until(&mut third, SOON, None, |g| {
        g.windows(4).any(|w| w == b"\r\n\r\n")
    })
    .await;
    let head = String::from_utf8_lossy(&got).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 429"), "{head}");
    assert!(head.contains("retry-after:"), "{head}");
    // Another address (127.0.0.1) is served meanwhile.
    let reply = timeout(SOON, chat(r.addr, 2))
        .await
        .expect("answered in time");
    assert_eq!(reply.status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holds_at_most_half_of_an_engines_connections() {
    let e = fast_engine().await;
    // Four slots to the engine: one address may hold two.
    let r = router_for(&e, "max_engine_connections = 4").await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(stream_from(5, r.addr, 1_000_000).await);
    }
    until("two of its streams run", SOON, || {
        e.running().iter().sum::<u32>() == 2
    })
    .await;
    // The other two wait for a slot of the address's own share; another address is served.
    let reply = timeout(SOON, chat(r.addr, 2))
        .await
        .expect("answered in time");
    assert_eq!(reply.status, 200);
    assert_eq!(
        e.running().iter().sum::<u32>(),
        2,
        "the flood still holds only its share"
    );
}
