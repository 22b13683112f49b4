//! The fleet's size told the same way everywhere: an engine whose shape is not known yet (its
//! `/metrics` hangs, so its DP size cannot be read) is one entry in `/workers`,
//! `rankgate_fleet_ranks` and `rankgate_rank_telemetry_state` alike, and counted in
//! `rankgate_fleet_engines_pending_shape`, which the alert `RankgateEngineShapeUnknown` reads.
//! And the first requests, before the engines' model lists are read, carry their model's label.

use std::time::Duration;

use rankgate_sim::sim::{SimConfig, SimFlavor};

use crate::common::*;
use crate::helpers::*;

const WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_pending_its_shape_is_counted_everywhere() {
    let up = engine(sim(SimFlavor::Vllm, 2, 0)).await;
    let hung = engine(SimConfig {
        hang_metrics: true,
        hang_models: true,
        ..sim(SimFlavor::Vllm, 1, 0)
    })
    .await;
    // Its flavor is set, its DP size left to the engine, which cannot say it.
    let pending = format!("[[engines]]\nurl = \"{}\"\nflavor = \"vllm\"\n", hung.url());
    let r = router(FAST, &[engine_toml(&up.url(), "vllm", 2, 0), pending]).await;
    let rows = wait_workers(&r, WAIT, |rows| {
        rows.len() == 3
            && (rows.iter())
                .filter(|w| w["telemetry"] == "available")
                .count()
                == 2
    })
    .await;
    let row = (rows.iter())
        .find(|w| w["reason_kind"] == "shape_unknown")
        .unwrap_or_else(|| panic!("no pending row: {rows:?}"));
    assert_eq!(row["id"], hung.url(), "{row}");

    let page = scrape(&r).await;
    assert_eq!(
        sample(&page, "rankgate_fleet_engines_pending_shape"),
        Some(1.0),
        "{page}"
    );
    // The same size as `/workers` (and so `rankgate top`, which counts its rows).
    assert_eq!(sum(&page, "rankgate_fleet_ranks", &[]), rows.len() as f64);
    let unavailable = sum(&page, "rankgate_fleet_ranks", &[("state", "unavailable")]);
    assert_eq!(unavailable, 1.0, "{page}");
    let series = format!(
        "rankgate_rank_telemetry_state{{worker=\"{}\",state=\"unavailable\",reason=\"shape_unknown\"}}",
        hung.url()
    );
    assert_eq!(sample(&page, &series), Some(1.0), "{page}");
    let states = sum(&page, "rankgate_rank_telemetry_state", &[]);
    assert_eq!(
        states,
        rows.len() as f64,
        "one state series per /workers row"
    );
    r.shutdown().await;
}

/// Before the engines' model lists are read (here never: `/v1/models` hangs), a request naming
/// its model is labelled with it, not `unknown`; clients cannot grow the label set past a few
/// names that way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_requests_carry_their_models_label() {
    let e = engine(SimConfig {
        hang_models: true,
        ..sim(SimFlavor::Vllm, 1, 0)
    })
    .await;
    let r = router(FAST, &[engine_toml(&e.url(), "vllm", 1, 0)]).await;
    wait_state(&r, &[0], "available").await;
    let rows = workers(&r).await;
    assert_eq!(rows[0]["models_state"], "pending", "{rows:?}");
    for _ in 0..2 {
        assert_eq!(chat(r.addr, 2).await.status, http::StatusCode::OK);
    }
    let page = scrape(&r).await;
    let named = sum(&page, "rankgate_requests_total", &[("model", "tiny-llama")]);
    assert_eq!(named, 2.0, "{page}");
    assert_eq!(
        sum(&page, "rankgate_requests_total", &[("model", "unknown")]),
        0.0,
        "{page}"
    );

    // Twenty made-up names: a few are believed, the rest count as `unknown`.
    for i in 0..20 {
        let body = serde_json::json!({
            "model": format!("made-up-{i}"),
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
        });
        post_json(r.addr, "/v1/chat/completions", body).await;
    }
    let page = scrape(&r).await;
    let labels: std::collections::BTreeSet<&str> = (page.lines())
        .filter(|l| l.starts_with("rankgate_requests_total{"))
        .filter_map(|l| l.split("model=\"").nth(1)?.split('"').next())
        .collect();
    assert!(labels.len() <= 10, "bounded: {labels:?}");
    assert!(labels.contains("unknown"), "{labels:?}");
    r.shutdown().await;
}
