//! Discovery: engines found at runtime by `[[discovery]]` entries (DNS names, Kubernetes pods).
//!
//! Each entry runs one task that reports, every time what it sees changes, the WHOLE set of
//! engines it finds now (a `Vec<Engine>` on its channel). Membership replaces that entry's
//! engines with the set: what appeared joins, what vanished leaves (its streams finish). A
//! failure to look (DNS server down, API server unreachable) reports nothing, so the fleet keeps
//! what was last found instead of emptying on a blip.

pub mod dns;
mod found;
#[cfg(feature = "kubernetes")]
pub mod kubernetes;

use tokio::sync::mpsc;
use tokio::task::JoinHandle;

pub use found::{DiscoveryError, Found};

use crate::config::{Discovery, DiscoverySource};
use crate::http::Shutdown;
use crate::membership::{Change, Membership};
use crate::worker::{Engine, Origin};

/// Starts one task per entry, and one that hands each set it reports to membership as the
/// entry's engines (`Origin::Discovery(i)`). They stop on `shutdown`.
pub fn spawn(
    entries: &[Discovery],
    membership: &Membership,
    shutdown: &Shutdown,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    for (i, d) in entries.iter().enumerate() {
        let (tx, mut rx) = mpsc::channel::<Vec<Engine>>(4);
        let at = d.at.clone();
        tasks.push(match &d.source {
            DiscoverySource::Dns { .. } => tokio::spawn(dns::run(d.clone(), tx, shutdown.clone())),
            #[cfg(feature = "kubernetes")]
            DiscoverySource::Kubernetes { .. } => {
                tokio::spawn(kubernetes::run(d.clone(), tx, shutdown.clone()))
            }
            // Refused at config load in a build without the feature.
            #[cfg(not(feature = "kubernetes"))]
            DiscoverySource::Kubernetes { .. } => {
                tracing::error!(discovery = %at, "this build has no Kubernetes discovery");
                continue;
            }
        });
        let membership = membership.clone();
        // Ends when the discovery task does (it drops the sender).
        tasks.push(tokio::spawn(async move {
            while let Some(engines) = rx.recv().await {
                let found = engines.len();
                let change = Change::Replace {
                    origin: Origin::Discovery(i),
                    engines,
                };
                match membership.apply(change).await {
                    Ok(o) => tracing::info!(
                        discovery = %at, found, added = ?o.added, removed = ?o.removed,
                        skipped = ?o.skipped, "discovered engines applied"
                    ),
                    Err(error) => {
                        tracing::warn!(discovery = %at, %error, "discovered engines not applied")
                    }
                }
            }
        }));
    }
    tasks
}
