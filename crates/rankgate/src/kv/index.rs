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
//! It starts exact when it sees the engine's first message (sequence 0) or `AllBlocksCleared`;
//! joined later, or after a gap in the sequence, it is cleared and rebuilds: unavailable (picks
//! use rankgate's own record) until the rank has stored a whole KV capacity of blocks since,
//! after which what it lacks is at most blocks the engine kept unused all that time. A sequence
//! that goes back is a restarted engine (its cache is empty): cleared, exact again from the
//! message. A publisher that went away leaves the index unavailable but kept: its next message
//! shows whether anything was missed in between.

use std::collections::HashMap;
use std::sync::atomic::{
    AtomicU32, AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;

use super::event::{EngineHash, Event, Message};
use super::hash::chain;
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
const CAPACITY_SLACK_QUARTERS: usize = 5;

const EMPTY: u64 = 0;
const REMOVED: u64 = 1;

/// The table picks read.
struct Table {
    slots: Box<[AtomicU64]>,
    mask: usize,
}

impl Table {
    fn with_room_for(blocks: usize) -> Table {
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

    fn contains(&self, name: u64) -> bool {
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
    fn insert(&self, name: u64) -> bool {
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

    fn remove(&self, name: u64) {
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
    table: ArcSwap<Table>,
    /// Tokens per block while the index is available; 0 while it is not (picks read this
    /// first, one atomic load).
    block_size: AtomicU32,
    blocks: AtomicUsize,
    /// Slots the table and the writer's maps take, for `/workers` and memory.
    memory: AtomicUsize,
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

    fn set(&self, state: KvState) {
        let size = match &state {
            KvState::Available { block_size, .. } => *block_size,
            KvState::Unavailable { .. } | KvState::Off { .. } => 0,
        };
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = state;
        self.block_size.store(size, Release);
    }
}

/// What a std `HashMap` of `capacity` entries of type `T` allocates: hashbrown keeps its
/// buckets a power of two at most 7/8 full, each an entry and a control byte, plus a group of
/// control bytes.
fn map_bytes<T>(capacity: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = match capacity < 8 {
        true => (capacity + 1).next_power_of_two(),
        false => (capacity * 8 / 7).next_power_of_two(),
    };
    buckets * (std::mem::size_of::<T>() + 1) + 16
}

/// Where the writer is in the engine's sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Exact: every event since the cache was empty was applied.
    Exact,
    /// Cleared after joining late or a gap: this many blocks stored since.
    Rebuilding { stored: usize },
    /// Unavailable for a reason outside the sequence (publisher gone); `then` is what it was.
    Paused { then: Resume },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resume {
    Exact,
    Rebuilding { stored: usize },
}

/// The one writer of a rank's index.
pub struct Writer {
    index: Arc<RankIndex>,
    /// The engine's hash of each block it holds, to rankgate's name of it.
    names: HashMap<EngineHash, u64>,
    /// How many engine blocks carry each name (normally one).
    held: HashMap<u64, u32>,
    /// Removed entries in the table, which a rebuild drops.
    removed_slots: usize,
    /// Tokens per block, from the engine's stores.
    block_size: u32,
    capacity_blocks: usize,
    /// Blocks held at most: the capacity with its slack once known, else
    /// [`UNKNOWN_CAPACITY_MAX_BLOCKS`].
    max_blocks: usize,
    last_seq: Option<u64>,
    phase: Phase,
    why: String,
    /// `why` says no events will come (see [`Writer::off`]), until a message shows otherwise.
    off: bool,
}

impl Writer {
    /// The writer of `index`, which starts empty: what an earlier writer left there was
    /// followed by a feed that is gone.
    pub fn new(index: Arc<RankIndex>) -> Writer {
        index.table.store(Arc::new(Table::with_room_for(0)));
        index.set(KvState::Unavailable {
            reason: "no KV events yet".into(),
        });
        Writer {
            index,
            names: HashMap::new(),
            held: HashMap::new(),
            removed_slots: 0,
            block_size: 0,
            capacity_blocks: DEFAULT_CAPACITY_BLOCKS,
            max_blocks: UNKNOWN_CAPACITY_MAX_BLOCKS,
            last_seq: None,
            phase: Phase::Paused {
                then: Resume::Rebuilding { stored: 0 },
            },
            why: "no KV events yet".into(),
            off: false,
        }
    }

    pub fn index(&self) -> &Arc<RankIndex> {
        &self.index
    }

    /// The rank's KV capacity in tokens, when its telemetry reports it: bounds the index (with
    /// a quarter's slack) and says when a rebuild is complete.
    pub fn set_capacity_tokens(&mut self, tokens: u64) {
        if self.block_size > 0 {
            let blocks = usize::try_from(tokens / u64::from(self.block_size)).unwrap_or(MAX_BLOCKS);
            self.capacity_blocks = blocks.clamp(1, MAX_BLOCKS);
            self.max_blocks =
                (self.capacity_blocks.saturating_mul(CAPACITY_SLACK_QUARTERS) / 4).min(MAX_BLOCKS);
        }
    }

    /// Blocks the index may hold before it is dropped as claiming too much.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// The publisher went away (or fell silent while the rank was busy): unavailable until its
    /// next message shows what was missed.
    pub fn lost(&mut self, reason: &str) {
        if let Phase::Exact | Phase::Rebuilding { .. } = self.phase {
            let then = match self.phase {
                Phase::Rebuilding { stored } => Resume::Rebuilding { stored },
                _ => Resume::Exact,
            };
            self.phase = Phase::Paused { then };
        }
        self.why = reason.into();
        self.off = false;
        self.publish();
    }

    /// No events will come for this rank (its engine publishes none, or none is configured
    /// for it): as [`Writer::lost`], but the rank says `off` rather than waiting.
    pub fn off(&mut self, reason: &str) {
        self.lost(reason);
        self.off = true;
        self.publish();
    }

    /// A message the rank sent could not be decoded: its events are missing, so the index is
    /// dropped as after a gap.
    pub fn undecodable(&mut self, reason: &str) {
        self.reset(
            Phase::Rebuilding { stored: 0 },
            format!("undecodable message: {reason}"),
        );
    }

    /// Applies one message of this rank.
    pub fn apply(&mut self, msg: &Message) {
        self.index.counts.messages.fetch_add(1, Relaxed);
        self.off = false;
        let seq = msg.seq;
        match self.last_seq {
            // Followed the sequence without a gap: the index stands (if paused, resumes).
            Some(last) if seq == last.wrapping_add(1) => {
                if let Phase::Paused { then } = self.phase {
                    self.phase = match then {
                        Resume::Exact => Phase::Exact,
                        Resume::Rebuilding { stored } => Phase::Rebuilding { stored },
                    };
                }
            }
            Some(last) if seq <= last => {
                let phase = if seq == 0 {
                    Phase::Exact
                } else {
                    Phase::Rebuilding { stored: 0 }
                };
                self.reset(
                    phase,
                    format!(
                        "engine restarted (sequence went from {last} back to {seq}): rebuilding"
                    ),
                );
            }
            Some(last) => self.reset(
                Phase::Rebuilding { stored: 0 },
                format!(
                    "missed events {}..{} (sequence gap): rebuilding",
                    last + 1,
                    seq - 1
                ),
            ),
            None if seq == 0 => self.reset(Phase::Exact, String::new()),
            None => self.reset(
                Phase::Rebuilding { stored: 0 },
                format!("joined the engine's events at sequence {seq}: rebuilding"),
            ),
        }
        self.last_seq = Some(seq);
        for e in &msg.batch.events {
            self.event(e);
        }
        self.publish();
    }

    fn event(&mut self, e: &Event) {
        let index = self.index.clone();
        let counts = &index.counts;
        match e {
            Event::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                special,
            } => {
                if *special {
                    counts.skipped.fetch_add(hashes.len() as u64, Relaxed);
                    return;
                }
                if *block_size != self.block_size {
                    // A new block size (first store, or the engine restarted differently): what
                    // was indexed in the old one names nothing the prompts will ask for.
                    let phase = match self.phase {
                        Phase::Exact if self.names.is_empty() => Phase::Exact,
                        _ => Phase::Rebuilding { stored: 0 },
                    };
                    let keep = self.why.clone();
                    self.clear();
                    self.phase = phase;
                    self.why = keep;
                    self.block_size = *block_size;
                }
                let bs = *block_size as usize;
                let mut prev = match parent {
                    None => None,
                    Some(p) => match self.names.get(p) {
                        Some(&n) => Some(n),
                        // The parent was stored before the index knew it: this chain cannot be
                        // named from here.
                        None => {
                            counts.skipped.fetch_add(hashes.len() as u64, Relaxed);
                            return;
                        }
                    },
                };
                for (i, &h) in hashes.iter().enumerate() {
                    let Some(block) = tokens.get(i * bs..(i + 1) * bs) else {
                        counts.skipped.fetch_add((hashes.len() - i) as u64, Relaxed);
                        break;
                    };
                    let name = chain(prev, block);
                    prev = Some(name);
                    self.store(h, name);
                }
            }
            Event::Removed {
                hashes,
                other_medium,
            } => {
                if *other_medium {
                    return;
                }
                for h in hashes {
                    self.remove(*h);
                }
            }
            Event::AllCleared => self.reset(Phase::Exact, String::new()),
            Event::Other => {}
        }
    }

    fn store(&mut self, engine: EngineHash, name: u64) {
        if let Some(old) = self.names.insert(engine, name) {
            if old == name {
                return;
            }
            self.release(old);
        }
        let n = self.held.entry(name).or_insert(0);
        *n += 1;
        if *n == 1 && !self.index.table.load().insert(name) {
            self.rebuild();
        }
        self.index.counts.stored.fetch_add(1, Relaxed);
        if let Phase::Rebuilding { stored } = &mut self.phase {
            *stored += 1;
            if *stored >= self.capacity_blocks {
                self.phase = Phase::Exact;
                self.why.clear();
            }
        }
        if self.names.len() > self.max_blocks {
            // More than the rank can hold: events were missed (or someone else's were taken).
            self.reset(
                Phase::Rebuilding { stored: 0 },
                format!(
                    "the engine claims more than {} blocks, the index's bound (its KV capacity and a quarter): rebuilding",
                    self.max_blocks
                ),
            );
            return;
        }
        let t = self.index.table.load();
        if (self.held.len() + self.removed_slots) * 4 > t.slots.len() * 3 {
            drop(t);
            self.rebuild();
        }
    }

    fn remove(&mut self, engine: EngineHash) {
        if let Some(name) = self.names.remove(&engine) {
            self.release(name);
            self.index.counts.removed.fetch_add(1, Relaxed);
        }
    }

    fn release(&mut self, name: u64) {
        if let Some(n) = self.held.get_mut(&name) {
            *n -= 1;
            if *n == 0 {
                self.held.remove(&name);
                self.index.table.load().remove(name);
                self.removed_slots += 1;
            }
        }
    }

    /// A fresh table for what is held, with room for the rank's capacity.
    fn rebuild(&mut self) {
        let table = Table::with_room_for(
            self.held
                .len()
                .max(self.capacity_blocks.min(self.max_blocks)),
        );
        for &name in self.held.keys() {
            table.insert(name);
        }
        self.index.table.store(Arc::new(table));
        self.removed_slots = 0;
    }

    fn clear(&mut self) {
        self.names = HashMap::new();
        self.held = HashMap::new();
        self.index.table.store(Arc::new(Table::with_room_for(0)));
        self.removed_slots = 0;
    }

    fn reset(&mut self, phase: Phase, why: String) {
        if !self.names.is_empty() || phase != Phase::Exact {
            self.index.counts.resets.fetch_add(1, Relaxed);
        }
        self.clear();
        self.phase = phase;
        self.why = why;
        self.publish();
    }

    /// Tells picks what the index may be used for now.
    fn publish(&self) {
        let i = &self.index;
        let blocks = self.held.len();
        i.blocks.store(blocks, Relaxed);
        let memory = i.table.load().slots.len() * std::mem::size_of::<AtomicU64>()
            + map_bytes::<(EngineHash, u64)>(self.names.capacity())
            + map_bytes::<(u64, u32)>(self.held.capacity());
        i.memory.store(memory, Relaxed);
        let state = match self.phase {
            Phase::Exact if self.block_size > 0 || blocks == 0 => KvState::Available {
                blocks,
                block_size: self.block_size,
            },
            Phase::Rebuilding { stored } => KvState::Unavailable {
                reason: format!(
                    "{} ({stored} of {} blocks stored since)",
                    self.why, self.capacity_blocks
                ),
            },
            _ if self.off => KvState::Off {
                reason: self.why.clone(),
            },
            _ => KvState::Unavailable {
                reason: self.why.clone(),
            },
        };
        // Exact but no store seen yet: nothing is cached, and no block size to name prompts by.
        let state = match state {
            KvState::Available { block_size: 0, .. } => KvState::Unavailable {
                reason: "exact, but no block stored yet (block size unknown)".into(),
            },
            s => s,
        };
        i.set(state);
    }
}

#[cfg(test)]
mod tests {
    use super::super::event::Batch;
    use super::super::hash::block_hashes;
    use super::*;

    fn msg(seq: u64, events: Vec<Event>) -> Message {
        Message {
            topic: b"kv".to_vec(),
            seq,
            batch: Batch {
                ts: 0.0,
                events,
                dp_rank: Some(0),
            },
        }
    }

    fn stored(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Event {
        Event::Stored {
            hashes: hashes.to_vec(),
            parent,
            tokens: tokens.to_vec(),
            block_size: 2,
            special: false,
        }
    }

    fn writer() -> Writer {
        Writer::new(Arc::new(RankIndex::default()))
    }

    #[test]
    fn stores_chain_removals_follow_engine_hashes() {
        let mut w = writer();
        w.apply(&msg(0, vec![stored(&[100, 101], None, &[1, 2, 3, 4])]));
        w.apply(&msg(1, vec![stored(&[102], Some(101), &[5, 6])]));
        let i = w.index().clone();
        let names = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 2);
        assert_eq!(i.block_size(), Some(2));
        assert_eq!(i.matched_blocks(&names), 3);
        w.apply(&msg(
            2,
            vec![Event::Removed {
                hashes: vec![101],
                other_medium: false,
            }],
        ));
        assert_eq!(
            i.matched_blocks(&names),
            1,
            "a prefix stops at the removed block"
        );
        assert_eq!(
            i.state(),
            KvState::Available {
                blocks: 2,
                block_size: 2
            }
        );
    }

    #[test]
    fn a_gap_clears_and_rebuilds_a_restart_starts_exact() {
        let mut w = writer();
        w.set_capacity_tokens(6);
        w.apply(&msg(0, vec![stored(&[100], None, &[1, 2])]));
        w.set_capacity_tokens(6); // block size now known: 3 blocks
        w.apply(&msg(5, vec![stored(&[200], None, &[9, 9])]));
        let i = w.index().clone();
        assert_eq!(i.block_size(), None);
        assert!(
            matches!(i.state(), KvState::Unavailable { reason } if reason.contains("missed events 1..4"))
        );
        assert_eq!(i.matched_blocks(&block_hashes(&[1, 2], 2)), 0, "cleared");
        w.apply(&msg(6, vec![stored(&[201, 202], None, &[7, 7, 8, 8])]));
        assert_eq!(
            i.block_size(),
            Some(2),
            "a whole capacity stored since: rebuilt"
        );
        w.apply(&msg(0, vec![stored(&[300], None, &[4, 4])]));
        assert_eq!(
            i.block_size(),
            Some(2),
            "a restart: exact from its first message"
        );
        assert_eq!(i.matched_blocks(&block_hashes(&[9, 9], 2)), 0);
        assert_eq!(i.matched_blocks(&block_hashes(&[4, 4], 2)), 1);
    }

    #[test]
    fn a_lost_publisher_pauses_and_its_next_message_decides() {
        let mut w = writer();
        w.apply(&msg(0, vec![stored(&[100], None, &[1, 2])]));
        w.lost("publisher gone");
        let i = w.index().clone();
        assert_eq!(i.block_size(), None);
        w.apply(&msg(1, vec![]));
        assert_eq!(i.block_size(), Some(2), "nothing missed: kept");
        assert_eq!(i.matched_blocks(&block_hashes(&[1, 2], 2)), 1);
    }

    #[test]
    fn special_blocks_and_unknown_parents_are_left_out() {
        let mut w = writer();
        let mut lora = stored(&[100], None, &[1, 2]);
        if let Event::Stored { special, .. } = &mut lora {
            *special = true;
        }
        w.apply(&msg(0, vec![lora, stored(&[101], Some(99), &[3, 4])]));
        assert_eq!(w.index().counts.skipped.load(Relaxed), 2);
        assert_eq!(w.index().matched_blocks(&block_hashes(&[1, 2], 2)), 0);
    }

    #[test]
    fn an_endless_store_stream_stays_within_the_ranks_capacity() {
        let mut w = writer();
        w.apply(&msg(0, vec![stored(&[1], None, &[0, 0])]));
        // 1,000 tokens of KV in blocks of 2: 500 blocks, 625 with the slack.
        w.set_capacity_tokens(1000);
        assert_eq!(w.max_blocks(), 625);
        let mut peak = 0;
        let mut resets = 0;
        for seq in 1..=100u64 {
            // 100 new blocks a message, never removed: an engine (or an impostor) claiming
            // 10,000 blocks of a 500-block cache.
            let hashes: Vec<u64> = (seq * 1000..seq * 1000 + 100).collect();
            let tokens: Vec<u32> = (0..200).map(|t| (seq * 1000) as u32 + t).collect();
            w.apply(&msg(seq, vec![stored(&hashes, None, &tokens)]));
            peak = peak.max(w.index().blocks());
            resets = w.index().counts.resets.load(Relaxed);
        }
        assert!(peak <= 625, "held {peak} blocks, over the bound");
        assert!(
            resets >= 10,
            "dropped each time it passed the bound: {resets}"
        );
        assert!(
            w.index().memory_bytes() < 625 * 200,
            "{} bytes",
            w.index().memory_bytes()
        );
    }

    #[test]
    fn without_a_known_capacity_the_index_is_bounded_far_below_the_hard_cap() {
        let mut w = writer();
        let n = UNKNOWN_CAPACITY_MAX_BLOCKS + 1;
        let tokens: Vec<u32> = (0..n as u32 * 2).collect();
        let hashes: Vec<u64> = (10..10 + n as u64).collect();
        w.apply(&msg(0, vec![stored(&hashes, None, &tokens)]));
        assert!(w.index().blocks() <= UNKNOWN_CAPACITY_MAX_BLOCKS);
        assert!(
            matches!(w.index().state(), KvState::Unavailable { reason } if reason.contains("claims more than 262144 blocks")),
            "{:?}",
            w.index().state()
        );
        const { assert!(UNKNOWN_CAPACITY_MAX_BLOCKS * 16 <= MAX_BLOCKS) };
    }

    #[test]
    fn the_table_grows_past_its_first_size() {
        let mut w = writer();
        let tokens: Vec<u32> = (0..20_000).collect();
        let hashes: Vec<u64> = (1000..11_000).collect();
        w.apply(&msg(0, vec![stored(&hashes, None, &tokens)]));
        let names = block_hashes(&tokens, 2);
        assert_eq!(w.index().matched_blocks(&names), 10_000);
        assert!(w.index().memory_bytes() > 10_000 * 16);
    }
}
