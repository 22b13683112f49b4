//! The headers rankgate forwards: request ids and forwarded headers reach the engine and come back,
//! the client's trace is continued or one started, forwarding and client-IP headers are kept
//! from a trusted proxy only, and a Connection header cannot strip what rankgate forwards.

use bytes::Bytes;
use http::Request;
use http_body_util::Full;

use crate::common::*;
use crate::helpers::*;

#[tokio::test]
async fn request_ids_and_forwarded_headers_reach_the_engine_and_come_back() {
    let (e, r) = header_fleet("").await;

    let reply = send(chat_with(r.addr, &[("x-request-id", "client-abc-123")])).await;
    assert_eq!(reply.status, 200);
    assert_eq!(request_id(&reply), "client-abc-123");
    let seen = e.last();
    assert_eq!(seen["x-request-id"], "client-abc-123");
    assert_eq!(seen["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen["x-forwarded-proto"], "http");

    // None sent: one is made, and the engine and the client hear the same one.
    let reply = send(chat_with(r.addr, &[])).await;
    let id = request_id(&reply);
    assert!(
        id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{id}"
    );
    assert_eq!(e.last()["x-request-id"], id.as_str());

    // An id that cannot be kept is replaced; a client that is no trusted proxy claims an
    // earlier hop and another scheme in vain.
    let long = "x".repeat(129);
    let reply = send(chat_with(
        r.addr,
        &[
            ("x-request-id", &long),
            ("x-forwarded-for", "203.0.113.7"),
            ("x-forwarded-proto", "https"),
        ],
    ))
    .await;
    let id = request_id(&reply);
    assert_eq!(id.len(), 32);
    let seen = e.last();
    assert_eq!(seen["x-request-id"], id.as_str());
    assert_eq!(seen["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen["x-forwarded-proto"], "http");

    // rankgate's own answers carry the id too.
    let req = Request::get(format!("http://{}/v2/nothing", r.addr))
        .header("x-request-id", "lost-1")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let reply = send(req).await;
    assert_eq!(reply.status, 404);
    assert_eq!(request_id(&reply), "lost-1");
}

#[tokio::test]
async fn the_clients_trace_is_continued_to_the_engine_or_one_is_started() {
    let (e, r) = header_fleet("").await;
    let client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let reply = send(chat_with(
        r.addr,
        &[("traceparent", client), ("tracestate", "vendor=opaque")],
    ))
    .await;
    assert_eq!(reply.status, 200);
    let seen = e.last();
    let sent = seen["traceparent"].to_str().ok().unwrap().to_string();
    assert_eq!(&sent[..36], &client[..36], "the client's trace: {sent}");
    assert_ne!(
        &sent[36..52],
        &client[36..52],
        "rankgate's hop is the engine's parent"
    );
    assert!(sent.ends_with("-01"), "{sent}");
    assert_eq!(seen["tracestate"], "vendor=opaque");

    // None (or a broken one): a trace is started, and the broken one's tracestate dropped.
    for headers in [
        vec![],
        vec![
            ("traceparent", "00-zz-broken-01"),
            ("tracestate", "vendor=opaque"),
        ],
    ] {
        assert_eq!(send(chat_with(r.addr, &headers)).await.status, 200);
        let seen = e.last();
        let sent = seen["traceparent"].to_str().ok().unwrap();
        assert_eq!(sent.len(), 55, "{sent}");
        assert!(sent.starts_with("00-") && sent.ends_with("-01"), "{sent}");
        assert!(seen.get("tracestate").is_none(), "{seen:?}");
    }
}

/// A request through `addr` from the client address `from` (another loopback address stands for
/// another machine), over a fresh HTTP/1.1 connection.
async fn send_from(
    from: std::net::IpAddr,
    addr: std::net::SocketAddr,
    req: Request<Full<Bytes>>,
) -> u16 {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind((from, 0).into()).unwrap();
    let stream = tokio::time::timeout(std::time::Duration::from_secs(5), socket.connect(addr))
        .await
        .expect("connected within 5 s")
        .unwrap();
    let io = hyper_util::rt::TokioIo::new(stream);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(io).await.unwrap();
    tokio::spawn(conn);
    let resp = tokio::time::timeout(std::time::Duration::from_secs(10), sender.send_request(req))
        .await
        .expect("answered within 10 s")
        .unwrap();
    resp.status().as_u16()
}

fn with_forwarding(addr: std::net::SocketAddr) -> Request<Full<Bytes>> {
    chat_with(
        addr,
        &[
            ("x-forwarded-for", "203.0.113.7"),
            ("x-forwarded-proto", "https"),
            ("x-forwarded-host", "api.example.com"),
            ("forwarded", "for=203.0.113.7;proto=https"),
        ],
    )
}

#[tokio::test]
async fn forwarding_headers_are_kept_from_a_trusted_proxy_only() {
    let (e, r) = header_fleet("trusted_proxies = [\"127.0.0.2/32\", \"10.0.0.0/8\"]").await;
    let (stranger, proxy) = ([127, 0, 0, 1].into(), [127, 0, 0, 2].into());

    // A stranger's claims are replaced by what rankgate saw; the rest of them dropped.
    assert_eq!(
        send_from(stranger, r.addr, with_forwarding(r.addr)).await,
        200
    );
    let seen = e.last();
    assert_eq!(seen["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen["x-forwarded-proto"], "http");
    assert!(!seen.contains_key("x-forwarded-host") && !seen.contains_key("forwarded"));

    // The trusted proxy's chain is appended to, its scheme and host kept.
    assert_eq!(send_from(proxy, r.addr, with_forwarding(r.addr)).await, 200);
    let seen = e.last();
    assert_eq!(seen["x-forwarded-for"], "203.0.113.7, 127.0.0.2");
    assert_eq!(seen["x-forwarded-proto"], "https");
    assert_eq!(seen["x-forwarded-host"], "api.example.com");
    assert_eq!(seen["forwarded"], "for=203.0.113.7;proto=https");

    // Sending none, the proxy is the client.
    assert_eq!(send_from(proxy, r.addr, chat_with(r.addr, &[])).await, 200);
    let seen = e.last();
    assert_eq!(seen["x-forwarded-for"], "127.0.0.2");
    assert_eq!(seen["x-forwarded-proto"], "http");
    r.shutdown().await;
}

#[tokio::test]
async fn client_ip_headers_are_kept_from_a_trusted_proxy_only() {
    let (e, r) = header_fleet("trusted_proxies = [\"127.0.0.2/32\"]").await;
    let (stranger, proxy) = ([127, 0, 0, 1].into(), [127, 0, 0, 2].into());
    let claims = [
        ("x-real-ip", "203.0.113.7"),
        ("true-client-ip", "203.0.113.8"),
        ("x-client-ip", "203.0.113.9"),
        ("cf-connecting-ip", "203.0.113.10"),
        ("x-original-forwarded-for", "203.0.113.11"),
    ];
    // Each alone, then all at once: a stranger's never reach the engine.
    for one in claims.iter().map(std::slice::from_ref).chain([&claims[..]]) {
        assert_eq!(
            send_from(stranger, r.addr, chat_with(r.addr, one)).await,
            200
        );
        let seen = e.last();
        for (name, _) in one {
            assert!(
                !seen.contains_key(*name),
                "{name} from a stranger: {seen:?}"
            );
        }
        assert_eq!(seen["x-forwarded-for"], "127.0.0.1");
    }
    // A trusted proxy's reach it as it wrote them.
    assert_eq!(
        send_from(proxy, r.addr, chat_with(r.addr, &claims)).await,
        200
    );
    let seen = e.last();
    for (name, value) in claims {
        assert_eq!(seen[name], value, "{name} from a trusted proxy");
    }
    assert_eq!(seen["x-forwarded-for"], "127.0.0.2");
    r.shutdown().await;
}

/// What the engine received, without the headers that differ between requests anyway (the
/// id, the trace, the rank picked).
fn comparable(mut h: http::HeaderMap) -> Vec<(String, String)> {
    for varying in [
        "x-request-id",
        "traceparent",
        "tracestate",
        "x-data-parallel-rank",
    ] {
        h.remove(varying);
    }
    let mut all: Vec<(String, String)> = h
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    all.sort();
    all
}

#[tokio::test]
async fn a_connection_header_cannot_strip_what_rankgate_forwards() {
    let (e, r) = header_fleet("").await;
    let plain = send(chat_with(r.addr, &[("x-request-id", "same-id")])).await;
    assert_eq!(plain.status, 200);
    let want = e.last();
    assert_eq!(want["x-request-id"], "same-id");
    assert_eq!(want["content-type"], "application/json");

    for listed in [
        "X-Forwarded-For, X-Forwarded-Proto, X-Request-Id",
        "content-type",
        "Content-Length, Host, Transfer-Encoding, x-forwarded-for",
        "keep-alive, X-Request-Id",
    ] {
        let reply = send(chat_with(
            r.addr,
            &[("x-request-id", "same-id"), ("connection", listed)],
        ))
        .await;
        assert_eq!(reply.status, 200, "{listed}");
        let seen = e.last();
        // The engine hears the id the client is told: a listed one was the client's to drop,
        // and rankgate made another for both.
        assert_eq!(
            seen["x-request-id"],
            request_id(&reply).as_str(),
            "{listed}"
        );
        assert_eq!(comparable(seen), comparable(want.clone()), "{listed}");
    }
    r.shutdown().await;
}
