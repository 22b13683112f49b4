//! One rank's index of the KV blocks its engine holds, named by rankgate's own chained hash
//! ([`super::hash`]), built from the engine's events and read by picks without a lock.
//!
//! Two halves. [`RankIndex`] is what picks read: an open-addressing table of block names in
//! atomics (0 empty, 1 a removed entry), swapped whole through an `ArcSwap` when it is rebuilt,
//! and the rank's state. [`Writer`] is the one writer, owned by the task that reads the rank's
//! events: it follows the engine's own block hashes (a removal names only those; a store names
//! its parent by one) with a map from the engine's hash to rankgate's name, and counts names
//! held twice. Memory per cached block: 8 bytes a table slot, the table at most 3/4 full and
//! rebuilt half full (16-32), and the writer's two map entries, 17 bytes a bucket each, buckets
//! a power of two at most 7/8 full (39-78): 65 bytes at 100,000 blocks, 88 allocated (80-87
//! resident) at 1-4 M. [`RankIndex::memory_bytes`] says what one allocated; it is bounded by
//! the rank's KV capacity ([`Writer::set_capacity_tokens`]).
//!
//! State: the index is `Available` only while it can claim no block the engine does not hold.
//! It starts complete when it sees the engine's first message (sequence 0) or
//! `AllBlocksCleared`; joined later, or after a gap in the sequence that the engine's replay
//! socket did not fill ([`super::replay`]), it is cleared and holds what it sees from there: a
//! lower bound, used by picks at once, partial until the rank has stored a whole KV capacity of
//! blocks since, after which what it lacks is at most blocks the engine kept unused all that
//! time. A sequence
//! that goes back is a restarted engine (its cache is empty): cleared, exact again from the
//! message. A publisher that went away leaves the index unavailable but kept: its next message
//! shows whether anything was missed in between.

use std::sync::atomic::{
    AtomicU32, AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::Mutex;

use arc_swap::ArcSwap;

use super::state::KvState;

/// Blocks one rank's index holds at most, whatever the rank reports (4 M blocks of 16 tokens:
/// 64 M tokens of KV; about 330 MB of index).
pub const MAX_BLOCKS: usize = 4 << 20;
/// Blocks assumed until the rank's KV capacity is known.
pub const DEFAULT_CAPACITY_BLOCKS: usize = 1 << 16;
/// Blocks an index may hold while the rank's KV capacity is unknown (about 20 MB of index):
/// four times [`DEFAULT_CAPACITY_BLOCKS`], so that a big rank whose telemetry is late is not
/// reset, and 16 times less than [`MAX_BLOCKS`], so that a publisher cannot grow it further.
pub const UNKNOWN_CAPACITY_MAX_BLOCKS: usize = 1 << 18;
/// An index may hold its rank's KV capacity times this (in quarters: 1.25) before the engine
/// is taken to claim more than it can hold: capacity is reported in tokens and rounded, and a
/// block freed and stored again may briefly be counted twice.
pub(super) const CAPACITY_SLACK_QUARTERS: usize = 5;

const EMPTY: u64 = 0;
const REMOVED: u64 = 1;

/// The table picks read.
pub(super) struct Table {
    pub(super) slots: Box<[AtomicU64]>,
    mask: usize,
}

impl Table {
    pub(super) fn with_room_for(blocks: usize) -> Table {
        let n = (blocks.max(512) * 2).next_power_of_two();
        Table {
            slots: (0..n).map(|_| AtomicU64::new(EMPTY)).collect(),
            mask: n - 1,
        }
    }

    /// A name as stored: never one of the two markers.
    fn key(name: u64) -> u64 {
        if name <= REMOVED {
            name + 2
        } else {
            name
        }
    }

    pub(super) fn contains(&self, name: u64) -> bool {
        let key = Table::key(name);
        let mut i = key as usize & self.mask;
        for _ in 0..=self.mask {
            match self.slots[i].load(Acquire) {
                EMPTY => return false,
                k if k == key => return true,
                _ => i = (i + 1) & self.mask,
            }
        }
        false
    }

    /// Inserts (the writer only); false when the table has no free slot.
    pub(super) fn insert(&self, name: u64) -> bool {
        let key = Table::key(name);
        let mut i = key as usize & self.mask;
        for _ in 0..=self.mask {
            match self.slots[i].load(Relaxed) {
                EMPTY | REMOVED => {
                    self.slots[i].store(key, Release);
                    return true;
                }
                k if k == key => return true,
                _ => i = (i + 1) & self.mask,
            }
        }
        false
    }

    pub(super) fn remove(&self, name: u64) {
        let key = Table::key(name);
        let mut i = key as usize & self.mask;
        for _ in 0..=self.mask {
            match self.slots[i].load(Relaxed) {
                EMPTY => return,
                k if k == key => {
                    self.slots[i].store(REMOVED, Release);
                    return;
                }
                _ => i = (i + 1) & self.mask,
            }
        }
    }
}

/// One rank's index, shared by its writer and every pick.
pub struct RankIndex {
    pub(super) table: ArcSwap<Table>,
    /// Tokens per block while the index is available; 0 while it is not (picks read this
    /// first, one atomic load).
    block_size: AtomicU32,
    pub(super) blocks: AtomicUsize,
    /// Slots the table and the writer's maps take, for `/workers` and memory.
    pub(super) memory: AtomicUsize,
    state: Mutex<KvState>,
    /// Messages and events this index took, and those it could not use.
    pub counts: Counts,
}

/// What an index took in.
#[derive(Debug, Default)]
pub struct Counts {
    pub messages: AtomicU64,
    pub stored: AtomicU64,
    pub removed: AtomicU64,
    /// Blocks left out: a LoRA's, multimodal, another medium's, or whose parent is unknown.
    pub skipped: AtomicU64,
    /// Times the index was dropped (gap, restart, bad message, over its bound).
    pub resets: AtomicU64,
    /// Replays asked of the engine's replay socket, those that failed, and the messages
    /// applied from them.
    pub replays: AtomicU64,
    pub replay_failures: AtomicU64,
    pub replayed: AtomicU64,
}

impl std::fmt::Debug for RankIndex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RankIndex")
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

impl Default for RankIndex {
    fn default() -> Self {
        RankIndex::new("no KV events yet")
    }
}

impl RankIndex {
    /// An empty index, unavailable for `reason`.
    pub fn new(reason: &str) -> RankIndex {
        RankIndex {
            table: ArcSwap::from_pointee(Table::with_room_for(0)),
            block_size: AtomicU32::new(0),
            blocks: AtomicUsize::new(0),
            memory: AtomicUsize::new(0),
            state: Mutex::new(KvState::Unavailable {
                reason: reason.into(),
            }),
            counts: Counts::default(),
        }
    }

    /// Tokens per block while the index may be used; `None` while unavailable.
    #[inline]
    pub fn block_size(&self) -> Option<u32> {
        Some(self.block_size.load(Acquire)).filter(|b| *b > 0)
    }

    /// How many of `prompt`'s leading blocks (names by [`super::hash::block_hashes`]) the
    /// rank holds. No lock: one table load, then atomic reads.
    pub fn matched_blocks(&self, prompt: &[u64]) -> usize {
        let table = self.table.load();
        prompt.iter().take_while(|&&h| table.contains(h)).count()
    }

    /// Blocks it holds (while rebuilding too).
    pub fn blocks(&self) -> usize {
        self.blocks.load(Relaxed)
    }

    pub fn state(&self) -> KvState {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Bytes its table and its writer's maps take (approximately: their capacities).
    pub fn memory_bytes(&self) -> usize {
        self.memory.load(Relaxed)
    }

    pub(super) fn set(&self, state: KvState) {
        let size = match &state {
            KvState::Available { block_size, .. } => *block_size,
            KvState::Unavailable { .. } | KvState::Off { .. } => 0,
        };
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = state;
        self.block_size.store(size, Release);
    }
}
