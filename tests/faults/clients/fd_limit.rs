//! Clients that flood: past the fd limit the front door's newcomers replace its idle connections
//! while the admin listener answers, and accept failures are throttled and survived.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::{timeout, Instant};

use rankgate_sim::sim::SimConfig;

use crate::common::binary::Rankgate;
use crate::common::*;
use crate::shutdown::{try_get, wait_status};

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
        // One byte of a request head: a socket that says nothing waits in the kernel until it
        // does (`TCP_DEFER_ACCEPT`) and would never reach rankgate's table.
        let connect = async move {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(SocketAddr::from(([127, 0, 0, from], 0)))?;
            let mut s = socket.connect(addr).await?;
            s.write_all(b"G").await?;
            Ok::<_, std::io::Error>(s)
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
