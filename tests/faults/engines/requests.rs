//! Faults on the client's side of a request: a broken client body is a 400 that never counts
//! against the engine, and admission refuses past `max_in_flight`.

use std::net::SocketAddr;
use std::time::Duration;

use rankgate_sim::sim::SimConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::{timeout, Instant};

use super::helpers::*;
use crate::common::*;

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
