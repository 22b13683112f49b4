//! What a rank's KV-event index can say of itself, as `/workers` shows it (`kv_index.state`):
//! used by picks, not used for now and why, or off (no events will come: the operator or the
//! engine turned them off), so that a fleet without KV events never reads as one waiting for them.

/// A rank's index state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvState {
    /// Exact (or rebuilt): the blocks it holds and their size in tokens.
    Available { blocks: usize, block_size: u32 },
    /// Not used by picks for now, and why (events expected: not arrived, lost, rebuilding).
    Unavailable { reason: String },
    /// No events are expected for this rank, and why (its engine publishes none, or none is
    /// configured for it): not a wait.
    Off { reason: String },
}

impl KvState {
    /// `available`, `unavailable` or `off`, as `/workers` names the state.
    pub fn name(&self) -> &'static str {
        match self {
            KvState::Available { .. } => "available",
            KvState::Unavailable { .. } => "unavailable",
            KvState::Off { .. } => "off",
        }
    }

    /// Why picks do not use the index; `None` while they do.
    pub fn reason(&self) -> Option<&str> {
        match self {
            KvState::Available { .. } => None,
            KvState::Unavailable { reason } | KvState::Off { reason } => Some(reason),
        }
    }
}
