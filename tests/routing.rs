//! Routing over real sockets: simulated engines on 127.0.0.1:0, a real router in front.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use http_body_util::{BodyExt, Full};
use rankgate_sim::sim::SimConfig;
use rankgate_sim::sim::SimFlavor as Flavor;

#[tokio::test]
async fn expands_engines_into_global_rank_workers() {
    let a = engine(sim(Flavor::Vllm, 2, 0)).await;
    let b = engine(sim(Flavor::Vllm, 2, 4)).await;
    let r = router(
        FAST,
        &[
            engine_toml(&a.url(), "vllm", 2, 0),
            engine_toml(&b.url(), "vllm", 2, 4),
        ],
    )
    .await;
    let rows = wait_state(&r, &[0, 1, 2, 3], "available").await;
    let ids: Vec<&str> = rows.iter().map(|w| w["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        [
            format!("{}@0", a.url()),
            format!("{}@1", a.url()),
            format!("{}@4", b.url()),
            format!("{}@5", b.url())
        ]
    );
    assert_eq!(rows[2]["dp_rank"], 4);
    assert_eq!(rows[2]["engine"], b.url());
    for key in [
        "flavor",
        "reason",
        "kv_usage",
        "num_running_reqs",
        "num_waiting_reqs",
        "age_ms",
        "in_flight",
    ] {
        assert!(rows[0].get(key).is_some(), "/workers lacks {key}");
    }
    // Global ranks travel to the engine, which accepts 4 and 5 (and would 400 on anything else).
    b.set_kv_usage(vec![0.0, 0.0]);
    a.set_kv_usage(vec![0.9, 0.9]);
    wait_workers(&r, Duration::from_secs(5), |rows| {
        rows[0]["kv_usage"] == 0.9
    })
    .await;
    for _ in 0..6 {
        let reply = chat(r.addr, 2).await;
        assert_eq!(
            reply.status,
            200,
            "{}",
            String::from_utf8_lossy(&reply.body)
        );
        assert!(reply.worker().starts_with(&b.url()));
    }
    let ranks: Vec<String> = b
        .seen()
        .iter()
        .filter_map(|s| s.rank_header.clone())
        .collect();
    assert!(
        !ranks.is_empty() && ranks.iter().all(|h| h == "4" || h == "5"),
        "{ranks:?}"
    );
}

#[tokio::test]
async fn least_kv_rank_receives_the_requests() {
    let (e, r) = fleet(SimConfig {
        kv_usage: vec![0.7, 0.2, 0.9, 0.5],
        ..sim(Flavor::Vllm, 4, 0)
    })
    .await;
    wait_state(&r, &[0, 1, 2, 3], "available").await;
    for _ in 0..20 {
        let reply = chat(r.addr, 1).await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.worker(), format!("{}@1", e.url()));
    }
    assert_eq!(e.served(), [0, 20, 0, 0]);
}

#[tokio::test]
async fn dark_rank_gets_nothing_even_when_it_would_look_idle() {
    // Rank 1 is really idle, but publishes no series: unknown is not idle.
    let (e, r) = fleet(SimConfig {
        kv_usage: vec![0.6, 0.0, 0.6],
        dark_ranks: vec![1],
        ..sim(Flavor::Vllm, 3, 0)
    })
    .await;
    let rows = wait_state(&r, &[0, 2], "available").await;
    assert_eq!(rows[1]["telemetry"], "unavailable");
    assert!(
        rows[1]["reason"]
            .as_str()
            .unwrap()
            .contains("no series for rank 1"),
        "{}",
        rows[1]
    );
    assert!(
        rows[1]["kv_usage"].is_null(),
        "unavailable rank must not show a KV figure"
    );
    let mut tasks = Vec::new();
    for _ in 0..24 {
        let addr = r.addr;
        tasks.push(tokio::spawn(async move { chat(addr, 4).await }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().status, 200);
    }
    let served = e.served();
    assert_eq!(served[1], 0, "dark rank served {served:?}");
    assert_eq!(served[0] + served[2], 24);
    let metrics = String::from_utf8(get(r.admin_addr, "/metrics").await.body.to_vec()).unwrap();
    let skipped = metrics
        .lines()
        .find_map(|l| l.strip_prefix("rankgate_skipped_unavailable_total "))
        .unwrap();
    assert_eq!(skipped, "24");
    assert!(metrics.contains(&format!(
        "rankgate_rank_telemetry_available{{worker=\"{}@1\"}} 0",
        e.url()
    )));
    assert!(metrics.contains(&format!(
        "rankgate_rank_kv_usage_ratio{{worker=\"{}@0\"}} 0.6",
        e.url()
    )));
}

#[tokio::test]
async fn stale_telemetry_makes_a_rank_unavailable_and_fresh_brings_it_back() {
    let slow = engine(SimConfig {
        kv_usage: vec![0.1],
        ..sim(Flavor::Vllm, 1, 0)
    })
    .await;
    let other = engine(SimConfig {
        kv_usage: vec![0.5],
        ..sim(Flavor::Vllm, 1, 1)
    })
    .await;
    let cfg = "[telemetry]\ninterval = \"50ms\"\nstale_after = \"400ms\"\ntimeout = \"20s\"\n";
    let r = router(
        cfg,
        &[
            engine_toml(&slow.url(), "vllm", 1, 0),
            engine_toml(&other.url(), "vllm", 1, 1),
        ],
    )
    .await;
    wait_state(&r, &[0, 1], "available").await;
    assert!(chat(r.addr, 1).await.worker().starts_with(&slow.url()));

    // The engine keeps answering, just too slowly: its last sample ages past stale_after.
    slow.set_metrics_delay(Duration::from_secs(2));
    let rows = wait_state(&r, &[0], "unavailable").await;
    assert!(
        rows[0]["reason"].as_str().unwrap().starts_with("stale"),
        "{}",
        rows[0]
    );
    for _ in 0..10 {
        assert!(chat(r.addr, 1).await.worker().starts_with(&other.url()));
    }

    slow.set_metrics_delay(Duration::ZERO);
    wait_state(&r, &[0], "available").await;
    assert!(chat(r.addr, 1).await.worker().starts_with(&slow.url()));
}

#[tokio::test]
async fn vllm_gets_the_header_and_client_rank_header_never_reaches_the_engine() {
    let (e, r) = fleet(SimConfig {
        kv_usage: vec![0.5, 0.1],
        ..sim(Flavor::Vllm, 2, 0)
    })
    .await;
    wait_state(&r, &[0, 1], "available").await;
    for spelling in [
        "X-data-parallel-rank",
        "x-data-parallel-rank",
        "X-DATA-PARALLEL-RANK",
    ] {
        let reply = send(
            post(r.addr, "/v1/chat/completions")
                .header(spelling, "0")
                .body(Full::new(Bytes::from(chat_body(1, false))))
                .unwrap(),
        )
        .await;
        assert_eq!(reply.status, 200);
        assert_eq!(reply.worker(), format!("{}@1", e.url()));
    }
    let seen = e.seen();
    assert_eq!(seen.len(), 3);
    for s in seen {
        assert_eq!(
            s.rank_header.as_deref(),
            Some("1"),
            "the engine must see rankgate's pin only"
        );
        assert_eq!(s.rank, 1);
        assert_eq!(s.body_rank, None, "vLLM bodies pass through untouched");
    }
}

#[tokio::test]
async fn sglang_gets_the_body_field_and_header() {
    let (e, r) = fleet(SimConfig {
        kv_usage: vec![0.1, 0.6],
        ..sim(Flavor::Sglang, 2, 0)
    })
    .await;
    wait_state(&r, &[0, 1], "available").await;
    let body = serde_json::json!({
        "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "data_parallel_rank": 1, "routed_dp_rank": 1,
    });
    let reply = send(
        post(r.addr, "/v1/chat/completions")
            .header("X-Data-Parallel-Rank", "1")
            .body(Full::new(Bytes::from(body.to_string())))
            .unwrap(),
    )
    .await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.worker(), format!("{}@0", e.url()));
    let seen = e.seen();
    assert_eq!(seen[0].body_rank, Some(serde_json::json!(0)));
    assert_eq!(seen[0].rank_header.as_deref(), Some("0"));
    assert_eq!(seen[0].rank, 0);
}

#[tokio::test]
async fn local_rank_numbering_pins_node_local_index() {
    use rankgate::worker::RankNumbering;
    // Second node of a hybrid deployment: global ranks 2..4, engine validating local indices.
    let e = engine(SimConfig {
        kv_usage: vec![0.8, 0.1],
        rank_numbering: RankNumbering::Local,
        ..sim(Flavor::Vllm, 2, 2)
    })
    .await;
    let toml = format!(
        "{}rank_header = \"local\"\n",
        engine_toml(&e.url(), "vllm", 2, 2)
    );
    let r = router(FAST, &[toml]).await;
    wait_state(&r, &[0, 1], "available").await;
    let reply = chat(r.addr, 1).await;
    assert_eq!(
        reply.status,
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    assert_eq!(reply.worker(), format!("{}@3", e.url()));
    assert_eq!(e.seen()[0].rank_header.as_deref(), Some("1"));
    assert_eq!(e.served(), [0, 1]);
}

/// One rank decoding at 20 tokens/s behind a router, ready.
async fn slow_fleet() -> (rankgate_sim::sim::SimEngine, rankgate::app::Router) {
    let (e, r) = fleet(SimConfig {
        decode_tokens_per_sec: 20.0,
        ..sim(Flavor::Vllm, 1, 0)
    })
    .await;
    wait_state(&r, &[0], "available").await;
    (e, r)
}

#[tokio::test]
async fn first_sse_chunk_arrives_before_the_engine_finishes() {
    let (e, r) = slow_fleet().await;
    let resp = stream_chat(r.addr, 40).await;
    assert_eq!(resp.status(), 200);
    let mut body = resp.into_body();
    let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
    assert!(first.starts_with(b"data: "), "{first:?}");
    // The engine is still decoding this request, and the router still counts it in flight.
    assert_eq!(e.running(), [1]);
    assert_eq!(workers(&r).await[0]["in_flight"], 1);
    let mut rest = Vec::new();
    while let Some(f) = body.frame().await {
        rest.extend_from_slice(&f.unwrap().into_data().unwrap_or_default());
    }
    assert!(rest.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(e.running(), [0]);
    assert_eq!(workers(&r).await[0]["in_flight"], 0);
}

#[tokio::test]
async fn burst_between_two_polls_spreads_over_ranks() {
    // One poll at start, the next 30 s later: the whole burst sees one snapshot.
    let e = engine(SimConfig {
        kv_usage: vec![0.10, 0.12],
        decode_tokens_per_sec: 50.0,
        ..sim(Flavor::Vllm, 2, 0)
    })
    .await;
    let cfg = "[telemetry]\ninterval = \"30s\"\nstale_after = \"60s\"\n";
    let r = router(cfg, &[engine_toml(&e.url(), "vllm", 2, 0)]).await;
    wait_state(&r, &[0, 1], "available").await;
    let scrapes = e.telemetry_requests();
    let mut tasks = Vec::new();
    for _ in 0..32 {
        let addr = r.addr;
        tasks.push(tokio::spawn(async move {
            let resp = stream_chat(addr, 20).await;
            let worker = resp.headers()["x-rankgate-worker"]
                .to_str()
                .unwrap()
                .to_string();
            let _ = resp.into_body().collect().await.unwrap();
            worker
        }));
    }
    let mut per: HashMap<String, usize> = HashMap::new();
    for t in tasks {
        *per.entry(t.await.unwrap()).or_default() += 1;
    }
    assert_eq!(
        e.telemetry_requests(),
        scrapes,
        "a poll happened during the burst"
    );
    assert_eq!(per.len(), 2, "burst herded onto one rank: {per:?}");
    assert!(
        per.values().all(|&n| n >= 8),
        "burst barely spread: {per:?}"
    );
}

#[tokio::test]
async fn client_disconnect_mid_stream_aborts_engine_work() {
    let (e, r) = slow_fleet().await;
    let resp = stream_chat(r.addr, 200).await;
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    assert_eq!(e.running(), [1]);
    assert_eq!(workers(&r).await[0]["in_flight"], 1);
    // The client goes away after one token of 200: the router closes the upstream stream, the
    // engine stops decoding and frees the KV, and the rank no longer counts the request.
    drop(body);
    let rows = wait_workers(&r, Duration::from_secs(5), |rows| rows[0]["in_flight"] == 0).await;
    assert_eq!(rows[0]["in_flight"], 0);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while e.running() != [0] {
        assert!(
            tokio::time::Instant::now() < deadline,
            "engine still decoding for a gone client"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(e.kv_usage(), [0.0]);
}

#[tokio::test]
async fn shutdown_drains_streams_in_flight() {
    let (e, r) = slow_fleet().await;
    let addr = r.addr;
    let resp = stream_chat(addr, 20).await;
    let mut body = resp.into_body();
    body.frame().await.unwrap().unwrap();
    // Shut down with a stream mid-flight: no new connections, but this one runs to its end.
    let stopping = tokio::spawn(r.shutdown());
    let mut rest = Vec::new();
    while let Some(f) = body.frame().await {
        rest.extend_from_slice(&f.unwrap().into_data().unwrap_or_default());
    }
    assert!(
        rest.ends_with(b"data: [DONE]\n\n"),
        "stream cut short by shutdown"
    );
    stopping.await.unwrap();
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "still accepting after shutdown"
    );
    assert_eq!(e.running(), [0]);
}
