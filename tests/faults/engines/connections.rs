//! The router's connections to engines: reused, dead ones replaced, held within
//! `max_engine_connections`; an answer holding a 431 status line reaches the client whole, and an
//! engine closing kept connections unannounced loses no request.

use std::net::SocketAddr;
use std::time::Duration;

use http_body_util::BodyExt;
use rankgate_sim::sim::{SimConfig, SimEngine};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::time::timeout;

use super::helpers::*;
use crate::common::*;

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
            include_str!("../../fixtures/vllm-0.32-dp2-metrics.txt"),
        ))
    } else if head.starts_with("get /v1/models") {
        Some((
            "application/json",
            include_str!("../../fixtures/vllm-0.32-models.json"),
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
                        include_str!("../../fixtures/vllm-0.32-chat.json"),
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
