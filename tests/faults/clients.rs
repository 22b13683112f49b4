//! Clients that stall, flood or send too much, against the front door over real sockets: every
//! kind of stalled connection is closed after its timeout while normal clients and the admin
//! listener are served; oversized headers get 431 and reach no engine; past the fd limit the
//! front door's newcomers replace its idle connections while the admin listener answers; idle
//! keep-alive connections close after `idle_timeout`.

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::{timeout, timeout_at, Instant};

use crate::common::binary::Rankgate;
use crate::common::*;
use crate::shutdown::{try_get, wait_status};
use rankgate_sim::sim::SimConfig;

/// This process's soft RLIMIT_NOFILE.
fn nofile_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only into the struct it is given.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return 1024;
    }
    lim.rlim_cur
}

/// How many stalled connections of one kind to open: 2,000, fewer if this process's fd limit
/// is low. Each costs two descriptors here (the router runs in process), one kind is open at a
/// time, and other tests of this binary run alongside, so a quarter of the limit at most.
fn stalled_per_kind() -> usize {
    let soft = nofile_limit();
    let n = (soft.saturating_sub(1000) / 4).min(2000) as usize;
    if n < 2000 {
        eprintln!("RLIMIT_NOFILE is {soft}: {n} stalled connections per kind instead of 2000");
    }
    assert!(n >= 50, "RLIMIT_NOFILE {soft} is too low for this test");
    n
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Stall {
    /// Connected, nothing sent.
    Silent,
    /// Part of an HTTP/1 request head.
    PartialHeaders,
    /// The h2 preface and an empty SETTINGS frame, then nothing.
    H2Preface,
    /// A whole HTTP/1 head with Content-Length, then part of the body.
    StalledBody,
}

impl Stall {
    fn bytes(self) -> &'static [u8] {
        match self {
            Stall::Silent => b"",
            Stall::PartialHeaders => {
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: rankgate\r\nContent-Type: appl"
            }
            Stall::H2Preface => {
                b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00"
            }
            Stall::StalledBody => {
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: rankgate\r\n\
                  Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{\"model\": \"tiny"
            }
        }
    }
}

/// How one stalled connection ended.
#[derive(Debug)]
struct Closed {
    /// From the last byte sent to EOF or reset.
    after: Duration,
    /// What rankgate sent before closing.
    got: Vec<u8>,
    reset: bool,
}

/// Reads until rankgate closes the connection (EOF or reset), bounded by `deadline`.
async fn read_to_close(
    mut s: TcpStream,
    sent: Instant,
    deadline: Instant,
) -> Result<Closed, String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match timeout_at(deadline, s.read(&mut buf)).await {
            Err(_) => {
                return Err(format!(
                    "still open {:?} after its last byte; got {:?}",
                    sent.elapsed(),
                    String::from_utf8_lossy(&got)
                ))
            }
            Ok(Ok(0)) => {
                return Ok(Closed {
                    after: sent.elapsed(),
                    got,
                    reset: false,
                })
            }
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Ok(Err(e)) if e.kind() == ErrorKind::ConnectionReset => {
                return Ok(Closed {
                    after: sent.elapsed(),
                    got,
                    reset: true,
                })
            }
            Ok(Err(e)) => return Err(format!("read: {e}")),
        }
    }
}

/// Whether the peer has neither closed nor reset `s` (data waiting, or nothing yet; no EOF).
fn still_open(s: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 1];
    // SAFETY: a peek into a local buffer on a socket we own; nothing is consumed.
    let n = unsafe {
        libc::recv(
            s.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    n > 0 || (n < 0 && std::io::Error::last_os_error().kind() == ErrorKind::WouldBlock)
}

/// Opens `n` connections of one stalled kind, checks that normal and admin requests are served
/// while all of them are open, and that rankgate closes every one after `limit` (not before).
async fn stall_kind(
    router: &rankgate::app::Router,
    engine: &rankgate_sim::sim::SimEngine,
    kind: Stall,
    n: usize,
    limit: Duration,
) {
    let opening = Instant::now();
    let mut conns = Vec::with_capacity(n);
    // In batches, so the listener's backlog never overflows (a dropped SYN costs a 1 s retry).
    let mut next = 0;
    while next < n {
        let batch = (n - next).min(32);
        let mut set = JoinSet::new();
        for i in next..next + batch {
            let addr = router.addr;
            set.spawn(async move {
                let mut s = timeout(Duration::from_secs(5), TcpStream::connect(addr))
                    .await
                    .map_err(|_| format!("connect {i} timed out"))?
                    .map_err(|e| format!("connect {i}: {e}"))?;
                if !kind.bytes().is_empty() {
                    s.write_all(kind.bytes())
                        .await
                        .map_err(|e| format!("write {i}: {e}"))?;
                }
                Ok::<_, String>((s, Instant::now()))
            });
        }
        while let Some(r) = set.join_next().await {
            conns.push(r.unwrap().unwrap_or_else(|e| panic!("{kind:?}: {e}")));
        }
        next += batch;
    }
    conns.sort_by_key(|c| c.1);
    let opened_in = opening.elapsed();

    // While all of them are open: a normal client and the admin listener are served.
    let received = engine.requests_received();
    let reply = timeout(Duration::from_secs(5), chat(router.addr, 2))
        .await
        .unwrap_or_else(|_| panic!("{kind:?}: normal request timed out"));
    assert_eq!(reply.status, 200, "{kind:?}: {:?}", reply.body);
    let rows = timeout(Duration::from_secs(5), workers(router))
        .await
        .unwrap_or_else(|_| panic!("{kind:?}: /workers timed out"));
    assert_eq!(rows.len(), 2);
    // Stalled bodies never reach a rank: nothing in flight, no request at the engine.
    assert!(
        rows.iter().all(|r| r["in_flight"] == 0),
        "{kind:?}: in flight while only stalled clients are open: {rows:?}"
    );
    assert_eq!(engine.requests_received(), received + 1, "{kind:?}");
    // The oldest connection is still open, so all of them were open at once.
    assert!(
        still_open(&conns[0].0),
        "{kind:?}: the first connection closed before the checks ({opened_in:?} to open {n})"
    );
    let checked = opening.elapsed();

    let slack = Duration::from_secs(3);
    let mut set = JoinSet::new();
    for (s, sent) in conns {
        set.spawn(read_to_close(s, sent, sent + limit + slack));
    }
    let mut closed = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        closed.push(r.unwrap().unwrap_or_else(|e| panic!("{kind:?}: {e}")));
    }
    let all_closed = opening.elapsed();
    let min = closed.iter().map(|c| c.after).min().unwrap();
    let max = closed.iter().map(|c| c.after).max().unwrap();
    let resets = closed.iter().filter(|c| c.reset).count();
    assert!(
        min + Duration::from_millis(50) >= limit,
        "{kind:?}: a connection closed {min:?} after its last byte, before its {limit:?} timeout"
    );
    match kind {
        Stall::StalledBody => {
            let with_408 = closed
                .iter()
                .filter(|c| c.got.starts_with(b"HTTP/1.1 408 "))
                .count();
            for c in &closed {
                assert!(
                    c.got.is_empty() || c.got.starts_with(b"HTTP/1.1 408 "),
                    "stalled body answered {:?}",
                    String::from_utf8_lossy(&c.got)
                );
            }
            eprintln!("  {with_408} of {n} stalled bodies answered 408 before the close");
            assert_eq!(with_408, n, "every stalled body gets its 408");
        }
        Stall::Silent | Stall::PartialHeaders => {
            for c in &closed {
                assert!(
                    c.got.is_empty(),
                    "{kind:?}: {:?}",
                    String::from_utf8_lossy(&c.got)
                );
            }
        }
        // The server's SETTINGS (and perhaps a GOAWAY) come first.
        Stall::H2Preface => {}
    }
    // Nothing reached the engine and nothing is left in flight.
    assert_eq!(engine.requests_received(), received + 1, "{kind:?}");
    let rows = workers(router).await;
    assert!(rows.iter().all(|r| r["in_flight"] == 0), "{rows:?}");
    eprintln!(
        "  {kind:?}: {n} opened in {opened_in:?}; chat + /workers served {checked:?} after the \
         first; all closed {all_closed:?} after the first; close {min:?}..{max:?} after the \
         last byte (timeout {limit:?}); {resets} reset, {} EOF",
        n - resets
    );
}

/// 2,000 stalled connections of each kind (silent, partial head, h2 preface only, stalled body):
/// normal and admin requests are served while they are open, and rankgate closes each after its
/// timeout; stalled bodies get 408 and never reach an engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_connections_are_closed_after_their_timeouts() {
    let n = stalled_per_kind();
    let e = engine(SimConfig::default()).await;
    let limit = Duration::from_secs(2);
    let r = router(
        // Every stalled connection from this one address held to its timeout: the address may
        // hold the whole table.
        &format!(
            "header_read_timeout = \"2s\"\nbody_read_timeout = \"2s\"\n\
             max_connections_per_client = 1000000\n{FAST}"
        ),
        &[engine_toml(&e.url(), "vllm", 2, 0)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    eprintln!("stalled clients, {n} per kind:");
    for kind in [
        Stall::Silent,
        Stall::PartialHeaders,
        Stall::H2Preface,
        Stall::StalledBody,
    ] {
        stall_kind(&r, &e, kind, n, limit).await;
    }
}

/// ~400 KB of HTTP/1 request headers: 431, and nothing reaches the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_get_431_and_are_not_forwarded() {
    let (e, r) = fleet(SimConfig::default()).await;
    wait_state(&r, &[0, 1], "available").await;
    let before = e.requests_received();
    let mut head = String::from(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: rankgate\r\nContent-Type: application/json\r\n",
    );
    let filler = "x".repeat(1000);
    for i in 0..400 {
        head.push_str(&format!("X-Filler-{i}: {filler}\r\n"));
    }
    let body = chat_body(2, false);
    head.push_str(&format!("Content-Length: {}\r\n\r\n{body}", body.len()));
    let s = TcpStream::connect(r.addr).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    // rankgate answers before it has read it all, and then closes: writing may fail.
    let writer = tokio::spawn(async move {
        let _ = wr.write_all(head.as_bytes()).await;
        wr
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = timeout(Duration::from_secs(5), async {
        loop {
            match rd.read(&mut buf).await {
                Ok(0) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
                Err(_) => break,
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no close within 5 s");
    let text = String::from_utf8_lossy(&got);
    assert!(
        text.starts_with("HTTP/1.1 431 "),
        "expected 431, got {text:?}"
    );
    drop(writer.await);
    // A normal request afterwards: the engine saw it and only it.
    assert_eq!(chat(r.addr, 2).await.status, 200);
    assert_eq!(e.requests_received(), before + 1);
}

/// One request with `lines` short header lines over HTTP/1.1, and the status line it got.
/// A chat completion request whose head has `lines` header lines (at least 3: Host,
/// Content-Type and Content-Length), plus `Connection: close` when `close`.
fn chat_with_lines(lines: usize, close: bool) -> String {
    let body = chat_body(2, false);
    let mut head = String::from("POST /v1/chat/completions HTTP/1.1\r\nHost: rankgate\r\n");
    for i in 0..lines - 3 {
        head.push_str(&format!("X-Tag-{i}: v\r\n"));
    }
    let close = if close { "Connection: close\r\n" } else { "" };
    head.push_str(&format!(
        "Content-Type: application/json\r\nContent-Length: {}\r\n{close}\r\n{body}",
        body.len()
    ));
    head
}

/// Sends [`chat_with_lines`] on `s` (kept alive) and reads its answer, within 5 s.
async fn chat_on(s: &mut TcpStream, lines: usize) -> String {
    s.write_all(chat_with_lines(lines, false).as_bytes())
        .await
        .unwrap();
    timeout(Duration::from_secs(5), read_response(s))
        .await
        .expect("response within 5 s")
}

async fn status_with_header_lines(addr: SocketAddr, lines: usize) -> String {
    let head = chat_with_lines(lines, true);
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(head.as_bytes()).await;
    let mut got = Vec::new();
    let _ = timeout(Duration::from_secs(10), s.read_to_end(&mut got)).await;
    let text = String::from_utf8_lossy(&got);
    text.lines().next().unwrap_or("").to_string()
}

/// Clients behind tracing and gateway layers send more than hyper's default of 100 header
/// lines: up to 512 are served (counting hop-by-hop ones), beyond that 431 and nothing reaches
/// the engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_to_512_header_lines_are_served_and_more_get_431() {
    let (e, r) = fleet(SimConfig::default()).await;
    wait_state(&r, &[0, 1], "available").await;
    // +1: the Connection line the helper adds.
    for lines in [101, 300, 511] {
        let status = status_with_header_lines(r.addr, lines).await;
        assert!(
            status.starts_with("HTTP/1.1 200 "),
            "{} lines: {status}",
            lines + 1
        );
    }
    let before = e.requests_received();
    let status = status_with_header_lines(r.addr, 600).await;
    assert!(status.starts_with("HTTP/1.1 431 "), "601 lines: {status}");
    assert_eq!(e.requests_received(), before);
}

/// A head longer than hyper's default arrays midway through a keep-alive connection is served
/// like the first one (the connection changes over to long heads without losing a byte):
/// short and long requests in turn, then pipelined, each answered in order. And a body that
/// holds a long head stays a body: answered (404) before its body was read, with the rest of
/// the body sent after the answer, it never becomes a request of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_heads_mid_connection_are_served_in_turn_and_bodies_stay_bodies() {
    let (e, r) = fleet(SimConfig::default()).await;
    wait_state(&r, &[0, 1], "available").await;
    let mut s = TcpStream::connect(r.addr).await.unwrap();
    for lines in [3, 300, 3, 150, 3] {
        let resp = chat_on(&mut s, lines).await;
        assert!(resp.starts_with("HTTP/1.1 200 "), "{lines} lines: {resp}");
    }
    let mut s = TcpStream::connect(r.addr).await.unwrap();
    let pipelined: String = [3, 200, 3].map(|l| chat_with_lines(l, false)).concat();
    s.write_all(pipelined.as_bytes()).await.unwrap();
    for lines in [3, 200, 3] {
        let resp = timeout(Duration::from_secs(5), read_response(&mut s))
            .await
            .expect("response within 5 s");
        assert!(
            resp.starts_with("HTTP/1.1 200 "),
            "pipelined, {lines} lines: {resp}"
        );
    }
    assert_eq!(e.requests_received(), 8);

    let fake = chat_with_lines(300, false);
    let head = format!(
        "POST /v1/no-such-path HTTP/1.1\r\nHost: rankgate\r\nContent-Length: {}\r\n\r\n0123456789",
        fake.len() + 10
    );
    let mut s = TcpStream::connect(r.addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let resp = timeout(Duration::from_secs(5), read_response(&mut s))
        .await
        .expect("response within 5 s");
    assert!(resp.starts_with("HTTP/1.1 404 "), "{resp}");
    // The connection may be closed by now (the body was not drained): the write may fail.
    let _ = s.write_all(fake.as_bytes()).await;
    let mut rest = Vec::new();
    let _ = timeout(Duration::from_secs(2), s.read_to_end(&mut rest)).await;
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        !rest.contains("HTTP/1.1"),
        "a body answered as a request: {rest}"
    );
    assert_eq!(e.requests_received(), 8, "nothing reached the engine");
}

/// An engine's own 431 is the client's answer like any other status (rankgate holds back only
/// hyper's 431 for a long head it reparses): each request on a keep-alive connection gets it,
/// in order, and the connection serves on once the engine answers 200 again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engines_431_reaches_the_client() {
    let (e, r) = fleet(SimConfig::default()).await;
    wait_state(&r, &[0, 1], "available").await;
    e.set_fail(431, 100.0).unwrap();
    let mut s = TcpStream::connect(r.addr).await.unwrap();
    for _ in 0..3 {
        let resp = chat_on(&mut s, 3).await;
        assert!(
            resp.starts_with("HTTP/1.1 431 "),
            "the engine's 431: {resp}"
        );
    }
    e.set_fail(431, 0.0).unwrap();
    for lines in [3, 200] {
        let resp = chat_on(&mut s, lines).await;
        assert!(resp.starts_with("HTTP/1.1 200 "), "{lines} lines: {resp}");
    }
}

/// After a completed request, an idle HTTP/1 keep-alive connection is closed after
/// `idle_timeout`, not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keepalive_connection_closes_after_idle_timeout() {
    let e = engine(SimConfig::default()).await;
    let r = router(
        &format!("idle_timeout = \"1s\"\n{FAST}"),
        &[engine_toml(&e.url(), "vllm", 2, 0)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    let mut s = TcpStream::connect(r.addr).await.unwrap();
    let body = chat_body(2, false);
    // Two requests on the connection: keep-alive is on, and the idle clock restarts.
    for _ in 0..2 {
        let req = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nHost: rankgate\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await.unwrap();
        let resp = timeout(Duration::from_secs(5), read_response(&mut s))
            .await
            .expect("response within 5 s");
        assert!(resp.starts_with("HTTP/1.1 200 "), "{resp}");
        assert!(
            !resp.to_ascii_lowercase().contains("connection: close"),
            "{resp}"
        );
    }
    let idle_from = Instant::now();
    let c = read_to_close(s, idle_from, idle_from + Duration::from_secs(4))
        .await
        .expect("idle connection closed");
    assert!(c.got.is_empty(), "{:?}", String::from_utf8_lossy(&c.got));
    assert!(
        c.after >= Duration::from_millis(950) && c.after < Duration::from_millis(2500),
        "idle keep-alive connection closed after {:?} (idle_timeout 1 s)",
        c.after
    );
    eprintln!(
        "idle keep-alive: closed {:?} after its last response",
        c.after
    );
}

/// Reads one HTTP/1 response with a Content-Length body and returns it as text.
async fn read_response(s: &mut TcpStream) -> String {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            n > 0,
            "closed mid-response: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&buf[..n]);
        let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
        let len: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map(|v| v.trim().parse().unwrap())
            .expect("content-length");
        if got.len() >= end + 4 + len {
            return String::from_utf8_lossy(&got).into_owned();
        }
    }
}

/// Opens up to `n` connections to `addr` (each connect bounded), stopping at the first that does
/// not complete; returns them.
async fn open_many(addr: SocketAddr, n: usize) -> Vec<TcpStream> {
    open_many_from(addr, n, 1).await
}

/// [`open_many`] from `sources` client addresses in turn, 127.0.0.2 and up (1: 127.0.0.1).
async fn open_many_from(addr: SocketAddr, n: usize, sources: u8) -> Vec<TcpStream> {
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let from = match sources {
            0 | 1 => 1,
            k => 2 + (i % k as usize) as u8,
        };
        let connect = async move {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(SocketAddr::from(([127, 0, 0, from], 0)))?;
            socket.connect(addr).await
        };
        match timeout(Duration::from_secs(1), connect).await {
            Ok(Ok(s)) => v.push(s),
            _ => break,
        }
    }
    v
}

fn fd_limit_config(engine_url: &str, server: &str) -> String {
    // A long header timeout: the idle connections must stay, holding their slots.
    format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n\
         header_read_timeout = \"60s\"\n{server}\n{FAST}\n{}",
        engine_toml(engine_url, "vllm", 2, 0)
    )
}

/// The real binary under RLIMIT_NOFILE 256, flooded with 4x that many idle connections from
/// eight addresses: the front door fills at its derived `max_connections` (no "accept failed"
/// at all), each newcomer taking the place of the oldest connection with no request yet once
/// that one has had its 250 ms, so a normal request is served while the flood is open; the
/// admin listener answers `/health` and `/workers` throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_the_fd_limit_admin_still_answers() {
    let e = engine(SimConfig::default()).await;
    let mut rg = Rankgate::start("fd-limit", &fd_limit_config(&e.url(), ""), Some(256)).await;
    wait_status(rg.admin_addr, "/ready", 200, Duration::from_secs(10)).await;

    let started = Instant::now();
    let flood = open_many_from(rg.addr, 1024, 8).await;
    // The kernel completes them (accepted, refused by their address's limit, or in the
    // backlog).
    assert_eq!(
        flood.len(),
        1024,
        "connections completed before one stalled"
    );
    let line = rg
        .wait_log("connection limit reached", Duration::from_secs(5))
        .await;
    assert!(line.contains("max_connections=96"), "{line}");
    // Admin answers while the front door is full.
    let health = try_get(rg.admin_addr, "/health", Duration::from_secs(2)).await;
    assert_eq!(health.map(|h| h.0), Some(200));
    let (status, body) = try_get(rg.admin_addr, "/workers", Duration::from_secs(2))
        .await
        .expect("/workers answers while the front door is full");
    assert_eq!(status, 200);
    let rows: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(rows.as_array().map(Vec::len), Some(2), "{body}");
    // A front-door request is served meanwhile, in place of an idle connection.
    // Generous: the door turns over 96 connections per 250 ms, and other tests of this binary
    // flood their own routers meanwhile.
    let served = timeout(Duration::from_secs(30), chat(rg.addr, 2))
        .await
        .expect("a request is served while the flood is open");
    assert_eq!(served.status, 200);
    let flooded = flood.len();
    drop(flood);
    assert_eq!(chat(rg.addr, 2).await.status, 200);
    assert_eq!(rg.count("accept failed"), 0, "{}", rg.log().join("\n"));
    // Hitting the cap over and over (each newcomer closes an idle one) is one line per 5 s,
    // not one per accept.
    let pauses = rg.count("connection limit reached");
    assert!(
        pauses <= 1 + started.elapsed().as_secs() as usize / 5,
        "{pauses} cap lines in {:?}",
        started.elapsed()
    );
    eprintln!(
        "fd limit 256: {flooded} connections opened into a table of 96 ({pauses} cap lines); \
         admin answered; a request served while the flood was open"
    );
}

/// `max_connections` set above what RLIMIT_NOFILE allows: accept fails with EMFILE over and
/// over, but the log gets at most one "accept failed" line per 5 s, and the front door serves
/// again once descriptors free up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_failures_are_throttled_and_survived() {
    let e = engine(SimConfig::default()).await;
    let mut rg = Rankgate::start(
        "emfile",
        &fd_limit_config(&e.url(), "max_connections = 5000\n"),
        Some(256),
    )
    .await;
    wait_status(rg.admin_addr, "/ready", 200, Duration::from_secs(10)).await;
    let flood = open_many(rg.addr, 1024).await;
    let first = Instant::now();
    rg.wait_log("accept failed", Duration::from_secs(5)).await;
    // Hold the flood for 2 s of failing accepts (one every 50 ms: about 40).
    tokio::time::sleep(Duration::from_secs(2)).await;
    let lines = rg.count("accept failed");
    let window = first.elapsed();
    let allowed = 1 + window.as_secs() as usize / 5;
    assert!(
        lines <= allowed,
        "{lines} accept-failed lines in {window:?}: {}",
        rg.log().join("\n")
    );
    let flooded = flood.len();
    drop(flood);
    wait_status(rg.admin_addr, "/health", 200, Duration::from_secs(10)).await;
    let reply = timeout(Duration::from_secs(10), async {
        loop {
            let st = try_get(rg.addr, "/v1/models", Duration::from_secs(2)).await;
            if st.as_ref().is_some_and(|s| s.0 == 200) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        reply.is_ok(),
        "front door not serving after the flood closed"
    );
    assert_eq!(chat(rg.addr, 2).await.status, 200);
    eprintln!(
        "EMFILE: {flooded} connections; {lines} accept-failed line(s) in {window:?}; served again"
    );
}

/// Clients whose bodies stall must not take `max_in_flight` slots from clients that send theirs:
/// the stack reads the body before admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_bodies_do_not_take_admission_slots() {
    let e = engine(SimConfig::default()).await;
    let r = router(
        &format!("max_in_flight = 50\nbody_read_timeout = \"3s\"\n{FAST}"),
        &[engine_toml(&e.url(), "vllm", 2, 0)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    let mut stalled = Vec::new();
    for _ in 0..100 {
        let mut s = TcpStream::connect(r.addr).await.unwrap();
        s.write_all(Stall::StalledBody.bytes()).await.unwrap();
        stalled.push(s);
    }
    let reply = timeout(Duration::from_secs(2), chat(r.addr, 2))
        .await
        .expect("served within 2 s");
    assert_eq!(
        reply.status,
        200,
        "a normal client behind 100 stalled bodies (max_in_flight 50): {:?}",
        String::from_utf8_lossy(&reply.body)
    );
    drop(stalled);
}
