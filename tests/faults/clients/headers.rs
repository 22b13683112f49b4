//! Clients that send too much head: oversized headers get 431 and reach no engine, up to 512
//! header lines are served, long heads mid-connection are served in turn while bodies stay bodies,
//! and an engine's own 431 reaches the client.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

use rankgate_sim::sim::SimConfig;

use super::helpers::*;
use crate::common::*;

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
