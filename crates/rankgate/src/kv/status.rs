//! A rank's `kv_index` as `/workers` shows it: its state (see [`super::state`]), its content
//! and what it took in.

use serde_json::{json, Value};

use super::index::RankIndex;
use super::state::KvState;

/// A rank's `kv_index` on `/workers`: whether picks use it, why not, what it holds and what it
/// took in. `reading` is `routing.kv_events`: with it off no rank's events are read, so every
/// index says `off`, never a wait for events that will not come.
pub fn shown(i: &RankIndex, reading: bool) -> Value {
    use std::sync::atomic::Ordering::Relaxed;
    let state = match reading {
        true => i.state(),
        false => KvState::Off {
            reason: "routing.kv_events is off: rankgate reads no engine's KV events".into(),
        },
    };
    let block_size = match &state {
        KvState::Available { block_size, .. } => Some(*block_size),
        _ => None,
    };
    let c = &i.counts;
    json!({
        "state": state.name(),
        "reason": state.reason(),
        "coverage": state.coverage(),
        "blocks": i.blocks(),
        "block_size": block_size,
        "memory_bytes": i.memory_bytes(),
        "messages": c.messages.load(Relaxed),
        "stored": c.stored.load(Relaxed),
        "removed": c.removed.load(Relaxed),
        "skipped": c.skipped.load(Relaxed),
        "resets": c.resets.load(Relaxed),
        "replays": c.replays.load(Relaxed),
        "replay_failures": c.replay_failures.load(Relaxed),
        "replayed": c.replayed.load(Relaxed),
    })
}
