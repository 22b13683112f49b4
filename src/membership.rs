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

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::worker::{Engine, EngineEntry, Flavor, Origin};

/// A change to the fleet.
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
}

/// What a change did.
#[derive(Debug, Default, Clone, PartialEq, serde::Serialize)]
pub struct Outcome {
    pub added: Vec<String>,
    pub removed: Vec<String>,
    /// Engines a discovery found but that another source already names (kept as that source
    /// has them).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
}

/// Why a change was refused; the fleet is then as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MembershipError {
    #[error("{url} is already in the fleet (from {origin})")]
    Exists { url: String, origin: Origin },
    #[error("no engine {url} in the fleet")]
    NotFound { url: String },
    #[error("{url} (ranks {ranks}) and {other} (ranks {other_ranks}) both claim the same global rank(s): give each engine its own start_rank..start_rank+dp_size")]
    RankOverlap {
        url: String,
        ranks: String,
        other: String,
        other_ranks: String,
    },
    #[error("rankgate is shutting down")]
    Stopped,
}

/// The engine list after a change, in fleet order, and what changed.
#[derive(Debug)]
pub struct Plan {
    pub engines: Vec<(Origin, Engine)>,
    pub outcome: Outcome,
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

    pub async fn apply(&self, change: Change) -> Result<Outcome, MembershipError> {
        let (done, outcome) = oneshot::channel();
        self.tx
            .send((change, done))
            .await
            .map_err(|_| MembershipError::Stopped)?;
        outcome.await.map_err(|_| MembershipError::Stopped)?
    }
}

/// The engine list after `change` is applied to `current` (the fleet's engines, in order).
pub fn plan(current: &[Arc<EngineEntry>], change: Change) -> Result<Plan, MembershipError> {
    let listed = |e: &Arc<EngineEntry>| (e.origin, e.cfg.clone());
    let mut outcome = Outcome::default();
    let mut engines: Vec<(Origin, Engine)> = match change {
        Change::Add(engine) => {
            if let Some(o) = current.iter().find(|o| same_address(&o.cfg, &engine)) {
                return Err(MembershipError::Exists {
                    url: engine.url.to_string(),
                    origin: o.origin,
                });
            }
            outcome.added.push(engine.url.to_string());
            current
                .iter()
                .map(listed)
                .chain([(Origin::Admin, engine)])
                .collect()
        }
        Change::Remove { url } => {
            let url = url.trim_end_matches('/');
            let Some(i) = current.iter().position(|e| &*e.url == url) else {
                return Err(MembershipError::NotFound {
                    url: url.to_string(),
                });
            };
            outcome.removed.push(url.to_string());
            (current.iter().enumerate())
                .filter(|(j, _)| *j != i)
                .map(|(_, e)| listed(e))
                .collect()
        }
        Change::Replace {
            origin,
            engines: new,
        } => {
            let mut kept: Vec<(Origin, Engine)> = Vec::new();
            for e in current.iter().filter(|e| e.origin != origin) {
                // The file is the operator's word: an address it names leaves the other
                // sources (and comes back to them if the file drops it and they name it again).
                if origin == Origin::Config && new.iter().any(|n| same_address(n, &e.cfg)) {
                    continue;
                }
                kept.push(listed(e));
            }
            let mut mine: Vec<(Origin, Engine)> = Vec::new();
            for n in new {
                if let Some((o, _)) = (kept.iter().chain(&mine)).find(|(_, k)| same_address(k, &n))
                {
                    outcome
                        .skipped
                        .push(format!("{} (already in the fleet from {o})", n.url));
                    continue;
                }
                mine.push((origin, n));
            }
            let at = kept
                .iter()
                .position(|(o, _)| rank_of(*o) > rank_of(origin))
                .unwrap_or(kept.len());
            kept.splice(at..at, mine);
            kept
        }
    };
    // Same order whatever the history: the file, the admin API, then discovery.
    engines.sort_by_key(|(o, _)| rank_of(*o));
    for (o, e) in &engines {
        let was = current.iter().find(|c| c.origin == *o && c.cfg == *e);
        if was.is_none() && !outcome.added.iter().any(|u| **u == *e.url) {
            outcome.added.push(e.url.to_string());
        }
    }
    for c in current {
        let still = engines.iter().any(|(o, e)| c.origin == *o && c.cfg == *e);
        if !still && !outcome.removed.iter().any(|u| **u == *c.url) {
            outcome.removed.push(c.url.to_string());
        }
    }
    check_overlap(&engines)?;
    Ok(Plan { engines, outcome })
}

/// Sources in fleet order.
fn rank_of(o: Origin) -> usize {
    match o {
        Origin::Config => 0,
        Origin::Admin => 1,
        Origin::Discovery(i) => 2 + i,
    }
}

/// Two entries for one server: the same identity, or the same gRPC address.
fn same_address(a: &Engine, b: &Engine) -> bool {
    a.url == b.url || (a.grpc.is_some() && a.grpc == b.grpc)
}

/// Engines the operator numbered (the file and the admin API) must not claim the same global
/// rank. Discovered engines are separate deployments, each numbering its own ranks.
fn check_overlap(engines: &[(Origin, Engine)]) -> Result<(), MembershipError> {
    let numbered: Vec<&Engine> = engines
        .iter()
        .filter(|(o, e)| matches!(o, Origin::Config | Origin::Admin) && e.flavor != Flavor::Gateway)
        .map(|(_, e)| e)
        .collect();
    for (j, b) in numbered.iter().enumerate() {
        for a in &numbered[..j] {
            let (ra, rb) = (a.ranks(), b.ranks());
            if ra.start.max(rb.start) < ra.end.min(rb.end) {
                let text = |r: std::ops::Range<u32>| format!("{}-{}", r.start, r.end - 1);
                return Err(MembershipError::RankOverlap {
                    url: b.url.to_string(),
                    ranks: text(rb),
                    other: a.url.to_string(),
                    other_ranks: text(ra),
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proxy::send::ConnLimits;
    use crate::worker::test_engine;

    fn entries(list: &[(Origin, Engine)]) -> Vec<Arc<EngineEntry>> {
        list.iter()
            .map(|(o, e)| EngineEntry::new(e.clone(), *o, ConnLimits::default()))
            .collect()
    }

    fn urls(p: &Plan) -> Vec<(Origin, String)> {
        p.engines
            .iter()
            .map(|(o, e)| (*o, e.url.to_string()))
            .collect()
    }

    #[test]
    fn sources_keep_their_own_engines_in_fleet_order() {
        let cur = entries(&[
            (Origin::Config, test_engine("http://a:1", 2, 0)),
            (Origin::Admin, test_engine("http://b:1", 2, 2)),
            (Origin::Discovery(0), test_engine("http://d:1", 2, 0)),
        ]);
        // A reload that drops a and adds c leaves b and d alone.
        let p = plan(
            &cur,
            Change::Replace {
                origin: Origin::Config,
                engines: vec![test_engine("http://c:1", 2, 4)],
            },
        )
        .unwrap();
        assert_eq!(
            urls(&p),
            [
                (Origin::Config, "http://c:1".into()),
                (Origin::Admin, "http://b:1".into()),
                (Origin::Discovery(0), "http://d:1".into())
            ]
        );
        assert_eq!(p.outcome.added, ["http://c:1"]);
        assert_eq!(p.outcome.removed, ["http://a:1"]);
        // Discovery may not take over an address the file names; its own others stay.
        let p = plan(
            &cur,
            Change::Replace {
                origin: Origin::Discovery(0),
                engines: vec![
                    test_engine("http://a:1", 2, 0),
                    test_engine("http://e:1", 2, 0),
                ],
            },
        )
        .unwrap();
        assert_eq!(p.outcome.added, ["http://e:1"]);
        assert_eq!(p.outcome.removed, ["http://d:1"]);
        assert_eq!(p.outcome.skipped.len(), 1);
        // The file does take over an address the admin API added.
        let p = plan(
            &cur,
            Change::Replace {
                origin: Origin::Config,
                engines: vec![
                    test_engine("http://a:1", 2, 0),
                    test_engine("http://b:1", 2, 2),
                ],
            },
        )
        .unwrap();
        assert_eq!(urls(&p)[1], (Origin::Config, "http://b:1".into()));
        assert_eq!(p.engines.len(), 3);
    }

    #[test]
    fn admin_changes_are_checked() {
        let cur = entries(&[
            (Origin::Config, test_engine("http://a:1", 2, 0)),
            (Origin::Discovery(0), test_engine("http://d:1", 2, 0)),
        ]);
        assert!(matches!(
            plan(&cur, Change::Add(test_engine("http://a:1", 1, 9))),
            Err(MembershipError::Exists {
                origin: Origin::Config,
                ..
            })
        ));
        let err = plan(&cur, Change::Add(test_engine("http://b:1", 2, 1))).unwrap_err();
        assert!(
            err.to_string()
                .contains("http://b:1 (ranks 1-2) and http://a:1 (ranks 0-1)"),
            "{err}"
        );
        // Discovered engines number their own ranks: no overlap with them.
        let p = plan(&cur, Change::Add(test_engine("http://b:1", 2, 2))).unwrap();
        assert_eq!(urls(&p)[1], (Origin::Admin, "http://b:1".into()));
        assert!(matches!(
            plan(
                &cur,
                Change::Remove {
                    url: "http://x:1".into()
                }
            ),
            Err(MembershipError::NotFound { .. })
        ));
        let p = plan(
            &cur,
            Change::Remove {
                url: "http://d:1/".into(),
            },
        )
        .unwrap();
        assert_eq!(p.outcome.removed, ["http://d:1"]);
        assert_eq!(p.engines.len(), 1);
    }
}
