//! LoRA adapters loaded on demand (`[[adapters]]`): a request naming a declared adapter that no
//! server's model list has makes rankgate load it on one server of its base model, with vLLM's
//! `POST /v1/load_lora_adapter`, and then read the lists again so the request routes to it.
//!
//! One load at a time per adapter: the first request starts it (in a task of its own, so a
//! client that leaves does not cut a load others wait for) and every request for the adapter
//! that comes meanwhile waits for the same load. A load that fails is answered with the engine's
//! own words, and that server is not asked again for [`FAILED_FOR`]: a bad path is not mended
//! by asking again, and each try costs the engine a read of the adapter's files. Where a server
//! holds `engines[].max_adapters` adapters, the least recently used declared one that no request
//! of this router's runs is unloaded first (one not declared is the operator's: never touched).
//!
//! Who reaches it: anyone who may send a request can start a load, but only of an adapter the
//! config declares, once per adapter at a time and once per [`FAILED_FOR`] per failing server;
//! the admin API loads and unloads by hand behind the admin token.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http::StatusCode;
use serde_json::{json, Value};
use tokio::sync::{watch, Semaphore};
use tokio::time::Instant;

use crate::model_routes::Declared;
use crate::table::{Snapshot, Table};
use crate::worker::{EngineEntry, Flavor};

mod calls;
mod error;
mod plan;

pub use calls::LOAD_WITHIN;
pub use error::{LoadError, FAILED_FOR};
pub use plan::listed_adapters;
use plan::{Failure, Loaded, Loading, Outcome, State};

/// How long a plan that found no server to load on stands (`LoadError::NoServer`, `Full`).
const REFUSED_FOR: Duration = Duration::from_secs(1);
/// Loads (with their unloads) running at once, across the fleet: each reads an adapter's files
/// on its engine and ends with a round of model-list reads.
pub const MAX_LOADS_AT_ONCE: usize = 4;

/// The loads running and failed lately; one for the router.
pub struct Loader {
    client: calls::Client,
    table: Arc<Table>,
    metrics: Arc<crate::metrics::Metrics>,
    state: Mutex<State>,
    /// [`MAX_LOADS_AT_ONCE`] permits.
    running: Semaphore,
    /// Numbers the loads, so a load's clean-up removes its own entry only.
    next: AtomicU64,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Loader")
    }
}

impl Loader {
    pub fn new(
        table: Arc<Table>,
        upstream: &crate::tls::Upstream,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Arc<Loader> {
        Arc::new(Loader {
            client: crate::http::client_with(Duration::from_secs(5), upstream),
            table,
            metrics,
            state: Mutex::default(),
            running: Semaphore::new(MAX_LOADS_AT_ONCE),
            next: AtomicU64::new(0),
        })
    }

    /// `rankgate_adapter_loads_total`: `r`, the answer to a load (`load`) or an unload.
    fn counted(&self, load: bool, r: calls::Answer) -> calls::Answer {
        use crate::metrics::AdapterLoad;
        self.metrics.adapter_load(match (&r, load) {
            (Err(_), _) => AdapterLoad::Failed,
            (Ok(()), true) => AdapterLoad::Loaded,
            (Ok(()), false) => AdapterLoad::Unloaded,
        });
        r
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every change leaves the state whole: a panic elsewhere leaves it usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `adapter` served by some server: loads it on the one [`plan::plan`] picks, or waits
    /// for the load running; the server, once the model lists read after the load are published.
    pub async fn ensure(self: &Arc<Self>, adapter: &Declared) -> Result<Arc<str>, LoadError> {
        let mut rx = self.start(adapter)?;
        let done = rx.wait_for(Option::is_some).await;
        match done.as_deref() {
            Ok(Some(outcome)) => outcome.clone(),
            // The load's task ended without answering (a panic, or the runtime going down).
            _ => Err(LoadError::Failed {
                adapter: adapter.name.to_string(),
                server: "its server".into(),
                why: "the load ended without an answer".into(),
            }),
        }
    }

    /// The answer to wait for: at once when some server's list has `adapter` now (published
    /// since the request looked), else the load running, else a new one.
    fn start(self: &Arc<Self>, adapter: &Declared) -> Result<watch::Receiver<Outcome>, LoadError> {
        let snap = self.table.snapshot.load();
        if let Some(server) = serving(&snap, &adapter.name) {
            return Ok(watch::channel(Some(Ok(server))).1);
        }
        let mut state = self.lock();
        if let Some(l) = state.loading.get(&adapter.name) {
            return Ok(l.answer.clone());
        }
        let now = Instant::now();
        let declared = snap.catalog.routes();
        state.failed.retain(|f| {
            now.duration_since(f.at) < FAILED_FOR
                && declared
                    .declared(&f.adapter)
                    .is_some_and(|d| d.path == f.path)
        });
        state
            .loaded
            .retain(|l| now.duration_since(l.at) < FAILED_FOR);
        // A plan that found no server is kept for a moment: a stranger repeating the request
        // costs one look, not a pass over the fleet under the lock each time.
        state
            .refused
            .retain(|(_, at, _)| now.duration_since(*at) < REFUSED_FOR);
        if let Some((_, _, e)) = state.refused.iter().find(|(a, ..)| *a == adapter.name) {
            return Err(e.clone());
        }
        let plan = match plan::plan(&snap, adapter, &state, self.table.stale_after) {
            Ok(p) => p,
            Err(e) => {
                if matches!(e, LoadError::NoServer { .. } | LoadError::Full { .. }) {
                    state.refused.push((adapter.name.clone(), now, e.clone()));
                }
                return Err(e);
            }
        };
        let (tx, rx) = watch::channel(None);
        let id = self.next.fetch_add(1, Relaxed);
        let server: Arc<str> = plan.engine.url.clone();
        let loading = Loading {
            id,
            server: server.clone(),
            victim: plan.unload.clone(),
            answer: rx.clone(),
        };
        state.loading.insert(adapter.name.clone(), loading);
        drop(state);
        let (this, adapter) = (self.clone(), adapter.clone());
        // Its own task: a first client that goes away does not cut the load the others wait for.
        tokio::spawn(async move {
            let cleanup = Cleanup {
                loader: this.clone(),
                adapter: adapter.name.clone(),
                id,
            };
            let outcome = this.run(&plan, &adapter).await.map(|()| server.clone());
            let mut state = this.lock();
            let at = Instant::now();
            let (name, path) = (adapter.name.clone(), adapter.path.clone());
            match &outcome {
                Ok(_) => state.loaded.push(Loaded {
                    adapter: name,
                    server,
                    at,
                }),
                Err(error @ (LoadError::Failed { .. } | LoadError::NotListed { .. })) => {
                    let error = error.clone();
                    state.failed.push(Failure {
                        adapter: name,
                        path,
                        server,
                        at,
                        error,
                    })
                }
                Err(_) => {}
            }
            drop(state);
            drop(cleanup);
            tx.send_replace(Some(outcome));
        });
        Ok(rx)
    }

    /// Unloads what `plan` says, loads `adapter`, and waits for the lists read after it; an
    /// engine that said it loaded the adapter but does not list it then has not served it.
    async fn run(&self, plan: &plan::Plan, adapter: &Declared) -> Result<(), LoadError> {
        let engine = &plan.engine;
        // A load waits for a turn no longer than a load takes: loads stuck on engines that do
        // not answer hold no request for hours behind them.
        let Ok(Ok(_permit)) = tokio::time::timeout(LOAD_WITHIN, self.running.acquire()).await
        else {
            return Err(LoadError::Busy {
                adapter: adapter.name.to_string(),
            });
        };
        let failed = |why: String| LoadError::Failed {
            adapter: adapter.name.to_string(),
            server: engine.url.to_string(),
            why,
        };
        if let Some(victim) = &plan.unload {
            self.forget(&engine.url, victim);
            let limit = engine.max_adapters.unwrap_or(0);
            let unloaded = calls::unload(&self.client, engine, victim, true).await;
            self.counted(false, unloaded).map_err(|(_, why)| {
                failed(format!(
                    "unloading `{victim}` first (engines[].max_adapters = {limit}): {why}"
                ))
            })?;
        }
        let loaded = calls::load(&self.client, engine, &adapter.name, &adapter.path).await;
        self.counted(true, loaded).map_err(|(_, why)| failed(why))?;
        self.relist().await;
        let snap = self.table.snapshot.load();
        let listed = (snap.fleet.engines.iter_enumerated())
            .any(|(e, x)| x.url == engine.url && snap.catalog.serves(e, &adapter.name));
        if !listed {
            tracing::warn!(adapter = %adapter.name, server = %engine.url, "a server said it loaded a LoRA adapter its /v1/models does not list");
            return Err(LoadError::NotListed {
                adapter: adapter.name.to_string(),
                server: engine.url.to_string(),
            });
        }
        Ok(())
    }

    /// `adapter` is unloaded from `server`: its load there is no longer one to count on.
    fn forget(&self, server: &str, adapter: &str) {
        (self.lock().loaded).retain(|l| !(&*l.server == server && &*l.adapter == adapter));
    }

    /// Reads every model list again, and waits (within [`crate::recheck::WAIT`]) until what
    /// they say is published.
    async fn relist(&self) {
        let round = self.table.recheck.force();
        self.table.recheck.wait(round, crate::recheck::WAIT).await;
    }

    /// Loads `adapter` on the server `url` by hand (the admin API), from `path` or, when none
    /// is given, the path `[[adapters]]` declares; the lists are read again after it.
    pub async fn load_by_hand(
        &self,
        url: &str,
        adapter: &str,
        path: Option<&str>,
    ) -> Result<(), HandError> {
        let snap = self.table.snapshot.load();
        let engine = engine(&snap, url)?;
        let declared = snap
            .catalog
            .routes()
            .declared(adapter)
            .map(|d| d.path.clone());
        let path = match (path, declared) {
            (Some(p), _) => p.to_string(),
            (None, Some(p)) => p.to_string(),
            (None, None) => return Err(HandError::NoPath(adapter.to_string())),
        };
        drop(snap);
        self.counted(
            true,
            calls::load(&self.client, &engine, adapter, &path).await,
        )
        .map_err(HandError::engine)?;
        self.relist().await;
        Ok(())
    }

    /// Unloads `adapter` from the server `url` by hand (the admin API).
    pub async fn unload_by_hand(&self, url: &str, adapter: &str) -> Result<(), HandError> {
        let engine = engine(&self.table.snapshot.load(), url)?;
        self.counted(
            false,
            calls::unload(&self.client, &engine, adapter, false).await,
        )
        .map_err(HandError::engine)?;
        self.relist().await;
        Ok(())
    }

    /// The loads running and the failures remembered, for `GET /adapters`.
    pub fn status(&self) -> (Value, Value) {
        let state = self.lock();
        let loading = (state.loading.iter())
            .map(|(a, l)| json!({"adapter": &**a, "server": &*l.server, "unloading_first": l.victim}))
            .collect();
        let failed = (state.failed.iter())
            .filter(|f| f.at.elapsed() < FAILED_FOR)
            .map(|f| {
                json!({"adapter": &*f.adapter, "server": &*f.server,
                    "seconds_ago": f.at.elapsed().as_secs(), "error": f.error.to_string()})
            })
            .collect();
        (Value::Array(loading), Value::Array(failed))
    }
}

/// Removes a load's entry when its task ends, however it ends (a panic included), so the
/// adapter is not left loading for ever.
struct Cleanup {
    loader: Arc<Loader>,
    adapter: Arc<str>,
    id: u64,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        let mut state = self.loader.lock();
        if state
            .loading
            .get(&self.adapter)
            .is_some_and(|l| l.id == self.id)
        {
            state.loading.remove(&self.adapter);
        }
    }
}

/// A server whose model list has `adapter` now.
fn serving(snap: &Snapshot, adapter: &str) -> Option<Arc<str>> {
    let e = *snap
        .catalog
        .engines_for(Some(adapter), |_| true)
        .ok()?
        .first()?;
    snap.catalog
        .serves(e, adapter)
        .then(|| snap.fleet.engines[e].url.clone())
}

/// Why a load or unload by hand did not happen.
#[derive(Debug, thiserror::Error)]
pub enum HandError {
    #[error("no engine of this fleet has the url {0:?} (GET /adapters lists them)")]
    NoServer(String),
    #[error("{0} is not a vLLM server serving OpenAI HTTP: rankgate loads adapters on vLLM servers only")]
    NotVllm(String),
    #[error("the adapter {0:?} is not declared in [[adapters]]: give its \"path\"")]
    NoPath(String),
    #[error("the call to the engine failed: {1}")]
    Engine(Option<StatusCode>, String),
}

impl HandError {
    fn engine((status, why): calls::Refusal) -> HandError {
        HandError::Engine(status, why)
    }

    /// The admin API's answer: the engine's own 4xx passed on, its other failures 502.
    pub fn status(&self) -> StatusCode {
        match self {
            HandError::NoServer(_) => StatusCode::NOT_FOUND,
            HandError::NotVllm(_) | HandError::NoPath(_) => StatusCode::BAD_REQUEST,
            HandError::Engine(Some(s), _) if s.is_client_error() => *s,
            HandError::Engine(..) => StatusCode::BAD_GATEWAY,
        }
    }
}

/// The engine of `snap` at `url`, when it can load adapters.
fn engine(snap: &Snapshot, url: &str) -> Result<Arc<EngineEntry>, HandError> {
    let e = (snap.fleet.engines.iter())
        .find(|e| &*e.url == url)
        .ok_or_else(|| HandError::NoServer(url.to_string()))?;
    match e.http && e.flavor == Flavor::Vllm {
        true => Ok(e.clone()),
        false => Err(HandError::NotVllm(url.to_string())),
    }
}
