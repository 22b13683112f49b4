//! One simulated DP rank: a KV cache of fixed capacity in tokens and a queue in front of it.
//!
//! A request reserves prompt + max_tokens of KV at admission (so it never has to be preempted),
//! while the KV it reports as used grows from its prompt by one token per decoded token, as a real
//! engine's does. When the reservation does not fit, the request waits: that queueing is what makes
//! a full rank slow, and what a load-aware router is there to avoid.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use tokio::sync::Notify;

#[derive(Debug, Default, Clone, Copy)]
pub struct RankCounts {
    pub reserved: u64,
    pub used: u64,
    pub running: u32,
    pub waiting: u32,
}

#[derive(Debug)]
pub struct Rank {
    pub global: u32,
    pub capacity: u64,
    /// Tokens held by a simulated background tenant (`--preload`): capacity real requests cannot use.
    pub preload: u64,
    counts: Mutex<RankCounts>,
    freed: Notify,
    /// Requests this rank has admitted, ever.
    pub served: AtomicU64,
}

/// A request's hold on its rank's KV; released (and waiters woken) on drop, so a client that goes
/// away mid-stream frees its KV like a real abort does.
#[derive(Debug)]
pub struct Admission<'a> {
    rank: &'a Rank,
    reserved: u64,
    used: u64,
}

impl Rank {
    pub fn new(global: u32, capacity: u64, preload_fraction: f64) -> Rank {
        let preload = (capacity as f64 * preload_fraction.clamp(0.0, 1.0)) as u64;
        Rank {
            global,
            capacity,
            preload,
            counts: Mutex::new(RankCounts::default()),
            freed: Notify::new(),
            served: AtomicU64::new(0),
        }
    }

    pub fn counts(&self) -> RankCounts {
        *self.lock()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RankCounts> {
        // A poisoned lock only means another request panicked mid-update; the counts are still
        // the best numbers there are.
        self.counts.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// KV usage as the engine would report it: background plus what requests really hold.
    pub fn kv_usage(&self) -> f64 {
        let c = self.lock();
        ((self.preload + c.used) as f64 / self.capacity as f64).min(1.0)
    }

    /// Waits until `prompt + max_tokens` fits, then holds it. A request larger than the whole
    /// free capacity is admitted alone, as an engine would rather run it than hang forever.
    pub async fn admit(&self, prompt: u64, max_tokens: u64) -> Admission<'_> {
        let free = self.capacity.saturating_sub(self.preload).max(1);
        let need = (prompt + max_tokens).min(free);
        // Counted as waiting while queued; a request dropped in the queue (its client left)
        // stops counting.
        let mut queued = Queued {
            rank: self,
            on: false,
        };
        loop {
            let notified = self.freed.notified();
            tokio::pin!(notified);
            // Register for wake-ups before checking, so a release between the check and the
            // wait is not missed.
            notified.as_mut().enable();
            {
                let mut c = self.lock();
                if c.reserved + need <= free {
                    c.reserved += need;
                    c.used += prompt.min(need);
                    c.running += 1;
                    if queued.on {
                        c.waiting -= 1;
                        queued.on = false;
                    }
                    self.served.fetch_add(1, Relaxed);
                    return Admission {
                        rank: self,
                        reserved: need,
                        used: prompt.min(need),
                    };
                }
                if !queued.on {
                    c.waiting += 1;
                    queued.on = true;
                }
            }
            notified.await;
        }
    }
}

/// A request's place in a rank's queue.
struct Queued<'a> {
    rank: &'a Rank,
    on: bool,
}

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        if self.on {
            self.rank.lock().waiting -= 1;
        }
    }
}

impl Admission<'_> {
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
        }
        self.rank.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn queues_when_full_and_resumes_on_release() {
        let rank = Rank::new(0, 100, 0.5);
        let mut a = rank.admit(20, 20).await;
        a.grow();
        assert_eq!(rank.counts().used, 21);
        assert!((rank.kv_usage() - 0.71).abs() < 1e-9);
        let second = rank.admit(20, 20);
        tokio::pin!(second);
        // 40 + 40 > 50 free: the second request must wait.
        assert!(futures_poll_once(second.as_mut()).await.is_none());
        assert_eq!(rank.counts().waiting, 1);
        drop(a);
        let b = second.await;
        assert_eq!(rank.counts().waiting, 0);
        assert_eq!(rank.counts().running, 1);
        drop(b);
        assert_eq!(rank.counts().reserved, 0);
    }

    #[tokio::test]
    async fn a_request_dropped_in_the_queue_stops_waiting() {
        let rank = Rank::new(0, 100, 0.0);
        let held = rank.admit(50, 50).await;
        let mut queued = Box::pin(rank.admit(10, 10));
        assert!(futures_poll_once(queued.as_mut()).await.is_none());
        assert_eq!(rank.counts().waiting, 1);
        // Its client left: the future is dropped while queued.
        drop(queued);
        assert_eq!(rank.counts().waiting, 0);
        drop(held);
    }

    async fn futures_poll_once<F: std::future::Future + Unpin>(f: F) -> Option<F::Output> {
        tokio::select! {
            biased;
            out = f => Some(out),
            _ = std::future::ready(()) => None,
        }
    }
}
