//! The telemetry monitor: polls each ENGINE once per interval and publishes the one snapshot,
//! fleet membership included.
//!
//! One poller task per engine, so a slow engine (a saturated vLLM once took ~7 s to answer one
//! scrape) only delays its own ranks while their age shows. Pollers never write the snapshot
//! themselves: they send their projected per-rank results to one publisher task, the single
//! writer, which builds the next [`Snapshot`] aside and swaps it in. A single writer needs no
//! compare-and-swap retry loop and owns the per-rank state-change log. Each poller also probes
//! its engine's health path ([`health`]) and stops promptly on shutdown, mid-poll or not.

pub mod budget;
mod client;
mod detect;
mod events;
mod fresh;
pub mod grpc;
pub mod health;
mod kv_estimate;
pub mod loads;
mod models;
pub mod pd_probe;
mod poller;
pub mod probe;
pub mod prom;
mod report;
mod source;
mod states;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio::task::{AbortHandle, JoinSet};

use crate::catalog::Catalog;
use crate::config::TelemetryConfig;
use crate::http::Shutdown;
use crate::ix::{EngineIx, IxVec, WorkerIx};
use crate::kv::listen::Listeners;
use crate::membership::{self, Change, MembershipError, Outcome, Sources};
use crate::table::{fixed_models, RankTelemetry, RankView, Snapshot, Table};
use crate::upstream::ConnLimits;
use crate::worker::{EngineEntry, EngineId, Fleet, Reported, WorkerId};

pub use report::Report;
use states::{log_change, log_staleness};

/// Engines named one by one in the log per fleet change (joined, left, said their shape); the
/// rest are counted in one line.
const LOG_EACH: usize = 20;

/// What the publisher needs besides the table.
pub struct Settings {
    pub telemetry: TelemetryConfig,
    pub default_kv_per_request: f64,
    pub limits: ConnLimits,
    /// How `https://` engines are reached.
    pub upstream: crate::tls::Upstream,
    /// `routing.kv_events`: every engine's KV events are read into its ranks' indexes.
    pub kv_events: bool,
}

/// Starts the publisher and a poller for every engine of the table's fleet; they run until
/// `shutdown`. Membership changes arrive on `changes`.
pub fn spawn(
    table: Arc<Table>,
    sources: Sources,
    settings: Settings,
    changes: mpsc::Receiver<membership::Request>,
    shutdown: Shutdown,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let fleet = table.snapshot.load().fleet.clone();
        let (tx, rx) = mpsc::channel(fleet.engines.len().max(16) * 2);
        let snap = table.snapshot.load_full();
        let listeners = Arc::new(Listeners::new(table.kv_refused.clone()));
        let budget = budget::Budget::new(settings.telemetry.max_concurrent_polls);
        let mut p = Publisher {
            budget: budget.clone(),
            http: client::HttpClient::new(crate::http::client_with(
                settings.telemetry.timeout,
                &settings.upstream,
            )),
            grpc: grpc::transport_with(settings.telemetry.timeout, &settings.upstream),
            stale: vec![false; snap.ranks.len()].into(),
            views: snap.ranks.clone(),
            catalog: snap.catalog.clone(),
            fleet,
            sources,
            table,
            settings,
            tx,
            pollers: HashMap::new(),
            feeds: HashMap::new(),
            listeners,
            tasks: JoinSet::new(),
            shutdown: shutdown.clone(),
            reported: HashMap::new(),
            reshaped: Vec::new(),
            by_key: HashMap::new(),
            answered: HashMap::new(),
        };
        p.by_key = (p.fleet.engines.iter_enumerated())
            .map(|(i, e)| (e.key, i))
            .collect();
        p.tasks.spawn(budget.refill());
        p.start_pollers();
        p.run(rx, changes, shutdown).await;
        p.tasks.abort_all();
        while p.tasks.join_next().await.is_some() {}
    })
}

/// The snapshot's single writer: folds poll reports and membership changes into the current
/// fleet and views and swaps in each new snapshot.
struct Publisher {
    table: Arc<Table>,
    settings: Settings,
    http: client::HttpClient,
    grpc: grpc::Transport,
    /// Where pollers send their reports.
    tx: mpsc::Sender<Report>,
    /// What each source says the fleet holds (the fleet is derived from it).
    sources: Sources,
    /// The fleet, views and catalog of the current snapshot.
    fleet: Arc<Fleet>,
    views: IxVec<WorkerIx, RankView>,
    catalog: Arc<Catalog>,
    /// Per worker: whether its staleness was logged.
    stale: IxVec<WorkerIx, bool>,
    pollers: HashMap<EngineId, AbortHandle>,
    /// Each engine's KV-event feed (`routing.kv_events`).
    feeds: HashMap<EngineId, AbortHandle>,
    /// The endpoints rankgate binds for engines that connect to publish their events.
    listeners: Arc<Listeners>,
    tasks: JoinSet<()>,
    /// The polls' concurrency and pace, shared by every poller.
    budget: Arc<budget::Budget>,
    shutdown: Shutdown,
    /// What each engine (by URL) last said of its flavor and size.
    reported: HashMap<Arc<str>, Reported>,
    /// Engines that said their shape since the last publish (rebuilt then, all at once).
    reshaped: Vec<Arc<str>>,
    /// Each engine of `fleet` by key, for its poll reports.
    by_key: HashMap<EngineId, EngineIx>,
    /// The newest model-list recheck round each engine has answered ([`crate::recheck`]).
    answered: HashMap<EngineId, u64>,
}

impl Publisher {
    async fn run(
        &mut self,
        mut reports: mpsc::Receiver<Report>,
        mut changes: mpsc::Receiver<membership::Request>,
        mut shutdown: Shutdown,
    ) {
        // Staleness has no report to announce it (a hung engine sends none), so a timer looks
        // for it.
        let mut tick = tokio::time::interval(self.table.stale_after / 4);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Reports are folded in as they come, and published at most once per `every`: a large
        // fleet's reports arrive hundreds a second, and each publish copies every rank's view.
        // A quiet fleet's report is published at once.
        let mut pending = false;
        let mut next = tokio::time::Instant::now();
        loop {
            let every = self.publish_every();
            tokio::select! {
                Some(report) = reports.recv() => {
                    self.report(report);
                    // Whatever else already arrived goes into the same snapshot.
                    while let Ok(r) = reports.try_recv() {
                        self.report(r);
                    }
                    pending = true;
                }
                Some((change, done)) = changes.recv() => {
                    let _ = done.send(self.change(change));
                    pending = false;
                    next = tokio::time::Instant::now() + every;
                }
                _ = tokio::time::sleep_until(next), if pending => {}
                _ = tick.tick() => {
                    log_staleness(&self.table, &self.fleet, &self.views, &mut self.stale);
                    // The pollers of engines that left end soon after their abort; until
                    // joined, each one's task (its whole future inline) stays allocated:
                    // 20,000 of them held ~100 MB after a huge fleet went.
                    while self.tasks.try_join_next().is_some() {}
                }
                _ = shutdown.changed() => return,
            }
            let now = tokio::time::Instant::now();
            if pending && now >= next {
                if self.reshaped.is_empty() {
                    self.publish();
                } else {
                    self.reshape();
                }
                log_staleness(&self.table, &self.fleet, &self.views, &mut self.stale);
                pending = false;
                next = now + every;
            }
        }
    }

    /// Least time between two publishes of poll reports: a few microseconds per rank (what one
    /// publish costs), so the publisher's share of a core stays about flat however large the
    /// fleet; never more than a quarter of the poll interval, so no report waits long.
    fn publish_every(&self) -> std::time::Duration {
        let per_rank = std::time::Duration::from_micros(5);
        let floor = std::time::Duration::from_millis(2);
        (per_rank * self.views.len() as u32)
            .max(floor)
            .min(self.settings.telemetry.interval / 4)
    }

    /// Folds one engine's poll into the views (published by the caller).
    fn report(&mut self, report: Report) {
        // A report of an engine that left the fleet since its poll began.
        let Some(&e) = self.by_key.get(&report.engine) else {
            return;
        };
        if let Some(reported) = report.reported {
            // Rebuilt at the next publish, with every other engine that said its shape by
            // then: one rebuild per engine would cost a huge fleet's arrival O(n^2).
            let url = self.fleet.engines[e].url.clone();
            self.reported.insert(url.clone(), reported);
            self.reshaped.push(url);
            return;
        }
        let range = self.fleet.workers_of(e);
        for ((w, telemetry), weight) in range.zip(report.ranks).zip(report.weight_at_poll) {
            let was = &self.views[w];
            log_change(&self.fleet, w, was, &telemetry);
            let available = matches!(telemetry, RankTelemetry::Available(_));
            self.views[w] = RankView {
                ever_available: was.ever_available || available,
                telemetry,
                reachable: report.reachable,
                weight_at_poll: weight,
                in_flight_at_report: self.fleet.workers[w].live.in_flight_weight(),
                kv_per_request: 0.0,
                source: report.source,
            };
        }
        let answered = self.answered.entry(report.engine).or_default();
        *answered = (*answered).max(report.models_round);
        if let Some(m) = report.models {
            // A list fixed in the config is never replaced.
            if self.fleet.engines[e].models.is_none() && self.catalog.of(e) != Some(&m[..]) {
                self.catalog = Arc::new(self.catalog.with(e, m.into()));
            }
        }
    }

    fn publish(&mut self) {
        let default = self.settings.default_kv_per_request;
        let next = next_snapshot(&self.fleet, &mut self.views, &self.catalog, default);
        self.table.snapshot.store(Arc::new(next));
        self.table.published.notify_waiters();
        self.settle_recheck();
    }

    /// Ends the newest recheck round once every engine that can say its models has answered
    /// it in what is now published (engines not shaped yet are not polled: they say nothing).
    fn settle_recheck(&mut self) {
        let recheck = &self.table.recheck;
        let round = recheck.newest();
        if recheck.is_done(round) {
            return;
        }
        let answered = |e: &EngineEntry| self.answered.get(&e.key).is_some_and(|&r| r >= round);
        if (self.fleet.engines.iter()).all(|e| !e.shaped() || answered(e)) {
            recheck.finish(round);
        }
    }

    /// Applies a membership change: the next fleet, with what is known of the engines that
    /// stay, swapped in; pollers started and stopped.
    fn change(&mut self, change: Change) -> Result<Outcome, MembershipError> {
        let plan = membership::plan(&self.sources, change)?;
        self.sources = plan.sources;
        // A reload's routes go in with its fleet below (the rebuild publishes once).
        if let Some(next) = (plan.routes.as_deref()).and_then(|r| self.catalog.rerouted(r)) {
            self.catalog = Arc::new(next);
        }
        // What engines that left said of themselves goes with them.
        let stay: HashSet<&str> = plan.engines.iter().map(|(_, e)| &*e.url).collect();
        self.reported.retain(|url, _| stay.contains(&**url));
        self.rebuild(plan.engines);
        // One line per engine, up to LOG_EACH of each kind, then a count: a change of 20,000
        // engines is not 20,000 lines written by the snapshot's writer.
        let each = |urls: &[String], what: &str| {
            for url in urls.iter().take(LOG_EACH) {
                tracing::info!(engine = %url, "{what}");
            }
            if urls.len() > LOG_EACH {
                tracing::info!(
                    engines = urls.len() - LOG_EACH,
                    "{what} (and more engines, not logged one by one)"
                );
            }
        };
        each(&plan.outcome.added, "engine joined the fleet");
        each(&plan.outcome.changed, "engine changed: its ranks carry on");
        each(
            &plan.outcome.removed,
            "engine left the fleet: no new requests, those on it finish",
        );
        Ok(plan.outcome)
    }

    /// The engines that said what they are since the last publish: their entries are built
    /// anew with it, in one rebuild however many they are (same-rank workers carry on), and a
    /// disagreement with the config is logged once, here.
    fn reshape(&mut self) {
        let urls = std::mem::take(&mut self.reshaped);
        let (listed, _) = self.sources.engines();
        self.rebuild(listed);
        // With the fleet's count now, which the start line could not give.
        let workers = self.fleet.workers.len();
        let engines_pending_shape = (self.fleet.engines.iter()).filter(|e| !e.shaped()).count();
        let at: HashMap<&str, &EngineEntry> = (self.fleet.engines.iter())
            .map(|e| (&*e.url, &**e))
            .collect();
        let mut quiet = 0usize;
        for url in &urls {
            let Some(entry) = at.get(&**url) else {
                continue;
            };
            let (flavor, ranks) = (entry.flavor, entry.dp_size);
            match entry.mismatch() {
                Some(m) => {
                    tracing::warn!(engine = %url, mismatch = %m, workers, engines_pending_shape, "engine disagrees with the config")
                }
                None if quiet < LOG_EACH => {
                    quiet += 1;
                    tracing::info!(engine = %url, %flavor, ranks, workers, engines_pending_shape, "engine said its shape")
                }
                None => quiet += 1,
            }
        }
        if quiet > LOG_EACH {
            tracing::info!(
                engines = quiet - LOG_EACH,
                workers,
                engines_pending_shape,
                "more engines said their shape (not logged one by one)"
            );
        }
    }

    /// Builds the fleet of `listed` (each with what its engine reported of itself), reusing the
    /// entries that did not change, and swaps it in with the telemetry carried over.
    fn rebuild(&mut self, listed: Vec<membership::Listed>) {
        let old = &self.fleet;
        // Looked up by URL (one pass, not one per engine: fleets run to tens of thousands).
        let old_at: HashMap<&str, EngineIx> = (old.engines.iter_enumerated())
            .map(|(i, e)| (&*e.url, i))
            .collect();
        // An engine that stays (same URL) keeps its entry if nothing about it changed, else
        // its workers: same ranks, same counters, same telemetry until the next poll.
        let entries: Vec<Arc<EngineEntry>> = (listed.into_iter())
            .map(|(origin, cfg)| {
                let cfg = cfg.with_reported(self.reported.get(&cfg.url));
                let was = old_at.get(&*cfg.url).map(|&i| &old.engines[i]);
                match was {
                    Some(e) if e.origin == origin && e.cfg == cfg => e.clone(),
                    was => EngineEntry::new(cfg, origin, self.settings.limits, was.map(|e| &**e)),
                }
            })
            .collect();
        let fleet = Fleet::new(entries);
        let mut known: HashMap<WorkerId, (RankView, bool)> = (old.workers.iter())
            .zip(
                std::mem::take(&mut self.views)
                    .into_iter()
                    .zip(std::mem::take(&mut self.stale)),
            )
            .map(|(w, v)| (w.key, v))
            .collect();
        (self.views, self.stale) = (fleet.workers.iter())
            .map(|w| known.remove(&w.key).unwrap_or((RankView::initial(), false)))
            .unzip();
        let fixed = fixed_models(&fleet);
        let lists: IxVec<EngineIx, _> = (fleet.engines.iter().zip(fixed))
            .map(|(e, fixed)| {
                fixed.or_else(|| {
                    let was = *old_at.get(&*e.url)?;
                    self.catalog.of(was).map(Into::into)
                })
            })
            .collect();
        self.catalog = Arc::new(Catalog::new(lists).routed(self.catalog.routes().clone()));
        self.by_key = (fleet.engines.iter_enumerated())
            .map(|(i, e)| (e.key, i))
            .collect();
        self.fleet = Arc::new(fleet);
        self.publish();
        self.start_pollers();
        let keys = &self.by_key;
        self.answered.retain(|k, _| keys.contains_key(k));
        for tasks in [&mut self.pollers, &mut self.feeds] {
            tasks.retain(|k, task| {
                let stays = keys.contains_key(k);
                if !stays {
                    task.abort();
                }
                stays
            });
        }
    }

    /// A poller for every engine of the fleet that has none.
    fn start_pollers(&mut self) {
        for entry in &self.fleet.engines {
            if self.pollers.contains_key(&entry.key) {
                continue;
            }
            match poller::Poller::new(
                entry.clone(),
                self.settings.telemetry.clone(),
                self.http.clone(),
                self.grpc.clone(),
            ) {
                Ok(p) => {
                    let task = self.tasks.spawn(p.run(
                        self.budget.clone(),
                        self.tx.clone(),
                        self.shutdown.clone(),
                        self.table.recheck.asked(),
                    ));
                    self.pollers.insert(entry.key, task);
                }
                // Config validation makes this unreachable; if it is not, the engine's ranks
                // stay Unavailable ("not polled") instead of taking the router down.
                Err(err) => tracing::error!(engine = %entry.url, %err, "engine not polled"),
            }
            // An engine without workers yet (shape unknown) gets its feed once it has them.
            if self.settings.kv_events
                && !entry.members.is_empty()
                && !self.feeds.contains_key(&entry.key)
            {
                let task = self.tasks.spawn(events::feed(
                    entry.clone(),
                    self.http.clone(),
                    self.listeners.clone(),
                    self.table.clone(),
                ));
                self.feeds.insert(entry.key, task);
            }
        }
        // Finished pollers (aborted ones) leave the set.
        while self.tasks.try_join_next().is_some() {}
    }
}

/// The snapshot the publisher swaps in: the fleet with `views`, each rank's KV estimate
/// refreshed first. (Public for `benches/telemetry.rs`: this is what one publish costs.)
pub fn next_snapshot(
    fleet: &Arc<Fleet>,
    views: &mut IxVec<WorkerIx, RankView>,
    catalog: &Arc<Catalog>,
    default_kv_per_request: f64,
) -> Snapshot {
    kv_estimate::estimate_kv_per_request(views.as_mut_slice(), default_kv_per_request);
    Snapshot {
        fleet: fleet.clone(),
        ranks: views.clone(),
        catalog: catalog.clone(),
    }
}

#[cfg(test)]
mod tests;
