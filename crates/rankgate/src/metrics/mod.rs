//! rankgate's own Prometheus metrics, through `prometheus-client`: one [`Registry`] built at
//! startup, rendered in the Prometheus text format (0.0.4) on the admin listener's `/metrics`.
//! Every metric is listed, with its labels and example alerts, in `docs/metrics.md`.
//!
//! Three kinds of series, by where their numbers live:
//! - Fixed label sets (retries, cut streams, build info): counters registered once, whose
//!   handles the request path bumps directly.
//! - Per worker and per engine ([`counts`]): atomics in the worker's `Member` and the engine's
//!   `EngineEntry`, and the per-rank gauges of the snapshot, all read at scrape time by a
//!   collector ([`fleet`]) from the CURRENT snapshot: a worker that left the fleet leaves
//!   `/metrics` with it.
//! - Per model: the latency histograms ([`histogram`], kept in atomics), and requests rankgate
//!   answered itself, labelled by small indices ([`labels`]) whose names are looked up only when
//!   scraped. A request naming a model route counts under its target (what served it); the
//!   route's own counter per target is read from the snapshot's routes ([`model_routes`]).
//!
//! The request path takes no lock to record a request, and allocates nothing once its label
//! combination has been seen: a route and a model are `u16`s, a counter bump is an atomic add
//! on a map read through an `ArcSwap` (copied only when a new combination appears). The one
//! exception is a fleet that routes by model: its requests carry a small slot through which
//! `select` hands back the model it read (see [`ModelSlot`]).
//!
//! The page is the Prometheus text format rather than OpenMetrics: `promtool check metrics`
//! lints the former, and reads an OpenMetrics counter family (named without `_total`) as a
//! metric without help.

mod certs;
pub(crate) mod counts;
mod doors;
mod fleet;
mod gray;
pub(crate) mod histogram;
mod kv;
mod labels;
mod model_routes;
mod pd;
mod process;
mod routes;
mod shared;

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::encoding::prometheus_text;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;

use crate::table::{Snapshot, Table};
use crate::worker::Member;

pub use counts::{Attempt, PollCounters, PollResult, RequestCounts, RequestKey, WorkerCounters};
pub use histogram::BUCKETS;
pub use labels::{ModelIdx, ModelSlot, RequestLabels, UNKNOWN};
pub use pd::{likely_cause, PdCounts, PdFailure, PdLeg, PdStage, RankPdHealth, PD_FAILING_AFTER};
pub use routes::{RouteIdx, UNMATCHED};

use shared::Core;

/// The `Content-Type` of `/metrics`.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// The registry and the handles the proxy records through.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    core: Arc<Core>,
    skipped_unavailable: Counter,
    retries: Counter,
    retries_refused: Counter,
    /// Streams cut after their first byte: `[broken, idle]`.
    streams_cut: [Counter; 3],
    /// Prompts tokenized by an engine's `POST /tokenize` (`models[].engine_tokenize`):
    /// `[ok, failed]`, and the seconds they took.
    engine_tokenize: [Counter; 2],
    engine_tokenize_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    /// `[[adapters]]` loads and unloads ([`crate::adapter_loads`]): `[loaded, failed, unloaded]`.
    adapter_loads: [Counter; 3],
    /// Disaggregated requests: outcomes, failures by leg, the legs' times.
    pub pd: Arc<PdCounts>,
    /// How long a request may wait for its first byte before it counts as hung
    /// ([`crate::first_byte`]); kept current by `proxy::watch_first_bytes`.
    pub first_byte_bound: Arc<crate::first_byte::Bound>,
    /// The series of what is built after the registry (flow control's queue).
    late: Late,
}

/// What became of a LoRA adapter load or unload (`rankgate_adapter_loads_total{result}`), in
/// the order of its counters.
#[derive(Debug, Clone, Copy)]
pub enum AdapterLoad {
    Loaded,
    Failed,
    Unloaded,
}

/// A counter family of one label whose `values` are fixed, registered with every series present
/// from the start; its counters, in the order of `values`.
fn by_label<const N: usize>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    (label, values): (&'static str, [&'static str; N]),
) -> [Counter; N] {
    let family = prometheus_client::metrics::family::Family::<
        [(&'static str, &'static str); 1],
        Counter,
    >::default();
    registry.register(name, help, family.clone());
    values.map(|v| family.get_or_create_owned(&[(label, v)]))
}

/// A collector registered empty and filled once, later.
#[derive(Debug, Default, Clone)]
struct Late(Arc<std::sync::OnceLock<Box<dyn prometheus_client::collector::Collector>>>);

impl prometheus_client::collector::Collector for Late {
    fn encode(&self, enc: prometheus_client::encoding::DescriptorEncoder) -> std::fmt::Result {
        match self.0.get() {
            Some(c) => c.encode(enc),
            None => Ok(()),
        }
    }
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics::new()
    }
}

impl Metrics {
    /// Metrics of no fleet: the request-path counters only (unit tests of the proxy).
    pub fn new() -> Metrics {
        Metrics::build(&[], None, Vec::new())
    }

    /// The router's metrics: the request-path counters, the fleet of `table` as the current
    /// snapshot has it at each scrape, `extra_routes` (`server.extra_routes`) as labels, and
    /// the listeners' `doors` (connection limits and counts), each with its `listener` label,
    /// and when the TLS listeners' certificates expire.
    pub fn for_router(
        table: Arc<Table>,
        extra_routes: &[String],
        doors: Vec<(&'static str, Arc<crate::http::Door>)>,
        certificates: Vec<Arc<crate::tls::ServerTls>>,
    ) -> Metrics {
        let mut m = Metrics::build(extra_routes, Some(table), doors);
        if !certificates.is_empty() {
            (m.registry).register_collector(Box::new(certs::Certificates {
                listeners: certificates,
            }));
        }
        m
    }

    fn build(
        extra_routes: &[String],
        table: Option<Arc<Table>>,
        doors: Vec<(&'static str, Arc<crate::http::Door>)>,
    ) -> Metrics {
        let mut registry = Registry::default();
        let core = Arc::new(Core {
            routes: routes::Routes::new(extra_routes),
            models: labels::Models::default(),
            local: RequestCounts::default(),
        });
        // `sim` and `top` are the binary's features (their crates are not this one), passed down
        // to this crate as markers so the label names the whole build.
        let features: Vec<&str> = [
            (cfg!(feature = "sim"), "sim"),
            (cfg!(feature = "kubernetes"), "kubernetes"),
            (cfg!(feature = "top"), "top"),
            (cfg!(feature = "otlp"), "otlp"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        registry.register(
            "rankgate_build",
            "rankgate's version and build; always 1",
            Info::new(vec![
                ("version", env!("CARGO_PKG_VERSION").to_string()),
                ("features", features.join(",")),
                (
                    "profile",
                    if cfg!(debug_assertions) {
                        "debug"
                    } else {
                        "release"
                    }
                    .to_string(),
                ),
            ]),
        );
        let counter = |registry: &mut Registry, name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let retries = counter(
            &mut registry,
            "rankgate_retries",
            "Requests sent again to another rank after a failure before the first byte",
        );
        let retries_refused = counter(
            &mut registry,
            "rankgate_retries_refused",
            "Retries not made because the retry budget (routing.retry_budget) was spent",
        );
        let skipped_unavailable = counter(
            &mut registry,
            "rankgate_skipped_unavailable",
            "Requests routed while passing over ranks whose telemetry was missing, stale or invalid",
        );
        let streams_cut = by_label(
            &mut registry,
            "rankgate_streams_cut",
            "Responses cut after their first byte, by reason: the engine's stream broke, or went \
             quiet for server.stream_idle_timeout (SSE streams end with an error event), or the \
             client took nothing of it for server.send_timeout (send_timeout: its connection cut, \
             its engine request with it)",
            ("reason", ["broken", "idle", "send_timeout"]),
        );
        let engine_tokenize = by_label(
            &mut registry,
            "rankgate_engine_tokenize",
            "Prompts an engine tokenized for exact prefix routing (models[].engine_tokenize), by \
             result: ok, or failed (the request then routes by rankgate's record)",
            ("result", ["ok", "failed"]),
        );
        let engine_tokenize_seconds = Counter::<f64, std::sync::atomic::AtomicU64>::default();
        registry.register(
            "rankgate_engine_tokenize_seconds",
            "Time requests waited for an engine's POST /tokenize, before their pick",
            engine_tokenize_seconds.clone(),
        );
        let adapter_loads = by_label(
            &mut registry,
            "rankgate_adapter_loads",
            "LoRA adapters rankgate loaded on a server ([[adapters]], and by hand on the admin API), \
             by result: loaded, failed (the engine refused or did not answer), or unloaded",
            ("result", ["loaded", "failed", "unloaded"]),
        );
        registry.register_collector(Box::new(fleet::Requests {
            core: core.clone(),
            table: table.clone(),
        }));
        let first_byte_bound = Arc::new(crate::first_byte::Bound::default());
        if let Some(table) = table {
            registry.register_collector(Box::new(gray::Gray {
                table: table.clone(),
                bound: first_byte_bound.clone(),
            }));
            registry.register_collector(Box::new(kv::KvPublishers {
                table: table.clone(),
            }));
            registry.register_collector(Box::new(model_routes::ModelRoutes {
                table: table.clone(),
            }));
            registry.register_collector(Box::new(fleet::Fleet { table }));
        }
        registry.register_collector(Box::new(process::Process));
        let pd = Arc::new(PdCounts::default());
        registry.register_collector(Box::new(pd::Pd(pd.clone())));
        if !doors.is_empty() {
            registry.register_collector(Box::new(doors::Doors(doors)));
        }
        let late = Late::default();
        registry.register_collector(Box::new(late.clone()));
        Metrics {
            registry,
            core,
            skipped_unavailable,
            retries,
            retries_refused,
            streams_cut,
            engine_tokenize,
            adapter_loads,
            engine_tokenize_seconds,
            pd,
            first_byte_bound,
            late,
        }
    }

    /// Adds the series of a part built after the registry (once; a second is ignored).
    pub fn add_late(&self, c: Box<dyn prometheus_client::collector::Collector>) {
        let _ = self.late.0.set(c);
    }

    /// Every model's first-byte histogram added up, bucket by bucket (cumulative counts).
    pub fn first_byte_counts(&self) -> [u64; crate::first_byte::SLOTS] {
        let mut all = [0; crate::first_byte::SLOTS];
        for s in self.core.models.all() {
            for (a, n) in all.iter_mut().zip(s.first_byte.counts()) {
                *a += n;
            }
        }
        all
    }

    /// A client left a request on `worker` before its answer ended (`mid_stream`: after its
    /// first byte).
    pub fn abandoned(&self, worker: &Member, mid_stream: bool) {
        worker.counters.abandoned[mid_stream as usize]
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// A request on `worker` waited for its first byte past the fleet's bound.
    pub fn hung(&self, worker: &Member) {
        worker
            .counters
            .hung
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// A prompt an engine's `/tokenize` answered (`ok`) or not, after `took`.
    pub fn engine_tokenize(&self, ok: bool, took: std::time::Duration) {
        self.engine_tokenize[usize::from(!ok)].inc();
        self.engine_tokenize_seconds.inc_by(took.as_secs_f64());
    }

    /// A load or unload of a LoRA adapter, done or failed.
    pub fn adapter_load(&self, result: AdapterLoad) {
        self.adapter_loads[result as usize].inc();
    }

    /// The labels of a request for `path` (on the gRPC front door if `grpc`) in the fleet of
    /// `snap`, and, when its model is to be read from its body (a fleet that routes by model),
    /// the slot `select` writes that model to.
    pub fn labels(
        &self,
        grpc: bool,
        path: &str,
        snap: &Snapshot,
    ) -> (RequestLabels, Option<ModelSlot>) {
        let catalog = (self.core.models).labels(&snap.catalog, snap.fleet.engines.len());
        let labels = RequestLabels {
            model: catalog.only,
            route: self.core.routes.of(grpc, path),
        };
        let read = catalog.by_model || catalog.pending;
        (labels, (read && !grpc).then(ModelSlot::default))
    }

    /// The label of a request naming `model` in the fleet of `snap`.
    /// The name a model label stands for (`unknown` for the unknown one).
    pub fn model_name(&self, m: ModelIdx) -> &str {
        self.core.models.name(m)
    }

    pub fn model(&self, model: &str, snap: &Snapshot) -> ModelIdx {
        let models = &self.core.models;
        let labels = models.labels(&snap.catalog, snap.fleet.engines.len());
        match labels.pending {
            // Before the engines' lists are read: the request's own name, within bounds.
            true => models.provisional(&labels, model),
            false => labels.of(model),
        }
    }

    /// A request answered on `worker` (by its engine, or by rankgate for its attempt).
    #[inline]
    pub fn response(&self, worker: &Member, labels: RequestLabels, status: u16) {
        worker.counters.requests.inc(RequestKey { labels, status });
    }

    /// A request rankgate answered itself, without a worker.
    #[inline]
    pub fn local_response(&self, labels: RequestLabels, status: u16) {
        self.core.local.inc(RequestKey { labels, status });
    }

    /// Labels for what is known of nothing but the status (a CORS refusal, answered before the
    /// request was looked at).
    pub fn unlabelled(&self) -> RequestLabels {
        RequestLabels {
            model: ModelIdx::UNKNOWN,
            route: self.core.routes.unmatched(),
        }
    }

    /// The first byte of an engine's answer reached the client's body, `since` after the
    /// request arrived.
    #[inline]
    pub fn first_byte(&self, model: ModelIdx, since: Duration) {
        self.core
            .models
            .with(model, |s| s.first_byte.observe(since));
    }

    /// A request's response body ended (or was dropped), `since` after it arrived.
    #[inline]
    pub fn finished(&self, model: ModelIdx, since: Duration) {
        self.core.models.with(model, |s| s.duration.observe(since));
    }

    /// One upstream attempt on `worker`.
    #[inline]
    pub fn attempt(&self, worker: &Member, a: Attempt) {
        worker.counters.attempt(a);
    }

    pub fn skipped_unavailable(&self) {
        self.skipped_unavailable.inc();
    }

    pub fn skipped_unavailable_total(&self) -> u64 {
        self.skipped_unavailable.get()
    }

    /// A request was sent again, to another rank.
    pub fn retried(&self) {
        self.retries.inc();
    }

    /// A retry was called for but the retry budget had none left.
    pub fn retry_refused(&self) {
        self.retries_refused.inc();
    }

    pub fn retries_total(&self) -> u64 {
        self.retries.get()
    }

    /// A response was cut after its first byte (`idle`: by the stream idle timeout).
    pub fn stream_cut(&self, idle: bool) {
        self.streams_cut[idle as usize].inc();
    }

    /// A response was cut because its client took nothing of it for `server.send_timeout`.
    pub fn stream_cut_send_timeout(&self) {
        self.streams_cut[2].inc();
    }

    /// A rank was ejected after consecutive failures.
    pub fn ejected(&self, worker: &Member) {
        worker
            .counters
            .ejections
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Everything, in the Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        // Writing to a String cannot fail; a collector's error would leave the page cut short,
        // which the scraper then refuses whole.
        if let Err(e) = prometheus_text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "encoding /metrics failed");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_page_of_no_fleet_has_the_fixed_series() {
        let m = Metrics::new();
        m.retried();
        m.stream_cut(true);
        let labels = m.unlabelled();
        m.local_response(labels, 401);
        m.finished(ModelIdx::UNKNOWN, Duration::from_millis(3));
        let page = m.render();
        for line in [
            "# TYPE rankgate_retries_total counter",
            "rankgate_retries_total 1",
            "rankgate_streams_cut_total{reason=\"idle\"} 1",
            "rankgate_streams_cut_total{reason=\"broken\"} 0",
            "rankgate_streams_cut_total{reason=\"send_timeout\"} 0",
            "rankgate_local_responses_total{model=\"unknown\",route=\"unmatched\",status=\"401\"} 1",
            "rankgate_request_duration_seconds_bucket{model=\"unknown\",le=\"0.005\"} 1",
            "rankgate_request_duration_seconds_count{model=\"unknown\"} 1",
            "# TYPE rankgate_build_info gauge",
        ] {
            assert!(page.lines().any(|l| l == line), "no {line:?} in\n{page}");
        }
        assert!(page.contains(&format!(
            "rankgate_build_info{{version=\"{}\"",
            env!("CARGO_PKG_VERSION")
        )));
    }
}
