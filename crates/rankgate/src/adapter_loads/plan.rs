//! Where a declared adapter is loaded, and what that server unloads first to stay within its
//! `max_adapters`. Read from one snapshot and the loads' own state (running, failed, done), under
//! the loads' lock, so two loads planned at once never count the same room twice.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;
use tokio::sync::watch;
use tokio::time::Instant;

use super::error::LoadError;
use crate::ix::EngineIx;
use crate::model_routes::Declared;
use crate::table::Snapshot;
use crate::worker::{EngineEntry, Flavor};

/// A load's answer once it is done: the server that serves the adapter.
pub(super) type Outcome = Option<Result<Arc<str>, LoadError>>;

/// What the loads know, under their lock: those running, failed and done lately.
#[derive(Default)]
pub(super) struct State {
    /// Loads running, by adapter.
    pub loading: HashMap<Arc<str>, Loading>,
    /// Loads that failed within [`super::FAILED_FOR`] (a server that failed is not planned for
    /// that adapter, so at most one per declared adapter and server).
    pub failed: Vec<Failure>,
    /// Loads done within [`super::FAILED_FOR`] (at most one per adapter at a time, each taking
    /// a load's time).
    pub loaded: Vec<Loaded>,
    /// Plans that found no server, within a second: one per declared adapter at most.
    pub refused: Vec<(Arc<str>, Instant, LoadError)>,
}

pub(super) struct Loading {
    pub id: u64,
    pub server: Arc<str>,
    /// The adapter it unloads first, if any: no other load picks it.
    pub victim: Option<String>,
    /// Its answer, for the requests that wait for it.
    pub answer: watch::Receiver<Outcome>,
}

pub(super) struct Failure {
    pub adapter: Arc<str>,
    /// The path that failed: a reload that changes it clears the failure.
    pub path: Arc<str>,
    pub server: Arc<str>,
    pub at: Instant,
    pub error: LoadError,
}

pub(super) struct Loaded {
    pub adapter: Arc<str>,
    pub server: Arc<str>,
    pub at: Instant,
}

/// Where a load goes: the server, and the adapter it unloads first to stay within its limit.
pub(super) struct Plan {
    pub engine: Arc<EngineEntry>,
    pub unload: Option<String>,
}

/// The adapters `e`'s model list has (entries naming a `parent`).
pub fn listed_adapters(snap: &Snapshot, e: EngineIx) -> impl Iterator<Item = &str> {
    (snap.catalog.of(e).into_iter().flatten())
        .filter(|m| m.entry.get("parent").is_some_and(Value::is_string))
        .map(|m| m.id.as_str())
}

/// The vLLM servers whose list has the base model and whose load of the adapter has not failed
/// lately, in this order: one that loaded it lately (its list may not show it yet: vLLM then
/// says it has it, at no cost; an unload forgets the load), then those below their `max_adapters` (loads under way
/// counted), then the one whose least loaded fresh rank has the most KV free, then the one
/// holding fewest adapters. A server at its limit takes it only by unloading an idle declared
/// adapter ([`victim`]).
pub(super) fn plan(
    snap: &Snapshot,
    adapter: &Declared,
    state: &State,
    stale_after: Duration,
) -> Result<Plan, LoadError> {
    let now = Instant::now();
    let mut refused = None;
    let mut candidates = Vec::new();
    for (e, entry) in snap.fleet.engines.iter_enumerated() {
        if !entry.http || entry.flavor != Flavor::Vllm || !snap.catalog.serves(e, &adapter.base) {
            continue;
        }
        let failure =
            (state.failed.iter()).find(|f| f.adapter == adapter.name && f.server == entry.url);
        if let Some(f) = failure {
            refused = Some(f.error.clone());
            continue;
        }
        let here = |server: &Arc<str>| *server == entry.url;
        let recent = (state.loaded.iter()).any(|l| here(&l.server) && l.adapter == adapter.name);
        let coming = state.loading.values().filter(|l| here(&l.server)).count();
        let held = listed_adapters(snap, e).count() + coming;
        let full = entry.max_adapters.is_some_and(|m| held >= m as usize);
        // A server none of whose ranks has fresh telemetry comes after every other.
        let kv = (snap.fleet.workers_of(e))
            .filter_map(|w| snap.ranks[w].telemetry.fresh(now, stale_after))
            .map(|l| l.kv_usage)
            .fold(f64::INFINITY, f64::min);
        candidates.push((!recent, full, kv, held, e));
    }
    candidates.sort_by(|a, b| {
        (a.0, a.1)
            .cmp(&(b.0, b.1))
            .then(a.2.total_cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    for &(_, full, _, _, e) in &candidates {
        let unload = match full {
            false => None,
            true => match victim(snap, e, state) {
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
/// that none of this router's requests runs on its ranks, its engine's gauge does not say runs,
/// and no other load is unloading, the one used least lately (its last request, or its load by
/// rankgate, whichever came later; never used first).
fn victim(snap: &Snapshot, e: EngineIx, state: &State) -> Option<String> {
    let entry = &snap.fleet.engines[e];
    let declared = snap.catalog.routes();
    let taken = |a: &str| {
        (state.loading.values()).any(|l| l.server == entry.url && l.victim.as_deref() == Some(a))
    };
    (listed_adapters(snap, e))
        .filter(|a| declared.declared(a).is_some() && !taken(a))
        .filter_map(|a| {
            let used = (entry.members.iter())
                .filter_map(|m| m.adapters.last_use(a).map(|(_, at)| at))
                .max();
            // Running on some rank: by this router's requests, or by the engine's gauge (which
            // covers the server as a whole, other clients' requests too).
            let busy =
                (entry.members.iter()).any(|m| m.adapters.state(a).0 || m.adapters.engine_runs(a));
            let loaded = (state.loaded.iter())
                .filter(|l| l.server == entry.url && &*l.adapter == a)
                .map(|l| l.at.into_std())
                .max();
            (!busy).then_some((used.max(loaded), a))
        })
        .min()
        .map(|(_, a)| a.to_string())
}
