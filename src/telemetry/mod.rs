//! The telemetry monitor: polls each ENGINE once per interval and publishes the one snapshot.
//!
//! One poller task per engine, so a slow engine (a saturated vLLM once took ~7 s to answer one
//! scrape) only delays its own ranks while their age shows. Pollers never write the snapshot
//! themselves: they send their projected per-rank results to one publisher task, the single
//! writer, which builds the next [`Snapshot`] aside and swaps it in. A single writer needs no
//! compare-and-swap retry loop and owns the per-rank state-change log. Each poller also probes
//! its engine's health path ([`health`]) and stops promptly on shutdown, mid-poll or not.

pub mod grpc;
pub mod health;
pub mod loads;
mod models;
mod poller;
pub mod prom;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinSet;

use crate::catalog::Model;
use crate::config::TelemetryConfig;
use crate::http::Shutdown;
use crate::table::{RankTelemetry, RankView, Snapshot, Table};

/// Counters the admin `/metrics` page shows about telemetry itself.
#[derive(Debug, Default)]
pub struct TelemetryStats {
    pub polls: AtomicU64,
    pub poll_failures: AtomicU64,
    pub bad_lines: AtomicU64,
    /// Per worker: polls in which the rank's entry was present but invalid or duplicated.
    pub invalid_entries: Vec<AtomicU64>,
    /// Entries naming a rank outside their engine's managed set.
    pub unmanaged_entries: AtomicU64,
}

impl TelemetryStats {
    pub fn new(workers: usize) -> TelemetryStats {
        TelemetryStats {
            invalid_entries: (0..workers).map(|_| AtomicU64::new(0)).collect(),
            ..TelemetryStats::default()
        }
    }
}

/// One engine's poll, projected onto its ranks.
pub struct Report {
    engine: usize,
    reachable: bool,
    weight_at_poll: Vec<u64>,
    ranks: Vec<RankTelemetry>,
    source: &'static str,
    /// The engine's models, when this poll read them.
    models: Option<Vec<Model>>,
}

/// Starts the pollers and the publisher; they run until `shutdown`.
pub fn spawn(
    table: Arc<Table>,
    cfg: TelemetryConfig,
    default_kv_per_request: f64,
    stats: Arc<TelemetryStats>,
    shutdown: Shutdown,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let (tx, rx) = mpsc::channel(table.fleet.engines.len().max(1) * 2);
        let http = poller::HttpClient::new(crate::http::client(cfg.timeout));
        let grpc = grpc::transport(cfg.timeout);
        let mut tasks = JoinSet::new();
        for e in 0..table.fleet.engines.len() {
            match poller::Poller::new(
                e,
                table.clone(),
                cfg.clone(),
                http.clone(),
                grpc.clone(),
                stats.clone(),
            ) {
                Ok(p) => {
                    tasks.spawn(p.run(tx.clone(), shutdown.clone()));
                }
                // Config validation makes this unreachable; if it is not, the engine's ranks
                // stay Unavailable ("not polled") instead of taking the router down.
                Err(err) => {
                    tracing::error!(engine = %table.fleet.engines[e].url, %err, "engine not polled")
                }
            }
        }
        drop(tx);
        publish(table, rx, default_kv_per_request).await;
        while tasks.join_next().await.is_some() {}
    })
}

/// The single writer: folds reports into the current views and swaps in each new snapshot.
async fn publish(table: Arc<Table>, mut rx: mpsc::Receiver<Report>, default_kv_per_request: f64) {
    let mut views: Vec<RankView> = table.snapshot.load().ranks.clone();
    let mut catalog = table.snapshot.load().catalog.clone();
    // Staleness has no report to announce it (a hung engine sends none), so a timer looks for it.
    let mut stale = vec![false; views.len()];
    let mut tick = tokio::time::interval(table.stale_after / 4);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            report = rx.recv() => {
                let Some(report) = report else { return };
                let range = table.fleet.workers_of(report.engine);
                for ((w, telemetry), weight) in range.zip(report.ranks).zip(report.weight_at_poll) {
                    log_change(&table, w, &views[w].telemetry, &telemetry);
                    views[w] = RankView {
                        telemetry,
                        reachable: report.reachable,
                        weight_at_poll: weight,
                        kv_per_request: 0.0,
                        source: report.source,
                    };
                }
                if let Some(m) = report.models {
                    let e = report.engine;
                    // A list fixed in the config is never replaced.
                    if table.fleet.engines[e].models.is_none() && catalog.of(e) != Some(&m[..]) {
                        catalog = Arc::new(catalog.with(e, m.into()));
                    }
                }
                estimate_kv_per_request(&mut views, default_kv_per_request);
                table.snapshot.store(Arc::new(Snapshot {
                    ranks: views.clone(),
                    catalog: catalog.clone(),
                }));
            }
            _ = tick.tick() => {}
        }
        log_staleness(&table, &views, &mut stale);
    }
}

/// One log line when a rank's last sample ages past `stale_after`, one when fresh numbers return.
fn log_staleness(table: &Table, views: &[RankView], stale: &mut [bool]) {
    let now = tokio::time::Instant::now();
    for (w, v) in views.iter().enumerate() {
        let RankTelemetry::Available(l) = &v.telemetry else {
            stale[w] = false;
            continue;
        };
        let is_stale = now.saturating_duration_since(l.sampled_at) > table.stale_after;
        if is_stale != stale[w] {
            let id = &table.fleet.workers[w].id_text;
            if is_stale {
                tracing::warn!(worker = %id, stale_after_ms = table.stale_after.as_millis() as u64, "telemetry stale");
            } else {
                tracing::info!(worker = %id, "telemetry fresh again");
            }
            stale[w] = is_stale;
        }
    }
}

/// One log line per state change of a rank, not one per poll.
fn log_change(table: &Table, w: usize, old: &RankTelemetry, new: &RankTelemetry) {
    let id = &table.fleet.workers[w].id_text;
    match (old, new) {
        (RankTelemetry::Available(_), RankTelemetry::Unavailable { reason }) => {
            tracing::warn!(worker = %id, %reason, "telemetry unavailable");
        }
        (RankTelemetry::Unavailable { reason: a }, RankTelemetry::Unavailable { reason: b })
            if !a.same_kind(b) =>
        {
            tracing::warn!(worker = %id, reason = %b, "telemetry still unavailable, new reason");
        }
        (RankTelemetry::Unavailable { .. }, RankTelemetry::Available(l)) => {
            tracing::info!(worker = %id, kv_usage = l.kv_usage, "telemetry available");
        }
        _ => {}
    }
}

/// Sets each rank's estimated KV cost of one more request, used to credit requests the engine has
/// not reported yet. A rank with running requests uses its own KV per request. Otherwise the cost
/// is the fleet's typical request size taken relative to THIS rank's capacity where capacities are
/// known (a rank with half the KV tokens fills twice as fast), else the fleet's mean fraction,
/// else the configured default.
fn estimate_kv_per_request(views: &mut [RankView], default: f64) {
    struct Sample {
        fraction: Option<f64>,
        tokens: Option<f64>,
        capacity: Option<f64>,
    }
    let sample = |v: &RankView| match &v.telemetry {
        RankTelemetry::Available(l) => {
            let capacity = l.capacity_tokens.map(|c| c as f64);
            let fraction = match l.running {
                Some(r) if r > 0 && l.kv_usage > 0.0 => {
                    Some((l.kv_usage / r as f64).clamp(1e-4, 1.0))
                }
                _ => None,
            };
            Sample {
                fraction,
                tokens: fraction.zip(capacity).map(|(f, c)| f * c),
                capacity,
            }
        }
        RankTelemetry::Unavailable { .. } => Sample {
            fraction: None,
            tokens: None,
            capacity: None,
        },
    };
    let samples: Vec<Sample> = views.iter().map(sample).collect();
    let mean = |xs: Vec<f64>| (!xs.is_empty()).then(|| xs.iter().sum::<f64>() / xs.len() as f64);
    let fleet_fraction =
        mean(samples.iter().filter_map(|s| s.fraction).collect()).unwrap_or(default);
    let fleet_tokens = mean(samples.iter().filter_map(|s| s.tokens).collect());
    let mean_capacity = mean(samples.iter().filter_map(|s| s.capacity).collect());
    for (v, s) in views.iter_mut().zip(&samples) {
        v.kv_per_request = match (s.fraction, s.capacity, fleet_tokens, mean_capacity) {
            (Some(f), ..) => f,
            (None, Some(c), Some(t), _) => (t / c).clamp(1e-4, 1.0),
            (None, Some(c), None, Some(m)) => (fleet_fraction * m / c).clamp(1e-4, 1.0),
            _ => fleet_fraction,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::Load;
    use tokio::time::Instant;

    fn view(kv: f64, running: u32, capacity: Option<u64>) -> RankView {
        RankView {
            telemetry: RankTelemetry::Available(Load {
                kv_usage: kv,
                running: Some(running),
                waiting: Some(0),
                used_tokens: None,
                capacity_tokens: capacity,
                aggregate: false,
                upstream: None,
                sampled_at: Instant::now(),
            }),
            ..RankView::initial()
        }
    }

    #[test]
    fn credit_is_relative_to_each_ranks_capacity() {
        // Idle fleet: the default is scaled so the half-size rank fills twice as fast.
        let mut v = vec![view(0.0, 0, Some(4096)), view(0.0, 0, Some(2048))];
        estimate_kv_per_request(&mut v, 0.02);
        assert!((v[0].kv_per_request - 0.015).abs() < 1e-12);
        assert!((v[1].kv_per_request - 0.03).abs() < 1e-12);
        // Rank 0 runs 4 requests at 0.1 KV: ~102 tokens each; rank 1 (idle, 1024 tokens) would
        // take 0.1 per request, rank 2 (no capacity known) the fleet fraction 0.025.
        let mut v = vec![
            view(0.1, 4, Some(4096)),
            view(0.0, 0, Some(1024)),
            view(0.0, 0, None),
        ];
        estimate_kv_per_request(&mut v, 0.02);
        assert!((v[0].kv_per_request - 0.025).abs() < 1e-12);
        assert!((v[1].kv_per_request - 0.1).abs() < 1e-12);
        assert!((v[2].kv_per_request - 0.025).abs() < 1e-12);
    }
}
