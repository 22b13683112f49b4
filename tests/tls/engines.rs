//! TLS toward engines: an HTTPS engine is polled and routed to, and an engine that requires mTLS
//! takes rankgate's client certificate.

use std::time::Duration;

use http::StatusCode;
use http_body_util::BodyExt;
use rankgate_sim::sim::SimConfig;

use crate::common::*;
use crate::helpers::*;

#[tokio::test]
async fn an_https_engine_is_polled_and_routed_to() {
    let pki = Pki::new("engine");
    let (files, _) = pki.issue("engine");
    let e = engine(SimConfig {
        tls: Some(files),
        ..SimConfig::default()
    })
    .await;
    assert!(e.url().starts_with("https://"));
    // Named http:// by mistake: unavailable, and the reason points at the scheme.
    let plain_url = e.url().replacen("https://", "http://", 1);
    let wrong = start(&format!(
        "{}{FAST}{}",
        ports(),
        engine_toml(&plain_url, "vllm", 2, 0)
    ))
    .await;
    let rows = wait_workers(&wrong, Duration::from_secs(10), |rows| {
        rows[0]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("https://"))
    })
    .await;
    assert_eq!(rows[0]["telemetry"], "unavailable", "{rows:?}");
    wrong.shutdown().await;
    let r = start(&format!(
        "{}{FAST}[engine_tls]\nca_file = {}\n{}",
        ports(),
        toml_path(&pki.ca_file),
        engine_toml(&e.url(), "vllm", 2, 0)
    ))
    .await;
    wait_state(&r, &[0, 1], "available").await;
    let reply = chat(r.addr, 4).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert!(
        reply.worker().starts_with(&format!("{}@", e.url())),
        "{}",
        reply.worker()
    );
    // Streams too.
    let resp = stream_chat(r.addr, 8).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(String::from_utf8_lossy(&body).contains("[DONE]"));
    r.shutdown().await;
}

#[tokio::test]
async fn an_engine_that_requires_mtls_takes_rankgates_client_certificate() {
    let pki = Pki::new("mtls");
    let (mut server, _) = pki.issue("engine");
    server.client_ca_file = Some(pki.ca_file.clone());
    let (client_cert, _) = pki.issue("rankgate");
    let e = engine(SimConfig {
        tls: Some(server),
        ..SimConfig::default()
    })
    .await;

    // Without a client certificate the engine refuses every connection: its ranks are
    // unavailable, never routed, and the reason says why.
    let without = start(&format!(
        "{}{FAST}[engine_tls]\nca_file = {}\n{}",
        ports(),
        toml_path(&pki.ca_file),
        engine_toml(&e.url(), "vllm", 2, 0)
    ))
    .await;
    let rows = wait_workers(&without, Duration::from_secs(10), |rows| {
        rows.iter().all(|w| {
            w["telemetry"] == "unavailable"
                && w["reason"]
                    .as_str()
                    .is_some_and(|r| !r.starts_with("no telemetry yet"))
        })
    })
    .await;
    let reason = rows[0]["reason"].as_str().unwrap();
    assert!(reason.contains("CertificateRequired"), "{reason}");
    assert_eq!(
        chat(without.addr, 4).await.status,
        StatusCode::SERVICE_UNAVAILABLE,
        "{rows:?}"
    );
    without.shutdown().await;

    let with = start(&format!(
        "{}{FAST}[engine_tls]\nca_file = {}\ncert_file = {}\nkey_file = {}\n{}",
        ports(),
        toml_path(&pki.ca_file),
        toml_path(&client_cert.cert_file),
        toml_path(&client_cert.key_file),
        engine_toml(&e.url(), "vllm", 2, 0)
    ))
    .await;
    wait_state(&with, &[0, 1], "available").await;
    assert_eq!(chat(with.addr, 4).await.status, StatusCode::OK);
    with.shutdown().await;
}
