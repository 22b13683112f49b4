//! What one poll of one engine sends the publisher: its ranks' telemetry, and what it newly
//! learnt of the engine. A leaf: pollers build it and the publisher folds it in.

use crate::catalog::Model;
use crate::config::SourceKind;
use crate::table::RankTelemetry;
use crate::worker::{EngineId, Reported};

/// One engine's poll, projected onto its ranks.
pub struct Report {
    pub(super) engine: EngineId,
    pub(super) reachable: bool,
    pub(super) weight_at_poll: Vec<u64>,
    pub(super) ranks: Vec<RankTelemetry>,
    pub(super) source: Option<SourceKind>,
    /// The engine's models, when this poll read them.
    pub(super) models: Option<Vec<Model>>,
    /// The newest round of model-list rechecks ([`crate::recheck`]) the engine has answered.
    pub(super) models_round: u64,
    /// What the engine newly said of its flavor and size: its entry is built anew with it.
    pub(super) reported: Option<Reported>,
}
