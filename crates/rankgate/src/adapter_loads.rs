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

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::time::Instant;

use crate::ix::EngineIx;
use crate::model_routes::Declared;
use crate::table::{Snapshot, Table};
use crate::worker::{EngineEntry, Flavor};

/// Longest one load or unload may take: vLLM reads the adapter's files (from disk, or from the
/// Hub for a repository id) before it answers.
pub const LOAD_WITHIN: Duration = Duration::from_secs(60);
/// How long a server whose load of an adapter failed is not asked to load it again.
pub const FAILED_FOR: Duration = Duration::from_secs(30);
/// Largest engine answer read: vLLM's are one line.
const MAX_ANSWER: usize = 64 * 1024;
/// Longest piece of an engine's answer an error repeats.
const MAX_SHOWN: usize = 300;

/// Why a declared adapter could not be made to serve.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LoadError {
    #[error("the LoRA adapter `{adapter}` ([[adapters]]) has base model `{base}`, which no vLLM server of this fleet serves now: it cannot be loaded anywhere")]
    NoServer { adapter: String, base: String },
    #[error("loading the LoRA adapter `{adapter}` on {server} failed: {why}; rankgate does not ask that server to load it again for {} s", FAILED_FOR.as_secs())]
    Failed {
        adapter: String,
        server: String,
        why: String,
    },
    #[error("every server of base model `{base}` holds its engines[].max_adapters adapters, each in use or not declared: the LoRA adapter `{adapter}` was not loaded; retry once one is idle")]
    Full { adapter: String, base: String },
    #[error("the LoRA adapter `{adapter}` was loaded on {server}, but its /v1/models does not list it yet; retry shortly")]
    NotListed { adapter: String, server: String },
}

impl LoadError {
    /// What a client told nothing of the fleet may read: no server, no engine reply.
    pub fn write_public(&self, out: &mut String) -> std::fmt::Result {
        use std::fmt::Write;
        match self {
            LoadError::NoServer { adapter, .. } => {
                write!(out, "the LoRA adapter `{adapter}` cannot be loaded: no server serves its base model now")
            }
            LoadError::Failed { adapter, .. } => write!(
                out,
                "loading the LoRA adapter `{adapter}` failed; not tried again for {} s",
                FAILED_FOR.as_secs()
            ),
            LoadError::Full { adapter, .. } => write!(
                out,
                "the LoRA adapter `{adapter}` was not loaded: every server holds its limit of adapters in use; retry later"
            ),
            LoadError::NotListed { adapter, .. } => write!(
                out,
                "the LoRA adapter `{adapter}` was loaded but is not listed yet; retry shortly"
            ),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            LoadError::Failed { .. } => StatusCode::BAD_GATEWAY,
            _ => StatusCode::SERVICE_UNAVAILABLE,
        }
    }
}

/// A load's answer once it is done.
type Outcome = Option<Result<Arc<str>, LoadError>>;

/// The loads running and failed lately; one for the router.
pub struct Loader {
    client: crate::http::HttpClient<Full<Bytes>>,
    table: Arc<Table>,
    state: Mutex<State>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Loader")
    }
}

#[derive(Default)]
struct State {
    /// Loads running, by adapter: the server and the answer its waiters watch.
    loading: HashMap<Arc<str>, (Arc<str>, watch::Receiver<Outcome>)>,
    /// Loads that failed within [`FAILED_FOR`]: at most one per declared adapter and server.
    failed: Vec<Failure>,
}

struct Failure {
    adapter: Arc<str>,
    server: Arc<str>,
    at: Instant,
    error: LoadError,
}

/// Where a load goes: the server, and the adapter it unloads first to stay within its limit.
struct Plan {
    engine: Arc<EngineEntry>,
    unload: Option<String>,
}

impl Loader {
    pub fn new(table: Arc<Table>, upstream: &crate::tls::Upstream) -> Arc<Loader> {
        Arc::new(Loader {
            client: crate::http::client_with(Duration::from_secs(5), upstream),
            table,
            state: Mutex::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every change leaves the state whole: a panic elsewhere leaves it usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `adapter` served by some server: loads it on the one [`plan`] picks, or waits for
    /// the load running; the server, once the model lists read after the load are published.
    pub async fn ensure(self: &Arc<Self>, adapter: &Declared) -> Result<Arc<str>, LoadError> {
        let mut rx = self.start(adapter)?;
        let done = rx.wait_for(Option::is_some).await;
        match done.as_deref() {
            Ok(Some(outcome)) => outcome.clone(),
            // The task ended without answering (the runtime is going down).
            _ => Err(LoadError::Failed {
                adapter: adapter.name.to_string(),
                server: "its server".into(),
                why: "the load ended without an answer".into(),
            }),
        }
    }

    /// The running load of `adapter`, or a new one.
    fn start(self: &Arc<Self>, adapter: &Declared) -> Result<watch::Receiver<Outcome>, LoadError> {
        let mut state = self.lock();
        if let Some((_, rx)) = state.loading.get(&adapter.name) {
            return Ok(rx.clone());
        }
        let now = Instant::now();
        state
            .failed
            .retain(|f| now.duration_since(f.at) < FAILED_FOR);
        let snap = self.table.snapshot.load();
        let plan = plan(&snap, adapter, &state.failed, self.table.stale_after)?;
        let (tx, rx) = watch::channel(None);
        let server: Arc<str> = plan.engine.url.clone();
        state
            .loading
            .insert(adapter.name.clone(), (server.clone(), rx.clone()));
        drop(state);
        let (this, adapter) = (self.clone(), adapter.clone());
        tokio::spawn(async move {
            let outcome = this.run(&plan, &adapter).await.map(|()| server.clone());
            let mut state = this.lock();
            state.loading.remove(&adapter.name);
            if let Err(error @ LoadError::Failed { .. }) = &outcome {
                state.failed.push(Failure {
                    adapter: adapter.name.clone(),
                    server,
                    at: Instant::now(),
                    error: error.clone(),
                });
            }
            drop(state);
            tx.send_replace(Some(outcome));
        });
        Ok(rx)
    }

    /// Unloads what `plan` says, loads `adapter`, and waits for the lists read after it.
    async fn run(&self, plan: &Plan, adapter: &Declared) -> Result<(), LoadError> {
        let engine = &plan.engine;
        let failed = |why: String| LoadError::Failed {
            adapter: adapter.name.to_string(),
            server: engine.url.to_string(),
            why,
        };
        if let Some(victim) = &plan.unload {
            self.unload_on(engine, victim).await.map_err(|why| {
                failed(format!(
                    "unloading `{victim}` first (engines[].max_adapters = {}): {why}",
                    engine.max_adapters.unwrap_or(0)
                ))
            })?;
        }
        let loaded = self.load_on(engine, &adapter.name, &adapter.path).await;
        if let Err(why) = &loaded {
            tracing::warn!(adapter = %adapter.name, server = %engine.url, error = %why, "loading a LoRA adapter failed");
        }
        loaded.map_err(failed)?;
        tracing::info!(adapter = %adapter.name, server = %engine.url, "loaded a LoRA adapter");
        self.relist().await;
        Ok(())
    }

    /// Reads every model list again, and waits (within [`crate::recheck::WAIT`]) until what
    /// they say is published.
    async fn relist(&self) {
        let round = self.table.recheck.force();
        self.table.recheck.wait(round, crate::recheck::WAIT).await;
    }

    /// `POST /v1/load_lora_adapter` on `engine`; an adapter it has already is loaded.
    async fn load_on(&self, engine: &EngineEntry, name: &str, path: &str) -> Result<(), String> {
        let body = json!({"lora_name": name, "lora_path": path});
        match self.post(engine, "/v1/load_lora_adapter", body).await {
            Err((Some(StatusCode::BAD_REQUEST), why)) if why.contains("already been loaded") => {
                Ok(())
            }
            r => r.map_err(|(_, why)| why),
        }
    }

    /// `POST /v1/unload_lora_adapter` on `engine`.
    async fn unload_on(&self, engine: &EngineEntry, name: &str) -> Result<(), String> {
        let body = json!({"lora_name": name});
        let r = self.post(engine, "/v1/unload_lora_adapter", body).await;
        if r.is_ok() {
            tracing::info!(adapter = %name, server = %engine.url, "unloaded a LoRA adapter");
        }
        r.map_err(|(_, why)| why)
    }

    /// One POST of `body` to `engine`, within [`LOAD_WITHIN`]; `Err` with the status (when it
    /// answered) and what went wrong, the engine's own message where it gave one.
    async fn post(
        &self,
        engine: &EngineEntry,
        path: &str,
        body: Value,
    ) -> Result<(), (Option<StatusCode>, String)> {
        let uri = format!("{}{path}", engine.url);
        let mut req = Request::post(&uri)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| (None, format!("{uri}: {e}")))?;
        if let Some(key) = &engine.api_key {
            req.headers_mut()
                .insert(header::AUTHORIZATION, key.0.clone());
        }
        let answer = async {
            let resp = (self.client.request(req).await)
                .map_err(|e| (None, crate::http::error_chain(&e)))?;
            let status = resp.status();
            let text = match Limited::new(resp.into_body(), MAX_ANSWER).collect().await {
                Ok(b) => String::from_utf8_lossy(&b.to_bytes()).into_owned(),
                Err(e) => format!("(its answer could not be read: {e})"),
            };
            match status.is_success() {
                true => Ok(()),
                false => Err((Some(status), format!("{status}: {}", message(&text)))),
            }
        };
        match tokio::time::timeout(LOAD_WITHIN, answer).await {
            Ok(r) => r,
            Err(_) => Err((
                None,
                format!("no answer within {} s", LOAD_WITHIN.as_secs()),
            )),
        }
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
        self.load_on(&engine, adapter, &path)
            .await
            .map_err(HandError::Engine)?;
        self.relist().await;
        Ok(())
    }

    /// Unloads `adapter` from the server `url` by hand (the admin API).
    pub async fn unload_by_hand(&self, url: &str, adapter: &str) -> Result<(), HandError> {
        let engine = engine(&self.table.snapshot.load(), url)?;
        self.unload_on(&engine, adapter)
            .await
            .map_err(HandError::Engine)?;
        self.relist().await;
        Ok(())
    }

    /// The loads running and the failures remembered, for `GET /adapters`.
    pub fn status(&self) -> (Value, Value) {
        let state = self.lock();
        let loading = (state.loading.iter())
            .map(|(a, (s, _))| json!({"adapter": &**a, "server": &**s}))
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

/// Why a load or unload by hand did not happen.
#[derive(Debug, thiserror::Error)]
pub enum HandError {
    #[error("no engine of this fleet has the url {0:?} (GET /adapters lists them)")]
    NoServer(String),
    #[error("{0} is not a vLLM server serving OpenAI HTTP: rankgate loads adapters on vLLM servers only")]
    NotVllm(String),
    #[error("the adapter {0:?} is not declared in [[adapters]]: give its \"path\"")]
    NoPath(String),
    #[error("the engine refused: {0}")]
    Engine(String),
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

/// An engine's error answer as its message says it (OpenAI's `error.message`), else its text,
/// cut to [`MAX_SHOWN`] characters.
fn message(text: &str) -> String {
    let said = serde_json::from_str::<Value>(text).ok().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("message"))
            .and_then(Value::as_str)
            .map(str::to_string)
    });
    let said = said.unwrap_or_else(|| text.trim().to_string());
    match said.char_indices().nth(MAX_SHOWN) {
        Some((cut, _)) => format!("{}...", &said[..cut]),
        None => said,
    }
}

/// The adapters `e`'s model list has (entries naming a `parent`).
pub fn listed_adapters(snap: &Snapshot, e: EngineIx) -> impl Iterator<Item = &str> {
    (snap.catalog.of(e).into_iter().flatten())
        .filter(|m| m.entry.get("parent").is_some_and(Value::is_string))
        .map(|m| m.id.as_str())
}

/// Where `adapter` is loaded: among the vLLM servers whose list has its base and whose load of
/// it has not failed lately, those below their `max_adapters` first, then the one whose
/// least-used fresh rank has the most KV free, then the one holding fewest adapters. A server
/// at its limit takes it only by unloading an idle declared adapter ([`victim`]).
fn plan(
    snap: &Snapshot,
    adapter: &Declared,
    failed: &[Failure],
    stale_after: Duration,
) -> Result<Plan, LoadError> {
    let now = Instant::now();
    let mut refused = None;
    let mut candidates = Vec::new();
    for (e, entry) in snap.fleet.engines.iter_enumerated() {
        if !entry.http || entry.flavor != Flavor::Vllm || !snap.catalog.serves(e, &adapter.base) {
            continue;
        }
        let failure = failed
            .iter()
            .find(|f| f.adapter == adapter.name && f.server == entry.url);
        if let Some(f) = failure {
            refused = Some(f.error.clone());
            continue;
        }
        let held = listed_adapters(snap, e).count();
        let full = entry.max_adapters.is_some_and(|m| held >= m as usize);
        // A server none of whose ranks has fresh telemetry comes after every other.
        let kv = (snap.fleet.workers_of(e))
            .filter_map(|w| snap.ranks[w].telemetry.fresh(now, stale_after))
            .map(|l| l.kv_usage)
            .fold(f64::INFINITY, f64::min);
        candidates.push((full, kv, held, e));
    }
    candidates.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)));
    for &(full, _, _, e) in &candidates {
        let unload = match full {
            false => None,
            true => match victim(snap, e) {
                Some(v) => Some(v),
                None => continue,
            },
        };
        return Ok(Plan {
            engine: snap.fleet.engines[e].clone(),
            unload,
        });
    }
    Err(match (candidates.is_empty(), refused) {
        (true, Some(error)) => error,
        (true, None) => LoadError::NoServer {
            adapter: adapter.name.to_string(),
            base: adapter.base.to_string(),
        },
        (false, _) => LoadError::Full {
            adapter: adapter.name.to_string(),
            base: adapter.base.to_string(),
        },
    })
}

/// The adapter server `e` unloads to make room: a declared one (rankgate can load it again)
/// that none of this router's requests runs on its ranks, the one used least lately (never
/// used first).
fn victim(snap: &Snapshot, e: EngineIx) -> Option<String> {
    let members = &snap.fleet.engines[e].members;
    let declared = snap.catalog.routes();
    (listed_adapters(snap, e))
        .filter(|a| declared.declared(a).is_some())
        .filter_map(|a| {
            let uses = members.iter().filter_map(|m| m.adapters.last_use(a));
            let (running, last) =
                uses.fold((0, None), |(n, last), (r, at)| (n + r, last.max(Some(at))));
            (running == 0).then_some((last, a))
        })
        .min()
        .map(|(_, a)| a.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_engines_refusal_is_shown_in_its_own_words_and_bounded() {
        let vllm = r#"{"error":{"message":"Loading lora x failed: No adapter found for /nope","type":"NotFoundError","param":null,"code":404}}"#;
        assert_eq!(
            message(vllm),
            "Loading lora x failed: No adapter found for /nope"
        );
        assert_eq!(
            message("  Internal Server Error\n"),
            "Internal Server Error"
        );
        let long = "y".repeat(1000);
        assert_eq!(message(&long).len(), MAX_SHOWN + 3);
    }
}
