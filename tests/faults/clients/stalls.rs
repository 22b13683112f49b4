//! Clients that stall: every kind of stalled connection is closed after its timeout while normal
//! clients and the admin listener are served, idle keep-alive connections close after
//! `idle_timeout`, and stalled bodies take no admission slot.

use std::io::ErrorKind;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio::time::{timeout, timeout_at, Instant};

use rankgate_sim::sim::SimConfig;

use super::helpers::*;
use crate::common::*;

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
    /// One byte of a request head, then nothing. (A socket that sends nothing at all waits in
    /// the kernel and never reaches rankgate: its listeners defer accepting until a client
    /// speaks, `TCP_DEFER_ACCEPT`.)
    FirstByte,
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
            Stall::FirstByte => b"P",
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
        Stall::FirstByte | Stall::PartialHeaders => {
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

/// 2,000 stalled connections of each kind (one byte, partial head, h2 preface only, stalled body):
/// normal and admin requests are served while they are open, and rankgate closes each after its
/// timeout; stalled bodies get 408 and never reach an engine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_connections_are_closed_after_their_timeouts() {
    let n = stalled_per_kind();
    let e = engine(SimConfig::default()).await;
    let limit = Duration::from_secs(2);
    let r = router(
        // Every stalled connection from this one address held to its timeout: the address may
        // hold the whole table, and as many requests (a stalled body is one in flight of its
        // address's; past max_streams_per_client it would get 429 at once, not its timeout).
        &format!(
            "header_read_timeout = \"2s\"\nbody_read_timeout = \"2s\"\n\
             max_connections_per_client = 1000000\nmax_streams_per_client = 1000000\n{FAST}"
        ),
        &[engine_toml(&e.url(), "vllm", 2, 0)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    eprintln!("stalled clients, {n} per kind:");
    for kind in [
        Stall::FirstByte,
        Stall::PartialHeaders,
        Stall::H2Preface,
        Stall::StalledBody,
    ] {
        stall_kind(&r, &e, kind, n, limit).await;
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
