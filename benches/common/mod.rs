#![allow(dead_code)]
//! A fleet for the benches: `ranks` workers as engines of 8 ranks (or one engine when fewer),
//! every rank with fresh telemetry, KV spread over [0.20, 0.36].

use std::sync::Arc;
use std::time::Duration;

use rankgate::config::Config;
use rankgate::table::{Load, RankTelemetry, RankView, Snapshot, Table};
use rankgate::worker::Fleet;

pub fn fleet_config(ranks: u32) -> Config {
    let per = ranks.min(8);
    let text: String = (0..ranks / per)
        .map(|e| {
            format!(
                "[[engines]]\nurl = \"http://10.{}.{}.1:8000\"\nflavor = \"vllm\"\ndp_size = {per}\nstart_rank = {}\n",
                e / 256,
                e % 256,
                e * per
            )
        })
        .collect();
    Config::from_str(&text).expect("config")
}

pub fn view(r: u32, now: tokio::time::Instant) -> RankView {
    RankView {
        telemetry: RankTelemetry::Available(Load {
            kv_usage: 0.2 + f64::from(r % 17) * 0.01,
            running: Some(4),
            waiting: Some(1),
            used_tokens: Some(50_000),
            capacity_tokens: Some(262_144),
            aggregate: false,
            upstream: None,
            prefix_cache: None,
            fresh: None,
            sampled_at: now,
        }),
        reachable: true,
        weight_at_poll: 0,
        in_flight_at_report: 0,
        kv_per_request: 0.02,
        source: None,
        ever_available: true,
    }
}

pub fn table(ranks: u32) -> Arc<Table> {
    let table = Table::new(
        Fleet::expand(fleet_config(ranks).engines),
        Duration::from_secs(3600),
    );
    let now = tokio::time::Instant::now();
    let snap = table.snapshot.load();
    table.snapshot.store(Arc::new(Snapshot {
        fleet: snap.fleet.clone(),
        ranks: (0..ranks).map(|r| view(r, now)).collect(),
        catalog: snap.catalog.clone(),
    }));
    table
}
