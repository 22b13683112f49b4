//! Discovery: engines found at runtime by `[[discovery]]` entries (DNS names, Kubernetes pods).
//!
//! Each entry runs one task that reports, every time what it sees changes, the WHOLE set of
//! engines it finds now (a `Vec<Engine>` on its channel). Membership replaces that entry's
//! engines with the set: what appeared joins, what vanished leaves (its streams finish). A
//! failure to look (DNS server down, API server unreachable) reports nothing, so the fleet keeps
//! what was last found instead of emptying on a blip.

use tokio::sync::mpsc;

#[cfg(feature = "kubernetes")]
pub mod kubernetes;

use crate::config::Discovery;
use crate::worker::Engine;

/// The channel a discovery task reports its sets on.
pub type Found = mpsc::Sender<Vec<Engine>>;

/// Why a discovery entry cannot run (its failure is logged; the rest of the fleet serves).
#[derive(Debug, thiserror::Error)]
#[error("{at}: {message}")]
pub struct DiscoveryError {
    pub at: String,
    pub message: String,
}

impl DiscoveryError {
    pub fn new(d: &Discovery, message: impl Into<String>) -> DiscoveryError {
        DiscoveryError {
            at: d.at.clone(),
            message: message.into(),
        }
    }
}
