//! Prefix-cache affinity's memory: which prompt prefixes rankgate recently sent to each rank.
//!
//! rankgate sees prompts as the client's bytes, not tokens, so a prompt is the raw JSON of its
//! `messages` (chat) or `prompt` (completions) value, cut into [`CHUNK`]-byte chunks; chunk `i`
//! is named by a hash chained over chunks `0..=i`, so equal names mean equal prefixes. A
//! conversation's next turn repeats the earlier messages byte for byte, so its first chunks
//! name the prefix already cached on the rank that served the last turn. Only whole chunks
//! count: the partial tail changes as the conversation grows.
//!
//! Each rank's index is an LRU of chunk names bounded by what its KV cache could hold (from its
//! reported capacity in tokens; a fixed budget when unknown): the engine evicts its prefix
//! cache least-recently-used under pressure, so a prefix rankgate has not sent for a whole
//! cache's worth of traffic is probably gone there too. It is approximate (rankgate does not
//! see other routers' traffic, an engine restart, or what the engine evicted early); a wrong
//! guess only costs the prefill affinity hoped to save, since load decides first.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Mutex;

use crate::scan::json_member_raw;

/// Bytes of prompt JSON per chunk: about 64 tokens of English text.
pub const CHUNK: usize = 256;
/// Tokens one chunk stands for, to size an index by a rank's KV capacity.
pub const TOKENS_PER_CHUNK: u64 = 64;
/// Chunks read from one prompt at most (512 KiB): a longer prompt matches by its start.
pub const MAX_CHUNKS: usize = 2048;
/// Entries per rank when its KV capacity is unknown, and the bounds for a known one: at most
/// 16 K entries (about 40 bytes each) per rank whatever it reports.
pub const DEFAULT_BUDGET: usize = 4096;
const MIN_BUDGET: usize = 256;
const MAX_BUDGET: usize = 16384;
/// Entries over the whole fleet at most (about 80 MiB): a fleet of thousands of ranks gets
/// less per rank rather than unbounded memory.
const FLEET_BUDGET: usize = 2 << 20;

/// The index size of a rank with a KV capacity of `capacity_tokens` (if reported) in a fleet
/// of `ranks` ranks.
pub fn budget(capacity_tokens: Option<u64>, ranks: usize) -> usize {
    let own = match capacity_tokens {
        Some(t) => ((t / TOKENS_PER_CHUNK) as usize).clamp(MIN_BUDGET, MAX_BUDGET),
        None => DEFAULT_BUDGET,
    };
    own.min(FLEET_BUDGET / ranks.max(1)).max(1)
}

/// The leading chunks of `prompt` worth recording in an index of `budget` entries: at most
/// half of it, so a prompt longer than the cache never evicts its own beginning (what the
/// next turn matches first).
pub fn recorded(prompt: &[u64], budget: usize) -> &[u64] {
    &prompt[..prompt.len().min(budget / 2)]
}

/// The chained chunk names of a request body's prompt (`messages`, else `prompt`); empty when
/// it has none, is not JSON, or is shorter than one chunk.
pub fn prompt_chunks(body: &[u8]) -> Vec<u64> {
    match json_member_raw(body, &["messages", "prompt"]) {
        Ok(Some(prompt)) => chunk_names(prompt),
        _ => Vec::new(),
    }
}

/// Names of `bytes`' whole chunks, each chained over all before it.
pub fn chunk_names(bytes: &[u8]) -> Vec<u64> {
    let mut names = Vec::with_capacity((bytes.len() / CHUNK).min(MAX_CHUNKS));
    let mut h = 0x9e37_79b9_7f4a_7c15u64;
    for chunk in bytes.chunks_exact(CHUNK).take(MAX_CHUNKS) {
        for word in chunk.chunks_exact(8) {
            let w = u64::from_le_bytes(word.try_into().unwrap_or_default());
            h = (h ^ w).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(29);
        }
        // Finalised per chunk (a collision between two prefixes only misleads a guess).
        let mut f = h ^ (h >> 33);
        f = f.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        names.push(f ^ (f >> 29));
    }
    names
}

/// Chunk names are hashes already: the map uses them as they are.
#[derive(Default)]
struct Identity(u64);

impl Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 << 8) | u64::from(*b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// One rank's prefixes: an LRU of chunk names.
#[derive(Debug, Default)]
pub struct RankPrefixes(Mutex<Lru>);

#[derive(Debug, Default)]
struct Lru {
    /// Each name's latest use.
    last: HashMap<u64, u64, BuildHasherDefault<Identity>>,
    /// Uses in order, oldest first; an entry whose name was used again since is skipped when
    /// it comes up for eviction.
    order: VecDeque<(u64, u64)>,
    clock: u64,
}

impl RankPrefixes {
    /// How many of `names`' leading chunks this rank holds.
    pub fn matched(&self, names: &[u64]) -> usize {
        let Ok(lru) = self.0.lock() else { return 0 };
        names
            .iter()
            .take_while(|n| lru.last.contains_key(n))
            .count()
    }

    /// Notes that `names` went to this rank, keeping at most `budget` uses.
    pub fn record(&self, names: &[u64], budget: usize) {
        let Ok(mut lru) = self.0.lock() else { return };
        let lru = &mut *lru;
        for &n in names {
            lru.clock += 1;
            lru.last.insert(n, lru.clock);
            lru.order.push_back((n, lru.clock));
        }
        while lru.order.len() > budget.max(1) {
            let Some((n, at)) = lru.order.pop_front() else {
                break;
            };
            if lru.last.get(&n) == Some(&at) {
                lru.last.remove(&n);
            }
        }
    }

    /// Names held now.
    pub fn len(&self) -> usize {
        self.0.lock().map_or(0, |l| l.last.len())
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn chat(turns: &[&str]) -> Vec<u8> {
        let msgs: Vec<_> = turns
            .iter()
            .map(|t| serde_json::json!({"role": "user", "content": t}))
            .collect();
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": msgs})).unwrap()
    }

    #[test]
    fn a_next_turn_shares_the_earlier_turns_chunks() {
        let system = "You are a helpful assistant. ".repeat(40);
        let first = prompt_chunks(&chat(&[&system, "What is a KV cache?"]));
        let second = prompt_chunks(&chat(&[&system, "What is a KV cache?", "And prefill?"]));
        assert!(first.len() >= 4, "{}", first.len());
        assert_eq!(&second[..first.len() - 1], &first[..first.len() - 1]);
        let other = prompt_chunks(&chat(&["Something else entirely. ".repeat(40).as_str()]));
        assert_ne!(other[0], first[0]);
    }

    #[test]
    fn prompts_of_completions_count_and_short_or_broken_bodies_have_none() {
        let body = serde_json::json!({"model": "m", "prompt": "x".repeat(3 * CHUNK)}).to_string();
        assert_eq!(prompt_chunks(body.as_bytes()).len(), 3);
        assert!(prompt_chunks(br#"{"messages":[{"role":"user","content":"hi"}]}"#).is_empty());
        assert!(prompt_chunks(b"not json").is_empty());
        assert!(prompt_chunks(br#"{"input":"x"}"#).is_empty());
    }

    #[test]
    fn match_length_is_the_leading_run() {
        let r = RankPrefixes::default();
        r.record(&[1, 2, 3], 100);
        assert_eq!(r.matched(&[1, 2, 3, 4]), 3);
        assert_eq!(r.matched(&[1, 9, 3]), 1);
        assert_eq!(r.matched(&[9, 1, 2]), 0);
        assert_eq!(r.matched(&[]), 0);
    }

    #[test]
    fn the_least_recently_used_go_first_within_the_budget() {
        let r = RankPrefixes::default();
        r.record(&[1, 2, 3, 4], 4);
        // 1 is used again, so 2 is now the oldest.
        r.record(&[1], 4);
        r.record(&[5], 4);
        assert_eq!(r.matched(&[1]), 1);
        assert_eq!(r.matched(&[2]), 0, "evicted");
        assert!(r.len() <= 4);
    }

    #[test]
    fn budgets_follow_capacity_within_bounds() {
        assert_eq!(budget(None, 8), DEFAULT_BUDGET);
        assert_eq!(budget(Some(64 * 1000), 8), 1000);
        assert_eq!(budget(Some(10), 8), MIN_BUDGET);
        assert_eq!(budget(Some(u64::MAX), 8), MAX_BUDGET);
        // A fleet of many ranks shares one bound.
        assert_eq!(budget(Some(u64::MAX), 65_536), FLEET_BUDGET / 65_536);
    }

    #[test]
    fn a_prompt_longer_than_the_cache_keeps_its_beginning() {
        let r = RankPrefixes::default();
        let prompt: Vec<u64> = (0..300).collect();
        r.record(recorded(&prompt, 256), 256);
        assert_eq!(
            r.matched(&prompt),
            128,
            "the first half of the budget, from the start"
        );
    }

    proptest! {
        /// Whatever is recorded, the index never holds more than its budget.
        #[test]
        fn memory_is_bounded(
            batches in prop::collection::vec(prop::collection::vec(0u64..500, 0..40), 0..60),
            budget in 1usize..64,
        ) {
            let r = RankPrefixes::default();
            for b in &batches {
                r.record(b, budget);
                let lru = r.0.lock().unwrap();
                prop_assert!(lru.order.len() <= budget);
                prop_assert!(lru.last.len() <= budget);
            }
        }

        #[test]
        fn any_bytes_are_chunked_without_panic(body in prop::collection::vec(any::<u8>(), 0..2048)) {
            let _ = prompt_chunks(&body);
            prop_assert_eq!(chunk_names(&body).len(), body.len() / CHUNK);
        }
    }
}
