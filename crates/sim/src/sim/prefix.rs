//! A rank's prefix cache: the KV blocks of prompts, kept after their request ends until capacity
//! pressure evicts them, least recently used first, so a later prompt that starts the same way
//! skips the prefill of what is cached.
//!
//! The simulator has no tokenizer. A token is [`TOKEN_BYTES`] bytes of the prompt's text (the ratio
//! the engine counts prompt tokens by), so a prompt whose bytes start with another prompt's bytes
//! starts with its tokens. Tokens are grouped in blocks of [`BLOCK_TOKENS`]; only full blocks are
//! cached, as in vLLM. Block `i` is named by a chained hash (vLLM's block hash: the previous
//! block's hash and this block's tokens), so a block is only reused after the very same prefix,
//! never because two prompts happen to share a chunk in the middle.
//!
//! Accounting follows vLLM's block pool: a block referenced by running requests is in use and
//! counted once however many requests share it; a block no running request references is free
//! but still cached (evictable), and is NOT counted as KV usage, as vLLM's `kv_cache_usage_perc`
//! counts free cached blocks as free. The rank (`rank.rs`) owns the capacity: it evicts idle
//! blocks, least recently used first, when what is in use plus what is cached would pass it.

use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// Tokens per KV block (vLLM's default block size on GPUs).
pub const BLOCK_TOKENS: u64 = 16;

/// Bytes of prompt text per simulated token.
pub const TOKEN_BYTES: usize = 4;

/// The chained hashes of the full blocks of a prompt `tokens` long whose text is `text`. Bytes
/// past `tokens` tokens (or a short text) end the chain early: only whole blocks of real text
/// are named.
pub fn block_ids(text: &[u8], tokens: u64) -> Vec<u64> {
    let block_bytes = BLOCK_TOKENS as usize * TOKEN_BYTES;
    let full = (tokens / BLOCK_TOKENS) as usize;
    let mut prev = 0u64;
    text.chunks_exact(block_bytes)
        .take(full)
        .map(|chunk| {
            // `DefaultHasher::new()` has fixed keys: the same prompt gets the same ids in every
            // run of one build, which is all a simulation needs.
            let mut h = std::collections::hash_map::DefaultHasher::new();
            prev.hash(&mut h);
            chunk.hash(&mut h);
            prev = h.finish();
            prev
        })
        .collect()
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
        for &id in ids {
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
        for &id in ids.iter().rev() {
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
            gone += 1;
        }
        gone
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(s: &str, tokens: u64) -> Vec<u64> {
        block_ids(s.as_bytes(), tokens)
    }

    #[test]
    fn ids_are_chained_and_only_whole_blocks() {
        let a = "x".repeat(64 * 3 + 10);
        let ids = text(&a, (a.len() / TOKEN_BYTES) as u64);
        assert_eq!(ids.len(), 3, "the partial fourth block is not named");
        // The same chunk after a different prefix is a different block.
        assert_ne!(ids[1], ids[2]);
        let mut b = a.clone();
        b.replace_range(0..1, "y");
        let other = text(&b, (b.len() / TOKEN_BYTES) as u64);
        assert!(ids.iter().zip(&other).all(|(x, y)| x != y));
        // A longer prompt with the same start shares the leading ids.
        let longer = format!("{a}{}", "z".repeat(200));
        let more = text(&longer, (longer.len() / TOKEN_BYTES) as u64);
        assert_eq!(&more[..3], &ids[..]);
        assert_eq!(text(&a, 20), ids[..1], "the token count bounds the blocks");
    }

    #[test]
    fn hit_length_is_the_leading_cached_run() {
        let mut c = PrefixCache::default();
        c.acquire(&[1, 2, 3]);
        assert_eq!(
            c.lookup(&[1, 2, 9, 3]),
            Lookup {
                hit: 2,
                new: 1,
                revived: 0
            }
        );
        assert_eq!(
            c.lookup(&[9, 1]).hit,
            0,
            "a hit must start at the first block"
        );
    }

    #[test]
    fn shared_blocks_are_counted_once() {
        let mut c = PrefixCache::default();
        c.acquire(&[1, 2, 3]);
        c.acquire(&[1, 2, 4]);
        assert_eq!(c.in_use(), 4);
        c.release(&[1, 2, 3]);
        assert_eq!(
            (c.in_use(), c.idle()),
            (3, 1),
            "1 and 2 still held by the second"
        );
        c.release(&[1, 2, 4]);
        assert_eq!((c.in_use(), c.idle()), (0, 4));
        // Reviving idle blocks costs no new allocation.
        assert_eq!(
            c.lookup(&[1, 2, 5]),
            Lookup {
                hit: 2,
                new: 1,
                revived: 2
            }
        );
    }

    #[test]
    fn eviction_is_least_recently_used_and_spares_blocks_in_use() {
        let mut c = PrefixCache::default();
        c.acquire(&[1, 2]);
        c.release(&[1, 2]); // idle order: 2, 1 (tail first)
        c.acquire(&[7]);
        c.release(&[7]); // then 7
        c.acquire(&[8]); // in use: never evicted
        assert_eq!(c.evict(1), 1);
        assert_eq!(c.lookup(&[1, 2]).hit, 1, "block 2 (the tail) went first");
        assert_eq!(c.evict(10), 2, "1 and 7; 8 is in use");
        assert_eq!((c.in_use(), c.idle()), (1, 0));
        assert_eq!(c.lookup(&[8]).hit, 1);
    }

    #[test]
    fn inserted_idle_blocks_go_before_what_is_released_after_them() {
        let mut c = PrefixCache::default();
        c.acquire(&[1, 2]);
        // A finished request's answer blocks continue its prompt's chain.
        c.insert_idle(&[1, 2, 3, 4]);
        c.release(&[1, 2]);
        assert_eq!((c.in_use(), c.idle()), (0, 4));
        assert_eq!(c.evict(1), 1);
        assert_eq!(
            c.lookup(&[1, 2, 3, 4]).hit,
            3,
            "the answer's tail went first"
        );
    }
}
