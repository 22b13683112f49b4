//! TLS on rankgate's own listeners: the front door serves HTTPS with HTTP/1.1 and h2 by ALPN, the
//! admin listener and the gRPC front door take TLS too, a certificate rotated on disk is served on
//! new connections, a bad certificate is a clear start error, a stalled or garbage handshake is
//! closed while others are served, and the engine behind a TLS listener is told `https`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Request, StatusCode, Version};
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate::config::{Config, ListenerTls};
use rankgate::http::HttpClient;
use rankgate::tls::Upstream;
use rankgate_sim::load::sdk;
use rankgate_sim::sim::SimConfig;
use rustls_pki_types::{CertificateDer, ServerName};

use crate::common;
use crate::common::*;
use crate::helpers::*;

fn listener_toml(table: &str, t: &ListenerTls) -> String {
    let mut out = format!(
        "[{table}]\ncert_file = {}\nkey_file = {}\n",
        toml_path(&t.cert_file),
        toml_path(&t.key_file)
    );
    if let Some(ca) = &t.client_ca_file {
        out.push_str(&format!("client_ca_file = {}\n", toml_path(ca)));
    }
    out
}

async fn request(
    client: &HttpClient<Full<Bytes>>,
    req: Request<Full<Bytes>>,
) -> (StatusCode, Version, http::HeaderMap, Bytes) {
    let resp = tokio::time::timeout(Duration::from_secs(10), client.request(req))
        .await
        .expect("an answer within 10 s")
        .expect("request");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("body").to_bytes();
    (parts.status, parts.version, parts.headers, body)
}

fn chat_to(base: &str) -> Request<Full<Bytes>> {
    Request::post(format!("{base}/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(chat_body(4, false))))
        .unwrap()
}

/// A simulated engine behind a router whose front door serves `files`' certificate (`server`:
/// more `[server]` keys), once both ranks are available.
async fn tls_router(files: &ListenerTls, server: &str) -> (rankgate_sim::sim::SimEngine, Router) {
    let e = engine(SimConfig::default()).await;
    let r = start(&format!(
        "{}{server}{}{FAST}{}",
        ports(),
        listener_toml("server.tls", files),
        engine_toml(&e.url(), "vllm", 2, 0)
    ))
    .await;
    wait_state(&r, &[0, 1], "available").await;
    (e, r)
}

#[tokio::test]
async fn the_front_door_serves_https_with_http1_and_h2_by_alpn() {
    let pki = Pki::new("front");
    let (files, _) = pki.issue("front");
    let (_e, r) = tls_router(&files, "").await;
    let base = format!("https://127.0.0.1:{}", r.addr.port());

    // The openai SDK's first calls, over HTTPS as a client configured with the CA would make
    // them; ALPN offers http/1.1 only.
    let h1 = rankgate::http::client_with(Duration::from_secs(2), &pki.trust());
    for call in sdk::calls("tiny-llama") {
        let o = sdk::send(&h1, &base, "EMPTY", &call).await.unwrap();
        assert!(
            o.status.is_success(),
            "{}: {} {:?}",
            call.name,
            o.status,
            o.body
        );
    }
    let (status, version, headers, _) = request(&h1, chat_to(&base)).await;
    assert_eq!((status, version), (StatusCode::OK, Version::HTTP_11));
    assert!(headers.contains_key("x-rankgate-worker"));

    // A client offering h2 gets h2.
    let h2 = rankgate::http::h2_client_with(Duration::from_secs(2), &pki.trust());
    let (status, version, _, body) = request(&h2, chat_to(&base)).await;
    assert_eq!(
        (status, version),
        (StatusCode::OK, Version::HTTP_2),
        "{body:?}"
    );

    // A client that does not trust the CA is refused at the handshake, and so is cleartext
    // HTTP on the TLS port.
    let stranger = rankgate::http::client_with::<Full<Bytes>>(
        Duration::from_secs(2),
        &Pki::new("stranger").trust(),
    );
    let err = stranger.request(chat_to(&base)).await.unwrap_err();
    let err = rankgate::http::error_chain(&err);
    assert!(
        err.contains("UnknownIssuer") || err.contains("certificate"),
        "{err}"
    );
    let plain = format!("http://127.0.0.1:{}", r.addr.port());
    assert!(client().request(chat_to(&plain)).await.is_err());
    r.shutdown().await;
}

#[tokio::test]
async fn the_admin_listener_and_the_grpc_front_door_take_tls_too() {
    let pki = Pki::new("admin");
    let (front, _) = pki.issue("front");
    let (admin, _) = pki.issue("admin");
    let e = engine(sim(rankgate_sim::sim::SimFlavor::Vllm, 1, 0)).await;
    let grpc = e.start_grpc(loopback()).await.unwrap();
    let r = start(&format!(
        "{}grpc_listen = \"127.0.0.1:0\"\n{}{}{FAST}[[engines]]\nurl = \"{}\"\ngrpc_url = \"http://{grpc}\"\nflavor = \"vllm\"\ndp_size = 1\n",
        ports(),
        listener_toml("server.tls", &front),
        listener_toml("server.admin_tls", &admin),
        e.url()
    ))
    .await;
    let https = rankgate::http::client_with(Duration::from_secs(2), &pki.trust());
    let admin_url = format!("https://127.0.0.1:{}/workers", r.admin_addr.port());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let req = Request::get(&admin_url).body(Full::default()).unwrap();
        let (status, _, _, body) = request(&https, req).await;
        assert_eq!(status, StatusCode::OK);
        let rows: serde_json::Value = serde_json::from_slice(&body).unwrap();
        if rows[0]["telemetry"] == "available" {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{rows}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(client()
        .request(
            Request::get(format!("http://{}/workers", r.admin_addr))
                .body(Full::default())
                .unwrap()
        )
        .await
        .is_err());

    // `rankgate top --admin https://... --ca-file ca.pem` reads it.
    let mut top = rankgate_top::Top::with_tls(
        &format!("https://127.0.0.1:{}", r.admin_addr.port()),
        Duration::from_secs(1),
        &pki.trust(),
    )
    .unwrap();
    top.poll_once().await;
    let state = top.state();
    assert!(
        state.outage.is_none() && state.updated.is_some(),
        "{:?}",
        state.outage
    );
    assert!(state.metrics_error.is_none(), "{:?}", state.metrics_error);

    // The gRPC front door over TLS: a gRPC client with the CA calls health through it.
    use rankgate::proto::health::health_client::HealthClient;
    use rankgate::proto::health::HealthCheckRequest;
    let transport = rankgate::telemetry::grpc::transport_with(Duration::from_secs(2), &pki.trust());
    let origin = format!("https://127.0.0.1:{}", r.grpc_addr.unwrap().port());
    let mut h = HealthClient::with_origin(transport, origin.parse().unwrap());
    let status = tokio::time::timeout(
        Duration::from_secs(10),
        h.check(HealthCheckRequest {
            service: String::new(),
        }),
    )
    .await
    .unwrap()
    .unwrap();
    assert_eq!(status.into_inner().status, 1, "SERVING");
    r.shutdown().await;
}

/// The certificate a new TLS connection to `addr` is served.
async fn served_certificate(addr: SocketAddr, trust: &Upstream) -> CertificateDer<'static> {
    let connector = tokio_rustls::TlsConnector::from(Arc::new((*trust.config).clone()));
    let name = ServerName::try_from("127.0.0.1").unwrap();
    let tls = tokio::time::timeout(Duration::from_secs(5), async {
        let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        connector.connect(name, tcp).await.unwrap()
    })
    .await
    .expect("a TLS handshake within 5 s");
    tls.get_ref().1.peer_certificates().unwrap()[0].clone()
}

#[tokio::test]
async fn a_certificate_rotated_on_disk_is_served_on_new_connections() {
    let pki = Pki::new("rotate");
    let (files, first) = pki.issue("front");
    let (_e, r) = tls_router(&files, "").await;
    let trust = pki.trust();
    assert_eq!(served_certificate(r.addr, &trust).await, first);
    // A connection made before the rotation, kept open through it.
    let kept = rankgate::http::client_with(Duration::from_secs(2), &trust);
    let base = format!("https://127.0.0.1:{}", r.addr.port());
    assert_eq!(request(&kept, chat_to(&base)).await.0, StatusCode::OK);

    // The renewal tool writes the new pair over the old files.
    let (_, second) = pki.issue("front");
    assert_ne!(first, second);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while served_certificate(r.addr, &trust).await != second {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the new certificate was not served within 10 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The pooled connection from before still serves.
    assert_eq!(request(&kept, chat_to(&base)).await.0, StatusCode::OK);

    // A broken file on disk is not served: the certificate in use stays.
    std::fs::write(&files.cert_file, "-----BEGIN CERTIFICATE-----\nbroken\n").unwrap();
    tokio::time::sleep(rankgate::tls::WATCH_EVERY * 3).await;
    assert_eq!(served_certificate(r.addr, &trust).await, second);
    r.shutdown().await;
}

#[tokio::test]
async fn a_bad_certificate_is_a_clear_start_error() {
    let pki = Pki::new("bad");
    let (good, _) = pki.issue("good");
    let (other, _) = pki.issue("other");
    let start_err = |tls: &ListenerTls, table: &str| {
        let text = format!(
            "{}{}[[engines]]\nurl = \"http://127.0.0.1:9\"\nflavor = \"vllm\"\ndp_size = 1\n",
            ports(),
            listener_toml(table, tls)
        );
        async move {
            match Router::start(Config::from_str(&text).unwrap()).await {
                Ok(_) => panic!("started with {text}"),
                Err(e) => e.to_string(),
            }
        }
    };
    // A key that belongs to another certificate.
    let mismatched = ListenerTls {
        key_file: other.key_file.clone(),
        ..good.clone()
    };
    let e = start_err(&mismatched, "server.tls").await;
    assert!(
        e.contains("server.tls.key_file")
            && e.contains("other.key")
            && e.contains("does not go with"),
        "{e}"
    );
    // A file that is not PEM.
    let garbage = pki.dir.join("garbage.pem");
    std::fs::write(&garbage, "hello").unwrap();
    let e = start_err(
        &ListenerTls {
            cert_file: garbage.clone(),
            ..good.clone()
        },
        "server.admin_tls",
    )
    .await;
    assert!(
        e.contains("server.admin_tls.cert_file")
            && e.contains("garbage.pem")
            && e.contains("no PEM certificate"),
        "{e}"
    );
    // A missing key file.
    let e = start_err(
        &ListenerTls {
            key_file: pki.dir.join("missing.key"),
            ..good.clone()
        },
        "server.tls",
    )
    .await;
    assert!(
        e.contains("cannot read") && e.contains("missing.key"),
        "{e}"
    );

    // `rankgate check` reads the files as `serve` does: the same message, exit 64.
    let config = pki.dir.join("check.toml");
    std::fs::write(
        &config,
        format!(
            "{}{}[[engines]]\nurl = \"http://127.0.0.1:9\"\nflavor = \"vllm\"\ndp_size = 1\n",
            ports(),
            listener_toml("server.tls", &mismatched)
        ),
    )
    .unwrap();
    // `serve` refuses it the same way, before binding anything.
    for cmd in ["check", "serve"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_rankgate"))
            .args([cmd, "--config"])
            .arg(&config)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{cmd}: {stderr}");
        assert!(
            stderr.contains("server.tls.key_file") && stderr.contains("does not go with"),
            "{cmd}: {stderr}"
        );
    }
}

/// Clients that stall or send garbage on the TLS port hold nothing: one that sends the first
/// byte of its handshake and no more is closed after `header_read_timeout`, one that sends plain
/// HTTP is refused at once, and a good client is served throughout.
#[tokio::test]
async fn a_stalled_or_garbage_handshake_is_closed_and_others_are_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let pki = Pki::new("stall");
    let (files, _) = pki.issue("front");
    let (_e, r) = tls_router(&files, "header_read_timeout = \"300ms\"\n").await;
    let started = tokio::time::Instant::now();
    // The first byte of a TLS record (a handshake), then nothing: a socket that sends nothing
    // at all waits in the kernel and never reaches rankgate (`TCP_DEFER_ACCEPT`).
    let mut silent = tokio::net::TcpStream::connect(r.addr).await.unwrap();
    silent.write_all(&[0x16]).await.unwrap();
    let mut garbage = tokio::net::TcpStream::connect(r.addr).await.unwrap();
    garbage
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    // The garbage one gets at most a TLS alert, then EOF.
    let closed = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            match garbage.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "a plain-HTTP client on the TLS port was not closed"
    );
    let base = format!("https://127.0.0.1:{}", r.addr.port());
    let h1 = rankgate::http::client_with(Duration::from_secs(2), &pki.trust());
    assert_eq!(request(&h1, chat_to(&base)).await.0, StatusCode::OK);
    let eof = tokio::time::timeout(Duration::from_secs(5), silent.read(&mut buf)).await;
    assert!(
        matches!(eof, Ok(Ok(0)) | Ok(Err(_))),
        "a client that never handshakes was not closed: {eof:?}"
    );
    assert!(
        started.elapsed() >= Duration::from_millis(250),
        "closed before its deadline"
    );
    r.shutdown().await;
}

#[tokio::test]
async fn behind_the_tls_listener_the_engine_is_told_https() {
    let pki = Pki::new("proto");
    let (files, _) = pki.issue("proto");
    let e = common::headers::HeaderEngine::start().await;
    let r = start(&format!(
        "{}{}{FAST}{}",
        ports(),
        listener_toml("server.tls", &files),
        e.toml("")
    ))
    .await;
    wait_state(&r, &[0, 1], "available").await;
    let base = format!("https://127.0.0.1:{}", r.addr.port());
    let h1 = rankgate::http::client_with(Duration::from_secs(2), &pki.trust());
    let h2 = rankgate::http::h2_client_with(Duration::from_secs(2), &pki.trust());
    for (client, version) in [(&h1, Version::HTTP_11), (&h2, Version::HTTP_2)] {
        // A client's own claim changes nothing: it is no trusted proxy.
        let mut req = chat_to(&base);
        (req.headers_mut()).insert("x-forwarded-proto", "http".parse().unwrap());
        let (status, got, _, body) = request(client, req).await;
        assert_eq!((status, got), (StatusCode::OK, version), "{body:?}");
        let seen = e.last();
        assert_eq!(seen["x-forwarded-proto"], "https", "{version:?}");
        assert_eq!(seen["x-forwarded-for"], "127.0.0.1", "{version:?}");
    }
    r.shutdown().await;
}
