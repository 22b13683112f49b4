//! A rank's prefix cache: the KV blocks of prompts, kept after their request ends until capacity
//! pressure evicts them, least recently used first, so a later prompt that starts the same way
//! skips the prefill of what is cached.
//!
//! Blocks are named from token ids. A tokenizer plugged into the engine
//! ([`super::SimConfig::tokenizer`]) supplies a request's ids; without one a token is
//! [`TOKEN_BYTES`] bytes of the prompt's text (the ratio the engine counts prompt tokens by), its
//! id those bytes read as a little-endian `u32` ([`text_token_ids`]): one-to-one, so two prompts
//! share leading tokens exactly when their texts share leading bytes, and a gRPC prompt sent as
//! token ids (whose ids the engine hashes as their little-endian bytes) gets back its own ids.
//! Tokens are grouped in blocks of [`BLOCK_TOKENS`]; only full blocks are cached, as in vLLM.
//! Block `i` is named by a chained hash (vLLM's block hash: the previous block's hash and this
//! block's tokens), so a block is only reused after the very same prefix, never because two
//! prompts happen to share a chunk in the middle.
//!
//! With KV events on ([`PrefixCache::record_events`]) the cache also writes down what it does,
//! as vLLM's block pool does: `BlockStored` for blocks entering it (chained to their parent, with
//! their token ids), `BlockRemoved` for evicted ones, `AllBlocksCleared` on a restart. Without
//! it nothing is recorded and nothing else changes.
//!
//! Accounting follows vLLM's block pool: a block referenced by running requests is in use and
//! counted once however many requests share it; a block no running request references is free
//! but still cached (evictable), and is NOT counted as KV usage, as vLLM's `kv_cache_usage_perc`
//! counts free cached blocks as free. The rank (`rank.rs`) owns the capacity: it evicts idle
//! blocks, least recently used first, when what is in use plus what is cached would pass it.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

use super::kv::event::KvEvent;

/// Tokens per KV block (vLLM's default block size on GPUs).
pub const BLOCK_TOKENS: u64 = 16;

/// Bytes of prompt text per simulated token.
pub const TOKEN_BYTES: usize = 4;

/// Token ids of a text as the sim counts tokens without a tokenizer: each [`TOKEN_BYTES`]-byte
/// group read as a little-endian `u32`; a trailing partial group is no token.
pub fn text_token_ids(text: &[u8]) -> Vec<u32> {
    text.chunks_exact(TOKEN_BYTES)
        .map(|g| u32::from_le_bytes([g[0], g[1], g[2], g[3]]))
        .collect()
}

/// A sequence's full KV blocks: their chained ids and the token ids they hold
/// (`tokens.len() == ids.len() * BLOCK_TOKENS`, or empty where only the ids are known).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Blocks {
    pub ids: Vec<u64>,
    pub tokens: Vec<u32>,
}

impl Blocks {
    /// The full blocks of a token sequence; a partial last block is left out.
    pub fn of_tokens(tokens: &[u32]) -> Blocks {
        let full = tokens.len() / BLOCK_TOKENS as usize;
        let tokens = &tokens[..full * BLOCK_TOKENS as usize];
        let mut prev = 0u64;
        let ids = tokens
            .chunks_exact(BLOCK_TOKENS as usize)
            .map(|chunk| {
                // `DefaultHasher::new()` has fixed keys: the same prompt gets the same ids in
                // every run of one build, which is all a simulation needs (a router hashes the
                // token ids with its own function anyway).
                let mut h = std::collections::hash_map::DefaultHasher::new();
                prev.hash(&mut h);
                chunk.hash(&mut h);
                prev = h.finish();
                prev
            })
            .collect();
        Blocks {
            ids,
            tokens: tokens.to_vec(),
        }
    }

    /// The full blocks of a prompt `tokens` long whose text is `text` (tokens as
    /// [`text_token_ids`] makes them). Bytes past `tokens` tokens (or a short text) end the chain
    /// early: only whole blocks of real text are named.
    pub fn of_text(text: &[u8], tokens: u64) -> Blocks {
        let bytes = usize::try_from(tokens)
            .unwrap_or(usize::MAX)
            .saturating_mul(TOKEN_BYTES)
            .min(text.len());
        Blocks::of_tokens(&text_token_ids(&text[..bytes]))
    }

    /// Block `i`'s tokens, empty when they are not known.
    fn tokens_of(&self, i: usize) -> &[u32] {
        let b = BLOCK_TOKENS as usize;
        self.tokens.get(i * b..(i + 1) * b).unwrap_or_default()
    }
}

/// The chained hashes of the full blocks of a prompt `tokens` long whose text is `text`
/// ([`Blocks::of_text`] without the tokens).
pub fn block_ids(text: &[u8], tokens: u64) -> Vec<u64> {
    Blocks::of_text(text, tokens).ids
}

#[derive(Debug, Clone, Copy)]
struct Block {
    /// Running requests holding the block.
    refs: u32,
    /// Its key in the idle list while `refs == 0`.
    tick: u64,
}

/// The cached blocks of one rank.
#[derive(Debug, Default)]
pub struct PrefixCache {
    blocks: HashMap<u64, Block>,
    /// Idle blocks by when they were last released: the first is the least recently used.
    idle: BTreeMap<u64, u64>,
    tick: u64,
    in_use: u64,
    /// Bumped by every restart; an admission remembers the epoch it took its blocks in.
    epoch: u64,
    /// Blocks held by requests admitted before a restart, by (epoch, id): no longer cached
    /// (nobody finds them, no event names them) but still in use until those requests end.
    detached: HashMap<(u64, u64), u32>,
    /// Events not yet handed to the publisher; `None` when events are off.
    journal: Option<Vec<KvEvent>>,
}

/// What taking a prompt's blocks would cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    /// Leading blocks already cached: their prefill is skipped.
    pub hit: usize,
    /// Blocks that are not cached and must be allocated.
    pub new: usize,
    /// Cached blocks no running request holds, which taking them turns into blocks in use.
    pub revived: usize,
}

impl PrefixCache {
    /// Blocks referenced by running requests.
    pub fn in_use(&self) -> u64 {
        self.in_use
    }

    /// Blocks cached but held by no running request (evictable).
    pub fn idle(&self) -> u64 {
        self.idle.len() as u64
    }

    /// The ids of the blocks cached (held or idle), sorted.
    pub fn cached_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.blocks.keys().copied().collect();
        ids.sort_unstable();
        ids
    }

    /// Starts recording KV events ([`PrefixCache::take_events`]).
    pub fn record_events(&mut self) {
        self.journal.get_or_insert_with(Vec::new);
    }

    /// The events recorded since the last call.
    pub fn take_events(&mut self) -> Vec<KvEvent> {
        self.journal
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// The current epoch (see [`PrefixCache::restart`]).
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Records a `BlockStored` for each run of blocks of `blocks` that are not cached yet, each
    /// chained to the block before it.
    fn record_stored(&mut self, blocks: &Blocks) {
        let Some(journal) = self.journal.as_mut() else {
            return;
        };
        let mut run: Option<(usize, usize)> = None;
        let flush = |run: (usize, usize), journal: &mut Vec<KvEvent>| {
            let (from, to) = run;
            let tokens: Vec<u32> = (from..to)
                .flat_map(|i| blocks.tokens_of(i))
                .copied()
                .collect();
            journal.push(KvEvent::stored(
                blocks.ids[from..to].to_vec(),
                from.checked_sub(1).map(|p| blocks.ids[p]),
                tokens,
                BLOCK_TOKENS as u32,
            ));
        };
        for (i, id) in blocks.ids.iter().enumerate() {
            if self.blocks.contains_key(id) {
                if let Some(r) = run.take() {
                    flush(r, journal);
                }
            } else {
                run = Some(run.map_or((i, i + 1), |(from, _)| (from, i + 1)));
            }
        }
        if let Some(r) = run {
            flush(r, journal);
        }
    }

    /// What taking `ids` would cost, without taking them.
    pub fn lookup(&self, ids: &[u64]) -> Lookup {
        let hit = ids
            .iter()
            .take_while(|id| self.blocks.contains_key(id))
            .count();
        let (mut new, mut revived) = (0, 0);
        for id in ids {
            match self.blocks.get(id) {
                None => new += 1,
                Some(b) if b.refs == 0 => revived += 1,
                Some(_) => {}
            }
        }
        Lookup { hit, new, revived }
    }

    /// Takes `ids` for a running request: cached ones are shared, the others allocated.
    pub fn acquire(&mut self, ids: &[u64]) {
        self.acquire_blocks(&Blocks {
            ids: ids.to_vec(),
            tokens: Vec::new(),
        });
    }

    /// [`PrefixCache::acquire`], recording the new blocks with their tokens.
    pub fn acquire_blocks(&mut self, blocks: &Blocks) {
        self.record_stored(blocks);
        for &id in &blocks.ids {
            let b = self.blocks.entry(id).or_insert(Block { refs: 0, tick: 0 });
            if b.refs == 0 {
                // Allocated now, or revived from the idle list.
                self.idle.remove(&b.tick);
                self.in_use += 1;
            }
            b.refs += 1;
        }
    }

    /// A request holding `ids` ended: blocks nobody else holds become idle. Released from the
    /// last block to the first, so a prompt's tail is evicted before its head (vLLM frees a
    /// request's blocks in reverse order for the same reason: the head is what others share).
    pub fn release(&mut self, ids: &[u64]) {
        for id in ids.iter().rev() {
            let Some(b) = self.blocks.get_mut(id) else {
                continue;
            };
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                self.tick += 1;
                b.tick = self.tick;
                self.idle.insert(self.tick, *id);
                self.in_use -= 1;
            }
        }
    }

    /// Caches `ids` as idle blocks (those not cached yet), the last one first so that it is the
    /// first evicted: blocks of a finished request's answer, which a later turn of the
    /// conversation starts with.
    pub fn insert_idle(&mut self, ids: &[u64]) {
        self.insert_idle_blocks(&Blocks {
            ids: ids.to_vec(),
            tokens: Vec::new(),
        });
    }

    /// [`PrefixCache::insert_idle`], recording the new blocks with their tokens.
    pub fn insert_idle_blocks(&mut self, blocks: &Blocks) {
        self.record_stored(blocks);
        for &id in blocks.ids.iter().rev() {
            if self.blocks.contains_key(&id) {
                continue;
            }
            self.tick += 1;
            self.blocks.insert(
                id,
                Block {
                    refs: 0,
                    tick: self.tick,
                },
            );
            self.idle.insert(self.tick, id);
        }
    }

    /// Evicts up to `n` idle blocks, least recently used first; returns how many went.
    pub fn evict(&mut self, n: u64) -> u64 {
        let mut gone = 0;
        while gone < n {
            let Some((_, id)) = self.idle.pop_first() else {
                break;
            };
            self.blocks.remove(&id);
            // One event per evicted block, as vLLM's block pool reports evictions.
            if let Some(j) = self.journal.as_mut() {
                j.push(KvEvent::removed(vec![id]));
            }
            gone += 1;
        }
        gone
    }

    /// The engine restarted: nothing is cached any more. Idle blocks are gone; blocks running
    /// requests hold stay in use (counted in [`PrefixCache::in_use`]) until those requests end
    /// ([`PrefixCache::release_detached`]), but are no longer found or shared. Records
    /// `AllBlocksCleared`, dropping events not yet taken (the old process never sent them).
    pub fn restart(&mut self) {
        let epoch = self.epoch;
        for (id, b) in self.blocks.drain() {
            if b.refs > 0 {
                *self.detached.entry((epoch, id)).or_insert(0) += b.refs;
            }
        }
        self.idle.clear();
        self.epoch += 1;
        if let Some(j) = self.journal.as_mut() {
            j.clear();
            j.push(KvEvent::AllBlocksCleared);
        }
    }

    /// vLLM's `reset_prefix_cache`: drops every cached block and records `AllBlocksCleared`,
    /// but only when no running request holds any (vLLM refuses otherwise); returns whether it
    /// did.
    pub fn reset(&mut self) -> bool {
        if self.in_use > 0 {
            return false;
        }
        self.blocks.clear();
        self.idle.clear();
        if let Some(j) = self.journal.as_mut() {
            j.push(KvEvent::AllBlocksCleared);
        }
        true
    }

    /// A request admitted in `epoch`, before a restart, ended: it lets go of its blocks.
    pub fn release_detached(&mut self, epoch: u64, ids: &[u64]) {
        for &id in ids {
            let key = (epoch, id);
            let Some(refs) = self.detached.get_mut(&key) else {
                continue;
            };
            *refs = refs.saturating_sub(1);
            if *refs == 0 {
                self.detached.remove(&key);
                self.in_use -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests;
