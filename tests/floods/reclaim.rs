//! Connection places are for work: sockets idle after one request are reclaimed (gracefully)
//! for newcomers on both listeners, never one with a request in flight, and a client behind a
//! flooder's address gets in.

use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::time::timeout;

use super::*;
/// `n` connections from `127.0.0.<from>` to `to`, each served one request and then left idle.
async fn idle_after_one_request(from: u8, to: SocketAddr, n: usize) -> Vec<TcpStream> {
    let mut out = Vec::new();
    for _ in 0..n {
        let mut s = connect_from(from, to).await;
        let (status, _) = roundtrip(&mut s, "/nope").await.expect("served");
        assert!(status.starts_with("HTTP/1.1 404"), "{status}");
        out.push(s);
    }
    out
}

/// The admin listener (256 places, 16 per address) filled by twenty addresses whose sockets
/// each sent one request and then idle: a probe from another address is answered, in place of
/// an idle socket, closed gracefully (nothing half-answered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_ready_answers_with_its_table_full_of_sockets_idle_after_one_request() {
    let (_e, r) = small_door("").await;
    assert_eq!(
        metric(
            &r,
            "rankgate_connections_per_client_max{listener=\"admin\"}"
        ),
        16
    );
    let mut idle = Vec::new();
    // 2..=21: 20 addresses x 16 = 320 sockets for 256 places; each address's own 17th
    // reclaims its own oldest, the door's 257th on the largest address's.
    for from in 2..22u8 {
        idle.extend(idle_after_one_request(from, r.admin_addr, 17).await);
    }
    for _ in 0..3 {
        let mut probe = connect_from(30, r.admin_addr).await;
        let (status, body) = roundtrip(&mut probe, "/ready")
            .await
            .expect("/ready answered with the admin table full of idle sockets");
        assert!(status.starts_with("HTTP/1.1 200"), "{status} {body}");
    }
    let reclaimed = metric(
        &r,
        "rankgate_connections_reclaimed_total{listener=\"admin\"}",
    );
    // 20 by the addresses' own 17th, 64 by the door, 1 for the first probe (the others found
    // the place it gave back).
    assert!(reclaimed >= 85, "{reclaimed} reclaimed");
    assert!(metric(&r, "rankgate_connections_open{listener=\"admin\"}") <= 256);
    // Those closed were closed cleanly, at a request's boundary: EOF, never a partial answer.
    let mut closed = 0;
    for s in &mut idle {
        let mut buf = [0u8; 64];
        if let Ok(r) = timeout(Duration::from_millis(1), s.read(&mut buf)).await {
            assert!(matches!(r, Ok(0) | Err(_)), "bytes on an idle socket");
            closed += 1;
        }
    }
    assert!(closed >= 80, "{closed} idle sockets seen closed");
}

/// A front door with a small table full of sockets idle after one request from several
/// addresses: another address is served, every time, in place of the idle ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_front_door_reclaims_idle_connections_for_a_newcomer() {
    let (_e, r) = small_door("max_connections = 8\nmax_connections_per_client = 4").await;
    let mut idle = Vec::new();
    for from in 2..5u8 {
        idle.extend(idle_after_one_request(from, r.addr, 4).await);
    }
    for _ in 0..5 {
        let mut s = connect_from(9, r.addr).await;
        let (status, _) = roundtrip(&mut s, "/nope")
            .await
            .expect("another address served");
        assert!(status.starts_with("HTTP/1.1 404"), "{status}");
    }
    assert!(metric(&r, OPEN) <= 8);
    assert!(
        metric(
            &r,
            "rankgate_connections_reclaimed_total{listener=\"front\"}"
        ) >= 5
    );
    drop(idle);
}

/// Reclaiming never cuts a request in flight: a connection streaming a slow answer keeps it
/// to its end while newcomers take every idle place around it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_with_a_request_in_flight_is_never_reclaimed() {
    let e = engine(SimConfig {
        decode_tokens_per_sec: 20.0,
        ..SimConfig::default()
    })
    .await;
    let r = router_with(
        "thread_per_core = false\nmax_connections = 4\nmax_connections_per_client = 4",
        FAST,
        &[engine_toml(&e.url(), "vllm", 2, 0)],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    // 30 tokens at 20 a second: a stream of about 1.5 s.
    let body = chat_body(30, true);
    let mut streaming = connect_from(5, r.addr).await;
    let req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: rankgate\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    streaming.write_all(req.as_bytes()).await.unwrap();
    let reader = tokio::spawn(async move {
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        let _ = timeout(Duration::from_secs(10), async {
            while !got.windows(12).any(|w| w == b"data: [DONE]") {
                match streaming.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await;
        String::from_utf8_lossy(&got).to_string()
    });
    wait_metric(&r, OPEN, 1).await;
    let mut idle = idle_after_one_request(2, r.addr, 3).await;
    // Newcomers from other addresses, each in place of an idle connection, while it streams.
    for from in 10..20u8 {
        let mut s = connect_from(from, r.addr).await;
        let (status, _) = roundtrip(&mut s, "/nope").await.expect("served");
        assert!(status.starts_with("HTTP/1.1 404"), "{status}");
        idle.push(s);
    }
    let text = reader.await.unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("data: [DONE]"), "the stream was cut: {text}");
    assert!(
        metric(
            &r,
            "rankgate_connections_reclaimed_total{listener=\"front\"}"
        ) >= 10
    );
}

/// A client behind the same address as a flood of silent sockets (a NAT) gets in at once: the
/// silent ones wait in the kernel until they speak (`TCP_DEFER_ACCEPT`) and take no place. (Held
/// past the deferral the kernel hands them over; then a queued connection that has sent its
/// request takes the place of one that said nothing: `http::admission`'s unit tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_behind_a_flooders_address_is_served() {
    let (_e, r) = small_door("max_connections = 64\nmax_connections_per_client = 2").await;
    let mut silent = Vec::new();
    for round in 0..5 {
        // Fresh silent sockets: two hold the places, two more fill the queue.
        for _ in 0..4 {
            silent.push(connect_from(3, r.addr).await);
        }
        // One accept loop: they are accepted before the good client, in order.
        let mut good = connect_from(3, r.addr).await;
        let (status, _) = roundtrip(&mut good, "/nope")
            .await
            .unwrap_or_else(|| panic!("round {round}: the client behind the flood was closed"));
        assert!(status.starts_with("HTTP/1.1 404"), "{status}");
    }
    // The silent sockets never took a place: the kernel holds them until they speak.
    for series in ["replaced", "refused"] {
        let name = format!("rankgate_connections_{series}_total{{listener=\"front\"}}");
        assert_eq!(metric(&r, &name), 0, "{name}");
    }
    drop(silent);
}
