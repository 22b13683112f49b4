//! Token ids of prompt pieces already seen, so that a chat's next turn tokenizes only what is
//! new. The rendered text is split at exact cuts ([`super::cut::Cuts::chunks`]) into pieces of
//! about [`CHUNK_BYTES`]; a piece's ids depend on its text alone, so they are cached by text.
//! A turn that repeats the conversation so far finds every piece but the last one or two.
//!
//! Exact by construction: a hit compares the whole piece's text, not only its hash. Bounded in
//! bytes (text plus ids), the oldest pieces dropped first (FIFO: a conversation's pieces are
//! used again together, so recency adds little over insertion order).
//!
//! A std `Mutex`, not the crate's snapshot-and-swap: the critical section is a map lookup or
//! insert and an `Arc` clone, never an await or a tokenization (those run outside it), and the
//! map changes on most requests, which a copied snapshot would make costly.

use std::collections::{HashMap, VecDeque};
use std::hash::BuildHasher;
use std::sync::{Arc, Mutex};

/// The size the text is cut into for the cache: a turn's tail re-tokenized on a hit is at most
/// about this much (~0.3 ms of byte-level BPE here).
pub const CHUNK_BYTES: usize = 2048;

/// Bytes an entry costs beside its text and ids (map slot, queue slot, allocations).
const ENTRY_OVERHEAD: usize = 96;

#[derive(Debug)]
pub struct ChunkCache {
    max_bytes: usize,
    /// SipHash with this process's random keys: a client cannot aim collisions at it.
    hasher: std::collections::hash_map::RandomState,
    inner: Mutex<Inner>,
}

#[derive(Debug, Default)]
struct Inner {
    map: HashMap<u64, Entry>,
    order: VecDeque<u64>,
    bytes: usize,
    hits: u64,
    misses: u64,
}

#[derive(Debug)]
struct Entry {
    text: Box<str>,
    ids: Arc<[u32]>,
}

impl Entry {
    fn cost(&self) -> usize {
        self.text.len() + self.ids.len() * 4 + ENTRY_OVERHEAD
    }
}

impl ChunkCache {
    pub fn new(max_bytes: usize) -> ChunkCache {
        ChunkCache {
            max_bytes,
            hasher: Default::default(),
            inner: Mutex::default(),
        }
    }

    /// The ids cached for exactly `text`.
    pub fn get(&self, text: &str) -> Option<Arc<[u32]>> {
        let key = self.hasher.hash_one(text);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let found = inner
            .map
            .get(&key)
            .filter(|entry| &*entry.text == text)
            .map(|entry| entry.ids.clone());
        if found.is_some() {
            inner.hits += 1;
        } else {
            inner.misses += 1;
        }
        found
    }

    /// Remembers `ids` for `text`, dropping the oldest pieces beyond the bound.
    pub fn put(&self, text: &str, ids: Arc<[u32]>) {
        let entry = Entry {
            text: text.into(),
            ids,
        };
        let cost = entry.cost();
        if cost > self.max_bytes {
            return;
        }
        let key = self.hasher.hash_one(text);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = inner.map.insert(key, entry) {
            // Same text again (two requests raced) or a 64-bit collision: replaced in place.
            inner.bytes -= old.cost();
        } else {
            inner.order.push_back(key);
        }
        inner.bytes += cost;
        while inner.bytes > self.max_bytes {
            let Some(oldest) = inner.order.pop_front() else {
                break;
            };
            if let Some(old) = inner.map.remove(&oldest) {
                inner.bytes -= old.cost();
            }
        }
    }

    /// Drops every piece.
    pub fn clear(&self) {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        inner.map.clear();
        inner.order.clear();
        inner.bytes = 0;
    }

    /// (hits, misses, bytes held).
    pub fn stats(&self) -> (u64, u64, usize) {
        let inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        (inner.hits, inner.misses, inner.bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hits_compare_text_and_the_bound_drops_oldest() {
        let cache = ChunkCache::new(3 * (ENTRY_OVERHEAD + 1 + 4));
        for text in ["a", "b", "c"] {
            cache.put(text, Arc::from(vec![1u32]));
        }
        assert!(cache.get("a").is_some());
        cache.put("d", Arc::from(vec![2u32]));
        assert!(cache.get("a").is_none(), "oldest dropped");
        assert_eq!(cache.get("d").as_deref(), Some(&[2u32][..]));
        assert!(cache.get("e").is_none());
        let (hits, misses, bytes) = cache.stats();
        assert_eq!((hits, misses), (2, 2));
        assert_eq!(bytes, 3 * (ENTRY_OVERHEAD + 1 + 4));
        cache.put("d", Arc::from(vec![2u32]));
        assert_eq!(
            cache.stats().2,
            bytes,
            "a second put of one text is not counted twice"
        );
        cache.clear();
        assert_eq!(cache.stats().2, 0);
    }
}
