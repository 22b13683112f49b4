//! The front door's own headers and gates, over real sockets: client API keys, `x-request-id`,
//! `X-Forwarded-For` / `-Proto`, and CORS.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::path::PathBuf;

use bytes::Bytes;
use common::headers::HeaderEngine;
use common::*;
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use rankgate_sim::sim::SimFlavor as Flavor;

/// A router with `server_keys` (more `[server]` keys) in front of the header-recording engine,
/// its two ranks showing fresh telemetry.
async fn header_fleet(server_keys: &str) -> (HeaderEngine, rankgate::app::Router) {
    let e = HeaderEngine::start().await;
    let r = router(
        &format!("{server_keys}\n{FAST}"),
        &[format!(
            "[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\ndp_size = 2\ntelemetry = [\"prometheus\"]\n",
            e.url
        )],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    (e, r)
}

/// A name no other test (or run) uses.
fn unique(what: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("rankgate-{what}-{}-{nanos}", std::process::id())
}

/// A key file in the temp directory, removed when dropped.
struct KeyFile(PathBuf);

impl KeyFile {
    fn new(text: &str) -> KeyFile {
        let path = std::env::temp_dir().join(unique("keys"));
        std::fs::write(&path, text).unwrap();
        KeyFile(path)
    }

    /// The `[server]` line that points at it.
    fn toml(&self) -> String {
        format!("api_keys_file = {:?}", self.0.display().to_string())
    }
}

impl Drop for KeyFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn chat_with(addr: std::net::SocketAddr, headers: &[(&str, &str)]) -> Request<Full<Bytes>> {
    let mut b = post(addr, "/v1/chat/completions");
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::from(chat_body(4, false)))).unwrap()
}

fn request_id(reply: &Reply) -> String {
    reply
        .headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_else(|| panic!("no x-request-id on the answer: {:?}", reply.headers))
        .to_string()
}

fn assert_unauthorized(reply: &Reply) {
    assert_eq!(
        reply.status,
        401,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.headers["www-authenticate"], "Bearer");
    let v = reply.json();
    assert_eq!(v["error"]["type"], "AuthenticationError");
    assert_eq!(v["error"]["code"], 401);
    // Refusals come from rankgate, with an id a client can quote.
    assert_eq!(request_id(reply).len(), 32);
}

#[tokio::test]
async fn a_key_file_gates_every_path() {
    let keys = KeyFile::new("# issued to the web team\n\nsk-test-right\n");
    let e = engine(sim(Flavor::Vllm, 1, 0)).await;
    let r = router(
        &format!("{}\n{FAST}", keys.toml()),
        &[engine_toml(&e.url(), "vllm", 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;

    assert_unauthorized(&send(chat_with(r.addr, &[])).await);
    assert_unauthorized(
        &send(chat_with(
            r.addr,
            &[("authorization", "Bearer sk-test-wrong")],
        ))
        .await,
    );
    assert_unauthorized(
        &send(chat_with(
            r.addr,
            &[("authorization", "Basic c2stdGVzdA==")],
        ))
        .await,
    );
    // No key, no route table: an unknown path is a 401 like any other.
    assert_unauthorized(&get(r.addr, "/v2/secret-admin").await);

    let ok = send(chat_with(
        r.addr,
        &[("authorization", "Bearer sk-test-right")],
    ))
    .await;
    assert_eq!(ok.status, 200, "{}", String::from_utf8_lossy(&ok.body));
    let with_key = Request::get(format!("http://{}/v2/nothing", r.addr))
        .header("authorization", "Bearer sk-test-right")
        .body(Full::new(Bytes::new()))
        .unwrap();
    assert_eq!(send(with_key).await.status, 404);
}

#[tokio::test]
async fn keys_from_the_environment_and_the_client_header_reaches_the_engine() {
    let var = unique("keys").to_uppercase().replace('-', "_");
    // Set before the router starts, which reads it once; nothing else uses this name.
    std::env::set_var(&var, " sk-env-one , ,sk-env-two");
    let (e, r) = header_fleet(&format!("api_keys_env = \"{var}\"")).await;

    assert_unauthorized(&send(chat_with(r.addr, &[])).await);
    let ok = send(chat_with(r.addr, &[("authorization", "Bearer sk-env-two")])).await;
    assert_eq!(ok.status, 200, "{}", String::from_utf8_lossy(&ok.body));
    // The client's key is not rankgate's to drop: the engine gets the header as sent.
    assert_eq!(e.last()["authorization"], "Bearer sk-env-two");
    std::env::remove_var(&var);
}

#[tokio::test]
async fn unreadable_key_sources_stop_the_start_and_say_where() {
    let text = |server: &str| {
        format!(
            "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\n{server}\n{}",
            engine_toml("http://127.0.0.1:1", "vllm", 1, 0)
        )
    };
    let start = |t: String| async move {
        let cfg = rankgate::config::Config::from_str(&t).unwrap();
        match rankgate::app::Router::start(cfg).await {
            Ok(_) => panic!("started without its keys"),
            Err(e) => e.to_string(),
        }
    };
    let var = unique("unset").to_uppercase().replace('-', "_");
    let e = start(text(&format!("api_keys_env = \"{var}\""))).await;
    assert!(e.contains(&var) && e.contains("not set"), "{e}");

    let missing = std::env::temp_dir().join(unique("no-such-keys"));
    let e = start(text(&format!(
        "api_keys_file = {:?}",
        missing.display().to_string()
    )))
    .await;
    assert!(e.contains(&missing.display().to_string()), "{e}");

    let empty = KeyFile::new("# nothing yet\n\n");
    let e = start(text(&empty.toml())).await;
    assert!(e.contains("no key"), "{e}");
}

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

fn preflight(addr: std::net::SocketAddr, origin: &str) -> Request<Full<Bytes>> {
    Request::builder()
        .method(Method::OPTIONS)
        .uri(format!("http://{addr}/v1/chat/completions"))
        .header("origin", origin)
        .header("access-control-request-method", "POST")
        .header(
            "access-control-request-headers",
            "authorization, content-type",
        )
        .body(Full::new(Bytes::new()))
        .unwrap()
}

const APP: &str = "https://app.example.com";

#[tokio::test]
async fn cors_preflights_are_answered_before_the_key_check() {
    let keys = KeyFile::new("sk-cors\n");
    let e = engine(sim(Flavor::Vllm, 1, 0)).await;
    let r = router(
        &format!(
            "{}\ncors_allow_origins = [\"{APP}\", \"http://localhost:3000\"]\n{FAST}",
            keys.toml()
        ),
        &[engine_toml(&e.url(), "vllm", 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;

    let ok = send(preflight(r.addr, APP)).await;
    assert_eq!(ok.status, StatusCode::NO_CONTENT);
    let h = &ok.headers;
    assert_eq!(h["access-control-allow-origin"], APP);
    assert_eq!(h["access-control-allow-methods"], "GET, POST, OPTIONS");
    assert_eq!(
        h["access-control-allow-headers"],
        "authorization, content-type"
    );
    assert_eq!(h["access-control-max-age"], "600");
    assert_eq!(h["vary"], "origin");
    assert_eq!(request_id(&ok).len(), 32);

    let foreign = send(preflight(r.addr, "https://evil.example")).await;
    assert_eq!(foreign.status, StatusCode::FORBIDDEN);
    let v = foreign.json();
    assert_eq!(v["error"]["code"], 403);
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("https://evil.example")),
        "{v}"
    );
    assert!(foreign.headers.get("access-control-allow-origin").is_none());

    // The page can read rankgate's refusal, and the answer's ids once it sends its key.
    let refused = send(chat_with(r.addr, &[("origin", APP)])).await;
    assert_unauthorized(&refused);
    assert_eq!(refused.headers["access-control-allow-origin"], APP);
    let served = send(chat_with(
        r.addr,
        &[("origin", APP), ("authorization", "Bearer sk-cors")],
    ))
    .await;
    assert_eq!(served.status, 200);
    assert_eq!(served.headers["access-control-allow-origin"], APP);
    assert_eq!(
        served.headers["access-control-expose-headers"],
        "x-request-id, x-rankgate-worker"
    );
    // Another origin's actual request is served (the browser withholds it from the page).
    let other = send(chat_with(
        r.addr,
        &[
            ("origin", "https://evil.example"),
            ("authorization", "Bearer sk-cors"),
        ],
    ))
    .await;
    assert_eq!(other.status, 200);
    assert!(other.headers.get("access-control-allow-origin").is_none());
}

#[tokio::test]
async fn the_engines_own_cors_answer_does_not_widen_the_list() {
    let (_e, r) = header_fleet(&format!("cors_allow_origins = [\"{APP}\"]")).await;
    let other = send(chat_with(r.addr, &[("origin", "https://evil.example")])).await;
    assert_eq!(other.status, 200);
    assert!(
        other.headers.get("access-control-allow-origin").is_none(),
        "{:?}",
        other.headers
    );
    let ours = send(chat_with(r.addr, &[("origin", APP)])).await;
    assert_eq!(
        ours.headers
            .get_all("access-control-allow-origin")
            .iter()
            .collect::<Vec<_>>(),
        [APP]
    );
}

#[tokio::test]
async fn cors_star_allows_any_origin() {
    let e = engine(sim(Flavor::Vllm, 1, 0)).await;
    let r = router(
        &format!("cors_allow_origins = [\"*\"]\n{FAST}"),
        &[engine_toml(&e.url(), "vllm", 1, 0)],
    )
    .await;
    wait_state(&r, &[0], "available").await;
    let ok = send(preflight(r.addr, "https://anywhere.test")).await;
    assert_eq!(ok.status, StatusCode::NO_CONTENT);
    assert_eq!(ok.headers["access-control-allow-origin"], "*");
    assert!(ok.headers.get("vary").is_none());
    let served = send(chat_with(r.addr, &[("origin", "https://anywhere.test")])).await;
    assert_eq!(served.status, 200);
    assert_eq!(served.headers["access-control-allow-origin"], "*");
}

#[tokio::test]
async fn without_cors_config_options_goes_down_the_stack() {
    let (_e, r) = fleet(sim(Flavor::Vllm, 1, 0)).await;
    let reply = send(preflight(r.addr, APP)).await;
    assert_eq!(reply.status, StatusCode::METHOD_NOT_ALLOWED);
    assert!(reply.headers.get("access-control-allow-origin").is_none());
    let served = {
        wait_state(&r, &[0], "available").await;
        send(chat_with(r.addr, &[("origin", APP)])).await
    };
    assert_eq!(served.status, 200);
    assert!(served.headers.get("access-control-allow-origin").is_none());
    assert!(served.headers.get("vary").is_none());
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
