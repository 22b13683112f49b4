//! What every discovery task shares: the channel it reports its sets on, and the error that
//! stops an entry from running. Kept apart from `discovery`'s `spawn`, which calls into the
//! tasks, so the tasks never import their parent.

use tokio::sync::mpsc;

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
