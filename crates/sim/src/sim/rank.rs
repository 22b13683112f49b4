//! One simulated DP rank: a KV cache of fixed capacity in tokens, a prefix cache of prompt
//! blocks inside it, and a queue in front of it.
//!
//! A request reserves prompt + max_tokens of KV at admission (so it never has to be preempted),
//! while the KV it reports as used grows from its prompt by one token per decoded token, as a real
//! engine's does. When the reservation does not fit, the request waits: that queueing is what makes
//! a full rank slow, and what a load-aware router is there to avoid.
//!
//! With prefix caching, the prompt's full blocks are not reserved privately: they are blocks of
//! the rank's [`PrefixCache`], shared with every running request that has the same prefix and
//! counted once, and kept (idle, evictable) after the request ends. Idle blocks do not count as
//! KV usage (vLLM reports cached free blocks as free) and never make a request wait: admission
//! evicts them, least recently used first, to make room.
//!
//! Its queue is vLLM's by default ([`Queueing`]): at most `max_num_seqs` requests run, and the
//! waiting ones start in order, so a request that does not fit holds back every one behind it
//! (head-of-line blocking), however small. The order is arrival, or with the priority policy the
//! request's `priority` then arrival. A waiting request holds nothing. With LoRA adapters
//! ([`Rank::with_lora`]) a request whose adapter finds no slot in the batch is set aside instead,
//! and those behind it may start, as vLLM's scheduler skips it ([`waiting`]).
//!
//! With KV events on ([`Rank::with_events`]) every change of the prefix cache is handed, in
//! order and inside the same critical section, to the rank's [`RankEvents`] for its publisher.
//! [`Rank::restart`] empties the cache as a restarted engine process has it empty.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

use super::kv::RankEvents;
use super::prefix::{Blocks, PrefixCache, BLOCK_TOKENS};
pub use waiting::SlotCounts;
use waiting::{Key, Waiting};

mod waiting;

#[derive(Debug, Default, Clone, Copy)]
pub struct RankCounts {
    /// KV held by running requests: their private reservations plus the blocks they share.
    pub reserved: u64,
    /// KV running requests really occupy: prompts and tokens decoded so far.
    pub used: u64,
    pub running: u32,
    pub waiting: u32,
    /// Cached blocks no running request holds (evictable; not in `used`).
    pub idle_blocks: u64,
    /// vLLM's `prefix_cache_queries`: prompt tokens of admitted requests that looked up the cache.
    pub prefix_queries: u64,
    /// vLLM's `prefix_cache_hits`: of those, tokens found cached.
    pub prefix_hits: u64,
    /// Requests admitted, and those finished, since the engine (re)started: vLLM publishes a
    /// DP rank's gauges only once it has run one, and counts `request_success_total`.
    pub admitted: u64,
    pub finished: u64,
    /// With LoRA: requests set aside for a slot, now and ever, and slot loads.
    pub lora: SlotCounts,
}

/// What running requests hold apart from shared blocks, and the cache itself.
#[derive(Debug, Default)]
struct State {
    /// Private reservations (prompt tail past the last full block, plus max tokens).
    reserved: u64,
    /// Of that, what is occupied.
    used: u64,
    running: u32,
    /// The waiting requests in the order they start: (priority, ticket), lowest first; the
    /// ticket numbers arrivals, so equal priorities (all of them under FCFS) go by arrival.
    /// With LoRA, also the batch's adapters and the slots.
    queue: Waiting,
    /// The next arrival's ticket.
    tickets: u64,
    cache: PrefixCache,
    prefix_queries: u64,
    prefix_hits: u64,
    admitted: u64,
    finished: u64,
}

#[derive(Debug)]
pub struct Rank {
    pub global: u32,
    pub capacity: u64,
    /// Tokens held by a simulated background tenant (`--preload`): capacity real requests cannot use.
    pub preload: u64,
    state: Mutex<State>,
    freed: Notify,
    /// Requests this rank has admitted, ever.
    pub served: AtomicU64,
    /// Where the cache's KV events go, with events on.
    events: Option<Arc<RankEvents>>,
    queueing: Queueing,
}

/// How a rank's waiting requests get their turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Queueing {
    /// Requests running at once at most, vLLM's `--max-num-seqs` (at least 1).
    pub max_running: u32,
    /// Waiting requests start strictly in their order, as vLLM's scheduler takes its waiting
    /// queue: it stops at the first request it cannot start. Off, any waiting request that fits
    /// starts (the SGLang flavor, as the sim always had it).
    pub in_order: bool,
}

impl Queueing {
    /// No cap, any order: what [`Rank::new`] starts with.
    pub const UNORDERED: Queueing = Queueing {
        max_running: u32::MAX,
        in_order: false,
    };
}

/// A request's hold on its rank's KV; released (and waiters woken) on drop, so a client that goes
/// away mid-stream frees its KV like a real abort does.
#[derive(Debug)]
pub struct Admission<'a> {
    rank: &'a Rank,
    reserved: u64,
    used: u64,
    blocks: Vec<u64>,
    /// The cache's epoch at admission: after a restart the blocks are no longer the cache's.
    epoch: u64,
    /// Blocks to keep cached once the request ends (its prompt's and its answer's), set by
    /// [`Admission::keep`].
    keep: Blocks,
    /// Prompt tokens found in the prefix cache: their prefill is skipped.
    pub cached_tokens: u64,
    /// The adapter it runs (by id), released from the batch when it ends.
    adapter: Option<u32>,
    /// Whether starting it loaded its adapter into a slot.
    pub lora_load: bool,
}

impl Rank {
    pub fn new(global: u32, capacity: u64, preload_fraction: f64) -> Rank {
        let preload = (capacity as f64 * preload_fraction.clamp(0.0, 1.0)) as u64;
        Rank {
            global,
            capacity,
            preload,
            state: Mutex::new(State::default()),
            freed: Notify::new(),
            served: AtomicU64::new(0),
            events: None,
            queueing: Queueing::UNORDERED,
        }
    }

    /// The rank with its queue run by `q` ([`Queueing`]).
    pub fn with_queueing(mut self, q: Queueing) -> Rank {
        self.queueing = Queueing {
            max_running: q.max_running.max(1),
            ..q
        };
        self
    }

    /// The rank with KV events on: its cache records them and hands them to `events`.
    pub fn with_events(mut self, events: Arc<RankEvents>) -> Rank {
        self.lock().cache.record_events();
        self.events = Some(events);
        self
    }

    /// Hands what the cache recorded to the publisher; called with the lock held so that
    /// batches keep the cache's order.
    fn flush(&self, s: &mut State) {
        if let Some(ev) = &self.events {
            ev.push(s.cache.take_events());
        }
    }

    /// The ids of the blocks the prefix cache holds, sorted.
    pub fn cached_ids(&self) -> Vec<u64> {
        self.lock().cache.cached_ids()
    }

    /// vLLM's `reset_prefix_cache` ([`PrefixCache::reset`]): the cache empties and the event
    /// stream says `AllBlocksCleared`, numbering going on; refused (`false`) while requests run.
    pub fn reset_prefix_cache(&self) -> bool {
        let mut s = self.lock();
        let done = s.cache.reset();
        self.flush(&mut s);
        done
    }

    /// The engine process restarted: the prefix cache is empty and the event stream starts
    /// again (`AllBlocksCleared` first, numbered 0). Requests in flight are not failed: they run
    /// to the end and release their KV (still counted as used until then), but their blocks are
    /// no longer cached or shared and their answers are not kept. The rank's counters (`served`,
    /// the prefix-cache totals of `/metrics`) go on counting across it, so a run's totals stay
    /// sums of deltas.
    pub fn restart(&self) {
        {
            let mut s = self.lock();
            s.cache.restart();
            s.queue.restart();
            (s.admitted, s.finished) = (0, 0);
            s.cache.take_events();
            if let Some(ev) = &self.events {
                ev.restart();
            }
        }
        self.freed.notify_waiters();
    }

    pub fn counts(&self) -> RankCounts {
        let s = self.lock();
        let shared = s.cache.in_use() * BLOCK_TOKENS;
        RankCounts {
            reserved: s.reserved + shared,
            used: s.used + shared,
            running: s.running,
            waiting: s.queue.len() as u32,
            idle_blocks: s.cache.idle(),
            prefix_queries: s.prefix_queries,
            prefix_hits: s.prefix_hits,
            admitted: s.admitted,
            finished: s.finished,
            lora: s.queue.slot_counts(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A poisoned lock only means another request panicked mid-update; the counts are still
        // the best numbers there are.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Holds `tokens` of KV outside any request, or with `release` frees them: a prefill
    /// server's blocks kept for the decode server that pulls them (`pd`), counted as used.
    pub fn hold_kv(&self, tokens: u64, release: bool) {
        let mut s = self.lock();
        if release {
            s.reserved = s.reserved.saturating_sub(tokens);
            s.used = s.used.saturating_sub(tokens);
        } else {
            s.reserved += tokens;
            s.used += tokens;
        }
        drop(s);
        self.freed.notify_waiters();
    }

    /// KV usage as the engine would report it: background plus what running requests really
    /// hold, shared blocks once; idle cached blocks count as free.
    pub fn kv_usage(&self) -> f64 {
        let c = self.counts();
        ((self.preload + c.used) as f64 / self.capacity as f64).min(1.0)
    }

    /// Admits a request with no cacheable prompt blocks (see [`Rank::admit_blocks`]).
    pub async fn admit(&self, prompt: u64, max_tokens: u64) -> Admission<'_> {
        self.admit_blocks(prompt, None, max_tokens).await
    }

    /// Waits until `prompt + max_tokens` fits, then holds it. `blocks` are the ids of the
    /// prompt's full blocks ([`super::prefix::block_ids`]; `None` without prefix caching): those
    /// cached are shared, the others allocated in the cache, and only the rest of the prompt plus
    /// `max_tokens` is reserved privately. A request larger than the whole free capacity is
    /// admitted alone, as an engine would rather run it than hang forever.
    pub async fn admit_blocks(
        &self,
        prompt: u64,
        blocks: Option<&[u64]>,
        max_tokens: u64,
    ) -> Admission<'_> {
        let blocks = blocks.map(|ids| Blocks {
            ids: ids.to_vec(),
            tokens: Vec::new(),
        });
        self.admit_prompt(prompt, blocks.as_ref(), max_tokens).await
    }

    /// [`Rank::admit_blocks`] with the blocks' token ids, which the KV events carry.
    pub async fn admit_prompt(
        &self,
        prompt: u64,
        prompt_blocks: Option<&Blocks>,
        max_tokens: u64,
    ) -> Admission<'_> {
        self.admit_ranked(prompt, prompt_blocks, max_tokens, 0)
            .await
    }

    /// [`Rank::admit_prompt`] at `priority` (lower goes first; 0 for all under FCFS). The
    /// request starts once it fits, fewer than `max_running` run, and, in order, no waiting
    /// request comes before it.
    pub async fn admit_ranked(
        &self,
        prompt: u64,
        prompt_blocks: Option<&Blocks>,
        max_tokens: u64,
        priority: i64,
    ) -> Admission<'_> {
        (self.admit_adapter(prompt, prompt_blocks, max_tokens, priority, None)).await
    }

    /// [`Rank::admit_ranked`] for a request running LoRA `adapter` (by id; `None`: the base
    /// model): it also needs its adapter in the batch or a slot free for it, and while it has
    /// neither it is set aside, holding back no one.
    pub async fn admit_adapter(
        &self,
        prompt: u64,
        prompt_blocks: Option<&Blocks>,
        max_tokens: u64,
        priority: i64,
        adapter: Option<u32>,
    ) -> Admission<'_> {
        let caching = prompt_blocks.is_some();
        let empty = Blocks::default();
        let prompt_blocks = prompt_blocks.unwrap_or(&empty);
        let blocks = &prompt_blocks.ids[..];
        let free = self.capacity.saturating_sub(self.preload).max(1);
        let block_tokens = blocks.len() as u64 * BLOCK_TOKENS;
        let tail = prompt.saturating_sub(block_tokens);
        let need = (tail + max_tokens).min(free);
        // Counted as waiting while queued; a request dropped in the queue (its client left)
        // stops counting.
        let mut queued = Queued {
            rank: self,
            key: None,
        };
        // Whether it has been counted as set aside for a slot.
        let mut slot_wait = false;
        let key = {
            let mut s = self.lock();
            s.tickets += 1;
            (priority, s.tickets)
        };
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            // Register for wake-ups before checking, so a release between the check and the
            // wait is not missed.
            notified.as_mut().enable();
            {
                let mut s = self.lock();
                let look = s.cache.lookup(blocks);
                let held = s.reserved + s.cache.in_use() * BLOCK_TOKENS;
                let taking = need + (look.new + look.revived) as u64 * BLOCK_TOKENS;
                let fits = s.running == 0 || held + taking <= free;
                // With the queue in order, its turn comes once no waiting request is ahead of it
                // but those set aside for a LoRA slot.
                let turn = s.queue.turn(key, adapter, self.queueing.in_order);
                if turn && s.running < self.queueing.max_running && fits {
                    s.cache.acquire_blocks(prompt_blocks);
                    // Whatever the cache still holds past capacity is idle: evict it.
                    let occupied =
                        s.reserved + need + (s.cache.in_use() + s.cache.idle()) * BLOCK_TOKENS;
                    let over = occupied.saturating_sub(free).div_ceil(BLOCK_TOKENS);
                    s.cache.evict(over);
                    self.flush(&mut s);
                    // vLLM recomputes at least the prompt's last token, whatever is cached.
                    let cached = (look.hit as u64 * BLOCK_TOKENS).min(prompt.saturating_sub(1));
                    if caching {
                        s.prefix_queries += prompt;
                        s.prefix_hits += cached;
                    }
                    let used = tail.min(need);
                    s.reserved += need;
                    s.used += used;
                    s.running += 1;
                    s.admitted += 1;
                    let was_queued = queued.key.take().is_some_and(|k| s.queue.remove(k));
                    let lora_load = s.queue.start(adapter);
                    self.served.fetch_add(1, Relaxed);
                    let adm = Admission {
                        rank: self,
                        reserved: need,
                        used,
                        blocks: blocks.to_vec(),
                        epoch: s.cache.epoch(),
                        keep: Blocks::default(),
                        cached_tokens: cached,
                        adapter,
                        lora_load,
                    };
                    drop(s);
                    if was_queued && self.queueing.in_order {
                        // The next in line may fit too.
                        self.freed.notify_waiters();
                    }
                    return adm;
                }
                if queued.key.is_none() {
                    s.queue.insert(key, adapter);
                    queued.key = Some(key);
                }
                if !slot_wait && s.queue.set_aside(adapter) {
                    s.queue.count_wait();
                    slot_wait = true;
                }
            }
            notified.await;
        }
    }
}

/// A request's place in a rank's queue, while it has one.
struct Queued<'a> {
    rank: &'a Rank,
    key: Option<Key>,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if let Some(k) = self.key.take() {
            self.rank.lock().queue.remove(k);
            if self.rank.queueing.in_order {
                // It may have been holding the others back.
                self.rank.freed.notify_waiters();
            }
        }
    }
}

impl Admission<'_> {
    /// The request finished: once it ends, `ids` (the blocks of its prompt followed by its
    /// answer, as the conversation's next turn will send them) stay cached. vLLM caches the
    /// blocks of generated tokens too; a later turn whose template renders the answer the same
    /// way finds them.
    pub fn keep(&mut self, ids: Vec<u64>) {
        self.keep = Blocks {
            ids,
            tokens: Vec::new(),
        };
    }

    /// [`Admission::keep`] with the blocks' token ids (the prompt's tokens followed by the
    /// answer's), which the KV events carry.
    pub fn keep_blocks(&mut self, blocks: Blocks) {
        self.keep = blocks;
    }

    /// One more token decoded: it occupies KV until the request ends.
    pub fn grow(&mut self) {
        if self.used < self.reserved {
            self.used += 1;
            self.rank.lock().used += 1;
        }
    }
}

impl Drop for Admission<'_> {
    fn drop(&mut self) {
        {
            let mut c = self.rank.lock();
            c.reserved -= self.reserved;
            c.used -= self.used;
            c.running -= 1;
            c.finished += 1;
            c.queue.finish(self.adapter);
            if c.cache.epoch() == self.epoch {
                // The answer's blocks first (those of the prompt are cached already and
                // skipped), so that they are evicted before the prompt they follow.
                c.cache.insert_idle_blocks(&self.keep);
                c.cache.release(&self.blocks);
            } else {
                // Taken before a restart: the blocks belong to the old process's cache.
                c.cache.release_detached(self.epoch, &self.blocks);
            }
            let free = self.rank.capacity.saturating_sub(self.rank.preload).max(1);
            let occupied = c.reserved + (c.cache.in_use() + c.cache.idle()) * BLOCK_TOKENS;
            c.cache
                .evict(occupied.saturating_sub(free).div_ceil(BLOCK_TOKENS));
            self.rank.flush(&mut c);
        }
        self.rank.freed.notify_waiters();
    }
}

#[cfg(test)]
mod lora_tests;
#[cfg(test)]
mod tests;
