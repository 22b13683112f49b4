//! The telemetry monitor: polls each ENGINE once per interval and publishes the one snapshot.
//!
//! One poller task per engine, so a slow engine (a saturated vLLM once took ~7 s to answer one
//! scrape) only delays its own ranks while their age shows. Pollers never write the snapshot
//! themselves: they send their projected per-rank results to one publisher task, the single
//! writer, which builds the next [`Snapshot`] aside and swaps it in. A single writer needs no
//! compare-and-swap retry loop and owns the per-rank state-change log.

pub mod prom;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::{Instant, MissedTickBehavior};

use crate::config::TelemetryConfig;
use crate::http::{shutdown_signalled, Shutdown};
use crate::table::{RankTelemetry, RankView, Snapshot, Table};

/// Largest telemetry body accepted; a real vLLM /metrics is ~70 KB.
const MAX_TELEMETRY_BYTES: usize = 8 * 1024 * 1024;

/// Counters the admin `/metrics` page shows about telemetry itself.
#[derive(Debug, Default)]
pub struct TelemetryStats {
    pub polls: AtomicU64,
    pub poll_failures: AtomicU64,
    pub bad_lines: AtomicU64,
}

/// One engine's poll, projected onto its ranks.
struct Report {
    engine: usize,
    reachable: bool,
    dispatched_at_poll: Vec<u64>,
    ranks: Vec<RankTelemetry>,
    source: &'static str,
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
        let client: Client<HttpConnector, Empty<Bytes>> = crate::http::client(cfg.timeout);
        let mut tasks = JoinSet::new();
        for e in 0..table.fleet.engines.len() {
            tasks.spawn(poll_engine(
                e,
                table.clone(),
                cfg.clone(),
                client.clone(),
                tx.clone(),
                stats.clone(),
                shutdown.clone(),
            ));
        }
        drop(tx);
        publish(table, rx, default_kv_per_request).await;
        while tasks.join_next().await.is_some() {}
    })
}

async fn poll_engine(
    e: usize,
    table: Arc<Table>,
    cfg: TelemetryConfig,
    client: Client<HttpConnector, Empty<Bytes>>,
    tx: mpsc::Sender<Report>,
    stats: Arc<TelemetryStats>,
    mut shutdown: Shutdown,
) {
    let engine = table.fleet.engines[e].clone();
    let workers = table.fleet.workers_of(e);
    let uri: http::Uri = match format!("{}/metrics", engine.url).parse() {
        Ok(u) => u,
        Err(err) => {
            tracing::error!(engine = %engine.url, error = %err, "cannot build the metrics URL; engine not polled");
            return;
        }
    };
    let mut ticker = tokio::time::interval(cfg.interval);
    // A slow scrape delays the next one instead of firing a burst of catch-up polls at an engine
    // that is already struggling.
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown_signalled(&mut shutdown) => return,
        }
        let dispatched_at_poll: Vec<u64> = workers
            .clone()
            .map(|w| table.live[w].dispatched.load(Relaxed))
            .collect();
        stats.polls.fetch_add(1, Relaxed);
        let result = tokio::time::timeout(cfg.timeout, fetch(&client, uri.clone())).await;
        let (reachable, ranks) = match result {
            Ok(Ok(text)) => {
                let scrape = prom::parse(&text);
                stats.bad_lines.fetch_add(scrape.bad_lines as u64, Relaxed);
                (true, prom::project(&scrape, &engine, Instant::now()))
            }
            Ok(Err(FetchError { reachable, reason })) => {
                stats.poll_failures.fetch_add(1, Relaxed);
                let reason = format!("scrape of {uri} failed: {reason}");
                (
                    reachable,
                    vec![RankTelemetry::unavailable(reason); engine.dp_size as usize],
                )
            }
            Err(_) => {
                stats.poll_failures.fetch_add(1, Relaxed);
                let reason = format!(
                    "scrape of {uri} timed out after {} ms",
                    cfg.timeout.as_millis()
                );
                (
                    false,
                    vec![RankTelemetry::unavailable(reason); engine.dp_size as usize],
                )
            }
        };
        let report = Report {
            engine: e,
            reachable,
            dispatched_at_poll,
            ranks,
            source: "prometheus",
        };
        if tx.send(report).await.is_err() {
            return;
        }
    }
}

struct FetchError {
    reachable: bool,
    reason: String,
}

async fn fetch(
    client: &Client<HttpConnector, Empty<Bytes>>,
    uri: http::Uri,
) -> Result<String, FetchError> {
    let resp = client.get(uri).await.map_err(|e| FetchError {
        reachable: false,
        reason: error_chain(&e),
    })?;
    let status = resp.status();
    let body = Limited::new(resp.into_body(), MAX_TELEMETRY_BYTES)
        .collect()
        .await
        .map_err(|e| FetchError {
            reachable: true,
            reason: format!("reading body: {e}"),
        })?
        .to_bytes();
    if !status.is_success() {
        return Err(FetchError {
            reachable: true,
            reason: format!("HTTP {status}"),
        });
    }
    String::from_utf8(body.to_vec()).map_err(|_| FetchError {
        reachable: true,
        reason: "body is not UTF-8".into(),
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
        estimate_kv_per_request(&mut views, default_kv_per_request);
        table.snapshot.store(Arc::new(Snapshot {
            ranks: views.clone(),
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
