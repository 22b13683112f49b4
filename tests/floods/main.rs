//! Floods from one client address, over real sockets on loopback (127.0.0.2 and up stand for
//! other clients): an address over `max_connections_per_client` replaces its own connections
//! that have sent nothing yet, waits for a place once all of them serve, and never keeps
//! another address out; a full table closes a connection with no request yet before any serving one;
//! the admin listener answers `/ready` with its table full of idle sockets; sockets idle after
//! one request are reclaimed (gracefully) for newcomers on both listeners, never one with a
//! request in flight; and a body that drips just inside `body_read_timeout` still ends at
//! `body_timeout`, with a 408.
#![cfg(feature = "sim")] // the simulated engine

#[path = "../common/mod.rs"]
mod common;
mod reclaim;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use rankgate::app::Router;
use rankgate_sim::sim::{SimConfig, SimEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::time::timeout;

use common::*;

const LIMIT: Duration = Duration::from_secs(5);

/// A connection to `to` from `127.0.0.<from>`.
async fn connect_from(from: u8, to: SocketAddr) -> TcpStream {
    let socket = TcpSocket::new_v4().expect("socket");
    let src = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(127, 0, 0, from)), 0);
    socket.bind(src).expect("bind a loopback source address");
    timeout(LIMIT, socket.connect(to))
        .await
        .expect("connect in time")
        .expect("connect")
}

/// One HTTP/1.1 request for `path` on `s`, kept alive; the status line and body it got, or
/// `None` if the connection closed (or was reset) first.
async fn roundtrip(s: &mut TcpStream, path: &str) -> Option<(String, String)> {
    let req = format!("GET {path} HTTP/1.1\r\nhost: rankgate\r\n\r\n");
    exchange(s, req.as_bytes()).await
}

/// The start of a request head, sent by [`begun_from`]'s connections.
const BEGUN: &[u8] = b"GET /nope HTTP/1.1\r\n";

/// A connection from `127.0.0.<from>` that has begun a request head and sent nothing more: it
/// has no request yet. (A socket that says nothing at all never reaches rankgate: its listeners
/// accept a connection only once it speaks, `TCP_DEFER_ACCEPT`.)
async fn begun_from(from: u8, to: SocketAddr) -> TcpStream {
    let mut s = connect_from(from, to).await;
    s.write_all(BEGUN).await.expect("send the first line");
    s
}

/// Ends the head a [`begun_from`] connection began; the answer, as [`roundtrip`]'s.
async fn finish(s: &mut TcpStream) -> Option<(String, String)> {
    exchange(s, b"host: rankgate\r\n\r\n").await
}

/// Sends `bytes` on `s`, then reads one answer (see [`roundtrip`]).
async fn exchange(s: &mut TcpStream, bytes: &[u8]) -> Option<(String, String)> {
    s.write_all(bytes).await.ok()?;
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    timeout(LIMIT, async {
        loop {
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_string();
                let length: usize = (head.lines())
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse().ok())?
                    })
                    .unwrap_or(0);
                if got.len() >= end + 4 + length {
                    let status = head.lines().next().unwrap_or("").to_string();
                    let body = String::from_utf8_lossy(&got[end + 4..end + 4 + length]);
                    return Some((status, body.to_string()));
                }
            }
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await
    .expect("an answer or a close within 5 s")
}

/// Whether rankgate closes `s` (EOF or reset) within 5 s, nothing answered.
async fn closed_by_rankgate(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 64];
    matches!(timeout(LIMIT, s.read(&mut buf)).await, Ok(Ok(0) | Err(_)))
}

/// The value of one series of rankgate's `/metrics`.
fn metric(r: &Router, series: &str) -> u64 {
    let page = r.metrics.render();
    (page.lines())
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or_else(|| panic!("{series} not in /metrics:\n{page}"))
}

/// Polls `series` until it reads `want`, at most 5 s.
async fn wait_metric(r: &Router, series: &str, want: u64) {
    let deadline = tokio::time::Instant::now() + LIMIT;
    while metric(r, series) != want {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{series} is {}, not {want}",
            metric(r, series)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

const OPEN: &str = "rankgate_connections_open{listener=\"front\"}";

/// One router, one accept loop: the order connections are accepted in is the order they were
/// opened in.
async fn small_door(server: &str) -> (SimEngine, Router) {
    let e = engine(SimConfig::default()).await;
    let r = router_with(
        &format!("thread_per_core = false\n{server}"),
        FAST,
        &[engine_toml(&e.url(), "vllm", 2, 0)],
    )
    .await;
    (e, r)
}

/// A request in progress on `s`: its head sent, its 5-byte body not yet. Asked with
/// `expect: 100-continue`, whose answer says rankgate is reading the body.
async fn begin_request(s: &mut TcpStream) {
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: rankgate\r\n\
                content-type: application/json\r\ncontent-length: 5\r\n\
                expect: 100-continue\r\n\r\n";
    s.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = timeout(LIMIT, s.read(&mut buf)).await.expect("100 in time");
        let n = n.expect("read");
        assert!(n > 0, "closed before its 100 Continue");
        got.extend_from_slice(&buf[..n]);
    }
    assert!(got.starts_with(b"HTTP/1.1 100"), "{got:?}");
}

/// An address whose places all serve (a request in progress on each): its newcomer waits for
/// one, closed at its header deadline if none comes, while another address is served at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_over_its_limit_keeps_no_other_address_out() {
    let (_e, r) = small_door(
        "max_connections = 16\nmax_connections_per_client = 2\nheader_read_timeout = \"1s\"\n\
         body_read_timeout = \"20s\"",
    )
    .await;
    assert_eq!(
        metric(
            &r,
            "rankgate_connections_per_client_max{listener=\"front\"}"
        ),
        2
    );
    // Two serving connections from 127.0.0.1 hold its limit.
    let mut a = connect_from(1, r.addr).await;
    let mut b = connect_from(1, r.addr).await;
    for s in [&mut a, &mut b] {
        let (status, _) = roundtrip(s, "/nope").await.expect("served");
        assert!(status.starts_with("HTTP/1.1 404"), "{status}");
        begin_request(s).await;
    }
    // A third waits for a place (none is idle); another address is served meanwhile.
    let mut c = connect_from(1, r.addr).await;
    c.write_all(b"GET /nope HTTP/1.1\r\nhost: rankgate\r\n\r\n")
        .await
        .unwrap();
    let mut d = connect_from(2, r.addr).await;
    let (status, _) = roundtrip(&mut d, "/nope")
        .await
        .expect("another address served");
    assert!(status.starts_with("HTTP/1.1 404"), "{status}");
    // No place came within its header deadline: closed, nothing answered.
    assert!(closed_by_rankgate(&mut c).await, "the third stayed open");
    assert_eq!(
        metric(&r, "rankgate_connections_refused_total{listener=\"front\"}"),
        1
    );
    for s in [&mut a, &mut b] {
        // The bodies come: answered (400, not JSON), the connections still open.
        s.write_all(b"{nope").await.unwrap();
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).await.expect("answered");
        assert_eq!(&buf, b"HTTP/1.1 400", "a serving connection was closed");
    }
    // A place given back goes to the address's next connection.
    drop(a);
    let mut e = connect_from(1, r.addr).await;
    let (status, _) = roundtrip(&mut e, "/nope")
        .await
        .expect("served once a place is free");
    assert!(status.starts_with("HTTP/1.1 404"), "{status}");
}

/// An address whose connections have sent nothing yet: its newcomer takes the place of the
/// oldest of them, the others stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_at_its_limit_replaces_its_oldest_idle_connection() {
    let (_e, r) = small_door("max_connections = 16\nmax_connections_per_client = 2").await;
    let mut idle1 = begun_from(3, r.addr).await;
    wait_metric(&r, OPEN, 1).await;
    let mut idle2 = begun_from(3, r.addr).await;
    wait_metric(&r, OPEN, 2).await;
    // A connection has 250 ms to send its request before a newer one may replace it.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let mut newest = connect_from(3, r.addr).await;
    let (status, _) = roundtrip(&mut newest, "/nope")
        .await
        .expect("the newest served");
    assert!(status.starts_with("HTTP/1.1 404"), "{status}");
    assert!(
        closed_by_rankgate(&mut idle1).await,
        "the oldest idle one stayed"
    );
    assert!(
        finish(&mut idle2).await.is_some(),
        "the younger idle connection was closed too"
    );
    assert_eq!(
        metric(
            &r,
            "rankgate_connections_replaced_total{listener=\"front\"}"
        ),
        1
    );
    assert_eq!(
        metric(&r, "rankgate_connections_refused_total{listener=\"front\"}"),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_table_closes_a_connection_with_no_request_before_a_serving_one() {
    let (_e, r) = small_door("max_connections = 4\nmax_connections_per_client = 4").await;
    let mut serving = Vec::new();
    for _ in 0..2 {
        let mut s = connect_from(1, r.addr).await;
        assert!(roundtrip(&mut s, "/nope").await.is_some());
        serving.push(s);
    }
    let mut older = begun_from(1, r.addr).await;
    wait_metric(&r, OPEN, 3).await;
    let mut younger = begun_from(1, r.addr).await;
    wait_metric(&r, OPEN, 4).await;
    // A connection has 250 ms to send its request before a newer one may replace it.
    tokio::time::sleep(Duration::from_millis(400)).await;
    // The table is full: a fifth client is served, in place of the oldest idle connection.
    let mut fifth = connect_from(2, r.addr).await;
    let (status, _) = roundtrip(&mut fifth, "/nope")
        .await
        .expect("the fifth served");
    assert!(status.starts_with("HTTP/1.1 404"), "{status}");
    assert!(
        closed_by_rankgate(&mut older).await,
        "the oldest idle one stayed"
    );
    for s in serving.iter_mut() {
        assert!(
            roundtrip(s, "/nope").await.is_some(),
            "a serving connection was closed"
        );
    }
    assert!(
        finish(&mut younger).await.is_some(),
        "the younger idle connection was closed"
    );
    assert_eq!(metric(&r, OPEN), 4);
}

/// The admin listener (256 connections, 32 per address) with more idle sockets than its table
/// holds, from ten addresses: `/ready` is still answered, in place of the oldest of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_ready_answers_with_its_table_full_of_idle_sockets() {
    let (_e, r) = small_door("").await;
    let mut idle = Vec::new();
    for from in 2..12u8 {
        for _ in 0..30 {
            idle.push(begun_from(from, r.admin_addr).await);
        }
    }
    let ready = timeout(LIMIT, get(r.admin_addr, "/ready"))
        .await
        .expect("/ready answered within 5 s while the admin table is full");
    assert_eq!(ready.status, 200);
    // Accepted in order, the 300 idle ones before the probe: at least 45 made room.
    let replaced = metric(
        &r,
        "rankgate_connections_replaced_total{listener=\"admin\"}",
    );
    assert!(replaced >= 45, "{replaced} replaced");
    assert!(metric(&r, "rankgate_connections_open{listener=\"admin\"}") <= 256);
    assert_eq!(
        metric(&r, "rankgate_connections_max{listener=\"admin\"}"),
        256
    );
    drop(idle);
}

/// A body whose every gap is well inside `body_read_timeout` still gets its 408 at
/// `body_timeout`, and never reaches an engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dripping_body_gets_408_at_the_body_timeout() {
    let (e, r) = small_door("body_read_timeout = \"2s\"\nbody_timeout = \"1s\"").await;
    wait_state(&r, &[0, 1], "available").await;
    let received = e.requests_received();
    let mut s = connect_from(1, r.addr).await;
    let head = "POST /v1/chat/completions HTTP/1.1\r\nhost: rankgate\r\n\
                content-type: application/json\r\ncontent-length: 100\r\n\r\n{";
    s.write_all(head.as_bytes()).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    // One byte every 200 ms, 40 at most (8 s): rankgate must answer long before.
    let drip = tokio::spawn(async move {
        for _ in 0..40 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if wr.write_all(b" ").await.is_err() {
                break;
            }
        }
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    let answered = timeout(LIMIT, async {
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match rd.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    })
    .await;
    drip.abort();
    assert!(answered.is_ok(), "no answer within 5 s");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 408 "), "{text}");
    assert_eq!(
        e.requests_received(),
        received,
        "the body reached an engine"
    );
}
