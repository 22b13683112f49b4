//! A rank's waiting requests in the order they start and, with LoRA on, the adapters its batch
//! runs and its slots hold.
//!
//! vLLM v1's scheduler (`vllm/v1/core/sched/scheduler.py`, `Scheduler.schedule`) collects the
//! adapters of the running requests it schedules (`scheduled_loras`), then walks the waiting
//! queue: a request whose adapter is not among them while they already number `max_loras` is
//! popped and set aside ("Scheduling would exceed max_loras, skip."), and the walk goes on to the
//! requests behind it; the ones set aside go back to the head of the queue after the step, so
//! they keep their place. A request that does not fit for KV, or finds `max_num_seqs` running,
//! still stops the walk and holds back everyone behind it (`rank.rs`). The sim has no steps: a
//! request may start when no waiting request ahead of it is one the walk would stop at, which is
//! [`Waiting::turn`], and the first such request is kept current on every change ([`head`]) so
//! that question costs nothing.
//!
//! The slots: a rank keeps at most `max_loras` adapters loaded, the least recently used evicted
//! first (vLLM's `LRUCacheWorkerLoRAManager`). Starting a request whose adapter is not loaded
//! loads it, and the load stalls the rank's steps for the load time (vLLM activates adapters in
//! the worker before the forward pass, for the whole batch); two loads at once stall twice as
//! long. An adapter still loaded costs nothing the next time.
//!
//! [`head`]: Waiting::head

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use tokio::time::Instant;

use super::Rank;

/// A waiting request's place: (priority, ticket), lowest first.
pub(super) type Key = (i64, u64);

/// The waiting queue, and the LoRA batch and slots when the rank serves adapters.
#[derive(Debug, Default)]
pub(super) struct Waiting {
    /// Waiting requests by their place, with the id of the adapter each runs.
    queue: BTreeMap<Key, Option<u32>>,
    lora: Option<Slots>,
    /// The first waiting request that is not set aside for want of a slot: the one the walk
    /// reaches first.
    head: Option<Key>,
}

/// A rank's LoRA batch and slots.
#[derive(Debug)]
struct Slots {
    max_loras: usize,
    load: Duration,
    /// Running requests per adapter: the batch's adapters, at most `max_loras` of them.
    running: BTreeMap<u32, u32>,
    /// Loaded adapters, least recently started first; every running adapter is among them.
    loaded: VecDeque<u32>,
    /// Requests set aside for want of a slot, each counted once.
    waits: u64,
    /// Adapters loaded into a slot.
    loads: u64,
    /// The end of the stall the last loads put on the rank's steps.
    stall_until: Option<Instant>,
}

/// What the slots have done, for `/metrics`.
#[derive(Debug, Default, Clone, Copy)]
pub struct SlotCounts {
    /// Waiting requests set aside right now (vLLM's `waiting_by_reason{reason="deferred"}`).
    pub deferred: u32,
    /// Requests ever set aside for want of a slot.
    pub waits: u64,
    /// Adapters ever loaded into a slot.
    pub loads: u64,
}

impl Rank {
    /// The rank serving LoRA adapters: at most `max_loras` distinct ones in its batch, each
    /// load into a slot stalling its steps for `load`.
    pub fn with_lora(self, max_loras: u32, load: Duration) -> Rank {
        self.lock().queue.serve_adapters(max_loras, load);
        self
    }

    /// When the rank's steps may run again after its adapter loads; `None`: never stalled.
    pub fn lora_stall_until(&self) -> Option<Instant> {
        self.lock().queue.stall_until()
    }

    /// The ids of the adapters the rank's batch runs.
    pub fn lora_batch(&self) -> Vec<u32> {
        self.lock().queue.batch()
    }
}

impl Waiting {
    /// With adapters: at most `max_loras` in a batch (at least 1), each load costing `load`.
    pub(super) fn serve_adapters(&mut self, max_loras: u32, load: Duration) {
        self.lora = Some(Slots {
            max_loras: max_loras.max(1) as usize,
            load,
            running: BTreeMap::new(),
            loaded: VecDeque::new(),
            waits: 0,
            loads: 0,
            stall_until: None,
        });
        self.refresh();
    }

    pub(super) fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether a request for `adapter` is set aside now: the batch runs `max_loras` distinct
    /// adapters and not this one. A base-model request never is.
    pub(super) fn set_aside(&self, adapter: Option<u32>) -> bool {
        match (&self.lora, adapter) {
            (Some(s), Some(a)) => s.running.len() >= s.max_loras && !s.running.contains_key(&a),
            _ => false,
        }
    }

    /// Whether the request at `key` may start as far as the queue goes: it is not set aside,
    /// and in order no waiting request ahead of it is one the walk would stop at.
    pub(super) fn turn(&self, key: Key, adapter: Option<u32>, in_order: bool) -> bool {
        !self.set_aside(adapter) && (!in_order || self.head.is_none_or(|h| key <= h))
    }

    pub(super) fn insert(&mut self, key: Key, adapter: Option<u32>) {
        self.queue.insert(key, adapter);
        if !self.set_aside(adapter) && self.head.is_none_or(|h| key < h) {
            self.head = Some(key);
        }
    }

    /// Takes the request at `key` out of the queue; whether it was there.
    pub(super) fn remove(&mut self, key: Key) -> bool {
        let was = self.queue.remove(&key).is_some();
        if was && self.head == Some(key) {
            self.refresh();
        }
        was
    }

    /// Counts a request set aside for want of a slot (once per request: the caller remembers).
    pub(super) fn count_wait(&mut self) {
        if let Some(s) = &mut self.lora {
            s.waits += 1;
        }
    }

    /// A request for `adapter` starts: it joins the batch and, when its adapter is not loaded,
    /// loads it into a slot (evicting the least recently started adapter the batch does not
    /// run) and stalls the rank's steps. Whether it loaded.
    pub(super) fn start(&mut self, adapter: Option<u32>) -> bool {
        let (Some(s), Some(a)) = (&mut self.lora, adapter) else {
            return false;
        };
        let joined = {
            let n = s.running.entry(a).or_insert(0);
            *n += 1;
            *n == 1
        };
        let loaded = match s.loaded.iter().position(|&x| x == a) {
            Some(i) => {
                s.loaded.remove(i);
                false
            }
            None => {
                if s.loaded.len() >= s.max_loras {
                    let running = &s.running;
                    if let Some(i) = s.loaded.iter().position(|x| !running.contains_key(x)) {
                        s.loaded.remove(i);
                    }
                }
                s.loads += 1;
                let now = Instant::now();
                s.stall_until = Some(s.stall_until.map_or(now, |t| t.max(now)) + s.load);
                true
            }
        };
        s.loaded.push_back(a);
        if joined {
            // One adapter more in the batch may set aside the request the walk reached first.
            self.refresh();
        }
        loaded
    }

    /// A request for `adapter` ended.
    pub(super) fn finish(&mut self, adapter: Option<u32>) {
        let (Some(s), Some(a)) = (&mut self.lora, adapter) else {
            return;
        };
        let left = match s.running.get_mut(&a) {
            Some(n) => {
                *n = n.saturating_sub(1);
                *n == 0
            }
            None => false,
        };
        if left {
            s.running.remove(&a);
            self.refresh();
        }
    }

    /// The engine process restarted: its slots hold only what requests still in flight run.
    pub(super) fn restart(&mut self) {
        if let Some(s) = &mut self.lora {
            s.loaded.retain(|a| s.running.contains_key(a));
        }
    }

    /// When the rank's steps may run again after the loads they wait for.
    pub(super) fn stall_until(&self) -> Option<Instant> {
        self.lora.as_ref().and_then(|s| s.stall_until)
    }

    /// The adapters the batch runs, by id.
    pub(super) fn batch(&self) -> Vec<u32> {
        (self.lora.as_ref()).map_or_else(Vec::new, |s| s.running.keys().copied().collect())
    }

    pub(super) fn slot_counts(&self) -> SlotCounts {
        let Some(s) = &self.lora else {
            return SlotCounts::default();
        };
        SlotCounts {
            deferred: self.queue.values().filter(|a| self.set_aside(**a)).count() as u32,
            waits: s.waits,
            loads: s.loads,
        }
    }

    /// Finds the first waiting request the walk would not set aside: O(1) without adapters,
    /// past the requests set aside with them.
    fn refresh(&mut self) {
        self.head = (self.queue.iter())
            .find(|(_, a)| !self.set_aside(**a))
            .map(|(k, _)| *k);
    }
}
