//! What a rank's KV-event index can say of itself, as `/workers` shows it (`kv_index.state`):
//! used by picks, not used for now and why, or off (no events will come: the operator or the
//! engine turned them off), so that a fleet without KV events never reads as one waiting for them.

/// An index that holds what it saw from a sequence number on, and why it saw no more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partial {
    /// The first sequence number whose events it holds.
    pub since: u64,
    /// Why it lacks what came before (joined late, a gap the replay did not cover, ...).
    pub why: String,
}

/// A rank's index state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvState {
    /// Used by picks: the blocks it holds and their size in tokens. `partial` when it joined
    /// late or lost events: a lower bound (every block it names is held; some held blocks may
    /// be missing); `None`: complete.
    Available {
        blocks: usize,
        block_size: u32,
        partial: Option<Partial>,
    },
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

    /// `complete`, `partial since <seq>`, or `None` while picks do not use the index.
    pub fn coverage(&self) -> Option<String> {
        match self {
            KvState::Available { partial: None, .. } => Some("complete".into()),
            KvState::Available {
                partial: Some(p), ..
            } => Some(format!("partial since {}: {}", p.since, p.why)),
            _ => None,
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
