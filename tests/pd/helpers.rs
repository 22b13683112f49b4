//! What the disaggregated-serving tests share: prefill and decode engines and their `[[engines]]`
//! tables, a router over them, requests run at once, and the router's `/metrics` page.

use std::time::Duration;

use bytes::Bytes;
use rankgate::app::Router;
use rankgate_sim::sim::{PdRole, SimConfig, SimEngine, SimFlavor};

use crate::common::*;

pub fn side(flavor: SimFlavor, role: Option<PdRole>, dp_size: u32) -> SimConfig {
    SimConfig {
        role,
        decode_tokens_per_sec: 2000.0,
        ..sim(flavor, dp_size, 0)
    }
}

/// One `[[engines]]` table for a server that is its own DP deployment, with its role.
pub fn role_toml(e: &SimEngine, flavor: &str, dp_size: u32, role: &str) -> String {
    let extra = match (flavor, role, e.bootstrap_port()) {
        ("sglang", "prefill", Some(port)) => format!("bootstrap_port = {port}\n"),
        _ => String::new(),
    };
    format!(
        "[[engines]]\nurl = \"{}\"\nflavor = \"{flavor}\"\ndp_size = {dp_size}\nrole = \"{role}\"\n{extra}",
        e.url()
    )
}

/// `p` prefill and `d` decode servers of `dp` ranks each behind a router with fast telemetry.
pub async fn pd_fleet(
    flavor: SimFlavor,
    p: usize,
    d: usize,
    dp: u32,
    server: &str,
) -> (Vec<SimEngine>, Vec<SimEngine>, Router) {
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    for _ in 0..p {
        prefill.push(engine(side(flavor, Some(PdRole::Prefill), dp)).await);
    }
    for _ in 0..d {
        decode.push(engine(side(flavor, Some(PdRole::Decode), dp)).await);
    }
    let f = flavor.as_str();
    let tables: Vec<String> = (prefill.iter().map(|e| role_toml(e, f, dp, "prefill")))
        .chain(decode.iter().map(|e| role_toml(e, f, dp, "decode")))
        .collect();
    let r = router_with(server, FAST, &tables).await;
    let n = (p + d) * dp as usize;
    wait_workers(&r, Duration::from_secs(10), |rows| {
        rows.len() == n && rows.iter().all(|w| w["telemetry"] == "available")
    })
    .await;
    wait_models(&r).await;
    (prefill, decode, r)
}

/// Runs the requests at once; their answers in order.
pub async fn all(
    requests: impl IntoIterator<Item = impl std::future::Future<Output = (u16, Bytes)> + Send + 'static>,
) -> Vec<(u16, Bytes)> {
    let tasks: Vec<_> = requests.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.expect("request task"));
    }
    out
}

pub async fn metrics_text(r: &Router) -> String {
    String::from_utf8_lossy(&get(r.admin_addr, "/metrics").await.body).to_string()
}
