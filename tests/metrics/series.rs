//! Series that must be right: time to first byte observed once per stream, requests carrying model,
//! route, status and worker while clients cannot add series, and a removed engine's series leaving
//! the page.

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use rankgate::app::Router;
use rankgate::config::Config;
use rankgate_sim::sim::{SimConfig, DEFAULT_MODEL};
use serde_json::json;

use crate::common::*;
use crate::{exposition::*, helpers::*};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_to_first_byte_is_observed_once_per_stream() {
    let (_e, r) = fleet(sim(rankgate_sim::sim::SimFlavor::Vllm, 2, 0)).await;
    wait_state(&r, &[0, 1], "available").await;
    wait_models(&r).await;
    let count = |page: &str| {
        sample(
            page,
            &format!("rankgate_time_to_first_byte_seconds_count{{model=\"{DEFAULT_MODEL}\"}}"),
        )
        .unwrap_or(0.0)
    };
    // One to label the model's series, then the count from there.
    chat(r.addr, 1).await;
    let before = count(&scrape(&r).await);
    const N: usize = 7;
    let mut streams = Vec::new();
    for _ in 0..N {
        streams.push(stream_chat(r.addr, 12).await);
    }
    // Answers rankgate writes itself carry no engine byte: not observed.
    assert_eq!(get(r.addr, "/nowhere").await.status, StatusCode::NOT_FOUND);
    assert_eq!(get(r.addr, "/v1/models").await.status, StatusCode::OK);
    for s in streams {
        let body = s
            .into_body()
            .collect()
            .await
            .expect("stream body")
            .to_bytes();
        assert!(body.ends_with(b"data: [DONE]\n\n"));
    }
    let page = scrape(&r).await;
    assert_eq!(count(&page) - before, N as f64, "{page}");
    let duration = sample(
        &page,
        &format!("rankgate_request_duration_seconds_count{{model=\"{DEFAULT_MODEL}\"}}"),
    )
    .unwrap();
    assert!(duration >= 1.0 + N as f64, "{page}");
    r.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_carry_model_route_status_and_worker_and_clients_cannot_add_series() {
    let (a, _b, r) = two_models().await;
    let body = |model: &str| {
        Full::new(Bytes::from(
            json!({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                .to_string(),
        ))
    };
    let reply = send(
        post(r.addr, "/v1/chat/completions")
            .body(body("model-a"))
            .unwrap(),
    )
    .await;
    assert_eq!(reply.status, StatusCode::OK);
    let worker = reply.worker();
    assert!(worker.starts_with(&a.url()), "{worker}");
    let page = scrape(&r).await;
    let series = format!(
        "rankgate_requests_total{{model=\"model-a\",route=\"/v1/chat/completions\",status=\"200\",worker=\"{worker}\"}}"
    );
    assert_eq!(sample(&page, &series), Some(1.0), "{page}");
    let before = page.lines().filter(|l| !l.starts_with('#')).count();

    // A thousand model names the fleet does not serve, and a hundred paths it does not route.
    let sent = AtomicUsize::new(0);
    let tasks = (0..10).map(|t| {
        let (addr, sent) = (r.addr, &sent);
        async move {
            for i in 0..100 {
                let name = format!("bogus-{t}-{i}");
                let reply = send(
                    post(addr, "/v1/chat/completions")
                        .body(body(&name))
                        .unwrap(),
                )
                .await;
                assert_eq!(reply.status, StatusCode::NOT_FOUND);
                if i % 10 == 0 {
                    assert_eq!(
                        get(addr, &format!("/v1/{name}")).await.status,
                        StatusCode::NOT_FOUND
                    );
                }
                sent.fetch_add(1, Relaxed);
            }
        }
    });
    futures_join_all(tasks).await;
    assert_eq!(sent.load(Relaxed), 1000);
    let page = scrape(&r).await;
    check_exposition(&page);
    assert!(
        !page.contains("bogus"),
        "a client's name became a label:\n{page}"
    );
    let after = page.lines().filter(|l| !l.starts_with('#')).count();
    // Two new series (the unknown model on its route, the unmatched path); the histograms'
    // `unknown` model was already there.
    assert!(after <= before + 2, "{before} -> {after} series:\n{page}");
    let local = |route: &str| {
        sample(
            &page,
            &format!("rankgate_local_responses_total{{model=\"unknown\",route=\"{route}\",status=\"404\"}}"),
        )
    };
    assert_eq!(local("/v1/chat/completions"), Some(1000.0), "{page}");
    assert_eq!(local("unmatched"), Some(100.0), "{page}");
    r.shutdown().await;
}

/// Runs the futures concurrently on this task, to their end.
async fn futures_join_all<F: std::future::Future<Output = ()>>(futs: impl Iterator<Item = F>) {
    let mut set: Vec<std::pin::Pin<Box<F>>> = futs.map(Box::pin).collect();
    std::future::poll_fn(|cx| {
        set.retain_mut(|f| f.as_mut().poll(cx).is_pending());
        if set.is_empty() {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await
}

const TOKEN: &str = "metrics-test-admin-token";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_engines_series_leave_the_page() {
    let a = engine(SimConfig::default()).await;
    let b = engine(SimConfig {
        start_rank: 2,
        ..SimConfig::default()
    })
    .await;
    let var = format!("RANKGATE_METRICS_TEST_ADMIN_TOKEN_{}", std::process::id());
    std::env::set_var(&var, TOKEN);
    let text = format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\nexpose_worker = \"url\"\nadmin_token_env = \"{var}\"\n{FAST}{}{}",
        engine_toml(&a.url(), "vllm", 2, 0),
        engine_toml(&b.url(), "vllm", 2, 2),
    );
    let r = Router::start(Config::from_str(&text).unwrap())
        .await
        .unwrap();
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    // Traffic on every rank, so each has request series.
    a.set_kv_usage(vec![0.9, 0.9]);
    b.set_kv_usage(vec![0.1, 0.1]);
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows[0]["kv_usage"] == json!(0.9)
    })
    .await;
    for _ in 0..4 {
        assert_eq!(chat(r.addr, 1).await.status, StatusCode::OK);
    }
    let page = scrape(&r).await;
    assert!(sum(&page, "rankgate_requests_total", &[("status", "200")]) >= 4.0);
    assert!(
        page.contains(&format!("worker=\"{}@2\"", b.url())),
        "{page}"
    );
    assert!(page.contains(&format!("engine=\"{}\"", b.url())), "{page}");

    let req = Request::builder()
        .method(Method::DELETE)
        .uri(format!("http://{}/engines?url={}", r.admin_addr, b.url()))
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let reply = send(req).await;
    assert_eq!(reply.status, StatusCode::OK, "{:?}", reply.body);
    assert_eq!(reply.json()["removed"], json!([b.url()]));
    wait_workers(&r, Duration::from_secs(10), |rows| rows.len() == 2).await;
    let page = scrape(&r).await;
    check_exposition(&page);
    assert!(!page.contains(&b.url()), "{page}");
    assert!(page.contains(&format!("rankgate_worker_info{{worker=\"{}@0\"", a.url())));
    assert_eq!(
        sample(&page, "rankgate_fleet_ranks{state=\"available\"}"),
        Some(2.0)
    );
    r.shutdown().await;
}
