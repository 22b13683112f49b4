//! Native per-rank telemetry over real sockets: gRPC GetLoads, SGLang /v1/loads, gateway rollups,
//! rankgate's own /loads, and source fallback.
#![cfg(feature = "sim")] // the simulated engine

mod common;

use std::time::Duration;

use common::*;
use rankgate::app::Router;
use rankgate::telemetry::grpc::{transport, LoadsClient};
use rankgate::worker;
use rankgate_sim::sim::{SimConfig, SimEngine, SimFlavor as Flavor};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A sim engine with its gRPC side started; returns the engine and its gRPC `host:port`.
async fn grpc_engine(cfg: SimConfig) -> (SimEngine, String) {
    let e = engine(cfg).await;
    let g = e.start_grpc(loopback()).await.expect("start gRPC");
    (e, g.to_string())
}

/// A gRPC-serving engine and a router reading it through GetLoads only.
async fn grpc_fleet(
    cfg: SimConfig,
    flavor: &str,
    dp_size: u32,
    start_rank: u32,
) -> (SimEngine, Router) {
    let (e, g) = grpc_engine(cfg).await;
    let table = with_sources(
        engine_toml(&e.url(), flavor, dp_size, start_rank),
        &[&format!("grpc://{g}")],
    );
    let r = router(FAST, &[table]).await;
    (e, r)
}

fn with_sources(table: String, sources: &[&str]) -> String {
    let list: Vec<String> = sources.iter().map(|s| format!("\"{s}\"")).collect();
    format!("{table}telemetry = [{}]\n", list.join(", "))
}

fn reason(row: &Value) -> &str {
    row["reason"].as_str().unwrap_or("")
}

#[tokio::test]
async fn grpc_loads_project_onto_global_ranks() {
    let (e, r) = grpc_fleet(
        SimConfig {
            kv_usage: vec![0.7, 0.2],
            ..sim(Flavor::Vllm, 2, 4)
        },
        "vllm",
        2,
        4,
    )
    .await;
    let rows = wait_state(&r, &[0, 1], "available").await;
    assert_eq!(rows[0]["id"], format!("{}@4", e.url()));
    assert_eq!(rows[0]["source"], "grpc");
    assert_eq!(rows[0]["kv_usage"], 0.7);
    assert_eq!(rows[1]["kv_usage"], 0.2);
    assert_eq!(rows[1]["max_total_num_tokens"], 4096);
    assert_eq!(rows[1]["num_used_tokens"], 819);
    for _ in 0..5 {
        assert_eq!(chat(r.addr, 1).await.worker(), format!("{}@5", e.url()));
    }
    assert_eq!(e.served(), [0, 5]);
    // GetLoads goes to the gRPC port, so no /metrics scrape was needed.
    assert!(e.telemetry_requests() > 0);
}

#[tokio::test]
async fn rank_missing_from_getloads_is_unavailable_and_gets_no_traffic() {
    let (e, r) = grpc_fleet(
        SimConfig {
            kv_usage: vec![0.0, 0.5],
            dark_ranks: vec![4],
            ..sim(Flavor::Vllm, 2, 4)
        },
        "vllm",
        2,
        4,
    )
    .await;
    let rows = wait_state(&r, &[1], "available").await;
    assert_eq!(rows[0]["telemetry"], "unavailable");
    assert!(reason(&rows[0]).contains("rank 4 absent"), "{}", rows[0]);
    assert!(rows[0]["kv_usage"].is_null());
    for _ in 0..8 {
        assert_eq!(chat(r.addr, 1).await.worker(), format!("{}@5", e.url()));
    }
    assert_eq!(e.served(), [0, 8]);
}

#[tokio::test]
async fn invalid_values_make_only_that_rank_unavailable() {
    let (e, r) = grpc_fleet(
        SimConfig {
            garbage_ranks: vec![1],
            ..sim(Flavor::Sglang, 3, 0)
        },
        "sglang",
        3,
        0,
    )
    .await;
    let rows = wait_state(&r, &[0, 2], "available").await;
    assert_eq!(rows[1]["telemetry"], "unavailable");
    assert!(reason(&rows[1]).contains("NaN"), "{}", rows[1]);
    let metrics = String::from_utf8(get(r.admin_addr, "/metrics").await.body.to_vec()).unwrap();
    let invalid = |w: usize| -> u64 {
        let key = format!(
            "rankgate_telemetry_invalid_entries_total{{worker=\"{}@{w}\"}} ",
            e.url()
        );
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(&key))
            .unwrap()
            .parse()
            .unwrap()
    };
    assert!(invalid(1) >= 1);
    assert_eq!(invalid(0), 0);
    assert_eq!(invalid(2), 0);
    for _ in 0..9 {
        assert_eq!(chat(r.addr, 1).await.status, 200);
    }
    assert_eq!(e.served()[1], 0);
}

#[tokio::test]
async fn dp_rank_filter_zero_is_sent_and_answered_as_a_filter() {
    for flavor in [Flavor::Vllm, Flavor::Sglang] {
        let (_e, g) = grpc_engine(sim(flavor, 2, 0)).await;
        let kind = match flavor {
            Flavor::Vllm => worker::Flavor::Vllm,
            Flavor::Sglang => worker::Flavor::Sglang,
        };
        let origin = format!("http://{g}");
        let client = LoadsClient::new(kind, &origin, transport(Duration::from_secs(2))).unwrap();
        let all = client.get_loads(None).await.unwrap();
        assert_eq!(
            all.loads.iter().map(|l| l.dp_rank).collect::<Vec<_>>(),
            [Some(0), Some(1)]
        );
        let zero = client.get_loads(Some(0)).await.unwrap();
        assert_eq!(
            zero.loads.len(),
            1,
            "explicit 0 must filter, not read as 'no filter'"
        );
        assert_eq!(zero.loads[0].dp_rank, Some(0));
        let one = client.get_loads(Some(1)).await.unwrap();
        assert_eq!(one.loads[0].dp_rank, Some(1));
        let err = client.get_loads(Some(7)).await.unwrap_err();
        assert!(
            err.contains("InvalidArgument") || err.contains("invalid argument"),
            "{err}"
        );
    }
}

#[tokio::test]
async fn real_servicer_quirks_summed_capacity_is_split() {
    let (_e, r) = grpc_fleet(
        SimConfig {
            kv_usage: vec![0.25, 0.5],
            servicer_quirks: true,
            ..sim(Flavor::Vllm, 2, 0)
        },
        "vllm",
        2,
        0,
    )
    .await;
    let rows = wait_state(&r, &[0, 1], "available").await;
    // The servicer says 8192 (the sum); each rank really holds 4096.
    assert_eq!(rows[0]["max_total_num_tokens"], 4096);
    assert_eq!(rows[0]["kv_usage"], 0.25);
    assert_eq!(rows[1]["kv_usage"], 0.5);
}

/// A fake upstream gateway serving a smg-style fleet rollup on GET /loads.
async fn fake_gateway(body: &'static str) -> String {
    let listener = TcpListener::bind(loopback()).await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let Ok(n) = s.read(&mut buf).await else {
                    return;
                };
                let (status, payload) = if buf[..n].starts_with(b"GET /loads") {
                    ("200 OK", body)
                } else {
                    ("404 Not Found", "{}")
                };
                let resp = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{payload}",
                    payload.len()
                );
                let _ = s.write_all(resp.as_bytes()).await;
            });
        }
    });
    format!("http://{addr}")
}

const ROLLUP: &str = r#"{"timestamp":"2026-12-02T00:00:00Z","version":"smg-1.13","dp_rank_count":3,
 "loads":[
  {"worker":"http://10.0.0.1:8000","worker_type":"regular","dp_rank":0,"num_running_reqs":4,"num_waiting_reqs":0,"token_usage":0.10},
  {"worker":"http://10.0.0.2:8000","worker_type":"regular","dp_rank":0,"num_running_reqs":2,"num_waiting_reqs":1,"token_usage":0.50},
  {"worker":"http://10.0.0.3:8000","worker_type":"regular","dp_rank":0,"num_running_reqs":0,"num_waiting_reqs":0,"token_usage":0.30}],
 "aggregate":{"total_running_reqs":6,"total_waiting_reqs":1,"total_reqs":7,"avg_token_usage":0.3,"avg_throughput":0,"avg_utilization":0}}"#;

#[tokio::test]
async fn gateway_rollup_is_one_worker_never_dp_ranks() {
    let gw = fake_gateway(ROLLUP).await;
    let gateway = format!("[[engines]]\nurl = \"{gw}\"\nflavor = \"gateway\"\n");
    // The same rollup offered as a vLLM engine's loads: must not be read as its ranks 0..3.
    let misread = with_sources(
        engine_toml("http://127.0.0.1:1", "vllm", 3, 0),
        &[&format!("{gw}/loads")],
    );
    let r = router(FAST, &[gateway, misread]).await;
    let rows = wait_state(&r, &[0], "available").await;
    assert_eq!(rows.len(), 4, "one gateway worker + three engine ranks");
    assert_eq!(rows[0]["id"], gw);
    assert!(rows[0]["dp_rank"].is_null());
    assert_eq!(rows[0]["kv_usage"], 0.3);
    assert_eq!(rows[0]["num_running_reqs"], 6);
    assert_eq!(rows[0]["aggregate"], true);
    let upstream = rows[0]["upstream_loads"].as_array().unwrap();
    assert_eq!(upstream.len(), 3);
    assert_eq!(upstream[1]["worker"], "http://10.0.0.2:8000");
    assert_eq!(upstream[1]["dp_rank"], 0);
    let rows = wait_workers(&r, Duration::from_secs(10), |rows| {
        reason(&rows[1]).contains("fleet rollup")
    })
    .await;
    for row in &rows[1..] {
        assert_eq!(row["telemetry"], "unavailable", "{row}");
        assert!(reason(row).contains("fleet rollup"), "{row}");
    }
}

#[tokio::test]
async fn rankgate_loads_round_trips_into_another_rankgate() {
    let (e, inner) = fleet(SimConfig {
        kv_usage: vec![0.3, 0.5],
        ..sim(Flavor::Vllm, 2, 0)
    })
    .await;
    wait_state(&inner, &[0, 1], "available").await;
    // Models are learnt from /v1/models shortly after the first poll.
    wait_workers(&inner, Duration::from_secs(10), |rows| {
        rows[0]["models"][0] == "tiny-llama"
    })
    .await;

    let loads = get(inner.admin_addr, "/loads").await.json();
    assert_eq!(loads["dp_rank_count"], 2);
    assert_eq!(loads["loads"][1]["worker"], e.url());
    assert_eq!(loads["loads"][1]["dp_rank"], 1);
    assert_eq!(loads["loads"][1]["token_usage"], 0.5);
    assert!((loads["aggregate"]["avg_token_usage"].as_f64().unwrap() - 0.4).abs() < 1e-9);
    assert!(loads["timestamp"].as_str().unwrap().ends_with('Z'));
    assert_eq!(
        get(inner.admin_addr, "/loads?model=tiny-llama")
            .await
            .json()["loads"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(
        get(inner.admin_addr, "/loads?model=other").await.json()["loads"]
            .as_array()
            .unwrap()
            .len(),
        0
    );

    let outer_engine = format!(
        "[[engines]]\nurl = \"http://{}\"\nflavor = \"gateway\"\ntelemetry = [\"http://{}/loads\"]\n",
        inner.addr, inner.admin_addr
    );
    let outer = router(FAST, &[outer_engine]).await;
    let rows = wait_state(&outer, &[0], "available").await;
    assert_eq!(rows.len(), 1);
    assert!((rows[0]["kv_usage"].as_f64().unwrap() - 0.4).abs() < 1e-9);
    let up = rows[0]["upstream_loads"].as_array().unwrap();
    assert_eq!(up.len(), 2);
    assert_eq!(up[0]["worker"], e.url());
    assert_eq!(up[1]["dp_rank"], 1);
    // Traffic flows outer -> inner -> engine, landing on the inner router's least-KV rank.
    let reply = chat(outer.addr, 1).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.worker(), format!("http://{}", inner.addr));
    assert_eq!(e.served(), [1, 0]);
    assert_eq!(e.seen()[0].rank_header.as_deref(), Some("0"));
}

#[tokio::test]
async fn source_fallback_grpc_then_http_then_prometheus() {
    let (e, g) = grpc_engine(SimConfig {
        kv_usage: vec![0.2, 0.4],
        ..sim(Flavor::Sglang, 2, 0)
    })
    .await;
    let closed = TcpListener::bind(loopback())
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let preferred = router(
        FAST,
        &[with_sources(
            engine_toml(&e.url(), "sglang", 2, 0),
            &[&format!("grpc://{g}"), "http", "prometheus"],
        )],
    )
    .await;
    let fallback = router(
        FAST,
        &[with_sources(
            engine_toml(&e.url(), "sglang", 2, 0),
            &[&format!("grpc://{closed}"), "http", "prometheus"],
        )],
    )
    .await;
    let rows = wait_workers(&preferred, Duration::from_secs(10), |rows| {
        rows[0]["source"] == "grpc"
    })
    .await;
    assert_eq!(rows[1]["kv_usage"], 0.4);
    let rows = wait_workers(&fallback, Duration::from_secs(10), |rows| {
        rows[0]["source"] == "http"
    })
    .await;
    assert_eq!(rows[1]["kv_usage"], 0.4);

    e.set_native_failing(true);
    for r in [&preferred, &fallback] {
        let rows = wait_workers(r, Duration::from_secs(10), |rows| {
            rows.iter().all(|w| w["source"] == "prometheus")
        })
        .await;
        assert_eq!(rows[0]["kv_usage"], 0.2);
        assert_eq!(rows[0]["telemetry"], "available");
    }
    e.set_native_failing(false);
    wait_workers(&preferred, Duration::from_secs(10), |rows| {
        rows[0]["source"] == "grpc"
    })
    .await;
}

#[tokio::test]
async fn each_engine_is_polled_once_per_interval_whatever_its_dp_size() {
    let (e, g) = grpc_engine(sim(Flavor::Vllm, 8, 0)).await;
    let cfg = "[telemetry]\ninterval = \"100ms\"\nstale_after = \"2s\"\n";
    for source in [format!("grpc://{g}"), "prometheus".to_string()] {
        let table = with_sources(engine_toml(&e.url(), "vllm", 8, 0), &[&source]);
        let r = router(cfg, &[table]).await;
        wait_state(&r, &[0, 7], "available").await;
        let start = e.telemetry_requests();
        let t0 = tokio::time::Instant::now();
        // A fixed window to count in: this measures a rate, it waits for no event.
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let polls = e.telemetry_requests() - start;
        let intervals = t0.elapsed().as_millis() as u64 / 100;
        // One GetLoads or scrape per interval for all eight ranks; per-rank polling makes eight.
        assert!(
            polls >= 1 && polls <= intervals + 1,
            "{source}: {polls} polls in {intervals} intervals"
        );
        r.shutdown().await;
    }
}

#[tokio::test]
async fn a_hanging_preferred_source_is_probed_aside_instead_of_stalling_polls() {
    // Accepts connections and never answers: each GetLoads waits for the poll timeout.
    let hang = TcpListener::bind(loopback()).await.unwrap();
    let hang_addr = hang.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((s, _)) = hang.accept().await {
            conns.push(s);
        }
    });
    let e = engine(SimConfig {
        kv_usage: vec![0.25],
        ..sim(Flavor::Sglang, 1, 0)
    })
    .await;
    let cfg = "[telemetry]\ninterval = \"50ms\"\nstale_after = \"3s\"\ntimeout = \"1s\"\n";
    let table = with_sources(
        engine_toml(&e.url(), "sglang", 1, 0),
        &[&format!("grpc://{hang_addr}"), "http"],
    );
    let r = router(cfg, &[table]).await;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows[0]["source"] == "http"
    })
    .await;
    // While gRPC sits out, polls answer at the interval: samples stay young, far under the
    // 1 s a poll would take if every one waited for the hanging source first.
    let mut ages = Vec::new();
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        ages.push(workers(&r).await[0]["age_ms"].as_u64().unwrap_or(u64::MAX));
    }
    let young = ages.iter().filter(|&&a| a < 400).count();
    assert!(young >= 7, "sample ages {ages:?}");
    held.abort();
}
