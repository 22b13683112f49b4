//! Membership: which engines are in the fleet, from three sources combined: the config file's
//! `[[engines]]` (replaced as a whole on reload), the admin API (one engine at a time), and
//! `[[discovery]]` entries (each replacing the set it found before).
//!
//! A change is a message to the telemetry publisher, the snapshot's single writer: it plans the
//! new engine list here ([`plan`]), builds the next fleet aside (reusing the entries of engines
//! that did not change, counters and all), swaps it in with the telemetry, and starts or stops
//! pollers. A removed engine's ranks get no new request from the next pick on; requests already
//! on them hold their worker and finish.
//!
//! Each source owns its engines: a reload does not touch what the admin API added or discovery
//! found, and discovery never takes over an address the file or the admin API named.
//!
//! Two URLs can still name one server (`http://localhost:8000` and `http://127.0.0.1:8000`):
//! a change that brings engines is checked as the startup check does
//! ([`crate::config::address_warnings`]), with the names resolved by the caller of
//! [`Membership::apply`] (never by the publisher, which must not wait on DNS); what it finds
//! is logged and returned as the outcome's `warnings`.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::worker::{Engine, Origin};

/// A change to the fleet.
// One value per admin call or reload, moved a few times: boxing the engine would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Change {
    /// `origin`'s engines become exactly `engines` (reload: the file's; discovery: what it found).
    Replace {
        origin: Origin,
        engines: Vec<Engine>,
    },
    /// The admin API adds one engine.
    Add(Engine),
    /// The admin API removes the engine with this URL (identity: `url`, or `grpc_url` when the
    /// engine has only that).
    Remove { url: String },
    /// A reload: the file's engines (as `Replace` from the config) and its `[[routes]]`, in one
    /// snapshot, so no request sees the new routes with the old engines.
    Reload {
        engines: Vec<Engine>,
        routes: Arc<crate::model_routes::Routes>,
    },
}

/// What a change did, by engine URL.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize)]
pub struct Outcome {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Engines that stay with new keys or under another source (their ranks, counters and
    /// telemetry carry over).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub changed: Vec<String>,
    /// Engines a source names that an earlier source already names (kept as that one has them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
    /// Likely mistakes the change brings (a second name of a server already in the fleet, a
    /// host that does not resolve): applied all the same, as at startup.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
    /// The fleet's addresses, for the caller to check when the change brought engines.
    #[serde(skip)]
    check: Vec<Address>,
}

/// One engine of the fleet for the address check: its name in a warning, its `host:port`, and
/// whether the change brought it.
#[derive(Debug, Clone, PartialEq)]
struct Address {
    name: String,
    authority: Arc<str>,
    concerned: bool,
}

/// How long the address check may resolve names, all of them together: an admin call waits
/// for it. Names not resolved by then are left out of the check.
pub const RESOLVE_WITHIN: Duration = Duration::from_secs(2);

impl Outcome {
    /// Resolves the fleet's host names (each once, together within [`RESOLVE_WITHIN`]) and
    /// fills `warnings` with what the address check finds about the engines the change brought.
    async fn check_addresses(&mut self) {
        let check = std::mem::take(&mut self.check);
        if !check.iter().any(|a| a.concerned) {
            return;
        }
        let deadline = tokio::time::Instant::now() + RESOLVE_WITHIN;
        let mut known: BTreeMap<Arc<str>, Result<Vec<std::net::SocketAddr>, String>> =
            BTreeMap::new();
        let mut resolved = Vec::with_capacity(check.len());
        for a in check {
            let addrs = match known.get(&a.authority) {
                Some(r) => r.clone(),
                None => {
                    let r = match tokio::time::timeout_at(
                        deadline,
                        tokio::net::lookup_host(&*a.authority),
                    )
                    .await
                    {
                        Ok(Ok(addrs)) => Ok(addrs.collect()),
                        Ok(Err(e)) => Err(e.to_string()),
                        // Out of time: not checked rather than reported unresolvable.
                        Err(_) => Ok(Vec::new()),
                    };
                    known.insert(a.authority.clone(), r.clone());
                    r
                }
            };
            resolved.push(crate::config::Resolved {
                name: a.name,
                addrs,
                concerned: a.concerned,
            });
        }
        self.warnings = crate::config::address_warnings(&resolved);
    }
}

/// Why a change was refused; the fleet is then as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MembershipError {
    #[error("{url} is already in the fleet (from {origin})")]
    Exists { url: String, origin: Origin },
    #[error("no engine {url} in the fleet")]
    NotFound { url: String },
    #[error("{url} (ranks {ranks}) and {other} (ranks {other_ranks}) both claim the same rank(s) of {group}: give each member its own start_rank..start_rank+dp_size (or leave start_rank and dp_group out for an engine that is its own DP deployment)")]
    RankOverlap {
        url: String,
        ranks: String,
        other: String,
        other_ranks: String,
        group: String,
    },
    #[error("the fleet would have {workers} workers; rankgate routes at most {max} (config::MAX_WORKERS): split the fleet between rankgates")]
    TooManyWorkers { workers: usize, max: usize },
    #[error("rankgate is shutting down")]
    Stopped,
}

/// What each source says the fleet holds. The fleet is derived from it: the file's engines,
/// then the admin API's, then each discovery's, an address an earlier source names shadowing a
/// later source's entry for it (which comes back if the earlier source lets it go).
#[derive(Debug, Default, Clone)]
pub struct Sources {
    config: Vec<Engine>,
    admin: Vec<Engine>,
    /// Per `[[discovery]]` entry: the set it last reported.
    found: BTreeMap<usize, Vec<Engine>>,
}

/// An engine and the source it is in the fleet by.
pub type Listed = (Origin, Engine);

/// The engine list after a change, in fleet order, and what changed.
#[derive(Debug)]
pub struct Plan {
    pub sources: Sources,
    pub engines: Vec<(Origin, Engine)>,
    pub outcome: Outcome,
    /// A reload's `[[routes]]`, for the publisher to swap in with the engines.
    pub routes: Option<Arc<crate::model_routes::Routes>>,
}

impl Sources {
    /// The file's engines, nothing else yet.
    pub fn new(config: Vec<Engine>) -> Sources {
        Sources {
            config,
            ..Sources::default()
        }
    }

    /// The fleet's engines in fleet order, and the shadowed entries (as `url (from origin)`).
    pub fn engines(&self) -> (Vec<Listed>, Vec<(Origin, String)>) {
        let listed = (self.config.iter().map(|e| (Origin::Config, e)))
            .chain(self.admin.iter().map(|e| (Origin::Admin, e)))
            .chain(
                (self.found.iter())
                    .flat_map(|(i, set)| set.iter().map(move |e| (Origin::Discovery(*i), e))),
            );
        let mut out: Vec<(Origin, Engine)> = Vec::new();
        let mut shadowed = Vec::new();
        // Each URL and each gRPC address with the source that took it first: one look-up per
        // engine, so a large fleet is listed in one pass.
        let mut urls: HashMap<&str, Origin> = HashMap::new();
        let mut grpcs: HashMap<&str, Origin> = HashMap::new();
        for (origin, e) in listed {
            let by = (urls.get(&*e.url).copied())
                .or_else(|| e.grpc.as_deref().and_then(|g| grpcs.get(g).copied()));
            match by {
                Some(by) => shadowed.push((
                    origin,
                    format!("{} (already in the fleet from {by})", e.url),
                )),
                None => {
                    urls.insert(&e.url, origin);
                    if let Some(g) = e.grpc.as_deref() {
                        grpcs.insert(g, origin);
                    }
                    out.push((origin, e.clone()));
                }
            }
        }
        (out, shadowed)
    }
}

/// The sources and the engine list after `change` is applied to `sources`.
pub fn plan(sources: &Sources, change: Change) -> Result<Plan, MembershipError> {
    let (before, _) = sources.engines();
    let mut next = sources.clone();
    let mut routes = None;
    let origin = match change {
        Change::Add(engine) => {
            if let Some((origin, _)) = before.iter().find(|(_, o)| same_address(o, &engine)) {
                return Err(MembershipError::Exists {
                    url: engine.url.to_string(),
                    origin: *origin,
                });
            }
            next.admin.push(engine);
            Origin::Admin
        }
        Change::Remove { url } => {
            let url = url.trim_end_matches('/');
            let Some((origin, _)) = before.iter().find(|(_, e)| &*e.url == url) else {
                return Err(MembershipError::NotFound {
                    url: url.to_string(),
                });
            };
            // From every source, so no shadowed entry takes its place.
            let keep = |e: &Engine| &*e.url != url;
            next.config.retain(keep);
            next.admin.retain(keep);
            for set in next.found.values_mut() {
                set.retain(keep);
            }
            *origin
        }
        Change::Reload { engines, routes: r } => {
            next.config = engines;
            routes = Some(r);
            Origin::Config
        }
        Change::Replace { origin, engines } => {
            match origin {
                Origin::Config => next.config = engines,
                Origin::Admin => next.admin = engines,
                Origin::Discovery(i) => {
                    next.found.insert(i, engines);
                }
            }
            origin
        }
    };
    let (engines, shadowed) = next.engines();
    check_overlap(&engines)?;
    let workers: usize = engines.iter().map(|(_, e)| e.dp_size as usize).sum();
    if workers > crate::config::MAX_WORKERS {
        return Err(MembershipError::TooManyWorkers {
            workers,
            max: crate::config::MAX_WORKERS,
        });
    }
    let by_url = |list: &[(Origin, Engine)]| -> HashMap<Arc<str>, usize> {
        (list.iter().enumerate())
            .map(|(i, (_, e))| (e.url.clone(), i))
            .collect()
    };
    let (was_at, now_at) = (by_url(&before), by_url(&engines));
    let mut outcome = Outcome::default();
    for (o, e) in &engines {
        match was_at.get(&e.url).map(|&i| &before[i]) {
            None => outcome.added.push(e.url.to_string()),
            Some((was, cfg)) if was != o || cfg != e => outcome.changed.push(e.url.to_string()),
            Some(_) => {}
        }
    }
    for (_, e) in &before {
        if !now_at.contains_key(&e.url) {
            outcome.removed.push(e.url.to_string());
        }
    }
    outcome.skipped = (shadowed.into_iter())
        .filter(|(o, _)| *o == origin)
        .map(|(_, text)| text)
        .collect();
    let brought = |url: &str| (outcome.added.iter().chain(&outcome.changed)).any(|u| u == url);
    if engines.iter().any(|(_, e)| brought(&e.url)) {
        outcome.check = (engines.iter())
            .map(|(o, e)| Address {
                name: format!("{} (from {o})", e.url),
                authority: e.authority.clone(),
                concerned: brought(&e.url),
            })
            .collect();
    }
    Ok(Plan {
        sources: next,
        engines,
        outcome,
        routes,
    })
}

/// Sends changes to the publisher and waits for their outcome. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Membership {
    tx: mpsc::Sender<Request>,
}

/// A change and where its outcome goes.
pub type Request = (Change, oneshot::Sender<Result<Outcome, MembershipError>>);

impl Membership {
    /// A handle and the receiving end the publisher serves.
    pub fn channel() -> (Membership, mpsc::Receiver<Request>) {
        let (tx, rx) = mpsc::channel(64);
        (Membership { tx }, rx)
    }

    /// Applies `change`; the outcome's `warnings` (also logged) say what the address check
    /// found about the engines it brought.
    pub async fn apply(&self, change: Change) -> Result<Outcome, MembershipError> {
        let (done, outcome) = oneshot::channel();
        self.tx
            .send((change, done))
            .await
            .map_err(|_| MembershipError::Stopped)?;
        let mut outcome = outcome.await.map_err(|_| MembershipError::Stopped)??;
        outcome.check_addresses().await;
        for warning in &outcome.warnings {
            tracing::warn!(%warning, "fleet change applied with a warning");
        }
        Ok(outcome)
    }
}

/// Two entries for one server: the same identity, or the same gRPC address.
fn same_address(a: &Engine, b: &Engine) -> bool {
    a.url == b.url || (a.grpc.is_some() && a.grpc == b.grpc)
}

/// The members of one multi-server DP deployment must not claim the same rank; independent
/// engines and other groups are not compared (see [`crate::worker::Deployment`]).
fn check_overlap(engines: &[(Origin, Engine)]) -> Result<(), MembershipError> {
    let declared = |o: &Origin| matches!(o, Origin::Config | Origin::Admin);
    // Only members of a multi-server deployment can overlap (see `config::rules`).
    let members: Vec<&(Origin, Engine)> = (engines.iter())
        .filter(|(_, e)| matches!(e.deployment, crate::worker::Deployment::Member { .. }))
        .collect();
    for (j, (ob, b)) in members.iter().map(|m| (&m.0, &m.1)).enumerate() {
        for (oa, a) in members[..j].iter().map(|m| (&m.0, &m.1)) {
            if !(a.deployment).shares_ranks_with(&b.deployment, declared(oa) && declared(ob)) {
                continue;
            }
            let (ra, rb) = (a.claimed_ranks(), b.claimed_ranks());
            if ra.start.max(rb.start) < ra.end.min(rb.end) {
                let text = |r: std::ops::Range<u32>| format!("{}-{}", r.start, r.end - 1);
                return Err(MembershipError::RankOverlap {
                    url: b.url.to_string(),
                    ranks: text(rb),
                    other: a.url.to_string(),
                    other_ranks: text(ra),
                    group: crate::config::group_text(&b.deployment),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
