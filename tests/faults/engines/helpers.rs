//! What the engine fault tests share: the bound on waits for state, a metric read from the admin
//! listener, the rows of `/workers` for one engine and the reason a row gives, and the simulated
//! engine's usual config and its `[[engines]]` table.

use std::time::Duration;

use rankgate::app::Router;
use rankgate_sim::sim::{SimConfig, SimEngine, SimFlavor as Flavor};
use serde_json::Value;

use crate::common::*;

/// Bound on anything that should happen promptly.
pub const SOON: Duration = Duration::from_secs(5);

/// A sample from the admin `/metrics` (0 when absent).
pub async fn metric(r: &Router, series: &str) -> f64 {
    let text = String::from_utf8_lossy(&get(r.admin_addr, "/metrics").await.body).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

/// Rows of `/workers` whose engine is `e`.
pub fn rows_of<'a>(rows: &'a [Value], e: &SimEngine) -> Vec<&'a Value> {
    let url = e.url();
    rows.iter()
        .filter(|r| r["engine"] == url.as_str())
        .collect()
}

pub fn is_on(worker: &str, e: &SimEngine) -> bool {
    worker.starts_with(&format!("{}@", e.url()))
}

pub fn reason(row: &Value) -> &str {
    row["reason"].as_str().unwrap_or("")
}

/// A vLLM sim hosting global ranks `start..start + dp`.
pub fn vllm(dp: u32, start: u32) -> SimConfig {
    sim(Flavor::Vllm, dp, start)
}

/// The `[[engines]]` table of a vLLM sim built with [`vllm`]`(dp, start)`.
pub fn toml_of(e: &SimEngine, dp: u32, start: u32) -> String {
    engine_toml(&e.url(), "vllm", dp, start)
}
