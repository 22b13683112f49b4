//! The collectors that read the fleet at scrape time: requests by worker (and those rankgate
//! answered itself), latency per model, and the per-rank and per-engine series of the CURRENT
//! snapshot. Only the snapshot's workers and engines are written, so one that left the fleet
//! leaves the page with it; names are rendered here, never on the request path.

use std::fmt;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeMetric, MetricEncoder,
};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use tokio::time::Instant;

use super::counts::{Attempt, PollResult, RequestCounts};
use super::shared::Core;
use crate::config::SourceKind;
use crate::reason::Reason;
use crate::table::{RankTelemetry, Table};

fn gauge<N: EncodeGaugeValue>(
    m: &mut MetricEncoder,
    labels: &impl EncodeLabelSet,
    v: N,
) -> fmt::Result {
    ConstGauge::new(v).encode(m.encode_family(labels)?)
}

/// The `worker` label alone.
fn id(w: &crate::worker::Seat) -> [(&'static str, &str); 1] {
    [("worker", &w.id_text)]
}

fn counter(m: &mut MetricEncoder, labels: &impl EncodeLabelSet, v: u64) -> fmt::Result {
    ConstCounter::new(v).encode(m.encode_family(labels)?)
}

/// Requests and latencies: `rankgate_requests_total` (per worker of the snapshot),
/// `rankgate_local_responses_total`, and the per-model histograms.
#[derive(Debug)]
pub(super) struct Requests {
    pub core: Arc<Core>,
    /// `None`: no fleet (unit tests): no per-worker series.
    pub table: Option<Arc<Table>>,
}

impl Requests {
    /// The series of one [`RequestCounts`], in label order, with `worker` last if given.
    fn series(
        &self,
        m: &mut MetricEncoder,
        counts: &RequestCounts,
        worker: Option<&str>,
    ) -> fmt::Result {
        let core = &self.core;
        let series = counts.snapshot();
        let mut rows: Vec<_> = series.iter().collect();
        rows.sort_unstable_by_key(|(k, _)| (k.labels.model.0, k.labels.route.0, k.status));
        for (key, c) in rows {
            let labels = [
                ("model", core.models.name(key.labels.model)),
                ("route", core.routes.name(key.labels.route)),
            ];
            let status = [("status", key.status)];
            match worker {
                Some(w) => counter(m, &(labels, (status, [("worker", w)])), c.get())?,
                None => counter(m, &(labels, status), c.get())?,
            }
        }
        Ok(())
    }
}

impl Collector for Requests {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        if let Some(table) = &self.table {
            let snap = table.snapshot.load();
            let mut m = enc.encode_descriptor(
                "rankgate_requests",
                "Requests answered on a worker (by its engine, or by rankgate for the worker's \
                 attempt, e.g. 502 or 504), by model, route, status code and worker.",
                None,
                MetricType::Counter,
            )?;
            for w in &snap.fleet.workers {
                self.series(&mut m, &w.counters.requests, Some(&w.id_text))?;
            }
        }
        let mut m = enc.encode_descriptor(
            "rankgate_local_responses",
            "Requests rankgate answered itself without an engine (refusals such as 400, 401, \
             404, 413, 429, 503 for no routable rank, and its own /v1/models), by model, route \
             and status code.",
            None,
            MetricType::Counter,
        )?;
        self.series(&mut m, &self.core.local, None)?;

        let models = &self.core.models;
        let mut m = enc.encode_descriptor(
            "rankgate_request_duration_seconds",
            "Time from a request's arrival to the end of its response body (streams included), \
             by model.",
            None,
            MetricType::Histogram,
        )?;
        for s in models.all() {
            s.duration
                .encode(m.encode_family(&[("model", &*s.name)])?)?;
        }
        let mut m = enc.encode_descriptor(
            "rankgate_time_to_first_byte_seconds",
            "Time from a request's arrival to the first chunk of the engine's response body \
             (time to first token for streams), by model; one observation per request whose \
             answer produced a first chunk.",
            None,
            MetricType::Histogram,
        )?;
        for s in models.all() {
            s.first_byte
                .encode(m.encode_family(&[("model", &*s.name)])?)?;
        }
        Ok(())
    }
}

/// The per-rank and per-engine series of the current snapshot.
#[derive(Debug)]
pub(super) struct Fleet {
    pub table: Arc<Table>,
}

impl Collector for Fleet {
    fn encode(&self, mut enc: DescriptorEncoder) -> fmt::Result {
        let table = &self.table;
        let snap = table.snapshot.load();
        let now = Instant::now();
        let workers = &snap.fleet.workers;
        let ranks = workers.iter().zip(&snap.ranks);
        let stale = table.stale_after;

        let mut m = enc.encode_descriptor(
            "rankgate_worker_info",
            "One series per virtual worker (one DP rank of an engine) with its engine and \
             flavor; always 1. Join on `worker` to group other series by engine.",
            None,
            MetricType::Gauge,
        )?;
        for w in workers {
            let e = &snap.fleet.engines[w.engine];
            let labels = [
                ("worker", &*w.id_text),
                ("engine", &*e.url),
                ("flavor", e.flavor.as_str()),
            ];
            gauge(&mut m, &labels, 1i64)?;
        }

        // An ejected rank takes no traffic whatever its telemetry says, so that is its state
        // (as `/workers` has it).
        let states: Vec<Option<Reason>> = ranks
            .clone()
            .map(|(w, v)| {
                (w.live.outlier.ejection().map(Reason::Ejected))
                    .or_else(|| v.telemetry.unavailable_reason(now, table.stale_after))
            })
            .collect();
        let available = states.iter().filter(|s| s.is_none()).count();
        // An engine whose flavor or DP size is not known yet has no ranks, but it is part of
        // the fleet and takes no traffic: counted as one unavailable entry here, in the state
        // series below and in `/workers` (one row each), so all three agree on the size.
        let pending: Vec<&str> = (snap.fleet.engines.iter())
            .filter(|e| !e.shaped())
            .map(|e| &*e.url)
            .collect();
        let mut m = enc.encode_descriptor(
            "rankgate_fleet_ranks",
            "Ranks in the fleet by state: available (fresh telemetry, or a fresh rank that has \
             no load gauges yet; not ejected) or unavailable (an engine whose shape is not known \
             yet counts as one). Both series are always present; available = 0 means every \
             request fails with 503 or goes to a rank chosen without telemetry.",
            None,
            MetricType::Gauge,
        )?;
        gauge(&mut m, &[("state", "available")], available as i64)?;
        gauge(
            &mut m,
            &[("state", "unavailable")],
            (states.len() - available + pending.len()) as i64,
        )?;
        let m = enc.encode_descriptor(
            "rankgate_fleet_engines_pending_shape",
            "Engines whose flavor or DP size is not known yet (they have not said it): no \
             ranks, no traffic until they do.",
            None,
            MetricType::Gauge,
        )?;
        ConstGauge::new(pending.len() as i64).encode(m)?;

        let mut m = enc.encode_descriptor(
            "rankgate_rank_telemetry_state",
            "The rank's state, with the kind of reason when it is unavailable (not_polled, \
             absent, invalid, stale, sources_failed, health, ejected, silent, ...; shape_unknown, \
             with the engine's URL as `worker`, for an engine whose ranks are not known yet), or \
             fresh (named by its engine, no load gauges yet) with reason idle or unproven; always \
             1, one series per rank.",
            None,
            MetricType::Gauge,
        )?;
        for ((w, state), v) in workers.iter().zip(&states).zip(&snap.ranks) {
            let fresh = match &v.telemetry {
                RankTelemetry::Available(l) => l.fresh,
                RankTelemetry::Unavailable { .. } => None,
            };
            let (state, reason) = match (state, fresh) {
                (Some(r), _) => ("unavailable", r.kind()),
                (None, Some(f)) => ("fresh", f.as_str()),
                (None, None) => ("available", "none"),
            };
            let labels = [
                ("worker", &*w.id_text),
                ("state", state),
                ("reason", reason),
            ];
            gauge(&mut m, &labels, 1i64)?;
        }
        // The engine's URL stands for its ranks until they are known (as in `/workers`).
        for url in &pending {
            let labels = [
                ("worker", *url),
                ("state", "unavailable"),
                ("reason", "shape_unknown"),
            ];
            gauge(&mut m, &labels, 1i64)?;
        }

        let mut m = enc.encode_descriptor(
            "rankgate_rank_telemetry_available",
            "1 when the rank has fresh, valid telemetry, else 0.",
            None,
            MetricType::Gauge,
        )?;
        for (w, v) in ranks.clone() {
            gauge(
                &mut m,
                &id(w),
                v.telemetry.fresh(now, stale).is_some() as i64,
            )?;
        }

        let mut m = enc.encode_descriptor(
            "rankgate_rank_telemetry_age_seconds",
            "Age of the rank's last telemetry sample (absent until it has one, and while its \
             last poll failed).",
            None,
            MetricType::Gauge,
        )?;
        for (w, v) in ranks.clone() {
            if let RankTelemetry::Available(l) = &v.telemetry {
                let age = now.saturating_duration_since(l.sampled_at).as_secs_f64();
                gauge(&mut m, &id(w), age)?;
            }
        }

        let mut m = enc.encode_descriptor(
            "rankgate_rank_kv_usage_ratio",
            "The rank's KV cache usage (0 to 1) as its engine last reported it; absent while its \
             telemetry is unavailable.",
            None,
            MetricType::Gauge,
        )?;
        for (w, v) in ranks.clone() {
            if let Some(l) = (v.telemetry.fresh(now, stale)).filter(|l| l.fresh.is_none()) {
                gauge(&mut m, &id(w), l.kv_usage)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "rankgate_rank_running_requests",
            "Requests the rank's engine reported running on it; absent while unavailable or \
             not reported.",
            None,
            MetricType::Gauge,
        )?;
        for (w, v) in ranks.clone() {
            if let Some(n) = v.telemetry.fresh(now, stale).and_then(|l| l.running) {
                gauge(&mut m, &id(w), n as i64)?;
            }
        }
        let mut m = enc.encode_descriptor(
            "rankgate_rank_waiting_requests",
            "Requests the rank's engine reported queued on it; absent while unavailable or not \
             reported.",
            None,
            MetricType::Gauge,
        )?;
        for (w, v) in ranks.clone() {
            if let Some(n) = v.telemetry.fresh(now, stale).and_then(|l| l.waiting) {
                gauge(&mut m, &id(w), n as i64)?;
            }
        }
        for (name, help, hits) in [
            (
                "rankgate_rank_engine_prefix_cache_queries",
                "Prompt tokens the rank's engine looked up in its prefix cache (its own counter, \
                 as last polled; vLLM's prefix_cache_queries_total).",
                false,
            ),
            (
                "rankgate_rank_engine_prefix_cache_hits",
                "Prompt tokens the rank's engine found in its prefix cache (its own counter, as \
                 last polled; vLLM's prefix_cache_hits_total): what prefix affinity's \
                 predictions are checked against.",
                true,
            ),
        ] {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for (w, v) in ranks.clone() {
                if let Some(c) = v.telemetry.fresh(now, stale).and_then(|l| l.prefix_cache) {
                    counter(&mut m, &id(w), if hits { c.hits } else { c.queries })?;
                }
            }
        }
        let mut m = enc.encode_descriptor(
            "rankgate_rank_prefix_predicted_hit_tokens",
            "Prompt tokens prefix affinity expected the rank to hold for the requests sent to \
             it, by whose account: events (its engine's KV events) or record (rankgate's record \
             of what it sent). Compare with rankgate_rank_engine_prefix_cache_hits_total.",
            None,
            MetricType::Counter,
        )?;
        for w in workers {
            for (by, n) in ["record", "events"]
                .iter()
                .zip(&w.counters.predicted_hit_tokens)
            {
                let n = n.load(std::sync::atomic::Ordering::Relaxed);
                counter(&mut m, &[("worker", &*w.id_text), ("by", by)], n)?;
            }
        }
        // Only a fleet with prefill or decode servers has legs: the usual fleet's page does
        // not grow by a series per rank that can only say 0.
        let split = workers.iter().any(|w| w.role.disaggregated());
        if split {
            let mut m = enc.encode_descriptor(
                "rankgate_pd_legs",
                "Legs of disaggregated requests sent to the rank, by leg (prefill, decode): \
                 each side's ranks are chosen by their own load.",
                None,
                MetricType::Counter,
            )?;
            for w in workers.iter().filter(|w| w.role.disaggregated()) {
                for (leg, n) in ["prefill", "decode"].iter().zip(&w.counters.pd_legs) {
                    let n = n.load(std::sync::atomic::Ordering::Relaxed);
                    counter(&mut m, &[("worker", &*w.id_text), ("leg", leg)], n)?;
                }
            }
        }
        let mut m = enc.encode_descriptor(
            "rankgate_rank_in_flight_requests",
            "Requests in flight on the rank through this router (until their response body \
             ends).",
            None,
            MetricType::Gauge,
        )?;
        for w in workers {
            gauge(&mut m, &id(w), w.live.in_flight() as i64)?;
        }

        let mut m = enc.encode_descriptor(
            "rankgate_rank_ejected",
            "1 while the rank is ejected after consecutive failures, else 0.",
            None,
            MetricType::Gauge,
        )?;
        for w in workers {
            gauge(&mut m, &id(w), w.live.outlier.ejection().is_some() as i64)?;
        }
        let mut m = enc.encode_descriptor(
            "rankgate_ejections",
            "Times the rank was ejected after consecutive failures (routing.eject_after).",
            None,
            MetricType::Counter,
        )?;
        for w in workers {
            let n = w
                .counters
                .ejections
                .load(std::sync::atomic::Ordering::Relaxed);
            counter(&mut m, &id(w), n)?;
        }
        let mut m = enc.encode_descriptor(
            "rankgate_upstream_attempts",
            "Attempts to send a request to the rank, retries included, by how they ended: \
             answered (status below 500), server_error (5xx), transport_error, timeout \
             (server.response_timeout), busy (no engine connection free), other.",
            None,
            MetricType::Counter,
        )?;
        for w in workers {
            for a in Attempt::ALL {
                let n = w.counters.attempts[a as usize].load(std::sync::atomic::Ordering::Relaxed);
                counter(
                    &mut m,
                    &[("worker", &*w.id_text), ("result", a.as_str())],
                    n,
                )?;
            }
        }
        let mut m = enc.encode_descriptor(
            "rankgate_telemetry_invalid_entries",
            "Polls in which the rank's load entry was present but invalid or duplicated.",
            None,
            MetricType::Counter,
        )?;
        for w in workers {
            let n = w.invalid_entries.load(std::sync::atomic::Ordering::Relaxed);
            counter(&mut m, &id(w), n)?;
        }

        self.engines(&mut enc, &snap)
    }
}

impl Fleet {
    fn engines(&self, enc: &mut DescriptorEncoder, snap: &crate::table::Snapshot) -> fmt::Result {
        use std::sync::atomic::Ordering::Relaxed;
        let engines = &snap.fleet.engines;
        let mut m = enc.encode_descriptor(
            "rankgate_telemetry_polls",
            "Reads of each telemetry source of each engine, by result: ok, error (an error \
             answer, unreachable, unreadable), timeout (telemetry.timeout), skipped (failed \
             recently, probed in the background).",
            None,
            MetricType::Counter,
        )?;
        for e in engines {
            // By kind of source: an engine may list two of one kind (two loads URLs), which
            // count together.
            for kind in SourceKind::ALL {
                if !e.telemetry.iter().any(|t| t.kind() == kind) {
                    continue;
                }
                for r in PollResult::ALL {
                    let labels = [
                        ("engine", &*e.url),
                        ("source", kind.as_str()),
                        ("result", r.as_str()),
                    ];
                    counter(&mut m, &labels, e.polls.reads(kind, r))?;
                }
            }
        }
        let per_engine = [
            (
                "rankgate_telemetry_poll_failures",
                "Polls of the engine in which no telemetry source answered (its ranks were \
                 unavailable until the next).",
                &(|e: &crate::worker::EngineEntry| e.polls.failed.load(Relaxed))
                    as &dyn Fn(&crate::worker::EngineEntry) -> u64,
            ),
            (
                "rankgate_telemetry_bad_lines",
                "Lines of the engine's Prometheus /metrics that could not be parsed.",
                &|e: &crate::worker::EngineEntry| e.polls.bad_lines.load(Relaxed),
            ),
            (
                "rankgate_telemetry_unmanaged_entries",
                "Load entries from the engine naming a rank outside its managed set (start_rank, \
                 dp_size).",
                &|e: &crate::worker::EngineEntry| e.polls.unmanaged_entries.load(Relaxed),
            ),
        ];
        for (name, help, read) in per_engine {
            let mut m = enc.encode_descriptor(name, help, None, MetricType::Counter)?;
            for e in engines {
                counter(&mut m, &[("engine", &*e.url)], read(e))?;
            }
        }
        Ok(())
    }
}
