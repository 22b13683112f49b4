//! The writer of one rank's KV index ([`super::index::RankIndex`]): the one task that reads
//! the rank's events follows the engine's own block hashes (a removal names only those; a store
//! names its parent by one) with a map from the engine's hash to rankgate's name, counts names
//! held twice, and keeps the index's state true (see [`super::index`] for the rules).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::event::{EngineHash, Event, Message};
use super::hash::chain;
use super::index::{
    RankIndex, Table, CAPACITY_SLACK_QUARTERS, DEFAULT_CAPACITY_BLOCKS, MAX_BLOCKS,
    UNKNOWN_CAPACITY_MAX_BLOCKS,
};
use super::state::{KvState, Partial};

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
    /// Cleared after joining late or a gap: a lower bound holding what it saw from sequence
    /// `since` on; `stored` blocks stored since (a whole capacity of them makes it complete).
    Partial { since: u64, stored: usize },
    /// Unavailable for a reason outside the sequence (publisher gone); `then` is what it was.
    Paused { then: Resume },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Resume {
    Exact,
    Partial { since: u64, stored: usize },
}

/// After a replay failed, gaps within this long are not asked again: an engine whose replay
/// socket is down or hostile costs one bounded attempt per this, not one per gap.
const REPLAY_BACKOFF: Duration = Duration::from_secs(10);

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
    /// Why the index is partial (kept while a pause overwrites `why`).
    partial_why: String,
    /// The engine's replay socket for this rank (`host:port`), if it has one.
    replay: Option<String>,
    /// When a replay last failed (see [`REPLAY_BACKOFF`]).
    replay_failed: Option<Instant>,
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
                then: Resume::Partial {
                    since: 0,
                    stored: 0,
                },
            },
            why: "no KV events yet".into(),
            partial_why: String::new(),
            replay: None,
            replay_failed: None,
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

    /// The engine's replay socket for this rank (`host:port`), asked after a gap.
    pub fn set_replay(&mut self, addr: Option<String>) {
        self.replay = addr;
    }

    /// Where to ask, and from which sequence number, for what is missing before message `seq`
    /// (a gap, or joining an engine already publishing: from 0, as far back as its buffer
    /// goes); `None` when nothing is missing, there is no replay socket, or one failed within
    /// [`REPLAY_BACKOFF`].
    pub fn replay_for(&self, seq: u64) -> Option<(String, u64)> {
        let from = match self.last_seq {
            None if seq > 0 => 0,
            Some(last) if seq > last.wrapping_add(1) && seq > last => last + 1,
            _ => return None,
        };
        if self
            .replay_failed
            .is_some_and(|t| t.elapsed() < REPLAY_BACKOFF)
        {
            return None;
        }
        Some((self.replay.clone()?, from))
    }

    /// A replay ended: `Err` says why it failed (what it applied stays applied).
    pub fn replay_done(&mut self, outcome: Result<u64, String>) {
        let c = &self.index.counts;
        c.replays.fetch_add(1, Relaxed);
        match outcome {
            Ok(n) => {
                c.replayed.fetch_add(n, Relaxed);
                self.replay_failed = None;
            }
            Err(why) => {
                c.replay_failures.fetch_add(1, Relaxed);
                self.replay_failed = Some(Instant::now());
                tracing::debug!("KV-event replay failed: {why}");
                if let Phase::Partial { .. } | Phase::Paused { .. } = self.phase {
                    // The latest failure only: an engine failing every replay must not grow
                    // this string without bound.
                    let cause = self.partial_why.split("; replay failed: ").next();
                    self.partial_why = format!("{}; replay failed: {why}", cause.unwrap_or(""));
                }
            }
        }
    }

    /// Blocks the index may hold before it is dropped as claiming too much.
    pub fn max_blocks(&self) -> usize {
        self.max_blocks
    }

    /// The publisher went away (or fell silent while the rank was busy): unavailable until its
    /// next message shows what was missed.
    pub fn lost(&mut self, reason: &str) {
        if let Phase::Exact | Phase::Partial { .. } = self.phase {
            let then = match self.phase {
                Phase::Partial { since, stored } => Resume::Partial { since, stored },
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
    /// dropped as after a gap, and holds what follows (taken to be the next number).
    pub fn undecodable(&mut self, reason: &str) {
        let next = self.last_seq.map_or(0, |l| l.wrapping_add(1));
        self.last_seq = Some(next);
        self.reset(
            partial(next.wrapping_add(1)),
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
                        Resume::Partial { since, stored } => Phase::Partial { since, stored },
                    };
                }
            }
            Some(last) if seq <= last => {
                let phase = if seq == 0 { Phase::Exact } else { partial(seq) };
                self.reset(
                    phase,
                    format!("engine restarted (sequence went from {last} back to {seq})"),
                );
            }
            Some(last) => self.reset(
                partial(seq),
                format!("missed events {}..{} (sequence gap)", last + 1, seq - 1),
            ),
            None if seq == 0 => self.reset(Phase::Exact, String::new()),
            None => self.reset(
                partial(seq),
                format!("joined the engine's events at sequence {seq}"),
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
                        _ => partial(self.last_seq.unwrap_or(0)),
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
        if let Phase::Partial { stored, .. } = &mut self.phase {
            *stored += 1;
            if *stored >= self.capacity_blocks {
                self.phase = Phase::Exact;
                self.why.clear();
                self.partial_why.clear();
            }
        }
        if self.names.len() > self.max_blocks {
            // More than the rank can hold: events were missed (or someone else's were taken).
            self.reset(
                partial(self.last_seq.unwrap_or(0)),
                format!(
                    "the engine claims more than {} blocks, the index's bound (its KV capacity and a quarter)",
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
        if let Phase::Partial { .. } = phase {
            self.partial_why = why.clone();
        }
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
                partial: None,
            },
            // A lower bound: every block it names was stored and not removed since `since`.
            Phase::Partial { since, stored } => KvState::Available {
                blocks,
                block_size: self.block_size,
                partial: Some(Partial {
                    since,
                    why: format!(
                        "{} ({stored} of {} blocks stored since; complete after a whole capacity)",
                        self.partial_why, self.capacity_blocks
                    ),
                }),
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
                reason: "no block stored yet (block size unknown)".into(),
            },
            s => s,
        };
        i.set(state);
    }
}

/// A lower bound from sequence `since`, nothing stored since yet.
fn partial(since: u64) -> Phase {
    Phase::Partial { since, stored: 0 }
}

#[cfg(test)]
mod tests;
