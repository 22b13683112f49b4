//! One engine's poller: each interval, ask its telemetry sources in order of preference until one
//! answers, project the answer onto the engine's ranks, and hand the result to the publisher.
//!
//! A source that fails (transport error, HTTP error, unreadable body, gRPC status) passes the
//! turn to the next; a source that answers serves every rank, including ranks it reports as
//! missing or invalid: falling back per rank would mix numbers of different ages and meanings.
//! A failed source (except the last, which has nothing behind it) is taken out of the polls and
//! probed in the background instead, every few polls (doubling up to [`MAX_SKIP`]); it rejoins
//! once a probe gets an answer. So a preferred source that hangs until the timeout costs the
//! polls nothing while the fallback answers at once.
//!
//! Beside the sources, each poll probes the engine's health path concurrently (see
//! [`super::health`]); an engine failing it is Unavailable whatever its numbers say. Every step
//! of a poll is bounded by `telemetry.timeout`, the model list is read aside
//! ([`super::models`]) so a hung `/v1/models` never holds up the polls, and the whole poll is raced against
//! shutdown so a stuck engine cannot keep the router from stopping.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio::time::{Instant, MissedTickBehavior};

use super::budget::{Budget, MISSES_TO_UNREACHED};
use super::client::{Failure, HttpClient};
use super::fresh::FreshRanks;
use super::grpc::LoadsClient;
use super::health::{self, Change, Health};
use super::loads::{self, LoadsReport, ProjectionNotes};
use super::models::ModelsReader;
use super::report::Report;
use super::source::{fetch_source, uri, Down, Raw, Source};
use super::{detect, prom};
use crate::config::{SourceKind, TelemetryConfig};
use crate::http::{shutdown_signalled, Shutdown};
use crate::metrics::PollResult;
use crate::reason::{HealthFailure, Reason, SourceFailure};
use crate::table::RankTelemetry;
use crate::worker::EngineEntry;
use crate::worker::{Deployment, Engine, Flavor, TelemetrySource};

/// Most polls between two background probes of a failed source.
const MAX_SKIP: u32 = 32;

pub struct Poller {
    entry: Arc<EngineEntry>,
    engine: Engine,
    cfg: TelemetryConfig,
    sources: Vec<Source>,
    http: HttpClient,
    models: ModelsReader,
    /// `None` when the engine has no health path (gateways by default, or `health_path = ""`).
    health_uri: Option<http::Uri>,
    health: Health,
    dp_size_checked: bool,
    /// Transport for asking a gRPC-only engine what it is.
    grpc: super::grpc::Transport,
    /// Ask the engine its flavor and size before the next poll (at start when the config
    /// leaves something to it, and again when it answers after an outage: a restarted engine
    /// may run another DP size).
    detect_due: bool,
    /// Whether the last poll reached the engine.
    reachable: bool,
    /// The engine's last answer to "what are you" failed, and that was logged: the next
    /// failures are not (their wording may change each poll: a refused connection, a timeout),
    /// its answer is, once.
    shape_failing: bool,
    /// Per source: `Some` while it is out of the polls after a failure.
    down: Vec<Option<Down>>,
    /// The newest model-list recheck round asked ([`crate::recheck`]).
    round: u64,
    /// Since when each rank is fresh (no gauges yet).
    fresh: FreshRanks,
}

impl Drop for Poller {
    fn drop(&mut self) {
        for probe in self
            .down
            .iter_mut()
            .flatten()
            .filter_map(|d| d.probe.take())
        {
            probe.abort();
        }
    }
}

impl Poller {
    pub fn new(
        entry: Arc<EngineEntry>,
        cfg: TelemetryConfig,
        http: HttpClient,
        grpc: super::grpc::Transport,
    ) -> Result<Poller, String> {
        let engine = entry.cfg.clone();
        let http = http.with_key(engine.api_key.clone());
        let engine_sources = engine.telemetry.len();
        let sources = engine
            .telemetry
            .iter()
            .map(|s| match s {
                TelemetrySource::Grpc { authority, tls } => {
                    let origin = TelemetrySource::grpc_origin(authority, *tls);
                    LoadsClient::new(engine.flavor, &origin, grpc.clone())
                        .map(|c| Source::Grpc(Box::new(c)))
                }
                TelemetrySource::Http { url } => uri(url).map(Source::Http),
                TelemetrySource::Prometheus => {
                    uri(&format!("{}/metrics", engine.url)).map(Source::Prometheus)
                }
            })
            .collect::<Result<Vec<_>, _>>()?;
        let health_uri = match &engine.health_path {
            Some(path) => Some(uri(&format!("{}{path}", engine.url))?),
            None => None,
        };
        let detect_due = asks(&engine) && engine.reported.is_none();
        Ok(Poller {
            detect_due,
            // A model list fixed in the config is never read; a gRPC-only engine has no
            // HTTP API to read one from (gRPC requests are not routed by model).
            models: ModelsReader::new(
                (engine.models.is_none() && engine.http)
                    .then(|| uri(&format!("{}/v1/models", engine.url)).ok())
                    .flatten(),
            ),
            health_uri,
            health: Health::new(cfg.health_failures),
            entry,
            engine,
            cfg,
            sources,
            http,
            dp_size_checked: false,
            reachable: false,
            shape_failing: false,
            grpc,
            down: (0..engine_sources).map(|_| None).collect(),
            fresh: FreshRanks::default(),
            round: 0,
        })
    }

    /// Polls once per interval until shutdown, the first at once (an engine is unknown, so
    /// unroutable, until it answers one), each poll within `budget` (see [`super::budget`]: a
    /// fleet that arrives at once is polled within its bounds, not in one burst).
    pub async fn run(
        mut self,
        budget: Arc<Budget>,
        tx: mpsc::Sender<Report>,
        mut shutdown: Shutdown,
        mut asked: watch::Receiver<u64>,
    ) {
        let mut ticker = tokio::time::interval(self.cfg.interval);
        // A slow poll delays the next one instead of firing a burst of catch-up polls at an
        // engine that is already struggling.
        ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut n: u64 = 0;
        // Consecutive steps that did not reach the engine; one never reached starts unreached.
        let mut misses = MISSES_TO_UNREACHED;
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                // A recheck round: its read starts now, not a tick later.
                Ok(()) = asked.changed() => {}
                _ = shutdown_signalled(&mut shutdown) => return,
            }
            self.round = *asked.borrow_and_update();
            // Dropping a poll cancels its requests, so shutdown never waits on a stuck engine.
            // The step is boxed: between polls (most of a poller's life, and all of it for the
            // thousands waiting for a place) the task holds only the poller.
            let report = tokio::select! {
                r = async {
                    let _place = budget.enter(misses < MISSES_TO_UNREACHED).await;
                    Box::pin(self.step(n)).await
                } => r,
                _ = shutdown_signalled(&mut shutdown) => return,
            };
            misses = match &report {
                Some(r) if r.reachable => 0,
                _ => misses.saturating_add(1),
            };
            let Some(report) = report else { continue };
            n += 1;
            tokio::select! {
                sent = tx.send(report) => if sent.is_err() { return },
                _ = shutdown_signalled(&mut shutdown) => return,
            }
        }
    }

    /// Asks the engine what it is when that is due, then polls it once it has workers. `None`:
    /// nothing to report this turn (its shape is still unknown, and why is on the entry).
    async fn step(&mut self, n: u64) -> Option<Report> {
        // An engine with workers is asked again only once it answers: a dead engine costs its
        // polls nothing more.
        if self.detect_due && (!self.entry.shaped() || self.reachable) {
            let asked = tokio::time::timeout(
                self.cfg.timeout,
                detect::detect(&self.engine, &self.http, &self.grpc),
            )
            .await
            .unwrap_or_else(|_| {
                Err(format!(
                    "asked its flavor and DP size: no answer within {} ms",
                    self.cfg.timeout.as_millis()
                ))
            });
            match asked {
                Ok(reported) => {
                    self.detect_due = false;
                    self.entry.unshaped.store(None);
                    let was_failing = std::mem::take(&mut self.shape_failing);
                    if self.entry.reported.as_ref() != Some(&reported) {
                        // The publisher builds the engine's entry anew with it, and logs it.
                        return Some(Report {
                            engine: self.entry.key,
                            reachable: true,
                            weight_at_poll: Vec::new(),
                            ranks: Vec::new(),
                            source: None,
                            models: None,
                            models_round: 0,
                            reported: Some(reported),
                        });
                    }
                    if was_failing {
                        tracing::info!(engine = %self.engine.url, "engine says its shape again");
                    }
                }
                // Without workers it is asked every poll until it answers; with workers (from
                // the config) it is routed as configured, and asked again after its next outage.
                Err(why) if self.entry.shaped() => {
                    self.detect_due = false;
                    if !std::mem::replace(&mut self.shape_failing, true) {
                        tracing::warn!(engine = %self.engine.url, %why, "engine did not say its shape: routed as configured");
                    }
                }
                // Asked every poll: warned once until it answers (`/workers` keeps the latest
                // reason), not once a poll.
                Err(why) => {
                    if !std::mem::replace(&mut self.shape_failing, true) {
                        tracing::warn!(engine = %self.engine.url, %why, "engine did not say its shape: it takes no traffic until it does");
                    } else if self.entry.unshaped.load().as_deref() != Some(&why) {
                        tracing::debug!(engine = %self.engine.url, %why, "engine still does not say its shape");
                    }
                    self.entry.unshaped.store(Some(why.into()));
                }
            }
        }
        if !self.entry.shaped() {
            return None;
        }
        let mut report = self.poll_engine(n).await;
        self.fresh.judge(&self.entry.members, &mut report);
        if report.reachable && !self.reachable && asks(&self.engine) && n > 0 {
            self.detect_due = true;
        }
        self.reachable = report.reachable;
        Some(report)
    }

    /// One poll: the sources and the health probe side by side, the health verdict applied, and
    /// the model list picked up when its background read has finished.
    async fn poll_engine(&mut self, n: u64) -> Report {
        let probe = self
            .health_uri
            .clone()
            .map(|u| health::probe(self.http.clone(), u, self.cfg.timeout));
        let (mut report, probed) = tokio::join!(self.poll(), async {
            match probe {
                Some(p) => Some(p.await),
                None => None,
            }
        });
        if let Some(result) = probed {
            self.apply_health(result, &mut report);
        }
        report.models = (self.models)
            .step(
                n,
                report.reachable,
                &self.http,
                self.cfg.timeout,
                self.round,
            )
            .await;
        report.models_round = self.models.answered();
        report
    }

    /// Records a probe result; while the engine is unhealthy its ranks are Unavailable and it
    /// counts as unreachable, so neither telemetry nor the no-telemetry fallback picks it.
    fn apply_health(&mut self, result: Result<(), HealthFailure>, report: &mut Report) {
        match self.health.record(result) {
            Change::TurnedUnhealthy => tracing::warn!(
                engine = %self.engine.url,
                failure = %self.health.failing().map(ToString::to_string).unwrap_or_default(),
                consecutive = self.health.consecutive_failures(),
                "engine unhealthy: its ranks take no traffic"
            ),
            Change::Recovered => tracing::info!(engine = %self.engine.url, "engine healthy again"),
            Change::None => {}
        }
        let Some(failure) = self.health.failing() else {
            return;
        };
        // When the sources failed too, keep their failures in the reason: they say more about
        // an engine that is down than the probe alone.
        let sources = match report.ranks.first() {
            Some(RankTelemetry::Unavailable {
                reason: Reason::SourcesFailed { failures },
            }) => failures.clone(),
            _ => Vec::new(),
        };
        let reason = Reason::Unhealthy {
            failure: failure.clone(),
            sources,
        };
        report.ranks = vec![RankTelemetry::unavailable(reason); report.ranks.len()];
        report.reachable = false;
    }

    /// One poll for `check --probe`: the kind of source that answered (`None`: none did) and
    /// the ranks.
    pub(super) async fn poll_once(&mut self) -> (Option<SourceKind>, Vec<RankTelemetry>) {
        let r = self.poll().await;
        (r.source, r.ranks)
    }

    /// One poll of the engine through its first answering source.
    pub async fn poll(&mut self) -> Report {
        let ranks = self.entry.members.len();
        let weight_at_poll: Vec<u64> = (self.entry.members.iter())
            .map(|m| m.live.dispatched_weight.load(Relaxed))
            .collect();
        let mut failures = Vec::new();
        let mut answered = false;
        let last = self.sources.len().saturating_sub(1);
        for i in 0..self.sources.len() {
            let name = self.sources[i].kind();
            if i < last && !self.back_in_poll(i).await {
                self.entry.polls.read(name, PollResult::Skipped);
                failures.push(SourceFailure {
                    source: name,
                    problem: "failed recently, probed in the background".into(),
                });
                continue;
            }
            let result = tokio::time::timeout(self.cfg.timeout, self.read(i)).await;
            let counted = match &result {
                Ok(Ok(_)) => PollResult::Ok,
                Ok(Err(_)) => PollResult::Error,
                Err(_) => PollResult::Timeout,
            };
            self.entry.polls.read(name, counted);
            if i < last && !matches!(result, Ok(Ok(_))) {
                self.down[i] = Some(Down {
                    every: 1,
                    wait: 1,
                    probe: None,
                });
            }
            match result {
                Ok(Ok((ranks, notes))) => {
                    self.note(&notes);
                    if let (Source::Grpc(client), false) = (&self.sources[i], self.dp_size_checked)
                    {
                        self.dp_size_checked = true;
                        // Once per engine, and bounded like every other step of a poll.
                        let _ = tokio::time::timeout(
                            self.cfg.timeout,
                            client.check_dp_size(&self.engine),
                        )
                        .await;
                    }
                    return Report {
                        engine: self.entry.key,
                        reachable: true,
                        weight_at_poll,
                        ranks,
                        source: Some(name),
                        models: None,
                        models_round: 0,
                        reported: None,
                    };
                }
                Ok(Err(f)) => {
                    answered |= f.answered;
                    failures.push(SourceFailure {
                        source: name,
                        problem: f.reason,
                    });
                }
                Err(_) => failures.push(SourceFailure {
                    source: name,
                    problem: format!("no answer within {} ms", self.cfg.timeout.as_millis()),
                }),
            }
        }
        self.entry.polls.failed.fetch_add(1, Relaxed);
        let reason = Reason::SourcesFailed { failures };
        Report {
            engine: self.entry.key,
            reachable: answered,
            weight_at_poll,
            ranks: vec![RankTelemetry::unavailable(reason); ranks],
            source: None,
            models: None,
            models_round: 0,
            reported: None,
        }
    }

    fn note(&self, notes: &ProjectionNotes) {
        for (m, bad) in self.entry.members.iter().zip(&notes.invalid) {
            if *bad {
                m.invalid_entries.fetch_add(1, Relaxed);
            }
        }
        (self.entry.polls.unmanaged_entries).fetch_add(notes.unmanaged as u64, Relaxed);
    }

    async fn read(&mut self, i: usize) -> Result<(Vec<RankTelemetry>, ProjectionNotes), Failure> {
        let src = self.sources[i].clone();
        match fetch_source(src.clone(), self.http.clone()).await? {
            Raw::Metrics(text) => {
                let scrape = prom::parse(&text);
                // A rank labelled beyond the ones routed: a rank whose series had not appeared
                // when the engine was counted, or a restart with more ranks. Ask it again.
                let end = self.engine.ranks().end;
                // (One series on a one-rank server is its rank whatever its label: external LB.)
                let one = self.engine.dp_size == 1 && scrape.per_rank.len() == 1;
                if self.engine.deployment == Deployment::Own
                    && !one
                    && scrape.per_rank.last().is_some_and(|(r, _)| *r >= end)
                {
                    self.detect_due = true;
                }
                (self.entry.polls.bad_lines).fetch_add(scrape.bad_lines as u64, Relaxed);
                prom::lora::LoraGauge::tell(scrape.lora.as_ref(), &self.entry.members);
                let ranks = prom::project(&scrape, &self.engine, Instant::now());
                Ok((ranks, ProjectionNotes::default()))
            }
            Raw::Loads(report) => Ok(self.project(&report)),
        }
    }

    /// Whether source `i` takes part in this poll. A source that is down does not; its probe
    /// is started every `every` polls, and once one gets an answer the source is back.
    async fn back_in_poll(&mut self, i: usize) -> bool {
        let Some(d) = &mut self.down[i] else {
            return true;
        };
        match d.probe.take() {
            Some(p) if p.is_finished() => {
                if p.await.unwrap_or(false) {
                    self.down[i] = None;
                    return true;
                }
                d.every = (d.every * 2).min(MAX_SKIP);
                d.wait = d.every;
            }
            Some(p) => d.probe = Some(p),
            None if d.wait > 0 => d.wait -= 1,
            None => {
                let (src, http, timeout) =
                    (self.sources[i].clone(), self.http.clone(), self.cfg.timeout);
                d.probe = Some(tokio::spawn(async move {
                    matches!(
                        tokio::time::timeout(timeout, fetch_source(src, http)).await,
                        Ok(Ok(_))
                    )
                }));
            }
        }
        false
    }

    fn project(&self, report: &LoadsReport) -> (Vec<RankTelemetry>, ProjectionNotes) {
        let now = Instant::now();
        match self.engine.flavor {
            Flavor::Gateway => (vec![loads::rollup(report, now)], ProjectionNotes::default()),
            Flavor::Vllm | Flavor::Sglang => loads::project(report, &self.engine, now),
        }
    }
}

/// Whether the engine is asked what it is: when the config leaves its flavor to it, or it is its
/// own DP deployment (whose rank count it knows better than the config).
fn asks(engine: &Engine) -> bool {
    engine.flavor != Flavor::Gateway
        && (engine.declared.flavor.is_none() || engine.deployment == Deployment::Own)
}
