//! The front door's error handling and protocols, over real sockets.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use rankgate_sim::sim::SimConfig;
use rankgate_sim::sim::SimFlavor as Flavor;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

#[tokio::test]
async fn unknown_path_wrong_method_and_models() {
    let (_e, r) = fleet(sim(Flavor::Vllm, 1, 0)).await;
    wait_state(&r, &[0], "available").await;
    wait_models(&r).await;
    get(r.addr, "/v2/nothing")
        .await
        .assert_openai_error(404, None);
    let wrong = get(r.addr, "/v1/chat/completions").await;
    wrong.assert_openai_error(405, None);
    assert_eq!(wrong.headers["allow"], "POST");
    // The fleet's list, answered by rankgate itself.
    let models = get(r.addr, "/v1/models").await;
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], "tiny-llama");
    assert!(models.headers.get("x-rankgate-worker").is_none());
}

#[tokio::test]
async fn oversized_bodies_get_413_declared_or_streamed() {
    let e = engine(sim(Flavor::Vllm, 1, 0)).await;
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\nmax_body_bytes = 1024\n{FAST}{}",
        engine_toml(&e.url(), "vllm", 1, 0)
    );
    let r = rankgate::app::Router::start(rankgate::config::Config::from_str(&text).unwrap())
        .await
        .unwrap();
    wait_state(&r, &[0], "available").await;

    let big = Bytes::from(vec![b'x'; 4096]);
    let reply = send(
        post(r.addr, "/v1/chat/completions")
            .body(Full::new(big))
            .unwrap(),
    )
    .await;
    reply.assert_openai_error(413, None);

    // A chunked body announces no length: the cap applies while it streams.
    let mut s = TcpStream::connect(r.addr).await.unwrap();
    let chunk = "x".repeat(1000);
    let mut req = String::from("POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\ncontent-type: application/json\r\n\r\n");
    for _ in 0..3 {
        req.push_str(&format!("{:x}\r\n{chunk}\r\n", chunk.len()));
    }
    req.push_str("0\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let head = String::from_utf8_lossy(&buf[..n]);
    assert!(head.starts_with("HTTP/1.1 413"), "{head}");
}

#[tokio::test]
async fn sglang_bad_json_is_400_and_nothing_reaches_the_engine() {
    let (e, r) = fleet(sim(Flavor::Sglang, 2, 0)).await;
    wait_state(&r, &[0, 1], "available").await;
    for bad in ["{not json", "[1, 2]"] {
        let reply = send(
            post(r.addr, "/v1/completions")
                .body(Full::new(Bytes::from(bad)))
                .unwrap(),
        )
        .await;
        reply.assert_openai_error(400, None);
    }
    assert!(e.seen().is_empty());
    assert_eq!(workers(&r).await[0]["in_flight"], 0);
}

#[tokio::test]
async fn reject_mode_answers_503_with_retry_after_when_no_rank_has_telemetry() {
    let e = engine(SimConfig {
        dark_ranks: vec![0, 1],
        ..sim(Flavor::Vllm, 2, 0)
    })
    .await;
    let cfg = format!("[routing]\nno_telemetry = \"reject\"\nretry_after_secs = 3\n{FAST}");
    let r = router(&cfg, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    let rows = wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.iter().all(|w| w["reachable"] == true)
    })
    .await;
    assert!(
        rows.iter().all(|w| w["telemetry"] == "unavailable"),
        "{rows:?}"
    );
    let reply = chat(r.addr, 1).await;
    reply.assert_openai_error(503, None);
    assert_eq!(reply.headers["retry-after"], "3");
    assert!(e.seen().is_empty());
    assert_eq!(get(r.admin_addr, "/ready").await.status, 503);
}

#[tokio::test]
async fn no_telemetry_falls_back_to_least_in_flight_on_reachable_ranks() {
    let (_e, r) = fleet(SimConfig {
        dark_ranks: vec![0, 1],
        ..sim(Flavor::Vllm, 2, 0)
    })
    .await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows[0]["reachable"] == true
    })
    .await;
    assert_eq!(get(r.admin_addr, "/ready").await.status, 200);
    let reply = chat(r.addr, 1).await;
    assert_eq!(reply.status, 200);
}

#[tokio::test]
async fn unreachable_engine_means_503_not_a_hang() {
    // Bind then drop a listener: nothing listens on that port any more.
    let port = TcpListener::bind(loopback())
        .await
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let r = router(
        FAST,
        &[engine_toml(
            &format!("http://127.0.0.1:{port}"),
            "vllm",
            1,
            0,
        )],
    )
    .await;
    let rows = wait_workers(&r, Duration::from_secs(10), |rows| {
        rows[0]["reason"]
            .as_str()
            .is_some_and(|s| s.contains("every telemetry source failed"))
    })
    .await;
    assert_eq!(rows[0]["reachable"], false);
    chat(r.addr, 1).await.assert_openai_error(503, None);
    assert_eq!(get(r.admin_addr, "/ready").await.status, 503);
    assert_eq!(get(r.admin_addr, "/health").await.status, 200);
}

/// A fake engine that answers `/metrics` and drops every other request's connection.
async fn broken_engine() -> String {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let Ok(n) = s.read(&mut buf).await else {
                    return;
                };
                if buf[..n].starts_with(b"GET /metrics") {
                    let body = "vllm:kv_cache_usage_perc{engine=\"0\"} 0.1\n";
                    let resp = format!(
                        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = s.write_all(resp.as_bytes()).await;
                }
                // Anything else: close without answering.
            });
        }
    });
    format!("http://{addr}")
}

#[tokio::test]
async fn upstream_failure_is_502_naming_the_engine() {
    let url = broken_engine().await;
    let r = router(FAST, &[engine_toml(&url, "vllm", 1, 0)]).await;
    wait_state(&r, &[0], "available").await;
    let reply = chat(r.addr, 1).await;
    reply.assert_openai_error(502, None);
    assert!(reply.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains(&url));
    assert_eq!(reply.worker(), format!("{url}@0"));
    assert_eq!(workers(&r).await[0]["in_flight"], 0);
    let metrics = String::from_utf8(get(r.admin_addr, "/metrics").await.body.to_vec()).unwrap();
    // Counted on its worker, with the status rankgate answered for it, and the model it named
    // (the engine's list is not read yet: the request's own name is its label).
    let worker = format!("status=\"502\",worker=\"{url}@0\"}} 1");
    assert!(
        metrics.lines().any(|l| l.starts_with(
            "rankgate_requests_total{model=\"tiny-llama\",route=\"/v1/chat/completions\","
        ) && l.ends_with(&worker)),
        "{metrics}"
    );
}

#[tokio::test]
async fn h2c_clients_are_served() {
    let (_e, r) = fleet(sim(Flavor::Vllm, 1, 0)).await;
    wait_state(&r, &[0], "available").await;
    let h2: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http();
    let resp = h2
        .request(
            Request::post(format!("http://{}/v1/chat/completions", r.addr))
                .header("content-type", "application/json")
                .body(Full::new(Bytes::from(chat_body(3, true))))
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(resp.version(), http::Version::HTTP_2);
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().contains_key("x-rankgate-worker"));
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(body.ends_with(b"data: [DONE]\n\n"));
}

#[tokio::test]
async fn admin_endpoints() {
    let (_e, r) = fleet(sim(Flavor::Vllm, 2, 0)).await;
    wait_state(&r, &[0, 1], "available").await;
    assert_eq!(get(r.admin_addr, "/health").await.status, 200);
    assert_eq!(get(r.admin_addr, "/ready").await.status, 200);
    assert_eq!(chat(r.addr, 1).await.status, 200);
    let m = String::from_utf8(get(r.admin_addr, "/metrics").await.body.to_vec()).unwrap();
    for needle in [
        "rankgate_requests_total{model=",
        "rankgate_request_duration_seconds_bucket{model=",
        "rankgate_rank_kv_usage_ratio{worker=",
        "rankgate_rank_telemetry_available{worker=",
        "rankgate_skipped_unavailable_total 0",
    ] {
        assert!(m.contains(needle), "missing {needle} in\n{m}");
    }
    // The one chat request, under whichever model label it got (the model list may not have
    // been read yet when it came).
    let durations: f64 = m
        .lines()
        .filter(|l| l.starts_with("rankgate_request_duration_seconds_count{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(durations, 1.0, "{m}");
    assert_eq!(get(r.admin_addr, "/nope").await.status, 404);
}
