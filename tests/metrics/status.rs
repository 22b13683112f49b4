//! The fleet's size told the same way everywhere: an engine whose shape is not known yet (its
//! `/metrics` hangs, so its DP size cannot be read) is one entry in `/workers`,
//! `rankgate_fleet_ranks` and `rankgate_rank_telemetry_state` alike, and counted in
//! `rankgate_fleet_engines_pending_shape`, which the alert `RankgateEngineShapeUnknown` reads.

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
        rows.len() == 3 && (rows.iter()).filter(|w| w["telemetry"] == "available").count() == 2
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
    assert_eq!(states, rows.len() as f64, "one state series per /workers row");
    r.shutdown().await;
}
