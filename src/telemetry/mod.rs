//! The telemetry monitor: polls each ENGINE once per interval and publishes the one snapshot.
//!
//! One poller task per engine, so a slow engine (a saturated vLLM once took ~7 s to answer one
//! scrape) only delays its own ranks while their age shows. Pollers never write the snapshot
//! themselves: they send their projected per-rank results to one publisher task, the single
//! writer, which builds the next [`Snapshot`] aside and swaps it in. A single writer needs no
//! compare-and-swap retry loop and owns the per-rank state-change log.

pub mod grpc;
pub mod loads;
mod poller;
pub mod prom;

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::JoinSet;

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
    dispatched_at_poll: Vec<u64>,
    ranks: Vec<RankTelemetry>,
    source: &'static str,
    /// The engine's model ids, when this poll read them.
    models: Option<Vec<String>>,
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
        let http: poller::HttpClient = crate::http::client(cfg.timeout);
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

/// Renders an error with its sources, since hyper's top-level message alone ("client error
/// (Connect)") does not say what went wrong.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

/// The single writer: folds reports into the current views and swaps in each new snapshot.
async fn publish(table: Arc<Table>, mut rx: mpsc::Receiver<Report>, default_kv_per_request: f64) {
    let mut views: Vec<RankView> = table.snapshot.load().ranks.clone();
    let mut models = table.snapshot.load().models.clone();
    while let Some(report) = rx.recv().await {
        let range = table.fleet.workers_of(report.engine);
        for ((w, telemetry), dispatched) in range.zip(report.ranks).zip(report.dispatched_at_poll) {
            log_change(&table, w, &views[w].telemetry, &telemetry);
            views[w] = RankView {
                telemetry,
                reachable: report.reachable,
                dispatched_at_poll: dispatched,
                kv_per_request: 0.0,
                source: report.source,
            };
        }
        if let Some(m) = report.models {
            models[report.engine] = m.into();
        }
        estimate_kv_per_request(&mut views, default_kv_per_request);
        table.snapshot.store(Arc::new(Snapshot {
            ranks: views.clone(),
            models: models.clone(),
        }));
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
            if kind(a) != kind(b) =>
        {
            tracing::warn!(worker = %id, reason = %b, "telemetry still unavailable, new reason");
        }
        (RankTelemetry::Unavailable { .. }, RankTelemetry::Available(l)) => {
            tracing::info!(worker = %id, kv_usage = l.kv_usage, "telemetry available");
        }
        _ => {}
    }
}

/// The part of a reason before any number, so "invalid KV usage 1.2" and "... 1.3" are one state.
fn kind(reason: &str) -> &str {
    let end = reason
        .find(|c: char| c.is_ascii_digit())
        .unwrap_or(reason.len());
    &reason[..end]
}

/// Sets each rank's estimated KV cost of one more request: its own KV per running request when it
/// has running requests, else the fleet's mean of those, else the configured default. Used to
/// credit requests the engine has not reported yet.
fn estimate_kv_per_request(views: &mut [RankView], default: f64) {
    let per_rank = |v: &RankView| match &v.telemetry {
        RankTelemetry::Available(l) => match l.running {
            Some(r) if r > 0 && l.kv_usage > 0.0 => Some((l.kv_usage / r as f64).clamp(1e-4, 1.0)),
            _ => None,
        },
        RankTelemetry::Unavailable { .. } => None,
    };
    let (sum, n) = views
        .iter()
        .filter_map(per_rank)
        .fold((0.0, 0u32), |(s, n), x| (s + x, n + 1));
    let fleet = if n > 0 { sum / n as f64 } else { default };
    for v in views.iter_mut() {
        v.kv_per_request = per_rank(v).unwrap_or(fleet);
    }
}
