//! Leaving the queue: a client that goes away while its request waits takes it out at once;
//! at shutdown, what waits is served within the drain grace, or answered 503 when it ends.

use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

use super::*;

#[tokio::test]
async fn a_client_that_goes_away_leaves_the_queue_at_once() {
    let (e, r) = setup("", "").await;
    let blocker = busy(&r, 20).await;
    let mut s = TcpStream::connect(r.addr).await.unwrap();
    let body = chat_body(1, false);
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: rankgate\r\nx-request-id: gone\r\n\
         content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    waiting(&r, 1).await;
    drop(s);
    // Out of the queue long before the rank frees (the blocker holds it for a second).
    waiting(&r, 0).await;
    let f = flows(&r).await;
    assert_eq!(
        objective(&f, "default")["rejected"]["client_gone"],
        1,
        "{f}"
    );
    assert!(
        !blocker.is_finished(),
        "the rank freed first: the test proves nothing"
    );
    assert_eq!(blocker.await.unwrap().status, 200);
    assert_eq!(
        arrivals(&e),
        ["blocker"],
        "a request whose client left was sent"
    );
}

#[tokio::test]
async fn at_shutdown_what_waits_is_served_within_the_drain_grace() {
    let (e, r) = setup("drain_grace = \"10s\"", "").await;
    let blocker = busy(&r, 4).await;
    let queued = ask(&r, "queued", &[], 1);
    waiting(&r, 1).await;
    let stop = tokio::spawn(r.shutdown());
    assert_eq!(blocker.await.unwrap().status, 200);
    let reply = queued.await.unwrap();
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    tokio::time::timeout(Duration::from_secs(10), stop)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(arrivals(&e), ["blocker", "queued"]);
}

#[tokio::test]
async fn when_the_drain_grace_ends_what_still_waits_is_answered_503() {
    let (e, r) = setup("drain_grace = \"300ms\"", "").await;
    let blocker = busy(&r, 60).await;
    let queued = ask(&r, "queued", &[], 1);
    waiting(&r, 1).await;
    let stop = tokio::spawn(r.shutdown());
    let reply = tokio::time::timeout(Duration::from_secs(5), queued)
        .await
        .unwrap()
        .unwrap();
    refused(&reply, "shutting_down");
    // The stream in flight is cut as every stream is at the end of the grace; never sent twice.
    let _ = blocker.await;
    tokio::time::timeout(Duration::from_secs(10), stop)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(arrivals(&e), ["blocker"]);
}
