//! rankgate's own Prometheus metrics: request counters and a latency histogram kept in atomics
//! (the request path only ever does relaxed adds), rendered as text on the admin listener
//! together with per-rank gauges read from the current snapshot.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use tokio::time::Instant;

use crate::table::Table;
use crate::telemetry::TelemetryStats;
use crate::worker::Member;

/// Upper bounds (seconds) of the proxy latency histogram; end-to-end, so streams included.
const BUCKETS: [f64; 14] = [
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// Statuses rankgate answers itself, without reaching an engine.
pub const OWN_STATUSES: [u16; 12] = [400, 401, 403, 404, 405, 408, 413, 429, 500, 502, 503, 504];

/// One worker's counters; they live in its [`crate::worker::Member`], so they leave `/metrics`
/// with it.
#[derive(Debug, Default)]
pub struct WorkerCounters {
    /// Responses by status class 1xx..5xx.
    by_class: [AtomicU64; 5],
    ejections: AtomicU64,
}

#[derive(Debug, Default)]
pub struct Metrics {
    own: [AtomicU64; OWN_STATUSES.len()],
    skipped_unavailable: AtomicU64,
    retries: AtomicU64,
    retries_refused: AtomicU64,
    /// Streams cut after their first byte: the engine's stream broke, or went quiet.
    streams_cut: [AtomicU64; 2],
    buckets: [AtomicU64; BUCKETS.len()],
    latency_count: AtomicU64,
    latency_sum_us: AtomicU64,
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics::default()
    }

    /// A response (from the engine, or a 502 rankgate wrote for it) on a worker.
    pub fn response(&self, worker: &Member, status: u16) {
        let class = (status / 100).clamp(1, 5) as usize - 1;
        worker.counters.by_class[class].fetch_add(1, Relaxed);
    }

    /// A response rankgate answered itself before picking a worker.
    pub fn own_response(&self, status: u16) {
        if let Some(i) = OWN_STATUSES.iter().position(|s| *s == status) {
            self.own[i].fetch_add(1, Relaxed);
        }
    }

    pub fn skipped_unavailable(&self) {
        self.skipped_unavailable.fetch_add(1, Relaxed);
    }

    /// A request was sent again, to another rank.
    pub fn retried(&self) {
        self.retries.fetch_add(1, Relaxed);
    }

    /// A retry was called for but the retry budget had none left.
    pub fn retry_refused(&self) {
        self.retries_refused.fetch_add(1, Relaxed);
    }

    pub fn retries_total(&self) -> u64 {
        self.retries.load(Relaxed)
    }

    /// A response was cut after its first byte (`idle`: by the stream idle timeout).
    pub fn stream_cut(&self, idle: bool) {
        self.streams_cut[idle as usize].fetch_add(1, Relaxed);
    }

    /// A rank was ejected after consecutive failures.
    pub fn ejected(&self, worker: &Member) {
        worker.counters.ejections.fetch_add(1, Relaxed);
    }

    pub fn skipped_unavailable_total(&self) -> u64 {
        self.skipped_unavailable.load(Relaxed)
    }

    pub fn observe_latency(&self, d: Duration) {
        let secs = d.as_secs_f64();
        if let Some(i) = BUCKETS.iter().position(|b| secs <= *b) {
            self.buckets[i].fetch_add(1, Relaxed);
        }
        self.latency_count.fetch_add(1, Relaxed);
        self.latency_sum_us.fetch_add(d.as_micros() as u64, Relaxed);
    }

    /// Renders everything in the Prometheus text format.
    pub fn render(&self, table: &Table, telemetry: &TelemetryStats) -> String {
        let mut o = String::with_capacity(4096);
        let snap = table.snapshot.load();
        let workers = &snap.fleet.workers;
        o.push_str("# HELP rankgate_requests_total Proxied requests by worker and response status class.\n# TYPE rankgate_requests_total counter\n");
        for w in workers {
            for (i, n) in w.counters.by_class.iter().enumerate() {
                let _ = writeln!(
                    o,
                    "rankgate_requests_total{{worker=\"{}\",status=\"{}xx\"}} {}",
                    w.id_text,
                    i + 1,
                    n.load(Relaxed)
                );
            }
        }
        o.push_str("# HELP rankgate_rejected_total Requests rankgate answered itself, by status.\n# TYPE rankgate_rejected_total counter\n");
        for (s, n) in OWN_STATUSES.iter().zip(&self.own) {
            let _ = writeln!(
                o,
                "rankgate_rejected_total{{status=\"{s}\"}} {}",
                n.load(Relaxed)
            );
        }
        o.push_str("# HELP rankgate_skipped_unavailable_total Requests routed while passing over ranks whose telemetry was missing, stale or invalid.\n# TYPE rankgate_skipped_unavailable_total counter\n");
        let _ = writeln!(
            o,
            "rankgate_skipped_unavailable_total {}",
            self.skipped_unavailable_total()
        );

        o.push_str("# HELP rankgate_retries_total Requests sent again to another rank after a failure before the first byte.\n# TYPE rankgate_retries_total counter\n");
        let _ = writeln!(o, "rankgate_retries_total {}", self.retries.load(Relaxed));
        o.push_str("# HELP rankgate_retries_refused_total Retries not made because the retry budget was spent.\n# TYPE rankgate_retries_refused_total counter\n");
        let _ = writeln!(
            o,
            "rankgate_retries_refused_total {}",
            self.retries_refused.load(Relaxed)
        );
        o.push_str("# HELP rankgate_streams_cut_total Responses cut after their first byte (SSE streams end with an error event).\n# TYPE rankgate_streams_cut_total counter\n");
        for (reason, n) in ["broken", "idle"].iter().zip(&self.streams_cut) {
            let _ = writeln!(
                o,
                "rankgate_streams_cut_total{{reason=\"{reason}\"}} {}",
                n.load(Relaxed)
            );
        }
        o.push_str("# HELP rankgate_ejections_total Times the rank was ejected after consecutive failures.\n# TYPE rankgate_ejections_total counter\n");
        for w in workers {
            let _ = writeln!(
                o,
                "rankgate_ejections_total{{worker=\"{}\"}} {}",
                w.id_text,
                w.counters.ejections.load(Relaxed)
            );
        }
        o.push_str("# HELP rankgate_rank_ejected 1 while the rank is ejected.\n# TYPE rankgate_rank_ejected gauge\n");
        for w in workers {
            let _ = writeln!(
                o,
                "rankgate_rank_ejected{{worker=\"{}\"}} {}",
                w.id_text,
                w.live.outlier.ejection().is_some() as u8
            );
        }

        o.push_str("# HELP rankgate_proxy_duration_seconds Time from request arrival to the end of the response body.\n# TYPE rankgate_proxy_duration_seconds histogram\n");
        let mut cumulative = 0;
        for (b, n) in BUCKETS.iter().zip(&self.buckets) {
            cumulative += n.load(Relaxed);
            let _ = writeln!(
                o,
                "rankgate_proxy_duration_seconds_bucket{{le=\"{b}\"}} {cumulative}"
            );
        }
        let count = self.latency_count.load(Relaxed);
        let _ = writeln!(
            o,
            "rankgate_proxy_duration_seconds_bucket{{le=\"+Inf\"}} {count}"
        );
        let _ = writeln!(
            o,
            "rankgate_proxy_duration_seconds_sum {}",
            self.latency_sum_us.load(Relaxed) as f64 / 1e6
        );
        let _ = writeln!(o, "rankgate_proxy_duration_seconds_count {count}");

        let now = Instant::now();
        o.push_str("# HELP rankgate_rank_kv_usage Last reported KV cache usage of the rank (absent while unavailable).\n# TYPE rankgate_rank_kv_usage gauge\n");
        for (w, view) in workers.iter().zip(&snap.ranks) {
            if let Some(l) = view.telemetry.fresh(now, table.stale_after) {
                let _ = writeln!(
                    o,
                    "rankgate_rank_kv_usage{{worker=\"{}\"}} {}",
                    w.id_text, l.kv_usage
                );
            }
        }
        o.push_str("# HELP rankgate_rank_telemetry_available 1 when the rank has fresh, valid telemetry.\n# TYPE rankgate_rank_telemetry_available gauge\n");
        for (w, view) in workers.iter().zip(&snap.ranks) {
            let up = view.telemetry.fresh(now, table.stale_after).is_some() as u8;
            let _ = writeln!(
                o,
                "rankgate_rank_telemetry_available{{worker=\"{}\"}} {up}",
                w.id_text
            );
        }
        o.push_str("# HELP rankgate_rank_in_flight Requests in flight on the rank through this router.\n# TYPE rankgate_rank_in_flight gauge\n");
        for w in workers {
            let _ = writeln!(
                o,
                "rankgate_rank_in_flight{{worker=\"{}\"}} {}",
                w.id_text,
                w.live.in_flight()
            );
        }
        o.push_str("# HELP rankgate_telemetry_unavailable_ranks Ranks whose telemetry is unavailable right now.\n# TYPE rankgate_telemetry_unavailable_ranks gauge\n");
        let unavailable = snap
            .ranks
            .iter()
            .filter(|v| v.telemetry.fresh(now, table.stale_after).is_none())
            .count();
        let _ = writeln!(o, "rankgate_telemetry_unavailable_ranks {unavailable}");
        o.push_str("# HELP rankgate_telemetry_invalid_entries_total Polls in which the rank's load entry was invalid or duplicated.\n# TYPE rankgate_telemetry_invalid_entries_total counter\n");
        for w in workers {
            let _ = writeln!(
                o,
                "rankgate_telemetry_invalid_entries_total{{worker=\"{}\"}} {}",
                w.id_text,
                w.invalid_entries.load(Relaxed)
            );
        }
        o.push_str("# TYPE rankgate_telemetry_unmanaged_entries_total counter\n");
        let _ = writeln!(
            o,
            "rankgate_telemetry_unmanaged_entries_total {}",
            telemetry.unmanaged_entries.load(Relaxed)
        );
        o.push_str("# TYPE rankgate_telemetry_polls_total counter\n");
        let _ = writeln!(
            o,
            "rankgate_telemetry_polls_total {}",
            telemetry.polls.load(Relaxed)
        );
        o.push_str("# TYPE rankgate_telemetry_poll_failures_total counter\n");
        let _ = writeln!(
            o,
            "rankgate_telemetry_poll_failures_total {}",
            telemetry.poll_failures.load(Relaxed)
        );
        o.push_str("# TYPE rankgate_telemetry_bad_lines_total counter\n");
        let _ = writeln!(
            o,
            "rankgate_telemetry_bad_lines_total {}",
            telemetry.bad_lines.load(Relaxed)
        );
        o
    }
}
